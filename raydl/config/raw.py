"""A config file's parsed YAML before the schema reads it: `${VAR}` expansion from the environment, the
command line's `--set section.key=value` overrides, and the bound on a config's size. Every error names the
file (and the --set item).

YAML aliases (`*name`) make a parsed config a graph whose parts may be shared: a few hundred bytes of
nested aliases stand for billions of values. So the expansion visits each mapping and list once, however
many paths lead to it (the result shares them as the YAML did); an override copies only the mappings and
lists on its own path; and `check_size` refuses a config that holds more than MAX_CONFIG_VALUES values with
its aliases written out, before the schema reads it path by path.
"""

from __future__ import annotations

import re
from typing import Any

from raydl.env import environment_variable

__all__ = ["MAX_CONFIG_VALUES", "apply_override", "check_size", "expand", "load_yaml", "parse_override"]

#: the most values (mappings, lists and scalars) a config may hold with its YAML aliases written out; the
#: configs under configs/ hold under a hundred
MAX_CONFIG_VALUES = 1_000_000
MAX_DEFAULT_DEPTH = 32  # ${A:-${B:-...}}: defaults inside defaults, at most this deep

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)")
_BRACES = re.compile(r"\$\{|\}")


def _closings(text: str) -> dict[int, int]:
    """The index of the "}" that closes each "${" of `text` (nested "${...}" inside), for those closed: one
    pass over the string, however many "${" it holds."""
    closes, open_at = {}, []
    for m in _BRACES.finditer(text):
        if m.group() == "${":
            open_at.append(m.start())
        elif open_at:
            closes[open_at.pop()] = m.start()
    return closes


def _substitute(
    text: str, path: str, lo: int = 0, hi: int | None = None, closes: dict | None = None, depth: int = 0
) -> str:
    """`${VAR}` and `${VAR:-default}` in text[lo:hi]; a default may name variables itself, and is read only
    when VAR is unset (`${RAYDL_DEMO_DIR:-${HOME}/.cache/raydl}`), up to MAX_DEFAULT_DEPTH defaults deep.
    Anything else is left as written."""
    if depth > MAX_DEFAULT_DEPTH:
        raise ValueError(f"{path}: ${{VAR:-default}} defaults nested more than {MAX_DEFAULT_DEPTH} deep")
    hi = len(text) if hi is None else hi
    closes = _closings(text) if closes is None else closes
    out, i = [], lo
    while (m := _ENV.search(text, i, hi)) is not None:
        close = closes.get(m.start(), -1)
        if close < 0 or close >= hi or (close > m.end() and not text.startswith(":-", m.end(), close)):
            out.append(text[i : m.end()])
            i = m.end()
            continue
        got = environment_variable(m.group(1))
        if got is None and close == m.end():
            raise ValueError(
                f"{path}: ${{{m.group(1)}}} is not set (write ${{{m.group(1)}:-default}} for a default)"
            )
        out += [
            text[i : m.start()],
            got if got is not None else _substitute(text, path, m.end() + 2, close, closes, depth + 1),
        ]
        i = close + 1
    return "".join(out) + text[i:hi]


def expand(value: object, path: str) -> object:
    """`${VAR}` and `${VAR:-default}` in string values, from the environment (e.g. a data root per
    cluster). The mappings and lists are new; each is built once, and shared where the YAML shared it."""
    done: dict[int, object] = {}

    def walk(v: object) -> object:
        if isinstance(v, dict | list):
            got = done.get(id(v))
            if got is None:
                if isinstance(v, dict):
                    got = done[id(v)] = {}
                    for k, x in v.items():
                        got[k] = walk(x)
                else:
                    got = done[id(v)] = []
                    for x in v:
                        got.append(walk(x))
            return got
        if isinstance(v, str) and "${" in v:
            return _substitute(v, path)
        return v

    return walk(value)


