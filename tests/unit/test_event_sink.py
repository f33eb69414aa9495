"""The engine's way out (engine/event_sink.py): a task's events reach the HTTP side only through
an ``EventSink``, one ``deliver`` per sink per flush, in order; the HTTP side's sink
(service/sink.py) is one per event loop, so every stream of a loop shares its wake-up."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path

from server.engine.event_sink import Delivery, Emitter, EventSink
from server.service.sink import LoopSink, emitter, loop_sink
from server.task import Event, GenParams, SamplingParams, Task, TaskResult, TextChunk
from tests.unit.helpers import make_engine, run

ROOT = Path(__file__).resolve().parents[2]


class RecordingSink:
    """An EventSink that runs deliveries at once and records each batch's size."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    def deliver(self, batch: Sequence[Delivery]) -> None:
        self.batches.append(len(batch))
        for d in batch:
            d()


def _task(prompt: list[int], sink: EventSink, out: list[Event]) -> Task:
    return Task(
        prompt=prompt,
        sampling=SamplingParams(temperature=0.0),
        gen=GenParams(max_tokens=3),
        emit=Emitter(out.append, sink),
    )


def test_a_steps_events_of_every_task_go_to_their_sink_in_one_delivery() -> None:
    engine, _ = make_engine(n_seq=2)
    sink = RecordingSink()
    a: list[Event] = []
    b: list[Event] = []
    steps = run(engine, _task([1, 2, 3], sink, a), _task([4, 5, 6], sink, b))
    # both tasks streamed text and ended, each in its own order
    for out in (a, b):
        assert isinstance(out[-1], TaskResult)
        assert all(isinstance(e, TextChunk) for e in out[:-1]) and len(out) > 1
    # one hand-off per flush (at most one per step here), never one per event
    assert len(sink.batches) <= steps
    assert sum(sink.batches) == len(a) + len(b)
    assert max(sink.batches) >= 2  # both tasks' events shared a delivery


def test_the_http_sink_is_one_per_loop_and_runs_deliveries_on_it() -> None:
    loop = asyncio.new_event_loop()
    try:
        assert loop_sink(loop) is loop_sink(loop)
        assert isinstance(loop_sink(loop), LoopSink)
        got: list[tuple[str, int]] = []
        seen_threads: set[int] = set()

        def receive(ev: int) -> None:
            seen_threads.add(threading.get_ident())
            got.append(("a", ev))

        e = emitter(loop, receive)
        assert e.sink is loop_sink(loop)
        worker = threading.Thread(target=lambda: [e(1), e(2)])
        worker.start()
        worker.join()
        loop.run_until_complete(asyncio.sleep(0.01))
        assert got == [("a", 1), ("a", 2)]
        assert seen_threads == {threading.get_ident()}  # the loop's thread
    finally:
        loop.close()
    emitter(loop, print)(3)  # a closed loop drops events: never raises


def test_no_attributes_glued_onto_callables_for_the_engine() -> None:
    """The boundary is typed: nothing sets ``.loop``/``.deliver`` on a function, and no
    ``type: ignore`` hides it."""
    for path in (ROOT / "server").rglob("*.py"):
        text = path.read_text()
        assert "emit.loop" not in text and "emit.deliver" not in text, path
        assert 'getattr(emit, "loop"' not in text, path


def test_a_loop_without_weak_references_still_gets_one_sink() -> None:
    class SlotsLoop:  # like an event loop implemented in C without __weakref__
        __slots__ = ()

    loop = SlotsLoop()
    first = loop_sink(loop)  # type: ignore[arg-type]
    assert loop_sink(loop) is first  # type: ignore[arg-type]
