"""Small Python objects over libfabric's: Fabric, Domain, CompletionQueue,
AddressVector, Endpoint, MemoryRegion (and InfoList, fi_getinfo's answer).

Each owns one fid. `close()` is idempotent and closes first whatever depends
on the object, newest first (an endpoint before the queue it is bound to, a
domain's regions and endpoints before the domain), so closing a Fabric closes
the whole tree in reverse order of creation. Every object is a context
manager, and `__del__` closes what a caller forgot. Every negative -FI_E...
return raises raydl.errors.FabricError naming the call.
"""

from __future__ import annotations

import os
import secrets
import threading
from dataclasses import dataclass
from typing import Any

from raydl.errors import FabricError
from raydl.native.pyfi._buffers import Span, as_span
from raydl.native.pyfi._lib import api_version, check, load, loaded
from raydl.native.pyfi._lifecycle import GATE

# Every wait inside libfabric is bounded by this, so a thread is never stuck in there (see _lifecycle).
MAX_WAIT_S = 0.1

EP_TYPES = {
    0: "FI_EP_UNSPEC",
    1: "FI_EP_MSG",
    2: "FI_EP_DGRAM",
    3: "FI_EP_RDM",
    4: "FI_EP_SOCK_STREAM",
    5: "FI_EP_SOCK_DGRAM",
}
PROGRESS = {0: "unspec", 1: "auto", 2: "manual"}
MR_MODE_BITS = (
    "FI_MR_LOCAL",
    "FI_MR_RAW",
    "FI_MR_VIRT_ADDR",
    "FI_MR_ALLOCATED",
    "FI_MR_PROV_KEY",
    "FI_MR_MMU_NOTIFY",
    "FI_MR_RMA_EVENT",
    "FI_MR_ENDPOINT",
    "FI_MR_HMEM",
    "FI_MR_COLLECTIVE",
)


def rma_caps() -> int:
    """What pyfi needs of a provider: one-sided reads and writes, both sides."""
    _, lib = load()
    return lib.FI_RMA | lib.FI_READ | lib.FI_WRITE | lib.FI_REMOTE_READ | lib.FI_REMOTE_WRITE


def supported_mr_mode() -> int:
    """mr_mode bits pyfi handles: it registers every local buffer and passes its
    descriptor (LOCAL), sends base addresses (VIRT_ADDR), reads keys back (PROV_KEY),
    and only registers allocated memory (ALLOCATED). Not handled: ENDPOINT
    (fi_mr_bind), RAW (keys over 64 bits), MMU_NOTIFY, RMA_EVENT, HMEM."""
    _, lib = load()
    return lib.FI_MR_LOCAL | lib.FI_MR_VIRT_ADDR | lib.FI_MR_ALLOCATED | lib.FI_MR_PROV_KEY


def supported_mode() -> int:
    """Mode bits pyfi honours: every operation's context is a struct fi_context2."""
    _, lib = load()
    return lib.FI_CONTEXT | lib.FI_CONTEXT2


def decode_mr_mode(bits: int) -> tuple[str, ...]:
    _, lib = load()
    return tuple(name for name in MR_MODE_BITS if bits & getattr(lib, name))


def _text(ffi: Any, ptr: Any) -> str:
    return ffi.string(ptr).decode(errors="replace") if ptr != ffi.NULL else ""


@dataclass(frozen=True)
class ProviderInfo:
    """A Python snapshot of one fi_info entry."""

    provider: str
    fabric: str
    domain: str
    ep_type: str
    caps: int
    mode: int
    mr_mode: tuple[str, ...]
    mr_mode_bits: int
    mr_key_size: int
    max_msg_size: int
    data_progress: str
    addr_format: int
    api_version: str


class Closeable:
    """Context manager and garbage-collection cleanup for anything with an idempotent close()."""

    def close(self) -> None:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - best effort at collection or interpreter shutdown
            pass


class InfoList(Closeable):
    """fi_getinfo's answer (a linked list), freed with fi_freeinfo on close."""

    def __init__(self, head: Any) -> None:
        self._head = head
        self._entries = []
        ffi, _ = load()
        node = head
        while node != ffi.NULL:
            self._entries.append(node)
            node = node.next

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, i: int) -> Any:
        """The i-th `struct fi_info *` (valid until close())."""
        return self._entries[i]

    def snapshots(self) -> list[ProviderInfo]:
        return [snapshot(entry) for entry in self._entries]

    def close(self) -> None:
        if self._head is not None:
            _, lib = load()
            with GATE.unless_exiting() as entered:
                if entered:
                    lib.fi_freeinfo(self._head)
            self._head, self._entries = None, []


