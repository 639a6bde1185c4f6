"""What this machine's libfabric offers: info(), diagnose(), and the provider choice.

`choose_provider` is a pure function of (argument, environment, what fits);
`diagnose` asks fi_getinfo once per known provider with pyfi's full hints and,
when that finds nothing, loosens one requirement at a time to say exactly which
one the provider lacks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from raydl.errors import FabricError
from raydl.native.pyfi._env import fabric_env
from raydl.native.pyfi._lib import load, unavailable_reason
from raydl.native.pyfi._objects import (
    MR_MODE_BITS,
    ProviderInfo,
    decode_mr_mode,
    getinfo,
    rma_caps,
    supported_mode,
    supported_mr_mode,
)

# Production first (efa, verbs), then the loopback-capable software providers.
KNOWN_PROVIDERS = ("efa", "verbs;ofi_rxm", "tcp;ofi_rxm", "sockets")


@dataclass(frozen=True)
class ProviderFit:
    """Whether one provider can carry pyfi's transfers here, and if not why."""

    provider: str
    fits: bool
    reason: str
    info: ProviderInfo | None = None
    domains: tuple[str, ...] = field(default=())


def info() -> list[ProviderInfo]:
    """Every fi_info entry with RMA capability (any endpoint type, any mr_mode),
    without duplicates. FabricError when the bindings are unavailable."""
    load()
    try:
        with getinfo(
            None, caps=load()[1].FI_RMA, ep_rdm=False, mr_mode=_all_mr_bits(), mode=_all_mode_bits()
        ) as infos:
            snaps = infos.snapshots()
    except FabricError as exc:
        if exc.code == _enodata():
            return []
        raise
    return list(dict.fromkeys(snaps))


def diagnose(providers: tuple[str, ...] = KNOWN_PROVIDERS) -> list[ProviderFit]:
    """For each provider: fits (FI_RMA|FI_READ|FI_WRITE|FI_REMOTE_READ, FI_EP_RDM,
    an mr_mode and mode pyfi handles), or exactly why not."""
    reason = unavailable_reason()
    if reason is not None:
        return [ProviderFit(p, False, reason) for p in providers]
    return [_diagnose_one(p) for p in providers]


def _diagnose_one(provider: str) -> ProviderFit:
    _, lib = load()
    full = _probe(provider)
    if isinstance(full, list):
        return ProviderFit(provider, True, "fits", full[0], tuple(dict.fromkeys(i.domain for i in full)))
    steps = [
        (
            dict(caps=0, ep_rdm=False, mr_mode=_all_mr_bits(), mode=_all_mode_bits()),
            "not available: libfabric has no such provider built in, or it found no device for it",
        ),
        (
            dict(caps=0, ep_rdm=True, mr_mode=_all_mr_bits(), mode=_all_mode_bits()),
            "has no FI_EP_RDM (reliable datagram) endpoint",
        ),
        (
            dict(caps=lib.FI_RMA, ep_rdm=True, mr_mode=_all_mr_bits(), mode=_all_mode_bits()),
            "has no RMA (FI_RMA) on an RDM endpoint",
        ),
        (
            dict(caps=rma_caps(), ep_rdm=True, mr_mode=_all_mr_bits(), mode=_all_mode_bits()),
            "lacks one of FI_READ, FI_WRITE, FI_REMOTE_READ, FI_REMOTE_WRITE on an RDM endpoint",
        ),
    ]
    for hints, why in steps:
        found = _probe(provider, **hints)
        if not isinstance(found, list):
            return ProviderFit(provider, False, f"{why} ({found})")
    loose = _probe(provider, caps=rma_caps(), ep_rdm=True, mr_mode=_all_mr_bits(), mode=supported_mode())
    if not isinstance(loose, list):
        return ProviderFit(
            provider,
            False,
            f"requires mode bits pyfi does not honour (it supports FI_CONTEXT, FI_CONTEXT2) ({loose})",
        )
    needed = sorted({bit for i in loose for bit in decode_mr_mode(i.mr_mode_bits & ~supported_mr_mode())})
    return ProviderFit(
        provider,
        False,
        "requires mr_mode "
        + ", ".join(needed or ["(unknown)"])
        + ", which pyfi does not handle (it handles FI_MR_LOCAL, FI_MR_VIRT_ADDR, "
        "FI_MR_ALLOCATED, FI_MR_PROV_KEY)",
        loose[0],
    )


def _probe(provider: str, **hints) -> list[ProviderInfo] | str:
    """The entries fi_getinfo returns for these hints, or its error text."""
    try:
        with getinfo(provider, **hints) as infos:
            return infos.snapshots()
    except FabricError as exc:
        return f"fi_getinfo: {exc.strerror}"


def _all_mr_bits() -> int:
    """Every mr_mode bit (FI_MR_LOCAL ... FI_MR_COLLECTIVE), not the old
    FI_MR_BASIC/FI_MR_SCALABLE values 1 and 2, which fi_getinfo refuses in a mask."""
    _, lib = load()
    return functools.reduce(lambda acc, name: acc | getattr(lib, name), MR_MODE_BITS, 0)


def _all_mode_bits() -> int:
    return (2**64) - 1


def _enodata() -> int:
    return load()[1].FI_ENODATA


@functools.lru_cache(maxsize=1)
def _diagnosis() -> tuple[ProviderFit, ...]:
    return tuple(diagnose())


def _fits() -> tuple[str, ...]:
    return tuple(fit.provider for fit in _diagnosis() if fit.fits)


def no_fit_reason() -> str | None:
    """Why no provider can be used (the bindings loaded), or None when one can:
    RAYDL_FABRIC_PROVIDER's provider must fit; else one of KNOWN_PROVIDERS."""
    env_provider = fabric_env().provider
    if env_provider:
        (fit,) = _diagnose_cached(env_provider)
        return None if fit.fits else f"RAYDL_FABRIC_PROVIDER={env_provider} does not fit here: {fit.reason}"
    if _fits():
        return None
    return "no RMA-capable libfabric provider fits here: " + "; ".join(
        f"{fit.provider}: {fit.reason}" for fit in _diagnosis()
    )


@functools.lru_cache(maxsize=8)
def _diagnose_cached(provider: str) -> tuple[ProviderFit, ...]:
    return tuple(diagnose((provider,)))


def choose_provider(
    provider: str | None = None, *, env_provider: str | None = None, fitting: tuple[str, ...] | None = None
) -> str:
    """The provider to use: the argument, else RAYDL_FABRIC_PROVIDER, else the
    first of KNOWN_PROVIDERS that fits here. Pure when env_provider and fitting
    are given; otherwise they are read (the fit once per process)."""
    if provider:
        return provider
    env_provider = env_provider if env_provider is not None else fabric_env().provider
    if env_provider:
        return env_provider
    if fitting is None:
        load()
        fitting = _fits()
    for name in KNOWN_PROVIDERS:
        if name in fitting:
            return name
    raise FabricError(
        "no RMA-capable libfabric provider fits here (tried "
        + ", ".join(KNOWN_PROVIDERS)
        + "); run `raydl fabric-info` for why",
        call="fi_getinfo",
        code=61,
        strerror="No data available",
    )
