"""Wiring of the KV-cache events (--kv-events-endpoint): the publisher, the ledger, the
prefix index's listener (RAM cache, disk tier) and the engine's slot watcher.

Order at load: ``start`` before the disk tier scans its directory (its files are published
as they are indexed) and publishes AllBlocksCleared first; ``attach`` once the engine
exists; ``close_tiers`` at shutdown publishes AllBlocksCleared (the model is unloaded) and sends
what is queued.

Exposure (issue 40): ``check`` refuses, before anything loads, an endpoint that binds
beyond the loopback unless --kv-events-allow-remote confirms it; ``token_policy`` withholds
token ids under --api-key (every block) or --cache-isolation (tenants' blocks) unless
--kv-events-token-ids allows them.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

from ..engine.engine import Engine
from ..kv_events.kv_blocks import BlockHasher
from ..kv_events.kv_events import TOKENS_ALL, TOKENS_NONE, TOKENS_SHARED, KVEvents
from ..kv_events.kv_publisher import KVPublisher, endpoint_problem, normalize_endpoint
from ..kv_events.kv_watch import SlotWatcher, watch_slots
from ..service.state import KVEventsHandle
from ..settings.config import Settings
from ..tiers.disk import DiskTier
from ..tiers.prompt_cache import PromptCache

log = logging.getLogger("server.http.kv_setup")


@dataclass
class KVEventsRuntime:
    publisher: KVPublisher
    events: KVEvents
    watcher: SlotWatcher | None = None


def default_topic(model: str) -> str:
    """vLLM's and llm-d's topic shape: ``kv@<pod>@<model>``."""
    return f"kv@{socket.gethostname()}@{model}"


def check(s: Settings) -> str:
    """Why the KV-event flags cannot start ("" when they can): an endpoint that binds
    beyond the loopback without --kv-events-allow-remote."""
    if not s.kv_events_endpoint or s.kv_events_allow_remote:
        return ""
    return endpoint_problem(normalize_endpoint(s.kv_events_endpoint))


def token_policy(s: Settings) -> str:
    """Whose token ids the events carry (kv_events/kv_events.py): all of them unless prompts are
    private: none under --api-key, none of a tenant's under --cache-isolation."""
    if s.kv_events_token_ids:
        return TOKENS_ALL
    if s.api_key or s.api_key_file:
        return TOKENS_NONE
    return TOKENS_SHARED if s.cache_isolation != "none" else TOKENS_ALL


def start(s: Settings, model: str, cache: PromptCache | None) -> KVEventsRuntime | None:
    """The publisher bound and started, AllBlocksCleared queued, and the RAM cache's prefix
    index (shared with the disk tier) reporting to the ledger. None when the events are off.
    Raises when the endpoint cannot be bound, or may not be (``check``)."""
    if not s.kv_events_endpoint:
        return None
    problem = check(s)
    if problem:
        raise RuntimeError(f"--kv-events-endpoint: {problem}")
    endpoint = normalize_endpoint(s.kv_events_endpoint)
    topic = s.kv_events_topic or default_topic(model)
    pub = KVPublisher(endpoint, topic)
    pub.start()
    tokens = token_policy(s)
    events = KVEvents(BlockHasher(s.kv_block_size, model), pub.publish, tokens)
    events.cleared()
    if cache is not None:
        # KVEvents hashes token ids, the index holds prompt items (images too): a gap the
        # type shows (cache: Any hid it), left to the images work
        cache.index.listener = events  # type: ignore[assignment]
    log.info(
        "KV events on %s, topic %r, blocks of %d tokens, token ids: %s",
        endpoint,
        topic,
        s.kv_block_size,
        tokens,
    )
    return KVEventsRuntime(pub, events)


def attach(rt: KVEventsHandle | None, engine: Engine) -> None:
    """The engine reports its slots' sequences after each step."""
    if rt is None:
        return
    rt.watcher = watch_slots(rt.events, engine.store.blocks, engine.slots)
    engine.kv_watch = rt.watcher


def close_tiers(disk: DiskTier | None, rt: KVEventsHandle | None) -> None:
    """At shutdown, after the engine stopped: the disk tier closes; then, the model being
    unloaded, AllBlocksCleared is published, the queue sent and the socket closed."""
    if disk is not None:
        disk.close()
    if rt is None:
        return
    rt.events.cleared()
    rt.publisher.close()
