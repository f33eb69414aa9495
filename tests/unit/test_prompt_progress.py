"""The engine's prompt progress events (return_progress), on the fake backend."""

from __future__ import annotations

from server.task import PromptProgress, TaskResult, TextChunk

from .helpers import make_engine, run, task


def _progress(events: list) -> list[PromptProgress]:
    return [e for e in events if isinstance(e, PromptProgress)]


def test_progress_per_chunk_monotonic_and_ending_at_the_total() -> None:
    e, _ = make_engine(n_batch=64)
    t, c = task(range(300), max_tokens=2)
    t.return_progress = True
    run(e, t)
    p = _progress(c.events)
    assert [x.processed for x in p] == [0, 64, 128, 192, 256, 300]
    assert all(x.total == 300 and x.cache == 0 for x in p)
    assert all(a.time_ms <= b.time_ms for a, b in zip(p, p[1:], strict=False))
    # every progress event comes before the first text and the result
    first_other = next(i for i, ev in enumerate(c.events) if isinstance(ev, TextChunk | TaskResult))
    assert all(c.events.index(x) < first_other for x in p)


def test_progress_starts_at_the_cached_prefix() -> None:
    e, _ = make_engine(n_batch=64)
    run(e, task(range(200), max_tokens=1)[0])
    t, c = task([*range(200), *range(500, 600)], max_tokens=1)
    t.return_progress = True
    run(e, t)
    p = _progress(c.events)
    assert p[0].processed == p[0].cache == 200 and p[-1].processed == 300
    assert [x.processed for x in p] == sorted(x.processed for x in p)


def test_no_progress_unless_asked_or_when_not_streaming() -> None:
    e, _ = make_engine(n_batch=64)
    t1, c1 = task(range(300), max_tokens=2)
    t2, c2 = task(range(1000, 1300), max_tokens=2)
    t2.return_progress, t2.stream = True, False
    run(e, t1, t2)
    assert c1.result is not None and c2.result is not None
    assert _progress(c1.events) == [] and _progress(c2.events) == []


def test_timings_per_token_ride_on_each_text_chunk() -> None:
    e, _ = make_engine(n_batch=64)
    t, c = task(range(100), max_tokens=4)
    t.timings_per_token = True
    plain, cp = task(range(200, 300), max_tokens=4)
    run(e, t, plain)
    chunks = [ev for ev in c.events if isinstance(ev, TextChunk)]
    assert chunks and all(ch.timings is not None for ch in chunks)
    assert [ch.timings.predicted_n for ch in chunks] == list(range(1, len(chunks) + 1))
    assert all(ch.timings.prompt_n == 100 for ch in chunks)
    assert c.result.timings.predicted_n == 4
    assert all(ev.timings is None for ev in cp.events if isinstance(ev, TextChunk))
