"""Speculative decoding: the n-gram drafter, and drafts verified in the engine's batch (fake
backend, whose output does not depend on the batch layout, so outputs compare exactly here;
the e2e test compares the real model's with a tolerance)."""

from __future__ import annotations

import numpy as np

from server.slot.sequence import Sequence
from server.slot.speculative import (
    SPEC_NGRAM,
    DraftLimits,
    SpecConfig,
    draft_room,
    ngram_draft,
    request_limits,
)
from tests.unit.helpers import make_engine, run, task

PERIOD = 50


def cyclic(tok: int, pos: int) -> int:
    """A "model" that continues 0, 1, ..., 49, 0, 1, ...: its answers repeat its context."""
    return (tok + 1) % PERIOD


def arr(xs) -> np.ndarray:
    return np.array(xs, dtype=np.int32)


# ---- the drafter --------------------------------------------------------------------


def test_ngram_draft_takes_what_followed_the_latest_match():
    # "1 2 3" occurs at 1 and at 10; the latest earlier one (10) is followed by 7 8 9 ...
    hist = arr([0, 1, 2, 3, 4, 5, 6, 0, 0, 0, 1, 2, 3, 7, 8, 9, 10, 11, 12, 0, 0, 1, 2])
    assert ngram_draft(hist, 3, size_n=3, size_m=5) == [7, 8, 9, 10, 11]


def test_ngram_draft_needs_a_match_and_size_n_tokens_after_it():
    hist = arr(list(range(30)))
    assert ngram_draft(hist, 99, size_n=3, size_m=5) == []  # no earlier occurrence
    # the only match is followed by 2 tokens (< size_n): no draft
    hist = arr([5, 6, 7, 8, 1, 2, 3, 40, 41] + [90 + i for i in range(10)] + [1, 2])
    assert ngram_draft(hist, 3, size_n=3, size_m=2) == []
    # too short a context for an n-gram and an m-gram
    assert ngram_draft(arr([1, 2, 3, 1, 2]), 3, size_n=3, size_m=5) == []


def test_ngram_draft_is_capped_by_size_m_and_the_context_end():
    hist = arr(list(range(PERIOD)) * 2)  # ends with 49; the next token is 0
    assert ngram_draft(hist, 0, size_n=4, size_m=6) == [1, 2, 3, 4, 5, 6]
    hist = arr(list(range(PERIOD)) + list(range(8)))  # match at 4..7, 46 tokens follow
    got = ngram_draft(hist, 8, size_n=4, size_m=48)
    assert got == list(range(9, PERIOD)) + list(range(0, 8))[: 48 - (PERIOD - 9)]


def test_the_sequences_array_view_follows_appends_cuts_shifts_and_assignments():
    seq = Sequence()
    toks = list(range(1500))
    seq.extend(toks[:10])
    assert seq.array().tolist() == toks[:10]
    seq.extend(toks[10:])
    assert seq.array().tolist() == toks  # grows past its first buffer
    seq.truncate(700)
    seq.extend([7] * 5)
    assert seq.array().tolist() == toks[:700] + [7] * 5
    seq.remove(100, 300)  # a context shift
    assert seq.array().tolist() == toks[:100] + toks[300:700] + [7] * 5
    seq.assign([3, 2, 1])
    assert seq.array().tolist() == [3, 2, 1]


def test_limits_and_room():
    cfg = SpecConfig(kind=SPEC_NGRAM, ngram_m=48)
    assert request_limits(SpecConfig(), -1, -1, -1) is None  # the server does not speculate
    assert request_limits(cfg, 0, -1, -1) is None  # the request turned it off
    assert request_limits(cfg, 100, -1, -1) == DraftLimits(48, 0, 0.0)
    assert request_limits(cfg, 5, 2, 0.5) == DraftLimits(5, 2, 0.5)
    lim = DraftLimits(48, 0, 0.0)
    assert draft_room(100, 4096, -1, lim) == 48
    assert draft_room(100, 120, -1, lim) == 18  # leaves n_ctx - 2
    assert draft_room(100, 4096, 10, lim) == 9  # the sampled token is one of the 10
    assert draft_room(100, 4096, 1, lim) == 0


