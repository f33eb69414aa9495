"""--cache-reuse N: the matching of a slot's cached tokens against a new prompt (pure).

llama-server's scan (server-context.cpp, ``n_cache_reuse``) only skips tokens of the cached
sequence, so a token inserted or substituted in the new prompt before the reusable part
defeats it. ``match_chunks`` aligns both ways: left to right, at each prompt position it
looks the prompt's next key (the first ``min(N, KEY)`` tokens) up in an index of the cached
sequence, takes the earliest cached position at or after the current one whose tokens agree
for at least N tokens, extends the chunk as far as they agree, and goes on after it;
otherwise it skips one prompt token. Cached positions only move forward (the KV keeps its
order), so deletions, insertions and substitutions in either sequence are all skipped.

Cost: one pass over the cached tokens to build the index, one dictionary lookup per
skipped prompt token, and one comparison per matched token (at most ``CANDIDATES``
candidate positions per lookup), so linear in the two lengths times the key length.

``select_chunks`` then keeps the chunks worth moving (each one after a gap costs its slot
one more step) and at most a fixed number of them; ``due_chunks`` tells the scheduler which
of a run's parked chunks move in before its next prompt chunk and where that chunk ends.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

KEY = 16  # tokens of an index key (N when N is smaller)
CANDIDATES = 8  # cached positions tried per lookup (repeated keys)


@dataclass(frozen=True)
class ReuseChunk:
    """``length`` tokens at cached positions ``cache_start``.. equal the prompt's at
    ``prompt_start``..: their KV moves by ``prompt_start - cache_start``."""

    cache_start: int
    prompt_start: int
    length: int

    @property
    def delta(self) -> int:
        return self.prompt_start - self.cache_start


def _common(a: Sequence[int], i: int, b: Sequence[int], j: int) -> int:
    """How many tokens ``a[i:]`` and ``b[j:]`` share from their start."""
    n = min(len(a) - i, len(b) - j)
    k, step = 0, 64
    while k + step <= n and a[i + k : i + k + step] == b[j + k : j + k + step]:
        k += step  # 64-token slices compared at C speed, as types.lcp
    while k < n and a[i + k] == b[j + k]:
        k += 1
    return k


def _index(cached: Sequence[int], start: int, k: int) -> dict[tuple[int, ...], list[int]]:
    """Every ``k``-gram of ``cached`` from ``start`` -> its positions, ascending."""
    idx: dict[tuple[int, ...], list[int]] = {}
    for c in range(start, len(cached) - k + 1):
        idx.setdefault(tuple(cached[c : c + k]), []).append(c)
    return idx


def match_chunks(
    cached: Sequence[int], prompt: Sequence[int], n_min: int, start: int = 0
) -> list[ReuseChunk]:
    """The chunks of at least ``n_min`` tokens of ``cached[start:]`` found in order in
    ``prompt[start:]`` (both sequences agree before ``start``, the common prefix), as
    described above. Chunks are ordered and disjoint in both sequences; none when
    ``n_min`` <= 0. Pure."""
    return list(iter_chunks(cached, prompt, n_min, start))


def iter_chunks(
    cached: Sequence[int], prompt: Sequence[int], n_min: int, start: int = 0
) -> Iterator[ReuseChunk]:
    """``match_chunks``, lazily: a caller that has enough stops the scan there."""
    if n_min <= 0:
        return
    k = min(n_min, KEY)
    idx = _index(cached, start, k)
    c = p = start
    while p + n_min <= len(prompt) and c + n_min <= len(cached):
        found = _lookup(cached, prompt, idx, c, p, k, n_min)
        if found is None:
            p += 1
            continue
        yield found
        c, p = found.cache_start + found.length, p + found.length


def _lookup(
    cached: Sequence[int],
    prompt: Sequence[int],
    idx: dict[tuple[int, ...], list[int]],
    c: int,
    p: int,
    k: int,
    n_min: int,
) -> ReuseChunk | None:
    """The chunk starting at prompt position ``p`` and the earliest cached position >= ``c``
    that agrees for ``n_min`` tokens or more (of the first ``CANDIDATES`` with its key)."""
    positions = idx.get(tuple(prompt[p : p + k]))
    if not positions:
        return None
    i = bisect_left(positions, c)
    for pos in positions[i : i + CANDIDATES]:
        n = _common(cached, pos, prompt, p)
        if n >= n_min:
            return ReuseChunk(pos, p, n)
    return None


def gap_tokens(chunks: Sequence[ReuseChunk], start: int) -> int:
    """Prompt tokens between ``start`` and the end of the last chunk that no chunk covers
    (computed before the chunks are placed)."""
    n, p = 0, start
    for ch in chunks:
        n += ch.prompt_start - p
        p = ch.prompt_start + ch.length
    return n


def select_chunks(
    chunks: Iterable[ReuseChunk], start: int, gapped_min: int, most: int, one_run: bool = False
) -> list[ReuseChunk]:
    """The chunks worth moving, in order, at most ``most`` of them (later ones are left to
    be computed, and ``chunks`` is not read further: a lazy scan stops there).

    A chunk right after the previous kept one (or at ``start``) costs nothing but its move.
    A chunk after a gap costs the slot one more step: the gap is decoded first, and the
    chunk can only join the sequence once its positions are consecutive. It is kept only
    when it saves at least ``gapped_min`` tokens of prompt processing; a chunk dropped
    joins the gap before the next one. So n_cache_reuse 1 against every other token
    substituted keeps nothing (one step per reused token would cost far more than it
    saves), and the steps a placement adds are at most ``most``.

    ``one_run``: the first chunk kept and those right after it only (none after a gap), for
    a memory with a sliding-window cache (see ``CacheReuse.plan``)."""
    out: list[ReuseChunk] = []
    p = start
    if most <= 0:
        return out
    for ch in chunks:
        if ch.prompt_start > p and ch.length < gapped_min:
            continue
        if one_run and out and ch.prompt_start > p:
            break
        out.append(ch)
        p = ch.prompt_start + ch.length
        if len(out) >= most:
            break
    return out


def due_chunks(pending: Sequence[ReuseChunk], cur: int) -> tuple[int, int, int]:
    """For a slot holding ``cur`` tokens with ``pending`` parked chunks (ordered): how many
    of them move in now (those starting at ``cur``, one after another), the token count
    after them, and where the next prompt chunk must end (the next pending chunk's start,
    which the gap before it is decoded up to; -1: no such bound)."""
    n = 0
    while n < len(pending) and pending[n].prompt_start == cur:
        cur += pending[n].length
        n += 1
    nxt = pending[n].prompt_start if n < len(pending) else -1
    return n, cur, nxt


__all__ = ["ReuseChunk", "iter_chunks", "match_chunks", "due_chunks", "gap_tokens", "select_chunks"]
