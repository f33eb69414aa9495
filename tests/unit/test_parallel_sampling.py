"""Pooled CPU sampling: ParallelSampling's thresholds, its automatic worker count (the
core count is faked, so every machine sees the same) and close; and the engine's
``_sample_all``, which samples a step's CPU-sampled slots together and falls back to one
by one when that raises."""

from __future__ import annotations

import dataclasses
import logging
import threading
from types import SimpleNamespace

import pytest

from server.engine import sampling_paths as sampling
from server.task import FinishReason, TaskError

from .helpers import make_engine, run, task


@pytest.fixture
def cores(monkeypatch):
    """Set the core count ParallelSampling sees."""

    def set_cores(n: int | None) -> None:
        monkeypatch.setattr(sampling, "os", SimpleNamespace(cpu_count=lambda: n))

    return set_cores


@pytest.mark.parametrize("n_cores,workers", [(None, 0), (1, 0), (2, 0), (3, 3), (8, 8), (64, 8)])
def test_auto_workers_by_cores(cores, n_cores, workers):
    cores(n_cores)
    par = sampling.ParallelSampling(workers=-1)
    try:
        assert par.workers == workers
        assert (par.pool is not None) == (workers > 1)
    finally:
        par.close()


def test_auto_needs_more_cores_than_min_cores(cores):
    cores(4)
    assert sampling.ParallelSampling(-1, min_cores=4).pool is None
    cores(5)
    par = sampling.ParallelSampling(-1, min_cores=4)
    assert par.workers == 5 and par.pool is not None
    par.close()


def test_pool_from_min_slots_on():
    par = sampling.ParallelSampling(workers=2, min_slots=4)
    try:
        assert [par.pool_for(n) for n in (0, 1, 2, 3)] == [None] * 4
        assert par.pool_for(4) is par.pool and par.pool_for(64) is par.pool
    finally:
        par.close()
    # a pool is never used for fewer than two slots, whatever min_slots says
    par = sampling.ParallelSampling(workers=2, min_slots=0)
    assert par.min_slots == 2 and par.pool_for(1) is None and par.pool_for(2) is par.pool
    par.close()


@pytest.mark.parametrize("workers", [0, 1])
def test_no_pool_with_fewer_than_two_workers(cores, workers):
    cores(16)  # explicit counts are taken as they are
    par = sampling.ParallelSampling(workers=workers, min_slots=2)
    assert par.workers == workers and par.pool is None and par.pool_for(100) is None


def test_the_pool_runs_on_its_workers_and_close_shuts_it_down():
    par = sampling.ParallelSampling(workers=2, min_slots=2)
    pool = par.pool_for(2)
    assert pool is not None
    names = list(pool.map(lambda _: threading.current_thread().name, range(4)))
    assert all(n.startswith("sample") for n in names), names
    par.close()
    assert par.pool is None and par.pool_for(2) is None
    with pytest.raises(RuntimeError):
        pool.submit(lambda: None)  # shut down
    par.close()  # twice is fine


def test_stopping_the_engine_closes_its_pool():
    e, _ = make_engine(sample_threads=2, sample_parallel_min=2)
    assert e.par.pool is not None
    e.stop()
    assert e.par.pool is None


class SampleSpy:
    """Wraps the fake backend's ``sample_many``: records each call's slots and pool."""

    def __init__(self, backend, fail: bool = False) -> None:
        self.real = backend.sample_many
        self.fail = fail
        self.calls: list[tuple[int, object]] = []

    def __call__(self, items, pool):
        self.calls.append((len(items), pool))
        if self.fail:
            raise RuntimeError("batched sampling broke")
        return self.real(items, pool)


def _run_four(monkeypatch, fail: bool = False, **kw):
    e, b = make_engine(n_seq=4, **kw)
    spy = SampleSpy(b, fail)
    monkeypatch.setattr(b, "sample_many", spy)
    tasks = [task([i + 1, i + 2, i + 3], 5) for i in range(4)]
    run(e, *(t for t, _ in tasks))
    e.par.close()
    return e, spy, [c for _, c in tasks]


