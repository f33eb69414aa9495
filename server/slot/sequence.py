"""A slot's one record of its sequence's tokens, and the counts that describe them.

``tokens`` is what the slot's KV sequence holds, at positions 0..len-1 (the slot store's
invariant: only ``SlotStore`` changes it, through the methods here). The counts describe the
run on it (the current task's, or the last one's while the slot is idle):

- ``n_prompt``: the task's prompt length; ``n_cached``: prompt tokens the KV already held
  (``cache_n``); ``n_computed``: prompt tokens this run decoded (``prompt_n``);
- ``generated``: the answer's tokens; ``n_sampled``: every token sampled, an ending
  end-of-generation token included (``predicted_n``); ``next_token``: the last one sampled,
  not in the KV yet (the token the next step decodes); ``n_forced``: generated tokens before
  it that are not in the KV either (a constraint's forced tokens, engine/executor.py: the next
  step decodes ``pending()``, the last ``n_forced + 1`` generated tokens, in one batch);
  ``n_emitted``: generated tokens sent to the client already.

What the next step decodes, the draft, the n-gram history and ``usage`` are views of this
record, never copies kept in step by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np


class Usage(NamedTuple):
    """A run's token accounting, as ``timings`` and ``usage`` report it."""

    cache_n: int
    prompt_n: int
    predicted_n: int


class RunCounts(NamedTuple):
    """A run's counts and answer, kept while it is preempted (engine/preempt.py)."""

    n_prompt: int
    n_sampled: int
    generated: list[int]
    next_token: int
    n_emitted: int
    n_forced: int = 0


class Sequence:
    __slots__ = (
        "tokens",
        "n_prompt",
        "n_cached",
        "n_computed",
        "n_sampled",
        "generated",
        "next_token",
        "n_forced",
        "n_emitted",
        "_arr",
        "_n_arr",
        "n_reused",
        "n_reuse_chunks",
        "watch",
        "_tell_at",
    )

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.n_prompt = 0
        self.n_cached = 0
        self.n_computed = 0
        self.n_sampled = 0
        self.generated: list[int] = []
        self.next_token = -1
        self.n_forced = 0
        self.n_emitted = 0
        # int32 mirror of tokens[:_n_arr] (the rest is copied in when array() is read)
        self._arr = np.empty(0, dtype=np.int32)
        self._n_arr = 0
        # --cache-reuse: cached tokens of this run moved into place (in n_cached), in chunks
        self.n_reused = 0
        self.n_reuse_chunks = 0
        # told of every change of ``tokens`` (the tokens now, how many leading ones stayed;
        # appends only when they reach the length it returned: one compare per token):
        # the slots' block index (server.prefix.block_index, wired by SlotStore), which tells
        # its listeners (the KV events: kv_events/kv_watch.py); None: none
        self.watch: Callable[[list[int], int], int] | None = None
        self._tell_at = 0  # an append reaching this length is told (the watch returns it)

    # ---- a run -------------------------------------------------------------------

    def start(self, n_prompt: int, n_cached: int) -> None:
        """A task starts on the slot holding ``n_cached`` tokens of its prompt."""
        self.n_prompt, self.n_cached, self.n_computed = n_prompt, n_cached, 0
        self.n_sampled, self.generated, self.next_token, self.n_emitted = 0, [], -1, 0
        self.n_forced = 0
        self.n_reused = self.n_reuse_chunks = 0

    def counts(self) -> RunCounts:
        """What a preempted run takes along (its KV goes to the RAM cache)."""
        return RunCounts(
            self.n_prompt,
            self.n_sampled,
            self.generated,
            self.next_token,
            self.n_emitted,
            self.n_forced,
        )

    def resume(self, c: RunCounts, n_past: int) -> None:
        """A preempted run resumes on this slot, which holds ``n_past`` tokens of it: its
        answer so far comes back; the prompt is accounted as a placement's would be (cache_n:
        the prompt tokens the slot holds again, prompt_n: those it computes from here)."""
        self.n_prompt, self.n_cached, self.n_computed = c.n_prompt, min(n_past, c.n_prompt), 0
        self.n_sampled, self.generated, self.next_token = c.n_sampled, c.generated, c.next_token
        self.n_emitted, self.n_forced = c.n_emitted, c.n_forced
        self.n_reused = self.n_reuse_chunks = 0

    def reused(self, n_tokens: int, n_chunks: int) -> None:
        """--cache-reuse moved ``n_chunks`` chunks of ``n_tokens`` cached tokens into place
        (they count as cached; the gaps between them are computed as prompt tokens)."""
        self.n_cached += n_tokens
        self.n_reused += n_tokens
        self.n_reuse_chunks += n_chunks

    def pending(self) -> list[int]:
        """What the next step decodes: the sampled token and the forced ones before it."""
        if self.n_forced == 0:
            return [self.next_token]
        return self.generated[-1 - self.n_forced :]

    @property
    def usage(self) -> Usage:
        return Usage(self.n_cached, self.n_computed, self.n_sampled)

    @property
    def prompt_done(self) -> bool:
        """The KV holds the whole prompt."""
        return len(self.tokens) >= self.n_prompt

    # ---- the KV's tokens (SlotStore only) ----------------------------------------

    def extend(self, toks: list[int]) -> None:
        n = len(self.tokens)
        self.tokens.extend(toks)
        if self.watch is not None and n + len(toks) >= self._tell_at:
            self._tell_at = self.watch(self.tokens, n)

    def truncate(self, n: int) -> None:
        del self.tokens[n:]
        self._n_arr = min(self._n_arr, n)
        if self.watch is not None:
            self._tell_at = self.watch(self.tokens, n)

    def remove(self, start: int, end: int) -> None:
        """Drop tokens[start:end] (a context shift): those after them move down."""
        del self.tokens[start:end]
        self._n_arr = min(self._n_arr, start)
        if self.watch is not None:
            self._tell_at = self.watch(self.tokens, start)

    def assign(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self._n_arr = 0
        if self.watch is not None:
            self._tell_at = self.watch(tokens, 0)

    def retell(self) -> None:
        """Tell the watch the tokens as they are (a listener joined it: the appends it
        skipped may matter to the newcomer)."""
        if self.watch is not None:
            self._tell_at = self.watch(self.tokens, len(self.tokens))

    def array(self) -> np.ndarray:
        """``tokens`` as an int32 array (a view, valid until the tokens change): only the
        tokens appended since the last read are copied."""
        n = len(self.tokens)
        if n > self._arr.size:
            grown = np.empty(max(n, 2 * self._arr.size, 1024), dtype=np.int32)
            grown[: self._n_arr] = self._arr[: self._n_arr]
            self._arr = grown
        if n > self._n_arr:
            self._arr[self._n_arr : n] = self.tokens[self._n_arr : n]
        self._n_arr = n
        return self._arr[:n]
