"""The step's three phases driven one at a time, as vLLM's scheduler tests do: ``schedule``
with hand-set slots (and nothing changed by it), ``update`` with hand-made outputs, and
``execute``'s retries against the fake backend."""

from __future__ import annotations

import copy

import pytest

from server.engine.engine import Engine, EngineOptions
from server.engine.scheduler import MIN_PROMPT_CHUNK
from server.engine.step_plan import Ended, SlotOutput, SlotWork, StepOutputs, StepPlan
from server.kv.share_cost import StepSpeed
from server.kv.store import shift_span
from server.slot.slot import Slot, SlotState
from server.slot.speculative import SPEC_DRAFT, SpecConfig
from server.task import FinishReason, TaskError, TaskResult, TextChunk
from tests.fake_backend import EOG, FakeBackend, FakeDraft

from .helpers import make_engine, run, task


def _prefilling(e: Engine, i: int, prompt: list[int], held: int = 0):
    """Slot ``i`` runs a task on ``prompt`` and holds its first ``held`` tokens."""
    t, c = task(prompt, max_tokens=8)
    s = e.slots[i]
    e.store.commit(s, prompt[:held])
    e.b.kv[i] = dict(enumerate(prompt[:held]))  # the fake KV holds them too
    run_ = s.start(t, held)
    run_.sampler = e.b.new_sampler(t.sampling, t.prompt)
    return s, c


def _generating(e: Engine, i: int, prompt: list[int], next_token: int):
    s, c = _prefilling(e, i, prompt, held=len(prompt))
    s.state = SlotState.GENERATE
    s.seq.next_token, s.seq.n_sampled = next_token, 1
    s.seq.generated.append(next_token)
    return s, c


def _state(e: Engine, b: FakeBackend):
    slots = [(s.state, list(s.tokens), list(s.checkpoints), s.seq.next_token) for s in e.slots]
    return copy.deepcopy(b.kv), slots, len(b.decodes)


# ---- schedule ------------------------------------------------------------------------


def test_generating_slots_come_first_then_prompts_oldest_first_within_the_budget():
    e, b = make_engine(n_batch=16)
    late, _ = _prefilling(e, 0, list(range(100, 130)))
    early, _ = _prefilling(e, 1, list(range(200, 230)))
    early.run.t_start = late.run.t_start - 1.0
    gen, _ = _generating(e, 2, list(range(10)), next_token=42)
    before = _state(e, b)
    plan = e.scheduler.schedule([late, early, gen])
    assert [w.slot.id for w in plan.work] == [2, 1]  # no room left for the late prompt
    g, p = plan.work
    assert (g.tokens, g.generating, g.logits) == ([42], True, True)
    assert (p.tokens, p.generating, p.logits) == (list(range(200, 215)), False, False)
    assert plan.n_tokens == 16
    assert _state(e, b) == before  # schedule decided; nothing changed


def test_while_slots_generate_prompt_chunks_take_one_ubatch_per_step():
    # a long prompt holds each generated token back one ubatch's time, not n_batch's (#40)
    e, b = make_engine(n_batch=64, n_ubatch=16)
    p, _ = _prefilling(e, 0, list(range(100, 200)))
    alone = e.scheduler.schedule([p])
    assert [len(w.tokens) for w in alone.work] == [64]  # nothing generates: the whole budget
    gen, _ = _generating(e, 1, list(range(10)), next_token=42)
    plan = e.scheduler.schedule([p, gen])
    assert [(w.slot.id, len(w.tokens)) for w in plan.work] == [(1, 1), (0, 16)]


