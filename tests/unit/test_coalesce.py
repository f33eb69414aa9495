"""Engine._coalesce: woken from idle, the engine waits in slices of coalesce_ms while
requests keep arriving, four slices at most, and not at all when nothing waits or no other
request is being prepared (``Engine.arrival``: a lone request runs at once). Time is
never measured: ``time.sleep`` is replaced by a clock that records the slices and lets the
test's arrivals reach the engine's real inbox during them."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from server.engine import engine as engine_mod

from .helpers import make_engine, task


class Arrivals:
    """A stand-in for ``time.sleep`` in the engine module: each slice slept puts the next
    scripted number of tasks into the engine's inbox (0 when the script has ended), each
    one arrival less on its way (as service.submit hands them over)."""

    def __init__(self, engine, script: list[int]) -> None:
        self.engine = engine
        self.script = list(script)
        self.slices: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slices.append(seconds)
        for _ in range(self.script.pop(0) if self.script else 0):
            self.engine.arrival(-1)
            self.engine._inbox.put(task([1, 2, 3])[0])


def coalesce(monkeypatch, waiting: int, script: list[int], on_way: int = 100, **opts) -> Arrivals:
    """Run ``_coalesce`` with ``waiting`` tasks already in the inbox, ``on_way`` requests
    being prepared and ``script``'s arrivals during its slices; returns the recorded slices."""
    e, _ = make_engine(**opts)
    e.arrival(on_way)
    clock = Arrivals(e, script)
    fake_time = SimpleNamespace(sleep=clock.sleep, perf_counter=time.perf_counter)
    monkeypatch.setattr(engine_mod, "time", fake_time)
    for _ in range(waiting):
        e._inbox.put(task([1])[0])
    e._coalesce()
    assert e._inbox.qsize() == waiting + sum(script[: len(clock.slices)])
    return clock


def test_nothing_waiting_returns_at_once(monkeypatch):
    assert coalesce(monkeypatch, 0, [5, 5]).slices == []


def test_off_when_coalesce_ms_is_zero(monkeypatch):
    assert coalesce(monkeypatch, 3, [1], coalesce_ms=0).slices == []
    assert coalesce(monkeypatch, 3, [1], coalesce_ms=-1).slices == []


def test_one_slice_when_nothing_more_arrives(monkeypatch):
    assert coalesce(monkeypatch, 1, []).slices == [0.002]  # the default 2 ms


def test_a_lone_request_runs_at_once(monkeypatch):
    """No other request being prepared: nothing can join the first decode, no slice."""
    assert coalesce(monkeypatch, 1, [1], on_way=0).slices == []
    assert coalesce(monkeypatch, 3, [1], on_way=0).slices == []


def test_stops_once_the_last_arrival_is_in(monkeypatch):
    """Two on their way: the slices last until both are in, not until a quiet slice."""
    assert coalesce(monkeypatch, 1, [1, 1, 1], on_way=2).slices == [0.002] * 2


@pytest.mark.parametrize("n_more", [1, 2, 3])
def test_waits_while_arrivals_keep_coming(monkeypatch, n_more):
    # each slice that saw an arrival is followed by another; the first quiet one ends it
    clock = coalesce(monkeypatch, 1, [1] * n_more + [0, 1], coalesce_ms=5.0)
    assert clock.slices == [0.005] * (n_more + 1)


def test_at_most_four_slices_however_many_arrive(monkeypatch):
    clock = coalesce(monkeypatch, 2, [3] * 10, coalesce_ms=1.5)
    assert clock.slices == [0.0015] * 4


def test_tasks_that_arrive_while_it_waits_share_the_first_decode(monkeypatch):
    """The three tasks that arrive during the slices and the first are one decode."""
    e, b = make_engine(n_seq=4, coalesce_ms=2.0)
    e.arrival(3)
    clock = Arrivals(e, [2, 1])
    monkeypatch.setattr(
        engine_mod, "time", SimpleNamespace(sleep=clock.sleep, perf_counter=time.perf_counter)
    )
    e._inbox.put(task([9, 9, 9], max_tokens=1)[0])
    e._coalesce()
    e.step()
    assert clock.slices == [0.002] * 2  # the last arrival is in: no third slice
    assert len(b.decodes) == 1 and len({s for s, _, _ in b.decodes[0]}) == 4


def test_commands_alone_are_not_coalesced(monkeypatch):
    """A slot save or restore woken from idle has no decode to share: no slice is slept
    for it; a task beside it is coalesced as before."""
    e, _ = make_engine()
    e.arrival(1)
    clock = Arrivals(e, [])
    fake_time = SimpleNamespace(sleep=clock.sleep, perf_counter=time.perf_counter)
    monkeypatch.setattr(engine_mod, "time", fake_time)
    monkeypatch.setattr(engine_mod.Engine, "alive", property(lambda self: True))
    e.call(lambda engine: None)
    e._coalesce()
    assert clock.slices == []
    e._inbox.put(task([1])[0])
    e._coalesce()
    assert clock.slices == [0.002]
    e._drain_inbox()
    assert e._ops_queued == 0 and len(e._ops) == 1
