"""Engine-side counters. Written only by the engine thread; read (without locks) by metrics."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..task import FinishReason, TaskResult

# distinct priorities counted apart in the metrics; the rest under "other" (a client's
# integer must not grow the label set without bound)
MAX_PRIORITY_LABELS = 16


@dataclass
class PriorityCounts:
    """One priority's tasks: admitted (first placements), preemptions, seconds waited in
    the queue (first waits and waits after a preemption)."""

    requests: int = 0
    preemptions: int = 0
    queue_seconds: float = 0.0


@dataclass
class EngineStats:
    n_decode_total: int = 0
    n_busy_slots_total: int = 0  # sum over decodes of slots in the batch
    n_tokens_max: int = 0
    checkpoints_created: int = 0
    checkpoints_restored: int = 0
    decode_seconds_total: float = 0.0  # inside llama_decode
    step_seconds_total: float = 0.0  # whole engine steps that decoded something
    n_steps: int = 0
    # the last decoded batch (schedule to update): its tokens and seconds, for the
    # prefill speed estimate of prefix sharing (kv/share_cost.py)
    n_batches: int = 0
    last_batch_tokens: int = 0
    last_batch_seconds: float = 0.0
    # Prompt/predicted accounting of finished requests: exactly the sums of the ``timings``
    # their responses carried. Cancelled or failed requests (whose clients never see timings)
    # are counted apart, so nothing is counted twice or against a response that says otherwise.
    prompt_tokens_total: int = 0
    prompt_tokens_cached_total: int = 0
    prompt_seconds_total: float = 0.0
    tokens_predicted_total: int = 0
    tokens_predicted_seconds_total: float = 0.0
    cancelled_prompt_tokens_total: int = 0
    cancelled_predicted_tokens_total: int = 0
    # slot files: the route counts each operation through an engine call (this thread)
    slot_saves: int = 0
    slot_restores: int = 0
    slot_file_failures: int = 0
    slot_bytes_written: int = 0
    slot_bytes_read: int = 0
    prefix_shared_tokens: int = 0
    # in-flight sharing (engine/sharing.py): waits not started, and given up, because computing
    # the prompt itself was estimated to finish sooner
    prefix_waits_skipped: int = 0
    prefix_waits_abandoned: int = 0
    kv_exhausted: int = 0  # requests ended because the KV cache had no room left
    cache_reuse_tokens: int = 0  # --cache-reuse: cached tokens moved into place
    cache_reuse_chunks: int = 0
    context_shifts: int = 0  # --context-shift: full slots that dropped half and went on
    # images (issue 42): decoded into slots, and image positions computed vs already cached
    images_decoded: int = 0
    image_tokens_computed: int = 0
    image_tokens_cached: int = 0
    # -bs: tasks whose chain ran on the backend, and those that fell back to the CPU, by why
    backend_sampled: int = 0
    sampling_fallbacks: dict[str, int] = field(default_factory=dict)
    # speculative decoding: tokens drafted and accepted, verification steps, and accepted
    # tokens by draft position (index 0: the first drafted token)
    draft_tokens: int = 0
    draft_accepted: int = 0
    draft_steps: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    draft_catchup_tokens: int = 0  # decoded by the draft model to catch up with its slot
    # --scheduling-policy priority: per priority (its decimal text, or "other")
    by_priority: dict[str, PriorityCounts] = field(default_factory=dict)
    preemptions: int = 0
    # Observers (metrics) called on the engine thread; must be cheap and never raise.
    observers: list[Callable[[str, float], None]] = field(default_factory=list)

    def _observe(self, what: str, value: float) -> None:
        for fn in self.observers:
            fn(what, value)

    def on_decode(self, n_busy: int, seconds: float) -> None:
        self.n_decode_total += 1
        self.n_busy_slots_total += n_busy
        self.decode_seconds_total += seconds

    def on_slot_file(
        self,
        saves: int = 0,
        restores: int = 0,
        failures: int = 0,
        bytes_written: int = 0,
        bytes_read: int = 0,
    ) -> None:
        self.slot_saves += saves
        self.slot_restores += restores
        self.slot_file_failures += failures
        self.slot_bytes_written += bytes_written
        self.slot_bytes_read += bytes_read

    def on_batch(self, n_tokens: int, seconds: float) -> None:
        self.n_batches += 1
        self.last_batch_tokens, self.last_batch_seconds = n_tokens, seconds

    def on_step(self, seconds: float) -> None:
        self.n_steps += 1
        self.step_seconds_total += seconds

    def on_sampler_placed(self, fallback: str) -> None:
        """A task's sampler chain placed under -bs: "" on the backend, else why not."""
        if fallback:
            self.sampling_fallbacks[fallback] = self.sampling_fallbacks.get(fallback, 0) + 1
        else:
            self.backend_sampled += 1

    def on_draft(self, n_drafted: int, n_accepted: int) -> None:
        """One verification step: ``n_accepted`` of ``n_drafted`` draft tokens held."""
        self.draft_steps += 1
        self.draft_tokens += n_drafted
        self.draft_accepted += n_accepted
        per = self.accepted_per_pos
        if len(per) < n_accepted:
            per.extend([0] * (n_accepted - len(per)))
        for i in range(n_accepted):
            per[i] += 1

    def on_image(self, n_tokens: int) -> None:
        self.images_decoded += 1
        self.image_tokens_computed += n_tokens

    def _priority(self, priority: int) -> PriorityCounts:
        key = str(priority)
        got = self.by_priority.get(key)
        if got is None:
            if len(self.by_priority) >= MAX_PRIORITY_LABELS - 1:
                key = "other"
            got = self.by_priority.setdefault(key, PriorityCounts())
        return got

    def on_admitted(self, priority: int, waited_s: float, first: bool) -> None:
        """A task of ``priority`` got a slot after ``waited_s`` in the queue (``first``: its
        first placement, not a resume)."""
        c = self._priority(priority)
        c.requests += first
        c.queue_seconds += waited_s

    def on_preempted(self, priorities: list[int]) -> None:
        """Runs of these priorities gave their slots up (engine/preempt.py)."""
        self.preemptions += len(priorities)
        for p in priorities:
            self._priority(p).preemptions += 1

    def on_launch(self, queue_ms: float) -> None:
        self._observe("queue_ms", queue_ms)

    def on_first_token(self, ttft_ms: float) -> None:
        self._observe("ttft_ms", ttft_ms)

    def on_finish(self, r: TaskResult, e2e_ms: float) -> None:
        t = r.timings
        if r.finish in (FinishReason.CANCELLED, FinishReason.ERROR):
            self.cancelled_prompt_tokens_total += t.prompt_n
            self.cancelled_predicted_tokens_total += t.predicted_n
            return
        self.prompt_tokens_total += t.prompt_n
        self.prompt_tokens_cached_total += t.cache_n
        self.prompt_seconds_total += t.prompt_ms / 1e3
        self.tokens_predicted_total += t.predicted_n
        self.tokens_predicted_seconds_total += t.predicted_ms / 1e3
        self.n_tokens_max = max(self.n_tokens_max, t.cache_n + t.prompt_n + t.predicted_n)
        self._observe("e2e_ms", e2e_ms)
        self._observe("predicted_n", t.predicted_n)