def test_while_slots_generate_prompt_chunks_fit_the_step_time_target():
    # the measured speed cuts the chunk to what fits in --step-target-ms (500 by default),
    # never under MIN_PROMPT_CHUNK; nothing generating: the whole budget whatever the speed
    e, b = make_engine(n_batch=512, n_ubatch=256)
    e.scheduler.speed = StepSpeed(alpha=0, per_step=1 / 16, per_token=1 / 256)
    p, _ = _prefilling(e, 0, list(range(100, 700)))
    assert [len(w.tokens) for w in e.scheduler.schedule([p]).work] == [512]
    gen, _ = _generating(e, 1, list(range(10)), next_token=42)
    plan = e.scheduler.schedule([p, gen])
    # (0.5 s - 1/16 s) * 256 tokens/s = 112 tokens in the step, one of them the generated one
    assert [(w.slot.id, len(w.tokens)) for w in plan.work] == [(1, 1), (0, 111)]
    e.scheduler.speed = StepSpeed(alpha=0, per_step=1 / 16, per_token=1 / 32)
    plan = e.scheduler.schedule([p, gen])
    assert [(w.slot.id, len(w.tokens)) for w in plan.work] == [(1, 1), (0, MIN_PROMPT_CHUNK)]
    e.opts.step_target_ms = 0  # off: one ubatch
    plan = e.scheduler.schedule([p, gen])
    assert [(w.slot.id, len(w.tokens)) for w in plan.work] == [(1, 1), (0, 256)]


def test_a_chunk_that_ends_the_prompt_wants_logits_and_stops_at_a_share_mark():
    e, b = make_engine(n_batch=64)
    s, _ = _prefilling(e, 0, list(range(40)), held=10)
    (w,) = e.scheduler.schedule([s]).work
    assert (w.tokens, w.logits) == (list(range(10, 40)), True)
    s.run.share_marks.add(25)  # a waiter needs the slot to stop at 25
    (w,) = e.scheduler.schedule([s]).work
    assert (w.tokens, w.logits) == (list(range(10, 25)), False)


def test_a_full_slot_plans_its_shift_and_no_draft():
    e, b = make_engine(n_ctx=64, n_seq=1, context_shift=True)
    s, _ = _generating(e, 0, list(range(63)), next_token=5)
    s.run.shift_due = True
    (w,) = e.scheduler.schedule([s]).work
    gen = s.run.task.gen
    assert w.shift == shift_span(63, 64, 63, gen.n_keep, gen.n_discard, False)
    assert w.tokens == [5]


def _draft_engine(n_batch: int, n_seq: int = 2):
    b = FakeBackend(n_batch=n_batch, n_seq=n_seq)
    d = FakeDraft(n_batch=n_batch, n_seq=n_seq)
    opts = EngineOptions(spec=SpecConfig(kind=SPEC_DRAFT, n_max=4))
    return Engine(b, opts, draft=d), b, d


def _speculating(e: Engine, i: int, prompt: list[int], tok: int) -> Slot:
    s, _ = _generating(e, i, prompt, tok)
    e.spec.plan(s.run)
    assert s.run.spec is not None
    return s


def test_a_draft_models_room_is_reserved_and_only_planned_slots_draft():
    e, b, d = _draft_engine(n_batch=5)
    a = _speculating(e, 0, list(range(20)), 7)
    z = _speculating(e, 1, list(range(30, 50)), 8)
    plan = e.scheduler.schedule([a, z])
    # slot a: its token and 4 draft rows fill the budget; slot z is not in this step
    assert [(w.slot.id, w.tokens, w.model_room) for w in plan.work] == [(0, [7], 4)]
    e.executor.execute(plan)
    drafted_for = {seq for rows in d.decodes for seq, _, _ in rows}
    assert drafted_for == {0}  # no draft computed for the slot the budget left out


# ---- the plan shrinking for a retry --------------------------------------------------


def test_shrink_drops_drafts_then_slots_then_cuts_prompt_chunks():
    e, _ = make_engine()
    g = SlotWork(e.slots[0], [1, 2, 3, 4], generating=True, logits=True, model_room=2)
    p = SlotWork(e.slots[1], list(range(10)), generating=False, logits=True)
    q = SlotWork(e.slots[2], list(range(5)), generating=False, logits=False)
    plan = StepPlan(32, [g, p, q])
    plan.shrink(6)
    assert [(w.slot.id, len(w.tokens), w.logits) for w in plan.work] == [
        (0, 1, True),
        (1, 5, False),
    ]
    assert g.model_room == 0 and plan.budget == 6


# ---- update ----------------------------------------------------------------------------


def _update(e: Engine, out: StepOutputs) -> None:
    e.updater.update(out)
    e._flush()  # deliver the events the update queued


