"""Values from input (resume states, checkpoint refs) read for checks and messages: an integer that is one,
and a repr that is bounded and never raises."""

from __future__ import annotations

import numbers

__all__ = ["brief", "integer"]


def integer(value: object) -> int | None:
    """`value` as an int when it is a whole number of an integer type (never a bool or a float), else None."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return None


def brief(value: object, limit: int = 80) -> str:
    """repr(value) for a message, at most `limit` characters; never raises (input: an int of
    5,000 digits has no repr in Python, a list of 200,000 pairs a long one)."""
    try:
        text = repr(value) if not isinstance(value, (list, tuple, dict)) or len(value) <= 64 else None
    except Exception:  # noqa: BLE001 - a value with no repr
        text = None
    if text is None:
        if isinstance(value, int):
            return f"<an int of about {round(value.bit_length() * 0.30103)} digits>"
        if isinstance(value, (list, tuple, dict)):
            return f"<a {type(value).__name__} of {len(value)} items>"
        return f"<a {type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
