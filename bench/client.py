"""HTTP side of the benchmark: streamed /v1/completions with time-to-first-token."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx


class BenchError(RuntimeError):
    """A server answered with an error where the workload needs a result."""


@dataclass
class StreamResult:
    ttft_s: float | None  # request sent -> first chunk with non-empty text
    total_s: float  # request sent -> stream finished
    text: str
    n_text_chunks: int
    timings: dict[str, Any] | None  # llama-server's `timings` from the final chunk
    finish_reason: str | None
    first_top: dict[str, float] | None = None  # first token's top log-probs, when asked for

    @property
    def predicted_n(self) -> int:
        """Generated tokens: the server's count when it reports one, else the text chunks."""
        if self.timings and "predicted_n" in self.timings:
            return int(self.timings["predicted_n"])
        return self.n_text_chunks

    @property
    def prompt_n(self) -> int | None:
        """Prompt tokens the server actually processed (cached ones excluded)."""
        if self.timings and "prompt_n" in self.timings:
            return int(self.timings["prompt_n"])
        return None

    def timing(self, key: str) -> float | None:
        if self.timings and self.timings.get(key) is not None:
            return float(self.timings[key])
        return None

    @property
    def decode_tps(self) -> float | None:
        """Client-side decode rate: tokens after the first over the time after the first."""
        if self.ttft_s is None or self.predicted_n < 2:
            return None
        span = self.total_s - self.ttft_s
        return (self.predicted_n - 1) / span if span > 0 else None


def make_client() -> httpx.AsyncClient:
    timeout = httpx.Timeout(connect=10.0, read=1800.0, write=60.0, pool=1800.0)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    return httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)


def completion_payload(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """Raw-prompt completion, greedy, fixed length (ignore_eos), streamed."""
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        **extra,
    }


# llama.cpp is not batch-invariant: the same prompt in other ubatch splits drifts by up to
# ~0.2 nats on CPU, so greedy texts of a cached and a cold run may differ on a near tie.
# Agreement is judged on the first token instead: the cold run's top token is in the other
# run's top 5 and within this many nats. A KV cache missing its window shifts far more.
LOGPROB_TOL = 0.5


def first_top_logprobs(chunk: dict[str, Any]) -> dict[str, float] | None:
    """The first token's top log-probabilities in a completion or chat chunk, in either the
    legacy completions form (``top_logprobs: [{token: lp}]``) or the chat form
    (``content: [{top_logprobs: [{token, logprob}]}]``, which llama-server also uses)."""
    choices = chunk.get("choices") or []
    lp = (choices[0].get("logprobs") if choices else None) or {}
    if lp.get("content"):
        return {t["token"]: t["logprob"] for t in lp["content"][0].get("top_logprobs", [])}
    if lp.get("top_logprobs"):
        return dict(lp["top_logprobs"][0])
    return None


def agrees(cold: dict[str, float] | None, warm: dict[str, float] | None) -> bool:
    if not cold or not warm:
        return False
    best = max(cold, key=cold.__getitem__)
    return best in warm and abs(warm[best] - cold[best]) <= LOGPROB_TOL


def _chunk_text(chunk: dict[str, Any]) -> tuple[str, str | None]:
    choices = chunk.get("choices") or []
    if not choices:
        return "", None
    c = choices[0]
    return c.get("text") or "", c.get("finish_reason")


async def stream_completion(
    client: httpx.AsyncClient, base_url: str, payload: dict[str, Any]
) -> StreamResult:
    """POST /v1/completions with stream=true; time the first non-empty text chunk."""
    t0 = time.perf_counter()
    ttft: float | None = None
    parts: list[str] = []
    n_chunks = 0
    timings: dict[str, Any] | None = None
    finish: str | None = None
    top: dict[str, float] | None = None
    async with client.stream("POST", f"{base_url}/v1/completions", json=payload) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode(errors="replace")
            raise BenchError(f"POST /v1/completions -> {resp.status_code}: {body[:500]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise BenchError(f"stream error: {chunk['error']}")
            text, fr = _chunk_text(chunk)
            top = top or first_top_logprobs(chunk)
            if text:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(text)
                n_chunks += 1
            finish = fr or finish
            if chunk.get("timings"):
                timings = chunk["timings"]
    total = time.perf_counter() - t0
    return StreamResult(ttft, total, "".join(parts), n_chunks, timings, finish, top)


async def run_concurrent(
    client: httpx.AsyncClient,
    base_url: str,
    payloads: Sequence[dict[str, Any]],
    concurrency: int,
) -> tuple[float, list[StreamResult]]:
    """Send the payloads, at most `concurrency` in flight; return (wall seconds, results)."""
    sem = asyncio.Semaphore(concurrency)

    async def one(p: dict[str, Any]) -> StreamResult:
        async with sem:
            return await stream_completion(client, base_url, p)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in payloads))
    return time.perf_counter() - t0, list(results)


async def post_json(
    client: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> tuple[int, Any, float]:
    """POST a JSON body; return (status, parsed body or text, client-side seconds)."""
    t0 = time.perf_counter()
    resp = await client.post(url, json=body)
    elapsed = time.perf_counter() - t0
    try:
        parsed: Any = resp.json()
    except ValueError:
        parsed = resp.text
    return resp.status_code, parsed, elapsed


async def get_json(client: httpx.AsyncClient, url: str) -> tuple[int, Any]:
    resp = await client.get(url)
    try:
        return resp.status_code, resp.json()
    except ValueError:
        return resp.status_code, resp.text
