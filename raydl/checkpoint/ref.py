"""What travels through Ray: CheckpointRef (where a checkpoint is served, and its digests), and what
fetch() returns: FetchedCheckpoint."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from raydl.util.process import process_name

__all__ = ["CheckpointRef", "FetchedCheckpoint", "HolderLocation", "this_machine"]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def this_machine() -> str:
    """One value per kernel and pid namespace: two processes that see it alike see each other's /proc."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return f"{_read('/proc/sys/kernel/random/boot_id')}/{ns}"


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/pid/stat): tells a pid reused
    apart."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


@dataclass(frozen=True)
class HolderLocation:
    """Where a holder keeps the bytes: the process, and the descriptor that maps them while they are
    published.

    Another process on the same machine (same `machine`) maps /proc/<pid>/fd/<fd>
    while it still links to `link`: that is how the object-store path serves a
    copy on demand, and how a fetcher tells a dead holder (no such process)
    from an unpublished copy (the descriptor is gone)."""

    node_id: str | None  # the holder's Ray node, None when it has no Ray
    machine: str  # this_machine() of the holder
    pid: int
    started: int | None  # start_time(pid)
    fd: int
    link: str  # os.readlink(/proc/<pid>/fd/<fd>) while published

    @classmethod
    def here(cls, fd: int) -> HolderLocation:
        node_id = None
        try:
            import ray

            if ray.is_initialized():
                node_id = ray.get_runtime_context().get_node_id()
        except Exception:  # noqa: BLE001 - no Ray here: no object-store path
            pass
        pid = os.getpid()
        return cls(
            node_id=node_id,
            machine=this_machine(),
            pid=pid,
            started=start_time(pid),
            fd=fd,
            link=os.readlink(f"/proc/self/fd/{fd}"),
        )


def holder_name() -> str:
    return process_name()


@dataclass(frozen=True)
class CheckpointRef:
    """What a peer needs to fetch a published checkpoint. Small and picklable: send it through Ray."""

    key: str
    size: int
    chunk_size: int
    checksums: tuple[int, ...]
    header: str  # the safetensors JSON header
    holder: str  # who serves these bytes: host:pid
    fabric: Any = None  # pyfi.FabricAddress, or None without an RMA provider
    location: HolderLocation | None = field(default=None, compare=False)  # for the object store and liveness
    # where in `fabric`'s region a holder still receiving (a broadcast peer) keeps its progress word:
    # an int64, the chunks it holds, verified; None: it holds them all
    progress_at: int | None = field(default=None, compare=False)
    object_store: bool = True  # may be served through the object store (when its holder has Ray)
    # publish(verify="sha256"): one SHA-256 digest per chunk, checked by every fetcher; None: XXH3 only
    sha256: tuple[bytes, ...] | None = field(default=None, compare=False)

    @property
    def transports(self) -> tuple[str, ...]:
        """How this ref can be fetched: "fabric" (RMA reads), "object_store" (served on demand through
        Ray)."""
        store = self.object_store and self.location is not None and self.location.node_id is not None
        return tuple(t for t, ok in (("fabric", self.fabric is not None), ("object_store", store)) if ok)

    def __repr__(self) -> str:
        # Never the fabric address's memory key: it is the secret a reader must hold (docs/security.md)
        return (
            f"CheckpointRef(key={self.key[:8]}…, size={self.size}, chunks={len(self.checksums)}, "
            f"holder={self.holder!r}, transports={self.transports}"
            f"{', verify=sha256' if self.sha256 is not None else ''})"
        )


class FetchedCheckpoint(dict):
    """The fetched tensors, with how they came: `.transport`, `.peer`, `.seconds`, `.path` (or None), and
    `.phases` (seconds per phase of the fetch: probe, setup, connect, register, transfer, verify, build)."""

    transport: str
    peer: str
    seconds: float
    path: str | None
    phases: dict[str, float]
