from server.kv.policy import CheckpointView, SlotView, choose_slot, plan_reuse, window_intact
from server.types import lcp  # policy no longer computes prefixes (kv/locator.py)


def test_lcp_exact_lengths():
    a = list(range(300))
    assert lcp(a, a) == 300
    assert lcp(a, a[:130]) == 130
    b = a[:200] + [-1] + a[201:]
    assert lcp(a, b) == 200
    assert lcp([], a) == 0
    assert lcp([5], [6]) == 0


def views(*specs):
    return [SlotView(i, idle, toks, t) for i, (idle, toks, t) in enumerate(specs)]


def test_choose_by_id_slot_waits_when_busy():
    slots = views((True, [1, 2], 0.0), (False, [1, 2, 3], 0.0))
    assert choose_slot(slots, [1, 2, 3], 1, 0.1) is None
    c = choose_slot(slots, [1, 2, 3], 0, 0.1)
    assert (c.slot, c.lcp, c.by) == (0, 2, "id_slot")


def test_choose_by_similarity_picks_longest_match():
    prompt = list(range(100))
    slots = views((True, list(range(30)), 5.0), (True, list(range(80)) + [7], 1.0), (True, [], 0.0))
    c = choose_slot(slots, prompt, -1, 0.1)
    assert (c.slot, c.lcp, c.by, c.save_first) == (1, 80, "similarity", False)


def test_similarity_threshold_falls_back_to_lru_empty_first():
    prompt = list(range(100))
    slots = views((True, [0, 1, 2, 3, 4] + [9] * 50, 1.0), (True, [], 3.0), (True, [50], 0.5))
    c = choose_slot(slots, prompt, -1, 0.1)  # 5/100 <= 0.1
    assert (c.slot, c.by, c.save_first) == (1, "lru", False)
    slots = views((True, [0, 1, 2, 3, 4] + [9] * 50, 1.0), (True, [50], 0.5))
    c = choose_slot(slots, prompt, -1, 0.1)
    assert (c.slot, c.by, c.save_first) == (1, "lru", True)


def test_similarity_pick_with_low_keep_is_saved_first():
    prompt = list(range(20))
    slots = views((True, list(range(10)) + [99] * 30, 0.0))
    c = choose_slot(slots, prompt, -1, 0.1)
    assert c.by == "similarity" and c.lcp == 10 and c.save_first  # f_keep = 10/40 < 0.5


def test_similarity_pick_losing_many_tokens_is_saved_first():
    # f_keep 0.9, but 300 tokens (>= SAVE_LOST_TOKENS) would be lost: saved first
    system = list(range(2700))
    slots = views((True, system + [-5] * 300, 0.0))
    c = choose_slot(slots, system + [-6] * 40, -1, 0.1)
    assert (c.by, c.lcp, c.save_first) == ("similarity", 2700, True)
    slots = views((True, system + [-5] * 255, 0.0))  # 255 lost: kept as llama-server does
    c = choose_slot(slots, system + [-6] * 40, -1, 0.1)
    assert (c.by, c.lcp, c.save_first) == ("similarity", 2700, False)


def test_no_idle_slot():
    assert choose_slot(views((False, [], 0.0)), [1], -1, 0.1) is None


def test_plan_full_match_reevaluates_last_token():
    toks = list(range(50))
    p = plan_reuse(toks, toks, cache_prompt=True, pos_min=0, n_swa=0)
    assert p.n_past == 49


def test_plan_cache_prompt_off():
    toks = list(range(50))
    assert plan_reuse(toks, toks + [1], cache_prompt=False, pos_min=0, n_swa=0).n_past == 0


def test_window_intact_rule():
    assert window_intact(0, 100, 512)
    # the token at 1000 sees keys 489..1000 (llama.cpp masks p1 - p0 >= n_swa)
    assert window_intact(489, 1000, 512)
    assert not window_intact(490, 1000, 512)
    assert window_intact(900, 1000, 0)


def test_plan_swa_cut_inside_window_is_reused():
    slot = list(range(1000))
    prompt = slot[:990] + [7, 7]
    p = plan_reuse(slot, prompt, cache_prompt=True, pos_min=400, n_swa=512)
    assert (p.n_past, p.reason) == (990, "lcp")


def test_plan_swa_cut_behind_window_uses_newest_usable_checkpoint():
    slot = list(range(1000))
    prompt = slot[:600] + [7] * 10
    cps = [CheckpointView(300, 0, 299), CheckpointView(550, 38, 549), CheckpointView(700, 188, 699)]
    p = plan_reuse(slot, prompt, cache_prompt=True, pos_min=480, n_swa=512, checkpoints=cps)
    assert (p.n_past, p.checkpoint, p.reason) == (550, 1, "checkpoint")


def test_plan_swa_cut_behind_window_without_checkpoint_resets():
    slot = list(range(1000))
    prompt = slot[:600] + [7] * 10
    p = plan_reuse(slot, prompt, cache_prompt=True, pos_min=480, n_swa=512)
    assert (p.n_past, p.reason) == (0, "swa-reset")


def test_plan_recurrent_cut_needs_a_checkpoint():
    toks = list(range(100))
    ck = [CheckpointView(40, 39, 39), CheckpointView(90, 89, 89)]
    kw = dict(cache_prompt=True, pos_min=99, n_swa=0, checkpoints=ck, recurrent=True)
    # extending the whole state: no cut, nothing to restore
    assert plan_reuse(toks, toks + [7], **kw).n_past == 100
    p = plan_reuse(toks, toks[:60] + [7], **kw)
    assert (p.n_past, p.checkpoint, p.reason) == (40, 0, "checkpoint")
    assert plan_reuse(toks, toks[:30] + [7], **kw).n_past == 0
    # the same cut on attention-only memory needs nothing
    assert plan_reuse(toks, toks[:60] + [7], **{**kw, "recurrent": False}).n_past == 60