def snapshot(entry: Any) -> ProviderInfo:
    ffi, lib = load()
    dom, fab, ep = entry.domain_attr, entry.fabric_attr, entry.ep_attr
    api = fab.api_version
    return ProviderInfo(
        provider=_text(ffi, fab.prov_name),
        fabric=_text(ffi, fab.name),
        domain=_text(ffi, dom.name),
        ep_type=EP_TYPES.get(int(ep.type), str(int(ep.type))),
        caps=int(entry.caps),
        mode=int(entry.mode),
        mr_mode=decode_mr_mode(dom.mr_mode),
        mr_mode_bits=int(dom.mr_mode),
        mr_key_size=int(dom.mr_key_size),
        max_msg_size=int(ep.max_msg_size),
        data_progress=PROGRESS.get(int(dom.data_progress), str(int(dom.data_progress))),
        addr_format=int(entry.addr_format),
        api_version=f"{api >> 16}.{api & 0xFFFF}",
    )


def getinfo(
    provider: str | None = None,
    *,
    node: str | None = None,
    service: str | None = None,
    source: bool = False,
    caps: int | None = None,
    ep_rdm: bool = True,
    mr_mode: int | None = None,
    mode: int | None = None,
) -> InfoList:
    """fi_getinfo with pyfi's hints: RMA caps, an RDM endpoint, the mr_mode and
    mode bits pyfi supports (each overridable). `source=True` passes FI_SOURCE so
    node/service name the local address to listen on."""
    with GATE.inside("fi_getinfo"):
        return _getinfo(provider, node, service, source, caps, ep_rdm, mr_mode, mode)


def _getinfo(
    provider: str | None,
    node: str | None,
    service: str | None,
    source: bool,
    caps: int | None,
    ep_rdm: bool,
    mr_mode: int | None,
    mode: int | None,
) -> InfoList:
    ffi, lib = load()
    hints = lib.fi_allocinfo()
    if hints == ffi.NULL:
        raise FabricError("fi_allocinfo failed: out of memory", call="fi_allocinfo")
    try:
        hints.caps = rma_caps() if caps is None else caps
        hints.mode = supported_mode() if mode is None else mode
        if ep_rdm:
            hints.ep_attr.type = lib.FI_EP_RDM
        hints.domain_attr.mr_mode = supported_mr_mode() if mr_mode is None else mr_mode
        check(lib.pyfi_set_prov_name(hints, provider.encode() if provider else ffi.NULL), "strdup")
        out = ffi.new("struct fi_info **")
        rc = lib.fi_getinfo(
            api_version(),
            node.encode() if node else ffi.NULL,
            service.encode() if service else ffi.NULL,
            lib.FI_SOURCE if source else 0,
            hints,
            out,
        )
        check(
            rc,
            "fi_getinfo",
            detail=f"provider {provider or 'any'}"
            + (f", node {node}:{service or '*'}" if node or service else ""),
        )
        return InfoList(out[0])
    finally:
        lib.fi_freeinfo(hints)


class _Fid(Closeable):
    """One libfabric object; `close()` closes its dependents first, newest first."""

    kind = "fid"
    _ptr: Any = None  # a half-built object (its open call failed) closes as a no-op

    def __init__(self, ptr: Any, parents: tuple[_Fid, ...] = ()) -> None:
        self._ptr = ptr
        self._dependents: list[_Fid] = []
        self._parents = parents
        for parent in parents:
            parent._dependents.append(self)

    @property
    def closed(self) -> bool:
        return self._ptr is None

    @property
    def ptr(self) -> Any:
        if self._ptr is None:
            raise FabricError(f"{self.kind} is closed", call=self.kind, code=9, strerror="closed")
        return self._ptr

    def close(self) -> None:
        if self._ptr is None:
            return
        for child in reversed(list(self._dependents)):
            child.close()
        ffi, lib = loaded()
        ptr, self._ptr = self._ptr, None
        for parent in self._parents:
            if self in parent._dependents:
                parent._dependents.remove(self)
        with GATE.unless_exiting() as entered:
            if entered:  # else libfabric's fi_fini frees it: an fi_close now could race that
                check(lib.fi_close(ffi.cast("struct fid *", ptr)), f"fi_close({self.kind})")
        self._after_close()

    def _after_close(self) -> None:
        pass


