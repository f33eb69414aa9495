"""--scheduling-policy priority against the fake backend: admission order, ties, aging, the
choice of the run to preempt, and preempted runs that resume from the RAM cache whole."""

from __future__ import annotations

import itertools

from server.engine.priority import MAX_PREEMPTIONS, PriorityRule, RunView, pick_victim, victims
from server.slot.slot import SlotState
from server.task import TaskResult
from server.tiers.prompt_cache import PromptCache

from .helpers import make_engine, run, task

PRIO = PriorityRule("priority", aging_s=10.0)


def prio_task(prompt, priority, t0, max_tokens=4, **kw):
    t, c = task(prompt, max_tokens=max_tokens, **kw)
    t.priority = priority
    t.t_enqueued = t0
    return t, c


# ---- the pure rules ------------------------------------------------------------------


def test_order_is_priority_then_arrival():
    ts = [prio_task([1], p, t0)[0] for p, t0 in [(5, 1.0), (1, 2.0), (3, 3.0), (1, 0.5)]]
    order = PRIO.order(ts, now=3.0)
    assert [(t.priority, t.t_enqueued) for t in order] == [(1, 0.5), (1, 2.0), (3, 3.0), (5, 1.0)]


def test_equal_priorities_keep_arrival_order():
    ts = [prio_task([1], 2, t0)[0] for t0 in (3.0, 1.0, 2.0)]
    assert [t.t_enqueued for t in PRIO.order(ts, now=3.0)] == [1.0, 2.0, 3.0]


def test_aging_improves_one_level_per_step_waited():
    old, _ = prio_task([1], 5, t0=0.0)
    new, _ = prio_task([1], 2, t0=39.0)
    assert PRIO.effective(old, now=9.9) == 5
    assert PRIO.effective(old, now=10.0) == 4
    assert PRIO.effective(old, now=40.0) == 1  # 4 steps waited: outranks the newer 2
    assert list(PRIO.order([new, old], now=40.0)) == [old, new]
    # a preempted task keeps its age: its arrival, not its preemption, is where it counts from
    old.t_waiting = 35.0
    assert PRIO.effective(old, now=40.0) == 1
    assert PriorityRule("priority", aging_s=0).effective(old, now=1e9) == 5


def test_victim_is_the_lowest_priority_latest_arrival():
    runs = [
        RunView(0, 5, 1.0, True),
        RunView(1, 7, 2.0, True),
        RunView(2, 7, 3.0, True),
        RunView(3, 9, 4.0, False),  # not movable: never chosen
    ]
    assert pick_victim(0, runs, set()) == 2
    assert pick_victim(0, runs, {2}) == 1
    assert pick_victim(0, runs, {1, 2}) == 0
    assert pick_victim(7, runs, set()) is None  # only strictly worse ranks give way
    assert pick_victim(6, runs, set()) == 2


def test_victims_leave_idle_slots_and_pinned_tasks_alone():
    runs = [RunView(0, 5, 1.0, True), RunView(1, 5, 2.0, True)]
    a, _ = prio_task([1], 0, 10.0)
    b, _ = prio_task([1], 0, 11.0)
    pinned, _ = prio_task([1], 0, 9.0, id_slot=0)
    low, _ = prio_task([1], 6, 12.0)
    got = victims(PRIO, [pinned, a, b, low], n_idle=1, runs=runs, now=12.0)
    assert [(t, s) for t, s in got] == [(b, 1)]  # a takes the idle slot, b the latest run


# ---- the engine ----------------------------------------------------------------------


def prio_engine(n_seq=2, **kw):
    e, b = make_engine(n_seq=n_seq, **kw)
    e.opts.priority = PRIO
    e.cache = PromptCache(-1, 0)
    e.opts.cache_idle_slots = False
    return e, b


def reference(prompt, max_tokens):
    """The same request alone on a fresh engine (the fake backend is batch-invariant)."""
    e, _ = make_engine(n_seq=1)
    t, c = task(prompt, max_tokens=max_tokens)
    run(e, t)
    return c


