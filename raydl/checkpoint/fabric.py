"""The fabric transport: pull a served checkpoint with pipelined one-sided reads, verifying as it lands.

FabricClient is a process's client side: it keeps connections to the holders
it has read from (opening one costs ~70 ms), one user at a time each. pull()
reads with pipelined one-sided reads and checks each chunk's digest as soon as
it has landed, on the reading thread while the next reads are in flight: the
bytes are still in cache then (XXH3-64 ran at 33 GB/s in cache against 3-11
GB/s from memory on this box), and no other thread competes for the cores.
When the reads stop making progress, pull() asks what became of the holder
(see object_store.holder_status): a dead or unpublished holder ends the pull
within about a second, naming it, instead of after the read timeout.
"""

from __future__ import annotations

import errno
import threading
import time
from typing import Any, Callable

import numpy as np

from raydl.checkpoint.layout import first_corrupt, first_tampered
from raydl.checkpoint.object_store import DEAD, UNPUBLISHED, holder_status
from raydl.checkpoint.ref import CheckpointRef
from raydl.errors import CheckpointError, FabricError

__all__ = ["FabricClient", "UpstreamPace", "pull", "verify"]

# What a provider answers a read of a region it does not serve under that key (rxm: ECANCELED,
# sockets: EACCES): a forged or stale ref, or a region revoked meanwhile
_REFUSED = (errno.ECANCELED, errno.EACCES, errno.EKEYREJECTED)
REFUSED_HINT = "the holder refused the read: no region of it matches the ref's memory key"
WATCH_EVERY_S = 1.0  # no completion for this long: ask whether the holder is still there
UPSTREAM_POLL_S = (
    0.003  # a broadcast peer's next look at its upstream's progress word, before it knows its pace
)
UPSTREAM_POLL_RANGE_S = (0.001, 0.02)  # ... and once it does: about one upstream chunk, within this range


class FabricClient:
    """This process's fabric client side: one pyfi.Client endpoint per (provider, fabric, host), opened
    by the first fetch that needs it, and a connection per holder read from (up to `max_connections`)
    on it."""

    def __init__(self, max_connections: int = 16) -> None:
        self._endpoints: dict[Any, Any] = {}  # Client.key -> pyfi.Client
        self._idle: dict[Any, Any] = {}  # FabricAddress -> Connection
        self._lock = threading.Lock()
        self._max = max_connections

    def connection(
        self,
        address,
        phases: dict[str, float] | None = None,
        *,
        timeout: float = 30.0,
        watchdog: Callable[[], None] | None = None,
    ) -> _Lease:
        """A context manager lending a connection to `address`; a failed transfer drops it.
        A new connection makes its first read now (timeout, watchdog as in pull)."""
        return _Lease(self, address, phases, timeout, watchdog)

    def _take(self, address, phases: dict[str, float] | None, timeout: float, watchdog):
        from raydl.native import pyfi

        with self._lock:
            conn = self._idle.pop(address, None)
        if conn is not None and not conn.closed:
            return conn
        t0 = time.perf_counter()
        key = pyfi.Client.key_for(address)
        with self._lock:
            client = self._endpoints.get(key)
        if client is None or client.closed:
            client = pyfi.Client(address.provider, host=key[2], fabric_name=address.fabric)
            with self._lock:
                self._endpoints[key] = client
        t1 = time.perf_counter()
        conn = client.connect(address)
        try:  # rxm connects on first use
            conn.read_into(
                np.empty(8, np.uint8),
                0,
                min(8, address.size),
                timeout=timeout,
                watchdog=watchdog,
                watch_every=WATCH_EVERY_S,
            )
        except BaseException:
            conn.close()
            raise
        if phases is not None:
            phases["setup"] = phases.get("setup", 0.0) + (t1 - t0)
            phases["connect"] = phases.get("connect", 0.0) + (time.perf_counter() - t1)
        return conn

    def _give_back(self, address, conn) -> None:
        with self._lock:
            old = self._idle.pop(address, None)
            self._idle[address] = conn
            extra = []
            while len(self._idle) > self._max:
                extra.append(self._idle.pop(next(iter(self._idle))))
        for c in [old, *extra]:
            if c is not None and c is not conn:
                c.close()

    def close(self) -> None:
        with self._lock:
            conns, self._idle = list(self._idle.values()), {}
            clients, self._endpoints = list(self._endpoints.values()), {}
        for c in conns:
            c.close()
        for c in clients:
            c.close()


