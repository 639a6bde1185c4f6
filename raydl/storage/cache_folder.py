"""The node cache's folder as files: its layout, who may use it, the lock and the size ledger its writers
share, the scan of its entries, and the temporary files dead writers left.

    PATH/entries/abc/<uri hash>-<store hash>-<etag hash>-<offset>-<length>   an entry: a header, the bytes
    PATH/tmp/<pid ns>-<pid>-<random>.tmp                 entries (and a first ledger) being written
    PATH/lock                                            fcntl lock: the ledger, renames and removals
    PATH/state                                           the ledger: "<bytes> <max_bytes> <bytes added>",
                                                         rewritten in place by the lock's holder
    PATH/evicting                                        fcntl lock held by the one process evicting

What it trusts. A cache folder is private to its user: PATH, entries/, tmp/ and every entries/abc/ are made
0700 and every file 0600 (whatever the umask), and a folder that exists already must be a real folder
(never a symbolic link) owned by this user; one that others could read is made 0700. A cache shared by
several users of a node is asked for by naming a group (`raydl.Cache(..., group=...)`): then the folders
are 2770 and the files 0660, all of that group, and a folder must belong to the group and be closed to
other users. Anything else is refused with a PermissionError naming the path.

What it touches. The cache reaches its files only through descriptors of these folders (`dir_fd`) and
never follows a link (O_NOFOLLOW on every open; lstat, never stat). It reads, evicts and removes only
regular files of its own naming patterns (`ENTRY`, `OLD_ENTRY`, `TEMP`) that belong to its user (a shared
cache: to its group); any other file in its folders is left as it is and counted nowhere.

What an entry file holds, and how one is read and written, is raydl/storage/node_cache.py's; eviction is
raydl/storage/cache_evict.py's. This module knows entries only as files with a size and a last use (their
mtime, which a hit touches).
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = [
    "ENTRIES",
    "ENTRY",
    "EVICTING",
    "LOCK",
    "OLD_ENTRY",
    "STALE_TMP_S",
    "STATE",
    "TEMP",
    "TMP",
    "DIR_FLAGS",
    "READ_FLAGS",
    "CacheFolder",
    "Ledger",
    "StateLock",
    "check_cache_folder",
    "pid_namespace",
    "write_all",
]

ENTRIES, TMP, LOCK, STATE, EVICTING = "entries", "tmp", "lock", "state", "evicting"
STATE_WIDTH = 64  # bytes of the ledger's record as written in place: three numbers, padded, and a newline
STATE_READS = 3  # reads of the ledger without the lock, each against the one before, before giving up
STALE_TMP_S = 3600.0  # a temporary file untouched this long is a dead writer's, whoever wrote it

SHARD = re.compile(r"[0-9a-f]{3}")  # entries/abc: the first 3 hex digits of the URI's hash
#: an entry's name: hashes of URI, store and etag, then offset and length ("all" for a whole object)
ENTRY = re.compile(r"[0-9a-f]{24}-[0-9a-f]{16}-[0-9a-f]{16}-[0-9]+-(?:[0-9]+|all)")
#: the names of the key scheme without the store (no lookup asks for them; evicted as usual)
OLD_ENTRY = re.compile(r"[0-9a-f]{24}-[0-9a-f]{16}-[0-9]+-(?:[0-9]+|all)")
#: a temporary file: its writer's pid namespace and pid, and 16 random hex digits
TEMP = re.compile(r"([0-9]+)-([0-9]+)-[0-9a-f]{16}\.tmp")

#: a folder of the cache, opened: never through a link
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: a file of a cache, opened to read: never through a link, never waiting on a FIFO put there
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _refused(path: str, why: str) -> PermissionError:
    return PermissionError(f"node cache folder {path!r} {why}")


class CacheFolder:
    """One cache folder, opened and checked: descriptors of PATH, entries/ and tmp/ (made where missing), and
    who may own what is in it. Every later open, rename and removal goes through these descriptors.

    `group`: None for a private cache (this user's only), or the name of the group that shares it."""

    def __init__(self, path: str, group: str | None = None) -> None:
        self.path = os.path.abspath(path)
        self.group = group
        self.uid = os.geteuid()
        self.gid = _group_id(self.path, group) if group is not None else None
        self.dir_mode = 0o700 if group is None else 0o2770
        self.file_mode = 0o600 if group is None else 0o660
        self.root = self.entries = self.tmp = -1
        try:
            parent = os.path.dirname(self.path)
            try:
                # above the cache: made as any folder is (the umask's mode)
                os.makedirs(parent, exist_ok=True)
            except FileExistsError as exc:  # PARENT itself is there, and is not a folder
                raise NotADirectoryError(errno.ENOTDIR, "is not a folder", parent) from exc
            self.root = self._open_dir(None, self.path, self.path)
            self.entries = self._open_dir(self.root, ENTRIES, os.path.join(self.path, ENTRIES))
            self.tmp = self._open_dir(self.root, TMP, os.path.join(self.path, TMP))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for name in ("tmp", "entries", "root"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)

    # -- who may own what ---------------------------------------------------------------------------
    def ours(self, st: os.stat_result) -> bool:
        """Whether a file (lstat'ed) is one the cache may read and remove: a regular file of this user (a
        shared cache: of its group)."""
        if not stat.S_ISREG(st.st_mode):
            return False
        return st.st_uid == self.uid if self.gid is None else st.st_gid == self.gid

    def _open_dir(self, parent: int | None, name: str, path: str) -> int:
        """A folder of the cache, made (with the cache's mode) where missing, opened without following a link,
        and checked; its descriptor."""
        created = False
        try:
            try:  # an existing folder first: a shard is made once and opened at every entry's write
                fd = os.open(name, DIR_FLAGS, dir_fd=parent)
            except FileNotFoundError:
                try:
                    os.mkdir(name, self.dir_mode, dir_fd=parent)
                    created = True
                except FileExistsError:  # another writer made it in between
                    pass
                fd = os.open(name, DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                try:
                    link = stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
                except OSError:
                    link = False
                raise _refused(
                    path, "is a symbolic link: a cache never follows one" if link else "is not a folder"
                ) from exc
            raise
        try:
            self._check_dir(fd, path, created)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _check_dir(self, fd: int, path: str, created: bool) -> None:
        st = os.fstat(fd)
        mode = stat.S_IMODE(st.st_mode)
        if self.gid is None:
            if st.st_uid != self.uid:
                raise _refused(
                    path,
                    f"belongs to uid {st.st_uid}, not to this user (uid {self.uid}): a private cache is its "
                    "own user's; raydl.Cache(..., group=...) shares one",
                )
            if mode != self.dir_mode:  # made under another umask, or readable by others: private again
                os.fchmod(fd, self.dir_mode)
            return
        if st.st_uid == self.uid and (created or st.st_gid != self.gid or mode != self.dir_mode):
            try:
                if st.st_gid != self.gid:
                    os.fchown(fd, -1, self.gid)
                os.fchmod(fd, self.dir_mode)  # after the chown, which clears the setgid bit
            except PermissionError as exc:
                raise _refused(path, f"cannot be given to group {self.group!r} ({exc.strerror})") from exc
            return
        if st.st_gid != self.gid:
            raise _refused(path, f"belongs to group gid {st.st_gid}, not to the cache's group {self.group!r}")
        if mode & 0o007 or mode & 0o070 != 0o070:
            raise _refused(
                path, f"has mode {mode:04o}: a shared cache's folders are its group's alone (2770)"
            )

    # -- shards and entries -------------------------------------------------------------------------
    def shard_path(self, shard: str) -> str:
        return os.path.join(self.path, ENTRIES, shard)

    def open_shard(self, shard: str, *, create: bool = False) -> int:
        """entries/<shard>'s descriptor, checked (FileNotFoundError when it is missing and not `create`)."""
        path = self.shard_path(shard)
        if create:
            return self._open_dir(self.entries, shard, path)
        try:
            fd = os.open(shard, DIR_FLAGS, dir_fd=self.entries)
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                return self._open_dir(self.entries, shard, path)  # raises, naming what it is
            raise
        try:
            self._check_dir(fd, path, False)
        except BaseException:
            os.close(fd)
            raise
        return fd

    @contextmanager
    def shard(self, shard: str, *, create: bool = False) -> Iterator[int]:
        fd = self.open_shard(shard, create=create)
        try:
            yield fd
        finally:
            os.close(fd)

    def shards(self) -> list[str]:
        """The names of entries/'s shard folders (links included: opening one refuses it, naming it)."""
        return [n for n in _names_in(self.entries) if SHARD.fullmatch(n)]

    def scan_shard(self, shard: str) -> list[tuple[int, int, str]]:
        """entries/<shard>'s entries as (mtime_ns, size, name): regular files of the cache's own names that
        are its own, lstat'ed in the open folder. Empty when the shard is gone."""
        out = []
        try:
            fd = self.open_shard(shard)
        except FileNotFoundError:
            return out
        uid, gid, is_reg = self.uid, self.gid, stat.S_ISREG  # ours(), inlined: this loop runs per entry
        try:
            with os.scandir(fd) as it:
                for e in it:
                    name = e.name
                    if not (name.startswith(shard) and (ENTRY.fullmatch(name) or OLD_ENTRY.fullmatch(name))):
                        continue
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if is_reg(st.st_mode) and (st.st_uid == uid if gid is None else st.st_gid == gid):
                        out.append((st.st_mtime_ns, st.st_size, name))
        finally:
            os.close(fd)
        return out

    def scan(self) -> Iterator[tuple[int, int, str, str]]:
        """Every entry as (mtime_ns, size, shard, name), a shard at a time."""
        for shard in self.shards():
            for mtime, size, name in self.scan_shard(shard):
                yield mtime, size, shard, name

    def remove(
        self, dir_fd: int, name: str, *, mtime_ns: int | None = None, ino: int | None = None
    ) -> int | None:
        """Remove the regular file `name` of the open folder `dir_fd` if it is the cache's own (with
        `mtime_ns`: still unused since it was scanned; with `ino`: still the file that was read); its size,
        or None when it was left."""
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            return None
        if not self.ours(st) or (mtime_ns is not None and st.st_mtime_ns != mtime_ns):
            return None
        if ino is not None and st.st_ino != ino:
            return None
        try:
            os.unlink(name, dir_fd=dir_fd)
        except OSError:
            return None
        return st.st_size

    # -- temporary files ----------------------------------------------------------------------------
    def temp(self, ns: str) -> tuple[int, str]:
        """A new temporary file in tmp/ (O_EXCL, O_NOFOLLOW, the cache's file mode): (fd, name)."""
        name = f"{ns}-{os.getpid()}-{secrets.token_hex(8)}.tmp"
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=self.tmp)  # fmt: skip
        if self.file_mode != 0o600:
            try:
                os.fchmod(fd, self.file_mode)  # 0660 whatever the umask (os.open's mode is masked by it)
            except BaseException:
                os.close(fd)
                os.unlink(name, dir_fd=self.tmp)
                raise
        return fd, name

    def clean_tmp(self, ns: str) -> int:
        """Remove the temporary files in tmp/ of dead writers of pid namespace `ns`, and those of the cache's
        own names left untouched for STALE_TMP_S (a writer in another namespace cannot be asked whether it
        lives); any other file is left. How many were removed."""
        removed = 0
        now = time.time()
        try:
            names = _names_in(self.tmp)
        except OSError:
            return 0
        for name in names:
            m = TEMP.fullmatch(name)
            if m is None:
                continue
            try:
                st = os.stat(name, dir_fd=self.tmp, follow_symlinks=False)
            except OSError:
                continue
            if not self.ours(st):
                continue
            dead = m.group(1) == ns and not _alive(int(m.group(2)))
            if dead or now - st.st_mtime > STALE_TMP_S:
                if self.remove(self.tmp, name, mtime_ns=st.st_mtime_ns) is not None:
                    removed += 1
        return removed

    # -- the ledger ---------------------------------------------------------------------------------
    def read_state(self) -> tuple[int, int, int] | None:
        """The ledger as (total, max_bytes, bytes added); None when missing, torn or not the cache's own.

        Read without the lock, while its holder may rewrite the record in place: two reads that agree are
        the answer (a read that raced a write differs from the next), else None."""
        try:
            fd = os.open(STATE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=self.root)
        except OSError:
            return None
        try:
            if not self.ours(os.fstat(fd)):
                return None
            last = os.pread(fd, 128, 0)
            for _ in range(STATE_READS):
                again = os.pread(fd, 128, 0)
                if again == last:
                    return _parse_state(again)
                last = again
            return None
        except OSError:
            return None
        finally:
            os.close(fd)

    def open_state(self) -> tuple[int, tuple[int, int, int] | None]:
        """The ledger opened for an update in place (by the holder of the lock) and read: (fd, its values).

        (-1, its values) where it may be read but not written through: a file with other names (a hard
        link: writing it would change every folder that shares it) or one this process may not open for
        writing; `write_state` then renames a new ledger over it. (-1, None) where it is missing or not a
        regular file of the cache's own; (fd, None) where it is torn."""
        try:
            fd = os.open(STATE, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=self.root)
        except FileNotFoundError:
            return -1, None
        except OSError:  # a link (ELOOP), a ledger made read-only, out of descriptors: read it if it can be
            return -1, self.read_state()
        try:
            st = os.fstat(fd)
            if not self.ours(st):
                os.close(fd)
                return -1, None
            values = _parse_state(os.pread(fd, 128, 0))
            if st.st_nlink != 1:
                os.close(fd)
                return -1, values
            return fd, values
        except OSError:
            os.close(fd)
            return -1, self.read_state()

    def update_state(self, fd: int, total: int, max_bytes: int, added: int) -> bool:
        """The ledger rewritten in place through `fd` (open_state's): one 64-byte write at offset 0 of a
        fixed-width record that covers whatever was there, so the hold makes no file of its own (a writer
        killed mid-call leaves the old record or the new one, never part of each); readers split on
        whitespace, as they always have. False, with nothing written, for numbers too long for the record
        (a crafted ledger's): `write_state` then."""
        record = f"{total} {max_bytes} {added}".encode()
        if len(record) >= STATE_WIDTH:
            return False
        os.pwrite(fd, record.ljust(STATE_WIDTH - 1) + b"\n", 0)
        if os.fstat(fd).st_size > STATE_WIDTH:  # a longer ledger before: nothing of it may follow the record
            os.ftruncate(fd, STATE_WIDTH)
        return True

    def write_state(self, total: int, max_bytes: int, added: int, ns: str) -> None:
        fd, name = self.temp(ns)
        try:
            write_all(fd, f"{total} {max_bytes} {added}\n".encode())
        finally:
            os.close(fd)
        os.rename(name, STATE, src_dir_fd=self.tmp, dst_dir_fd=self.root)

    def open_lock(self, name: str) -> int:
        """A lock file in PATH (made with the cache's file mode), never through a link."""
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.root)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _refused(
                    os.path.join(self.path, name), "is a symbolic link: a cache never follows one"
                ) from exc
            raise
        try:
            st = os.fstat(fd)
            if not self.ours(st):
                raise _refused(os.path.join(self.path, name), "is not a regular file of the cache's own")
            if stat.S_IMODE(st.st_mode) != self.file_mode and st.st_uid == self.uid:
                os.fchmod(fd, self.file_mode)
        except BaseException:
            os.close(fd)
            raise
        return fd