def test_admission_follows_priority_then_arrival():
    e, b = make_engine(n_seq=1)
    e.opts.priority = PRIO
    done: list[int] = []
    tasks = []
    for i, p in enumerate([5, 1, 3, 1]):
        t, c = prio_task([10 + i] * 8, p, t0=float(i), max_tokens=2)
        emit = c

        def record(ev, i=i, emit=emit):
            emit(ev)
            if isinstance(ev, TaskResult):
                done.append(i)

        t.emit = record
        tasks.append(t)
    run(e, *tasks)
    assert done == [1, 3, 2, 0]


def long_prompt(base):
    return [base + i % 40 for i in range(60)]


def test_a_better_priority_preempts_the_latest_worst_run_which_resumes_whole():
    e, b = prio_engine(n_seq=2)
    lows = [prio_task(long_prompt(100 * (i + 1)), 5, t0=float(i), max_tokens=30) for i in range(2)]
    for t, _ in lows:
        e.waiting.append(t)
    for _ in range(6):
        e.step()
    assert all(s.state is SlotState.GENERATE for s in e.slots)
    victim_slot = next(s for s in e.slots if s.task is lows[1][0])
    held = list(victim_slot.tokens)
    sent = len(lows[1][1].text)
    hi, hc = prio_task(long_prompt(900), 0, t0=10.0, max_tokens=3)
    e.waiting.append(hi)
    e.step()
    # the high-priority task took the latest low run's slot within the step
    assert victim_slot.task is hi and lows[1][0].id in e.preemption.held
    assert e.stats.preemptions == 1 and e.stats.by_priority["5"].preemptions == 1
    assert any(x.tokens == held for x in e.cache.entries)
    run(e)
    ref = reference(lows[1][0].prompt, 30)
    r = lows[1][1].result
    assert r is not None and r.tokens == ref.result.tokens
    assert lows[1][1].text == ref.text and len(lows[1][1].text) > sent
    t = r.timings
    assert (t.preempted, t.resumed_n) == (1, len(held))
    assert (t.cache_n, t.prompt_n, t.predicted_n) == (60, 0, 30)  # resumed: nothing recomputed
    assert lows[0][1].result.timings.preempted == 0 and hc.result.timings.preempted == 0
    assert e.preemption.held == {} and all(s.idle for s in e.slots)
    assert e.check_integrity() == []


def test_a_run_whose_cache_entry_was_lost_recomputes_it_and_finishes_whole():
    e, b = prio_engine(n_seq=1)
    low, lc = prio_task(long_prompt(100), 5, t0=0.0, max_tokens=20)
    e.waiting.append(low)
    for _ in range(5):
        e.step()
    hi, hc = prio_task(long_prompt(700), 0, t0=1.0, max_tokens=2)
    e.waiting.append(hi)
    e.step()
    assert low.id in e.preemption.held
    e.cache.limit_bytes = 0  # the saved state is lost
    e.cache.update()
    e.cache.limit_bytes = -1
    run(e)
    ref = reference(low.prompt, 20)
    assert lc.result.tokens == ref.result.tokens and lc.text == ref.text
    t = lc.result.timings
    assert (t.preempted, t.resumed_n, t.cache_n, t.prompt_n, t.predicted_n) == (1, 0, 0, 60, 20)
    assert e.check_integrity() == [] and e.preemption.held == {}


def test_fcfs_never_preempts():
    e, b = prio_engine(n_seq=1)
    e.opts.priority = PriorityRule("fcfs")
    low, lc = prio_task(long_prompt(100), 5, t0=0.0, max_tokens=10)
    e.waiting.append(low)
    for _ in range(3):
        e.step()
    hi, hc = prio_task(long_prompt(700), 0, t0=1.0, max_tokens=2)
    e.waiting.append(hi)
    e.step()
    assert e.slots[0].task is low and e.stats.preemptions == 0
    run(e)
    assert lc.result.timings.preempted == 0


def test_no_preemption_without_a_ram_cache():
    e, b = prio_engine(n_seq=1)
    e.cache = None
    low, _ = prio_task(long_prompt(100), 5, t0=0.0, max_tokens=10)
    e.waiting.append(low)
    for _ in range(3):
        e.step()
    hi, _ = prio_task(long_prompt(700), 0, t0=1.0, max_tokens=2)
    e.waiting.append(hi)
    e.step()
    assert e.slots[0].task is low and e.stats.preemptions == 0
    run(e)


