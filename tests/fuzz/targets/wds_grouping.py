"""WebDataset grouping (raydl.sources.webdataset.group_samples, base_plus_ext) on member-name lists derived
from the bytes (one name per line), checked against the webdataset library's own group_by_keys."""

from __future__ import annotations

import re

from webdataset.tariterators import group_by_keys  # at import: its first import is slow, not an input's time

import raydl.errors
from raydl.sources.webdataset import base_plus_ext, group_samples

ALLOWED = (raydl.errors.RaydlError,)
# The floor of a run (harness.py); measured in 20 s runs on a loaded 2-core machine: 4,940-11,600 inputs, every one accepted
MIN_INPUTS, MIN_ACCEPTED = 2000, 1000
URI = "fuzz.tar"
# the library's own member filter (webdataset.tariterators.tar_file_iterator: meta_prefix/meta_suffix "__",
# skip_meta), applied to its input as the library applies it while reading the tar
_SKIP_META = r"__[^/]*__($|/)"
# suffixes the library keeps in a sample dict of its own: a member with one is a "duplicate" there
_LIBRARY_KEYS = {"__key__", "__url__", "__local_path__"}


def seeds() -> list[bytes]:
    names = [
        "a.b.c.jpg\na.b.c.cls\ndir.x/img.JPG\ndir.x/img.Cls\nREADME\n__meta__\n__index__/x.jpg\n./dotslash.png",
        "k1.jpg\nk2.jpg\nk1.cls\nempty.jpg\nempty.cls\nonlylabel.cls\nwith space.jpg\nwith space.json",
        "s000.jpg\ns000.txt\ns000.json\ns001.jpg\ns001.txt\ns001.json\ns002.jpg\ns002.JPG",
        "ü/näme.webp\nü/näme.cls\n.hidden.jpg\na/.b.jpg\na/b.\n.\n..\n/\n/x.y\nx/\nx/.y.z",
    ]
    return [n.encode() for n in names]


def _library(names: list[str]):
    files = [
        {"fname": n, "data": i, "__url__": URI}
        for i, n in enumerate(names)
        if not ("/" not in n and n.startswith("__") and n.endswith("__")) and not re.match(_SKIP_META, n)
    ]
    return [{k: v for k, v in s.items() if k != "__url__"} for s in group_by_keys(iter(files))]


def run_one(data: bytes) -> None:
    names = data.decode("utf-8", "surrogateescape").split("\n")
    for n in names:
        key, field = base_plus_ext(n)
        assert (key is None) == (field is None)
        if key is not None:
            assert f"{key}.{field}" == n and "/" not in field
    if any((base_plus_ext(n)[1] or "").lower() in _LIBRARY_KEYS for n in names):
        return  # the library confuses these with its own keys; raydl does not
    try:
        ours = [{"__key__": s.key, **s.fields} for s in group_samples(names, URI)]
    except raydl.errors.DataSourceError:
        ours = None
    try:
        theirs = _library(names)
    except ValueError:  # the library's "duplicate file name in tar file"
        theirs = None
    assert ours == theirs, (names, ours, theirs)
