"""One spare buffer for the next slot state copied into the RAM cache.

A slot's state copied into new memory faults in every page of it: 2,760 faults for a
Gemma 3 slot of 1,100 tokens (11 MiB), ~6 of the copy's ~8 ms on this machine, and the copy
runs on the launched task's path (--cache-idle-slots, a slot about to be overwritten).
Conversations that outnumber the slots take one state out of the RAM cache for each one
they put in: the one taken (restored into a slot, nothing reads it any more) becomes the
spare, and the next copy lands in its pages (~2 ms).

A copy is a bytearray of exactly the state's size, made 1/8 larger than that when new, so
that the next turn's slightly larger state still fits it when it comes back as the spare
(the RAM cache counts the states' sizes: its buffers may hold up to 1/8 more). A spare is
resized in place only within what it holds (``PyByteArray_Resize`` keeps the allocation
when the size stays above half of it): no copy, no page touched anew.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

HEADROOM = 8  # a new copy's allocation is its size plus 1/HEADROOM

_EMPTY = sys.getsizeof(bytearray())
_resize = ctypes.pythonapi.PyByteArray_Resize
_resize.argtypes = [ctypes.py_object, ctypes.c_ssize_t]
_resize.restype = ctypes.c_int


def room(buf: bytearray) -> int:
    """The bytes ``buf`` can hold without a new allocation (its allocation, less the
    trailing NUL a bytearray keeps)."""
    return sys.getsizeof(buf) - _EMPTY - 1


def _fits(buf: bytearray, size: int) -> bool:
    return room(buf) // 2 < size <= room(buf)


class Spare:
    """The engine thread's spare state buffer (no lock: one thread uses it)."""

    def __init__(self) -> None:
        self._buf: bytearray | None = None
        self.reused = 0  # copies made into the spare (tests, /slots debugging)

    def give(self, data: object) -> None:
        """Keep ``data`` (a restored state's bytes, which nothing reads any more) as the
        spare when it is a bytearray with more room than the one kept."""
        if isinstance(data, bytearray) and (self._buf is None or room(data) > room(self._buf)):
            self._buf = data

    def copy(self, size: int, fill: Callable[[bytearray, int], int]) -> bytearray | None:
        """A bytearray of exactly ``size`` bytes, filled by ``fill(buf, size)`` (which
        returns the bytes written, 0 on failure): the spare when it has room, else a new
        one with 1/HEADROOM more. None when ``fill`` fails."""
        buf, self._buf = self._buf, None
        reused = buf is not None and _fits(buf, size)
        if not reused:
            buf = bytearray(size + size // HEADROOM)
        assert buf is not None
        try:
            _resize(buf, size)  # within its allocation: in place
        except (BufferError, MemoryError):  # exported or not resizable: a new one
            buf, reused = bytearray(size), False
        if fill(buf, size) != size:
            return None
        self.reused += reused
        return buf
