"""What a resume state records of a mix, checked against the mix a loader reads: pure, no Ray."""

from __future__ import annotations

from raydl.util.values import brief

__all__ = ["brief", "check_mix_state"]


def _listed(state: dict, key: str) -> list:
    """state[key] when it is a list, else [] (a crafted state: this loader's names what changed)."""
    value = state.get(key)
    return value if isinstance(value, list) else []


def check_mix_state(theirs: dict | None, mine: dict | None) -> None:
    """A state of a mix loads only into the same mix: a ValueError naming what changed (the sources, their
    weights, the epoch size, the batching, the per-sample weights or a source's data)."""
    if theirs is None and mine is None:
        return
    if theirs is None or mine is None:
        was, now = ("one dataset", "a mix") if theirs is None else ("a mix", "one dataset")
        raise ValueError(f"cannot resume: the state is of {was}, this loader is of {now}")
    if "windows" in mine and "windows" not in theirs:  # a state that records no windows: every source's 0
        theirs = {**theirs, "windows": [0] * len(mine["windows"])}
    for key, value in mine.items():
        if theirs.get(key) != value:
            if key in ("sample_weights", "fingerprints"):
                pairs = zip(mine["sources"], _listed(theirs, key), value, strict=False)
                changed = [n for n, a, b in pairs if a != b] or mine["sources"]
            if key == "sample_weights":
                raise ValueError(
                    f"cannot resume: the per-sample weights of source(s) {changed} changed since the state "
                    "was saved; load it into a loader of the same mix"
                )
            if key == "fingerprints":
                raise ValueError(
                    f"cannot resume: the data of source(s) {changed} changed since the state was saved; load "
                    "it into a loader of the same mix"
                )
            if key == "weights":
                was = dict(zip(_listed(theirs, "sources"), _listed(theirs, "weights"), strict=False))
                now = dict(zip(mine["sources"], value, strict=True))
                raise ValueError(
                    f"cannot resume: the mix's weights changed: the state has {brief(was, 400)}, this loader "
                    f"{brief(now, 400)}; "
                    "resume with the same weights (or start a new epoch plan without the state)"
                )
            raise ValueError(
                f"cannot resume: the mix's {key} is {brief(theirs.get(key))} in the state and {brief(value)} "
                "here; load it into a loader of the same mix"
            )
