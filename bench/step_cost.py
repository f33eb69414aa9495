"""The engine's Python cost per decode step, isolated from llama.cpp.

The engine runs on a backend whose decode and sampling cost nothing (a real ``LlamaBatch``,
so filling the batch is measured as it runs; decode returns at once; every slot samples a
fixed token), with N slots generating. What is left is the scheduler's own Python: building
the batch, committing, sampling bookkeeping, text streaming and event delivery.

    python -m bench.step_cost            # 8, 32 and 64 slots
    python -m bench.step_cost 16 128     # other slot counts
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from server.engine.engine import Engine, EngineOptions
from server.llama.backend import LlamaBatch
from server.task import GenParams, SamplingParams, Task
from tests.fake_backend import FakeBackend, FakeSampler


class NullBackend(FakeBackend):
    """FakeBackend with free decode and sampling, and the real batch."""

    def __init__(self, n_seq: int) -> None:
        super().__init__(n_seq=n_seq, n_ctx=1 << 20, n_batch=4096, n_ubatch=512)
        self.batch = LlamaBatch(self.n_batch)  # type: ignore[assignment]

    def decode(self, start: int, count: int) -> int:
        return 0

    def sample(self, sampler: FakeSampler, idx: int) -> int:
        return 17

    def sample_many(self, items: list, pool) -> list[int]:
        return [17] * len(items)


@dataclass
class StepCost:
    slots: int
    steps: int
    us_per_step: float
    us_per_slot: float


def busy_engine(n_slots: int, prompt_len: int, max_tokens: int) -> tuple[Engine, NullBackend]:
    """An engine on the free backend with ``n_slots`` streamed tasks queued, one per slot,
    each with a ``prompt_len``-token prompt and ``max_tokens`` to generate."""
    b = NullBackend(n_slots)
    e = Engine(b, EngineOptions(prefix_share=False, cache_idle_slots=False, coalesce_ms=0))
    for i in range(n_slots):
        e.waiting.append(
            Task(
                prompt=[(i * 31 + j) % 900 for j in range(prompt_len)],
                sampling=SamplingParams(temperature=0.0),
                gen=GenParams(max_tokens=max_tokens),
                emit=lambda ev: None,
                id_slot=i,
                stream=True,
            )
        )
    return e, b


def measure(n_slots: int, steps: int = 400, prompt_len: int = 32, rounds: int = 5) -> StepCost:
    """Python time per step with ``n_slots`` slots generating (prefill excluded): the least
    of ``rounds`` rounds of ``steps`` steps (on a shared machine other processes only ever
    add time, so the least disturbed round is the measure)."""
    e, b = busy_engine(n_slots, prompt_len, rounds * steps + 10)
    for _ in range(3):  # admission and prefill, then warm up
        e.step()
    dt = float("inf")
    for _ in range(rounds):
        t0 = time.process_time()
        for _ in range(steps):
            e.step()
        dt = min(dt, time.process_time() - t0)
    b.batch.free()
    return StepCost(n_slots, steps, dt / steps * 1e6, dt / steps / n_slots * 1e6)


def main(argv: list[str]) -> None:
    for n in [int(a) for a in argv] or [8, 32, 64]:
        c = measure(n)
        print(
            f"{c.slots:4d} slots: {c.us_per_step:8.1f} us/step  {c.us_per_slot:6.2f} us/slot "
            f"(CPU time of the engine's Python, best of 5 x {c.steps} steps)"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
