"""Prefix lookup cost against the number of cached entries (issue 27), without llama.cpp.

Every entry is one shared 2,000-token system prompt plus its own distinct tail of a few
hundred tokens (agent conversations). The bench fills each tier with N entries, then times:

- ``ram find``: PromptCache.find for a new conversation (system prompt + a tail nobody has)
  and for a continued one (an entry's tokens + a new turn), from an empty slot;
- ``ram save``: PromptCache.save of one more entry (its covered and prefix checks), the entry
  taken straight back out so N stays N;
- ``disk find``: DiskTier.find, the same two prompts, entries registered in the tier's
  in-memory index without files (its directory exists and is empty);
- ``disk add``: what the writer does with a written file (covers, add, prefixes_of),
  undone again;
- ``locate new`` / ``locate cont``: the admission's one lookup (server.kv.locator, issue
  41): ``Locator.match`` over SLOTS live slots (``locate4``: 4 slots; ``scan``/``scan4``:
  the same slot prefixes computed as before issue 41, each consumer scanning with ``lcp``)
  (each holding one of the conversations, half of them prefilling one more; their tokens
  kept in the slots' block index as the engine's store keeps them) plus the RAM tier's
  rule on the index walk, the two prompts; every slot's two values are read, as slot
  choice plus sharing do at most;
- ``ram find worst``: RAM find for a new conversation when the entries were saved longest
  first (tails of N+100 down to 101 tokens), so that every one is shorter than all before
  it: the prefix index's worst case (every entry is a record, see prefix/prefix_index.py).

    python -m bench.prefix_lookup              # 10, 100, 1,000 and 5,000 entries
    python -m bench.prefix_lookup 10 20000     # other entry counts

Times are wall-clock medians per call, in microseconds.
"""

from __future__ import annotations

import functools
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

from server.kv.locator import Locator
from server.prefix.block_index import BlockIndex
from server.slot.slot import Slot
from server.task import GenParams, SamplingParams, Task
from server.tiers.disk import DiskTier
from server.tiers.disk_files import DiskEntry, FileCheck
from server.tiers.prompt_cache import PromptCache, RamHeld
from server.types import lcp

SYSTEM = 2000  # tokens of the shared system prompt
TAIL = (200, 400)  # each entry's own tail
VOCAB = 50_000
SLOTS = 64  # slots the locator scans besides the index
CHECK = FileCheck(version=3, n_ctx=1 << 20, n_vocab=VOCAB, model="bench")


def conversations(n: int, seed: int = 7) -> tuple[list[int], list[list[int]]]:
    """The system prompt and ``n`` entries' tokens (tails start with distinct tokens)."""
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(SYSTEM)]
    out = []
    for i in range(n):
        tail = [VOCAB + i] + [rng.randrange(VOCAB) for _ in range(rng.randint(*TAIL) - 1)]
        out.append(system + tail)
    return system, out


def timed(fn: Callable[[], object], budget_s: float = 0.3) -> float:
    """Median microseconds per call over batches filling about ``budget_s``."""
    fn()
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    reps = max(1, min(200, int(budget_s / one / 5)))
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        samples.append((time.perf_counter() - t0) / reps * 1e6)
    return statistics.median(samples)