class Ledger:
    """The ledger as one holder of the lock sees it: `total` (the entries' bytes), `added` (bytes ever added,
    which lets a full walk of the folder correct the total), `max_bytes` (as the last writer set it)."""

    __slots__ = ("added", "max_bytes", "total")

    def __init__(self, total: int, max_bytes: int, added: int) -> None:
        self.total, self.max_bytes, self.added = total, max_bytes, added


class StateLock:
    """The folder's fcntl lock held, with the ledger read as a `Ledger`, written back on exit (and by
    `write()` before a rename, so that a writer killed between the two leaves the ledger over the folder's
    bytes, never under).

    `thread_lock` is the cache's lock between this process's threads (a flock is per open file, so it does
    not keep two threads of one process apart); `max_bytes` of 0 keeps the max_bytes recorded by the last
    writer (a tool's view of the folder, such as `raydl cache`). A ledger that is missing, torn or not the
    cache's own is replaced by the folder's bytes, counted under the lock."""

    def __init__(self, folder: CacheFolder, thread_lock: threading.Lock, max_bytes: int, ns: str) -> None:
        self._folder = folder
        self._thread_lock = thread_lock
        self._max_bytes = max_bytes
        self._ns = ns
        self._fd = -1
        self._state_fd = -1  # the ledger, open for an update in place while the lock is held
        self.ledger = Ledger(0, 0, 0)
        self._written = (0, 0, 0)

    def __enter__(self) -> Ledger:
        import fcntl

        self._thread_lock.acquire()
        try:
            self._fd = self._folder.open_lock(LOCK)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            self._state_fd, values = self._folder.open_state()
            if values is None:  # no ledger, a torn one, or not the cache's own: the folder's bytes, counted
                # now under the lock (never 0 over a full folder: eviction would wait until it held twice
                # its max_bytes); written on exit where there are any
                self.ledger = Ledger(sum(size for _, size, _, _ in self._folder.scan()), self._max_bytes, 0)
                self._written = (0, 0, 0)
            else:
                total, recorded_max, added = values
                self.ledger = Ledger(total, self._max_bytes or recorded_max, added)
                self._written = values
        except BaseException:
            self._release()
            raise
        return self.ledger

    def _values(self) -> tuple[int, int, int]:
        led = self.ledger
        return max(0, led.total), led.max_bytes, led.added

    def write(self) -> None:
        values = self._values()
        if self._state_fd < 0 or not self._folder.update_state(self._state_fd, *values):
            self._folder.write_state(*values, self._ns)  # no ledger yet, or not the cache's own: a new one
            if self._state_fd >= 0:  # the descriptor names the ledger renamed over: never write through it
                os.close(self._state_fd)
                self._state_fd = -1
        self._written = values

    def __exit__(self, *exc) -> None:
        try:
            if (
                exc[0] is None and self._values() != self._written
            ):  # a hold that changed nothing writes nothing
                self.write()
        finally:
            self._release()

    def _release(self) -> None:
        if self._state_fd >= 0:
            os.close(self._state_fd)
            self._state_fd = -1
        if self._fd >= 0:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = -1
        self._thread_lock.release()


