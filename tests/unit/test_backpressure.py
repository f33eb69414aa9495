"""A streaming client that reads nothing holds its slot, not unbounded memory: its events
stop at a bound and generation resumes once it reads again. The engine thread and the event
loop run for real here; the backend is the fake."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref

from server.schemas.errors import APIError
from server.service.tasks import DISCONNECT_POLL_S, MAX_BACKLOG, TaskGroup
from server.task import GenParams, SamplingParams, TaskResult

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


class _Client:
    """A request's disconnect probe: gone once ``leave_at`` (monotonic) has passed."""

    def __init__(self, leave_after: float) -> None:
        self.leave_at = time.monotonic() + leave_after
        self.asked = 0

    async def is_disconnected(self) -> bool:
        self.asked += 1
        return time.monotonic() >= self.leave_at


async def _wait_results(max_tokens: int, client: _Client) -> tuple[str, float, int]:
    """A non-streaming group of one task; how it ended, after how long, and the number of
    asyncio tasks left running besides this one."""
    e, _ = make_engine(n_seq=1)
    e.start()
    try:
        group = TaskGroup(e, timeout=30)
        group.add(
            list(range(1, 20)), SamplingParams(temperature=0.0), GenParams(max_tokens=max_tokens)
        )
        group.submit()
        t0 = time.monotonic()
        try:
            (r,) = await group.results(client)
            how = r.finish.value
        except APIError as err:  # cancelled tasks end without a result
            how = f"error {err.status}"
        return how, time.monotonic() - t0, len(asyncio.all_tasks()) - 1
    finally:
        e.stop()


def test_a_quick_request_starts_no_disconnect_watcher():
    client = _Client(leave_after=60)
    how, took, left = asyncio.run(_wait_results(4, client))
    assert how == "length" and took < DISCONNECT_POLL_S
    assert client.asked == 0 and left == 0  # never asked: no watcher task was started


def test_a_gone_client_cancels_a_long_request():
    client = _Client(leave_after=0.3)
    how, took, left = asyncio.run(_wait_results(10**6, client))
    assert how == "cancelled"  # not run to its end
    assert client.asked >= 1 and left == 0
    assert 0.3 <= took < 0.3 + 3 * DISCONNECT_POLL_S
