"""Workload 12: embedding throughput, requests of 32 short texts each (/v1/embeddings).

Both servers run with ``--embedding --pooling mean`` (the -embd configurations); the plain
ones cannot embed and are n/a. Every request carries a batch of short seeded sentences (fresh
ones per request and repeat: nothing is cached), a few requests in flight at a time; the
servers spread each request's texts over their slots and decode them together. Requests per
second is the headline; texts and prompt tokens per second follow from it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from .client import BenchError
from .prompts import short_text
from .servers import LLAMA_SERVER, OURS

EMBD_FLAGS = ("--embedding", "--pooling", "mean")
EMBD_SUFFIX = "-embd"
LLAMA_EMBD = LLAMA_SERVER + EMBD_SUFFIX
OURS_EMBD = OURS + EMBD_SUFFIX


async def _one(client: httpx.AsyncClient, url: str, texts: list[str]) -> int:
    """One request; the prompt tokens the server counted."""
    r = await client.post(url + "/v1/embeddings", json={"input": texts})
    if r.status_code != 200:
        raise BenchError(f"/v1/embeddings answered {r.status_code}: {r.text[:200]}")
    body = r.json()
    if len(body["data"]) != len(texts) or not body["data"][0]["embedding"]:
        raise BenchError("/v1/embeddings returned the wrong number of embeddings")
    return int(body["usage"]["prompt_tokens"])


async def run_embedding_throughput(
    client: httpx.AsyncClient,
    url: str,
    key: str,
    n_requests: int,
    n_texts: int,
    n_words: int,
    concurrency: int,
) -> dict[str, Any] | None:
    """Metrics of ``n_requests`` requests of ``n_texts`` texts, ``concurrency`` at a time;
    None when the server does not embed (started without --embedding)."""
    probe = await client.post(url + "/v1/embeddings", json={"input": "probe"})
    if probe.status_code in (404, 501):
        return None
    batches = [
        [short_text(f"{key}-q{i}-t{j}", n_words) for j in range(n_texts)] for i in range(n_requests)
    ]
    sem = asyncio.Semaphore(concurrency)

    async def run(texts: list[str]) -> int:
        async with sem:
            return await _one(client, url, texts)

    t0 = time.perf_counter()
    tokens = await asyncio.gather(*(run(b) for b in batches))
    wall = time.perf_counter() - t0
    return {
        "rps": n_requests / wall,
        "texts_per_s": n_requests * n_texts / wall,
        "prompt_tps": sum(tokens) / wall,
        "wall_s": wall,
    }
