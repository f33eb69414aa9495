"""Context checkpoints on a sliding-window model, against the fake backend."""

from server.kv.checkpoints import CheckpointPolicy, file_checkpoints, restored_serves
from server.types import Checkpoint

from .helpers import make_engine, run, task


def swa_engine(**kw):
    kw.setdefault("n_swa", 100)
    kw.setdefault("n_ubatch", 128)
    kw.setdefault("n_batch", 512)
    return make_engine(**kw)


def test_boundaries_and_chunk_ends():
    p = CheckpointPolicy(enabled=True, n_ubatch=128)
    assert p.boundaries(1000, 600) == [600, 868, 996]
    assert p.chunk_end(0, 1000, 600) == 600
    assert p.chunk_end(600, 1000, 600) == 868
    assert p.chunk_end(996, 1000, 600) == 1000
    # resumed with little left to compute: no extra decodes near the end
    assert p.boundaries(1000, 600, n_start=940) == []
    assert p.chunk_end(940, 1000, 600, n_start=940) == 1000
    assert p.boundaries(1000, 990, n_start=940) == [990]
    assert p.boundaries(1000, 600, n_start=900) == [996]


def test_checkpoints_land_at_user_start_and_near_the_end():
    e, b = swa_engine()
    prompt = list(range(1, 1001))
    t, c = task(prompt, max_tokens=2, user_start=600)
    run(e, t)
    s = e.slots[c.result.id_slot]
    # the last one is taken at the end of the prompt, before the first generated token
    assert [x.n_tokens for x in s.checkpoints] == [600, 868, 996, 1000]
    assert all(x.pos_max == x.n_tokens - 1 for x in s.checkpoints)
    assert e.stats.checkpoints_created == 4


def test_mid_prompt_checkpoints_respect_min_step():
    e, b = swa_engine(checkpoint_min_step=300, n_batch=128)
    t, c = task(list(range(1, 1001)), max_tokens=1)
    run(e, t)
    got = [x.n_tokens for x in e.slots[c.result.id_slot].checkpoints]
    # chunk starts every 128 tokens; one at least 300 after the previous, plus the two near the end
    assert got == [384, 768, 868, 996]


def test_per_slot_limit_drops_oldest():
    e, b = swa_engine(ctx_checkpoints=2)
    t, c = task(list(range(1, 1001)), max_tokens=1, user_start=600)
    run(e, t)
    assert [x.n_tokens for x in e.slots[c.result.id_slot].checkpoints] == [868, 996]


def test_insert_replaces_same_position():
    p = CheckpointPolicy(enabled=True, max_per_slot=4)
    have = [Checkpoint(10, 0, 9, bytearray(b"a"))]
    p.insert(have, Checkpoint(10, 0, 9, bytearray(b"b")))
    assert [(x.n_tokens, bytes(x.data)) for x in have] == [(10, b"b")]


def test_replaced_last_message_restores_the_checkpoint():
    e, b = swa_engine()
    head = list(range(1, 601))
    t1, c1 = task(head + [7] * 400, max_tokens=2, user_start=600)
    run(e, t1)
    t2, c2 = task(head + [8] * 300, max_tokens=2, user_start=600)
    run(e, t2)
    assert (c2.result.timings.cache_n, c2.result.timings.prompt_n) == (600, 300)
    assert e.stats.checkpoints_restored == 1
    # checkpoints past the cut were dropped, new ones taken for the new tail
    assert [x.n_tokens for x in e.slots[c2.result.id_slot].checkpoints] == [600, 768, 896, 900]


def test_without_checkpoints_a_cut_behind_the_window_is_recomputed():
    e, b = swa_engine(ctx_checkpoints=0)
    head = list(range(1, 601))
    run(e, task(head + [7] * 400, max_tokens=2, user_start=600)[0])
    t2, c2 = task(head + [8] * 300, max_tokens=2, user_start=600)
    run(e, t2)
    assert (c2.result.timings.cache_n, c2.result.timings.prompt_n) == (0, 900)


def test_a_prompt_that_branched_off_a_reused_prefix_checkpoints_the_branch():
    """A shared head, then three short tails on one slot (a system prompt and questions,
    workload 3's shape). The first prompt's checkpoints near its end lie past the branch
    point (600): the second, reusing 600 through the window, takes one there before its own
    tail, so the third, after the window slid far past 600, resumes there instead of
    recomputing from the one n_ubatch before the first prompt's end (481)."""
    e, b = swa_engine()
    head = list(range(1, 601))
    timings, kept = [], []
    for tail, n_out in (([7] * 13, 1), ([8] * 13, 150), ([9] * 13, 2)):
        t, c = task(head + tail, max_tokens=n_out, id_slot=0)
        run(e, t)
        timings.append((c.result.timings.cache_n, c.result.timings.prompt_n))
        kept.append([x.n_tokens for x in e.slots[0].checkpoints])
    assert timings == [(0, 613), (600, 13), (600, 13)]
    assert kept[0] == [481, 609]  # 613 - 4 - n_ubatch, 613 - 4 (the end one comes with the answer)
    assert kept[1] == [481, 600, 613]  # the branch point, then the prompt's end
    assert e.stats.checkpoints_restored == 1  # the third resumed at 600
    # a branch within SHORT_TAIL of the newest checkpoint below it takes none
    p = CheckpointPolicy(enabled=True, n_ubatch=128)
    assert p.wants(600, 613, -1, [_ck(481)], n_start=600)
    assert not p.wants(600, 613, -1, [_ck(540)], n_start=600)
    assert not p.wants(600, 613, -1, [_ck(481)], n_start=0)  # a cold prompt: the usual marks
    assert p.wants(600, 613, -1, [_ck(481)], branches={600})  # a sharing waiter's target


