"""Optional extras, imported on first use with an error that says what to install."""

from __future__ import annotations

__all__ = ["import_torch"]


def import_torch(what: str):
    """torch, imported on first use (an optional extra); `what` names the feature that needs it."""
    try:
        import torch
    except ImportError as exc:
        raise ImportError(
            f"{what} needs torch; install the build for your CUDA version, or the default one with "
            "`pip install 'raydl-loader[torch]'` (from a raydl checkout: `pip install -e '.[torch]'`)"
        ) from exc
    return torch
