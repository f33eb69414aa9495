"""server.service.pools: a request's preparation on bounded pools of its own, abandoned when
its client leaves or its time runs out, and a small request never queued behind big ones."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from server.cancel import CancelFlag, Cancelled, Watched, checkpoint, run_with
from server.schemas.errors import APIError
from server.service import pools
from server.templates.chat_template import BUILTIN_TEMPLATES, ChatTemplate


class FakeRequest:
    """What ``prepare`` reads of a request: its length, method, state, and whether its
    client is still there (gone once ``gone`` is set)."""

    def __init__(self, length: int = 100) -> None:
        self.headers = {"content-length": str(length)}
        self.method = "POST"
        self.state = SimpleNamespace()
        self.gone = threading.Event()

    async def is_disconnected(self) -> bool:
        return self.gone.is_set()


def spin(stop: threading.Event, started: threading.Event, counter: list[int]) -> str:
    """Work that checks its flag between 'messages', as rendering does."""
    started.set()
    while not stop.is_set():
        checkpoint()
        counter[0] += 1
        time.sleep(0.001)
    return "done"


def test_work_runs_on_its_own_pool_not_the_default_executor() -> None:
    async def main() -> str:
        return await pools.prepare(FakeRequest(), 10, lambda: threading.current_thread().name)

    assert asyncio.run(main()).startswith("prep-light")


def test_lanes_by_body_size() -> None:
    assert pools.lane_of(None) == "light"
    assert pools.lane_of(FakeRequest(1000)) == "light"
    assert pools.lane_of(FakeRequest(pools.HEAVY_BYTES + 1)) == "heavy"
    chunked = FakeRequest()
    chunked.headers = {}
    assert pools.lane_of(chunked) == "heavy"


def test_a_client_that_leaves_stops_its_running_work() -> None:
    """Every heavy worker busy with a request whose client then leaves: each stops at its
    next checkpoint, and the caller gets 499 (which nobody reads)."""
    stop = threading.Event()
    n = pools.HEAVY_WORKERS
    counters = [[0] for _ in range(n)]
    reqs = [FakeRequest(pools.HEAVY_BYTES * 2) for _ in range(n)]

    async def main() -> list[Any]:
        jobs = [
            asyncio.create_task(pools.prepare(r, 60, spin, stop, threading.Event(), c))
            for r, c in zip(reqs, counters, strict=True)
        ]
        await asyncio.sleep(0.3)
        for r in reqs:
            r.gone.set()
        return await asyncio.wait_for(asyncio.gather(*jobs, return_exceptions=True), 10)

    try:
        out = asyncio.run(main())
        assert all(isinstance(e, APIError) and e.status == 499 for e in out), out
        time.sleep(0.2)  # past one checkpoint of each
        before = [c[0] for c in counters]
        time.sleep(0.3)
        assert [c[0] for c in counters] == before  # none still runs
    finally:
        stop.set()


def test_queued_work_of_a_client_that_left_never_starts() -> None:
    stop = threading.Event()
    queued_started = threading.Event()

    async def main() -> None:
        busy = [
            asyncio.create_task(
                pools.prepare(
                    FakeRequest(pools.HEAVY_BYTES * 2), 60, spin, stop, threading.Event(), [0]
                )
            )
            for _ in range(pools.HEAVY_WORKERS)
        ]
        req = FakeRequest(pools.HEAVY_BYTES * 2)
        queued = asyncio.create_task(pools.prepare(req, 60, queued_started.set))
        await asyncio.sleep(0.2)
        req.gone.set()
        with pytest.raises(APIError) as e:
            await asyncio.wait_for(queued, 5)  # answered while the lane is still full
        assert e.value.status == 499
        stop.set()
        assert await asyncio.gather(*busy) == ["done"] * pools.HEAVY_WORKERS
        await asyncio.sleep(0.2)

    try:
        asyncio.run(main())
        assert not queued_started.is_set()
    finally:
        stop.set()


def test_heavy_lane_full_a_light_request_runs_at_once() -> None:
    stop = threading.Event()
    n = pools.HEAVY_WORKERS * 2

    async def main() -> float:
        heavy = [
            asyncio.create_task(
                pools.prepare(
                    FakeRequest(pools.HEAVY_BYTES * 2), 60, spin, stop, threading.Event(), [0]
                )
            )
            for _ in range(n)
        ]
        await asyncio.sleep(0.2)
        t = time.monotonic()
        assert await pools.prepare(FakeRequest(), 60, lambda: "small") == "small"
        took = time.monotonic() - t
        stop.set()
        await asyncio.gather(*heavy)
        return took

    try:
        assert asyncio.run(main()) < 5  # it ran at once; before, it waited for the big ones
    finally:
        stop.set()


def test_time_limit_is_408_for_the_whole_request() -> None:
    """The limit counts from the request's first hand-off: a second one gets what is left."""
    stop = threading.Event()
    req = FakeRequest()

    async def main() -> None:
        await pools.prepare(req, 0.6, time.sleep, 0.4)
        with pytest.raises(APIError) as e:
            await pools.prepare(req, 0.6, spin, stop, threading.Event(), [0])
        assert e.value.status == 408 and e.value.type == "timeout_error"
        assert "--request-prep-timeout" in e.value.message

    try:
        t = time.monotonic()
        asyncio.run(main())
        assert time.monotonic() - t < 5
    finally:
        stop.set()


def test_errors_of_the_work_pass_through() -> None:
    def bad() -> None:
        raise APIError(400, "bad body")

    async def main() -> None:
        await pools.prepare(FakeRequest(), 10, bad)

    with pytest.raises(APIError) as e:
        asyncio.run(main())
    assert e.value.status == 400


def test_a_template_stops_between_messages_once_cancelled() -> None:
    """``messages`` reach the template as a Watched list: a render whose flag is set stops
    at the next message instead of rendering all of them."""
    flag = CancelFlag()
    tpl = ChatTemplate(BUILTIN_TEMPLATES["chatml"])
    msgs = [{"role": "user", "content": str(i)} for i in range(1000)]
    rendered = []

    class Counting(Watched):
        def __iter__(self) -> Iterator[Any]:
            for i, m in enumerate(super().__iter__()):
                rendered.append(i)
                if i == 5:
                    flag.cancel("the client left")
                yield m

    with pytest.raises(Cancelled):
        run_with(flag, lambda: tpl._tpl.render(messages=Counting(msgs)), ())  # noqa: SLF001
    assert len(rendered) == 6

    def cancelled_render() -> str:
        flag2.cancel("the client left")
        return tpl.render(msgs)

    flag2 = CancelFlag()
    with pytest.raises(Cancelled):
        run_with(flag2, cancelled_render, ())