class _Lease:
    def __init__(self, client: FabricClient, address, phases, timeout: float, watchdog) -> None:
        self._client, self._address, self._phases = client, address, phases
        self._timeout, self._watchdog = timeout, watchdog

    def __enter__(self):
        self._conn = self._client._take(self._address, self._phases, self._timeout, self._watchdog)
        return self._conn

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None or self._conn.closed:
            self._conn.close()
        else:
            self._client._give_back(self._address, self._conn)


def verify(buf: np.ndarray, ref: CheckpointRef, first: int, last: int, peer: str) -> None:
    """Check chunks [first, last) of buf against the ref's digests (SHA-256 when the ref carries them,
    else XXH3-64); CheckpointError naming peer and chunk."""
    if ref.sha256 is not None:
        bad = first_tampered(buf, ref.sha256, ref.chunk_size, first, last)
        if bad is not None:
            raise CheckpointError(
                f"checkpoint {ref.key[:8]}: chunk {bad} from {peer} does not match its sha256 digest "
                "(changed in flight or at the holder)"
            )
        return
    bad = first_corrupt(buf, ref.checksums, ref.chunk_size, first, last)
    if bad is not None:
        i, got = bad
        raise CheckpointError(
            f"checkpoint {ref.key[:8]}: chunk {i} from {peer} is corrupt "
            f"(xxh3-64 {got:#018x}, expected {ref.checksums[i]:#018x})"
        )


def holder_watchdog(ref: CheckpointRef) -> Callable[[], None]:
    """Raises CheckpointError when the holder of `ref` is dead or no longer serves it."""

    def watch() -> None:
        state = holder_status(ref.location)
        if state == DEAD:
            raise CheckpointError(
                f"checkpoint {ref.key[:8]}: its holder {ref.holder} ({ref.fabric.peer}) is dead"
            )
        if state == UNPUBLISHED:
            raise CheckpointError(
                f"checkpoint {ref.key[:8]} is no longer published by {ref.holder} "
                f"({ref.fabric.peer}): it was unpublished"
            )

    return watch


class UpstreamPace:
    """When a chain peer that has read all its upstream holds looks at its progress word again:
    about when the upstream's next chunk is due, from how fast that word has grown (a moving
    average of seconds per chunk), within UPSTREAM_POLL_RANGE_S. Each look is a read that also
    wakes the upstream's serving thread; at a fixed 3 ms a peer looked ~3 times per 1 MiB chunk
    of a 1 Gbit/s link, and on a starved CPU those looks took the cycles the upstream needed.
    Pure: the caller passes the times."""

    def __init__(
        self, first_s: float = UPSTREAM_POLL_S, range_s: tuple[float, float] = UPSTREAM_POLL_RANGE_S
    ) -> None:
        self._first, (self._lo, self._hi) = first_s, range_s
        self._t: float | None = None
        self._n = -1
        self._moving = False  # seen it grow once: later growths measure its pace
        self._per_chunk: float | None = None

    def saw(self, t: float, n: int) -> None:
        """The upstream held n chunks at time t. The first growth only starts the clock: the time
        before it is the upstream's own start (its set-up, the chain's fill ahead of it), not its pace."""
        if n <= self._n:
            return
        if self._moving:
            per = (t - self._t) / (n - self._n)
            self._per_chunk = per if self._per_chunk is None else 0.5 * (self._per_chunk + per)
        self._moving = self._t is not None
        self._t, self._n = t, n

    def wait_s(self) -> float:
        """Seconds to wait before the next look, having found nothing new."""
        if self._per_chunk is None:
            return self._first
        return min(self._hi, max(self._lo, self._per_chunk))


