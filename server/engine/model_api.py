"""What the service layer and the app need of the loaded model, beyond the engine's
``Backend``: its tokenizer (``server.engine_api.Tokenizer``, a leaf the routes read) and
what it reports about itself (``ModelBackend``). ``server.llama.backend.LlamaBackend``
implements both (checked by ``server.http.app``'s ``_conforms``); the unit tests' fake
implements what they use."""

from __future__ import annotations

from typing import Protocol

from ..engine_api import Tokenizer
from ..kv.draft_kv import DraftMemory
from ..slot.backend_api import Backend
from ..types import FimTokens, VocabCompiler


class ModelBackend(Backend, Tokenizer, Protocol):
    """The loaded model as the HTTP side sees it: the engine's Backend, its tokenizer, and
    what /props, /v1/models, /infill, /rerank and structured output read."""

    n_ctx_train: int
    n_params: int
    model_size: int
    architecture: str
    chat_template: str | None  # the GGUF's template (None: none)
    state_file_version: int  # llama.cpp's LLAMA_STATE_SEQ_VERSION (slot files)

    @property
    def fim(self) -> FimTokens: ...

    def constraint_compiler(self) -> VocabCompiler: ...
    def rerank_parts(self) -> tuple[str | None, int, int, int, bool, bool, bool]: ...
    def warmup(self) -> None: ...
    def close(self) -> None: ...


class DraftModel(DraftMemory, Protocol):
    """A draft model's context (draft-simple) as the server holds it: the engine's
    DraftMemory, closed with the server (before the model it may share)."""

    def close(self) -> None: ...
