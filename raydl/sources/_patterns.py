"""Glob patterns for shard and file URLs: one meaning on local disk and on S3.

    *        any characters within one path segment (never a '/')
    ?        one character other than '/'
    [abc]    one of the characters (ranges a-z, negation [!a]); never a '/'
    **       a whole segment: any number of folders, none included ('a/**/x.tar'
             matches 'a/x.tar' and 'a/b/c/x.tar'); last, every file below

Names starting with a dot match as any other (S3 has no hidden keys).
Local `**` does not descend into links to folders (a link loop cannot make
it endless). A name is a pattern only if it holds one of `* ? [`, and a name
that exists exactly as written is that file or object, before it is read as
a pattern (a shard named `shard[1].tar` is itself).
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterator

__all__ = ["has_magic", "local_glob", "path_regex", "static_prefix"]

_MAGIC = re.compile(r"[*?\[]")


def has_magic(s: str) -> bool:
    return _MAGIC.search(s) is not None


def _compile(rx: str) -> re.Pattern[str]:
    with warnings.catch_warnings():  # '--' in a class: Python warns of future set syntax, and means a range
        warnings.simplefilter("ignore", FutureWarning)
        return re.compile(rx, re.DOTALL)


def _segment(seg: str) -> str:
    """The regex of one segment (no '/' in it); '**' within a segment is '*'."""
    out, i = [], 0
    while i < len(seg):
        c = seg[i]
        i += 1
        if c == "*":
            while i < len(seg) and seg[i] == "*":
                i += 1
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = i + (i < len(seg) and seg[i] == "!")
            j += j < len(seg) and seg[j] == "]"  # a ']' first is literal, as in fnmatch
            j = seg.find("]", j)
            if j < 0:
                out.append(r"\[")  # no closing bracket: a literal '['
                continue
            body = seg[i:j]
            negate = body.startswith("!")
            body = re.sub(r"([\\^\[\]&~|])", r"\\\1", body[1:] if negate else body)
            cls = f"[^/{body}]" if negate else f"(?!/)[{body}]"
            try:
                _compile(cls)
            except re.error:  # a reversed range ([z-a]): the '[' is literal, as when never closed
                out.append(r"\[")
                continue
            out.append(cls)
            i = j + 1
        else:
            out.append(re.escape(c))
    return "".join(out)


def path_regex(pattern: str) -> re.Pattern[str]:
    """The whole-string regex of `pattern` (see the module docstring)."""
    segs = pattern.split("/")
    parts = []
    for k, seg in enumerate(segs):
        last = k == len(segs) - 1
        if seg == "**":
            parts.append(".*" if last else "(?:[^/]+/)*")
        else:
            parts.append(_segment(seg) + ("" if last else "/"))
    return _compile("".join(parts))


def static_prefix(pattern: str) -> str:
    """The pattern up to its first magic character: every match starts with it (an S3 list prefix)."""
    m = _MAGIC.search(pattern)
    return pattern if m is None else pattern[: m.start()]


def local_glob(pattern: str) -> list[str]:
    """The regular files (links followed) that `pattern` matches on local disk, sorted."""
    segs = pattern.split("/")
    k = 0
    while k < len(segs) - 1 and not has_magic(segs[k]):
        k += 1
    head = "/".join(segs[:k])
    if k == 0:
        base = ""
    elif head == "":
        base = "/"  # an absolute pattern: '/' + the rest
    else:
        base = head + "/"
    return sorted(_walk(base, segs[k:]))


def _listdir(d: str) -> list[os.DirEntry]:
    try:
        with os.scandir(d or ".") as it:
            return list(it)
    except OSError:
        return []  # not a folder, gone, or unreadable: nothing below it matches


def _walk(base: str, segs: list[str]) -> Iterator[str]:
    """Files `base + <what segs match>`; `base` is "" or ends with '/'."""
    seg, rest = segs[0], segs[1:]
    if seg == "**":
        if not rest:  # every file below
            for e in _listdir(base):
                path = base + e.name
                if e.is_dir(follow_symlinks=False):
                    yield from _walk(path + "/", segs)
                elif os.path.isfile(path):
                    yield path
            return
        yield from _walk(base, rest)
        for e in _listdir(base):
            if e.is_dir(follow_symlinks=False):
                yield from _walk(base + e.name + "/", segs)
        return
    if not has_magic(seg):
        names = [seg]
    else:
        rx = _compile(_segment(seg))
        names = [e.name for e in _listdir(base) if rx.fullmatch(e.name)]
    for name in names:
        path = base + name
        if rest:
            if os.path.isdir(path):
                yield from _walk(path + "/", rest)
        elif os.path.isfile(path):
            yield path
