"""Optional extras, imported on first use with an error that says what to install."""

from __future__ import annotations

__all__ = ["import_torch"]


def import_torch(what: str):
    """torch, imported on first use (an optional extra); `what` names the feature that needs it."""
    try:
        import torch
    except ImportError as exc:
        raise ImportError(
            f"{what} needs torch; install the build for your CUDA version, "
            "or `pip install 'raydl[torch]'` for the default one"
        ) from exc
    return torch
