"""Prometheus metrics (prometheus-client). llama-server's ``llamacpp:*`` names for existing
dashboards, plus ``llamaslot_*`` metrics it lacks (latency histograms, RAM cache, slots).

Scrapes read the engine's counters without taking any lock the engine step holds: the engine
thread writes plain ints/floats, the collector reads them (atomic under the GIL).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sized
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from ..engine.engine import Engine
    from ..settings.config import Settings
    from ..slot.slot import Slot
    from ..slot.stats import EngineStats
    from ..tiers.disk import DiskTier
    from ..tiers.prompt_cache import PromptCache

# The endpoint labels of llamaslot_requests_total. Any other path counts as "other": a label
# per path a client sends would let scanners grow the metric without bound.
KNOWN = {
    "/v1/completions",
    "/completions",
    "/v1/chat/completions",
    "/v1/completions/render",
    "/v1/chat/completions/render",
    "/chat/completions",
    "/completion",
    "/tokenize",
    "/debug/integrity",
    "/detokenize",
    "/health",
    "/v1/health",
    "/props",
    "/slots",
    "/metrics",
    "/cache",
    "/v1/models",
    "/models",
    "/v1/stream",
    "/v1/streams/lookup",
}


def endpoint_label(path: str) -> str:
    """The endpoint label a request path counts under: itself if known, ``/slots/{id}`` for
    any slot action, else ``other``."""
    if path.startswith("/slots/"):
        return "/slots/{id}"
    return path if path in KNOWN else "other"


class MetricsSource(Protocol):
    """What the collector reads of the server state (server.service.state.ServerState; this
    module may not import it). ``kv_events`` and ``adapters`` are read with getattr: a bare
    state in the unit tests may lack them."""

    @property
    def engine(self) -> Engine | None: ...
    @property
    def model_name(self) -> str: ...
    @property
    def settings(self) -> Settings: ...
    @property
    def streams(self) -> _Streams: ...


class _StreamCounts(Protocol):
    """The resumable streams' counters (server.service.stream_buffers.StreamStats)."""

    opened: int
    replays: int
    stopped: int
    expired: int
    expired_running: int
    refused: int
    events_dropped: int


class _Streams(Protocol):
    """The resumable streams (server.service.stream_buffers.StreamRegistry)."""

    @property
    def stats(self) -> _StreamCounts: ...
    @property
    def sessions(self) -> Sized: ...
    def generating(self) -> int: ...
    def buffered_bytes(self) -> int: ...


class _Adapter(Protocol):
    """A loaded LoRA adapter (server.service.adapters.Adapter)."""

    @property
    def alias(self) -> str | None: ...
    @property
    def path(self) -> str: ...


LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _llamacpp(engine: Engine, slots: list[Slot]) -> Iterator[Metric]:
    """llama-server's metrics, with its names and meanings (dashboards built for it work)."""
    st = engine.stats
    yield _counter(
        "llamacpp:prompt_tokens",
        "Number of prompt tokens processed, excluding cached tokens",
        st.prompt_tokens_total,
    )
    yield _counter(
        "llamacpp:prompt_tokens_cached",
        "Number of prompt tokens reused from the cache",
        st.prompt_tokens_cached_total,
    )
    yield _counter(
        "llamacpp:prompt_seconds",
        "Total time spent processing prompts",
        st.prompt_seconds_total,
    )
    yield _counter(
        "llamacpp:tokens_predicted",
        "Number of generation tokens processed",
        st.tokens_predicted_total,
    )
    yield _counter(
        "llamacpp:tokens_predicted_seconds",
        "Total time spent generating tokens",
        st.tokens_predicted_seconds_total,
    )
    yield _counter("llamacpp:n_decode", "Total number of llama_decode() calls", st.n_decode_total)
    yield _gauge(
        "llamacpp:n_tokens_max",
        "Largest observed sequence length (prompt + generation)",
        st.n_tokens_max,
    )
    pps = st.prompt_tokens_total / st.prompt_seconds_total if st.prompt_seconds_total > 0 else 0.0
    dps = (
        st.tokens_predicted_total / st.tokens_predicted_seconds_total
        if st.tokens_predicted_seconds_total > 0
        else 0.0
    )
    yield _gauge("llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s", pps)
    yield _gauge(
        "llamacpp:predicted_tokens_seconds", "Average generation throughput in tokens/s", dps
    )
    yield _gauge(
        "llamacpp:requests_processing",
        "Number of requests processing",
        sum(1 for s in slots if s.task is not None),
    )
    yield _gauge("llamacpp:requests_deferred", "Number of requests deferred", len(engine.waiting))
    yield _gauge(
        "llamacpp:n_busy_slots_per_decode",
        "Average number of busy slots per llama_decode() call",
        st.n_busy_slots_total / max(1, st.n_decode_total),
    )


