"""What the HTTP side knows of the engine, and nothing more (ARCHITECTURE §2.2): the model's
tokenizer (``Tokenizer``), and the values the engine thread hands over: snapshots made
between two steps (``SlotSnapshot``, ``CacheView``, ``IntegrityReport``) and a prompt's
embedding (``EmbedResult``).

A leaf. The engine fills these and the routes read them, so neither side imports the other
for them: the routes ask through ``server.service`` (``service/engine_views.py`` for the
snapshots, ``service/embedding_runs.py`` for embeddings), which submits the engine's
commands and tasks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .json_value import JsonObject
from .task import Task


class Tokenizer(Protocol):
    """The model's vocabulary as the front end tokenizes and detokenizes with it. Calls may
    come from any thread (worker threads tokenize requests); they read only the vocabulary,
    never the context."""

    n_vocab: int
    bos_id: int
    bos_text: str  # "" when the vocabulary has no BOS
    eos_text: str

    @property
    def add_bos(self) -> bool: ...

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = True
    ) -> list[int]: ...
    def token_to_piece(self, token: int, special: bool = False) -> bytes: ...
    def detokenize(self, tokens: list[int]) -> str: ...
    def eog_tokens(self) -> tuple[int, ...]:
        """Every end-of-generation token (``ignore_eos`` bans them)."""
        ...


@dataclass(frozen=True)
class SlotSnapshot:
    """One slot as it stood between two engine steps (GET /slots). ``task``: the task it
    runs (None when idle); ``owner``: the tenant its tokens belong to; the counts are the
    running run's, or the last one's when idle (0 before the first)."""

    id: int
    n_ctx: int
    state: str  # SlotState's value
    task: Task | None
    owner: str
    n_tokens: int
    n_prompt: int
    n_cached: int
    n_processed: int
    n_decoded: int
    checkpoint_tokens: tuple[int, ...]
    checkpoint_bytes: int
    draft_tokens: int  # the tokens of the draft model's sequence it shares (0: none)

    @property
    def idle(self) -> bool:
        return self.state == "idle"


@dataclass(frozen=True)
class CacheView:
    """What GET /cache shows: the RAM cache's and the disk tier's descriptions (``disk``:
    ``{"enabled": False}`` without one) and --cache-idle-slots."""

    ram: JsonObject
    disk: JsonObject
    idle_slots: bool


@dataclass(frozen=True)
class IntegrityReport:
    """The engine's, the RAM cache's and the disk tier's integrity problems (none: ok)."""

    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class EmbedResult:
    """One prompt's embeddings: one pooled row (pooling rank: the scores), or with pooling
    none one row per prompt token. Not normalized."""

    index: int
    vectors: np.ndarray  # float32, shape (rows, width)
    n_tokens: int


def too_large(n_tokens: int, n_ubatch: int) -> str:
    """llama-server's message for a prompt that does not fit one physical batch (the
    embedding routes check it before submitting, the engine again)."""
    return (
        f"input ({n_tokens} tokens) is too large to process. increase the physical batch "
        f"size (current batch size: {n_ubatch})"
    )
