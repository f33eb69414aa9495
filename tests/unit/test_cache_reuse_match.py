"""--cache-reuse: the two-sided chunk matcher (server.prefix.reuse), exact outputs."""

from server.prefix.reuse import (
    ReuseChunk,
    due_chunks,
    gap_tokens,
    iter_chunks,
    match_chunks,
    select_chunks,
)

A = list(range(100, 110))  # 10 distinct tokens
B = list(range(200, 210))
C = list(range(300, 310))


def test_deletion_in_the_prompt():
    # cached A B C, prompt A C: C moves down by 10
    assert match_chunks(A + B + C, A + C, 4, start=10) == [ReuseChunk(20, 10, 10)]


def test_insertion_in_the_prompt():
    # cached A C, prompt A B C: C moves up by 10, B is a gap
    got = match_chunks(A + C, A + B + C, 4, start=10)
    assert got == [ReuseChunk(10, 20, 10)]
    assert gap_tokens(got, 10) == 10


def test_substitution_near_the_start():
    # "Request id 4711." -> "Request id 9.": 4 tokens replaced by 1
    cached = [1, 2, 47, 11, 12, 13] + B + C
    prompt = [1, 2, 9] + B + C
    got = match_chunks(cached, prompt, 8, start=2)
    assert got == [ReuseChunk(6, 3, 20)]
    assert gap_tokens(got, 2) == 1


def test_both_sides_change():
    # cached X A Y B, prompt A Z B: deletions and insertions on both sides
    cached = [7, 7] + A + [8, 8, 8] + B
    prompt = A + [5] + B
    assert match_chunks(cached, prompt, 5) == [ReuseChunk(2, 0, 10), ReuseChunk(15, 11, 10)]


def test_repeated_ngrams_take_the_earliest_in_order():
    cached = A + B + A + C
    prompt = B + A + C
    # B at 10, then the A after it (20, not 0), extended through C
    assert match_chunks(cached, prompt, 5) == [ReuseChunk(10, 0, 30)]


def test_no_match():
    assert match_chunks(A + B, C + C, 4) == []
    assert match_chunks([], A, 4) == []
    assert match_chunks(A, A, 0) == []


def test_chunks_shorter_than_n_are_ignored():
    # A (10 tokens) is shorter than 12: not reused; B + C (20) is
    cached = A + [1] + B + C
    prompt = [2] + A + [3] + B + C
    assert match_chunks(cached, prompt, 12) == [ReuseChunk(11, 12, 20)]


def test_order_is_kept():
    # the prompt swaps B and A: only one of them can be reused (KV order)
    assert match_chunks(A + B, B + A, 5) == [ReuseChunk(10, 0, 10)]


def test_key_longer_than_sixteen():
    long = list(range(1000, 1100))
    assert match_chunks([5] + long, [6, 6] + long, 64) == [ReuseChunk(1, 2, 100)]


def test_gap_tokens():
    chunks = [ReuseChunk(10, 12, 5), ReuseChunk(20, 30, 5)]
    assert gap_tokens(chunks, 10) == 2 + 13


def test_select_keeps_gapped_chunks_worth_a_step():
    # at start: free; after a gap: kept only with >= 8 tokens; a dropped chunk joins the gap
    chunks = [
        ReuseChunk(10, 10, 3),  # no gap: kept however short
        ReuseChunk(14, 14, 3),  # gap 1, 3 tokens: dropped
        ReuseChunk(17, 17, 9),  # gap 4 (the dropped chunk's tokens too), 9 tokens: kept
        ReuseChunk(26, 26, 2),  # no gap after a kept chunk: kept
    ]
    assert select_chunks(chunks, 10, 8, 16) == [chunks[0], chunks[2], chunks[3]]
    assert select_chunks(chunks, 10, 8, 2) == [chunks[0], chunks[2]]
    assert select_chunks(chunks, 10, 8, 0) == []
    # a window cache: one run of adjacent chunks (the first kept one and those right after)
    assert select_chunks(chunks, 10, 8, 16, one_run=True) == [chunks[0]]
    assert select_chunks(chunks[1:], 10, 8, 16, one_run=True) == [chunks[2], chunks[3]]


def test_every_other_token_substituted_keeps_nothing():
    cached = list(range(1000, 4000))
    prompt = [t if i % 2 == 0 else 7 for i, t in enumerate(cached)]
    found = match_chunks(cached, prompt, 1, start=1)
    assert len(found) == 1499 and {c.length for c in found} == {1}
    assert select_chunks(found, 1, 32, 16) == []


def test_select_stops_the_scan_at_its_limit():
    cached = list(range(1000, 3000))
    prompt = [t if i % 40 else 7 for i, t in enumerate(cached)]  # a substitution every 40
    it = iter_chunks(cached, prompt, 16, start=1)
    got = select_chunks(it, 1, 32, 4)
    assert [(c.prompt_start, c.length) for c in got] == [(1, 39), (41, 39), (81, 39), (121, 39)]
    assert next(it) == ReuseChunk(161, 161, 39)  # the scan stopped right after the fourth


def test_due_chunks():
    pending = [ReuseChunk(40, 10, 5), ReuseChunk(50, 15, 5), ReuseChunk(60, 30, 5)]
    assert due_chunks(pending, 10) == (2, 20, 30)  # two in a row, then the gap up to 30
    assert due_chunks(pending, 8) == (0, 8, 10)
    assert due_chunks(pending[2:], 30) == (1, 35, -1)
