"""--context-shift with the fake backend: llama-server's n_keep / n_discard rule, generation
past the slot's context with the KV cache and the token list shifted together (the integrity
check runs after every step, over the draft context too), and the old behaviour without it."""

from __future__ import annotations

import pytest

from server.engine.engine import Engine, EngineOptions
from server.kv.store import shift_span
from server.slot.speculative import SPEC_DRAFT, SpecConfig
from server.task import FinishReason
from tests.fake_backend import FakeBackend, FakeDraft, next_token
from tests.unit.helpers import make_engine, run, task


@pytest.mark.parametrize(
    "args, want",
    [
        # llama-server's test_ctx_shift numbers: 256-token slot, BOS, n_keep 0
        ((255, 256, 226, 0, 0, True), (1, 127)),
        ((255, 256, 226, 0, 0, False), (0, 127)),
        ((255, 256, 226, -1, 0, True), (227, 14)),  # n_keep -1: the prompt (and BOS)
        ((255, 256, 226, 10, 5, False), (10, 5)),  # n_discard given
        ((255, 256, 226, 10, 500, False), (10, 244)),  # at least one token stays
        ((255, 256, 226, 1000, 0, False), (252, 1)),  # at most n_ctx - 4 kept
        ((255, 256, 226, 254, 0, False), (252, 1)),
    ],
)
def test_shift_span_is_llama_servers_rule(args, want):
    assert shift_span(*args) == want


def expected(prompt: list[int], n_ctx: int, n_max: int, n_keep: int = 0) -> tuple[list, list]:
    """What a shifting slot generates with the fake model, computed without the engine:
    the generated tokens and the tokens the slot holds at the end."""
    ctx, out = list(prompt), []
    tok = next_token(ctx[-1], len(ctx) - 1)
    while True:
        out.append(tok)
        if len(out) == n_max:
            return out, ctx
        if len(ctx) + 1 >= n_ctx:
            keep, drop = shift_span(len(ctx), n_ctx, len(prompt), n_keep, 0, False)
            del ctx[keep : keep + drop]
        ctx.append(tok)
        tok = next_token(tok, len(ctx) - 1)


def test_generation_goes_past_the_context_with_shifts():
    e, b = make_engine(n_ctx=64, n_seq=1, context_shift=True)
    prompt = list(range(1, 21))
    t, c = task(prompt, max_tokens=150)
    run(e, t)  # integrity checked after every step
    r = c.result
    assert r.finish is FinishReason.LENGTH and r.truncated
    assert r.timings.predicted_n == 150 and len(r.tokens) == 150
    assert r.timings.prompt_n == len(prompt)
    want, held = expected(prompt, 64, 150)
    assert r.tokens == want
    s = e.slots[0]
    assert s.tokens == held and len(s.tokens) < 64
    assert b.kv[0] == dict(enumerate(held))  # the KV holds them at 0..n-1
    assert e.stats.context_shifts >= 3


def test_n_keep_minus_one_keeps_the_prompt():
    e, _ = make_engine(n_ctx=64, n_seq=1, context_shift=True)
    prompt = list(range(1, 21))
    t, c = task(prompt, max_tokens=100)
    t.gen.n_keep = -1
    run(e, t)
    want, held = expected(prompt, 64, 100, n_keep=-1)
    assert c.result.tokens == want
    assert e.slots[0].tokens[: len(prompt)] == prompt == held[: len(prompt)]


def test_without_context_shift_the_run_ends_at_the_limit():
    for kw in ({}, {"context_shift": True}):
        e, b = make_engine(n_ctx=64, n_seq=1, **kw)
        if kw:
            b.can_shift = False  # a memory that cannot shift: llama-server turns it off
        assert not e.shifts
        t, c = task(list(range(1, 21)), max_tokens=150)
        run(e, t)
        r = c.result
        assert r.finish is FinishReason.LENGTH and r.truncated
        assert r.timings.predicted_n == 64 - 1 - 20 + 1  # sampled until n + 1 reaches 64
        assert e.stats.context_shifts == 0


def test_a_run_that_ends_before_the_limit_is_not_truncated():
    e, _ = make_engine(n_ctx=64, n_seq=1, context_shift=True)
    t, c = task(list(range(1, 21)), max_tokens=10)
    run(e, t)
    assert not c.result.truncated and e.stats.context_shifts == 0


def test_the_next_request_reuses_the_shifted_tokens():
    e, _ = make_engine(n_ctx=64, n_seq=1, context_shift=True)
    t, c = task(list(range(1, 21)), max_tokens=100)
    run(e, t)
    held = list(e.slots[0].tokens)
    t2, c2 = task(held + [5, 6], max_tokens=3)
    run(e, t2)
    assert c2.result.timings.cache_n == len(held)


def test_several_slots_shift_independently():
    e, b = make_engine(n_ctx=256, n_seq=4, kv_unified=False, context_shift=True)
    tasks = [task([i + 1] * (10 + 3 * i), max_tokens=120) for i in range(4)]
    run(e, *(t for t, _ in tasks))
    for i, (_, c) in enumerate(tasks):
        want, held = expected([i + 1] * (10 + 3 * i), 64, 120)
        assert c.result.tokens == want
        assert e.slots[c.result.id_slot].tokens == held


