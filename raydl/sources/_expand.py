"""Shard patterns to the objects they name: brace patterns, globs (* ? [ **) and lists, local or s3://.

A pattern's braces are expanded first (raydl/sources/_braces.py), then each
URL is itself where it exists as written, else a glob with one meaning on
local disk and S3 (raydl/sources/_patterns.py). A path with no pattern in it
(no braces, no `* ? [`) that is not there is a DataSourceError saying it does
not exist, as for every other source; a pattern that matches nothing is a
ValueError, the argument's fault. On an object store the sizes
and etags come from LIST pages, each prefix listed once (`Listing`): a list of
URLs lists each folder's common prefix once, never a HEAD per object. Both
read_webdataset and read_parquet name their files this way.
"""

from __future__ import annotations

import logging
import os

from raydl.errors import DataSourceError
from raydl.sources._braces import expand_braces
from raydl.sources._patterns import has_magic, local_glob, path_regex, static_prefix
from raydl.storage import ObjectInfo, split_scheme
from raydl.storage.base import check_text_path

__all__ = ["Listing", "expand", "expand_urls", "is_plain", "stem"]

logger = logging.getLogger("raydl.sources")


def is_plain(url: str) -> bool:
    """Whether `url` is a path with no pattern in it: no braces (well formed or not), no glob character."""
    return not has_magic(url) and "{" not in url and "}" not in url


def stem(uri: str) -> str:
    """The URI without its extensions (shard-0001.tar.gz -> shard-0001): its DALI index is stem + .idx."""
    slash = uri.rfind("/") + 1
    dot = uri.find(".", slash)
    return uri if dot < 0 else uri[:dot]


class Listing:
    """The objects LIST pages showed, by URI: each prefix listed once (S3), files stat'ed (local)."""

    def __init__(self, storage_of) -> None:
        self.storage_of = storage_of
        self.seen: dict[str, ObjectInfo] = {}
        self._listed: set[str] = set()

    def list_prefix(self, prefix: str) -> list[ObjectInfo]:
        covered = any(prefix.startswith(p) for p in self._listed)
        if not covered:
            for o in self.storage_of(prefix).list(prefix):
                self.seen[o.uri] = o
            self._listed.add(prefix)
        return sorted((o for u, o in self.seen.items() if u.startswith(prefix)), key=lambda o: o.uri)

    def prefetch(self, urls: list[str]) -> None:
        """List the common prefix of `urls` (and of their stems, so NAME.idx shows), one LIST per folder."""
        by_folder: dict[str, list[str]] = {}
        for u in urls:
            by_folder.setdefault(u[: u.rfind("/") + 1], []).append(u)
        for folder, group in by_folder.items():
            prefix = os.path.commonprefix(group + [stem(u) for u in group])
            if len(prefix) < len(folder):
                prefix = folder
            self.list_prefix(prefix)

    def get(self, uri: str) -> ObjectInfo | None:
        scheme, _ = split_scheme(uri)
        if scheme == "file":
            return self.storage_of(uri).stat(uri) if os.path.isfile(uri) else None
        return self.seen.get(uri)

    def exists(self, uri: str) -> bool:
        scheme, _ = split_scheme(uri)
        return os.path.isfile(uri) if scheme == "file" else uri in self.seen


def expand_urls(urls: str | list[str] | tuple[str, ...], storage_of) -> list[ObjectInfo]:
    """Brace patterns, globs (* ? [ **) and lists, local or s3://, to the shards they name, in order.

    Globs mean the same on local disk and S3 (raydl/sources/_patterns.py); a
    name that exists as written is itself, before it is read as a glob. A
    pattern that matches nothing is a ValueError naming it; so is a malformed
    brace pattern. A path with no pattern in it that is not there is a
    DataSourceError: '...' does not exist. `storage_of(url)` gives the storage of a URL. On S3 the
    sizes and etags come from LIST pages (never a HEAD per object).
    """
    return expand(urls, Listing(storage_of))


def expand(urls, listing: Listing) -> list[ObjectInfo]:
    """`expand_urls` through `listing`, whose LIST pages a caller goes on using (for the shards' indexes)."""
    patterns = [urls] if isinstance(urls, str) else list(urls)
    if not patterns or not all(isinstance(u, str) and u for u in patterns):
        raise ValueError(f"urls must be a non-empty str or a non-empty list of str, got {urls!r}")
    expanded = [(p, expand_braces(p)) for p in patterns]
    remote = [u for _, us in expanded for u in us if split_scheme(u)[0] != "file" and not has_magic(u)]
    for u in remote:
        listing.storage_of(u)  # a ValueError naming an unknown scheme, before anything is listed
    listing.prefetch(remote)
    out: list[ObjectInfo] = []
    for pattern, candidates in expanded:
        found: list[ObjectInfo] = []
        missing: list[str] = []  # shards a brace pattern names one by one, not there
        for url in candidates:
            got = _objects_of(url, listing)
            if not got and is_plain(url):
                missing.append(url)
            for o in got:
                check_text_path(o.uri, "shard")
            found += got
        if found and missing:  # some of the shards it names are there: the others are left out, not silently
            logger.warning(
                "raydl: %d of the shards %r names do not exist (the first: %r); listing the %d that do",
                len(missing),
                pattern,
                missing[0],
                len(found),
            )
        if not found and is_plain(pattern):
            raise DataSourceError(f"{pattern!r} does not exist", uri=pattern)
        if not found:
            raise ValueError(f"the shard pattern {pattern!r} matches nothing")
        out += found
    return out


def _objects_of(url: str, listing: Listing) -> list[ObjectInfo]:
    """The objects one brace-expanded URL names: itself where it exists as written, else its glob's
    matches (from the LIST pages of its static prefix, or the local disk)."""
    storage = listing.storage_of(url)
    scheme, _ = split_scheme(url)
    literal = listing.get(url) if scheme == "file" or not has_magic(url) else None
    if literal is None and has_magic(url) and scheme != "file":
        listed = listing.list_prefix(static_prefix(url))
        literal = next((o for o in listed if o.uri == url), None)
        if literal is None:
            rx = path_regex(url)
            return [o for o in listed if rx.fullmatch(o.uri)]
    if literal is not None:
        return [literal]
    if has_magic(url):
        return [storage.stat(p) for p in local_glob(url)]
    if scheme == "file" and os.path.isdir(url):
        raise DataSourceError(
            f"{url!r} is a folder, not a shard: name its shards, e.g. {os.path.join(url, '*.tar')!r} or a "
            "brace pattern",
            uri=url,
        )
    if scheme == "file" and os.path.exists(url):
        return [storage.stat(url)]  # not a file: its error says what it is
    return []