def _out(w: SlotWork, *toks: int, **kw) -> StepOutputs:
    return StepOutputs([SlotOutput(w, list(toks), **kw)], n_tokens=len(w.tokens))


def test_update_accounts_a_prompt_chunk_and_starts_generating_at_its_end():
    e, b = make_engine()
    s, c = _prefilling(e, 0, list(range(30)))
    w = SlotWork(s, list(range(20)), generating=False, logits=False)
    e.store.commit(s, w.tokens)
    _update(e, _out(w))
    assert (s.state, s.seq.n_computed, c.events) == (SlotState.PREFILL, 20, [])
    w = SlotWork(s, list(range(20, 30)), generating=False, logits=True)
    e.store.commit(s, w.tokens)
    _update(e, _out(w, 77))
    assert s.state is SlotState.GENERATE and s.run.t_first > 0
    assert (s.seq.n_computed, s.seq.n_sampled, s.seq.next_token) == (30, 1, 77)
    assert [type(ev) for ev in c.events] == [TextChunk]
    assert c.events[0].tokens == [77]


def test_update_finishes_on_end_of_generation_and_counts_it():
    e, b = make_engine()
    s, c = _generating(e, 0, list(range(10)), next_token=3)
    w = SlotWork(s, [3], generating=True, logits=True)
    e.store.commit(s, w.tokens)
    _update(e, _out(w, EOG))
    assert s.idle and c.result.finish is FinishReason.STOP
    assert c.result.timings.predicted_n == 2  # the first token and the end of generation
    assert c.result.tokens == [3]
    assert e.updater.ended == [s]  # its draft (if any) settles before the next admission


def test_update_takes_accepted_drafts_in_order_and_stops_at_the_limit():
    e, b = make_engine()
    s, c = _generating(e, 0, list(range(10)), next_token=3)
    s.run.task.gen.max_tokens = 3
    w = SlotWork(s, [3, 4, 5], generating=True, logits=True)
    e.store.commit(s, w.tokens)
    _update(e, _out(w, 4, 5, 6, n_drafted=2, n_accepted=2))
    r = c.result
    assert r.finish is FinishReason.LENGTH and r.tokens == [3, 4, 5]  # 6: past the limit
    assert (r.timings.draft_n, r.timings.draft_n_accepted) == (2, 2)
    assert (e.stats.draft_tokens, e.stats.draft_accepted) == (2, 2)


def test_a_full_context_is_shifted_next_step_or_ends_the_run():
    for shifts in (True, False):
        e, b = make_engine(n_ctx=16, n_seq=1, context_shift=shifts)
        s, c = _generating(e, 0, list(range(14)), next_token=3)
        w = SlotWork(s, [3], generating=True, logits=True)
        e.store.commit(s, w.tokens)
        _update(e, _out(w, 4))
        assert s.run.truncated
        if shifts:
            assert not s.idle and s.run.shift_due and c.result is None
        else:
            assert s.idle and c.result.finish is FinishReason.LENGTH


def test_update_ends_the_runs_execute_could_not_carry_on():
    e, b = make_engine()
    s, c = _generating(e, 0, list(range(10)), next_token=3)
    _update(e, StepOutputs(ended=[Ended(s, FinishReason.ERROR, "llama_decode failed (-3)")]))
    assert s.idle and isinstance(c.events[-1], TaskError)
    assert c.events[-1].message == "llama_decode failed (-3)"
    assert e.updater.ended == []  # a failed run leaves its draft as it is


# ---- execute -------------------------------------------------------------------------


def test_a_kv_full_decode_retries_a_halved_plan_and_drafts_once():
    e, b, d = _draft_engine(n_batch=64, n_seq=1)
    s = _speculating(e, 0, list(range(20)), 7)
    b.fail_next = [1]  # no KV room, no idle slot to free: halve and retry
    plan = e.scheduler.schedule([s])
    assert plan.work[0].model_room == 4
    n_draft_decodes = len(d.decodes)
    out = e.executor.execute(plan)
    assert plan.budget == 32 and out.n_tokens == 1  # the retry carried no draft
    assert len(d.decodes) - n_draft_decodes <= 5  # one proposal: catch-up plus 4 positions
    assert [o.work.slot for o in out.outputs] == [s] and len(out.outputs[0].tokens) == 1
    assert e.check_integrity() == []