def _labelled(name: str, doc: str, labels: dict[str, str], value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=list(labels))
    g.add_metric(list(labels.values()), value)
    return g


def _protocol(state: MetricsSource, engine: Engine, slots: list[Slot]) -> Iterator[Metric]:
    """The model-server protocol's metrics (GIE 003), with vLLM's names and meanings, so
    llm-d's router reads this server as it reads vLLM: queued and running requests, the
    share of the context's cells that hold a slot's sequence (0-1; cells shared by two
    slots through seq_cp count twice, so it errs high), and the block geometry."""
    who = {"model_name": state.model_name, "engine": "0"}
    running = sum(1 for s in slots if s.task is not None)
    yield _labelled(
        "vllm:num_requests_running", "Number of requests in model execution batches", who, running
    )
    yield _labelled(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed",
        who,
        engine.queue_depth(),
    )
    n_ctx = max(1, int(engine.b.n_ctx))
    used = min(1.0, sum(len(s.tokens) for s in slots) / n_ctx)
    yield _labelled(
        "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", who, used
    )
    bs = int(state.settings.kv_block_size)
    info = {"engine": "0", "block_size": str(bs), "num_gpu_blocks": str(n_ctx // bs)}
    yield _labelled("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", info, 1.0)
    yield from _lora_info(state, engine, slots)
    kv = getattr(state, "kv_events", None)
    if kv is not None:
        pub = kv.publisher
        yield _counter("llamaslot_kv_events_sent", "KV-event batches sent", pub.sent)
        yield _counter(
            "llamaslot_kv_events_dropped",
            "KV-event batches dropped (queue full or ZMQ high-water mark): subscribers see a "
            "gap in the sequence numbers",
            pub.dropped,
        )


def _adapter_names(adapters: list[_Adapter], scales: tuple[float, ...]) -> set[str]:
    """The adapters a task runs under (a non-zero scale), by alias or file name."""
    return {
        a.alias or os.path.basename(a.path)
        for a, scale in zip(adapters, scales, strict=False)
        if scale != 0.0
    }


def _lora_info(state: MetricsSource, engine: Engine, slots: list[Slot]) -> Iterator[Metric]:
    """vLLM's ``vllm:lora_requests_info`` (with --lora): the adapters of running and of
    waiting requests as comma-separated labels, the value the time of the reading (as
    vLLM's); llm-d's LoRA-affinity scorer reads it. Absent without adapters."""
    adapters = list(getattr(getattr(state, "adapters", None), "adapters", []))
    if not adapters:
        return
    running: set[str] = set()
    for s in slots:
        if s.task is not None:
            running |= _adapter_names(adapters, s.task.lora)
    try:
        queued = list(engine.waiting)
    except RuntimeError:  # the engine changed the queue while it was read: none this time
        queued = []
    waiting: set[str] = set()
    for t in queued:
        waiting |= _adapter_names(adapters, t.lora)
    labels = {
        "max_lora": str(len(adapters)),
        "running_lora_adapters": ",".join(sorted(running)),
        "waiting_lora_adapters": ",".join(sorted(waiting)),
    }
    yield _labelled(
        "vllm:lora_requests_info", "Running stats on lora requests.", labels, time.time()
    )


def _reuse(st: EngineStats) -> Iterator[Metric]:
    """--cache-reuse: cached tokens, and chunks, moved into place instead of recomputed."""
    yield _counter(
        "llamaslot_cache_reuse_tokens",
        "Cached prompt tokens moved into place by --cache-reuse (not recomputed)",
        st.cache_reuse_tokens,
    )
    yield _counter(
        "llamaslot_cache_reuse_chunks",
        "Chunks moved into place by --cache-reuse",
        st.cache_reuse_chunks,
    )


def _images(st: EngineStats, state: MetricsSource) -> Iterator[Metric]:
    """Images (issue 42): decoded into slots, image positions computed vs served cached,
    and the projector's embedding cache (encodes, hits), when a projector is loaded."""
    yield _counter("llamaslot_images_decoded", "Images decoded into slots", st.images_decoded)
    yield _counter(
        "llamaslot_image_tokens_computed",
        "Image positions decoded from embeddings",
        st.image_tokens_computed,
    )
    yield _counter(
        "llamaslot_image_tokens_cached",
        "Image positions a prompt found in the KV cache already (not decoded again)",
        st.image_tokens_cached,
    )
    projector = getattr(state, "projector", None)
    cache = getattr(projector, "cache", None)
    if cache is None:
        return
    c = cache.counters
    yield _counter("llamaslot_images_encoded", "Images encoded by the projector", c.encoded)
    yield _counter(
        "llamaslot_image_encode_seconds", "Time spent encoding images", c.encode_ms / 1e3
    )
    yield _counter(
        "llamaslot_image_embedding_cache_hits",
        "Image embedding lookups the embedding cache served (not encoded again; an image "
        "prompt's head, tokenized to find its last user turn, looks its images up too)",
        c.hits,
    )
    yield _gauge(
        "llamaslot_image_embedding_cache_bytes", "Bytes of the embedding cache", cache.nbytes
    )
    yield _counter(
        "llamaslot_image_files_decoded",
        "Images decoded from their bytes (a re-sent image whose embeddings the request's "
        "tenant has cached is not)",
        c.decoded,
    )
    yield _counter(
        "llamaslot_image_pixels_decoded",
        "Pixels of the images decoded from their bytes",
        c.pixels_decoded,
    )


def _beyond(st: EngineStats) -> Iterator[Metric]:
    """Engine counters llama-server lacks: cancellations, checkpoints, slot files, sharing."""
    yield _counter(
        "llamaslot_cancelled_prompt_tokens",
        "Prompt tokens processed for requests that were cancelled or failed "
        "(not in llamacpp:prompt_tokens_total)",
        st.cancelled_prompt_tokens_total,
    )
    yield _counter(
        "llamaslot_cancelled_predicted_tokens",
        "Tokens generated for requests that were cancelled or failed",
        st.cancelled_predicted_tokens_total,
    )
    yield _counter(
        "llamaslot_checkpoints_created", "Context checkpoints created", st.checkpoints_created
    )
    yield _counter(
        "llamaslot_checkpoints_restored",
        "Context checkpoints restored",
        st.checkpoints_restored,
    )
    yield from _reuse(st)
    yield _counter(
        "llamaslot_decode_seconds", "Time spent inside llama_decode", st.decode_seconds_total
    )
    yield _counter(
        "llamaslot_engine_step_seconds",
        "Time spent in engine steps that decoded",
        st.step_seconds_total,
    )
    yield _counter(
        "llamaslot_kv_exhausted",
        "Requests ended with an error because the KV cache had no room for their next token",
        st.kv_exhausted,
    )
    yield _counter("llamaslot_slot_files_saved", "Slot files saved", st.slot_saves)
    yield _counter("llamaslot_slot_files_restored", "Slot files restored", st.slot_restores)
    yield _counter(
        "llamaslot_slot_file_failures",
        "Slot file saves or restores that failed",
        st.slot_file_failures,
    )
    yield _counter(
        "llamaslot_slot_file_bytes_written",
        "Bytes written to slot files",
        st.slot_bytes_written,
    )
    yield _counter(
        "llamaslot_slot_file_bytes_read", "Bytes read from slot files", st.slot_bytes_read
    )
    yield _counter(
        "llamaslot_prefix_shared_tokens",
        "Prompt tokens shared from another sequence by seq_cp",
        st.prefix_shared_tokens,
    )


def _sampling(st: EngineStats) -> Iterator[Metric]:
    """Where requests sampled under -bs (backend sampling)."""
    yield _counter(
        "llamaslot_backend_sampled_requests",
        "Requests whose sampler chain ran on the backend (-bs)",
        st.backend_sampled,
    )
    fb = CounterMetricFamily(
        "llamaslot_backend_sampling_fallbacks",
        "Requests that sampled on the CPU under -bs, by reason",
        labels=["reason"],
    )
    for reason, n in list(st.sampling_fallbacks.items()):
        fb.add_metric([reason], n)
    yield fb


def _priorities(st: EngineStats) -> Iterator[Metric]:
    """--scheduling-policy priority: per request priority (at most 16 labels, the rest
    "other"): requests admitted, preemptions, seconds waited in the queue."""
    by = list(st.by_priority.items())
    fams = (
        ("llamaslot_priority_requests", "Requests admitted to a slot, by priority", "requests"),
        ("llamaslot_priority_preemptions", "Runs preempted, by priority", "preemptions"),
        (
            "llamaslot_priority_queue_seconds",
            "Seconds requests waited for a slot (after a preemption too), by priority",
            "queue_seconds",
        ),
    )
    for name, doc, attr in fams:
        fam = CounterMetricFamily(name, doc, labels=["priority"])
        for key, c in by:
            fam.add_metric([key], getattr(c, attr))
        yield fam
    yield _counter("llamaslot_preemptions", "Runs preempted (all priorities)", st.preemptions)


def _speculative(st: EngineStats) -> Iterator[Metric]:
    """llama-server's speculative decoding counters (0 when speculation is off)."""
    yield _counter(
        "llamacpp:spec_decode_num_draft_tokens",
        "Speculative: Total draft tokens generated",
        st.draft_tokens,
    )
    yield _counter(
        "llamacpp:spec_decode_num_accepted_tokens",
        "Speculative: Total draft tokens accepted by the target model",
        st.draft_accepted,
    )
    yield _counter(
        "llamacpp:spec_decode_num_drafts",
        "Speculative: Total speculative decoding verification steps",
        st.draft_steps,
    )
    yield _counter(
        "llamaslot_draft_catchup_tokens",
        "Tokens the draft model decoded to catch up with its slot (prompts, accepted drafts)",
        st.draft_catchup_tokens,
    )
    if st.accepted_per_pos:
        per = CounterMetricFamily(
            "llamacpp:spec_decode_num_accepted_tokens_per_pos",
            "Speculative: Accepted tokens per draft position",
            labels=["position"],
        )
        for i, n in enumerate(list(st.accepted_per_pos)):
            per.add_metric([str(i)], n)
        yield per


def _per_slot(slots: list[Slot]) -> Iterator[Metric]:
    """Per-slot gauges, labelled by slot id."""
    busy = GaugeMetricFamily(
        "llamaslot_slot_busy", "1 while the slot serves a request", labels=["slot"]
    )
    held = GaugeMetricFamily(
        "llamaslot_slot_tokens", "Tokens held in the slot's KV cache", labels=["slot"]
    )
    for s in slots:
        busy.add_metric([str(s.id)], 1.0 if s.task is not None else 0.0)
        held.add_metric([str(s.id)], len(s.tokens))
    yield busy
    yield held


def _cache(cache: PromptCache) -> Iterator[Metric]:
    """The RAM prompt cache's size, limits and counters."""
    c = cache.counters
    yield _gauge("llamaslot_cache_bytes", "RAM prompt cache size in bytes", cache.nbytes)
    yield _gauge("llamaslot_cache_tokens", "Tokens held in the RAM prompt cache", cache.n_tokens)
    yield _gauge("llamaslot_cache_entries", "Entries in the RAM prompt cache", len(cache.entries))
    yield _gauge(
        "llamaslot_cache_limit_bytes",
        "RAM prompt cache byte limit (-1: none)",
        cache.limit_bytes,
    )
    yield _counter("llamaslot_cache_saves", "Slot states saved into the RAM cache", c.saves)
    yield _counter("llamaslot_cache_loads", "Cache hits: entries restored into a slot", c.loads)
    yield _counter(
        "llamaslot_cache_misses",
        "Lookups that found nothing better than the slot",
        c.misses,
    )
    yield _counter("llamaslot_cache_evictions", "Entries evicted from the RAM cache", c.evictions)
    yield _counter(
        "llamaslot_cache_restored_bytes",
        "Bytes restored from the RAM cache",
        c.bytes_restored,
    )


def _disk(disk: DiskTier) -> Iterator[Metric]:
    """The disk tier's size, limit, counters and load time."""
    d = disk.describe()
    c = d["counters"]
    yield _gauge("llamaslot_disk_cache_bytes", "Disk cache size in bytes", d["n_bytes"])
    yield _gauge("llamaslot_disk_cache_entries", "Entries in the disk cache", d["n_entries"])
    yield _gauge("llamaslot_disk_cache_limit_bytes", "Disk cache byte limit", d["limit_bytes"])
    yield _gauge("llamaslot_disk_cache_pending", "Entries waiting for the writer", d["n_pending"])
    for key, doc in (
        ("hits", "Disk cache hits: entries restored into a slot"),
        ("misses", "Disk cache lookups that found nothing usable"),
        ("writes", "Entries written to the disk cache"),
        ("bytes_written", "Bytes written to the disk cache"),
        ("write_failures", "Disk cache writes that failed"),
        ("write_drops", "Entries not written: the writer was too far behind"),
        ("evictions", "Disk cache entries evicted for the byte limit"),
        ("load_failures", "Chosen disk cache entries that could not be loaded"),
        ("bad_files", "Hostile or damaged files skipped in the disk cache directory"),
        ("bytes_read", "Bytes restored from the disk cache"),
    ):
        yield _counter(f"llamaslot_disk_cache_{key}", doc, c[key])
    yield _counter(
        "llamaslot_disk_cache_load_seconds",
        "Time spent restoring disk cache entries into slots",
        c["load_ms_total"] / 1e3,
    )


def _streams(reg: _Streams) -> Iterator[Metric]:
    """Resumable streams (server.service.stream_buffers): sessions, buffers, what became of them."""
    st = reg.stats
    yield _gauge("llamaslot_streams", "Resumable streams kept", len(reg.sessions))
    yield _gauge(
        "llamaslot_streams_generating", "Resumable streams still generating", reg.generating()
    )
    yield _gauge(
        "llamaslot_streams_buffered_bytes", "Bytes held by replay buffers", reg.buffered_bytes()
    )
    yield _counter("llamaslot_streams_opened", "Resumable streams opened", st.opened)
    yield _counter("llamaslot_streams_replays", "GET /v1/stream replays served", st.replays)
    yield _counter("llamaslot_streams_stopped", "Streams stopped (DELETE or replaced)", st.stopped)
    yield _counter(
        "llamaslot_streams_expired", "Streams dropped after --stream-ttl unread", st.expired
    )
    yield _counter(
        "llamaslot_streams_expired_generating",
        "Expired streams whose generation was stopped (nobody came back)",
        st.expired_running,
    )
    yield _counter("llamaslot_streams_refused", "Named streams refused (429: no room)", st.refused)
    yield _counter(
        "llamaslot_streams_events_dropped",
        "Events dropped from full replay buffers",
        st.events_dropped,
    )


class _EngineCollector:
    """Reads the engine's counters at each scrape (nothing before the engine exists)."""

    def __init__(self, state: MetricsSource) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        yield from _streams(self.state.streams)
        engine = self.state.engine
        if engine is None:
            return
        # One snapshot of the slot list for every per-slot figure of this scrape.
        slots = list(engine.slots)
        yield from _llamacpp(engine, slots)
        yield from _protocol(self.state, engine, slots)
        yield from _beyond(engine.stats)
        yield from _images(engine.stats, self.state)
        yield from _sampling(engine.stats)
        yield from _priorities(engine.stats)
        yield from _speculative(engine.stats)
        yield from _per_slot(slots)
        if engine.cache is not None:
            yield from _cache(engine.cache)
        disk = getattr(engine, "disk", None)
        if disk is not None:
            yield from _disk(disk)


class ServerMetrics:
    """The server's registry: the engine collector plus latency and token histograms that
    the engine's observer feeds, and the request counter the middleware feeds."""

    def __init__(self, state: MetricsSource) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(state))
        self.ttft = Histogram(
            "llamaslot_time_to_first_token_seconds",
            "Time from request to first token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "llamaslot_request_duration_seconds",
            "Time from request to its last token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue = Histogram(
            "llamaslot_queue_wait_seconds",
            "Time a request waited for a slot",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Histogram(
            "llamaslot_request_predicted_tokens",
            "Tokens generated per request",
            buckets=TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "llamaslot_requests",
            "HTTP requests by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=self.registry,
        )

    def observe(self, what: str, value: float) -> None:
        """Engine observer (called on the engine thread)."""
        if what == "ttft_ms":
            self.ttft.observe(value / 1e3)
        elif what == "e2e_ms":
            self.e2e.observe(value / 1e3)
        elif what == "queue_ms":
            self.queue.observe(value / 1e3)
        elif what == "predicted_n":
            self.tokens.observe(value)

    def count_request(self, endpoint: str, status: int) -> None:
        """Count a finished request under ``endpoint`` (see ``endpoint_label``) by status class."""
        outcome = "ok" if status < 400 else ("client_error" if status < 500 else "server_error")
        self.requests.labels(endpoint, outcome).inc()

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
