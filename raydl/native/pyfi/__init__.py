"""pyfi: raydl's libfabric bindings (cffi, API mode) and a one-sided transfer engine.

    from raydl.native import pyfi
    if pyfi.available():
        with pyfi.serve(buf) as server:               # or a path: mapped read-only
            with pyfi.connect(server.address) as conn:  # address: picklable, send it via Ray
                conn.read_into(dst)                    # pipelined fi_read into dst

Layers, bottom up (see README.md beside this file):
    _env      the one place pyfi reads the environment
    _lib      loads the compiled module; -FI_E... -> raydl.errors.FabricError
    _objects  Fabric, Domain, CompletionQueue, AddressVector, Endpoint, MemoryRegion
    _probe    info(), diagnose(), the provider choice
    _stack    FabricAddress and the stack both ends open
    _server   serve() / Server / ServerEndpoint: register regions, serve them from a thread
    _client   connect() / Connection: pipelined reads (and writes)
    _bench    raw_read_rate()

Importing pyfi never fails: without libfabric (or its compiled module, or
with RAYDL_DISABLE_FABRIC=1) `available()` is False and `unavailable_reason()`
says why and what to install.
"""

from __future__ import annotations

from raydl.native.pyfi import _lib, _probe
from raydl.native.pyfi._client import Client, Connection, Pacer, connect
from raydl.native.pyfi._lib import version_string
from raydl.native.pyfi._objects import (
    AddressVector,
    CompletionQueue,
    Domain,
    Endpoint,
    Fabric,
    MemoryRegion,
    ProviderInfo,
    getinfo,
)
from raydl.native.pyfi._probe import KNOWN_PROVIDERS, ProviderFit, choose_provider, diagnose, info
from raydl.native.pyfi._server import Server, ServerEndpoint, serve
from raydl.native.pyfi._stack import FabricAddress

__all__ = [
    "AddressVector",
    "Client",
    "CompletionQueue",
    "Connection",
    "Domain",
    "Endpoint",
    "Fabric",
    "FabricAddress",
    "KNOWN_PROVIDERS",
    "MemoryRegion",
    "Pacer",
    "ProviderFit",
    "ProviderInfo",
    "Server",
    "ServerEndpoint",
    "available",
    "choose_provider",
    "connect",
    "diagnose",
    "fabric_info_main",
    "format_diagnosis",
    "getinfo",
    "info",
    "serve",
    "unavailable_reason",
]


def available() -> bool:
    """True when transfers can run here: the bindings load and a provider fits
    (RAYDL_FABRIC_PROVIDER's, else one of KNOWN_PROVIDERS). Checked once per process."""
    return unavailable_reason() is None


def unavailable_reason() -> str | None:
    """Why available() is False (what is missing, what to install), or None."""
    return _lib.unavailable_reason() or _probe.no_fit_reason()


def format_diagnosis(fits: list[ProviderFit] | None = None) -> str:
    """diagnose()'s answer as the text `raydl fabric-info` prints."""
    reason = _lib.unavailable_reason()
    if reason is not None:
        return f"libfabric: unavailable: {reason}\nCheckpoint transfer will use the Ray object store."
    fits = diagnose() if fits is None else fits
    lines = [
        f"libfabric {version_string()} (pyfi needs FI_RMA|FI_READ|FI_WRITE|FI_REMOTE_READ "
        "on an FI_EP_RDM endpoint)"
    ]
    for fit in fits:
        lines.append(f"  {fit.provider:<14} {'fits' if fit.fits else 'no'}")
        if fit.fits and fit.info is not None:
            i = fit.info
            lines.append(
                f"      fabric {i.fabric}, domains {', '.join(fit.domains)}; "
                f"mr_mode {'|'.join(i.mr_mode) or '0 (offsets, chosen keys)'}; "
                f"progress {i.data_progress}; max msg {i.max_msg_size}"
            )
        else:
            lines.append(f"      {fit.reason}")
    chosen = [f.provider for f in fits if f.fits]
    try:
        lines.append(f"Provider used by default: {choose_provider(fitting=tuple(chosen))}")
    except Exception as exc:  # noqa: BLE001 - report, don't fail the report
        lines.append(f"No provider fits: {exc}")
    return "\n".join(lines)


def fabric_info_main(args: object = None) -> int:
    """`raydl fabric-info`: print the diagnosis; 0 when some provider fits."""
    del args  # no options yet
    fits = [] if _lib.unavailable_reason() is not None else diagnose()
    print(format_diagnosis(fits))
    return 0 if any(f.fits for f in fits) else 1