def test_prompts_sharing_a_head_all_checkpoint_where_they_branch():
    """Four prompts with one 600-token head arrive together: one computes the head and the
    others wait and copy it (prefix sharing). The source checkpoints where they branch off
    it (its waiters' target), each waiter where it branched (the copy's end)."""
    e, b = swa_engine(n_seq=4)
    head = list(range(1, 601))
    tasks = [task(head + [700 + i] * 13, max_tokens=2) for i in range(4)]
    run(e, *(t for t, _ in tasks))
    got = sorted(
        (c.result.timings.cache_n, [x.n_tokens for x in e.slots[c.result.id_slot].checkpoints])
        for _, c in tasks
    )
    assert got[0] == (0, [481, 600, 609, 613])  # the source: 613 - 4 - n_ubatch, 600, ...
    assert got[1:] == [(600, [481, 600, 613])] * 3  # the waiters (481 came with the copy)
    assert e.stats.prefix_shared_tokens == 3 * 600


def test_cut_inside_the_window_needs_no_checkpoint():
    e, b = swa_engine(ctx_checkpoints=0)
    prompt = list(range(1, 1001))
    run(e, task(prompt, max_tokens=2)[0])
    t2, c2 = task(prompt[:990] + [5, 5], max_tokens=2)
    run(e, t2)
    assert c2.result.timings.cache_n == 990


def test_non_swa_model_takes_no_checkpoints():
    e, b = make_engine(n_swa=0)
    run(e, task(list(range(1, 1001)), max_tokens=1, user_start=600)[0])
    assert e.stats.checkpoints_created == 0 and not e.ckpt.enabled


def test_restored_state_holds_only_the_last_window():
    # like llama.cpp: a saved state leaves out window cells masked for its last position
    e, b = swa_engine(n_seq=1)
    run(e, task(list(range(1, 1001)), max_tokens=1)[0])
    live_min = b.seq_pos_min(0)
    data = b.state_get(0)
    b.seq_clear(0)
    assert b.state_set(0, data) == len(data)
    assert live_min < 900 and b.seq_pos_min(0) == 1000 - 100 and b.seq_pos_max(0) == 999


def _evicted_conversation(max_tokens: int = 8, **kw):
    """A 1,000-token conversation (window 100) pushed out of the only slot into the RAM
    cache by another prompt; returns the engine, its prompt and what the slot held."""
    from server.tiers.prompt_cache import PromptCache

    e, b = swa_engine(n_seq=1, **kw)
    e.cache = PromptCache(-1, 0)
    e.opts.cache_idle_slots = False
    prompt = list(range(1, 1001))
    run(e, task(prompt, max_tokens=max_tokens, user_start=600)[0])
    held = list(e.slots[0].tokens)
    run(e, task([900 + i % 50 for i in range(300)], max_tokens=2)[0])
    assert [x.tokens for x in e.cache.entries] == [held]
    return e, prompt, held


def test_ram_cache_entry_keeps_the_checkpoint_a_slot_file_keeps():
    # the slot held checkpoints at 600 (the user message), 868, 996 and 1000; the entry
    # carries the one serving both a regenerated answer and the next turn (file_checkpoints)
    e, prompt, held = _evicted_conversation()
    assert [x.n_tokens for x in e.cache.entries[0].checkpoints] == [996]


def test_follow_up_after_ram_load_cut_in_the_answer_resumes_before_the_prompt_end():
    e, prompt, held = _evicted_conversation()
    # the client's follow-up keeps 3 of the 7 decoded answer tokens, then differs
    t, c = task(held[:1003] + [5, 6, 7], max_tokens=2)
    run(e, t)
    assert e.cache.counters.loads == 1
    assert (c.result.timings.cache_n, c.result.timings.prompt_n) == (996, 10)
    assert e.stats.checkpoints_restored == 1


def test_follow_up_after_ram_load_extending_the_whole_state_reuses_all_of_it():
    e, prompt, held = _evicted_conversation()
    t, c = task(held + [5, 6, 7], max_tokens=2)
    run(e, t)
    assert (c.result.timings.cache_n, c.result.timings.prompt_n) == (len(held), 3)
    assert e.stats.checkpoints_restored == 0