def test_a_failed_decode_ends_the_longest_run_and_keeps_the_others():
    e, b = make_engine()
    short, _ = _generating(e, 0, list(range(10)), next_token=3)
    long, c = _generating(e, 1, list(range(50, 90)), next_token=4)
    b.fail_next = [-3]
    out = e.executor.execute(e.scheduler.schedule([short, long]))
    assert [(x.slot, x.reason) for x in out.ended] == [(long, FinishReason.ERROR)]
    assert [o.work.slot for o in out.outputs] == [short]
    _update(e, out)
    assert c.error.message == "llama_decode failed (-3)" and long.idle and not short.idle
    assert e.check_integrity() == []


# ---- the step's own measure for prefix sharing ------------------------------------------


class _Speed:
    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []

    def observe(self, n_tokens: int, seconds: float) -> None:
        self.seen.append((n_tokens, seconds))


def test_sharing_observes_each_batch_it_decoded_not_what_the_batch_holds_later():
    e, b = make_engine(n_batch=32)
    e.sharing.speed = _Speed()
    t, _ = task(range(80), max_tokens=2)
    e.waiting.append(t)
    sizes = []
    while e._has_work():
        e.step()
        sizes.append(e.stats.last_batch_tokens)
        b.batch.clear()  # another user of the batch (an embedding step, a retry) meanwhile
    # each step observes the batch decoded by the step before it, with its own time
    assert [n for n, _ in e.sharing.speed.seen] == sizes[: len(e.sharing.speed.seen)]
    assert sizes[:3] == [32, 32, 16] and all(sec > 0 for _, sec in e.sharing.speed.seen)


def test_the_engine_still_serves_whole_runs_through_the_phases():
    e, b = make_engine(n_batch=8)
    t1, c1 = task(range(30), max_tokens=5)
    t2, c2 = task(range(100, 120), max_tokens=3)
    run(e, t1, t2)
    assert isinstance(c1.result, TaskResult) and isinstance(c2.result, TaskResult)
    assert (c1.result.timings.prompt_n, c1.result.timings.predicted_n) == (30, 5)
    assert (c2.result.timings.prompt_n, c2.result.timings.predicted_n) == (20, 3)


# ---- admission -------------------------------------------------------------------------


def test_admit_places_in_fifo_order_and_decides_without_touching_anything():
    e, b = make_engine(n_seq=2)
    e.store.commit(e.slots[1], list(range(50)))  # slot 1 holds a prompt the first task shares
    b.kv[1] = dict(enumerate(range(50)))
    first, _ = task(list(range(40)) + [7], max_tokens=1)
    pinned, _ = task([5, 6], max_tokens=1, id_slot=1)  # its slot is taken by the first task
    third, _ = task([8, 9], max_tokens=1)
    fourth, _ = task([10, 11], max_tokens=1)
    e.waiting.extend([first, pinned, third, fourth])
    before = _state(e, b)
    adm = e.scheduler.admit(e.waiting, e.slots)
    assert [(p.task, p.slot.id, p.choice.by) for p in adm.placements] == [
        (first, 1, "similarity"),
        (third, 0, "lru"),
    ]
    # the pinned task waits for its slot; the fourth finds no idle slot and keeps its place
    assert list(adm.deferred) == [pinned, fourth]
    assert _state(e, b) == before and all(s.idle for s in e.slots)
    e.runner.drive(e.placer.place(adm.placements))
    assert e.slots[1].task is first and e.slots[1].run.n_cached == 40
    assert e.slots[0].task is third


def test_live_is_the_slots_run_from_its_first_task_on():
    s = Slot(0, 64)
    with pytest.raises(RuntimeError, match="slot 0 holds no run"):
        _ = s.live
    run_ = s.start(task([1, 2, 3])[0], 0)
    assert s.live is run_
    s.release()
    assert s.idle and s.live is run_  # the last run stays readable
