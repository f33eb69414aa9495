"""Durable writes of slot files (ARCHITECTURE §8): a save's file is whole under its name or not
there, on the device before the answer, and written about as fast as the device allows.

``write_durable``: the file's pieces written in runs of 4 MiB, one writev each, with the
device's writeback started after each (sync_file_range, Linux), so the final fdatasync waits
for the last run only, not for the whole file; then the atomic rename and the directory's
fsync. A crash or a full disk never leaves a partial file under the final name.

Recycled files (as PostgreSQL recycles WAL segments): on this kind of disk a new file costs
twice an overwrite (~15 against ~7 ms durable for 19 MiB): its blocks are allocated on the
way and the fdatasync commits that allocation to the journal. So a save writes into the
directory's *spare* (``SPARE_NAME``: a file whose blocks are already written), when there is
one, and a save that replaces a file swaps it in (``RENAME_EXCHANGE``): the replaced file
becomes the next spare. A save that found no file to replace has a new spare written in the
background, for the next save. Its pages stay in the page cache: on a virtual machine that
hands free memory back to its host, a save into new page-cache pages after a few idle
seconds took 30-150 ms (every page faulted in again by the host) instead of ~8.
A reader holds a shared ``flock`` on the file it reads (``open_locked``); a spare is written
only under an exclusive one, so a file swapped out while it is read is never overwritten
under its reader.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import queue
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from .file_io import Laps

_SYNC_FILE_RANGE_WRITE = 2
_CHUNK = 4 << 20
_IOV_MAX = 1024  # POSIX's minimum on Linux: slices per writev


def _libc(name: str, argtypes: list[type]) -> Callable[..., int] | None:
    """libc's function ``name`` returning int (Linux), or None where there is none."""
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


_START_WRITEBACK = _libc(
    "sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
)

SPARE_NAME = ".spare.slot"  # a dot name: no request can name it (slot_file.validate_filename)
SPARE_MIN = 1 << 20  # smaller files gain little from a spare: none is written for them
_ZERO_CHUNK = 1 << 20  # a spare's zeros are written a MiB a slice
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


_RENAMEAT2 = _libc(  # glibc 2.28+
    "renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
)


def _runs(views: Sequence[memoryview], size: int) -> Iterator[list[memoryview]]:
    """The bytes of ``views`` in consecutive runs of ``size`` bytes (the last one shorter),
    each a list of slices (views the caller releases)."""
    run: list[memoryview] = []
    room = size
    for mv in views:
        off = 0
        while off < len(mv):
            part = mv[off : off + room]
            run.append(part)
            off, room = off + len(part), room - len(part)
            if room == 0:
                yield run
                run, room = [], size
    if run:
        yield run


def _writev_all(fd: int, run: list[memoryview]) -> int:
    """Write ``run`` whole; one writev per IOV_MAX slices, the rest of a short write again."""
    total = 0
    for i in range(0, len(run), _IOV_MAX):
        group = run[i : i + _IOV_MAX]
        want, n = sum(len(v) for v in group), os.writev(fd, group)
        total += n
        while n < want:  # short write (rare on a regular file): finish slice by slice
            for v in group:
                if n >= len(v):
                    n -= len(v)
                    continue
                total += os.write(fd, v[n:])
                n = 0
            break
    return total


def _write_all(fd: int, pieces: Sequence[bytes | memoryview]) -> int:
    """Write ``pieces`` in order, in runs of _CHUNK bytes, one writev each, starting the
    device's writeback after each run (it then runs while the next is copied). One writev
    per run: where the file overwrites a recycled spare, a page filled from two pieces in
    two writes would first be read from the device (a partial page of an uncached file).
    Returns the bytes written."""
    views = [memoryview(p).cast("B") for p in pieces]
    pos = 0
    try:
        for run in _runs(views, _CHUNK):
            try:
                n = _writev_all(fd, run)
            finally:
                for v in run:
                    v.release()
            if _START_WRITEBACK is not None:
                _START_WRITEBACK(fd, pos, n, _SYNC_FILE_RANGE_WRITE)
            pos += n
    finally:
        for v in views:
            v.release()
    return pos


# How long a reader waits for a file's exclusive lock: ours is held only while a spare is
# written (milliseconds); another program's could be held for ever, and a restore's worker
# thread must not wait for it that long.
LOCK_WAIT_S = 5.0


def _lock_shared(fd: int, deadline: float) -> None:
    """A shared flock on ``fd``, polled until ``deadline`` (then OSError EAGAIN). A file
    system without locks: none taken (nothing is recycled there for our own readers)."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise OSError(
                    errno.EAGAIN, "the slot file stays locked by another writer"
                ) from None
            time.sleep(0.001)
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP):
                raise
            return


def open_locked(path: Path) -> int:
    """An fd of the file at ``path`` with a shared flock held (released when the fd is
    closed), checked to still be the file at ``path`` once locked: a save may have swapped
    it out to become a spare meanwhile, and a spare is only written under an exclusive lock.
    Raises FileNotFoundError when there is no file."""
    SPARES.touch()
    for _ in range(8):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _lock_shared(fd, time.monotonic() + LOCK_WAIT_S)
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # swapped out before we locked it: open the new file
    raise OSError(errno.EAGAIN, f"{path.name} kept changing while opened")


def _open_for_write(tmp: Path) -> int:
    """``tmp`` (an empty temporary file) opened for writing and locked exclusively; the
    directory's spare is moved onto it first when there is one that no reader holds."""
    spare = tmp.parent / SPARE_NAME
    try:
        os.rename(spare, tmp)  # atomic: of two concurrent saves, one gets the spare
    except OSError:
        pass  # no spare: a new file
    fd = os.open(tmp, os.O_WRONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.fchmod(fd, 0o644)  # as a new file's (temp_for): a recycled one may have had others
        return fd
    except OSError:  # a reader still holds the swapped-out file (or no locks here): skip it
        os.close(fd)
    # a new file, named by us alone: nobody else can open it, no lock needed
    tmp.unlink()
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)


