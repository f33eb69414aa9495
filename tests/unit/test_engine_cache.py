"""The RAM cache wired into slot selection, against the fake backend."""

from server.tiers.prompt_cache import PromptCache

from .helpers import make_engine, run, task


def cached_engine(**kw):
    e, b = make_engine(**kw)
    e.cache = PromptCache(-1, 0)
    return e, b


def test_conversation_comes_back_from_ram_after_losing_its_slot():
    e, b = cached_engine(n_seq=1)
    e.opts.cache_idle_slots = False
    conv = list(range(1, 200))
    t, c = task(conv, max_tokens=3)
    run(e, t)
    first = list(e.slots[0].tokens)
    run(e, task([900 + i % 50 for i in range(150)], max_tokens=3)[0])  # takes the only slot
    assert len(e.cache.entries) == 1 and e.cache.entries[0].tokens == first
    follow = first + [5, 6, 7]
    t2, c2 = task(follow, max_tokens=3)
    run(e, t2)
    assert (c2.result.timings.cache_n, c2.result.timings.prompt_n) == (len(first), 3)
    assert e.cache.counters.loads == 1
    # the loaded entry left the cache; the displaced conversation went in
    assert [len(x.tokens) for x in e.cache.entries] == [152]
    assert e.cache.check_integrity() == []


def test_without_cache_the_follow_up_is_recomputed():
    e, b = make_engine(n_seq=1)
    conv = list(range(1, 200))
    run(e, task(conv, max_tokens=3)[0])
    first = list(e.slots[0].tokens)
    run(e, task([900 + i % 50 for i in range(150)], max_tokens=3)[0])
    t2, c2 = task(first + [5], max_tokens=3)
    run(e, t2)
    assert c2.result.timings.cache_n == 0


def test_idle_slots_are_saved_and_cleared_on_launch_in_unified_mode():
    e, b = cached_engine(n_seq=2)
    run(e, task(range(1, 60), max_tokens=2)[0])
    busy_slot = next(s for s in e.slots if s.tokens)
    held = list(busy_slot.tokens)
    t, c = task([800] * 30, max_tokens=2)
    e.waiting.append(t)
    e.step()
    assert busy_slot.tokens == [] and b.kv[busy_slot.id] == {}
    assert [x.tokens for x in e.cache.entries] == [held]
    run(e)
    # the same prompt again is served from RAM
    t3, c3 = task(held + [1], max_tokens=1)
    run(e, t3)
    assert c3.result.timings.cache_n == len(held)


def test_failed_restore_keeps_entry_and_slot_starts_cold():
    e, b = cached_engine(n_seq=1)
    e.opts.cache_idle_slots = False
    run(e, task(range(1, 100), max_tokens=2)[0])
    held = list(e.slots[0].tokens)
    run(e, task([700] * 80, max_tokens=2)[0])
    orig = b.state_set
    b.state_set = lambda *a, **k: 0
    t, c = task(held + [3], max_tokens=2)
    run(e, t)
    b.state_set = orig
    assert c.result.timings.cache_n == 0
    assert any(x.tokens == held for x in e.cache.entries)
    assert e.cache.counters.load_failures == 1