def ram_row(n: int) -> tuple[float, float, float]:
    system, convs = conversations(n)
    c = PromptCache(-1, 0)
    for t in convs:
        c.save(t, 16, lambda: bytearray(16))
    assert len(c.entries) == n
    fresh = system + [VOCAB * 3 + j for j in range(300)]
    cont = convs[n // 2] + [VOCAB * 4 + j for j in range(50)]
    assert c.find([], fresh) is not None and c.find([], cont).n_lcp == len(convs[n // 2])
    extra = system + [VOCAB * 5 + j for j in range(300)]

    def save_one() -> None:
        c.save(extra, 16, lambda: bytearray(16))
        c.take(c.find([], extra), lambda e: True)

    return (
        timed(lambda: c.find([], fresh)),
        timed(lambda: c.find([], cont)),
        timed(save_one),
    )


def worst_row(n: int) -> float:
    rng = random.Random(11)
    system = [rng.randrange(VOCAB) for _ in range(SYSTEM)]
    c = PromptCache(-1, 0)
    for i in range(n):
        tail = [VOCAB + i] + [rng.randrange(VOCAB) for _ in range(n + 100 - i)]
        c.save(system + tail, 16, lambda: bytearray(16))
    fresh = system + [VOCAB * 3 + j for j in range(300)]
    assert c.find([], fresh).index == 0
    return timed(lambda: c.find([], fresh))


def locate_row(n: int, n_slots: int = SLOTS) -> tuple[float, float, float]:
    system, convs = conversations(n)
    c = PromptCache(-1, 0)
    for t in convs:
        c.save(t, 16, lambda: bytearray(16))
    blocks = BlockIndex()
    slots = []
    for i in range(n_slots):  # as SlotStore wires them: their sequences keep ``blocks``
        s = Slot(i, 1 << 20)
        s.seq.watch = functools.partial(blocks.changed, i)
        s.tokens = list(convs[i % n])
        if i % 2:  # prefilling the next conversation
            t = Task(list(convs[(i + 1) % n]), SamplingParams(), GenParams(), lambda ev: None)
            s.start(t, len(s.tokens))
        slots.append(s)
    loc = Locator(slots, c.index, blocks)
    fresh = system + [VOCAB * 3 + j for j in range(300)]
    cont = convs[n // 2] + [VOCAB * 4 + j for j in range(50)]

    def locate(prompt: list[int]) -> object:
        m = loc.match("", prompt)
        sum(m.held) + sum(m.inflight)  # every slot read, as slot choice plus sharing do
        tiers = m.tiers()
        assert tiers is not None
        return tiers.best((RamHeld.TIER,), -1.0, 0.0)

    def scan(prompt: list[int]) -> object:  # before: each consumer scanned the slots itself
        for h in slots:
            lcp(h.tokens, prompt)
            if h.task is not None:
                lcp(h.task.prompt, prompt)
        return c.index.match("", prompt).best((RamHeld.TIER,), -1.0, 0.0)

    assert locate(cont).n_lcp == len(convs[n // 2])  # type: ignore[attr-defined]
    return timed(lambda: scan(fresh)), timed(lambda: locate(fresh)), timed(lambda: locate(cont))


def disk_row(n: int, directory: str) -> tuple[float, float, float]:
    system, convs = conversations(n)
    t = DiskTier(directory, 1 << 50, CHECK, rescan_s=1e9)  # not started: nothing scans
    t._dir_mtime = -2  # never "changed": a miss never waits for a scan
    for i, toks in enumerate(convs):
        t.index.add(DiskEntry(f"{i:016x}-h-1-{i:012x}.lsc", toks, "", 1000, 900, i))
    assert len(t.index.entries) == n
    fresh = system + [VOCAB * 3 + j for j in range(300)]
    cont = convs[n // 2] + [VOCAB * 4 + j for j in range(50)]
    assert t.find(fresh, "", [], own=True) is not None
    assert t.find(cont, "", [], own=True).n_lcp == len(convs[n // 2])
    extra = DiskEntry("ffffffffffffffff-h-1-ffffffffffff.lsc", system + [7] * 300, "", 1000, 900, n)

    def add_one() -> None:  # the writer's index work for one written file
        with t._lock:
            assert not t.index.covers(extra.tokens, extra.tenant)
            t.index.add(extra)
            t.index.prefixes_of(extra.tokens, extra.tenant, but=extra.name)
        with t._lock:
            t.index.remove(extra.name)

    return (
        timed(lambda: t.find(fresh, "", [], own=True)),
        timed(lambda: t.find(cont, "", [], own=True)),
        timed(add_one),
    )


def main(argv: list[str]) -> None:
    counts = [int(a) for a in argv] or [10, 100, 1000, 5000]
    print(f"entries: {SYSTEM}-token system prompt + a {TAIL[0]}-{TAIL[1]}-token tail each")
    print(f"us per call (median); locate: {SLOTS} slots scanned too (locate4: 4 slots)")
    head = ("entries", "ram find new", "ram find cont", "ram save", "disk find new")
    head += ("disk find cont", "disk add", "ram find worst")
    head += ("scan4 new", "locate4 new", "locate4 cont", "scan new", "locate new", "locate cont")
    print("".join(f"{h:>15}" for h in head))
    with tempfile.TemporaryDirectory() as d:
        for n in counts:
            row = (*ram_row(n), *disk_row(n, d), worst_row(n), *locate_row(n, 4), *locate_row(n))
            print(f"{n:>15}" + "".join(f"{v:>15.1f}" for v in row))


if __name__ == "__main__":
    main(sys.argv[1:])