def test_state_saved_under_cache_pressure_serves_a_cut_at_its_length():
    # llama.cpp reuses window cells the next token no longer sees when it needs room: the
    # saved state then starts at len - n_swa + 1, which is exactly what the next token needs
    e, prompt, held = _evicted_conversation(swa_slack=-1)
    t, c = task(held + [5, 6, 7], max_tokens=2)
    run(e, t)
    assert (c.result.timings.cache_n, c.result.timings.prompt_n) == (len(held), 3)
    # the state went through a second save and restore: still served whole
    run(e, task([900 + i % 50 for i in range(300)], max_tokens=2)[0])
    held2 = next(list(x.tokens) for x in e.cache.entries if x.tokens[:3] == held[:3])
    t, c = task(held2 + [4], max_tokens=2)
    run(e, t)
    assert (c.result.timings.cache_n, c.result.timings.prompt_n) == (len(held2), 1)


def test_same_prompt_after_ram_load_resumes_at_the_checkpoint_before_its_end():
    e, prompt, held = _evicted_conversation()
    t, c = task(prompt, max_tokens=2)
    run(e, t)
    # the last prompt token is re-evaluated: the cut at 999 needs the checkpoint at 996
    assert (c.result.timings.cache_n, c.result.timings.prompt_n) == (996, 4)


def test_prompt_end_checkpoint_only_when_prompt_and_answer_can_outgrow_the_window():
    e, b = swa_engine(n_swa=600)
    t, c = task(list(range(1, 101)), max_tokens=50)
    run(e, t)
    assert e.slots[c.result.id_slot].checkpoints == []
    e, b = swa_engine(n_swa=120)
    t, c = task(list(range(1, 101)), max_tokens=50)
    run(e, t)
    assert [x.n_tokens for x in e.slots[c.result.id_slot].checkpoints] == [100]


def test_prompts_within_one_ubatch_take_no_checkpoints():
    e, b = swa_engine(n_ubatch=128)
    t, c = task(list(range(1, 121)), max_tokens=1, user_start=50)
    run(e, t)
    assert e.slots[c.result.id_slot].checkpoints == []
    assert len(b.decodes) == 1  # the whole prompt in one decode, no split for a checkpoint


def test_insert_collapses_checkpoints_closer_than_near():
    p = CheckpointPolicy(enabled=True, max_per_slot=8)
    have: list[Checkpoint] = []
    for n in (100, 596, 600, 601, 602):
        p.insert(have, Checkpoint(n, 0, n - 1, bytearray(b"x")))
    # 600 and 601 fell within 4 tokens below 602; 596 is exactly 4 below 600 and stays
    assert [x.n_tokens for x in have] == [100, 596, 602]


def _ck(n: int) -> Checkpoint:
    return Checkpoint(n, max(0, n - 512), n - 1, bytearray(b"x"))


def test_a_slot_file_carries_the_one_checkpoint_a_restore_needs():
    # a 4,051-token slot (Gemma 3's window 512): the checkpoints the policy took at the
    # user message, 4 + n_ubatch before the prompt's end, 4 before it, and at its end
    have = [_ck(n) for n in (1000, 3535, 4047, 4051)]
    # the 4 before the end serves both a regenerated answer (a cut at 4050) and the next
    # turn (a cut at or past 4051, 4 more tokens to compute); the older ones are dropped
    assert [c.n_tokens for c in file_checkpoints(have, 4060, 512)] == [4047]
    # none at or past the state's length: the state itself serves a cut there
    assert [c.n_tokens for c in file_checkpoints(have, 4051, 512)] == [4047]
    assert file_checkpoints([_ck(4051)], 4051, 512) == []
    # a newest more than SHORT_TAIL tokens past the one before it is carried itself
    assert [c.n_tokens for c in file_checkpoints([_ck(3000), _ck(4047)], 4060, 512)] == [4047]


def test_a_slot_file_carries_no_checkpoint_its_state_covers():
    # a state within one window holds every position: any cut is served without one
    assert file_checkpoints([_ck(100), _ck(300)], 400, 512) == []
    # one token short of the state's end is served by the state's own window
    assert file_checkpoints([_ck(999)], 1000, 512) == []
    assert file_checkpoints([], 1000, 512) == []
    # no window, no cut needs one; a recurrent state holds only its latest
    assert file_checkpoints([_ck(300)], 400, 0) == []
    assert [c.n_tokens for c in file_checkpoints([_ck(300)], 400, 0, recurrent=True)] == [300]


def test_a_restored_state_serves_its_own_length_or_a_checkpoint():
    ck = [Checkpoint(996, 896, 995, b"")]
    assert restored_serves(1008, 1008, [], 100, False)  # its own length
    assert restored_serves(1008, 1007, [], 100, False)  # the last token re-evaluated
    assert not restored_serves(1008, 900, [], 100, False)  # another conversation's prefix
    assert restored_serves(1008, 999, ck, 100, False)  # a regenerated answer: the checkpoint
    assert not restored_serves(1008, 990, ck, 100, False)  # before the checkpoint
    assert restored_serves(1008, 999, None, 100, False)  # a file's: not known, taken
    assert restored_serves(1008, 10, [], 0, False)  # full attention: any prefix
    assert restored_serves(50, 40, [], 100, False)  # a state within one window
