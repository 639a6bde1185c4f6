"""Ahead of a process's first fetch: prepare() brings its fabric side up (libfabric's start-up and the
provider probe) and can fault a receive buffer in, on a background thread.

Importing raydl.checkpoint runs prepare_at_import() (RAYDL_CHECKPOINT_PREPARE=0 turns it off), so a fresh
process's first fetch finds libfabric started. Inside Ray that thread also starts faulting in a receive
buffer of the size the cluster's last publish left in its KV store (the size hint, checked like any other
input), so the first fetch lands on memory already faulted in. Nothing here opens an endpoint.
"""

from __future__ import annotations

import logging
import threading

from raydl.checkpoint.process import PROCESS

__all__ = [
    "HINT_MAX_SHARE",
    "HINT_TTL_S",
    "decline_receive_prefault",
    "prepare",
    "prepare_at_import",
    "record_size_hint",
    "sane_size_hint",
    "size_hint",
]

# The checkpoint API's one logger name, whichever of its modules logs
logger = logging.getLogger("raydl.checkpoint.api")


def prepare(*, buffer_bytes: int | None = None, wait: bool = False) -> None:
    """Bring this process's fabric side up ahead of its first fetch: libfabric's start-up (0.3-0.4 s
    here) and the provider probe; with buffer_bytes, also fault a receive buffer of that size in. It
    opens no endpoint, so nothing listens until something is published (a fetch opens its client
    endpoint, ~3-6 ms). A trainer calls it at start; it runs on a background thread unless
    wait=True. Idempotent; without a usable libfabric only the buffer is prepared."""
    if buffer_bytes is not None and buffer_bytes < 0:
        raise ValueError(f"buffer_bytes must be >= 0, got {buffer_bytes}")
    thread = PROCESS.start_preparing(_prepare_fabric)
    prefault = None
    if buffer_bytes:
        from raydl.env import checkpoint_faults

        try:
            huge = checkpoint_faults().endswith("-huge")
        except ValueError:  # the fetch says so
            huge = False
        prefault = threading.Thread(
            target=PROCESS.buffers.prefault,
            args=(buffer_bytes,),
            kwargs={"huge": huge},
            name="raydl-checkpoint-prefault",
            daemon=True,
        )
        prefault.start()
    if wait:
        thread.join()
        if prefault is not None:
            prefault.join()


def _prepare_fabric() -> None:
    try:
        from raydl.native import pyfi
        from raydl.native.pyfi._lifecycle import GATE

        with GATE.inside("checkpoint.prepare"):  # the process's exit waits for libfabric's start-up to end
            if pyfi.available():
                pyfi.choose_provider()
    except Exception as exc:  # noqa: BLE001 - preparing is an optimisation: the fetch will say what fails
        logger.info("raydl: checkpoint.prepare() could not start libfabric: %s", exc)


# -- the size hint: a fresh process's receive buffer faulted in before its first fetch -----------------
SIZE_HINT_KEY = b"checkpoint:last_size"
SIZE_HINT_NAMESPACE = "raydl"
HINT_TTL_S = 60.0  # a buffer faulted in from the hint and not fetched into by then is dropped
HINT_MAX_SHARE = 0.25  # ... and none is faulted in when it would take more of MemAvailable than this
_hinted: int | None = None  # the size this process last wrote there


def _ray_connected():
    """The ray module when this process is connected to a cluster (never imports Ray), else None."""
    import sys

    ray = sys.modules.get("ray")
    try:
        return ray if ray is not None and ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - a half-imported Ray: no hint
        return None


def record_size_hint(size: int) -> None:
    """Inside Ray, note the last published checkpoint's size in the cluster's KV store (best effort): a
    process that imports raydl.checkpoint later faults a receive buffer that large in before it fetches."""
    global _hinted
    if _ray_connected() is None or _hinted == size:  # a trainer publishes the same size again and again
        return
    try:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(
            SIZE_HINT_KEY, str(int(size)).encode(), overwrite=True, namespace=SIZE_HINT_NAMESPACE
        )
        _hinted = size
    except Exception as exc:  # noqa: BLE001 - a hint, nothing depends on it
        logger.debug("raydl: could not record the checkpoint size hint: %s", exc)


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return None


def size_hint() -> int | None:
    """The last checkpoint size published in this process's Ray cluster, when it is a sane receive
    buffer here: at most HINT_MAX_SHARE of MemAvailable (the value comes from the cluster's KV store,
    so it is checked like any other input). None outside Ray, without a hint, or when too large."""
    if _ray_connected() is None:
        return None
    try:
        from ray.experimental import internal_kv

        raw = internal_kv._internal_kv_get(SIZE_HINT_KEY, namespace=SIZE_HINT_NAMESPACE)
    except Exception as exc:  # noqa: BLE001
        logger.debug("raydl: no checkpoint size hint: %s", exc)
        return None
    return sane_size_hint(raw, _mem_available())


def sane_size_hint(raw: bytes | None, available: int | None) -> int | None:
    """The hint's bytes as a size, when it is a positive decimal of at most HINT_MAX_SHARE of
    `available` bytes; else None. Pure."""
    if not raw or len(raw) > 20 or available is None:
        return None
    try:
        size = int(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None
    return size if 0 < size <= HINT_MAX_SHARE * available else None


def decline_receive_prefault() -> None:
    """This process will not fetch into a receive buffer (a broadcast peer): no receive buffer is
    faulted in from the size hint, and one under way is dropped."""
    PROCESS.buffers.decline_ahead()


def _prepare_from_hint() -> None:
    """What the import's background thread does: inside Ray, a receive buffer of the cluster's last
    published checkpoint size starts faulting in (Toucher threads, returning at once) unless this
    process publishes or fetched already; then libfabric's start-up. A fetch that starts meanwhile
    takes the buffer over; unfetched, it goes after HINT_TTL_S."""
    from raydl.env import checkpoint_faults

    try:
        way = checkpoint_faults()
    except ValueError:
        way = "hint"
    size = None if way != "hint" or len(PROCESS.published) else size_hint()
    if size is not None:  # first: it takes longer than libfabric's start-up, and runs beside it
        if PROCESS.buffers.prefault_ahead(size, ttl_s=HINT_TTL_S):
            logger.debug("raydl: faulting a %d-byte receive buffer in ahead of the first fetch", size)
    _prepare_fabric()


def prepare_at_import() -> None:
    """What importing raydl.checkpoint does: prepare() in the background, as RAYDL_CHECKPOINT_PREPARE
    says (default: the fabric side, and inside Ray a receive buffer of the cluster's last published
    checkpoint size, see _prepare_from_hint; a size: a receive buffer that large; 0: nothing). It
    never blocks the import nor fails it: a bad value is logged and ignored."""
    from raydl.env import checkpoint_prepare

    try:
        enabled, buffer_bytes = checkpoint_prepare()
    except ValueError as exc:
        logger.warning("raydl: %s; not preparing the checkpoint fabric at import", exc)
        return
    if not enabled:
        return
    if buffer_bytes:
        prepare(buffer_bytes=buffer_bytes)
    else:
        PROCESS.start_preparing(_prepare_from_hint)
