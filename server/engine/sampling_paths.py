"""Where a slot samples: on the backend (-bs) or on the CPU, and CPU sampling in parallel.

Backend sampling (llama-server's ``-bs``) runs a slot's sampler chain inside the decode
graph, so only the chosen token leaves the device. It is chosen per slot when its task
starts; a task that needs something the backend chain lacks samples on the CPU instead,
transparently (``cpu_reason`` names why, and the engine counts it).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from ..task import Task


class ConstraintDeadEnd(RuntimeError):
    """The request's grammar or schema admits no token where its run stands: the request's
    fault (``status``), answered as a 400 (issue 40), never a 500."""

    status = 400


# Why a task samples on the CPU under -bs (the label of the fallback counter).
CONSTRAINT = "constraint"  # grammar / json_schema / response_format: needs the token mask
LOGPROBS = "logprobs"  # logprobs / n_probs read the full logits row
PENALTIES = "penalties"  # repeat / frequency / presence penalties
SAMPLERS = "samplers"  # a stage llama.cpp has no graph version of (DRY, XTC, mirostat, ...)
REQUEST = "request"  # the request's backend_sampling: false
FALLBACK_REASONS = (CONSTRAINT, LOGPROBS, PENALTIES, SAMPLERS, REQUEST)
# The stages llama.cpp runs in the decode graph (those with a backend_apply in its
# llama-sampler.cpp): logit bias, penalties, top-k, top-p, min-p, temperature (with
# dynatemp), and the dist / greedy pick. The others sample on the CPU.
BACKEND_STAGES = frozenset({"penalties", "top_k", "top_p", "min_p", "temperature"})
# logit_bias is not among them: llama.cpp's logit-bias stage runs in the graph too, and
# ignore_eos bans the end-of-generation tokens with it, as llama-server does.


def cpu_reason(task: Task) -> str:
    """Why ``task`` cannot sample on the backend ("" when it can). The backend chain is
    a logit bias, then greedy, or top-k, top-p, min-p, temperature and a seeded dist:
    what ``LlamaBackend.new_sampler`` builds without penalties and without the stages
    outside ``BACKEND_STAGES`` (README "Backend sampling")."""
    p = task.sampling
    if not p.backend_ok:
        return REQUEST
    if p.constraint is not None:
        return CONSTRAINT
    if task.gen.logprobs or task.gen.n_probs > 0:
        return LOGPROBS
    if p.penalized():
        return PENALTIES
    if any(s not in BACKEND_STAGES for s in p.stages()) or "adaptive_p" in p.samplers:
        return SAMPLERS
    return ""


class ParallelSampling:
    """A small thread pool for the slots that sample on the CPU in one step.

    Measured on the 2-core CI machine (Gemma 3 270M, 262k vocabulary, llama_sampler_sample
    about 0.3 ms a slot, most of it filling the candidate array): two workers were slower
    than one loop at every count, 0.87-0.95x from 2 to 32 slots, so on 2 cores or fewer the
    auto setting leaves the pool off. With more cores (a GPU host: sampling is what bounds
    the step there) it uses up to 8 workers from ``min_slots`` CPU-sampled slots on; a
    slot's sampling then no longer waits for the slots before it. ``workers`` = 0: off.
    """

    def __init__(self, workers: int = -1, min_slots: int = 4, min_cores: int = 2) -> None:
        cores = os.cpu_count() or 1
        if workers < 0:
            workers = min(8, cores) if cores > min_cores else 0
        self.workers = workers
        self.min_slots = max(2, min_slots)
        self.pool = (
            ThreadPoolExecutor(workers, thread_name_prefix="sample") if workers > 1 else None
        )

    def pool_for(self, n_slots: int) -> ThreadPoolExecutor | None:
        """The pool to sample ``n_slots`` slots with; None: sample them one after another."""
        return self.pool if n_slots >= self.min_slots else None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False)
            self.pool = None
