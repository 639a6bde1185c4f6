"""No thread is inside libfabric when the process exits.

libfabric tears its providers down from a library destructor (fi_fini) when
the process exits. A serving thread still inside fi_cq_sread, or a reader
inside fi_cq_read, then runs on freed provider state: the Ray worker segfault
in CoreWorker::HandleExit seen when CheckpointPeer actors were killed. So every
pyfi wait is bounded (the serving loop waits in 50 ms slices, the client in at
most 50 ms), and every call into libfabric (set-up, registration, transfers,
waits and fi_close) happens inside `GATE.inside()`; at interpreter exit (atexit runs
before the library destructors) the gate closes: no thread enters again, and
exit waits up to EXIT_WAIT_S for those inside to leave (and says so on stderr
when they did not). A thread that would enter afterwards gets a FabricError
instead; a close() after that leaves the object to libfabric's own teardown
(`GATE.unless_exiting()`): an fi_close racing fi_fini crashed a child of the exit-safety test.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import sys
import threading

from raydl.errors import FabricError

__all__ = ["EXIT_WAIT_S", "GATE", "Gate"]

EXIT_WAIT_S = (
    5.0  # a thread leaves within ~0.1 s; closing its endpoint on the way out takes longer under load
)


class Gate:
    """Counts threads inside libfabric; close() bars new entries and waits for the count to reach 0."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._inside = 0
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @contextlib.contextmanager
    def inside(self, call: str):
        with self._cv:
            if self._closed:
                raise FabricError(
                    f"{call}: the process is exiting, libfabric is no longer used",
                    call=call,
                    code=errno.ESHUTDOWN,
                    strerror=os.strerror(errno.ESHUTDOWN),
                )
            self._inside += 1
        try:
            yield
        finally:
            with self._cv:
                self._inside -= 1
                self._cv.notify_all()

    @contextlib.contextmanager
    def unless_exiting(self):
        """Yields True inside the gate, or False (without entering) once the process is exiting."""
        with self._cv:
            if self._closed:
                entered = False
            else:
                self._inside += 1
                entered = True
        try:
            yield entered
        finally:
            if entered:
                with self._cv:
                    self._inside -= 1
                    self._cv.notify_all()

    def close(self, timeout: float = EXIT_WAIT_S) -> bool:
        """Bar new entries; True when every thread left within `timeout` seconds."""
        with self._cv:
            self._closed = True
            return self._cv.wait_for(lambda: self._inside == 0, timeout=timeout)

    def close_at_exit(self) -> None:
        if not self.close():
            sys.stderr.write(
                f"pyfi: exiting with {self._inside} thread(s) still inside libfabric after "
                f"{EXIT_WAIT_S:g} s\n"
            )


GATE = Gate()
atexit.register(GATE.close_at_exit)
