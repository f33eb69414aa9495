"""Cell-level audits of the KV cache against the slots' token lists (pure functions).

The slot store's invariant is "a slot's tokens are exactly what the KV cache holds for its
sequence". Positions alone (pos_min / pos_max) cannot prove it: a crafted state can hold
thousands of cells at repeated positions, which the slot would never account for and which
no clear of "its" tokens would free. These checks count cells:

- the full-attention cache holds, for each slot, exactly one cell per position 0..n-1;
- the sliding-window cache holds, for each slot, distinct positions within 0..n-1 (and the
  last one), and when a state is loaded, the window the next token attends to;
- no cell belongs to a sequence that is not a slot, but for the --cache-reuse scratch
  sequence's parked chunks, exactly where they are parked.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from ..llama.ggml_types import cache_type_name
from ..types import CacheCells
from .policy import window_intact


def _describe(pos: list[int]) -> str:
    return f"{len(pos)} cells" + (f" at {min(pos)}..{max(pos)}" if pos else "")


def _full_problem(pos: list[int], n: int) -> str | None:
    if len(pos) != n or len(set(pos)) != n or (n and (min(pos) != 0 or max(pos) != n - 1)):
        return f"the full cache holds {_describe(pos)} for {n} tokens"
    return None


def _swa_problem(pos: list[int], n: int, n_swa: int, loading: bool) -> str | None:
    if len(set(pos)) != len(pos):
        return f"the window cache holds repeated positions ({_describe(pos)})"
    if not pos:
        return None if n == 0 else f"the window cache holds no cells for {n} tokens"
    if min(pos) < 0 or max(pos) != n - 1:
        return f"the window cache holds {_describe(pos)} for {n} tokens"
    if loading and n_swa > 0 and not window_intact(min(pos), n, n_swa):
        return f"the window cache starts at {min(pos)}, after the window of token {n}"
    if loading and max(pos) - min(pos) + 1 != len(pos):
        return f"the window cache holds {_describe(pos)}, not one run of positions"
    return None


def seq_state_problem(caches: Sequence[CacheCells], n: int, n_swa: int) -> str | None:
    """Why a one-sequence state (read from its bytes before loading) cannot be the KV of
    ``n`` tokens at positions 0..n-1; None when it can."""
    for c in caches:
        pos = c.pos
        problem = _full_problem(pos, n) if c.kind == "full" else _swa_problem(pos, n, n_swa, True)
        if problem:
            return problem
    return None


def kv_problems(
    caches: Sequence[CacheCells],
    n_tokens: Sequence[int | None],
    others: Mapping[int, Sequence[int]] | None = None,
    window_slides: bool = False,
) -> list[str]:
    """Cell-count problems of a whole KV cache: ``n_tokens[s]`` is slot s's token count, or
    None for a slot whose tokens are changing (a decode in flight) and so not checked.
    ``others``: sequences beyond the slots and the positions they hold, one cell each (the
    --cache-reuse scratch sequence's parked chunks). ``window_slides``: the window cache is
    smaller than the context (``Backend.window_cache_slides``), so none of its cells may
    belong to several sequences (llama.cpp would never reuse them; SlotStore.copy_prefix)."""
    problems: list[str] = []
    extra = others or {}
    for c in caches:
        by_seq: dict[int, list[int]] = defaultdict(list)
        for p, seqs in zip(c.pos, c.seqs, strict=True):
            for s in seqs:
                by_seq[s].append(p)
        for s in sorted(by_seq):
            if s in extra:
                problems += _other_problems(s, sorted(by_seq[s]), extra[s], c.kind)
            elif not 0 <= s < len(n_tokens):
                problems.append(f"{len(by_seq[s])} {c.kind}-cache cells belong to no slot")
        shared = sum(len(seqs) > 1 for seqs in c.seqs) if c.kind == "swa" and window_slides else 0
        if shared:
            problems.append(f"{shared} swa-cache cells belong to several sequences")
        for s, n in enumerate(n_tokens):
            if n is None:
                continue
            pos = by_seq.get(s, [])
            if c.kind == "full":
                problem = _full_problem(pos, n)
            else:
                problem = _swa_problem(pos, n, 0, False)
            if problem:
                problems.append(f"slot {s}: {problem}")
    return problems


def _other_problems(seq: int, got: list[int], want: Sequence[int], kind: str) -> list[str]:
    """A non-slot sequence holds one cell at each position it should (a window cache may
    have dropped some; none at another position either way)."""
    exact = sorted(want)
    if got == exact or (kind != "full" and len(set(got)) == len(got) and set(got) <= set(exact)):
        return []
    return [f"sequence {seq}: the {kind} cache holds {_describe(got)}, expected {len(exact)}"]


def kv_type_problem(caches: Sequence[CacheCells], want: tuple[int, int] | None) -> str | None:
    """Why a state's K/V rows (the ggml types llama.cpp records per layer) cannot load into a
    context whose cache types are ``want`` (K, V); None when they can, when ``want`` is
    unknown, or when the state holds no rows. A state of other types has other row sizes:
    llama.cpp refuses it too, but it is refused here first, with the types named."""
    if want is None:
        return None
    for c in caches:
        for what, got, w in (("K", c.k_types, want[0]), ("V", c.v_types, want[1])):
            if got and got != {w}:
                names = ",".join(cache_type_name(t) for t in sorted(got))
                return f"its {what} cache type is {names}, this server's is {cache_type_name(w)}"
    return None
