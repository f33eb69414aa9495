"""Images in the engine (issue 42), on the fake backend: an image is one work decoded by
the runner (never split, never in a token batch), a follow-up about the same image reuses
it whole from the slot, another image stops the match at the image, and a cut never
falls inside one."""

from __future__ import annotations

import numpy as np

from server.image_types import EncodedImage, PromptImage, image_placeholders
from server.kv import images
from server.tiers.prompt_cache import PromptCache
from tests.fake_backend import RUNNER
from tests.unit.helpers import make_engine, run, task


def with_image(head: list[int], seed: int, n: int, tail: list[int]):
    """A task whose prompt is ``head``, an image of ``n`` positions, then ``tail``."""
    identity = seed.to_bytes(16, "little")
    embd = np.zeros((n, 8), np.float32)
    im = PromptImage(len(head), EncodedImage(identity, embd, True, True))
    t, c = task(head + image_placeholders(identity, n) + tail, max_tokens=3)
    t.images = (im,)
    return t, c


HEAD = list(range(1, 300))
TAIL = list(range(400, 450))


def test_an_image_is_decoded_whole_by_the_runner_between_text_chunks():
    e, b = make_engine(n_seq=1, n_batch=64, n_ubatch=64)
    t, c = with_image(HEAD, 1, 40, TAIL)
    run(e, t)
    assert c.result is not None and c.result.timings.prompt_n == len(t.prompt)
    assert b.images == [(0, len(HEAD), 40, True)]
    assert all(ph == RUNNER for name, ph in b.memory_calls)
    # no token batch holds a placeholder
    assert all(tok >= 0 for rows in b.decodes for _, _, tok in rows)
    assert e.stats.images_decoded == 1 and e.stats.image_tokens_computed == 40


def test_a_follow_up_about_the_same_image_reuses_it_and_another_image_stops_there():
    e, b = make_engine(n_seq=1, n_batch=512)
    t, c = with_image(HEAD, 1, 40, TAIL)
    run(e, t)
    held = list(e.slots[0].tokens)
    t2, c2 = with_image(HEAD, 1, 40, TAIL)
    t2.prompt = held + [7, 8, 9]
    run(e, t2)
    assert c2.result is not None and c2.result.timings.cache_n == len(held)
    assert len(b.images) == 1 and e.stats.image_tokens_cached == 40
    t3, c3 = with_image(HEAD, 2, 40, TAIL)
    run(e, t3)
    assert c3.result is not None and c3.result.timings.cache_n == len(HEAD)
    assert len(b.images) == 2


def test_a_cut_inside_an_image_moves_to_its_start():
    ph = image_placeholders(b"x" * 16, 5)
    toks = [1, 2, *ph, 3]
    assert [images.outside(toks, n) for n in range(len(toks) + 1)] == [0, 1, 2, 2, 2, 2, 2, 7, 8]
    assert image_placeholders(b"x" * 16, 5) == ph and all(p < 0 for p in ph)
    assert image_placeholders(b"y" * 16, 5)[0] != ph[0]


def test_a_slot_holding_an_image_comes_back_from_the_ram_cache_whole():
    e, b = make_engine(n_seq=1, n_batch=512)
    e.cache = PromptCache(-1, 0)
    t, _ = with_image(HEAD, 1, 40, TAIL)
    run(e, t)
    held = list(e.slots[0].tokens)
    run(e, task(list(range(600, 900)), max_tokens=2)[0])  # the image's state to the cache
    t2, c2 = with_image(HEAD, 1, 40, TAIL)
    t2.prompt = held + [7, 8]
    run(e, t2)
    assert e.cache.counters.loads >= 1
    assert c2.result is not None and c2.result.timings.cache_n == len(held)
    assert len(b.images) == 1  # restored with its image, not decoded again


def test_two_requests_about_one_image_share_it():
    e, b = make_engine(n_seq=2, n_batch=1024)
    e.sharing.speed.observe(1000, 1.0)
    tasks = [with_image(HEAD, 3, 40, TAIL + [900 + i]) for i in range(2)]
    run(e, *(t for t, _ in tasks))
    assert all(c.result is not None for _, c in tasks)
    assert len(b.images) == 1 and e.stats.prefix_shared_tokens >= len(HEAD) + 40


def test_a_failed_image_decode_ends_its_run_with_an_error_and_the_engine_goes_on():
    e, b = make_engine(n_seq=1, n_batch=512)
    t, c = with_image([], 4, 40, TAIL)  # the image first: its decode is the first one
    b.fail_next = [-3]
    run(e, t)
    assert c.error is not None and "image" in c.error.message
    assert e.slots[0].tokens == [] and b.images == []
    t2, c2 = with_image(HEAD, 4, 40, TAIL)
    run(e, t2)
    assert c2.result is not None and len(b.images) == 1
