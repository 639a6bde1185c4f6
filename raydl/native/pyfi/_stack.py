"""What both ends of a transfer share: the address a server hands out, and the
stack each side opens (fabric -> domain -> cq + av -> enabled RDM endpoint).

Remote addresses are `base + offset`: base is the region's virtual address
when the provider sets FI_MR_VIRT_ADDR (efa, verbs) and 0 when it does not
(tcp;ofi_rxm, sockets: offsets, application-chosen keys).
"""

from __future__ import annotations

import functools
import ipaddress
import socket
import struct
from dataclasses import dataclass

from raydl.native.pyfi._lib import load
from raydl.native.pyfi._objects import AddressVector, CompletionQueue, Domain, Endpoint, Fabric, getinfo


@dataclass(frozen=True)
class FabricAddress:
    """What a client needs to reach a served region; small and picklable."""

    provider: str
    fabric: str
    raw: bytes  # the server endpoint's fi_getname bytes
    key: int  # the region's MR key
    base: int  # added to offsets: a virtual address (FI_MR_VIRT_ADDR) or 0
    size: int
    writable: bool
    host: str | None  # the host the server bound to, e.g. "127.0.0.1"; None: any

    @property
    def peer(self) -> str:
        return describe_peer(self.provider, self.raw)

    def __repr__(self) -> str:
        return f"FabricAddress({self.peer}, size={self.size}, {'writable' if self.writable else 'read-only'})"


def describe_peer(provider: str, raw: bytes) -> str:
    """'tcp;ofi_rxm@127.0.0.1:43121' for socket addresses, else a hex prefix."""
    family = struct.unpack_from("<H", raw)[0] if len(raw) >= 2 else -1
    if family == socket.AF_INET and len(raw) >= 8:
        port = struct.unpack_from(">H", raw, 2)[0]
        return f"{provider}@{socket.inet_ntop(socket.AF_INET, raw[4:8])}:{port}"
    if family == socket.AF_INET6 and len(raw) >= 24:
        port = struct.unpack_from(">H", raw, 2)[0]
        return f"{provider}@[{socket.inet_ntop(socket.AF_INET6, raw[8:24])}]:{port}"
    return f"{provider}@{raw[:16].hex()}"


def socket_host(raw: bytes) -> str | None:
    """The IP address in an endpoint name that is a socket address (tcp, sockets), else None (efa, verbs)."""
    family = struct.unpack_from("<H", raw)[0] if len(raw) >= 2 else -1
    if family == socket.AF_INET and len(raw) >= 8:
        return socket.inet_ntop(socket.AF_INET, raw[4:8])
    if family == socket.AF_INET6 and len(raw) >= 24:
        return socket.inet_ntop(socket.AF_INET6, raw[8:24])
    return None


@functools.lru_cache(maxsize=256)
def route_source(host: str) -> str | None:
    """The local address the kernel would send from to reach `host` (no packet is sent: a UDP socket's
    connect() only picks the route), or None when there is no route."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def parse_bind(bind: str | None) -> tuple[str | None, str | None]:
    if not bind:
        return None, None
    host, sep, port = bind.rpartition(":")
    if not sep:
        return bind, None
    host = host.strip("[]") or None
    return host, (None if port in ("", "0") else port)


def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Stack:
    """fabric -> domain -> cq, av -> enabled RDM endpoint, for one provider."""

    def __init__(
        self,
        provider: str,
        *,
        host: str | None,
        service: str | None,
        fabric_name: str | None = None,
        wait: bool,
    ) -> None:
        with getinfo(provider, node=host, service=service, source=host is not None) as infos:
            entries = [
                e
                for e in infos
                if fabric_name is None or load()[0].string(e.fabric_attr.name).decode() == fabric_name
            ]
            entry = (entries or list(infos))[0]
            self.fabric = Fabric(entry)
            try:
                self.domain = Domain(self.fabric, entry)
                self.cq: CompletionQueue = self.domain.cq(wait=wait)
                self.av: AddressVector = self.domain.av()
                self.ep: Endpoint = self.domain.endpoint(entry, cq=self.cq, av=self.av)
            except BaseException:
                self.fabric.close()
                raise
        self.provider = self.domain.info.provider
        self.fabric_name = self.domain.info.fabric

    def close(self) -> None:
        self.fabric.close()  # closes the tree beneath it, newest first
