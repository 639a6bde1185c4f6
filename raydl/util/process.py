"""Who this process is, in the one form raydl's messages and registries use."""

from __future__ import annotations

import os
import socket

__all__ = ["process_name"]


def process_name() -> str:
    """`host:pid` of this process: names a loader worker, checkpoint peer or publisher in messages."""
    return f"{socket.gethostname()}:{os.getpid()}"