class _Landing:
    """Checks each digest chunk of a pull as soon as all of its bytes have landed (reads and digest
    chunks need not line up), on the reading thread while the next reads are in flight: the bytes
    are still in cache, so XXH3-64 runs several times faster than over a window read earlier.
    on_prefix(n) hears each time the verified prefix grows to n chunks (reads complete out of
    order, so a chunk past a gap waits for it): a chain peer publishes that to the next one at
    once, chunk by chunk, not window by window."""

    def __init__(
        self,
        dst: np.ndarray,
        ref: CheckpointRef,
        peer: str,
        start: int = 0,
        on_prefix: Callable[[int], None] | None = None,
    ) -> None:
        self._dst, self._ref, self._peer = dst, ref, peer
        self._have: dict[int, int] = {}  # digest chunk -> bytes landed so far
        self._ahead: set[int] = set()  # verified chunks past the prefix
        self.prefix = start
        self._on_prefix = on_prefix
        self.seconds = 0.0

    def landed(self, start: int, length: int) -> None:
        c, size = self._ref.chunk_size, self._ref.size
        end = start + length
        i = start // c
        grew = False
        while i * c < end:
            lo, hi = i * c, min((i + 1) * c, size)
            got = self._have.pop(i, 0) + min(end, hi) - max(start, lo)
            if got < hi - lo:
                self._have[i] = got
            else:
                t = time.perf_counter()
                verify(self._dst, self._ref, i, i + 1, self._peer)
                self.seconds += time.perf_counter() - t
                if i == self.prefix:
                    self.prefix += 1
                    grew = True
                    while self.prefix in self._ahead:
                        self._ahead.remove(self.prefix)
                        self.prefix += 1
                else:
                    self._ahead.add(i)
            i += 1
        if grew and self._on_prefix is not None:
            self._on_prefix(self.prefix)