# ---- in the engine -------------------------------------------------------------------


def spec_engine(**kw):
    cfg = SpecConfig(kind=SPEC_NGRAM, ngram_n=kw.pop("ngram_n", 4), ngram_m=kw.pop("m", 16))
    e, b = make_engine(spec=cfg, **kw)
    b.model = cyclic
    return e, b


def plain_engine(**kw):
    e, b = make_engine(**kw)
    b.model = cyclic
    return e, b


def test_drafts_are_accepted_and_the_output_is_the_plain_one():
    prompt = list(range(PERIOD)) * 2 + [0, 1, 2]
    e, b = spec_engine()
    t, c = task(prompt, max_tokens=120)
    steps = run(e, t)
    p, pb = plain_engine()
    t2, c2 = task(prompt, max_tokens=120)
    plain_steps = run(p, t2)
    r, r2 = c.result, c2.result
    assert r.tokens == r2.tokens and len(r.tokens) == 120
    assert r.timings.predicted_n == 120
    # every draft of a cyclic model is right: 16 tokens per step after the first
    assert r.timings.draft_n == r.timings.draft_n_accepted > 0
    assert e.stats.draft_accepted == r.timings.draft_n_accepted
    assert steps < plain_steps // 4
    # the slot holds exactly prompt + generated - the last sampled token
    assert len(e.slots[r.id_slot].tokens) == len(prompt) + 120 - 1


def test_rejected_drafts_are_dropped_from_the_kv_cache():
    # the prompt's n-gram 10 11 12 13 is followed by 40 41 ..., the model continues 14 15 ...
    prompt = [7, 8, 9] + list(range(10, 14)) + list(range(40, 48)) + [99] * 20 + [9]
    e, b = spec_engine(ngram_n=4, m=8)
    t, c = task(prompt, max_tokens=20)
    run(e, t)  # the integrity check runs after every step
    p, _ = plain_engine()
    t2, c2 = task(prompt, max_tokens=20)
    run(p, t2)
    r = c.result
    assert r.tokens == c2.result.tokens
    assert r.timings.draft_n >= 8 and r.timings.draft_n_accepted < r.timings.draft_n
    assert e.stats.accepted_per_pos[0] <= e.stats.draft_steps


def test_several_slots_and_a_sliding_window():
    prompts = [list(range(k, PERIOD)) + list(range(PERIOD)) * 3 for k in (0, 7, 21)]
    e, b = spec_engine(n_swa=32, swa_slack=0)
    p, _ = plain_engine(n_swa=32, swa_slack=0)
    runs = [task(pr, max_tokens=90) for pr in prompts]
    plain = [task(pr, max_tokens=90) for pr in prompts]
    run(e, *[t for t, _ in runs])
    run(p, *[t for t, _ in plain])
    for (_, c), (_, c2) in zip(runs, plain, strict=True):
        assert c.result.tokens == c2.result.tokens
        assert c.result.timings.draft_n_accepted > 45


def test_limits_stop_strings_and_turning_it_off():
    prompt = list(range(PERIOD)) * 2
    e, _ = spec_engine(m=16)
    t, c = task(prompt, max_tokens=21)
    run(e, t)
    assert c.result.timings.predicted_n == 21 == len(c.result.tokens)  # never overshoots
    # a stop string inside an accepted draft ends the text there
    t, c = task(prompt, max_tokens=60, stop=["jkl"])  # pieces: chr(97 + tok % 26)
    run(e, t)
    assert c.result.text.endswith("hi") and "jkl" not in c.result.text
    t, c = task(prompt, max_tokens=30)
    t.gen.spec_n_max = 0
    run(e, t)
    assert c.result.timings.draft_n == 0 and c.result.timings.predicted_n == 30
