"""A least-recently-used map bounded by the bytes its values hold: the one shape behind the
images' embedding cache (server.llama.mtmd) and the base64 texts decoded lately
(server.media.image_inputs). Imports nothing of the server's, so any layer may use it."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SizedLRU(Generic[K, V]):
    """Values by key within ``max_bytes`` (each value's size: ``size``), least recently
    used out first. Thread-safe: every method takes ``lock``. Invariant: ``nbytes`` is the
    sum of the held values' sizes and at most ``max_bytes``."""

    def __init__(self, max_bytes: int, size: Callable[[V], int]) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._size = size
        self._items: OrderedDict[K, V] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, key: K) -> V | None:
        """The value, now the most recently used; None when not held."""
        with self.lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> int:
        """Hold ``value`` (replacing the key's old one); returns how many values left to
        make room. A value larger than ``max_bytes`` is not held (nothing leaves)."""
        n = self._size(value)
        if n > self.max_bytes:
            return 0
        gone = 0
        with self.lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.nbytes -= self._size(old)
            self._items[key] = value
            self.nbytes += n
            while self.nbytes > self.max_bytes and self._items:
                _, dropped = self._items.popitem(last=False)
                self.nbytes -= self._size(dropped)
                gone += 1
        return gone

    def __contains__(self, key: object) -> bool:
        with self.lock:
            return key in self._items

    def __len__(self) -> int:
        return len(self._items)
