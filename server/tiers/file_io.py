"""Buffers, reads and timing laps for slot files (ARCHITECTURE §8): the parts of a save and a
restore that are plain memory and I/O, kept fast.

``StateBuffers``: pre-faulted memory reused across saves and restores. A fresh buffer of a
20 MiB state costs ~5,000 page faults (4 KiB pages) or the zeroing of ten huge pages on its
first touch, as much as the copy itself; a reused one costs neither. At most one idle
buffer is kept (the largest, up to ``keep_max`` bytes: 128 MiB, a 4,000-token Gemma 3
270M state is 20 MiB), so the memory held is bounded by one state; larger states get a
fresh buffer each time, as before.

``pread_into``: a file read straight into such a buffer, in parallel parts when large.
The durable writes are in ``durable``.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait

from .saved import FileBuf

# Files from this size are read into huge pages (``new_buffer``).
HUGE_BUFFER_MIN = 2 << 20
_HUGE = 2 << 20
_PAGE = 4096


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


# A read from the page cache is a copy bound by one core (~4.5 GB/s here, 4.4 ms for a
# 19 MiB state); parts of at least _PART_MIN bytes are read by up to _READERS threads at
# once (2.3 ms on two cores). Reads of one file do not serialize the way writes do.
_PART_MIN = 4 << 20
_READERS = max(1, min(4, os.cpu_count() or 1))
_read_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _readers() -> ThreadPoolExecutor:
    global _read_pool
    with _pool_lock:
        if _read_pool is None:
            _read_pool = ThreadPoolExecutor(_READERS - 1, thread_name_prefix="file-read")
        return _read_pool


def _pread_range(fd: int, mv: memoryview, start: int, end: int) -> int:
    """Fill ``mv[start:end]`` from the file at ``start``; the bytes read (fewer: EOF)."""
    pos = start
    while pos < end:
        with mv[pos:end] as part:
            n = os.preadv(fd, [part], pos)  # a single read stops at ~2 GiB: loop
        if n == 0:
            break
        pos += n
    return pos - start


def pread_into(fd: int, buf: FileBuf) -> int:
    """Fill ``buf`` from the start of the file ``fd``; the kernel writes straight into it
    (one copy, no intermediate bytes), a large buffer in page-aligned parts read at once
    on several threads. Returns the bytes read: fewer than ``len(buf)`` when the file
    ended first (the parts after a short one are not counted)."""
    with memoryview(buf) as whole, whole.cast("B") as mv:
        size = len(mv)
        k = min(_READERS, size // _PART_MIN)
        if k <= 1:
            return _pread_range(fd, mv, 0, size)
        step = -(-size // k // _PAGE) * _PAGE
        bounds = [(a, min(a + step, size)) for a in range(0, size, step)]
        pool = _readers()
        rest = [pool.submit(_pread_range, fd, mv, a, b) for a, b in bounds[1:]]
        try:
            first = _pread_range(fd, mv, *bounds[0])
        finally:
            wait(rest)  # no part may still write into ``buf`` once this returns or raises
        got = [first] + [f.result() for f in rest]
    total = 0
    for (a, b), n in zip(bounds, got, strict=True):
        total += n
        if n < b - a:
            break  # the file ended inside this part
    return total


# process-wide: slot-file saves and restores share the one idle buffer
BUFFERS = StateBuffers()


class Laps:
    """Laps of wall time in milliseconds, added to ``parts`` by name (nothing without)."""

    def __init__(self, parts: dict[str, float] | None) -> None:
        self.parts, self.t = parts, time.perf_counter()

    def lap(self, name: str) -> None:
        if self.parts is not None:
            now = time.perf_counter()
            self.parts[name] = self.parts.get(name, 0.0) + (now - self.t) * 1e3
            self.t = now
