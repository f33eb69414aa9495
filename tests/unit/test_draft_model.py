"""draft-simple with a fake draft context: drafting, verification and the draft sequence
kept a prefix of its slot's tokens through the RAM cache, checkpoints and cuts (the
integrity check, which covers both contexts, runs after every step)."""

from __future__ import annotations

from server.engine.engine import Engine, EngineOptions
from server.slot.speculative import SPEC_DRAFT, SpecConfig
from server.tiers.prompt_cache import PromptCache
from tests.fake_backend import FakeBackend, FakeDraft
from tests.unit.helpers import run, task
from tests.unit.test_speculative import PERIOD, cyclic


def engines(draft_model=cyclic, n_max: int = 4, cache: bool = False, **kw):
    """A draft-simple engine and a plain one over the same fake model."""
    out = []
    for spec in (True, False):
        b = FakeBackend(**kw)
        b.model = cyclic
        d = None
        if spec:
            d = FakeDraft(**kw)
            d.model = draft_model
        opts = EngineOptions(
            spec=SpecConfig(kind=SPEC_DRAFT, n_max=n_max) if spec else SpecConfig()
        )
        pc = PromptCache(-1, 0) if cache else None
        out.append((Engine(b, opts, cache=pc, draft=d), b, d))
    return out


def test_drafts_of_an_agreeing_model_are_accepted():
    (e, _, d), (p, _, _) = engines()
    prompt = list(range(PERIOD)) * 3
    t, c = task(prompt, max_tokens=60)
    steps = run(e, t)
    t2, c2 = task(prompt, max_tokens=60)
    plain_steps = run(p, t2)
    r = c.result
    assert r.tokens == c2.result.tokens
    assert r.timings.draft_n == r.timings.draft_n_accepted > 0
    assert steps <= plain_steps // 4 + 2
    s = e.slots[r.id_slot]
    assert e.store.dft.held[s.id] == s.tokens  # synced when the run ended
    # the draft decoded the prompt once, then what the target accepted
    assert e.stats.draft_catchup_tokens == len(s.tokens)


def test_drafts_of_a_disagreeing_model_are_all_rejected():
    (e, _, _), (p, _, _) = engines(draft_model=lambda tok, pos: (tok + 7) % PERIOD)
    prompt = list(range(PERIOD)) * 2
    t, c = task(prompt, max_tokens=30)
    run(e, t)
    t2, c2 = task(prompt, max_tokens=30)
    run(p, t2)
    assert c.result.tokens == c2.result.tokens
    assert c.result.timings.draft_n > 0 and c.result.timings.draft_n_accepted == 0


def test_draft_state_round_trips_through_the_ram_cache():
    (e, _, d), _ = engines(cache=True, n_ctx=8192)
    memo = list(range(PERIOD)) * 30  # 1,500 tokens
    t, c = task(memo, max_tokens=10, id_slot=0)
    run(e, t)
    n = len(e.slots[0].tokens)
    t, c = task([900 + i % 50 for i in range(300)], max_tokens=4, id_slot=0)
    run(e, t)  # slot 0's memo went to the RAM cache, with its draft state
    entry = e.cache.entries[0]
    assert len(entry.tokens) == n and len(entry.data_dft) > 0
    before = e.stats.draft_catchup_tokens
    follow = memo + c.result.tokens[:0] + list(range(PERIOD))
    t, c = task(follow, max_tokens=12, id_slot=0)
    run(e, t)
    assert c.result.timings.cache_n >= len(memo)
    # the draft came back with the target: only the new tokens were decoded by it
    caught = e.stats.draft_catchup_tokens - before
    assert caught <= c.result.timings.prompt_n + c.result.timings.predicted_n


def test_checkpoints_carry_the_draft_and_a_cut_behind_its_window_clears_it():
    (e, b, d), _ = engines(n_swa=64, swa_slack=0)
    memo = list(range(PERIOD)) * 6  # 300 tokens, beyond the 64-token window
    t, c = task(memo, max_tokens=80, user_start=len(memo) - 10, id_slot=0)
    run(e, t)
    s = e.slots[0]
    assert s.checkpoints and all(ck.data_dft for ck in s.checkpoints)
    # resuming at the prompt-end checkpoint restores the draft with the target
    ck = s.checkpoints[-1]
    before = e.stats.draft_catchup_tokens
    t, c = task(memo + [7, 7, 7], max_tokens=3, id_slot=0)
    run(e, t)
    assert c.result.timings.cache_n == ck.n_tokens
    assert e.stats.draft_catchup_tokens - before <= 3 + 3 + 1
    # without draft data the same cut empties the draft (it recomputes), never the target
    for ck in s.checkpoints:
        ck.data_dft = b""
    before = e.stats.draft_catchup_tokens
    t, c = task(memo + [8, 8], max_tokens=2, id_slot=0)
    run(e, t)
    n = c.result.timings.cache_n
    assert n > 0  # the target resumed at its checkpoint
    assert e.stats.draft_catchup_tokens - before >= n  # the draft started over
