"""Speculative decoding policy: what a generating slot proposes, and how much of it to try.

A drafting slot adds ``[next_token, d1..dk]`` to the step's batch, all with logits; the engine
then samples row by row and keeps the longest prefix where the sampled token equals the
draft (llama.cpp's ``common_sampler_sample_and_accept_n``). Every kept token was sampled from
the target's own distribution given the tokens before it, so the output is what
non-speculative decoding gives, within the batch-layout drift; rejected rows are removed
from the KV cache.

Draft sources:
- ``ngram-simple`` (llama.cpp's ``common_ngram_simple_draft``): the last ``size_n`` tokens of
  the context (the last one being the token about to be decoded) are looked up backwards in
  the context; the ``size_m`` tokens that followed the latest earlier occurrence are the
  draft. It pays off where the answer repeats the prompt (edits, refactors, extraction).
- ``draft-simple``: a draft model's greedy continuation (``server.speculative.drafter``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SPEC_NONE = "none"
SPEC_NGRAM = "ngram-simple"
SPEC_DRAFT = "draft-simple"
SPEC_IMPLEMENTED = (SPEC_NONE, SPEC_NGRAM, SPEC_DRAFT)


@dataclass(frozen=True)
class SpecConfig:
    """Server-wide speculation settings (llama-server's ``--spec-*`` flags)."""

    kind: str = SPEC_NONE
    n_max: int = 3  # --spec-draft-n-max: draft-model tokens per step
    n_min: int = 0  # --spec-draft-n-min: a shorter draft is not tried
    p_min: float = 0.0  # --spec-draft-p-min: stop drafting below this probability
    ngram_n: int = 12  # --spec-ngram-simple-size-n: lookup n-gram length
    ngram_m: int = 48  # --spec-ngram-simple-size-m: draft m-gram length

    @property
    def enabled(self) -> bool:
        return self.kind != SPEC_NONE

    @property
    def most_drafted(self) -> int:
        """The longest draft one step can carry for one slot."""
        return self.ngram_m if self.kind == SPEC_NGRAM else self.n_max


@dataclass(frozen=True)
class DraftLimits:
    """One request's speculation settings: the server's, narrowed by its own fields."""

    n_max: int
    n_min: int
    p_min: float


def request_limits(cfg: SpecConfig, n_max: int, n_min: int, p_min: float) -> DraftLimits | None:
    """The limits of a request giving ``speculative.n_max/n_min/p_min`` (-1: not given).
    None when the request does not speculate (the server does not, or n_max is 0)."""
    if not cfg.enabled or n_max == 0:
        return None
    top = cfg.most_drafted
    return DraftLimits(
        n_max=top if n_max < 0 else min(n_max, top),
        n_min=cfg.n_min if n_min < 0 else n_min,
        p_min=cfg.p_min if p_min < 0 else p_min,
    )


def draft_room(n_tokens: int, n_ctx: int, n_remaining: int, limits: DraftLimits) -> int:
    """Most draft tokens a slot holding ``n_tokens`` may try (llama-server's
    ``get_n_draft_max``): one position is left free after the sampled token, and a draft
    never overshoots the tokens the request may still generate (``n_remaining`` < 0: no
    limit)."""
    room = min(limits.n_max, n_ctx - n_tokens - 2)
    if n_remaining >= 0:
        room = min(room, n_remaining - 1)
    return max(room, 0)


def ngram_draft(hist: np.ndarray, last: int, size_n: int, size_m: int) -> list[int]:
    """llama.cpp's ngram-simple draft: the tokens that followed the latest earlier
    occurrence of ``hist[-(size_n-1):] + [last]``; empty when there is none, or when fewer
    than ``size_n`` tokens follow it. Vectorized: one comparison pass over the context, then
    one over the candidate windows."""
    cur = hist.size
    if size_n < 1 or cur <= size_n + size_m + 1:
        return []
    pattern = np.empty(size_n, dtype=np.int32)
    pattern[:-1] = hist[cur - size_n + 1 :]
    pattern[-1] = last
    # start positions j in [1, cur - size_n - 1] (0 and the current n-gram excluded)
    hi = cur - size_n
    cands = np.flatnonzero(hist[1:hi] == pattern[0]) + 1
    if cands.size == 0:
        return []
    windows = np.lib.stride_tricks.sliding_window_view(hist, size_n)
    hits = cands[(windows[cands] == pattern).all(axis=1)]
    if hits.size == 0:
        return []
    start = int(hits[-1]) + size_n
    n = min(size_m, cur - start)
    if n < size_n:
        return []
    return hist[start : start + n].tolist()