def test_a_cancelled_preempted_task_frees_its_run():
    e, b = prio_engine(n_seq=1)
    low, lc = prio_task(long_prompt(100), 5, t0=0.0, max_tokens=20)
    e.waiting.append(low)
    for _ in range(4):
        e.step()
    sampler = e.slots[0].live.sampler
    hi, _ = prio_task(long_prompt(700), 0, t0=1.0, max_tokens=8)
    e.waiting.append(hi)
    e.step()
    assert low.id in e.preemption.held
    low.cancel()
    run(e)
    assert e.preemption.held == {} and sampler.freed and lc.result is None
    assert e.check_integrity() == [] and all(s.idle for s in e.slots)


def test_metrics_count_requests_and_waits_per_priority():
    e, b = prio_engine(n_seq=1)
    for p in (0, 3, 3):
        run(e, prio_task([7] * 5, p, t0=0.0, max_tokens=1)[0])
    assert e.stats.by_priority["3"].requests == 2 and e.stats.by_priority["0"].requests == 1
    assert e.stats.by_priority["3"].queue_seconds > 0


def test_a_run_ages_while_it_runs_and_is_preempted_a_bounded_number_of_times():
    """A run is weighed by its effective priority now (aged from its arrival), and once it
    was preempted MAX_PREEMPTIONS times it is no victim any more."""
    e, b = prio_engine(n_seq=1)
    low, _ = prio_task(long_prompt(100), 5, t0=0.0, max_tokens=10)
    e.waiting.append(low)
    e.step()
    run_ = e.slots[0].live
    views = e.preemption.views(PRIO, e.slots, True, False, now=30.0)
    assert [(v.rank, v.movable) for v in views] == [(2, True)]  # 5, aged 3 levels in 30 s
    run_.preempted = MAX_PREEMPTIONS
    views = e.preemption.views(PRIO, e.slots, True, False, now=30.0)
    assert [(v.rank, v.movable) for v in views] == [(2, False)]


def test_a_long_low_priority_run_finishes_behind_a_stream_of_short_better_ones():
    """Issue 56: two clients keep sending 6-token requests of priorities -8..4 while a long
    request of priority 10 waits or runs on one of two slots (a fake clock: 1 s a step,
    aging 10 s). Preempted, it keeps its age and its answer so far, and it loses its slot
    at most MAX_PREEMPTIONS times, so it finishes within a bound: it outranks every
    newcomer (10 - -8 + 1) * 10 s after it arrived, then it waits for one short request
    to end and needs its own prompt step and 40 tokens (plus a restore step a preemption)."""
    e, b = prio_engine(n_seq=2)
    clock = [0.0]
    e.clock = lambda: clock[0]
    long, lc = prio_task(long_prompt(100), 10, t0=0.0, max_tokens=40)
    e.waiting.append(long)
    prios = itertools.cycle(range(-8, 5))
    clients: list = [None, None]
    ended: list[int | None] = [None, None]  # the step each client's last request ended
    n_short = 0
    bound = (10 - -8 + 1) * 10 + (6 + 1) + (1 + 40) + MAX_PREEMPTIONS
    steps = 0
    while not lc.done and steps < 4 * bound:
        for i, c in enumerate(clients):
            if c is not None and c.done and ended[i] is None:
                ended[i] = steps
            # each client sends its next request one step after its last one ended (the
            # round trip), so a slot is free for a moment: the long run takes it, and the
            # next short request preempts it
            if c is None or (ended[i] is not None and ended[i] < steps):
                t, clients[i] = prio_task([300 + n_short % 50] * 6, next(prios), clock[0], 6)
                e.waiting.append(t)
                ended[i] = None
                n_short += 1
        e.step()
        assert e.check_integrity() == []
        clock[0] += 1.0
        steps += 1
    assert lc.result is not None, f"not finished in {steps} steps ({n_short} short requests)"
    assert steps <= bound
    assert 1 <= lc.result.timings.preempted <= MAX_PREEMPTIONS
    ref = reference(long.prompt, 40)
    assert lc.result.tokens == ref.result.tokens and lc.text == ref.text
