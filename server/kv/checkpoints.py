"""When context checkpoints are taken during prefill, and which ones a slot keeps
(docs/ARCHITECTURE.md §6)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from ..types import Checkpoint
from .policy import window_intact

# Why snapshots keep every checkpoint: llama.cpp writes a sequence's sliding-window cells only
# where they are not masked for its last position (llama_kv_cache::state_write), so a state
# saved at length L and restored holds positions >= L - n_swa, whatever the live sequence held.
# It serves a cut only at L itself; every shorter cut needs a checkpoint at or before it.


# Checkpoints closer than this collapse into the newest (the reference keeps 4 tokens between
# its last two prompt checkpoints, which this keeps apart).
NEAR = 4

# A prefill with at most this many tokens left skips the checkpoints near the prompt's end.
SHORT_TAIL = 64


@dataclass
class CheckpointPolicy:
    enabled: bool
    max_per_slot: int = 32
    min_step: int = 8192
    n_ubatch: int = 512

    def applies(self, n_prompt: int) -> bool:
        """Prompts of at most one ubatch take no checkpoints: recomputing one costs a single
        decode, no more than the extra decode that splitting off a checkpoint would cost now."""
        return self.enabled and n_prompt > self.n_ubatch

    def boundaries(self, n_prompt: int, user_start: int, n_start: int = 0) -> list[int]:
        """Prompt positions where a prefill chunk must end so a checkpoint lands there:
        the start of the last user message, and 4 + n_ubatch and 4 tokens before the end.

        ``n_start`` is where this prefill began (the cached tokens). When at most SHORT_TAIL
        tokens are left to compute, the marks near the end are skipped: each costs a decode
        of its own now, while the prompt-end checkpoint serves follow-ups and losing one of
        those marks costs a later cut at most SHORT_TAIL tokens of recompute.
        """
        if not self.applies(n_prompt):
            return []
        marks = {user_start}
        if n_prompt - n_start > SHORT_TAIL:
            marks |= {n_prompt - 4 - self.n_ubatch, n_prompt - 4}
        return sorted(m for m in marks if max(0, n_start) < m < n_prompt)

    def chunk_end(self, cur: int, n_prompt: int, user_start: int, n_start: int = 0) -> int:
        for m in self.boundaries(n_prompt, user_start, n_start):
            if m > cur:
                return m
        return n_prompt

    def wants(
        self,
        cur: int,
        n_prompt: int,
        user_start: int,
        have: list[Checkpoint],
        n_start: int = 0,
        branches: Collection[int] = (),
    ) -> bool:
        """Whether to checkpoint a slot that holds ``cur`` prompt tokens before its next chunk.
        ``branches``: where other prompts branch off this one (prefix sharing's waiters copy
        up to there)."""
        if not self.applies(n_prompt) or cur <= 0 or cur >= n_prompt:
            return False
        if have and have[-1].n_tokens == cur:
            return False
        if cur in self.boundaries(n_prompt, user_start, n_start):
            return True
        last = have[-1].n_tokens if have else 0
        # where this prompt branched off what the slot held (a reused or copied prefix), or
        # where others branch off it: the next prompt that shares the prefix branches there
        # too, and once the window behind it slid away only a checkpoint serves that cut
        if (cur == n_start or cur in branches) and cur - last > SHORT_TAIL:
            return True
        return cur - last >= self.min_step

    def wants_at_prompt_end(self, n_prompt: int, have: list[Checkpoint]) -> bool:
        """Whether to checkpoint a slot that has just decoded its whole prompt (no extra
        decode: the slot holds exactly the prompt before its first generated token).

        The next turn of a conversation extends this prompt and usually diverges in the
        generated tail; once the slot has been snapshotted and restored (RAM cache, slot
        file) only a checkpoint serves that cut. Short prompts get one too: prompt plus
        answer can outgrow the window even when the prompt alone does not.
        """
        return self.enabled and n_prompt > 0 and not (have and have[-1].n_tokens == n_prompt)

    def insert(self, have: list[Checkpoint], c: Checkpoint) -> None:
        """Add ``c``: it replaces checkpoints less than ``NEAR`` tokens below it (a cut there
        loses fewer than NEAR tokens of reuse, each copy costs a window of state), and the
        oldest go first past ``max_per_slot``."""
        have[:] = [x for x in have if not 0 <= c.n_tokens - x.n_tokens < NEAR]
        while have and len(have) >= self.max_per_slot:
            have.pop(0)
        have.append(c)
        have.sort(key=lambda x: x.n_tokens)


def restored_serves(
    n_tokens: int, n_lcp: int, checkpoints: list[Checkpoint] | None, n_swa: int, recurrent: bool
) -> bool:
    """Whether a state saved at ``n_tokens`` tokens, once restored, serves a prompt that
    shares ``n_lcp`` of them (see the top of this module): always with full attention; with
    a window, a cut at its own length (the window behind it intact) or at one of its
    ``checkpoints``. None: not known yet (a file's, until it is read), taken as serving, as
    a file on disk may carry the checkpoint a regenerated answer needs. A RAM entry that
    shares only a system prompt with another conversation serves nothing of it: restoring
    it would only replace what the slot holds."""
    if n_swa <= 0 and not recurrent:
        return True
    if recurrent and n_lcp >= n_tokens:
        return True
    if not recurrent and window_intact(max(0, n_tokens - n_swa), n_lcp, n_swa):
        return True
    return checkpoints is None or any(0 < c.n_tokens <= n_lcp for c in checkpoints)


def file_checkpoints(
    have: list[Checkpoint], n_tokens: int, n_swa: int, recurrent: bool = False
) -> list[Checkpoint]:
    """The checkpoints a slot file carries (ARCHITECTURE §8): at most one, each costing a window of
    state (7.5 MiB for Gemma 3 270M, as much as a third of a 4,000-token slot's state).

    A state saved at length ``n_tokens`` holds positions >= n_tokens - n_swa (see the top of
    this module; a recurrent state only its latest), so a restored slot serves a cut further
    back only from a checkpoint at or before it. The two cuts that follow a restore are the
    next turn (it extends the prompt and diverges in the answer: a cut at or after the
    prompt's end) and a regenerated answer (the same prompt: a cut one token before its
    end). One checkpoint serves both: the oldest of those within SHORT_TAIL tokens of the
    newest, which is the one 4 tokens before the prompt's end (CheckpointPolicy's marks),
    not the prompt-end one, which would save the next turn only those 4 tokens of recompute.
    Older ones (an edited earlier message) are not carried: each costs another window for
    a cut a restored conversation rarely takes. None when the state itself serves that cut
    (a state within one window)."""
    usable = [c for c in have if 0 < c.n_tokens < n_tokens]
    if not usable:
        return []
    newest = usable[-1].n_tokens
    keep = next(c for c in usable if newest - c.n_tokens <= SHORT_TAIL)
    if not recurrent and window_intact(max(0, n_tokens - n_swa), keep.n_tokens, n_swa):
        return []
    return [keep]
