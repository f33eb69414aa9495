"""The engine's way out: where a task's events go (the HTTP side implements it).

The engine thread never calls into the HTTP side beyond ``EventSink.deliver``: a task's
``emit`` is an ``Emitter`` (its ``receive`` runs on the sink's side, e.g. an event loop)
or, in unit tests, any plain callable (called on the engine thread). ``Engine._flush``
hands each sink a flush's events in one ``deliver`` call: one wake-up per event loop, not
one per event."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Generic, Protocol, TypeVar

E = TypeVar("E")

# One event bound to its receiver (``partial(receive, event)``): run on the sink's side.
Delivery = Callable[[], None]


class EventSink(Protocol):
    """The consumer side of the engine's events.

    ``deliver(batch)`` is called from the engine thread with deliveries in the order their
    events were sent; it must be thread-safe, never block, and never raise (a consumer that
    is gone drops them). It runs each delivery on its own side (an event loop's thread)."""

    def deliver(self, batch: Sequence[Delivery]) -> None: ...


@dataclass(frozen=True, slots=True)
class Emitter(Generic[E]):
    """One task's way out: ``receive`` runs on ``sink``'s side. Calling it sends one event
    at once (errors at shutdown); the engine batches the rest per sink (``Engine._flush``)."""

    receive: Callable[[E], None]
    sink: EventSink

    def __call__(self, ev: E) -> None:
        self.sink.deliver([self.bind(ev)])

    def bind(self, ev: E) -> Delivery:
        """``ev`` bound to this task's receiver, for a batch."""
        return partial(self.receive, ev)
