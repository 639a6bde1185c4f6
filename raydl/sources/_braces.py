"""Brace patterns for shard URLs, as the webdataset library (braceexpand) reads them.

    shard-{000000..000127}.tar   numeric range; zero padding follows the wider bound
    shard-{a,b,c}.tar            alternatives
    {train,val}-{0..9}.tar       several braces multiply, left to right

Unbalanced braces are a ValueError naming the pattern.
"""

from __future__ import annotations

import re

__all__ = ["expand_braces"]

_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?$")
_ALPHA_RANGE = re.compile(r"^([A-Za-z])\.\.([A-Za-z])$")


def _matching(pattern: str, start: int) -> int:
    depth = 0
    for i in range(start, len(pattern)):
        c = pattern[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"malformed brace pattern {pattern!r}: the '{{' at position {start} is never closed")


def _split_top(body: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for c in body:
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        depth += (c == "{") - (c == "}")
        cur.append(c)
    parts.append("".join(cur))
    return parts


def _alternatives(body: str, pattern: str) -> list[str]:
    m = _RANGE.match(body)
    if m:
        lo, hi, step = m.group(1), m.group(2), m.group(3)
        padded = any(len(x.lstrip("-")) > 1 and x.lstrip("-").startswith("0") for x in (lo, hi))
        width = max(len(lo.lstrip("-")), len(hi.lstrip("-"))) if padded else 0
        a, b, s = int(lo), int(hi), abs(int(step)) if step else 1
        if s == 0:
            raise ValueError(f"malformed brace pattern {pattern!r}: step 0 in {{{body}}}")
        values = range(a, b + 1, s) if a <= b else range(a, b - 1, -s)
        return [str(v).zfill(width) if v >= 0 else "-" + str(-v).zfill(width) for v in values]
    m = _ALPHA_RANGE.match(body)
    if m:
        a, b = ord(m.group(1)), ord(m.group(2))
        step = 1 if a <= b else -1
        return [chr(c) for c in range(a, b + step, step)]
    parts = _split_top(body)
    if len(parts) == 1:
        return ["{" + p + "}" for p in expand_braces(parts[0])]  # "{x}" is literal, as in bash
    return [x for p in parts for x in expand_braces(p)]


def expand_braces(pattern: str) -> list[str]:
    """Every string the pattern stands for, in order."""
    i = pattern.find("{")
    close_only = pattern.find("}")
    if i < 0:
        if close_only >= 0:
            raise ValueError(
                f"malformed brace pattern {pattern!r}: a '}}' at position {close_only} has no '{{'"
            )
        return [pattern]
    if 0 <= close_only < i:
        raise ValueError(f"malformed brace pattern {pattern!r}: a '}}' at position {close_only} has no '{{'")
    j = _matching(pattern, i)
    head, body, tail = pattern[:i], pattern[i + 1 : j], pattern[j + 1 :]
    tails = expand_braces(tail)
    return [head + mid + t for mid in _alternatives(body, pattern) for t in tails]
