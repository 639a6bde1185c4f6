"""What travels through Ray: CheckpointRef (where a checkpoint is served, and its digests), and what
fetch() returns: FetchedCheckpoint."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from raydl.errors import CheckpointError
from raydl.util.process import process_name
from raydl.util.values import brief, integer

__all__ = ["CheckpointRef", "FetchedCheckpoint", "HolderLocation", "this_machine"]

MAX_SIZE = 1 << 50  # bytes of one checkpoint a ref may claim (a PiB)
_U64 = 1 << 64


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

    def check(self) -> CheckpointRef:
        """This ref, when it agrees with itself: sizes, one digest per chunk, a fabric region that holds the
        bytes (and the progress word after them), a holder's location of the right types. A ref travels
        through Ray from another process, so a fetcher checks it before allocating or reading anything;
        CheckpointError naming the holder and what does not agree."""
        why = self._disagreement()
        if why is not None:
            holder = self.holder if isinstance(self.holder, str) else "?"
            key = self.key[:8] if isinstance(self.key, str) else "?"
            raise CheckpointError(f"checkpoint {key} from {holder[:200]}: its ref is not usable: {why}")
        return self

    def _disagreement(self) -> str | None:
        if not isinstance(self.key, str) or not 0 < len(self.key) <= 128:
            return "the key is not a short string"
        if not isinstance(self.holder, str) or len(self.holder) > 1024:
            return "the holder is not a short string"
        if not isinstance(self.header, str):
            return "the header is not a string"
        if not _int(self.size) or not 8 <= self.size <= MAX_SIZE:
            return f"size {brief(self.size)} is not between 8 and {MAX_SIZE} bytes"
        if not _int(self.chunk_size) or self.chunk_size < 1:
            return f"chunk_size {brief(self.chunk_size)} is not a positive integer"
        chunks = -(-self.size // self.chunk_size)
        if not isinstance(self.checksums, (tuple, list)) or len(self.checksums) != chunks:
            n = len(self.checksums) if isinstance(self.checksums, (tuple, list)) else "no"
            return f"{n} digests for {chunks} chunks of {self.chunk_size} bytes"
        if not all(_int(d) and 0 <= d < _U64 for d in self.checksums):
            return "a digest is not a 64-bit unsigned integer"
        if self.sha256 is not None and (
            not isinstance(self.sha256, (tuple, list))
            or len(self.sha256) != chunks
            or not all(isinstance(d, bytes) and len(d) == 32 for d in self.sha256)
        ):
            return f"its sha256 digests are not {chunks} digests of 32 bytes"
        if self.fabric is not None:
            why = _fabric_disagreement(self.fabric, self.size, self.progress_at)
            if why is not None:
                return why
        elif self.progress_at is not None:
            return "a progress word without a fabric address"
        if self.location is not None and not _location_ok(self.location):
            return "its holder's location is not a HolderLocation of the right types"
        return None

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


def _int(v) -> bool:
    return integer(v) is not None


def _fabric_disagreement(address, size: int, progress_at) -> str | None:
    """Why a ref's fabric address cannot serve its `size` bytes (and its progress word), or None."""
    from raydl.native.pyfi import FabricAddress

    if not isinstance(address, FabricAddress):
        return f"its fabric address is a {type(address).__name__}, not a FabricAddress"
    a = address
    if not (
        isinstance(a.provider, str) and isinstance(a.fabric, str) and len(a.provider) + len(a.fabric) <= 512
    ):
        return "its fabric provider or fabric name is not a short string"
    if not isinstance(a.raw, bytes) or not 0 < len(a.raw) <= 1024:
        return "its fabric address bytes are not a short bytes value"
    if not (a.host is None or (isinstance(a.host, str) and len(a.host) <= 256)):
        return "its fabric host is not a short string"
    for name in ("key", "base", "size"):
        if not _int(getattr(a, name)) or not 0 <= getattr(a, name) < _U64:
            return f"its fabric region's {name} is not a 64-bit unsigned integer"
    if not isinstance(a.writable, bool):
        return "its fabric region's writable flag is not a bool"
    end = size
    if progress_at is not None:
        if not _int(progress_at) or progress_at < size or progress_at % 8:
            return f"its progress word at {brief(progress_at)} is not 8-aligned after the {size} bytes"
        end = progress_at + 8
    if a.size < end:
        return f"its fabric region holds {a.size} bytes, fewer than the {end} it says it serves"
    return None


def _location_ok(loc) -> bool:
    return (
        isinstance(loc, HolderLocation)
        and (loc.node_id is None or isinstance(loc.node_id, str))
        and isinstance(loc.machine, str)
        and _int(loc.pid)
        and 0 < loc.pid < 1 << 31
        and (loc.started is None or _int(loc.started))
        and _int(loc.fd)
        and 0 <= loc.fd < 1 << 31
        and isinstance(loc.link, str)
    )


class FetchedCheckpoint(dict):
    """The fetched tensors, with how they came: `.transport`, `.peer`, `.seconds`, `.path` (or None), and
    `.phases` (seconds per phase of the fetch: probe, setup, connect, register, transfer, verify, build)."""

    transport: str
    peer: str
    seconds: float
    path: str | None
    phases: dict[str, float]
