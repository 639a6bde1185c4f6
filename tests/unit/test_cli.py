"""The raydl command line: every sub-command is wired and answers --help; fabric-info reports providers."""
from __future__ import annotations

import pytest

from raydl.cli import main

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("argv", [["demo", "--help"], ["bench", "loader", "--help"],
                                  ["bench", "checkpoint", "--help"], ["fabric-info", "--help"]])
def test_subcommands_answer_help(argv, capsys):
    """Each sub-command exists and prints its usage."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    assert "usage: raydl" in capsys.readouterr().out


def test_fabric_info_lists_every_known_provider(capsys):
    """fabric-info prints, for each provider raydl knows, whether it fits (exit 0 only if one does)."""
    from raydl.native import pyfi

    code = main(["fabric-info"])
    out = capsys.readouterr().out
    for provider in ("efa", "verbs;ofi_rxm", "tcp;ofi_rxm", "sockets"):
        assert provider in out or not pyfi.available()
    assert code == (0 if pyfi.available() else 1)
