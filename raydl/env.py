"""The one place raydl reads environment variables (see docs/configs.md for each; raydl/util/memory.py reads
ARROW_DEFAULT_MEMORY_POOL, pyarrow's own, where it picks the decode pool).

pyfi, the libfabric bindings, keeps its own two (RAYDL_FABRIC_PROVIDER,
RAYDL_DISABLE_FABRIC) in raydl/native/pyfi/_env.py so that it stays
importable alone.
"""

from __future__ import annotations

import os
import re

__all__ = [
    "cache_dir",
    "checkpoint_bind",
    "checkpoint_faults",
    "checkpoint_prepare",
    "azure_storage_connection_string",
    "environment_variable",
    "local_ray_config",
    "native_disabled",
    "ray_address",
    "ray_worker_niceness",
    "simd_cap",
    "storage_emulator_host",
]


def native_disabled() -> bool:
    """RAYDL_DISABLE_NATIVE=1 forces the numpy/Pillow fallback (for tests and debugging)."""
    return os.environ.get("RAYDL_DISABLE_NATIVE", "") not in ("", "0")


_SIMD_LEVELS = {"portable": 0, "avx2": 1, "avx512": 2}


def simd_cap() -> int | None:
    """RAYDL_SIMD=portable|avx2|avx512: the resampler's path (raydl.native.simd_level, at most what the CPU
    has), for measuring one path against another in the same benchmark; unset: AVX2 where the CPU has it."""
    value = os.environ.get("RAYDL_SIMD", "").strip().lower()
    if not value:
        return None
    if value not in _SIMD_LEVELS:
        raise ValueError(f"RAYDL_SIMD must be one of {', '.join(_SIMD_LEVELS)}, got {value!r}")
    return _SIMD_LEVELS[value]


def cache_dir() -> str:
    """RAYDL_CACHE_DIR: this node's cache folder (WebDataset shard indexes); default ~/.cache/raydl."""
    return os.environ.get("RAYDL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "raydl")


def ray_address() -> str | None:
    """RAY_ADDRESS: set by `ray job submit` for the job's driver (and by users pointing at a cluster)."""
    return os.environ.get("RAY_ADDRESS") or None


# Ray settings a local Ray that raydl starts gets (and that docs/cluster.md asks of a cluster's `ray start`,
# as RAY_<name>=<value> in its environment). free_objects_period_milliseconds: Ray frees the store memory of
# objects nobody holds in batches, by default once a second; a loader hands over a batch many times a
# second, so batches already dropped held the store's pages for up to a second and each new one was copied
# into pages never touched before (a page fault per 4 KiB, and resident memory that stays). Within 10 ms,
# a new batch mostly reuses the pages of one just freed.
RAY_SYSTEM_CONFIG = {"free_objects_period_milliseconds": 10}


def local_ray_config() -> dict[str, int]:
    """The `_system_config` raydl starts a local Ray with: RAY_SYSTEM_CONFIG, less any setting this process's
    environment gives as RAY_<name> (which Ray reads itself, and which wins)."""
    return {k: v for k, v in RAY_SYSTEM_CONFIG.items() if f"RAY_{k}" not in os.environ}


def ray_worker_niceness() -> int:
    """RAY_worker_niceness: the niceness Ray starts worker processes at (Ray's default: 15)."""
    try:
        return int(os.environ.get("RAY_worker_niceness", "15"))
    except ValueError:
        return 15


def checkpoint_bind() -> str:
    """Where checkpoint publishers listen: RAYDL_CHECKPOINT_BIND ("host:port", e.g. "10.0.0.5:0"; an
    empty value counts as unset), else this node's Ray address inside Ray (the interface the other
    nodes reach it on), else loopback. Never every interface (0.0.0.0) unless asked for by name.
    See docs/security.md."""
    bind = os.environ.get("RAYDL_CHECKPOINT_BIND")
    if bind:
        return bind
    try:
        import ray

        if ray.is_initialized():
            return f"{ray.util.get_node_ip_address()}:0"
    except Exception:  # noqa: BLE001 - no Ray here: loopback
        pass
    return "127.0.0.1:0"


_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def checkpoint_prepare() -> tuple[bool, int]:
    """(bring the fabric side up when raydl.checkpoint is imported, bytes of receive buffer to fault in then)
    from RAYDL_CHECKPOINT_PREPARE: unset or "1": (True, 0); "0": (False, 0); a size ("512MiB", "1G",
    "4096"): (True, size). Anything else is a ValueError naming the variable."""
    text = os.environ.get("RAYDL_CHECKPOINT_PREPARE", "").strip()
    if text in ("", "1"):
        return True, 0
    if text == "0":
        return False, 0
    m = re.fullmatch(r"([0-9]+)\s*([KMG]?)(?:i?B)?", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"RAYDL_CHECKPOINT_PREPARE={text!r}: want 0, 1 or a size such as 512MiB")
    return True, int(m.group(1)) * _SIZE_UNITS[m.group(2).upper()]


CHECKPOINT_FAULTS = ("hint", "ahead", "ahead-huge", "end-huge", "reads", "first")


def checkpoint_faults() -> str:
    """How a fresh receive buffer is faulted in, from RAYDL_CHECKPOINT_FAULTS (for benchmarks that
    compare the ways; docs/checkpoints.md): "hint" (default: at import, inside Ray, one of the
    cluster's last published checkpoint size starts faulting in; a fetch into fresh memory has
    toucher threads just ahead of its reads), "ahead" (only the toucher threads), "ahead-huge"
    (those, on transparent huge pages), "end-huge" (huge pages, one thread from the buffer's end
    while the reads fault its front), "reads" (the reads fault it), "first" (all of it on every core, then
    the reads). Anything else is a ValueError naming the variable."""
    text = os.environ.get("RAYDL_CHECKPOINT_FAULTS", "").strip() or "hint"
    if text not in CHECKPOINT_FAULTS:
        raise ValueError(f"RAYDL_CHECKPOINT_FAULTS={text!r}: want one of {', '.join(CHECKPOINT_FAULTS)}")
    return text


def environment_variable(name: str) -> str | None:
    """Any variable a config file names (`${DATA_ROOT}`, see raydl.config); None when unset."""
    return os.environ.get(name)


def storage_emulator_host() -> str | None:
    """STORAGE_EMULATOR_HOST: a GCS emulator's address ("127.0.0.1:4443" or a URL), as Google's client reads
    it; None when unset."""
    return os.environ.get("STORAGE_EMULATOR_HOST") or None


def azure_storage_connection_string() -> str | None:
    """AZURE_STORAGE_CONNECTION_STRING, Azure's default connection string; None when unset. A secret: never
    logged or printed."""
    return os.environ.get("AZURE_STORAGE_CONNECTION_STRING") or None
