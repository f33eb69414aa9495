"""Cooperative cancellation of a request's preparation (rendering, tokenizing, mapping).

The work runs in a worker thread (server.service.pools); the coroutine that waits for it sets
the request's ``CancelFlag`` when the client leaves or the time limit passes. The work itself
calls ``checkpoint()`` between messages, items and tokenizer chunks: it raises ``Cancelled``
once the flag is set, so abandoned work stops within one message, not at its end. Outside a
worker that runs with a flag (a unit test, the engine thread), ``checkpoint`` does nothing.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

# A worker holding the GIL makes every other thread that wants it wait up to the switch
# interval (5 ms) each time it takes it back, and the engine thread takes it back after
# every llama.cpp call: one heavy render stalled a stream for 1.2 s. So work that checks
# its flag also lets go of the GIL every YIELD_EVERY_S, for YIELD_S (long enough for a
# waiting thread to wake and take it): no thread waits on it more than about a millisecond.
YIELD_EVERY_S = 0.001
YIELD_S = 0.0001


T = TypeVar("T")


class Cancelled(Exception):
    """The request's preparation was abandoned: its client left or its time ran out. Nobody
    reads the result; the waiting coroutine has already answered."""


class CancelFlag:
    """Set once, from the event loop; read from the worker (a plain attribute: one writer)."""

    __slots__ = ("next_yield", "reason", "set")

    def __init__(self) -> None:
        self.set = False
        self.reason = ""
        self.next_yield = 0.0  # perf_counter time of the worker's next GIL yield

    def cancel(self, reason: str) -> None:
        if not self.set:
            self.reason = reason
            self.set = True


_CURRENT: contextvars.ContextVar[CancelFlag | None] = contextvars.ContextVar(
    "prep_cancel_flag", default=None
)


def checkpoint() -> None:
    """Raise ``Cancelled`` if the work running in this thread was abandoned; otherwise let
    other threads have the GIL for a moment if this one has held it a while."""
    flag = _CURRENT.get()
    if flag is None:
        return
    if flag.set:
        raise Cancelled(flag.reason)
    now = time.perf_counter()
    if now >= flag.next_yield:
        if flag.next_yield:
            time.sleep(YIELD_S)
        flag.next_yield = time.perf_counter() + YIELD_EVERY_S


def run_with(flag: CancelFlag, fn: Callable[..., T], args: tuple[object, ...]) -> T:
    """``fn(*args)`` with ``flag`` as this thread's flag (what ``checkpoint`` reads). A flag
    already set means the work was abandoned before it started: nothing runs."""
    if flag.set:
        raise Cancelled(flag.reason)
    token = _CURRENT.set(flag)
    try:
        return fn(*args)
    finally:
        _CURRENT.reset(token)


class Watched(list[T]):
    """A list whose iteration calls ``checkpoint`` before each item: handed to a chat
    template as ``messages``, a render whose client left stops at the next message. Indexing,
    ``len``, slicing and JSON encoding are a list's."""

    def __iter__(self) -> Iterator[T]:
        it = super().__iter__()
        for item in it:
            checkpoint()
            yield item
