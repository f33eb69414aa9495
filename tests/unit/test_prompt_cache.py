"""One test per rule of ARCHITECTURE §7, with exact entries and eviction order."""

from server.tiers.prompt_cache import PromptCache
from server.types import Checkpoint
from tests.unit.helpers import ram_find


def save(c: PromptCache, tokens, size=100, ckpts=()):
    return c.save(tokens, size, lambda: bytearray(size), list(ckpts))


def toks(c: PromptCache):
    return [e.tokens for e in c.entries]


def test_empty_prompt_is_not_saved():
    c = PromptCache(1000, 0)
    assert save(c, []).reason == "empty" and c.entries == []


def test_prefix_of_existing_entry_is_skipped():
    c = PromptCache(1000, 0)
    save(c, [1, 2, 3, 4])
    out = save(c, [1, 2])
    assert (out.saved, out.reason) == (False, "covered")
    assert save(c, [1, 2, 3, 4]).reason == "covered"
    assert toks(c) == [[1, 2, 3, 4]]


def test_entry_larger_than_limit_is_skipped_without_evicting():
    c = PromptCache(250, 0)
    save(c, [1])
    save(c, [2])
    out = save(c, [3], size=260)
    assert out.reason == "too-large" and toks(c) == [[1], [2]] and c.counters.evictions == 0


def test_checkpoints_count_toward_size():
    c = PromptCache(250, 0)
    ck = Checkpoint(1, 0, 0, bytearray(200))
    assert save(c, [3, 4], size=100, ckpts=[ck]).reason == "too-large"
    save(c, [5, 6], size=40, ckpts=[ck])
    assert c.nbytes == 240


def test_entries_covered_by_the_new_one_are_removed():
    c = PromptCache(1000, 0)
    save(c, [1, 2])
    save(c, [9])
    save(c, [1, 2, 3])
    assert toks(c) == [[9], [1, 2, 3]]


def test_oldest_entries_are_evicted_to_make_room():
    c = PromptCache(300, 0)
    for t in ([1], [2], [3]):
        save(c, t)
    out = save(c, [4], size=150)
    assert out.saved and out.evicted == 2
    assert toks(c) == [[3], [4]]
    assert c.check_integrity() == []


def test_memory_error_shrinks_limit_to_40_percent_and_gives_up():
    c = PromptCache(1000, 0)
    for t in ([1], [2], [3], [4]):
        save(c, t)

    def boom():
        raise MemoryError

    out = c.save([5], 100, boom)
    assert (out.saved, out.reason) == (False, "no-memory")
    assert c.limit_bytes == 160  # 40 % of the 400 bytes held
    assert toks(c) == [[4]]  # evicted oldest-first down to the new limit


def test_load_takes_entry_improving_both_keep_and_sim():
    c = PromptCache(-1, 0)
    save(c, [1, 2, 3, 4, 5, 6, 7, 8])  # lcp 6 with the prompt: keep .75, sim .6
    save(c, [1, 2, 9])  # lcp 2: keep .67, sim .2
    prompt = [1, 2, 3, 4, 5, 6, 0, 0, 0, 0]
    ch = ram_find(c, [], prompt)
    assert (ch.index, ch.n_lcp) == (0, 6)
    # a slot holding a better prefix already: nothing improves on it
    assert ram_find(c, [1, 2, 3, 4, 5, 6, 0], prompt) is None


def test_load_never_takes_an_entry_with_f_keep_below_quarter():
    c = PromptCache(-1, 0)
    save(c, [1] + list(range(100, 110)))  # lcp 1 of 11: f_keep 0.09
    assert ram_find(c, [], [1, 2, 3]) is None


def test_take_removes_entry_and_failed_restore_keeps_it():
    c = PromptCache(-1, 0)
    save(c, [1, 2, 3])
    ch = ram_find(c, [], [1, 2, 3, 4])
    assert c.take(ch, lambda e: False) is None
    assert toks(c) == [[1, 2, 3]] and c.counters.load_failures == 1
    e = c.take(ch, lambda e: True)
    assert e.tokens == [1, 2, 3] and c.entries == []
    assert (c.counters.loads, c.counters.bytes_restored, c.counters.tokens_restored) == (1, 100, 3)


def test_update_evicts_by_bytes_then_by_tokens():
    c = PromptCache(-1, 4)
    save(c, [1, 1], size=10)
    save(c, [2, 2], size=10)
    save(c, [3, 3], size=10)
    c.limit_bytes = 25
    c.update()  # bytes: 30 > 25 -> drop [1,1]; tokens: limit max(4, 25 / 5) = 5 >= 4 held
    assert toks(c) == [[2, 2], [3, 3]]
    c.limit_bytes = -1
    c.limit_tokens = 3
    c.update()
    assert toks(c) == [[3, 3]]


def test_token_limit_is_raised_to_what_bytes_hold():
    c = PromptCache(1000, 4)
    save(c, [1, 2, 3, 4], size=40)  # 10 bytes / token -> 1000 bytes hold 100 tokens
    assert c.token_limit() == 100
    save(c, [5, 6, 7, 8], size=40)
    c.update()
    assert len(c.entries) == 2


def test_integrity_detects_prefix_entries():
    c = PromptCache(-1, 0)
    save(c, [1, 2, 3])
    c.entries.append(c.entries[0].__class__([1, 2], bytearray(5)))
    assert any("prefix" in p for p in c.check_integrity())


def test_integrity_recounts_bytes_and_tokens_from_the_entries():
    c = PromptCache(-1, 0)
    save(c, [1, 2, 3], size=30)
    save(c, [7, 8], size=20)
    assert c.check_integrity() == [] and (c.nbytes, c.n_tokens) == (50, 5)
    c.entries[0].data = bytearray(10)  # changed behind the cache's back
    c.entries[1].tokens.append(9)
    problems = c.check_integrity()
    assert "bytes 50 != sum of entries 30" in problems
    assert "tokens 5 != sum of entries 6" in problems
