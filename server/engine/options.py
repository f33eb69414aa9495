"""The engine's settings (``server.http.app.engine_options`` builds them from Settings)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..slot.speculative import SpecConfig
from .priority import PriorityRule


@dataclass
class EngineOptions:
    """Scheduler settings (``server.http.app.engine_options`` builds them from Settings)."""

    slot_prompt_similarity: float = 0.10
    ctx_checkpoints: int = 32
    checkpoint_min_step: int = 8192
    cache_idle_slots: bool = True  # only with a RAM cache
    prefix_share: bool = True  # needs unified KV
    prefix_share_min: int = 128  # least gain worth waiting for an in-flight prefix
    coalesce_ms: float = 2.0  # after idle, wait in slices this long for concurrent arrivals
    # --step-target-ms: while slots generate, a step's prompt tokens are cut so that the
    # step's estimated time (kv/share_cost.StepSpeed) stays within this (0: no cut)
    step_target_ms: float = 500.0
    # workers sampling the CPU-sampled slots of one step concurrently (-1: auto, by the
    # cores; 0: off); used from ``sample_parallel_min`` such slots (see engine/sampling_paths.py)
    sample_threads: int = -1
    sample_parallel_min: int = 4
    spec: SpecConfig = field(default_factory=SpecConfig)  # speculative decoding (--spec-*)
    context_shift: bool = False  # --context-shift: a full slot shifts (SlotStore.shift)
    cache_reuse: int = 0  # --cache-reuse N: least chunk reused by a KV shift (prefix/reuse.py)
    # --scheduling-policy and --priority-aging-seconds (engine/priority.py)
    priority: PriorityRule = field(default_factory=PriorityRule)


__all__ = ["EngineOptions"]