def pull(
    client: FabricClient,
    ref: CheckpointRef,
    dst: np.ndarray,
    *,
    start: int = 0,
    timeout: float,
    chunk_size: int,
    max_inflight: int,
    window_bytes: int | None = None,
    link_gbps: float | None = None,
    progress_at: int | None = None,
    on_done: Callable[[int], None] | None = None,
    phases: dict[str, float] | None = None,
    on_landed: Callable[[int], None] | None = None,
) -> None:
    """Read chunks [start, end) of the checkpoint from ref.fabric into dst, verifying each as it lands.
    `ref` is one its caller checked (CheckpointRef.check: fetch, a broadcast peer's pull).

    progress_at: where in the source's region its progress word sits (a
    broadcast holder still receiving: the chunks it holds, read with RMA over
    the same connection); None: the source holds everything. on_done(n) hears
    the verified prefix (n chunks) each time it grows, on the reading thread.
    window_bytes: the most read in one read_into between looks at the source's
    progress (default: everything at once for a plain fetch, 4 x chunk_size x
    max_inflight in a chain). link_gbps
    paces the reads (a simulated link, for benchmarks and tests). phases, when
    given, gets "setup" and "connect" (a new connection), "transfer" and
    "verify" (digests, checked between the reads) seconds added. on_landed(end)
    hears, on the reading thread, that a read ending at byte `end` has landed
    (fetch's Toucher keeps faulting just ahead of that).
    """
    if not 0 <= start <= len(ref.checksums) or len(dst) != ref.size:
        raise ValueError(
            f"pull: start {start} of {len(ref.checksums)} chunks, {len(dst)} bytes for {ref.size}"
        )
    if window_bytes is None and progress_at is None and on_done is None:
        # nobody watches the progress: one pipelined read, no drain between windows
        window = len(ref.checksums)
    else:
        window = max(1, (window_bytes or 4 * chunk_size * max_inflight) // ref.chunk_size)
    pacer = None
    if link_gbps:
        from raydl.native.pyfi import Pacer

        pacer = Pacer(link_gbps * 1e9 / 8, burst=chunk_size)
    landing = _Landing(dst, ref, ref.fabric.peer, start, on_done)
    watch = holder_watchdog(ref)
    reads = _Reads(
        ref, dst, landing, watch, start=start, window=window, progress_at=progress_at, on_landed=on_landed
    )
    try:
        with client.connection(ref.fabric, phases, timeout=timeout, watchdog=watch) as conn:
            t1 = time.perf_counter()
            reads.run(conn, timeout=timeout, chunk_size=chunk_size, max_inflight=max_inflight, pacer=pacer)
            t2 = time.perf_counter()
    except FabricError as exc:
        raise _transfer_failed(ref, reads.done, exc, watch) from exc
    if phases is not None:
        phases["transfer"] = phases.get("transfer", 0.0) + (t2 - t1) - landing.seconds
        phases["verify"] = phases.get("verify", 0.0) + landing.seconds


class _Reads:
    """One pull's reads, a window at a time, never past what the source holds (a broadcast holder still
    receiving says so in its progress word). `done` is how many chunks have landed, each checked."""

    def __init__(
        self,
        ref: CheckpointRef,
        dst: np.ndarray,
        landing: _Landing,
        watch: Callable[[], None],
        *,
        start: int,
        window: int,
        progress_at: int | None,
        on_landed: Callable[[int], None] | None,
    ) -> None:
        self._ref, self._dst, self._landing, self._watch = ref, dst, landing, watch
        self._window, self._progress_at, self._on_landed = window, progress_at, on_landed
        self._word = np.zeros(1, np.int64)
        self.done = start

    def run(self, conn, *, timeout: float, chunk_size: int, max_inflight: int, pacer) -> None:
        n = len(self._ref.checksums)
        avail = self.done
        pace = UpstreamPace()
        grew_at = time.monotonic()  # when the upstream last held more than what was read
        while self.done < n:
            if avail <= self.done:  # look at the upstream's progress only once what it had is read
                avail = n if self._progress_at is None else self._held(conn, timeout, pace, n)
            if avail <= self.done:  # the upstream holder has nothing new yet
                if time.monotonic() - grew_at > timeout:  # alive and serving, but its own pull is stuck
                    raise CheckpointError(
                        f"checkpoint {self._ref.key[:8]}: its upstream holder {self._ref.holder} "
                        f"({self._ref.fabric.peer}) has held {avail} of {n} chunks for more than "
                        f"{timeout:g} s without getting more"
                    )
                time.sleep(pace.wait_s())
                continue
            end = min(avail, self.done + self._window)
            c = self._ref.chunk_size
            lo, hi = self.done * c, min(end * c, self._ref.size)
            conn.read_into(
                self._dst[lo:hi],
                offset=lo,
                chunk_size=chunk_size,
                max_inflight=max_inflight,
                timeout=timeout,
                watchdog=self._watch,
                watch_every=WATCH_EVERY_S,
                pacer=pacer,
                on_chunk=lambda pos, length, lo=lo: self._landed(lo + pos, length),
            )
            self.done = end  # every chunk of the window landed, so every one was checked (and on_done heard)
            grew_at = time.monotonic()

    def _held(self, conn, timeout: float, pace: UpstreamPace, n: int) -> int:
        """How many chunks the source holds now, read from its progress word."""
        conn.read_into(
            self._word,
            offset=self._progress_at,
            timeout=timeout,
            watchdog=self._watch,
            watch_every=WATCH_EVERY_S,
        )
        avail = min(n, int(self._word[0]))
        pace.saw(time.monotonic(), avail)
        return avail

    def _landed(self, pos: int, length: int) -> None:
        self._landing.landed(pos, length)
        if self._on_landed is not None:
            self._on_landed(pos + length)


def _transfer_failed(
    ref: CheckpointRef, done: int, exc: FabricError, watch: Callable[[], None]
) -> CheckpointError:
    """The CheckpointError for a pull whose reads failed at chunk `done`: what became of the holder when it
    can tell (a region revoked on a live endpoint fails the read at once), else the fabric's error."""
    try:
        watch()
    except CheckpointError as why:
        return why
    refused = exc.code in _REFUSED
    peer = ref.fabric.peer
    return CheckpointError(
        f"checkpoint {ref.key[:8]}: transfer from {ref.holder} ({peer}) failed at chunk {done}: {exc}"
        + (f" ({REFUSED_HINT})" if refused else "")
    )
