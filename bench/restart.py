"""Workload 9's runner: a follow-up turn on a long conversation after a server restart.

Ours restarts with ``--cache-disk`` (SIGTERM writes its idle slot to the disk tier; the new
process rebuilds the index and serves the follow-up from disk); llama-server restarts cold.
The server is restarted in place (the ServerProcess keeps its identity for the rest of the
run) and, at the end, restarted once more with its original command line.

Note: the bench's foreign-CPU meter asks for the servers' pids at each mark, but the process
that exits during a sample reads as foreign: this workload's samples are not retried for it.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from .client import completion_payload, stream_completion
from .servers import _RUNNING, OURS, ServerProcess, ServerSpec, start, stop, wait_ready


@dataclass
class RestartResult:
    metrics: dict[str, float | None] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    ttft_ms: list[float] = field(default_factory=list)


def _respawn(sp: ServerProcess, spec: ServerSpec) -> float:
    """SIGTERM ``sp`` (ours writes its slots to disk then), start ``spec`` in its place and
    wait until it is ready; returns the seconds that took."""
    t0 = time.monotonic()
    stop(sp, grace_s=30.0)
    new = start(spec, sp.log_path.parent)
    wait_ready(new)
    _RUNNING.remove(new)  # ``sp`` stands for it from now on
    sp.spec, sp.port, sp.proc, sp.log_path = new.spec, new.port, new.proc, new.log_path
    _RUNNING.append(sp)
    return time.monotonic() - t0


def _disk_spec(spec: ServerSpec, disk: Path) -> ServerSpec:
    if spec.name != OURS:
        return spec  # llama-server has no disk tier: it restarts cold
    return replace(spec, argv=[*spec.argv, "--cache-disk", str(disk)])


async def restart_follow_up(
    client: httpx.AsyncClient,
    sp: ServerProcess,
    conversation: str,
    next_turn: str,
    out: int,
    disk: Path,
) -> RestartResult:
    """First turn, restart, follow-up (TTFT measured), then the same follow-up computed
    from scratch (cache_prompt false) as the cold reference."""
    original = sp.spec
    shutil.rmtree(disk, ignore_errors=True)
    res = RestartResult()
    try:
        await asyncio.to_thread(_respawn, sp, _disk_spec(original, disk))
        first = await stream_completion(client, sp.url, completion_payload(conversation, out))
        follow = conversation + first.text + next_turn
        restart_s = await asyncio.to_thread(_respawn, sp, sp.spec)
        warm = await stream_completion(client, sp.url, completion_payload(follow, out))
        cold = await stream_completion(
            client, sp.url, completion_payload(follow, out, cache_prompt=False)
        )
    finally:
        await asyncio.to_thread(_respawn, sp, original)
        shutil.rmtree(disk, ignore_errors=True)
    warm_ms = None if warm.ttft_s is None else warm.ttft_s * 1e3
    cold_ms = None if cold.ttft_s is None else cold.ttft_s * 1e3
    res.metrics = {
        "ttft_after_restart_ms": warm_ms,
        "ttft_cold_ms": cold_ms,
        "ratio": None if warm_ms is None or not cold_ms else warm_ms / cold_ms,
        "restart_s": restart_s,
        "prompt_n_after_restart": None if warm.prompt_n is None else float(warm.prompt_n),
    }
    res.ttft_ms = [x for x in (warm_ms,) if x is not None]
    res.info = {"first_prompt_n": first.prompt_n, "cold_prompt_n": cold.prompt_n}
    return res