class Fabric(_Fid):
    """fi_fabric over an fi_info entry's fabric attributes."""

    kind = "fabric"

    def __init__(self, entry: Any) -> None:
        ffi, lib = load()
        out = ffi.new("struct fid_fabric **")
        with GATE.inside("fi_fabric"):
            check(lib.fi_fabric(entry.fabric_attr, out, ffi.NULL), "fi_fabric")
        super().__init__(out[0])

    def domain(self, entry: Any) -> Domain:
        return Domain(self, entry)


class Domain(_Fid):
    """fi_domain; remembers the mr_mode and key size the provider returned."""

    kind = "domain"

    def __init__(self, fabric: Fabric, entry: Any) -> None:
        ffi, lib = load()
        out = ffi.new("struct fid_domain **")
        with GATE.inside("fi_domain"):
            check(lib.fi_domain(fabric.ptr, entry, out, ffi.NULL), "fi_domain")
        super().__init__(out[0], (fabric,))
        self.info = snapshot(entry)
        self.mr_mode = self.info.mr_mode_bits
        # FI_THREAD_SAFE (tcp;ofi_rxm, sockets): any thread may use the domain's objects at once;
        # otherwise (FI_THREAD_DOMAIN ...) the application serializes access to them.
        self.thread_safe = int(entry.domain_attr.threading) == int(lib.FI_THREAD_SAFE)

    def cq(self, size: int = 0, *, wait: bool = False) -> CompletionQueue:
        return CompletionQueue(self, size, wait=wait)

    def av(self, count: int = 0) -> AddressVector:
        return AddressVector(self, count)

    def endpoint(self, entry: Any, *, cq: CompletionQueue, av: AddressVector) -> Endpoint:
        return Endpoint(self, entry, cq=cq, av=av)

    def register(self, buf: Any, *, access: int, key: int | None = None) -> MemoryRegion:
        return MemoryRegion(self, buf, access=access, key=key)

    def random_key(self, *, fresh: bool = False) -> int:
        """An unpredictable key of the domain's key size (at most 64 bits); fresh=True: also one this
        process never gave out before (a region peers may access: its key is their secret)."""
        bits = 8 * min(self.info.mr_key_size or 8, 8)
        return _KEYS.draw(bits) if fresh else secrets.randbits(bits)


class _IssuedKeys:
    """Keys of regions peers may access: drawn at random (secrets), never the same twice in this
    process. Only these are remembered (8 bytes-ish each, one per served region), not the keys of a
    client's local registrations."""

    def __init__(self) -> None:
        self._issued: set[int] = set()
        self._lock = threading.Lock()

    def draw(self, bits: int) -> int:
        with self._lock:
            while True:
                key = secrets.randbits(bits)
                if key and key not in self._issued:
                    self._issued.add(key)
                    return key

    def after_fork(self) -> None:
        self._lock = threading.Lock()  # the parent's may have been held by another thread


_KEYS = _IssuedKeys()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_KEYS.after_fork)


@dataclass(frozen=True)
class CompletionError:
    """One fi_cq_readerr entry."""

    context: int
    code: int
    prov_errno: int
    text: str


