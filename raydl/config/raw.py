"""A config file's parsed YAML before the schema reads it: `${VAR}` expansion from the environment, and
the command line's `--set section.key=value` overrides. Every error names the file (and the --set item).
"""

from __future__ import annotations

import re
from typing import Any

from raydl.env import environment_variable

__all__ = ["apply_override", "expand", "parse_override"]


_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)")


def _closing(text: str, start: int) -> int:
    """Index of the "}" that closes a "${" whose body starts at `start` (nested "${...}" inside), or -1."""
    depth = 1
    for i in range(start, len(text)):
        if text.startswith("${", i):
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return -1


def _substitute(text: str, path: str) -> str:
    """`${VAR}` and `${VAR:-default}` in one string; a default may name variables itself, and is read only
    when VAR is unset (`${RAYDL_DEMO_DIR:-${HOME}/.cache/raydl}`). Anything else is left as written."""
    out, i = [], 0
    while (m := _ENV.search(text, i)) is not None:
        close = _closing(text, m.end())
        body = text[m.end() : close]
        if close < 0 or body and not body.startswith(":-"):
            out.append(text[i : m.end()])
            i = m.end()
            continue
        got = environment_variable(m.group(1))
        if got is None and not body:
            raise ValueError(
                f"{path}: ${{{m.group(1)}}} is not set (write ${{{m.group(1)}:-default}} for a default)"
            )
        out += [text[i : m.start()], got if got is not None else _substitute(body[2:], path)]
        i = close + 1
    return "".join(out) + text[i:]


def expand(value: object, path: str) -> object:
    """`${VAR}` and `${VAR:-default}` in string values, from the environment (e.g. a data root per
    cluster)."""
    if isinstance(value, dict):
        return {k: expand(v, path) for k, v in value.items()}
    if isinstance(value, list):
        return [expand(v, path) for v in value]
    if not isinstance(value, str) or "${" not in value:
        return value
    return _substitute(value, path)


def parse_override(item: str) -> tuple[list[str], object]:
    import yaml

    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set takes section.key=value (e.g. loader.batch_size=128), got {item!r}")
    return key.strip().split("."), yaml.safe_load(raw)


def apply_override(data: dict, parts: list[str], value: object, path: str, item: str) -> None:
    """Set data[parts[0]][parts[1]]... = value; a pipeline stage is named by its method or its index."""
    node: Any = data
    for depth, part in enumerate(parts[:-1]):
        if isinstance(node, list):  # a pipeline: `part` names a stage, the next part one of its arguments
            i = _stage_index(node, part, path, item)
            if isinstance(node[i], str):
                node[i] = {node[i]: {}}
            if not isinstance(node[i], dict) or len(node[i]) != 1:
                raise ValueError(f"{path}: --set {item}: pipeline stage {part!r} is not a one-key mapping")
            name = next(iter(node[i]))
            if node[i][name] is None:
                node[i][name] = {}
            node = node[i][name]
        elif isinstance(node, dict):
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
        else:
            raise ValueError(f"{path}: --set {item}: `{'.'.join(parts[:depth])}` is not a section")
    if isinstance(node, list):
        node[_stage_index(node, parts[-1], path, item)] = value
    elif isinstance(node, dict):
        node[parts[-1]] = value
    else:
        raise ValueError(f"{path}: --set {item}: `{'.'.join(parts[:-1])}` is not a section")


def _stage_index(stages: list, part: str, path: str, item: str) -> int:
    if part.isdigit() and int(part) < len(stages):
        return int(part)
    for i, st in enumerate(stages):
        if st == part or (isinstance(st, dict) and part in st):
            return i
    raise ValueError(f"{path}: --set {item}: no pipeline stage `{part}`")
