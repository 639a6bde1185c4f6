"""The checkpoint package's seams: pure chain planning, and imports that cross no private names and form no cycle."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from raydl.checkpoint.chain import chain_sources
from raydl.checkpoint.ref import CheckpointRef

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)


def _ref(holder: str) -> CheckpointRef:
    return CheckpointRef(key="k" * 32, size=8, chunk_size=4, checksums=(1, 2), header="{}", holder=holder)


def test_chain_reads_upstream_first_then_publisher_then_earlier_holders():
    """Peer i reads from peer i-1, falling back to the publisher, then to peers i-2, i-3, ..."""
    pub, peers = _ref("pub"), [_ref(f"p{i}") for i in range(4)]
    got = [[s.holder for s in sources] for sources in chain_sources(pub, peers)]
    assert got == [["pub"], ["p0", "pub"], ["p1", "pub", "p0"], ["p2", "pub", "p1", "p0"]]
    assert chain_sources(pub, []) == []


def test_peer_actor_imports_no_private_checkpoint_names():
    """actors/peer.py (the checkpoint peer actor) imports only public names from raydl.checkpoint's modules."""
    tree = ast.parse((ROOT / "raydl/actors/peer.py").read_text())
    crossing = [(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("raydl.checkpoint") for alias in node.names
                if alias.name.startswith("_")]
    assert crossing == []


@pytest.mark.parametrize("first", ["raydl.actors.peer", "raydl.checkpoint", "raydl.checkpoint.fabric"])
def test_modules_import_in_any_order(first):
    """Each module imports first in a fresh interpreter (no import cycle), and the README API is there."""
    code = (f"import {first}\nfrom raydl import checkpoint\n"
            "assert all(callable(getattr(checkpoint, n)) for n in "
            "('publish', 'fetch', 'broadcast', 'unpublish', 'peer_actor', 'prepare'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr[-2000:]
