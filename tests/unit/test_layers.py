"""The package's floors: every import runs down (or stays on its floor), and no import circle exists, type-only
imports (under TYPE_CHECKING) counted as the dependencies they are."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)

_spec = importlib.util.spec_from_file_location("layers", ROOT / "scripts" / "layers.py")
layers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layers)

# Bottom to top, as raydl/README.md draws them. A module belongs to the first entry its name starts with.
FLOORS = [
    ["raydl.errors"],
    ["raydl.options", "raydl.env", "raydl.util"],
    ["raydl.storage", "raydl.native"],
    ["raydl.describe", "raydl.checkpoint"],
    ["raydl.sources"],
    ["raydl.plan"],
    ["raydl.batch"],
    ["raydl.actors"],
    ["raydl.consume"],
    ["raydl.execute"],
    ["raydl.dataset"],
    ["raydl.config"],
    ["raydl.demo", "raydl.cli", "raydl.bench", "raydl"],
]
# Packages whose __init__ is a public face on the top floor (it re-exports names from floors above its own
# modules': raydl.checkpoint.peer_actor is the checkpoint peer actor's).
FACES = {"raydl", "raydl.checkpoint"}


def floor_of(module: str) -> int:
    if module in FACES:
        return len(FLOORS) - 1
    for level, prefixes in enumerate(FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes if p != "raydl"):
            return level
    raise AssertionError(f"{module} is on no floor: add it to FLOORS (and raydl/README.md)")


GRAPH = layers.import_graph(ROOT / "raydl")


def test_every_import_runs_down_or_stays_on_its_floor():
    """No module imports (lazily or not) from a floor above its own."""
    up = [f"{m} (floor {floor_of(m)}) imports {t} (floor {floor_of(t)})"
          for m, targets in sorted(GRAPH.items()) for t in sorted(targets) if floor_of(t) > floor_of(m)]
    assert up == []


def test_options_env_and_errors_import_nothing_above_errors():
    """The bottom floors stand alone: options, env and errors import no raydl module but errors."""
    for module in ("raydl.options", "raydl.env", "raydl.errors"):
        assert GRAPH[module] <= {"raydl.errors"}, (module, GRAPH[module])


def test_no_import_circle():
    """The import graph has no circle, lazy and type-only (TYPE_CHECKING) imports included."""
    assert layers.circles(GRAPH) == []


def test_the_graph_sees_lazy_and_type_only_imports_and_circles(tmp_path):
    """The checker is not vacuous: a lazy import counts, a TYPE_CHECKING one counts too, a loop is a circle."""
    assert "raydl.dataset" in GRAPH["raydl.config"]  # imported inside functions only
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.a import A\n")
    graph = layers.import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"}
    assert layers.circles(graph) == [["pkg.a", "pkg.b"]]
    assert layers.import_graph(pkg, type_only=False)["pkg.a"] == set()
    assert layers.circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    floors = layers.floors({"a": {"b"}, "b": set(), "c": {"a", "b"}})
    assert floors == {"b": 0, "a": 1, "c": 2}
