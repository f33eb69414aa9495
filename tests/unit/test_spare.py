"""The spare state buffer (server/kv/spare.py): a restored RAM entry's bytes take the next
state copied out, in place, when they have room."""

from __future__ import annotations

from server.kv.spare import HEADROOM, Spare, room
from server.tiers.prompt_cache import PromptCache

from .helpers import make_engine, run, task


def fill_with(byte: int):
    def fill(buf: bytearray, n: int) -> int:
        buf[:n] = bytes([byte]) * n
        return n

    return fill


def test_a_new_copy_is_exact_with_an_eighth_more_room():
    sp = Spare()
    got = sp.copy(800, fill_with(7))
    assert got is not None and len(got) == 800 and bytes(got) == b"\x07" * 800
    assert room(got) == 800 + 800 // HEADROOM and sp.reused == 0


def test_the_spare_takes_a_slightly_larger_state_in_place():
    sp = Spare()
    first = sp.copy(800, fill_with(1))
    assert first is not None
    sp.give(first)  # restored: nothing reads it any more
    again = sp.copy(880, fill_with(2))  # larger, within its room
    assert again is first and len(again) == 880 and bytes(again) == b"\x02" * 880
    assert room(again) == 900 and sp.reused == 1
    sp.give(again)
    smaller = sp.copy(500, fill_with(3))  # above half its room: still in place
    assert smaller is first and len(smaller) == 500 and sp.reused == 2


def test_a_state_the_spare_cannot_hold_gets_new_memory():
    sp = Spare()
    first = sp.copy(800, fill_with(1))
    sp.give(first)
    big = sp.copy(901, fill_with(2))  # beyond its room
    assert big is not first and len(big) == 901 and sp.reused == 0
    sp.give(bytes(10))  # not a bytearray: never kept
    sp.give(first)
    tiny = sp.copy(100, fill_with(3))  # under half its room: a new, small one
    assert tiny is not first and room(tiny) == 100 + 100 // HEADROOM
    assert sp.copy(50, lambda buf, n: 0) is None  # the fill failed


def test_a_restored_entry_is_the_next_copys_memory_and_the_states_stay_right():
    """One slot, two conversations taking turns through the RAM cache: each restore gives
    its entry's bytes to the copy of the conversation it displaces; every turn still finds
    its whole conversation (exact cache_n), and the cache stays consistent."""
    e, b = make_engine(n_seq=1)
    e.cache = PromptCache(-1, 0)
    e.opts.cache_idle_slots = False
    convs = [list(range(1, 200)), [900 + i % 50 for i in range(190)]]
    for turn in range(3):
        for i, conv in enumerate(convs):
            t, c = task(conv, max_tokens=3)
            run(e, t)
            if turn:
                assert c.result.timings.cache_n == len(conv) - 2, (turn, i)  # all it held
            convs[i] = list(e.slots[0].tokens) + [5 + turn, 6 + i]
    assert e.store.spare.reused >= 3
    assert e.cache.check_integrity() == []
