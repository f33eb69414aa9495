"""Prometheus metrics (prometheus-client). llama-server's ``llamacpp:*`` names for existing
dashboards, plus ``llamaslot_*`` metrics it lacks (latency histograms, RAM cache, slots).

Scrapes read the engine's counters without taking any lock the engine step holds: the engine
thread writes plain ints/floats, the collector reads them (atomic under the GIL).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class _EngineCollector:
    def __init__(self, state: Any) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        engine = self.state.engine
        if engine is None:
            return
        st = engine.stats

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        # ---- llama-server's names and meanings ----
        yield counter(
            "llamacpp:prompt_tokens",
            "Number of prompt tokens processed, excluding cached tokens",
            st.prompt_tokens_total,
        )
        yield counter(
            "llamacpp:prompt_tokens_cached",
            "Number of prompt tokens reused from the cache",
            st.prompt_tokens_cached_total,
        )
        yield counter(
            "llamacpp:prompt_seconds",
            "Total time spent processing prompts",
            st.prompt_seconds_total,
        )
        yield counter(
            "llamacpp:tokens_predicted",
            "Number of generation tokens processed",
            st.tokens_predicted_total,
        )
        yield counter(
            "llamacpp:tokens_predicted_seconds",
            "Total time spent generating tokens",
            st.tokens_predicted_seconds_total,
        )
        yield counter(
            "llamacpp:n_decode", "Total number of llama_decode() calls", st.n_decode_total
        )
        yield gauge(
            "llamacpp:n_tokens_max",
            "Largest observed sequence length (prompt + generation)",
            st.n_tokens_max,
        )
        pps = (
            st.prompt_tokens_total / st.prompt_seconds_total if st.prompt_seconds_total > 0 else 0.0
        )
        dps = (
            st.tokens_predicted_total / st.tokens_predicted_seconds_total
            if st.tokens_predicted_seconds_total > 0
            else 0.0
        )
        yield gauge("llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s", pps)
        yield gauge(
            "llamacpp:predicted_tokens_seconds", "Average generation throughput in tokens/s", dps
        )
        slots = list(engine.slots)
        yield gauge(
            "llamacpp:requests_processing",
            "Number of requests processing",
            sum(1 for s in slots if s.task is not None),
        )
        yield gauge(
            "llamacpp:requests_deferred", "Number of requests deferred", len(engine.waiting)
        )
        yield gauge(
            "llamacpp:n_busy_slots_per_decode",
            "Average number of busy slots per llama_decode() call",
            st.n_busy_slots_total / max(1, st.n_decode_total),
        )

        # ---- beyond llama-server ----
        yield counter(
            "llamaslot_cancelled_prompt_tokens",
            "Prompt tokens processed for requests that were cancelled or failed "
            "(not in llamacpp:prompt_tokens_total)",
            st.cancelled_prompt_tokens_total,
        )
        yield counter(
            "llamaslot_cancelled_predicted_tokens",
            "Tokens generated for requests that were cancelled or failed",
            st.cancelled_predicted_tokens_total,
        )
        yield counter(
            "llamaslot_checkpoints_created", "Context checkpoints created", st.checkpoints_created
        )
        yield counter(
            "llamaslot_checkpoints_restored",
            "Context checkpoints restored",
            st.checkpoints_restored,
        )
        yield counter(
            "llamaslot_decode_seconds", "Time spent inside llama_decode", st.decode_seconds_total
        )
        yield counter(
            "llamaslot_engine_step_seconds",
            "Time spent in engine steps that decoded",
            st.step_seconds_total,
        )
        yield counter("llamaslot_slot_files_saved", "Slot files saved", st.slot_saves)
        yield counter("llamaslot_slot_files_restored", "Slot files restored", st.slot_restores)
        yield counter(
            "llamaslot_slot_file_failures",
            "Slot file saves or restores that failed",
            st.slot_file_failures,
        )
        yield counter(
            "llamaslot_slot_file_bytes_written",
            "Bytes written to slot files",
            st.slot_bytes_written,
        )
        yield counter(
            "llamaslot_slot_file_bytes_read", "Bytes read from slot files", st.slot_bytes_read
        )
        yield counter(
            "llamaslot_prefix_shared_tokens",
            "Prompt tokens shared from another sequence by seq_cp",
            st.prefix_shared_tokens,
        )
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

        cache = engine.cache
        if cache is not None:
            c = cache.counters
            yield gauge("llamaslot_cache_bytes", "RAM prompt cache size in bytes", cache.nbytes)
            yield gauge(
                "llamaslot_cache_tokens", "Tokens held in the RAM prompt cache", cache.n_tokens
            )
            yield gauge(
                "llamaslot_cache_entries", "Entries in the RAM prompt cache", len(cache.entries)
            )
            yield gauge(
                "llamaslot_cache_limit_bytes",
                "RAM prompt cache byte limit (-1: none)",
                cache.limit_bytes,
            )
            yield counter("llamaslot_cache_saves", "Slot states saved into the RAM cache", c.saves)
            yield counter(
                "llamaslot_cache_loads", "Cache hits: entries restored into a slot", c.loads
            )
            yield counter(
                "llamaslot_cache_misses",
                "Lookups that found nothing better than the slot",
                c.misses,
            )
            yield counter(
                "llamaslot_cache_evictions", "Entries evicted from the RAM cache", c.evictions
            )
            yield counter(
                "llamaslot_cache_restored_bytes",
                "Bytes restored from the RAM cache",
                c.bytes_restored,
            )


class ServerMetrics:
    def __init__(self, state: Any) -> None:
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
        outcome = "ok" if status < 400 else ("client_error" if status < 500 else "server_error")
        self.requests.labels(endpoint, outcome).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