def test_the_draft_context_follows_a_shift():
    outs = []
    for spec in (True, False):
        b = FakeBackend(n_ctx=64, n_seq=1)
        d = FakeDraft(n_ctx=64, n_seq=1) if spec else None
        kind = SpecConfig(kind=SPEC_DRAFT, n_max=4) if spec else SpecConfig()
        e = Engine(b, EngineOptions(context_shift=True, spec=kind), draft=d)
        t, c = task(list(range(1, 21)), max_tokens=150)
        run(e, t)  # integrity of both contexts after every step
        outs.append(c.result.tokens)
        assert e.stats.context_shifts >= 3
        if spec:
            s = e.slots[0]
            n_dft = len(e.store.dft.held[0])
            assert n_dft <= len(s.tokens)
            assert d.kv[0] == {p: s.tokens[p] for p in range(n_dft)}
            assert c.result.timings.draft_n > 0
            # the draft shifted with the target: it decoded each token once, no catch-up
            assert e.stats.draft_catchup_tokens <= 20 + 150
    assert outs[0] == outs[1] == expected(list(range(1, 21)), 64, 150)[0]


def test_a_draft_that_cannot_shift_is_cut_to_n_keep():
    b = FakeBackend(n_ctx=64, n_seq=1)
    d = FakeDraft(n_ctx=64, n_seq=1)
    d.can_shift = False
    e = Engine(
        b, EngineOptions(context_shift=True, spec=SpecConfig(kind=SPEC_DRAFT, n_max=4)), draft=d
    )
    t, c = task(list(range(1, 21)), max_tokens=150)
    run(e, t)
    assert c.result.tokens == expected(list(range(1, 21)), 64, 150)[0]
    # cut at each shift: the draft decodes the moved tokens again when it next drafts
    assert e.stats.draft_catchup_tokens > 20 + 150


def _shared_then_shifted(n_other: int = 0):
    """Slot 0 holds a 40-token prompt (and ``n_other`` tokens it generated); slot 1 copies
    what it shares with it (prefix sharing: the cells are shared, unified KV) and generates
    past its 64-token context, so it shifts with shared cells beyond the shift's cut.
    Returns the engine, the backend, slot 0's tokens and slot 1's result."""
    b = FakeBackend(n_ctx=256, n_seq=2)
    b.n_ctx_slot = 64  # the slot's context, with room in the KV for both slots' cells
    e = Engine(b, EngineOptions(context_shift=True))
    prompt = list(range(1, 41))
    run(e, task(prompt, max_tokens=n_other, id_slot=0)[0])
    other = list(e.slots[0].tokens)
    t, c = task(prompt, max_tokens=40, id_slot=1)
    run(e, t)  # the integrity of every slot is checked after every step
    assert c.result.timings.cache_n == 39 and e.stats.prefix_shared_tokens == 39
    assert e.stats.context_shifts == 1
    return e, b, other, c.result


def _calls(b: FakeBackend) -> list[tuple[str, tuple]]:
    """The memory calls up to the shift's seq_add (state_set: its sequence only)."""
    calls = [(name, args[:1] if name == "state_set" else args) for name, args in b.memory_args]
    return calls[: next(i for i, (name, _) in enumerate(calls) if name == "seq_add") + 1]


def test_a_shift_leaves_the_cells_another_slot_shares_in_place():
    e, b, other, r = _shared_then_shifted()
    assert len(other) == 40 and b.kv[0] == dict(enumerate(other))  # slot 0 did not move
    assert len(r.tokens) == 40
    # slot 0's next token is what its unshifted prompt predicts
    t, c = task(other, max_tokens=1, id_slot=0)
    run(e, t)
    assert c.result.tokens == [next_token(other[-1], len(other) - 1)]
    assert c.result.timings.cache_n == len(other) - 1


def test_a_shift_drops_the_shared_cells_past_its_cut_and_moves_only_its_own():
    # slot 1 holds 63 tokens, the first 40 shared: llama-server's rule would drop 31 after
    # n_keep 0 and move the 9 shared ones with its own; it drops all 40 instead
    e, b, other, _ = _shared_then_shifted()
    assert _calls(b)[-2:] == [("seq_rm", (1, 0, 40)), ("seq_add", (1, 40, 63, -40))]
    assert "state_set" not in [name for name, _ in b.memory_args]
    assert b.kv[0] == dict(enumerate(other))


def test_a_slot_sharing_all_it_holds_shifts_a_private_copy():
    # slot 0 generated what slot 1 generates (the same greedy tokens): slot 1 shares all 63
    e, b, other, _ = _shared_then_shifted(n_other=24)
    assert len(other) == 63 and b.kv[0] == dict(enumerate(other))
    assert _calls(b)[-4:] == [
        ("seq_clear", (1,)),  # slot 1 takes a private copy of its cells ...
        ("state_set", (1,)),
        ("seq_rm", (1, 0, 31)),  # ... then shifts it as llama-server does
        ("seq_add", (1, 31, 63, -31)),
    ]


def test_a_shift_over_cells_no_other_slot_shares_is_llama_servers():
    b = FakeBackend(n_ctx=256, n_seq=2)
    b.n_ctx_slot = 64
    e = Engine(b, EngineOptions(context_shift=True))
    run(e, task(list(range(1, 41)), max_tokens=0, id_slot=0)[0])
    prompt = list(range(100, 141))
    t, c = task(prompt, max_tokens=40, id_slot=1)
    run(e, t)
    assert e.stats.context_shifts == 1 and c.result.tokens == expected(prompt, 64, 40)[0]
    assert "state_set" not in [name for name, _ in b.memory_args]
