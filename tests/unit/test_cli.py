"""The raydl command line: every sub-command is wired and answers --help; fabric-info reports providers."""
from __future__ import annotations

import pytest

from raydl.cli import main

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("argv", [["demo", "--help"], ["make-images", "--help"], ["bench", "loader", "--help"],
                                  ["bench", "checkpoint", "--help"], ["bench", "storage", "--help"],
                                  ["fabric-info", "--help"]])
def test_subcommands_answer_help(argv, capsys):
    """Each sub-command exists and prints its usage."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    assert "usage: raydl" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, says",
    [
        (["demo", "--set", "loader.batch_size=8"], "--set changes values of a config file"),
        (["demo", "--config", "configs/local-demo.yaml", "--batch-size", "8"], "--set loader.batch_size=N"),
    ],
)
def test_demo_refuses_flags_it_would_ignore(argv, says, capsys):
    """--set without --config, or --batch-size beside --config, is a usage error, before anything runs."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert says in capsys.readouterr().err


def test_make_images_from_photos_and_without_them(tmp_path, capsys):
    """make-images writes DIR/cNNN/*.jpg + labels.csv, the same bytes for the same arguments; without photos it
    falls back to generated sources and says so."""
    from raydl.bench.make_images import DEFAULT_PHOTOS

    photos = DEFAULT_PHOTOS if DEFAULT_PHOTOS.is_dir() else tmp_path / "none"
    for out in ("a", "b"):
        assert main(["make-images", str(tmp_path / out), "--n", "6", "--classes", "2", "--photos", str(photos)]) == 0
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.jpg"))
    assert [str(f) for f in files][:2] == ["c000/0000000.jpg", "c000/0000002.jpg"] and len(files) == 6
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)
    assert (tmp_path / "a" / "labels.csv").read_text().splitlines()[:2] == ["path,label", "c000/0000000.jpg,0"]
    capsys.readouterr()
    assert main(["make-images", str(tmp_path / "gen"), "--n", "2", "--photos", str(tmp_path / "none")]) == 0
    assert "no photos" in capsys.readouterr().out and len(list((tmp_path / "gen").rglob("*.jpg"))) == 2


def test_fabric_info_lists_every_known_provider(capsys):
    """fabric-info prints, for each provider raydl knows, whether it fits (exit 0 only if one does)."""
    from raydl.native import pyfi

    code = main(["fabric-info"])
    out = capsys.readouterr().out
    for provider in ("efa", "verbs;ofi_rxm", "tcp;ofi_rxm", "sockets"):
        assert provider in out or not pyfi.available()
    assert code == (0 if pyfi.available() else 1)


def test_cache_info_and_clear(tmp_path, capsys):
    """`raydl cache info PATH` shows a node cache's entries, bytes and max_bytes; `clear` empties it (and keeps
    the max_bytes the loaders recorded); a folder that is no cache is exit 2."""
    from raydl.storage.cache import NodeCache

    cache = NodeCache(str(tmp_path / "c"), 1 << 20)
    for i in range(3):
        cache.put(f"s3://b/k{i}", "e", 0, 100, b"x" * 100)
    assert main(["cache", "info", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "entries     3" in out and "max_bytes   1,048,576" in out and "oldest use  20" in out
    assert main(["cache", "clear", str(tmp_path / "c")]) == 0
    assert "removed 3 entries" in capsys.readouterr().out
    assert main(["cache", "info", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "entries     0" in out and "max_bytes   1,048,576" in out
    assert main(["cache", "info", str(tmp_path)]) == 2