class CompletionQueue(_Fid):
    """fi_cq_open in context format.

    With `wait=True` it asks for a wait object (FI_WAIT_UNSPEC) so `wait()` can
    block in fi_cq_sread until the provider sees activity, which for tcp and
    sockets also drives their progress: an idle server then costs no CPU.
    Providers without wait objects get a polled queue (`waitable` False)."""

    kind = "cq"

    def __init__(self, domain: Domain, size: int = 0, *, wait: bool = False) -> None:
        ffi, lib = load()
        attr = ffi.new("struct fi_cq_attr *")
        attr.size = size
        attr.format = lib.FI_CQ_FORMAT_CONTEXT
        attr.wait_obj = lib.FI_WAIT_UNSPEC if wait else lib.FI_WAIT_NONE
        out = ffi.new("struct fid_cq **")
        with GATE.inside("fi_cq_open"):
            rc = lib.fi_cq_open(domain.ptr, attr, out, ffi.NULL)
            if wait and rc < 0:  # no wait objects here: fall back to a polled queue
                attr.wait_obj = lib.FI_WAIT_NONE
                rc = lib.fi_cq_open(domain.ptr, attr, out, ffi.NULL)
                wait = False
        check(rc, "fi_cq_open")
        super().__init__(out[0], (domain,))
        self.waitable = wait
        self._entries = ffi.new("struct fi_cq_entry[]", 64)

    def poll(
        self, *, timeout_s: float = 0.0, spin: int = 0, sleep_us: int = 0
    ) -> tuple[list[int], list[CompletionError]]:
        """Completed operations' contexts (as integers) and error completions.

        Waits up to timeout_s for the first one (polling in C, GIL released),
        sleeping sleep_us between polls after `spin` back-to-back polls; polling
        is also what drives a manual-progress provider's transfers."""
        _, lib = loaded()
        with GATE.inside("fi_cq_read"):
            rc = lib.pyfi_cq_wait(
                self.ptr,
                self._entries,
                len(self._entries),
                int(min(timeout_s, MAX_WAIT_S) * 1e6),
                spin,
                sleep_us,
            )
            return self._completions(rc, "fi_cq_read")

    def wait(self, timeout_s: float) -> tuple[list[int], list[CompletionError]]:
        """Like poll(), blocking in fi_cq_sread (a waitable queue only); a
        provider that turns out not to support it makes the queue polled."""
        _, lib = loaded()
        if not self.waitable:
            return self.poll(timeout_s=timeout_s, sleep_us=50)
        with GATE.inside("fi_cq_sread"):
            rc = lib.fi_cq_sread(
                self.ptr,
                self._entries,
                len(self._entries),
                loaded()[0].NULL,
                max(1, int(min(timeout_s, MAX_WAIT_S) * 1000)),
            )
            if rc in (-lib.FI_ENOSYS, -lib.FI_EOPNOTSUPP):
                self.waitable = False
                return [], []
            if rc in (-lib.FI_ETIMEDOUT, -lib.FI_ECANCELED):  # FI_ECANCELED: woken by signal() (sockets)
                return [], []
            return self._completions(rc, "fi_cq_sread")

    def signal(self) -> None:
        """Wake a thread blocked in wait() now (fi_cq_signal), so a closing server need not wait out
        its slice (up to 50 ms). A module built before this binding, or a provider without it: no-op."""
        _, lib = loaded()
        fn = getattr(lib, "fi_cq_signal", None)
        if fn is not None and self.waitable:
            fn(self.ptr)  # its error, if any, only means the waiter wakes at the end of its slice

    def _completions(self, rc: int, call: str) -> tuple[list[int], list[CompletionError]]:
        ffi, lib = loaded()
        if rc == -lib.FI_EAGAIN:
            return [], []
        if rc == -lib.FI_EAVAIL:
            return [], self._read_errors()
        check(rc, call)
        return [int(ffi.cast("uintptr_t", self._entries[i].op_context)) for i in range(rc)], []

    def _read_errors(self) -> list[CompletionError]:
        ffi, lib = loaded()
        errors = []
        for _ in range(64):
            err = ffi.new("struct fi_cq_err_entry *")
            rc = lib.fi_cq_readerr(self.ptr, err, 0)
            if rc == -lib.FI_EAGAIN or rc == 0:
                break
            check(rc, "fi_cq_readerr")
            buf = ffi.new("char[]", 256)
            text = lib.fi_cq_strerror(self.ptr, err.prov_errno, err.err_data, buf, len(buf))
            errors.append(
                CompletionError(
                    context=int(ffi.cast("uintptr_t", err.op_context)),
                    code=int(err.err),
                    prov_errno=int(err.prov_errno),
                    text=_text(ffi, text) if text != ffi.NULL else "",
                )
            )
        return errors


class AddressVector(_Fid):
    """fi_av_open (table); `insert(raw)` returns the peer's fi_addr_t."""

    kind = "av"

    def __init__(self, domain: Domain, count: int = 0) -> None:
        ffi, lib = load()
        attr = ffi.new("struct fi_av_attr *")
        attr.type = lib.FI_AV_UNSPEC  # the provider's choice; pyfi only keeps the fi_addr_t
        attr.count = count
        out = ffi.new("struct fid_av **")
        with GATE.inside("fi_av_open"):
            check(lib.fi_av_open(domain.ptr, attr, out, ffi.NULL), "fi_av_open")
        super().__init__(out[0], (domain,))

    def insert(self, raw: bytes, *, peer: str | None = None) -> int:
        ffi, lib = loaded()
        addr = ffi.new("fi_addr_t *")
        with GATE.inside("fi_av_insert"):
            rc = lib.fi_av_insert(self.ptr, raw, 1, addr, 0, ffi.NULL)
        check(rc, "fi_av_insert", peer=peer)
        if rc != 1:
            raise FabricError(
                f"fi_av_insert inserted {rc} of 1 address (peer {peer})",
                call="fi_av_insert",
                code=22,
                strerror="address not inserted",
            )
        return int(addr[0])


