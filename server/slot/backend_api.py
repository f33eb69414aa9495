"""What the engine needs from llama.cpp: ``server.llama.backend.LlamaBackend``, or a fake in
the unit tests (``tests.fake_backend.FakeBackend``). Implementations are called from the
engine thread only.

The protocol is complete: the engine and its helpers (every engine-side folder) use no member that
is not declared here, and never probe with ``getattr``. Both implementations are checked
against it, statically (``server.http.app``'s ``_conforms``, the type checker of
``./test.sh``) and at run time (``tests/unit/test_backend_protocol.py``)."""

from __future__ import annotations

import mmap
from concurrent.futures import Executor
from typing import Any, Protocol

import numpy as np

from ..task import SamplingParams, TokenLogprob
from ..tiers.saved import FileBuf
from ..types import CacheCells, StateBuf, TokenMatcher


class SamplerHandle(Protocol):
    """A task's sampler as the engine holds it (``Backend.new_sampler`` makes it, the
    backend's own type: server.llama.backend.Sampler, the fake's FakeSampler); the engine
    hands it back to the backend's sampling calls and frees it when the task ends."""

    def free(self) -> None: ...


class Batch(Protocol):
    """The decode batch the engine fills (server.llama.backend.LlamaBatch)."""

    @property
    def n(self) -> int:
        """Tokens in the batch."""
        ...

    def clear(self) -> None: ...
    def add_span(self, tokens: list[int], pos0: int, seq: int, logits_last: bool) -> int: ...
    def add_tokens(self, tokens: list[int], pos: list[int], seqs: list[int]) -> int: ...
    def outputs_all(self) -> None: ...


class SeqMemory(Protocol):
    """A context's sequences: memory edits and state bytes (server.llama.memory.SeqMemory),
    for the target context and a draft model's alike."""

    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> bool: ...
    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None: ...
    def seq_pos_min(self, seq: int) -> int: ...
    def seq_pos_max(self, seq: int) -> int: ...
    def seq_clear(self, seq: int) -> None: ...
    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None: ...
    def state_size(self, seq: int, partial: bool = False) -> int: ...
    def state_get(self, seq: int, partial: bool = False, size: int | None = None) -> StateBuf: ...
    def state_get_into(self, seq: int, buf: FileBuf, size: int) -> int:
        """Copy the state (``size`` bytes, ``state_size``) into the start of ``buf``; the
        bytes copied, 0 on failure."""
        ...

    def state_set(
        self, seq: int, data: StateBuf, partial: bool = False, nbytes: int | None = None
    ) -> int: ...
    def state_cells(
        self, data: StateBuf | bytes | mmap.mmap | memoryview, nbytes: int, start: int = 0
    ) -> tuple[list[CacheCells], int] | None:
        """Reads ``data`` only: any buffer of state bytes (a file's, a cache entry's)."""
        ...

    def kv_cells(self) -> list[CacheCells] | None: ...

    # the caches a sequence's state holds, in llama.cpp's order ("full", "swa": a sliding
    # window cache, full-size under --swa-full); None: recurrent memory
    kv_kinds: tuple[str, ...] | None

    @property
    def can_shift(self) -> bool:
        """llama_memory_can_shift: whether ``seq_add`` may move positions (else it aborts)."""
        ...

    @property
    def kv_type_ids(self) -> tuple[int, int] | None:
        """The ggml types of the K and V caches (server.llama.ggml_types); None: unknown,
        and a state's types are not checked."""
        ...


class Backend(SeqMemory, Protocol):
    """What the engine needs from llama.cpp (server.llama.backend.LlamaBackend, or a fake)."""

    n_ctx: int
    n_ctx_slot: int
    n_batch: int
    n_ubatch: int
    n_seq: int
    scratch_seq: int  # --cache-reuse's extra sequence id (-1: none; engine/cache_reuse.py)
    n_swa: int
    n_vocab: int
    kv_unified: bool
    is_recurrent: bool
    # the sliding-window cache is smaller than the context: cells that slid out of a window
    # are reused, and only those one sequence owns (llama.cpp's find_slot)
    window_cache_slides: bool

    @property
    def batch(self) -> Batch:
        """The one decode batch (read-only: implementations hold their own batch type)."""
        ...

    backend_sampling: bool  # -bs: attach_sampler may put chains in the decode graph

    def decode(self, start: int, count: int) -> int: ...
    def decode_image(self, seq: int, pos0: int, embd: np.ndarray, non_causal: bool) -> int:
        """Decode an image's embeddings (rows of ``embd``) into ``seq`` at positions
        pos0..; llama_decode's status (the runner's only, as ``decode``)."""
        ...

    def set_adapters(self, scales: tuple[float, ...]) -> None:
        """The LoRA scales (one per loaded adapter; empty: none) the next decodes run under:
        llama.cpp applies them to every sequence of a decode (server.llama.lora)."""
        ...

    def new_sampler(self, p: SamplingParams, history: list[int]) -> SamplerHandle: ...
    def sample(self, sampler: Any, idx: int) -> int: ...
    def attach_sampler(self, sampler: Any, seq: int) -> bool: ...
    def sample_many(self, items: list[tuple[Any, int]], pool: Executor | None) -> list[int]: ...
    def sample_constrained(
        self, sampler: Any, idx: int, matcher: TokenMatcher, full_mask: bool = False
    ) -> int: ...
    def accept_forced(self, sampler: Any, token: int) -> None:
        """``token`` joins the answer without being sampled (a constraint forced it): the
        chain's stages that remember tokens (penalties, DRY) see it, as a sampled one."""
        ...

    def top_logprobs(self, idx: int, token: int, n: int) -> TokenLogprob: ...
    def sampled_logprobs(self, sampler: Any, idx: int, token: int, n: int) -> TokenLogprob: ...
    def token_to_piece(self, token: int, special: bool = False) -> bytes: ...
    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = True
    ) -> list[int]: ...
    def is_eog(self, token: int) -> bool: ...

    @property
    def add_bos(self) -> bool:
        """Whether the vocabulary starts a text with BOS (a context shift keeps it)."""
        ...

    # embeddings (--embedding; server.engine.embed)
    pooling: int  # the context's llama_pooling_type (0: none, a row per token); -1: off

    def set_embeddings(self, on: bool) -> None: ...
    def embedding_of_seq(self, seq: int) -> np.ndarray | None: ...
    def embedding_rows(self, start: int, count: int) -> np.ndarray | None: ...
