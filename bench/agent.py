"""Workload 16: agents (issue 45). Many tool-calling conversations over few slots.

Agents share one long system prompt (a preamble and 20 tool descriptions) and then take
turns: the model writes a tool call (a fixed number of tokens, ``ignore_eos``) and the client
appends the tool's result (~300 tokens) and asks for the next call. There are more
conversations than slots and they take turns round-robin, so every conversation leaves its
slot before its next turn: what a server keeps of it (its prompt cache in RAM, ours also the
disk tier) decides how much of each turn is computed again.

Both servers run with the same larger context and the same small RAM cache (``-c 32768
--cache-ram 256``: 24 conversations of up to ~5,000 tokens do not fit it), ours also with
``--cache-disk`` under the run's temporary directory. The prompts are raw text on
/v1/completions (the default base model has no chat template): the same bytes for both
servers, so the same tokens.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import httpx

from .client import StreamResult, completion_payload, run_concurrent
from .prompts import PromptBook, short_text
from .servers import LLAMA_SERVER, OURS

AGENT_SUFFIX = "-agent"  # server name suffix of this workload's configurations
LLAMA_AGENT = LLAMA_SERVER + AGENT_SUFFIX
OURS_AGENT = OURS + AGENT_SUFFIX
AGENT_FLAGS = ("-c", "32768", "--cache-ram", "256")
# ours only: the disk tier, in the run's temporary directory ({save_root} is replaced)
OURS_AGENT_FLAGS = ("--cache-disk", "{save_root}/w16-disk")


@dataclass(frozen=True)
class AgentShape:
    convs: int
    turns: int
    system: int  # tokens of the shared system prompt, tools included
    tools: int
    result: int  # tokens of each tool result
    out: int  # tokens of each tool call
    concurrency: int


async def system_prompt(book: PromptBook, shape: AgentShape) -> str:
    """The shared system prompt: a preamble, then ``tools`` descriptions, ``system`` tokens
    in all (give or take the headers)."""
    per_tool = max(1, shape.system // (shape.tools + 1))
    parts = [
        "System: You are an agent. Call one tool per turn.\n",
        await book.text("w16", per_tool),
    ]
    for i in range(shape.tools):
        parts.append(f"\nTool tool_{i}: " + await book.text(f"w16-tool{i}", per_tool))
    return "".join(parts)


def _task(key: str) -> str:
    return f"\nUser: {short_text(key, 40)}\nAssistant: <tool_call>"


async def _result(book: PromptBook, key: str, n: int) -> str:
    return f"</tool_call>\n<tool_result>\n{await book.text(key, n)}\n</tool_result>\nAssistant: <tool_call>"


async def run_agents(
    client: httpx.AsyncClient, url: str, book: PromptBook, key: str, shape: AgentShape
) -> tuple[float, list[StreamResult]]:
    """Every conversation's turns, round-robin, ``concurrency`` requests in flight; the
    wall time and every turn's result."""
    system = await system_prompt(book, shape)
    prompts = [system + _task(f"{key}-c{i}") for i in range(shape.convs)]
    wall, results = 0.0, []
    for turn in range(shape.turns):
        payloads = [completion_payload(p, shape.out) for p in prompts]
        dt, got = await run_concurrent(client, url, payloads, shape.concurrency)
        wall += dt
        results.extend(got)
        prompts = [
            p + r.text + await _result(book, f"{key}-c{i}-t{turn}", shape.result)
            for i, (p, r) in enumerate(zip(prompts, got, strict=True))
        ]
    return wall, results


def agent_metrics(wall: float, results: list[StreamResult]) -> dict[str, float | None]:
    """Wall time, prompt tokens computed (``timings.prompt_n``, None when a server gives
    none), and the TTFT median and 99th percentile over every turn."""
    ttft = sorted(r.ttft_s * 1e3 for r in results if r.ttft_s is not None)
    computed = [r.prompt_n for r in results]
    p99 = ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))] if ttft else None
    counted = [n for n in computed if n is not None]
    return {
        "wall_s": wall,
        "prompt_computed": float(sum(counted)) if len(counted) == len(computed) else None,
        "ttft_p50_ms": statistics.median(ttft) if ttft else None,
        "ttft_p99_ms": p99,
    }