def _swap_in(tmp: Path, path: Path) -> bool:
    """Put ``tmp`` at ``path``. A file already at ``path`` is exchanged atomically and
    becomes the directory's spare (True); otherwise a plain rename (False)."""
    exchanged = (
        _RENAMEAT2 is not None
        and path.exists()
        and _RENAMEAT2(_AT_FDCWD, bytes(tmp), _AT_FDCWD, bytes(path), _RENAME_EXCHANGE) == 0
    )
    if exchanged:  # the save is done: the old file is only kept if it can be the spare
        try:
            os.replace(tmp, tmp.parent / SPARE_NAME)
        except OSError:
            tmp.unlink(missing_ok=True)
        return True
    # nothing to replace, or ENOENT (removed meanwhile), EINVAL/ENOSYS (not supported here)
    os.replace(tmp, path)
    return False


def write_durable(
    tmp: Path, path: Path, pieces: Sequence[bytes | memoryview], laps: Laps | None = None
) -> int:
    """Write ``pieces`` to ``tmp`` (an empty temporary file beside ``path``; the spare's
    blocks reused when there is one), fdatasync it, swap it in at ``path`` and fsync the
    directory; ``tmp`` is removed on failure. Returns the file's size; ``laps`` gets
    "write", "sync" and "rename". Without a file replaced, a new spare of this size is
    written in the background."""
    laps = laps or Laps(None)
    SPARES.touch()
    try:
        fd = _open_for_write(tmp)
        try:
            written = _write_all(fd, pieces)
            if os.fstat(fd).st_size > written:  # a larger spare: cut to this file
                os.ftruncate(fd, written)
            laps.lap("write")
            os.fdatasync(fd)
            laps.lap("sync")
        finally:
            os.close(fd)
        recycled = _swap_in(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    laps.lap("rename")
    SPARES.touch()
    if not recycled:
        SPARES.refill(path.parent, written)
    return written


# A spare is written once slot-file saves and restores have paused this long: writing
# 19 MiB into new page-cache pages next to a restore made the restore 2-4x slower here
# (the pages were faulted in by the virtual machine's host meanwhile).
QUIET_S = 0.25


class SpareMaker:
    """Writes directories' spares on one background thread at the lowest priority (started
    at the first need; a queue hand-off costs a save ~20 us where a thread start cost
    0.4 ms): zeros (``write_zeros``), then renamed to SPARE_NAME unless a spare appeared
    meanwhile. Best effort: an error leaves no spare and no file."""

    def __init__(self) -> None:
        self._busy: set[Path] = set()
        self._todo: queue.SimpleQueue[tuple[Path, int]] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._thread: threading.Thread | None = None
        self.last_io = 0.0  # time.monotonic() of the last save or restore's file access

    def touch(self) -> None:
        """Note a slot file's access now: a spare waits for a pause (QUIET_S)."""
        self.last_io = time.monotonic()

    def refill(self, directory: Path, size: int) -> None:
        """Have ``directory``'s spare of ``size`` bytes written, unless it has
        one, one is on the way, or the file is too small to gain from one."""
        if size < SPARE_MIN or (directory / SPARE_NAME).exists():
            return
        with self._idle:
            if directory in self._busy:
                return
            self._busy.add(directory)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="spares", daemon=True)
                self._thread.start()
        self._todo.put((directory, size))

    def wait(self, timeout: float = 30.0) -> bool:
        """Block until no spare is being written (tests); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._busy, timeout)

    def _serve(self) -> None:
        # the lowest priority, for this thread alone: it must not slow the requests that
        # follow a save (a restore reads on every core)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while True:
            directory, size = self._todo.get()
            while (left := self.last_io + QUIET_S - time.monotonic()) > 0:
                time.sleep(left)  # after the slot files' traffic pauses (see QUIET_S)
            try:
                self._make(directory, size)
            finally:
                with self._idle:
                    self._busy.discard(directory)
                    self._idle.notify_all()

    def _make(self, directory: Path, size: int) -> None:
        tmp: Path | None = None
        try:
            fd, name = tempfile.mkstemp(prefix=".tmp-spare-", suffix=".slot", dir=directory)
            tmp = Path(name)
            os.close(fd)
            write_zeros(tmp, size)
            if not (directory / SPARE_NAME).exists():
                os.replace(tmp, directory / SPARE_NAME)
                tmp = None
        except OSError:
            pass
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)


SPARES = SpareMaker()


def write_zeros(path: Path, size: int) -> None:
    """``size`` bytes of zeros written to ``path`` through the page cache and fdatasync'd:
    its blocks are then allocated on the device and its pages stay cached (clean,
    reclaimable), so a save overwriting it reuses both. Exactly ``size``: the next save is
    most often the same slot's state again, as large, and a spare of its size needs no
    ftruncate (0.4 ms here, and a heavier fdatasync after it)."""
    zeros = memoryview(bytes(_ZERO_CHUNK))
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        off = 0
        while off < size:  # the same MiB again and again: few calls, the GIL released
            left = size - off
            iov = [zeros] * min(left // _ZERO_CHUNK, _IOV_MAX) or [zeros[:left]]
            off += os.pwritev(fd, iov, off)
        os.fdatasync(fd)
    finally:
        os.close(fd)