class Endpoint(_Fid):
    """An RDM endpoint bound to a CQ (transmit and receive) and an AV, enabled."""

    kind = "ep"

    def __init__(self, domain: Domain, entry: Any, *, cq: CompletionQueue, av: AddressVector) -> None:
        ffi, lib = load()
        out = ffi.new("struct fid_ep **")
        with GATE.inside("fi_endpoint"):
            check(lib.fi_endpoint(domain.ptr, entry, out, ffi.NULL), "fi_endpoint")
        # Closing the cq, the av or the domain closes the endpoint first.
        super().__init__(out[0], (domain, cq, av))
        try:
            with GATE.inside("fi_enable"):
                check(lib.fi_ep_bind(self.ptr, ffi.cast("struct fid *", av.ptr), 0), "fi_ep_bind(av)")
                check(
                    lib.fi_ep_bind(self.ptr, ffi.cast("struct fid *", cq.ptr), lib.FI_TRANSMIT | lib.FI_RECV),
                    "fi_ep_bind(cq)",
                )
                check(lib.fi_enable(self.ptr), "fi_enable")
        except BaseException:
            self.close()
            raise

    def name(self) -> bytes:
        """fi_getname: the raw address peers insert into their AV."""
        ffi, lib = loaded()
        size = ffi.new("size_t *", 64)
        buf = ffi.new("char[]", 64)
        with GATE.inside("fi_getname"):
            rc = lib.fi_getname(ffi.cast("struct fid *", self.ptr), buf, size)
            if rc == -lib.FI_ETOOSMALL:
                buf = ffi.new("char[]", size[0])
                rc = lib.fi_getname(ffi.cast("struct fid *", self.ptr), buf, size)
        check(rc, "fi_getname")
        return bytes(ffi.buffer(buf, size[0]))


class MemoryRegion(_Fid):
    """fi_mr_reg over caller-owned memory (see _buffers.as_span).

    `key` is what a peer presents: the provider's (FI_MR_PROV_KEY), else the one
    requested, random when not given. `base` is what a peer adds offsets to: the
    buffer's virtual address under FI_MR_VIRT_ADDR, else 0 (offsets)."""

    kind = "mr"

    def __init__(self, domain: Domain, buf: Any, *, access: int, key: int | None = None) -> None:
        ffi, lib = loaded()
        writable = bool(access & (lib.FI_READ | lib.FI_REMOTE_WRITE | lib.FI_RECV))
        self._owns_span = not isinstance(buf, Span)
        self.span: Span = as_span(buf, writable=writable) if self._owns_span else buf
        prov_key = bool(domain.mr_mode & lib.FI_MR_PROV_KEY)
        remote = bool(access & (lib.FI_REMOTE_READ | lib.FI_REMOTE_WRITE))
        requested = 0 if prov_key else (domain.random_key(fresh=remote) if key is None else key)
        out = ffi.new("struct fid_mr **")
        try:
            with GATE.inside("fi_mr_reg"):
                check(
                    lib.fi_mr_reg(
                        domain.ptr, self.span.ptr, self.span.nbytes, access, 0, requested, 0, out, ffi.NULL
                    ),
                    "fi_mr_reg",
                    detail=f"{self.span.nbytes} bytes",  # never the key: it is a reader's secret
                )
        except BaseException:
            self._after_close()
            raise
        super().__init__(out[0], (domain,))
        self.key = int(lib.fi_mr_key(self.ptr))
        self.desc = lib.fi_mr_desc(self.ptr)
        self.base = self.span.address if domain.mr_mode & lib.FI_MR_VIRT_ADDR else 0
        self.size = self.span.nbytes

    def _after_close(self) -> None:
        if self._owns_span:
            self.span.release()


__all__ = [
    "AddressVector",
    "CompletionError",
    "CompletionQueue",
    "Domain",
    "Endpoint",
    "Fabric",
    "InfoList",
    "MemoryRegion",
    "ProviderInfo",
    "decode_mr_mode",
    "getinfo",
    "rma_caps",
    "snapshot",
    "supported_mode",
    "supported_mr_mode",
]