def test_cpu_slots_are_sampled_together_on_the_pool(monkeypatch):
    e, spy, done = _run_four(monkeypatch, sample_threads=2, sample_parallel_min=4)
    # four slots each step: the prompt step, then four generated tokens to decode
    assert spy.calls and all(n == 4 for n, _ in spy.calls)
    assert all(pool is not None for _, pool in spy.calls)
    _, base, ref = _run_four(monkeypatch, sample_threads=0)
    assert [c.result.tokens for c in done] == [c.result.tokens for c in ref]
    assert all(pool is None for _, pool in base.calls)  # together, without a pool


def test_below_min_slots_they_are_sampled_together_without_the_pool(monkeypatch):
    _, spy, _ = _run_four(monkeypatch, sample_threads=2, sample_parallel_min=5)
    assert spy.calls and all((n, pool) == (4, None) for n, pool in spy.calls)


def test_one_slot_is_sampled_alone(monkeypatch):
    e, b = make_engine(n_seq=4, sample_threads=2, sample_parallel_min=2)
    spy = SampleSpy(b)
    monkeypatch.setattr(b, "sample_many", spy)
    t, c = task([1, 2, 3], 5)
    run(e, t)
    e.par.close()
    assert c.result.timings.predicted_n == 5 and spy.calls == []


def test_backend_sampled_slots_are_left_out(monkeypatch):
    e, b = make_engine(n_seq=4, sample_threads=0)
    b.backend_sampling = True  # chains without a penalty go to the backend
    spy = SampleSpy(b)
    monkeypatch.setattr(b, "sample_many", spy)
    tasks = [task([i + 1, i + 2], 3) for i in range(4)]
    for t, _ in tasks[:2]:  # penalties keep these two on the CPU
        t.sampling = dataclasses.replace(t.sampling, repeat_penalty=1.2)
    run(e, *(t for t, _ in tasks))
    assert spy.calls and all(n == 2 for n, _ in spy.calls)
    assert all(c.result.timings.predicted_n == 3 for _, c in tasks)


def test_the_batched_tokens_are_the_ones_taken(monkeypatch):
    e, b = make_engine(n_seq=4, sample_threads=0)
    monkeypatch.setattr(b, "sample_many", lambda items, pool: [40 + i for i in range(len(items))])
    tasks = [task([i + 1, i + 2], 1, id_slot=i) for i in range(3)]
    run(e, *(t for t, _ in tasks))
    assert [c.result.tokens for _, c in tasks] == [[40], [41], [42]]


def test_a_failed_batch_falls_back_to_one_by_one(monkeypatch, caplog):
    _, _, ref = _run_four(monkeypatch, sample_threads=0)
    with caplog.at_level(logging.ERROR, logger="server.engine.engine"):
        _, spy, done = _run_four(monkeypatch, fail=True, sample_threads=0)
    assert spy.calls  # it was tried, every step, and every slot still got its tokens
    assert [c.result.tokens for c in done] == [c.result.tokens for c in ref]
    assert sum("batched sampling failed" in r.message for r in caplog.records) == len(spy.calls)


def test_in_the_fallback_a_failing_slot_ends_alone(monkeypatch):
    e, b = make_engine(n_seq=4, sample_threads=0)
    monkeypatch.setattr(b, "sample_many", SampleSpy(b, fail=True))
    real = b.sample
    tasks = [task([i + 1, i + 2], 4, id_slot=i) for i in range(3)]

    def sample(sampler, idx):
        if b.outputs[idx][0] == 1:  # slot 1's row
            raise RuntimeError("no candidates")
        return real(sampler, idx)

    monkeypatch.setattr(b, "sample", sample)
    run(e, *(t for t, _ in tasks))
    (_, c0), (_, c1), (_, c2) = tasks
    assert isinstance(c1.error, TaskError) and "sampling failed: no candidates" in c1.error.message
    for c in (c0, c2):
        assert c.result.finish is FinishReason.LENGTH and c.result.timings.predicted_n == 4
