"""What the routes share (ServerState), whose cached prefixes a request may reuse
(``tenant_of``) and its image work's scope (``media_scope_of``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from starlette.requests import Request

from ..engine.engine import Engine
from ..engine.model_api import DraftModel, ModelBackend
from ..image_types import ImageProjector
from ..kv_events.kv_events import KVEvents
from ..kv_events.kv_publisher import KVPublisher
from ..kv_events.kv_watch import SlotWatcher
from ..media.media_scope import MediaScope, key_pixels, request_pixels
from ..schemas.errors import APIError
from ..settings.config import Settings
from ..templates.chat_template import ChatTemplate
from ..tiers import tenancy
from ..tiers.prompt_cache import PromptCache
from .adapters import AdapterRegistry
from .stream_buffers import StreamLimits, StreamRegistry


class Metrics(Protocol):
    """The server's metrics as the routes and the engine see them (server.http.metrics'
    ServerMetrics implements it)."""

    def observe(self, what: str, value: float) -> None:
        """An engine observation (engine thread)."""
        ...

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        ...


class KVEventsHandle(Protocol):
    """The KV-cache events while a model is loaded (--kv-events-endpoint;
    server.http.kv_setup's KVEventsRuntime, which this layer may not import): the publisher
    (/metrics reads its counters), the ledger, and the engine's slot watcher once attached."""

    publisher: KVPublisher
    events: KVEvents
    watcher: SlotWatcher | None


@runtime_checkable
class KeptModel(Protocol):
    """A model that sleeps at level 1 (server.llama.backend.LlamaBackend): its context freed
    and the model kept, then a new context opened on it, or the whole closed."""

    def free_context(self) -> None: ...
    def open_context(self) -> None: ...
    def close(self) -> None: ...


class NoMetrics:
    """Metrics before the app set its own (unit tests build a bare ServerState)."""

    def observe(self, what: str, value: float) -> None:
        return None

    def exposition(self) -> bytes:
        return b""


@dataclass
class ServerState:
    """What the routes share: settings, and once loaded the model, engine and chat template.

    ``loading`` is true until the loader thread finished, successfully or not; on failure
    ``load_error`` says why and ``engine`` stays None."""

    settings: Settings
    backend: ModelBackend | None = None
    # the draft model's context (draft-simple), owned like ``backend``
    draft: DraftModel | None = None
    engine: Engine | None = None
    template: ChatTemplate | None = None
    projector: ImageProjector | None = None  # --mmproj (server.llama.mtmd.Projector)
    model_name: str = ""
    model_aliases: list[str] = field(default_factory=list)  # --alias a,b,c (sorted)
    model_path: str = ""
    # LoRA adapters and their global scales (--lora..., /lora-adapters; service/adapters.py)
    adapters: AdapterRegistry = field(default_factory=lambda: AdapterRegistry([]))
    loading: bool = True
    load_error: str = ""
    on_load_failed: Callable[[], None] | None = None  # set by the CLI: stop serving
    metrics: Metrics = field(default_factory=NoMetrics)
    kv_events: KVEventsHandle | None = None  # --kv-events-endpoint
    started: float = field(default_factory=time.time)
    # Set on SIGTERM (time.monotonic): running requests may finish until then; the rest end
    # with an error event (streams) or a 503.
    drain_deadline: float | None = None
    # --sleep-idle-seconds (server.http.model_sleep): while sleeping there is no backend or
    # engine; /props and /metrics answer from what they said just before
    sleeping: bool = False
    sleep_props: dict[str, object] = field(default_factory=dict)
    sleep_metrics: bytes = b""
    # POST /sleep?level=1 without a disk tier: the RAM cache (the slots saved into it) kept
    # across the sleep; the next load serves from it. None otherwise.
    kept_cache: PromptCache | None = None
    # POST /sleep?level=1: the model with its context freed; the next load opens a new
    # context on it. None otherwise.
    kept_backend: KeptModel | None = None
    # resumable streams (X-Conversation-Id): create_app sizes it from the flags
    streams: StreamRegistry = field(default_factory=lambda: StreamRegistry(StreamLimits()))

    def require_backend(self) -> ModelBackend:
        """The loaded model, or an APIError 503 while there is none (loading, asleep, or
        its load failed)."""
        if self.backend is None:
            raise APIError(503, "Loading model", "unavailable_error")
        return self.backend

    def require_engine(self) -> Engine:
        """The running engine, or an APIError 503 saying why there is none."""
        if self.loading:
            raise APIError(503, "Loading model", "unavailable_error")
        if self.engine is None or not self.engine.alive:
            raise APIError(
                503,
                "the engine is not running: " + (self.load_error or "it stopped"),
                "unavailable_error",
            )
        return self.engine


def tenant_of(st: ServerState, request: Request | None, cache_salt: str | None = None) -> str:
    """Whose cached prefixes a request may reuse (--cache-isolation; names: tiers/tenancy.py):

    - ``none``: everyone's, except that a ``cache_salt`` keeps a request to its salt's;
    - ``key``: its API key's (and, within it, its salt's);
    - ``salt``: its salt's; a request without one shares with nobody, ever: it gets a fresh
      random tenant that no other request, process or replica can hold, and that is never
      written to disk.

    Key and salt tenants are digests, the same in every process (restarts, replicas).
    """
    mode = st.settings.cache_isolation
    salt = tenancy.salt_tenant(cache_salt) if cache_salt else ""
    if mode == "key":
        key = getattr(getattr(request, "state", None), "api_key_id", "")
        return f"key:{key}" + (f"/{salt}" if salt else "")
    if mode == "salt" and not salt:
        return tenancy.private_tenant()
    return salt


def media_scope_of(st: ServerState, request: Request | None, tenant: str) -> MediaScope:
    """The scope of a hand-off of ``request``'s preparation (server.media.media_scope):
    ``tenant``'s image caches (``tenant_of``, without its adapter set: an image's
    embeddings do not depend on it), its API key's in-flight pixels ("" without keys: all
    clients share one budget), and the pixel budgets of the flags."""
    s = st.settings
    per_request = request_pixels(s.image_max_pixels, s.image_max_request_pixels)
    return MediaScope(
        tenant=tenant,
        key=str(getattr(getattr(request, "state", None), "api_key_id", "") or ""),
        request_pixels=per_request,
        key_pixels=key_pixels(per_request, s.image_max_key_pixels),
    )