def check_cache_folder(path: str, group: str | None = None) -> None:
    """Make `path` (and its entry folders) with the cache's modes, check who owns them, and write, fsync and
    remove a file there; the OSError (a PermissionError naming the path for a link or a foreign folder) if
    any step fails. What the loader checks on every node before its workers use the cache."""
    folder = CacheFolder(path, group)
    try:
        fd, name = folder.temp(pid_namespace())
        try:
            os.write(fd, b"raydl")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(name, dir_fd=folder.tmp)
    finally:
        folder.close()


def pid_namespace() -> str:
    """This process's pid namespace: a temporary file's pid means a process only within its namespace."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def _parse_state(raw: bytes) -> tuple[int, int, int] | None:
    parts = raw.split()
    try:
        return int(parts[0]), int(parts[1]), int(parts[2]) if len(parts) > 2 else 0
    except (ValueError, IndexError):
        return None


def _names_in(dir_fd: int) -> list[str]:
    """The names in the folder `dir_fd` holds open, listed through a descriptor of this call's own: a listing
    through `dir_fd` itself shares its read position with every other thread listing it at the same time
    (os.listdir dups the descriptor), and each would miss what the other read."""
    fd = os.open(".", DIR_FLAGS, dir_fd=dir_fd)
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data) -> None:
    """All of `data` written to `fd` (os.write may write less than asked)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _group_id(path: str, group: str) -> int:
    import grp

    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise _refused(path, f"is to be shared by group {group!r}, which this node does not have") from None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError as exc:  # EPERM: alive, someone else's
        return exc.errno == errno.EPERM
    return True
