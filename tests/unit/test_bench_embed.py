"""Workload 12 (embedding throughput): the requests it sends, its metrics, the servers it
runs (only the --embedding configurations) and the ratio the report gives. (Running it needs
the servers: `python -m bench.run --only 12`.)"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from bench.client import BenchError
from bench.embed import EMBD_FLAGS, LLAMA_EMBD, OURS_EMBD, run_embedding_throughput
from bench.run import variant_specs
from bench.servers import LLAMA_SERVER, OURS, ServerSpec
from bench.workloads import WORKLOADS


def _client(handler) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def _embedder(seen: list[list[str]], status: int = 200):
    def handler(req: httpx.Request) -> httpx.Response:
        inputs = json.loads(req.content)["input"]
        if inputs == "probe":
            return httpx.Response(status, json={"data": [{"embedding": [0.0]}]})
        seen.append(inputs)
        data = [{"embedding": [1.0, 0.0], "index": i} for i in range(len(inputs))]
        return httpx.Response(
            200, json={"data": data, "usage": {"prompt_tokens": 10 * len(inputs)}}
        )

    return handler


def test_requests_and_metrics() -> None:
    seen: list[list[str]] = []

    async def go():
        async with _client(_embedder(seen)) as c:
            return await run_embedding_throughput(c, "http://x", "w12-r0", 3, 32, 8, 2)

    m = asyncio.run(go())
    assert len(seen) == 3 and all(len(b) == 32 for b in seen)
    texts = [t for b in seen for t in b]
    assert len(set(texts)) == len(texts)  # fresh texts: nothing a cache could hold
    assert m is not None and m["rps"] == pytest.approx(3 / m["wall_s"])
    assert m["texts_per_s"] == pytest.approx(96 / m["wall_s"])
    assert m["prompt_tps"] == pytest.approx(960 / m["wall_s"])


def test_not_embedding_is_none_and_errors_raise() -> None:
    async def go(handler):
        async with _client(handler) as c:
            return await run_embedding_throughput(c, "http://x", "k", 1, 4, 8, 1)

    assert asyncio.run(go(_embedder([], status=501))) is None

    def failing(req: httpx.Request) -> httpx.Response:
        if json.loads(req.content)["input"] == "probe":
            return httpx.Response(200, json={})
        return httpx.Response(500, json={"error": {"message": "boom"}})

    with pytest.raises(BenchError):
        asyncio.run(go(failing))


def test_only_the_embedding_configurations_run_it() -> None:
    w = WORKLOADS[12]
    assert w.variants_only and w.variants[0].flags == EMBD_FLAGS
    base = [ServerSpec(LLAMA_SERVER, ["llama-server"]), ServerSpec(OURS, ["python"])]
    specs = variant_specs(base, w.variants, plain=not w.variants_only)
    assert [s.name for s in specs] == [LLAMA_EMBD, OURS_EMBD]
    assert all(s.argv[-3:] == list(EMBD_FLAGS) for s in specs)
    (vr,) = w.variant_ratios
    assert (vr.num, vr.den, vr.key, vr.target) == (OURS_EMBD, LLAMA_EMBD, "rps", 0.9)
