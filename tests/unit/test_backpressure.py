"""A streaming client that reads nothing holds its slot, not unbounded memory: its events
stop at a bound and generation resumes once it reads again. The engine thread and the event
loop run for real here; the backend is the fake."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref

from server.service.tasks import MAX_BACKLOG, TaskGroup
from server.types import GenParams, SamplingParams, TaskResult

from .helpers import make_engine


async def _lagging_reader() -> tuple[int, int, int, TaskResult | None]:
    e, _ = make_engine(n_seq=2)
    e.start()
    try:
        group = TaskGroup(e, timeout=30)
        group.add(list(range(1, 20)), SamplingParams(temperature=0.0), GenParams(max_tokens=3000))
        group.submit()
        await asyncio.sleep(0.3)  # the client reads nothing
        run = e.slots[0].run
        decoded_early = run.n_decoded
        await asyncio.sleep(0.3)
        decoded_later, queued = run.n_decoded, len(group.pending)
        result = None
        async for _, ev in group.events():  # the client reads again: it finishes
            if isinstance(ev, TaskResult):
                result = ev
        return decoded_early, decoded_later, queued, result
    finally:
        e.stop()


def test_a_reader_that_lags_stops_its_generation_at_a_bound():
    t0 = time.time()
    early, later, queued, result = asyncio.run(_lagging_reader())
    assert early == later  # stalled, not generating into an unbounded queue
    assert MAX_BACKLOG <= queued <= MAX_BACKLOG + 2  # one step may overshoot by a token
    assert result is not None and result.timings.predicted_n == 3000
    assert time.time() - t0 < 20


async def _finished_groups(n: int) -> tuple[list, list, list[int]]:
    """Runs ``n`` streamed groups to the end (read in batches) and one cancelled early;
    returns the groups still alive, their tasks still alive that no slot holds as its last
    run (an idle slot keeps it, for /slots), and each group's event count."""
    e, _ = make_engine(n_seq=2)
    e.start()
    groups: list = []
    tasks: list = []
    counts: list[int] = []
    try:
        for i in range(n + 1):
            group = TaskGroup(e, timeout=30)
            group.add(list(range(1, 20)), SamplingParams(temperature=0.0), GenParams(max_tokens=8))
            group.submit()
            seen = 0
            async for batch in group.batches():
                seen += len(batch)
                if i == n:
                    break  # a client that leaves early: its task is cancelled
            counts.append(seen)
            groups.append(weakref.ref(group))
            tasks.append(weakref.ref(group.tasks[0]))
            del group, batch
        await asyncio.sleep(0.2)  # the cancelled task ends on the engine thread
        held = {id(s.run.task) for s in e.slots if s.run is not None}
        alive_groups = [g() for g in groups if g() is not None]
        alive_tasks = [t() for t in tasks if t() is not None and id(t()) not in held]
    finally:
        e.stop()
    return alive_groups, alive_tasks, counts


def test_a_finished_request_is_freed_without_the_garbage_collector():
    """A request's TaskGroup and tasks form no reference cycle (the engine's emitters and
    lagging checks reach only the group's mailbox), so they are freed as soon as the request
    is done, not at the collector's next full pass (see server.http.heap)."""
    gc.collect()
    gc.disable()
    try:
        groups, tasks, counts = asyncio.run(_finished_groups(3))
    finally:
        gc.enable()
    assert counts[:3] == [9, 9, 9]  # 8 chunks and the result, each group
    assert groups == []
    assert tasks == []
