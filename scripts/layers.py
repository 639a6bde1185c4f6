#!/usr/bin/env python3
"""The import graph of the raydl package, and how it stacks into floors.

    python3 scripts/layers.py              # from the repository root: the counts
    python3 scripts/layers.py --floors     # and each floor's modules

Every raydl import counts, at the top of a module, inside a function (a lazy
import is still a dependency) or under `if TYPE_CHECKING:` (a type-only import
is a dependency too: the module cannot be read without the other);
`--no-type-only` leaves those out, to compare. A
package's __init__.py counts as the package, and a module's import of its own
package (from inside it) is left out. A module's floor is 0 when it
imports nothing of raydl, else one above the highest floor it imports; the
modules of an import circle share one floor, and an arrow "runs back up" when
it goes to a module on the same floor or higher, which only an arrow inside a
circle does. tests/unit/test_layers.py checks the package against its declared
layers with the same graph.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_name(package_dir: Path, path: Path) -> str:
    parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    return skip


def _targets(node: ast.AST, module: str, is_package: bool, known: set[str]) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names if a.name in known)
    elif isinstance(node, ast.ImportFrom):
        target = node.module or ""
        if node.level:
            base = (module if is_package else module.rpartition(".")[0]).split(".")
            target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
        for alias in node.names:
            sub = f"{target}.{alias.name}"
            if sub in known:
                yield sub
            elif target in known:
                yield target


def import_graph(package_dir: Path, *, type_only: bool = True) -> dict[str, set[str]]:
    """module -> the package's modules it imports (lazy and, unless `type_only` is False, TYPE_CHECKING
    ones included)."""
    files = {module_name(package_dir, p): p for p in sorted(package_dir.rglob("*.py"))}
    known = set(files)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_nodes(tree) if not type_only else set()
        is_package = path.name == "__init__.py"
        graph[module] = {
            t
            for node in ast.walk(tree)
            if id(node) not in skip
            for t in _targets(node, module, is_package, known)
            if t != module and not module.startswith(t + ".")  # a package's own modules, inside it
        }
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each module's floor: 0 when it imports nothing of the package, else one above the highest floor it
    imports; a circle's modules share a floor."""
    group = {m: m for m in graph}
    for component in circles(graph):
        for m in component:
            group[m] = component[0]
    down: dict[str, set[str]] = {g: set() for g in group.values()}
    for m, targets in graph.items():
        down[group[m]].update(group[t] for t in targets if group[t] != group[m])
    floor: dict[str, int] = {}

    def visit(g: str) -> int:
        if g not in floor:
            floor[g] = 0  # a placeholder: the condensation has no cycle
            floor[g] = 1 + max((visit(t) for t in down[g]), default=-1)
        return floor[g]

    sys.setrecursionlimit(10_000)
    return {m: visit(group[m]) for m in graph}


def _type_only_imports(package_dir: Path) -> Iterator[str]:
    """The modules that import something of the package under `if TYPE_CHECKING:` (one per import)."""
    files = {module_name(package_dir, p): p for p in sorted(package_dir.rglob("*.py"))}
    known = set(files)
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            is_package = path.name == "__init__.py"
            if id(node) in skip and any(True for _ in _targets(node, module, is_package, known)):
                yield module


def longest_function(package_dir: Path) -> tuple[int, str]:
    """(lines, "module:function") of the longest function or method in the package."""
    best = (0, "")
    for path in sorted(package_dir.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                best = max(best, (length, f"{module_name(package_dir, path)}:{node.name}"))
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", default=str(ROOT / "raydl"), help="the package folder (default: raydl/)")
    parser.add_argument("--floors", action="store_true", help="also list each floor's modules")
    parser.add_argument(
        "--no-type-only", action="store_true", help="leave out imports under `if TYPE_CHECKING:` (to compare)"
    )
    args = parser.parse_args(argv)
    package_dir = Path(args.package)
    graph = import_graph(package_dir, type_only=not args.no_type_only)
    floor = floors(graph)
    arrows = [(m, t) for m, targets in graph.items() for t in targets]
    up = [(m, t) for m, t in arrows if floor[t] >= floor[m]]
    found = circles(graph)
    lines, where = longest_function(package_dir)
    type_only = sum(1 for _ in _type_only_imports(package_dir))
    print(f"modules (rooms): {len(graph)}")
    print(f"floors: {max(floor.values()) + 1}")
    print(f"import arrows: {len(arrows)}, running back up: {len(up)}")
    print(f"import circles: {len(found)}" + "".join(f"\n  {len(c)} modules: {', '.join(c)}" for c in found))
    left_out = " (left out)" if args.no_type_only else ""
    print(f"type-only imports (under TYPE_CHECKING): {type_only}{left_out}")
    print(f"longest function: {lines} lines ({where})")
    if args.floors:
        for level in range(max(floor.values()) + 1):
            print(f"floor {level}: {', '.join(sorted(m for m in graph if floor[m] == level))}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
