"""The HTTP side of the engine's way out: one ``EventSink`` per event loop.

The engine hands each sink a flush's events in one ``deliver`` (engine/event_sink.py); here that
is one ``call_soon_threadsafe``, so a step that produced events for 64 streams of one loop
wakes it once."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Sequence
from typing import TypeVar

from ..engine.event_sink import Delivery, Emitter

E = TypeVar("E")


class LoopSink:
    """The ``EventSink`` of one asyncio event loop: deliveries run on the loop's thread, in
    order. Thread-safe; a closed loop drops them (its clients are gone)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def deliver(self, batch: Sequence[Delivery]) -> None:
        try:
            self.loop.call_soon_threadsafe(_run_all, batch)
        except RuntimeError:  # loop closed: the clients are long gone
            pass


def _run_all(batch: Sequence[Delivery]) -> None:
    for delivery in batch:
        delivery()


# one sink per loop, so the engine groups every task of a loop into one hand-off (two
# sinks for one loop, should two threads race here, only cost that loop a second wake-up)
_SINKS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopSink] = weakref.WeakKeyDictionary()
# loops that take no weak reference (an event loop implemented in C may not): kept for the
# process's life (a server runs one loop)
_KEPT: dict[asyncio.AbstractEventLoop, LoopSink] = {}


def loop_sink(loop: asyncio.AbstractEventLoop) -> LoopSink:
    """The sink of ``loop`` (created on first use, freed with the loop)."""
    try:
        sink = _SINKS.get(loop)
        if sink is None:
            sink = _SINKS[loop] = LoopSink(loop)
    except TypeError:  # no weak references to this loop
        sink = _KEPT.setdefault(loop, LoopSink(loop))
    return sink


def emitter(loop: asyncio.AbstractEventLoop, receive: Callable[[E], None]) -> Emitter[E]:
    """A task's ``emit``: ``receive`` runs on ``loop`` (thread-safe, never blocks)."""
    return Emitter(receive, loop_sink(loop))
