"""Workload 16 (agents, issue 45): its prompts, the server configurations it runs and its
measures. (Running it needs the servers: `python -m bench.run --only 16`.)"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from bench import agent
from bench.client import StreamResult
from bench.prompts import PromptBook
from bench.report import Results, variant_lines
from bench.run import parse_args, variant_specs
from bench.servers import LCP, LLAMA_SERVER, OURS, ServerSpec
from bench.workloads import FULL, WORKLOADS, Sample


async def _words(text: str) -> list[str]:  # a tokenizer: one piece per word
    return [w + " " for w in text.split()]


def test_w16_runs_both_servers_with_the_agent_flags_and_ours_with_the_disk_tier() -> None:
    w = WORKLOADS[16]
    assert parse_args(["--only", "16"]).only == [16]
    base = [
        ServerSpec(LLAMA_SERVER, ["llama-server", "-m", "m.gguf"]),
        ServerSpec(OURS, [sys.executable, "-m", "server", "-m", "m.gguf"]),
        ServerSpec(LCP, ["python", "-m", "llama_cpp.server"]),
    ]
    specs = variant_specs(base, w.variants, not w.variants_only, Path("/tmp/run"))
    assert [s.name for s in specs] == [agent.LLAMA_AGENT, agent.OURS_AGENT]
    llama, ours = specs
    assert llama.argv == ["llama-server", "-m", "m.gguf", *agent.AGENT_FLAGS]
    assert ours.argv[-6:] == [*agent.AGENT_FLAGS, "--cache-disk", "/tmp/run/w16-disk"]


def test_conversations_share_the_system_prompt_and_grow_by_call_and_result() -> None:
    shape = agent.AgentShape(3, 2, 420, 20, 30, 4, 2)
    book = PromptBook(_words)
    system = asyncio.run(agent.system_prompt(book, shape))
    assert system.count("\nTool tool_") == 20 and "tool_19" in system
    assert 420 <= len(system.split()) <= 420 + 70  # 21 x 20 pieces plus the headers
    sent: list[list[str]] = []

    async def fake_run(client, url, payloads, concurrency):
        assert concurrency == 2
        sent.append([p["prompt"] for p in payloads])
        return 1.5, [StreamResult(0.01, 0.1, " call()", 1, {"prompt_n": 7}, "length", None)] * 3

    orig = agent.run_concurrent
    agent.run_concurrent = fake_run  # type: ignore[assignment]
    try:
        wall, results = asyncio.run(agent.run_agents(None, "u", book, "k", shape))  # type: ignore[arg-type]
    finally:
        agent.run_concurrent = orig  # type: ignore[assignment]
    assert wall == 3.0 and len(results) == 6
    first, second = sent
    assert all(p.startswith(system) for p in first + second)
    assert len(set(first)) == 3  # each conversation its own task
    for p0, p1 in zip(first, second, strict=True):
        assert p1.startswith(p0 + " call()</tool_call>\n<tool_result>\n")
        assert p1.endswith("</tool_result>\nAssistant: <tool_call>")


def test_agent_metrics() -> None:
    rs = [
        StreamResult(t / 1e3, 1.0, "x", 1, {"prompt_n": 10 * t}, "length", None)
        for t in range(1, 101)
    ]
    m = agent.agent_metrics(12.0, rs)
    assert m == {
        "wall_s": 12.0,
        "prompt_computed": 50500.0,
        "ttft_p50_ms": 50.5,
        "ttft_p99_ms": 99.0,
    }
    rs[0] = StreamResult(None, 1.0, "", 0, None, "length", None)  # a server without timings
    assert agent.agent_metrics(1.0, rs)["prompt_computed"] is None


def test_report_gives_llama_server_wall_over_ours_against_the_target() -> None:
    r = Results()
    r.add(16, agent.LLAMA_AGENT, Sample(metrics={"wall_s": 100.0}))
    r.add(16, agent.OURS_AGENT, Sample(metrics={"wall_s": 25.0}))
    (line,) = variant_lines(r, WORKLOADS[16])
    assert "4.00x" in line and "target ≥ 2.5: met" in line
    assert "24 agent conversations x 8 turns" in WORKLOADS[16].describe(FULL)
