"""Loading the compiled bindings, and turning -FI_E... returns into FabricError.

The compiled module (raydl.native.pyfi._pyfi) is imported lazily, once; when
it is missing, or libfabric.so cannot be loaded, or RAYDL_DISABLE_FABRIC=1,
`load()` raises FabricError with the reason and `unavailable_reason()` returns
it, so `import raydl.native.pyfi` itself always works.
"""

from __future__ import annotations

import errno
import functools
from typing import Any

from raydl.errors import FabricError
from raydl.native.pyfi._env import apply_provider_defaults, fabric_env

# libfabric's own codes past the errno range (rdma/fi_errno.h; part of its ABI).
_FI_CODES = {
    256: "FI_EOTHER",
    257: "FI_ETOOSMALL",
    258: "FI_EOPBADSTATE",
    259: "FI_EAVAIL",
    260: "FI_EBADFLAGS",
    261: "FI_ENOEQ",
    262: "FI_EDOMAIN",
    263: "FI_ENOCQ",
    264: "FI_ECRC",
    265: "FI_ETRUNC",
    266: "FI_ENOKEY",
    267: "FI_ENOAV",
    268: "FI_EOVERRUN",
    269: "FI_ENORX",
}


@functools.lru_cache(maxsize=1)
def _import() -> tuple[Any, Any, str | None]:
    """(ffi, lib, None), or (None, None, why) when the module cannot be loaded."""
    apply_provider_defaults()  # before any libfabric call: its providers read them at start-up
    try:
        from raydl.native.pyfi import _pyfi  # type: ignore[attr-defined]
    except ImportError as exc:
        return (
            None,
            None,
            (
                f"the compiled module raydl.native.pyfi._pyfi cannot be loaded ({exc}); install "
                "libfabric and its headers (Debian: libfabric1 libfabric-dev) and reinstall raydl "
                "(`pip install -e .`), or run `python -m raydl.native._build_pyfi`"
            ),
        )
    return _pyfi.ffi, _pyfi.lib, None


def unavailable_reason() -> str | None:
    """Why the bindings cannot be used, or None when they can."""
    if fabric_env().disabled:
        return "disabled by RAYDL_DISABLE_FABRIC=1"
    return _import()[2]


def load() -> tuple[Any, Any]:
    """(ffi, lib) of the compiled bindings; FabricError saying why when unusable."""
    reason = unavailable_reason()
    if reason is not None:
        raise FabricError(f"libfabric bindings unavailable: {reason}", call="load")
    ffi, lib, _ = _import()
    return ffi, lib


def loaded() -> tuple[Any, Any]:
    """(ffi, lib) for code working on pyfi objects that exist (load() succeeded when they were
    made): the per-read and per-poll paths. It skips load()'s environment check, which is
    what RAYDL_DISABLE_FABRIC gates (making new stacks), and cost microseconds per call."""
    ffi, lib, reason = _import()
    if reason is not None:
        raise FabricError(f"libfabric bindings unavailable: {reason}", call="load")
    return ffi, lib


def code_name(code: int) -> str:
    """'FI_ENOKEY' for 266, 'FI_EAGAIN' for 11 (positive codes)."""
    if code in _FI_CODES:
        return _FI_CODES[code]
    name = errno.errorcode.get(code)
    return f"FI_{name}" if name else f"error {code}"


def strerror(code: int) -> str:
    """fi_strerror's text for a positive FI_E... code."""
    ffi, lib = load()
    return ffi.string(lib.fi_strerror(code)).decode(errors="replace")


def fabric_error(call: str, rc: int, *, peer: str | None = None, detail: str = "") -> FabricError:
    """The FabricError for a negative return `rc` of `call`."""
    code = -int(rc)
    text = strerror(code)
    where = f" (peer {peer})" if peer else ""
    extra = f": {detail}" if detail else ""
    return FabricError(
        f"{call} failed{where}: {text} (-{code_name(code)}){extra}", call=call, code=code, strerror=text
    )


def check(rc: int, call: str, *, peer: str | None = None, detail: str = "") -> int:
    """Return rc when it is >= 0; raise FabricError naming `call` when negative."""
    if rc < 0:
        raise fabric_error(call, rc, peer=peer, detail=detail)
    return rc


def api_version() -> int:
    """FI_VERSION(1, min(header minor, runtime minor)): asking a runtime for a newer
    API than it has fails with -FI_ENOSYS (1.18 against 1.17)."""
    _, lib = load()
    runtime = lib.fi_version()
    major, minor = runtime >> 16, runtime & 0xFFFF
    if (major, minor) > (lib.FI_MAJOR_VERSION, lib.FI_MINOR_VERSION):
        major, minor = lib.FI_MAJOR_VERSION, lib.FI_MINOR_VERSION
    return lib.pyfi_version(major, minor)


def version_string() -> str:
    """The runtime libfabric version, e.g. '1.17'."""
    _, lib = load()
    v = lib.fi_version()
    return f"{v >> 16}.{v & 0xFFFF}"
