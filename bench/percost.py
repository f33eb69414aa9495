"""Workload 18: per-request cost, a 1-token non-streaming completion at 1 and 64 clients.

What it isolates is the server's handling of one request (HTTP, validation, tokenizing, the
hand-off to the engine and back, the JSON answer), not prompt processing: every request is a
fresh ~8-word prompt (~10 tokens, seeded by repeat and index, the same for both servers: no
prefix cache holds it) and asks for ``max_tokens: 1``, non-streaming, greedy. Two phases:

- 1 client: ``n_sequential`` requests one after another on one keep-alive connection;
- 64 clients: ``n_concurrent`` requests, 64 in flight over the shared client's 64 keep-alive
  connections. Both servers run with the main phase's ``-np 4``: the 60 requests beyond the
  slots wait in each server's own queue, so the latency includes the queue and requests/s is
  the throughput of 4 slots.

A few warm-up requests precede each phase (first-request costs are not per-request costs).
``bench.workloads`` registers W18 (it imports this module after its own types): import that
module first, as ``bench.run`` does.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import httpx

from .client import BenchError
from .prompts import short_text
from .servers import ServerProcess
from .workloads import FULL, Ctx, Metric, Sample, Workload

CLIENTS = 64
PROMPT_WORDS = 8
WARMUP = 8
# (sequential, concurrent) requests per repeat
FULL_N = (200, 640)
QUICK_N = (100, 256)


def payload(prompt: str) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": False,
    }


async def one_request(client: httpx.AsyncClient, url: str, prompt: str) -> float:
    """Seconds from sending to the parsed answer; raises on anything but one completion."""
    t0 = time.perf_counter()
    r = await client.post(url + "/v1/completions", json=payload(prompt))
    if r.status_code != 200:
        raise BenchError(f"/v1/completions answered {r.status_code}: {r.text[:200]}")
    body = r.json()
    elapsed = time.perf_counter() - t0
    if len(body.get("choices") or ()) != 1:
        raise BenchError("/v1/completions did not return one choice")
    return elapsed


def p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]


def phase_metrics(prefix: str, lat_s: list[float], wall_s: float) -> dict[str, float | None]:
    ms = [x * 1e3 for x in lat_s]
    return {
        f"{prefix}_p50_ms": statistics.median(ms),
        f"{prefix}_p99_ms": p99(ms),
        f"{prefix}_rps": len(ms) / wall_s,
    }


async def sequential(client: httpx.AsyncClient, url: str, prompts: list[str]) -> dict[str, Any]:
    lat = []
    t0 = time.perf_counter()
    for p in prompts:
        lat.append(await one_request(client, url, p))
    return phase_metrics("c1", lat, time.perf_counter() - t0)


async def concurrent(
    client: httpx.AsyncClient, url: str, prompts: list[str], clients: int
) -> dict[str, Any]:
    """``clients`` workers, each sending its next prompt when its answer arrives."""
    queue = list(reversed(prompts))
    lat: list[float] = []

    async def worker() -> None:
        while queue:
            lat.append(await one_request(client, url, queue.pop()))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return phase_metrics(f"c{clients}", lat, time.perf_counter() - t0)


async def w18_per_request(ctx: Ctx, srv: ServerProcess, rep: int) -> Sample:
    n_seq, n_conc = FULL_N if ctx.sizes == FULL else QUICK_N
    key = f"w18-r{rep}"
    warm = [short_text(f"{key}-w{i}", PROMPT_WORDS) for i in range(WARMUP)]
    await asyncio.gather(*(one_request(ctx.client, srv.url, p) for p in warm))
    seq = [short_text(f"{key}-s{i}", PROMPT_WORDS) for i in range(n_seq)]
    conc = [short_text(f"{key}-c{i}", PROMPT_WORDS) for i in range(n_conc)]
    metrics = await sequential(ctx.client, srv.url, seq)
    metrics |= await concurrent(ctx.client, srv.url, conc, CLIENTS)
    return Sample(metrics=metrics, info={"n_sequential": n_seq, "n_concurrent": n_conc})


W18 = Workload(
    18,
    "Per-request cost: 1-token non-streaming completions",
    lambda s: (
        f"non-streaming /v1/completions, `max_tokens: 1`, a fresh ~{PROMPT_WORDS}-word prompt "
        f"each (the same prompts for both servers); 1 client sending "
        f"{(FULL_N if s == FULL else QUICK_N)[0]} requests one after another, then "
        f"{CLIENTS} clients sending {(FULL_N if s == FULL else QUICK_N)[1]} over {CLIENTS} "
        f"keep-alive connections; both servers `-np 4` (the rest wait in the server's queue)"
    ),
    (
        Metric("c1_p50_ms", "1 client: latency p50", "ms", False),
        Metric("c1_p99_ms", "1 client: latency p99", "ms", False, chart=False),
        Metric("c1_rps", "1 client: requests per second", "req/s", True, chart=False),
        Metric(f"c{CLIENTS}_p50_ms", f"{CLIENTS} clients: latency p50", "ms", False),
        Metric(f"c{CLIENTS}_p99_ms", f"{CLIENTS} clients: latency p99", "ms", False, chart=False),
        Metric(f"c{CLIENTS}_rps", f"{CLIENTS} clients: requests per second", "req/s", True),
    ),
    w18_per_request,
)
