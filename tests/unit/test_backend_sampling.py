"""Backend sampling placement (-bs) and parallel CPU sampling, on the fake backend."""

from __future__ import annotations

import dataclasses

from server.engine import sampling_paths as sampling
from server.task import SamplingParams
from tests.unit.helpers import make_engine, run, task


def _with(t, **sp):
    t.sampling = dataclasses.replace(t.sampling, **sp)
    return t


def test_cpu_reason() -> None:
    t, _ = task([1, 2, 3])
    assert sampling.cpu_reason(t) == ""
    assert sampling.cpu_reason(_with(task([1])[0], repeat_penalty=1.1)) == sampling.PENALTIES
    # a penalty over an empty window does nothing: it stays on the backend
    assert sampling.cpu_reason(_with(task([1])[0], repeat_penalty=1.1, repeat_last_n=0)) == ""
    assert sampling.cpu_reason(_with(task([1])[0], logit_bias={5: -1.0})) == ""  # in the graph
    t2, _ = task([1])
    t2.gen.n_probs = 2
    assert sampling.cpu_reason(t2) == sampling.LOGPROBS
    t3, _ = task([1])
    t3.gen.logprobs = True
    assert sampling.cpu_reason(t3) == sampling.LOGPROBS


def test_placement_is_counted_and_chains_detach() -> None:
    e, b = make_engine(n_seq=4)
    b.backend_sampling = True
    plain, c1 = task([1, 2, 3], 3)
    penalized, c2 = task([4, 5, 6], 3)
    penalized.sampling = SamplingParams(temperature=0.0, repeat_penalty=1.2)
    run(e, plain, penalized)
    assert c1.result is not None and c2.result is not None
    assert e.stats.backend_sampled == 1
    assert e.stats.sampling_fallbacks == {"penalties": 1}
    assert len(b.attached) == 1
    assert all(s.freed for s in b.samplers)


def test_no_placement_without_bs() -> None:
    e, b = make_engine(n_seq=2)
    t, c = task([1, 2, 3], 3)
    run(e, t)
    assert c.result is not None
    assert e.stats.backend_sampled == 0 and e.stats.sampling_fallbacks == {}
    assert b.attached == {}


def test_parallel_sampling_gives_the_same_tokens() -> None:
    """The pool only changes when tokens are sampled, never which."""
    outs = []
    for threads in (0, 2):
        e, _ = make_engine(n_seq=6, sample_threads=threads, sample_parallel_min=2)
        assert (e.par.pool is not None) == (threads == 2)
        tasks = [task([i + 1, i + 2, i + 3], 6) for i in range(6)]
        run(e, *(t for t, _ in tasks))
        outs.append([c.result.tokens for _, c in tasks])
        e.par.close()
    assert outs[0] == outs[1]


def test_parallel_sampling_auto() -> None:
    par = sampling.ParallelSampling(workers=-1)
    # on at most 2 cores it is off (measured: no gain); elsewhere it needs enough slots
    assert par.pool_for(1) is None
    if par.pool is not None:
        assert par.pool_for(par.min_slots) is par.pool
    par.close()


def test_flag_and_variable() -> None:
    from server.http.app import engine_options, model_options
    from server.settings.config import parse_settings

    s = parse_settings(["-bs", "--sample-threads", "0"])
    assert s.backend_sampling and s.sample_threads == 0
    assert model_options(s, "/m.gguf").backend_sampling
    assert engine_options(s, has_cache=False).sample_threads == 0
    assert parse_settings([], env={"LLAMA_ARG_BACKEND_SAMPLING": "1"}).backend_sampling
    assert not parse_settings([]).backend_sampling
