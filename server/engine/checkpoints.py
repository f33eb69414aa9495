"""When context checkpoints are taken during prefill, and which ones a slot keeps (DESIGN §6)."""

from __future__ import annotations

from dataclasses import dataclass

from .policy import window_intact
from .slot import Checkpoint


def needed_with_state(have: list[Checkpoint], pos_min: int, n_swa: int) -> list[Checkpoint]:
    """Checkpoints that a snapshot of the whole sequence state does not already serve.

    A state whose lowest position is ``pos_min`` serves any cut at ``c`` with its window
    intact; a checkpoint there adds nothing to a RAM-cache entry or a slot file.
    """
    if n_swa <= 0:
        return list(have)
    return [c for c in have if not window_intact(pos_min, c.n_tokens, n_swa)]


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

    def boundaries(self, n_prompt: int, user_start: int) -> list[int]:
        """Prompt positions where a prefill chunk must end so a checkpoint lands there:
        the start of the last user message, and 4 + n_ubatch and 4 tokens before the end."""
        if not self.applies(n_prompt):
            return []
        marks = {user_start, n_prompt - 4 - self.n_ubatch, n_prompt - 4}
        return sorted(m for m in marks if 0 < m < n_prompt)

    def chunk_end(self, cur: int, n_prompt: int, user_start: int) -> int:
        for m in self.boundaries(n_prompt, user_start):
            if m > cur:
                return m
        return n_prompt

    def wants(self, cur: int, n_prompt: int, user_start: int, have: list[Checkpoint]) -> bool:
        """Whether to checkpoint a slot that holds ``cur`` prompt tokens before its next chunk."""
        if not self.applies(n_prompt) or cur <= 0 or cur >= n_prompt:
            return False
        if have and have[-1].n_tokens == cur:
            return False
        if cur in self.boundaries(n_prompt, user_start):
            return True
        last = have[-1].n_tokens if have else 0
        return cur - last >= self.min_step

    def insert(self, have: list[Checkpoint], c: Checkpoint) -> None:
        """Add ``c``: one checkpoint per n_tokens (the new one replaces), oldest out first."""
        have[:] = [x for x in have if x.n_tokens != c.n_tokens]
        while have and len(have) >= self.max_per_slot:
            have.pop(0)
        have.append(c)
        have.sort(key=lambda x: x.n_tokens)
