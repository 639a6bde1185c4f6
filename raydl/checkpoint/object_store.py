"""The object-store transport, served on demand, and what Ray knows of a holder's fate.

Any held copy can be fetched through Ray's object store: the fetcher runs a
small task on the holder's node that maps the holder's bytes through
/proc/<pid>/fd/<fd> (no copy on the holder's side) and returns them; Ray puts
that one array in plasma for the ray.get, and frees it once the fetcher has
copied it out. So plasma holds no second copy at rest, any process that
publishes (the driver included) needs no serving actor, and a fabric-less node
can still fetch every checkpoint.

Why a task that maps the holder's memory, and not a call into the holder: the
holder is often the driver or a user's own actor, which has no method raydl
could call. The price: holder and task must share a kernel and pid namespace,
which holds for a Ray node (one raylet per host or container).

holder_status() tells a dead holder (process gone, pid reused, node dead) from
a live one whose copy was unpublished (the descriptor is closed): fetch()
consults it when a fabric read stops making progress, so a dead publisher is
an error within seconds rather than after the read timeout.
"""

from __future__ import annotations

import logging
import mmap
import os
import time

import numpy as np

from raydl.checkpoint.ref import CheckpointRef, HolderLocation, start_time, this_machine
from raydl.errors import CheckpointError

logger = logging.getLogger(__name__)

__all__ = ["DEAD", "PUBLISHED", "UNKNOWN", "UNPUBLISHED", "fetch_bytes", "holder_status", "local_status"]

PUBLISHED, UNPUBLISHED, DEAD, UNKNOWN = "published", "unpublished", "dead", "unknown"


def local_status(loc: HolderLocation) -> str:
    """The holder's state, seen from its own machine."""
    if start_time(loc.pid) != loc.started:
        return DEAD
    try:
        link = os.readlink(f"/proc/{loc.pid}/fd/{loc.fd}")
    except FileNotFoundError:
        return UNPUBLISHED
    except OSError:
        return UNKNOWN
    return PUBLISHED if link == loc.link else UNPUBLISHED


def _map_holder(loc: HolderLocation, size: int) -> np.ndarray:
    """The holder's bytes, mapped read-only from here (same machine), or CheckpointError saying why not."""
    try:
        fd = os.open(f"/proc/{loc.pid}/fd/{loc.fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise CheckpointError(
            f"holder pid {loc.pid} serves nothing at fd {loc.fd} any more "
            f"({local_status(loc)}): {exc.strerror}"
        ) from exc
    try:
        if os.readlink(f"/proc/self/fd/{fd}") != loc.link or start_time(loc.pid) != loc.started:
            raise CheckpointError(
                f"holder pid {loc.pid}: fd {loc.fd} is no longer the checkpoint ({local_status(loc)})"
            )
        held = os.fstat(fd).st_size
        if held < size:  # mapping past the end would fault (SIGBUS) when the bytes are read
            raise CheckpointError(f"holder pid {loc.pid}: fd {loc.fd} holds {held} bytes, fewer than {size}")
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return np.frombuffer(mm, np.uint8)


def _serve_task(loc: HolderLocation, size: int) -> np.ndarray:
    """Runs on the holder's node: its bytes, returned to Ray (which writes them into plasma once)."""
    return _map_holder(loc, size)


def _status_task(loc: HolderLocation) -> str:
    return local_status(loc)


def _on_node(fn, node_id: str):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return ray.remote(fn).options(
        num_cpus=0, max_retries=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
    )


def fetch_bytes(ref: CheckpointRef, dst: np.ndarray, *, timeout: float) -> None:
    """Copy the holder's bytes into dst through the object store (a task on the holder's node serves them)."""
    import ray

    loc = ref.location
    if loc is None or loc.node_id is None:
        raise CheckpointError(
            f"{ref!r}: its holder has no Ray, so nothing can serve it through the object store"
        )
    try:
        src = ray.get(_on_node(_serve_task, loc.node_id).remote(loc, ref.size), timeout=timeout)
    except CheckpointError:
        raise
    except (ray.exceptions.RayError, TimeoutError) as exc:
        cause = exc.cause if isinstance(getattr(exc, "cause", None), CheckpointError) else None
        if cause is not None:
            raise CheckpointError(f"checkpoint {ref.key[:8]} from {ref.holder}: {cause}") from exc
        raise CheckpointError(
            f"checkpoint {ref.key[:8]}: the object store could not serve it from {ref.holder}: {exc}"
        ) from exc
    dst[:] = src
    del src  # the plasma copy can go now


def _node_alive(node_id: str) -> bool | None:
    import ray

    try:
        for n in ray.nodes():
            if n["NodeID"] == node_id:
                return bool(n["Alive"])
    except Exception:  # noqa: BLE001 - Ray cannot say
        return None
    return False


def holder_status(loc: HolderLocation | None, *, timeout: float = 2.0) -> str:
    """PUBLISHED, UNPUBLISHED, DEAD or UNKNOWN (cannot tell: no Ray, or the node did not answer in time)."""
    if loc is None:
        return UNKNOWN
    if loc.machine == this_machine():
        return local_status(loc)
    try:
        import ray

        if loc.node_id is None or not ray.is_initialized():
            return UNKNOWN
    except ImportError:
        return UNKNOWN
    alive = _node_alive(loc.node_id)
    if alive is False:
        return DEAD
    t0 = time.monotonic()
    try:
        return ray.get(_on_node(_status_task, loc.node_id).remote(loc), timeout=timeout)
    except (ray.exceptions.RayError, TimeoutError) as exc:
        logger.debug(
            "raydl: no answer about holder pid %d after %.1f s: %s", loc.pid, time.monotonic() - t0, exc
        )
        return DEAD if _node_alive(loc.node_id) is False else UNKNOWN
