"""The binding objects: ordered idempotent close, no fd leaks, -FI_E... -> FabricError, keys."""
from __future__ import annotations

import os

import pytest

from raydl.errors import FabricError
from raydl.native import pyfi
from raydl.native.pyfi._lib import load

if not pyfi.available():
    pytest.skip(f"libfabric unavailable: {pyfi.unavailable_reason()}", allow_module_level=True)

pytestmark = pytest.mark.timeout(60)


def _open_stack(provider: str):
    with pyfi.getinfo(provider, node="127.0.0.1", source=True) as infos:
        fabric = pyfi.Fabric(infos[0])
        domain = fabric.domain(infos[0])
        cq = domain.cq()
        av = domain.av()
        ep = domain.endpoint(infos[0], cq=cq, av=av)
    return fabric, domain, cq, av, ep


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_open_close_cycles_leak_no_fds(provider):
    """50 fabric/domain/cq/av/endpoint/MR open-close cycles leave the process's fd count as it was."""
    _, lib = load()
    fabric, *_ = _open_stack(provider)  # first use loads provider libraries and may open fds once
    fabric.close()
    before = _fds()
    for _ in range(50):
        fabric, domain, cq, av, ep = _open_stack(provider)
        mr = domain.register(bytearray(4096), access=lib.FI_REMOTE_READ)
        assert ep.name()
        mr.close()
        ep.close()
        av.close()
        cq.close()
        domain.close()
        fabric.close()
    assert _fds() == before


def test_closing_the_fabric_closes_the_tree_and_close_is_idempotent(provider):
    """Closing a fabric closes its endpoint, queues, regions and domain first; closing again is a no-op."""
    _, lib = load()
    fabric, domain, cq, av, ep = _open_stack(provider)
    mr = domain.register(bytearray(64), access=lib.FI_REMOTE_READ)
    fabric.close()
    assert all(obj.closed for obj in (fabric, domain, cq, av, ep, mr))
    fabric.close()
    ep.close()
    mr.close()


def test_closing_a_queue_closes_the_endpoint_bound_to_it(provider):
    """An endpoint is closed before the completion queue it is bound to (no -FI_EBUSY)."""
    fabric, domain, cq, av, ep = _open_stack(provider)
    with fabric:
        cq.close()
        assert ep.closed and not av.closed and not domain.closed


def test_context_managers_close_in_reverse_order(provider):
    """Nested with-blocks close each object on exit."""
    with pyfi.getinfo(provider, node="127.0.0.1", source=True) as infos:
        with pyfi.Fabric(infos[0]) as fabric, fabric.domain(infos[0]) as domain:
            with domain.cq() as cq, domain.av() as av, domain.endpoint(infos[0], cq=cq, av=av) as ep:
                pass
    assert ep.closed and cq.closed and av.closed and domain.closed and fabric.closed


def test_duplicate_mr_key_is_a_fabric_error_naming_the_call(provider):
    """Registering two regions with the same requested key (mr_mode 0) raises FabricError(-FI_ENOKEY) from fi_mr_reg."""
    _, lib = load()
    fabric, domain, *_ = _open_stack(provider)
    with fabric:
        if domain.mr_mode & lib.FI_MR_PROV_KEY:
            pytest.skip(f"{provider} chooses the keys itself")
        domain.register(bytearray(64), access=lib.FI_REMOTE_READ, key=1234)
        with pytest.raises(FabricError) as info:
            domain.register(bytearray(64), access=lib.FI_REMOTE_READ, key=1234)
    err = info.value
    assert err.call == "fi_mr_reg" and err.code == lib.FI_ENOKEY
    assert err.strerror == "Required key not available" and err.strerror in str(err)
    assert "FI_ENOKEY" in str(err) and "fi_mr_reg" in str(err)


def test_unknown_provider_is_fi_enodata():
    """fi_getinfo for a provider that does not exist raises FabricError(-FI_ENODATA) naming fi_getinfo."""
    _, lib = load()
    with pytest.raises(FabricError) as info:
        pyfi.getinfo("no-such-provider")
    assert info.value.call == "fi_getinfo" and info.value.code == lib.FI_ENODATA
    assert "No data available" in str(info.value)


def test_using_a_closed_object_is_a_fabric_error(provider):
    """A call on a closed endpoint raises FabricError instead of touching freed memory."""
    fabric, domain, cq, av, ep = _open_stack(provider)
    fabric.close()
    with pytest.raises(FabricError, match="closed"):
        ep.name()


def test_keys_are_unique_and_unpredictable(provider):
    """Regions in one domain, and regions of separate serves, get distinct random 64-bit keys."""
    _, lib = load()
    fabric, domain, *_ = _open_stack(provider)
    with fabric:
        keys = [domain.register(bytearray(64), access=lib.FI_REMOTE_READ).key for _ in range(50)]
    assert len(set(keys)) == 50
    served = []
    for _ in range(5):
        with pyfi.serve(bytearray(64), provider=provider) as server:
            served.append(server.address.key)
    assert len(set(served)) == 5
    if not domain.mr_mode & lib.FI_MR_PROV_KEY:
        assert max(keys + served) > 2**32  # drawn from 64 bits, not a counter


def test_endpoint_listens_on_loopback(provider):
    """serve(bind='127.0.0.1:0') puts the endpoint on 127.0.0.1 with a port the OS chose."""
    with pyfi.serve(bytearray(64), provider=provider, bind="127.0.0.1:0") as server:
        assert server.address.peer.startswith(f"{provider}@127.0.0.1:")
        assert not server.address.peer.endswith(":0")


def test_once_the_exit_gate_closes_no_call_enters_libfabric(provider, monkeypatch):
    """After the exit gate closes (atexit), set-up calls are a FabricError (ESHUTDOWN) and close() leaves the
    object to libfabric's own teardown, counting nobody inside: an fi_close racing fi_fini crashed a child."""
    import errno

    from raydl.native.pyfi import _lifecycle, _objects

    gate = _lifecycle.Gate()
    monkeypatch.setattr(_objects, "GATE", gate)
    _, lib = load()
    fabric, domain, cq, av, ep = _open_stack(provider)
    mr = domain.register(bytearray(64), access=lib.FI_REMOTE_READ)
    assert gate.close(timeout=1.0)
    with pytest.raises(FabricError) as info:
        domain.register(bytearray(64), access=lib.FI_REMOTE_READ)
    assert info.value.code == errno.ESHUTDOWN and "fi_mr_reg" in str(info.value)
    with pytest.raises(FabricError, match="fi_getinfo"):
        pyfi.getinfo(provider, node="127.0.0.1", source=True)
    fabric.close()  # the whole tree, without entering libfabric
    assert all(obj.closed for obj in (fabric, domain, cq, av, ep, mr)) and gate.close(timeout=0.1)
