"""Buffers and durable writes for slot files (DESIGN §8): the parts of a save and a restore
that are plain I/O, kept fast.

``StateBuffers``: pre-faulted memory reused across saves and restores. A fresh buffer of a
20 MiB state costs ~5,000 page faults (4 KiB pages) or the zeroing of ten huge pages on its
first touch, as much as the copy itself; a reused one costs neither. At most one idle
buffer is kept (the largest, up to ``keep_max`` bytes: 128 MiB, a 4,000-token Gemma 3
270M state is 20 MiB), so the memory held is bounded by one state; larger states get a
fresh buffer each time, as before.

``write_durable``: the file's pieces written in chunks with the device's writeback started
after each (sync_file_range, Linux), so the final fdatasync waits for the last chunk only,
not for the whole file; then the atomic rename and the directory's fsync. A crash or a full
disk never leaves a partial file under the final name.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .saved import FileBuf

# Files from this size are read into huge pages (``new_buffer``).
HUGE_BUFFER_MIN = 2 << 20
_HUGE = 2 << 20


def new_buffer(size: int) -> FileBuf:
    """Private memory of ``size`` bytes. From HUGE_BUFFER_MIN bytes, anonymous memory
    asked for transparent huge pages (a bytearray is zero-filled, then faulted in 4 KiB
    pages); never a file mapped, so a file truncated meanwhile cannot SIGBUS us."""
    if size < HUGE_BUFFER_MIN:
        return bytearray(size)
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; elsewhere plain pages
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP disabled: plain pages, still not zero-filled twice
            pass
    return buf


class StateBuffers:
    """A pool of one idle buffer (thread-safe). ``take(size)`` gives a buffer of at least
    ``size`` bytes, the idle one when it is large enough (already faulted in), else a new
    one (huge-page sized); ``give`` returns a buffer once nothing reads or writes it any
    more: it becomes the idle one when it is the largest seen, up to ``keep_max`` bytes.
    A buffer that may still be in use (a cancelled request whose engine command is queued)
    must never be given back: it is simply dropped."""

    def __init__(self, keep_max: int = 128 << 20) -> None:
        self.keep_max = keep_max
        self._idle: FileBuf | None = None
        self._lock = threading.Lock()

    def take(self, size: int) -> FileBuf:
        with self._lock:
            buf = self._idle
            if buf is not None and len(buf) >= size:
                self._idle = None
                return buf
        if size >= HUGE_BUFFER_MIN:
            size = -(-size // _HUGE) * _HUGE  # whole huge pages: a later, larger state fits
        return new_buffer(size)

    def give(self, buf: FileBuf) -> None:
        if len(buf) > self.keep_max:
            return
        with self._lock:
            if self._idle is None or len(self._idle) < len(buf):
                self._idle = buf


# process-wide: slot-file saves and restores share the one idle buffer
BUFFERS = StateBuffers()

_SYNC_FILE_RANGE_WRITE = 2
_CHUNK = 4 << 20


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's sync_file_range (Linux), or None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_START_WRITEBACK = _sync_file_range()


class Laps:
    """Laps of wall time in milliseconds, added to ``parts`` by name (nothing without)."""

    def __init__(self, parts: dict[str, float] | None) -> None:
        self.parts, self.t = parts, time.perf_counter()

    def lap(self, name: str) -> None:
        if self.parts is not None:
            now = time.perf_counter()
            self.parts[name] = self.parts.get(name, 0.0) + (now - self.t) * 1e3
            self.t = now


def _write_all(fd: int, pieces: Sequence[bytes | memoryview]) -> int:
    """Write ``pieces`` in order, starting the device's writeback of every ~4 MiB written
    (it then runs while the next chunk is copied). Returns the bytes written."""
    pos = started = 0
    for piece in pieces:
        with memoryview(piece) as whole, whole.cast("B") as mv:
            off = 0
            while off < len(mv):
                with mv[off : off + _CHUNK] as part:
                    n = os.write(fd, part)
                off, pos = off + n, pos + n
                if _START_WRITEBACK is not None and pos - started >= _CHUNK:
                    _START_WRITEBACK(fd, started, pos - started, _SYNC_FILE_RANGE_WRITE)
                    started = pos
    return pos


def write_durable(
    tmp: Path, path: Path, pieces: Sequence[bytes | memoryview], laps: Laps | None = None
) -> int:
    """Write ``pieces`` to ``tmp`` (truncated first), fdatasync it, rename it to ``path``
    and fsync the directory; ``tmp`` is removed on failure. Returns the file's size;
    ``laps`` gets "write", "sync" and "rename"."""
    laps = laps or Laps(None)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
        try:
            written = _write_all(fd, pieces)
            laps.lap("write")
            os.fdatasync(fd)
            laps.lap("sync")
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    laps.lap("rename")
    return written
