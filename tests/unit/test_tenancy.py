"""--cache-isolation: cached prefixes (slot KV, RAM-cache entries, prefix sharing) are reused
only within one tenant. Exact hit lengths against the fake backend."""

from __future__ import annotations

from server.kv.policy import SlotView, choose_slot
from server.tiers.prompt_cache import PromptCache
from tests.unit.helpers import ram_find

from .helpers import make_engine, run, task

MEMO = list(range(100, 400))  # 300 tokens: "Memo <tag>: the vault code is <code> ..."


def test_a_slot_holding_another_tenants_tokens_matches_nothing():
    slots = [SlotView(0, True, MEMO, 1.0, "a"), SlotView(1, True, [], 0.0, "")]
    mine = choose_slot(slots, MEMO + [1], -1, 0.1, "a")
    assert (mine.slot, mine.lcp, mine.by) == (0, 300, "similarity")
    theirs = choose_slot(slots, MEMO + [1], -1, 0.1, "b")
    assert theirs.lcp == 0 and theirs.slot == 1  # the empty slot, by LRU
    pinned = choose_slot(slots, MEMO + [1], 0, 0.1, "b")
    assert pinned.lcp == 0 and pinned.save_first  # keep tenant a's KV in the RAM cache first


def _probe(tenant_a: str, tenant_b: str) -> list[int]:
    """A sends the memo; B probes it with each guess of one digit (a fresh B each time, so
    its own probes tell it nothing); returns cached tokens per guess."""
    e, _ = make_engine(n_seq=3)
    run(e, task(MEMO + [7, 7, 7], max_tokens=2, tenant=tenant_a)[0])
    seen = []
    for guess in (7, 8):
        t, c = task(MEMO + [7, guess, 7], max_tokens=2, tenant=tenant_b and tenant_b + str(guess))
        run(e, t)
        seen.append(c.result.timings.cache_n)
    return seen


def test_the_probe_of_the_finding_learns_nothing_across_tenants():
    assert _probe("a", "b") == [0, 0]
    # without isolation every client is one tenant: the right guess caches one token more
    assert _probe("", "") == [len(MEMO) + 2, len(MEMO) + 1]


def test_same_tenant_reuses_as_before():
    e, _ = make_engine(n_seq=2)
    run(e, task(MEMO, max_tokens=2, tenant="a")[0])
    t, c = task(MEMO + [5, 6], max_tokens=2, tenant="a")
    run(e, t)
    assert c.result.timings.cache_n == len(MEMO)


def test_ram_cache_entries_load_only_for_their_tenant():
    e, _ = make_engine(n_seq=1)
    e.cache = PromptCache(-1, 0)
    e.opts.cache_idle_slots = False
    run(e, task(MEMO, max_tokens=2, tenant="a")[0])
    run(e, task([900 + i % 50 for i in range(150)], max_tokens=2, tenant="c")[0])
    assert [x.tenant for x in e.cache.entries] == ["a"]
    t, c = task(MEMO + [5], max_tokens=2, tenant="b")
    run(e, t)
    assert c.result.timings.cache_n == 0 and e.cache.counters.loads == 0
    t, c = task(MEMO + [5], max_tokens=2, tenant="a")
    run(e, t)
    assert c.result.timings.cache_n == len(MEMO) and e.cache.counters.loads == 1


def test_cache_entries_cover_each_other_only_within_a_tenant():
    c = PromptCache(-1, 0)

    def save(tokens, tenant):
        return c.save(tokens, 8, lambda: bytearray(8), tenant=tenant)

    assert save(MEMO, "a").saved
    assert save(MEMO[:100], "b").saved  # a's longer entry does not cover b's prompt
    assert save(MEMO + [1], "b").saved  # nor does b's longer entry evict a's
    assert [(len(x.tokens), x.tenant) for x in c.entries] == [(300, "a"), (301, "b")]
    assert ram_find(c, [], MEMO, "a").index == 0 and ram_find(c, [], MEMO, "b").index == 1
    assert ram_find(c, [], MEMO, "z") is None


def test_prefix_sharing_stays_within_a_tenant():
    e, b = make_engine(n_seq=2, prefix_share=True, prefix_share_min=1)
    run(e, task(MEMO, max_tokens=2, tenant="a", id_slot=0)[0])
    t, c = task(MEMO + [9], max_tokens=2, tenant="b", id_slot=1)
    run(e, t)
    assert c.result.timings.cache_n == 0 and e.stats.prefix_shared_tokens == 0
    t, c = task(MEMO + [9], max_tokens=2, tenant="a", id_slot=1)
    run(e, t)
    assert c.result.timings.cache_n == len(MEMO) and e.stats.prefix_shared_tokens == len(MEMO)
