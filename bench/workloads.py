"""The workloads. Each run returns one Sample per (server, repeat)."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from .agent import (
    AGENT_FLAGS,
    AGENT_SUFFIX,
    LLAMA_AGENT,
    OURS_AGENT,
    OURS_AGENT_FLAGS,
    AgentShape,
    agent_metrics,
    run_agents,
)
from .client import (
    StreamResult,
    agrees,
    completion_payload,
    first_top_logprobs,
    get_json,
    post_json,
    run_concurrent,
    stream_completion,
)
from .copyedit import LLAMA_NGRAM, OURS_NGRAM, SPEC_FLAGS, SPEC_SUFFIX, run_copy_edit
from .embed import EMBD_FLAGS, EMBD_SUFFIX, LLAMA_EMBD, OURS_EMBD, run_embedding_throughput
from .prompts import PromptBook, short_text
from .restart import restart_follow_up
from .servers import LLAMA_SERVER, OURS, ServerProcess
from .structured import N_INTS, run_structured


@dataclass(frozen=True)
class Sizes:
    w1_prompt: int = 900
    w1_out: int = 64
    w2_requests: int = 4
    w2_prompt_words: int = 12
    w2_out: int = 128
    w3_system: int = 1800
    w3_questions: int = 16
    w3_concurrency: int = 4
    w3_out: int = 32
    w4_convs: int = 6
    w4_turns: int = 3
    w4_start: int = 300
    w4_user_words: int = 30
    w4_out: int = 48
    w4_concurrency: int = 4
    w5_tokens: int = 4000
    w6_slots: int = 8
    w6_out: int = 128
    w3_cold_checks: int = 4
    w7_doc: int = 1500
    w7_question: int = 120
    w7_out: int = 16
    w8_convs: int = 6
    w8_turns: int = 3
    w8_start: int = 950
    w8_user_words: int = 30
    w8_out: int = 16
    w9_prompt: int = 4000
    w9_user_words: int = 30
    w9_out: int = 16
    w10_reps: int = 4
    w11_texts: int = 1  # per repeat (one text each: a full run's 3 repeats take ~2 min)
    w11_paragraphs: int = 8  # ~530 tokens of text, ~1,100-token prompt
    w12_requests: int = 4
    w12_texts: int = 32  # per request
    w12_words: int = 8  # per text (~10 tokens)
    w12_concurrency: int = 2
    w16_convs: int = 24
    w16_turns: int = 8
    w16_system: int = 2000
    w16_tools: int = 20
    w16_result: int = 300
    w16_out: int = 24
    w16_concurrency: int = 4


FULL = Sizes()
QUICK = Sizes(
    w1_out=32,
    w2_out=48,
    w3_system=900,
    w3_questions=8,
    w3_out=16,
    w4_convs=6,
    w4_turns=3,
    w4_out=24,
    w5_tokens=2000,
    w6_out=48,
    w7_doc=800,
    w11_texts=3,
    w12_requests=2,
    w16_convs=8,
    w16_turns=4,
)


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    unit: str
    higher_is_better: bool
    chart: bool = True  # shown in the ratio chart


@dataclass
class Sample:
    metrics: dict[str, float | None] = field(default_factory=dict)
    ttft_ms: list[float] = field(default_factory=list)  # distribution for the chart
    info: dict[str, Any] = field(default_factory=dict)
    na: str | None = None  # why this server cannot run the workload


@dataclass
class Ctx:
    client: httpx.AsyncClient
    book: PromptBook
    sizes: Sizes
    save_dirs: dict[str, Path]  # server name -> --slot-save-path


Runner = Callable[[Ctx, ServerProcess, int], Awaitable[Sample]]


@dataclass(frozen=True)
class Variant:
    suffix: str  # appended to the server name, e.g. "-ngram"
    flags: tuple[str, ...]  # appended to both servers' command lines
    # appended to ours only; "{save_root}" becomes the run's temporary directory
    ours_flags: tuple[str, ...] = ()


@dataclass(frozen=True)
class VariantRatio:
    num: str  # server (configuration) names
    den: str
    key: str  # metric
    target: float | None = None  # done when the ratio is at least this


@dataclass(frozen=True)
class Workload:
    id: int
    title: str
    describe: Callable[[Sizes], str]
    metrics: tuple[Metric, ...]
    run: Runner
    ours_only: bool = False
    restarts: bool = False  # restarts the server: the foreign-CPU meter cannot judge it
    # Extra server configurations, each run beside the plain servers in the workload's own
    # phase (every server once per variant, named server + suffix), and the ratios between
    # configurations that the report gives.
    variants: tuple[Variant, ...] = ()
    variant_ratios: tuple[VariantRatio, ...] = ()
    variants_only: bool = False  # only the variants run it (the plain servers cannot)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _ttfts_ms(results: list[StreamResult]) -> list[float]:
    return [r.ttft_s * 1e3 for r in results if r.ttft_s is not None]


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _sum_prompt_n(results: list[StreamResult]) -> float | None:
    ns = [r.prompt_n for r in results]
    return None if any(n is None for n in ns) else float(sum(n for n in ns if n is not None))


# --- 1: one request, long prompt ----------------------------------------------------------


async def w1_single(ctx: Ctx, srv: ServerProcess, rep: int) -> Sample:
    s = ctx.sizes
    prompt = await ctx.book.text(f"w1-r{rep}", s.w1_prompt)
    r = await stream_completion(ctx.client, srv.url, completion_payload(prompt, s.w1_out))
    return Sample(
        metrics={
            "ttft_ms": _ms(r.ttft_s),
            "prompt_tps": r.timing("prompt_per_second"),
            "decode_tps": r.decode_tps,
            "decode_tps_server": r.timing("predicted_per_second"),
        },
        ttft_ms=_ttfts_ms([r]),
        info={"prompt_n": r.prompt_n, "predicted_n": r.predicted_n},
    )


W1 = Workload(
    1,
    "Single request, long prompt",
    lambda s: f"one request, ~{s.w1_prompt}-token prompt, {s.w1_out} tokens out (ignore_eos)",
    (
        Metric("ttft_ms", "time to first token", "ms", False),
        Metric("prompt_tps", "prompt processing (server timings)", "tok/s", True),
        Metric("decode_tps", "decode (client, after first token)", "tok/s", True),
        Metric("decode_tps_server", "decode (server timings)", "tok/s", True, chart=False),
    ),
    w1_single,
)


# --- 2: concurrent generation ---------------------------------------------------------------


async def w2_concurrent(ctx: Ctx, srv: ServerProcess, rep: int) -> Sample:
    s = ctx.sizes
    payloads = [
        completion_payload(short_text(f"w2-r{rep}-{i}", s.w2_prompt_words), s.w2_out)
        for i in range(s.w2_requests)
    ]
    wall, results = await run_concurrent(ctx.client, srv.url, payloads, s.w2_requests)
    generated = sum(r.predicted_n for r in results)
    per_req = [r.decode_tps for r in results if r.decode_tps is not None]
    return Sample(
        metrics={
            "agg_tps": generated / wall,
            "wall_s": wall,
            "ttft_p50_ms": _median(_ttfts_ms(results)),
            "per_request_tps": _median(per_req),
        },
        ttft_ms=_ttfts_ms(results),
        info={"generated": generated},
    )


W2 = Workload(
    2,
    "Concurrent generation",
    lambda s: f"{s.w2_requests} concurrent requests, short prompts, {s.w2_out} tokens each",
    (
        Metric("agg_tps", "aggregate generated tokens/s", "tok/s", True),
        Metric("wall_s", "wall time", "s", False, chart=False),
        Metric("ttft_p50_ms", "TTFT p50", "ms", False),
        Metric("per_request_tps", "per-request decode p50 (client)", "tok/s", True, chart=False),
    ),
    w2_concurrent,
)


# --- 3: shared system prompt --------------------------------------------------------------


async def w3_shared_system(ctx: Ctx, srv: ServerProcess, rep: int) -> Sample:
    s = ctx.sizes
    system = await ctx.book.text(f"w3-r{rep}-system", s.w3_system)
    # the first few carry log-probs, to compare with cold runs
    payloads = [
        completion_payload(
            f"{system}\n\nQuestion: {short_text(f'w3-r{rep}-q{i}', 10)}\nAnswer:",
            s.w3_out,
            **({"logprobs": 5} if rep == 0 and i < s.w3_cold_checks else {}),
        )
        for i in range(s.w3_questions)
    ]
    wall, results = await run_concurrent(ctx.client, srv.url, payloads, s.w3_concurrency)
    ttfts = _ttfts_ms(results)
    metrics: dict[str, float | None] = {
        "wall_s": wall,
        "ttft_p50_ms": _median(ttfts),
        "ttft_max_ms": max(ttfts) if ttfts else None,
        "prompt_processed": _sum_prompt_n(results),
    }
    if rep == 0:
        # answers must not depend on sharing: compare the first few with cold runs
        same = 0
        for p, r in list(zip(payloads, results, strict=True))[: s.w3_cold_checks]:
            cold = await stream_completion(ctx.client, srv.url, {**p, "cache_prompt": False})
            same += agrees(cold.first_top, r.first_top)
        metrics["cold_agree"] = same / max(1, min(len(payloads), s.w3_cold_checks))
    return Sample(metrics=metrics, ttft_ms=ttfts)


W3 = Workload(
    3,
    "Shared system prompt",
    lambda s: (
        f"~{s.w3_system}-token system prompt + {s.w3_questions} different short questions, "
        f"{s.w3_concurrency} at a time, {s.w3_out} tokens each"
    ),
    (
        Metric("wall_s", "wall time", "s", False),
        Metric("ttft_p50_ms", "TTFT p50", "ms", False),
        Metric("ttft_max_ms", "TTFT max", "ms", False),
        Metric("prompt_processed", "prompt tokens processed (sum of prompt_n)", "tok", False),
        Metric(
            "cold_agree",
            "first-token log-probs agree with cold runs (first repeat)",
            "share",
            True,
            False,
        ),
    ),
    w3_shared_system,
)


# --- 4: multi-turn conversations ----------------------------------------------------------


@dataclass(frozen=True)
class TurnShape:
    convs: int
    turns: int
    start: int  # tokens of the first prompt
    user_words: int
    out: int  # tokens per answer
    concurrency: int


def _next_turn(key: str, words: int) -> str:
    return f"\nUser: {short_text(key, words)}\nAssistant:"


async def _multi_turn(
    ctx: Ctx, srv: ServerProcess, key: str, shape: TurnShape
) -> tuple[float, list[StreamResult], list[StreamResult]]:
    """Conversations taking turns round-robin; each turn is the previous prompt, its answer
    and a new user line. Returns wall time, turn-1 results and later-turn results."""
    prompts = [
        await ctx.book.text(f"{key}-c{i}", shape.start)
        + _next_turn(f"{key}-c{i}-t0", shape.user_words)
        for i in range(shape.convs)
    ]
    first: list[StreamResult] = []
    later: list[StreamResult] = []
    wall = 0.0
    for turn in range(shape.turns):
        payloads = [completion_payload(p, shape.out) for p in prompts]
        dt, results = await run_concurrent(ctx.client, srv.url, payloads, shape.concurrency)
        wall += dt
        (first if turn == 0 else later).extend(results)
        prompts = [
            p + r.text + _next_turn(f"{key}-c{i}-t{turn + 1}", shape.user_words)
            for i, (p, r) in enumerate(zip(prompts, results, strict=True))
        ]
    return wall, first, later


def _multi_turn_metrics(wall: float, first: list[StreamResult], later: list[StreamResult]):
    later_ttft = _ttfts_ms(later)
    shares = [
        r.timing("cache_n") / (r.timing("cache_n") + r.timing("prompt_n"))
        for r in later
        if r.timing("cache_n") is not None and r.timing("prompt_n") is not None
    ]
    return Sample(
        metrics={
            "wall_s": wall,
            "ttft_turn1_p50_ms": _median(_ttfts_ms(first)),
            "ttft_later_p50_ms": _median(later_ttft),
            "ttft_later_mean_ms": statistics.fmean(later_ttft) if later_ttft else None,
            "ttft_later_max_ms": max(later_ttft) if later_ttft else None,
            "prompt_processed_later": _sum_prompt_n(later),
            "cached_share_later_min": min(shares) if len(shares) == len(later) else None,
        },
        ttft_ms=later_ttft,
    )


async def w4_multi_turn(ctx: Ctx, srv: ServerProcess, rep: int) -> Sample:
    s = ctx.sizes
    shape = TurnShape(
        s.w4_convs, s.w4_turns, s.w4_start, s.w4_user_words, s.w4_out, s.w4_concurrency
    )
    return _multi_turn_metrics(*await _multi_turn(ctx, srv, f"w4-r{rep}", shape))


_MULTI_TURN_METRICS = (
    Metric("wall_s", "wall time", "s", False),
    Metric("ttft_turn1_p50_ms", "turn-1 TTFT p50", "ms", False, chart=False),
    Metric("ttft_later_p50_ms", "turn-2/3 TTFT p50", "ms", False),
    Metric("ttft_later_mean_ms", "turn-2/3 TTFT mean", "ms", False, chart=False),
    Metric("ttft_later_max_ms", "turn-2/3 TTFT max", "ms", False, chart=False),
    Metric("prompt_processed_later", "turn-2/3 prompt tokens processed", "tok", False),
    Metric("cached_share_later_min", "turn-2/3 least cached share of a prompt", "share", True),
)


W4 = Workload(
    4,
    "Multi-turn conversations",
    lambda s: (
        f"{s.w4_convs} conversations x {s.w4_turns} turns, round-robin, "
        f"{s.w4_concurrency} at a time over 4 slots; ~{s.w4_start}-token start, "
        f"~{s.w4_user_words}-word user turns, {s.w4_out} tokens per answer"
    ),
    _MULTI_TURN_METRICS,
    w4_multi_turn,
)


# --- 5: slot save / restore ---------------------------------------------------------------


def _na_reason(action: str, status: int, body: Any) -> str:
    msg = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(msg, dict):
        msg = msg.get("message", msg)
    return f"{action} -> HTTP {status}: {str(msg)[:160]}"


async def w5_slot_save_restore(ctx: Ctx, srv: ServerProcess, rep: int) -> Sample:
    s = ctx.sizes
    prompt = await ctx.book.text("w5-slot", s.w5_tokens)
    # Fill slot 0 (a prefix-cache hit after the first repeat).
    fill = completion_payload(prompt, 1, id_slot=0)
    await stream_completion(ctx.client, srv.url, fill)
    filename = f"bench-w5-r{rep}.bin"
    url = f"{srv.url}/slots/0"
    st, save, save_s = await post_json(ctx.client, url + "?action=save", {"filename": filename})
    if st != 200:
        return Sample(na=_na_reason("POST /slots/0?action=save", st, save))
    st, restore, restore_s = await post_json(
        ctx.client, url + "?action=restore", {"filename": filename}
    )
    if st != 200:
        return Sample(na=_na_reason("POST /slots/0?action=restore", st, restore))
    path = ctx.save_dirs.get(srv.name, Path("/nonexistent")) / filename
    size_mb = path.stat().st_size / 2**20 if path.exists() else None
    if path.exists():
        path.unlink()
    return Sample(
        metrics={
            "save_ms": save_s * 1e3,
            "restore_ms": restore_s * 1e3,
            "save_ms_server": (save.get("timings") or {}).get("save_ms"),
            "restore_ms_server": (restore.get("timings") or {}).get("restore_ms"),
            "file_mib": size_mb,
            **_parts("save", save),
            **_parts("restore", restore),
        },
        info={"n_saved": save.get("n_saved"), "n_restored": restore.get("n_restored")},
    )


# the parts of a save and a restore that ours reports (timings.save_parts_ms /
# restore_parts_ms); llama-server reports none (n/a)
_W5_PARTS = {
    "save": {
        "state": "llama.cpp copies the state into a reused buffer",
        "write": "file written (body, checkpoint appendix, footer)",
        "sync": "fdatasync",
        "rename": "rename + directory fsync",
    },
    "restore": {
        "read": "file read",
        "proof": "cells proven, appendices parsed",
        "load": "engine loads the state",
    },
}


def _parts(action: str, body: Any) -> dict[str, float | None]:
    got = (body.get("timings") or {}).get(f"{action}_parts_ms") or {}
    return {f"{action}_{k}_ms": got.get(k) for k in _W5_PARTS[action]}


W5 = Workload(
    5,
    "Slot save and restore",
    lambda s: f"save and restore slot 0 holding a ~{s.w5_tokens}-token prompt (/slots/0?action=…)",
    (
        Metric("save_ms", "save (client round trip)", "ms", False),
        Metric("restore_ms", "restore (client round trip)", "ms", False),
        Metric("save_ms_server", "save (server timings.save_ms)", "ms", False, chart=False),
        Metric(
            "restore_ms_server", "restore (server timings.restore_ms)", "ms", False, chart=False
        ),
        Metric("file_mib", "file size", "MiB", False, chart=False),
        *(
            Metric(f"{a}_{k}_ms", f"{a}: {label}", "ms", False, chart=False)
            for a, parts in _W5_PARTS.items()
            for k, label in parts.items()
        ),
    ),
    w5_slot_save_restore,
)


# --- 6: scheduler overhead (ours only) ----------------------------------------------------


async def _engine_counters(ctx: Ctx, srv: ServerProcess) -> dict[str, float] | None:
    st, props = await get_json(ctx.client, f"{srv.url}/props")
    eng = props.get("engine") if st == 200 and isinstance(props, dict) else None
    return eng if isinstance(eng, dict) else None


async def w6_scheduler_overhead(ctx: Ctx, srv: ServerProcess, rep: int) -> Sample:
    s = ctx.sizes
    before = await _engine_counters(ctx, srv)
    if before is None:
        return Sample(na="GET /props has no `engine` counters")
    payloads = [
        completion_payload(short_text(f"w6-r{rep}-{i}", 12), s.w6_out) for i in range(s.w6_slots)
    ]
    wall, results = await run_concurrent(ctx.client, srv.url, payloads, s.w6_slots)
    after = await _engine_counters(ctx, srv) or before
    n = after["n_steps"] - before["n_steps"]
    step = after["step_seconds_total"] - before["step_seconds_total"]
    dec = after["decode_seconds_total"] - before["decode_seconds_total"]
    if n <= 0:
        return Sample(na="engine counters did not move")
    return Sample(
        metrics={
            "overhead_ms": (step - dec) / n * 1e3,
            "overhead_pct": 100.0 * (step - dec) / step if step > 0 else None,
            "step_ms": step / n * 1e3,
            "decode_ms": dec / n * 1e3,
            "agg_tps": sum(r.predicted_n for r in results) / wall,
        },
        info={"n_steps": n},
    )


W6 = Workload(
    6,
    "Scheduler overhead (ours only)",
    lambda s: (
        f"-np {s.w6_slots}, {s.w6_slots} concurrent generations of {s.w6_out} tokens; "
        "engine-step time outside llama_decode from GET /props `engine`"
    ),
    (
        Metric("overhead_ms", "step time outside llama_decode, per step", "ms", False),
        Metric("overhead_pct", "share of step time outside llama_decode", "%", False),
        Metric("step_ms", "engine step", "ms", False),
        Metric("decode_ms", "llama_decode per step", "ms", False),
        Metric("agg_tps", "aggregate generated tokens/s", "tok/s", True),
    ),
    w6_scheduler_overhead,
    ours_only=True,
)

# --- 7: replace a long last user message (context checkpoints) ---------------------------


async def _chat_stream(
    ctx: Ctx, srv: ServerProcess, body: dict[str, Any]
) -> tuple[float, dict[str, float] | None]:
    """Streamed chat completion: (seconds to the first non-empty delta, the first token's
    top log-probs when the body asks for them)."""
    t0 = time.perf_counter()
    ttft = None
    top: dict[str, float] | None = None
    async with ctx.client.stream("POST", f"{srv.url}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            top = top or first_top_logprobs(chunk)
            for c in chunk.get("choices") or []:
                if (c.get("delta") or {}).get("content") and ttft is None:
                    ttft = time.perf_counter() - t0
    return (ttft if ttft is not None else time.perf_counter() - t0), top


async def w7_replace_last_message(ctx: Ctx, srv: ServerProcess, rep: int) -> Sample:
    s = ctx.sizes
    doc = await ctx.book.text(f"w7-r{rep}-doc", s.w7_doc)
    head = [
        {"role": "system", "content": "You answer questions about documents."},
        {"role": "user", "content": "Here is a document:\n" + doc},
        {"role": "assistant", "content": "I have read it. Ask me anything about it."},
    ]

    def body(last: str, **extra: Any) -> dict[str, Any]:
        msgs = [*head, {"role": "user", "content": last}]
        return {
            "messages": msgs,
            "max_tokens": s.w7_out,
            "temperature": 0.0,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 5,
            **extra,
        }

    first = await ctx.book.text(f"w7-r{rep}-q1", s.w7_question)
    edited = await ctx.book.text(f"w7-r{rep}-q2", s.w7_question)
    await _chat_stream(ctx, srv, body(first))
    # the user edits the last message: the cut is at its start, far behind the window
    ttft_ckpt, top_ckpt = await _chat_stream(ctx, srv, body(edited))
    ttft_cold, top_cold = await _chat_stream(ctx, srv, body(edited, cache_prompt=False))
    return Sample(
        metrics={
            "ttft_checkpoint_ms": ttft_ckpt * 1e3,
            "ttft_recompute_ms": ttft_cold * 1e3,
            "speedup": ttft_cold / ttft_ckpt if ttft_ckpt > 0 else None,
            "same_as_cold": 1.0 if agrees(top_cold, top_ckpt) else 0.0,
        },
        ttft_ms=[ttft_ckpt * 1e3],
    )


W7 = Workload(
    7,
    "Edit the last user message of a long chat (ours only)",
    lambda s: (
        f"a chat holding a ~{s.w7_doc}-token document, then a ~{s.w7_question}-token question; "
        "the question is edited and sent again: TTFT resuming from the context checkpoint at "
        "the start of the last user message vs recomputing the prompt (cache_prompt off: what "
        "a cut behind the sliding window costs without checkpoints); greedy output compared "
        "with the cold run by first-token log-probabilities"
    ),
    (
        Metric("ttft_checkpoint_ms", "TTFT with checkpoints", "ms", False),
        Metric("ttft_recompute_ms", "TTFT recomputing (no checkpoint)", "ms", False),
        Metric("speedup", "checkpoint speed-up (recompute / checkpoint)", "x", True),
        Metric(
            "same_as_cold", "first-token log-probs agree with the cold run", "share", True, False
        ),
    ),
    w7_replace_last_message,
    ours_only=True,
)

# --- 8: multi-turn conversations longer than the sliding window ------------------------------


async def w8_long_multi_turn(ctx: Ctx, srv: ServerProcess, rep: int) -> Sample:
    s = ctx.sizes
    shape = TurnShape(s.w8_convs, s.w8_turns, s.w8_start, s.w8_user_words, s.w8_out, 1)
    return _multi_turn_metrics(*await _multi_turn(ctx, srv, f"w8-r{rep}", shape))


W8 = Workload(
    8,
    "Multi-turn conversations longer than the sliding window",
    lambda s: (
        f"{s.w8_convs} conversations x {s.w8_turns} turns, round-robin, one request at a time "
        f"over 4 slots (so each conversation leaves its slot before its next turn: served from "
        f"the RAM cache); ~{s.w8_start}-token start (the default model's window is 512), "
        f"~{s.w8_user_words}-word user turns, {s.w8_out} tokens per answer"
    ),
    _MULTI_TURN_METRICS,
    w8_long_multi_turn,
)

# --- 9: a follow-up turn after a restart (ours: --cache-disk; llama-server: cold) --------------


async def w9_restart_follow_up(ctx: Ctx, srv: ServerProcess, rep: int) -> Sample:
    s = ctx.sizes
    conversation = await ctx.book.text(f"w9-r{rep}", s.w9_prompt) + _next_turn(
        f"w9-r{rep}-t0", s.w9_user_words
    )
    disk = next(iter(ctx.save_dirs.values()), Path("/tmp")).parent / f"w9-disk-{srv.name}"
    r = await restart_follow_up(
        ctx.client,
        srv,
        conversation,
        _next_turn(f"w9-r{rep}-t1", s.w9_user_words),
        s.w9_out,
        disk,
    )
    return Sample(metrics=r.metrics, ttft_ms=r.ttft_ms, info=r.info)


W9 = Workload(
    9,
    "Follow-up turn after a restart",
    lambda s: (
        f"a ~{s.w9_prompt}-token conversation, then SIGTERM and a new server process, then "
        f"its next turn (~{s.w9_user_words} words): ours restarts with --cache-disk (the idle "
        f"slot is written at SIGTERM, the follow-up restored from disk), llama-server restarts "
        f"cold; the same follow-up with cache_prompt=false is the cold reference"
    ),
    (
        Metric("ttft_after_restart_ms", "TTFT of the follow-up after the restart", "ms", False),
        Metric("ttft_cold_ms", "TTFT of the follow-up computed cold", "ms", False, chart=False),
        Metric("ratio", "after restart / cold", "x", False),
        Metric("restart_s", "SIGTERM to ready again", "s", False, chart=False),
        Metric(
            "prompt_n_after_restart", "prompt tokens computed after the restart", "tokens", False
        ),
    ),
    w9_restart_follow_up,
    restarts=True,
)

# --- 10: JSON-schema-constrained generation ---------------------------------------------------


async def w10_structured(ctx: Ctx, srv: ServerProcess, rep: int) -> Sample:
    metrics = await run_structured(ctx.client, srv.url, f"w10-r{rep}", ctx.sizes.w10_reps)
    return Sample(metrics=metrics)


W10 = Workload(
    10,
    "JSON-schema-constrained generation",
    lambda s: (
        f"{s.w10_reps} greedy answers constrained to a JSON array of {N_INTS} integers "
        f"(json_schema), each followed by the same prompt unconstrained for as many tokens; "
        f"then a first request with a new 50-tool call schema (its compile) and the same again"
    ),
    (
        Metric("constrained_tps", "constrained decode rate (server timings)", "tok/s", True),
        Metric("free_tps", "unconstrained decode rate, same prompt and length", "tok/s", True),
        Metric("constrained_over_free", "constrained / unconstrained", "x", True, chart=False),
        Metric("valid_share", "answers that parse with the schema's shape", "share", True, False),
        Metric("tools50_first_ttft_ms", "TTFT, first request with a 50-tool schema", "ms", False),
        Metric("tools50_again_ttft_ms", "TTFT, the same request again", "ms", False, chart=False),
    ),
    w10_structured,
)


# --- 11: copy-edit (speculative decoding) -------------------------------------------------


async def w11_copy_edit(ctx: Ctx, srv: ServerProcess, rep: int) -> Sample:
    s = ctx.sizes
    metrics = await run_copy_edit(
        ctx.client, srv.url, f"w11-r{rep}", s.w11_texts, s.w11_paragraphs, rep * s.w11_texts
    )
    return Sample(metrics=metrics)


W11 = Workload(
    11,
    "Copy-edit: the answer copies the prompt (speculative decoding)",
    lambda s: (
        f"{s.w11_texts} text(s) per repeat, one at a time: ~{s.w11_paragraphs * 66}-token "
        f"story and 'Rewrite this text exactly, changing the name X to Y' (raw Gemma turn "
        f"markup, the answer's first sentence primed), greedy, as many tokens as the text "
        f"(ignore_eos), prompt cache off (both prefill alike, so both write the same text); "
        f"every server plain and with `{' '.join(SPEC_FLAGS)}` (the -ngram "
        f"columns). The default 270M base model copies but keeps the old name; copied share "
        f"= answer characters in runs of 24+ copied from the text"
    ),
    (
        Metric("decode_tps_server", "decode (server timings), median of texts", "tok/s", True),
        Metric("decode_tps", "decode (client, after first token)", "tok/s", True, chart=False),
        Metric("wall_s", "wall time, all texts", "s", False, chart=False),
        Metric("draft_n", "drafted tokens (timings.draft_n)", "tok", True, chart=False),
        Metric("draft_n_accepted", "accepted drafts", "tok", True, chart=False),
        Metric("acceptance", "accepted / drafted", "share", True, chart=False),
        Metric("copied_share", "copied share of the answers", "share", True, chart=False),
        Metric("predicted_n", "generated tokens", "tok", True, chart=False),
    ),
    w11_copy_edit,
    variants=(Variant(SPEC_SUFFIX, SPEC_FLAGS),),
    variant_ratios=(
        VariantRatio(OURS_NGRAM, OURS, "decode_tps_server", 1.5),
        VariantRatio(OURS_NGRAM, LLAMA_NGRAM, "decode_tps_server", 1.0),
        VariantRatio(LLAMA_NGRAM, LLAMA_SERVER, "decode_tps_server"),
        VariantRatio(OURS_NGRAM, OURS, "wall_s"),
        VariantRatio(OURS_NGRAM, LLAMA_NGRAM, "wall_s"),
    ),
)

# --- 12: embedding throughput -----------------------------------------------------------------


async def w12_embeddings(ctx: Ctx, srv: ServerProcess, rep: int) -> Sample:
    s = ctx.sizes
    metrics = await run_embedding_throughput(
        ctx.client,
        srv.url,
        f"w12-r{rep}",
        s.w12_requests,
        s.w12_texts,
        s.w12_words,
        s.w12_concurrency,
    )
    if metrics is None:
        return Sample(na="started without --embedding")
    return Sample(metrics=metrics)


W12 = Workload(
    12,
    "Embedding throughput",
    lambda s: (
        f"{s.w12_requests} /v1/embeddings requests of {s.w12_texts} short texts "
        f"(~{s.w12_words} words each), {s.w12_concurrency} in flight; every server with "
        f"`{' '.join(EMBD_FLAGS)}` (the -embd configurations)"
    ),
    (
        Metric("rps", "requests per second", "req/s", True),
        Metric("texts_per_s", "texts embedded per second", "text/s", True, chart=False),
        Metric("prompt_tps", "prompt tokens per second", "tok/s", True, chart=False),
        Metric("wall_s", "wall time", "s", False, chart=False),
    ),
    w12_embeddings,
    variants=(Variant(EMBD_SUFFIX, EMBD_FLAGS),),
    variant_ratios=(VariantRatio(OURS_EMBD, LLAMA_EMBD, "rps", 0.9),),
    variants_only=True,
)

# --- 16: agents: many tool-calling conversations over few slots (bench/agent.py) ---------------


async def w16_agents(ctx: Ctx, srv: ServerProcess, rep: int) -> Sample:
    s = ctx.sizes
    shape = AgentShape(
        s.w16_convs,
        s.w16_turns,
        s.w16_system,
        s.w16_tools,
        s.w16_result,
        s.w16_out,
        s.w16_concurrency,
    )
    wall, results = await run_agents(ctx.client, srv.url, ctx.book, f"w16-r{rep}", shape)
    return Sample(metrics=agent_metrics(wall, results), ttft_ms=_ttfts_ms(results))


W16 = Workload(
    16,
    "Agents: tool-calling conversations over few slots",
    lambda s: (
        f"{s.w16_convs} agent conversations x {s.w16_turns} turns over 4 slots, "
        f"{s.w16_concurrency} requests in flight, round-robin: a shared ~{s.w16_system}-token "
        f"system prompt with {s.w16_tools} tools, then per turn a {s.w16_out}-token tool call "
        f"and a ~{s.w16_result}-token tool result; both servers `{' '.join(AGENT_FLAGS)}` (the "
        f"{AGENT_SUFFIX} columns), ours also `--cache-disk` (the RAM cache cannot hold them all)"
    ),
    (
        Metric("wall_s", "wall time", "s", False),
        Metric("prompt_computed", "prompt tokens computed", "tok", False),
        Metric("ttft_p50_ms", "turn TTFT p50", "ms", False),
        Metric("ttft_p99_ms", "turn TTFT p99", "ms", False, chart=False),
    ),
    w16_agents,
    variants=(Variant(AGENT_SUFFIX, AGENT_FLAGS, OURS_AGENT_FLAGS),),
    # llama-server's wall over ours: the target is ours <= 0.4x llama-server's
    variant_ratios=(VariantRatio(LLAMA_AGENT, OURS_AGENT, "wall_s", 2.5),),
    variants_only=True,
)

# workloads 17 and 18 build on the types above (bench/image_workload.py, bench/percost.py)
from .image_workload import W17  # noqa: E402
from .percost import W18  # noqa: E402

WORKLOADS: dict[int, Workload] = {
    w.id: w for w in (W1, W2, W3, W4, W5, W6, W7, W8, W9, W10, W11, W12, W16, W17, W18)
}