def check_size(data: object, path: str, limit: int = MAX_CONFIG_VALUES) -> None:
    """A ValueError naming the file when `data` holds more than `limit` values with its YAML aliases written
    out, or holds itself. Counted over the shared graph, each mapping and list once."""
    sizes: dict[int, int] = {}
    active: set[int] = set()
    stack: list[tuple[object, bool]] = [(data, False)]
    while stack:
        node, after = stack.pop()
        key = id(node)
        kids = list(node.values()) if isinstance(node, dict) else node
        if after:
            active.discard(key)
            size = 1 + sum(sizes[id(k)] if isinstance(k, dict | list) else 1 for k in kids)
            if size > limit:
                raise ValueError(
                    f"{path}: with its YAML aliases written out the config holds more than {limit:,} values, "
                    "the most a config may hold; write it without nested aliases"
                )
            sizes[key] = size
            continue
        if key in sizes:
            continue
        if key in active:
            raise ValueError(
                f"{path}: a YAML alias makes the config contain itself; write it without that alias"
            )
        active.add(key)
        stack.append((node, True))
        stack += [(k, False) for k in kids if isinstance(k, dict | list) and id(k) not in sizes]


def load_yaml(source, where: str) -> object:
    """yaml.safe_load of `source` (text or an open file); a ValueError naming `where` when it is not YAML or
    is nested past what the parser follows."""
    import yaml

    try:
        return yaml.safe_load(source)
    except yaml.YAMLError as exc:
        raise ValueError(f"{where}: not valid YAML: {exc}") from exc
    except RecursionError as exc:
        raise ValueError(
            f"{where}: nested too deeply for a config (mappings and lists in each other)"
        ) from exc


def parse_override(item: str) -> tuple[list[str], object]:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set takes section.key=value (e.g. loader.batch_size=128), got {item[:200]!r}")
    return key.strip().split("."), load_yaml(raw, f"--set {key.strip()[:200]}")


def apply_override(data: dict, parts: list[str], value: object, path: str, item: str) -> None:
    """Set data[parts[0]][parts[1]]... = value; a pipeline stage is named by its method or its index. The
    mappings and lists on the way are copied first: another path that shares one (a YAML alias) keeps its
    value."""
    node: Any = data
    for depth, part in enumerate(parts[:-1]):
        if isinstance(node, list):  # a pipeline: `part` names a stage, the next part one of its arguments
            i = _stage_index(node, part, path, item)
            node[i] = {node[i]: {}} if isinstance(node[i], str) else _own(node[i])
            if not isinstance(node[i], dict) or len(node[i]) != 1:
                raise ValueError(f"{path}: --set {item}: pipeline stage {part!r} is not a one-key mapping")
            name = next(iter(node[i]))
            node[i][name] = {} if node[i][name] is None else _own(node[i][name])
            node = node[i][name]
        elif isinstance(node, dict):
            node[part] = {} if node.get(part) is None else _own(node[part])
            node = node[part]
        else:
            raise ValueError(f"{path}: --set {item}: `{'.'.join(parts[:depth])}` is not a section")
    if isinstance(node, list):
        node[_stage_index(node, parts[-1], path, item)] = value
    elif isinstance(node, dict):
        node[parts[-1]] = value
    else:
        raise ValueError(f"{path}: --set {item}: `{'.'.join(parts[:-1])}` is not a section")


def _own(value: object) -> object:
    """A shallow copy of a mapping or list (anything else as it is)."""
    if isinstance(value, dict):
        return dict(value)
    return list(value) if isinstance(value, list) else value


def _stage_index(stages: list, part: str, path: str, item: str) -> int:
    if part.isascii() and part.isdigit() and len(part) < 10 and int(part) < len(stages):
        return int(part)
    for i, st in enumerate(stages):
        if st == part or (isinstance(st, dict) and part in st):
            return i
    raise ValueError(f"{path}: --set {item}: no pipeline stage `{part}`")
