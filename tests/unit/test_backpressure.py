"""A streaming client that reads nothing holds its slot, not unbounded memory: its events
stop at a bound and generation resumes once it reads again. The engine thread and the event
loop run for real here; the backend is the fake."""

from __future__ import annotations

import asyncio
import time

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
