"""Where each server's CPU goes during workload 2 (4 concurrent streams, 128 tokens each).

Both servers run the same vendored llama.cpp with ``-t 2``: its compute threads take
nearly all of the CPU, and what the rest of the process spends per generated token is the
server's own overhead. Per repeat (the two servers alternate, so a drift of the machine
hits both), from ``/proc/<pid>/task/*/stat``: tokens per second, the process's CPU per
generated token, and the CPU of every thread but the two busiest (the compute threads; in
ours, the engine thread is one of them: it calls llama_decode) plus, for ours, the event
loop's thread (HTTP, JSON, SSE).

    python -m bench.thread_cpu [--repeats 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

from bench.client import completion_payload, run_concurrent
from bench.prompts import short_text
from bench.run import default_model
from bench.servers import (
    common_flags,
    ensure_llama_server,
    llama_server_spec,
    ours_spec,
    start,
    stop,
    wait_ready,
)

_TICK = os.sysconf("SC_CLK_TCK")
LOGS = Path(__file__).resolve().parent / "out" / "logs"


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of ``pid``, by thread id."""
    out: dict[int, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / _TICK
    return out


async def _workload(url: str, rep: int, n: int = 4, tokens: int = 128) -> tuple[float, int]:
    payloads = [completion_payload(short_text(f"tc-r{rep}-{i}", 24), tokens) for i in range(n)]
    async with httpx.AsyncClient(timeout=300, trust_env=False) as c:
        wall, results = await run_concurrent(c, url, payloads, n)
    return wall, sum(r.predicted_n for r in results)


def measure(url: str, pid: int, rep: int) -> dict[str, float]:
    """One repeat: tok/s, CPU ms per token (all, outside the two busiest threads, and the
    main thread's: the event loop in ours)."""
    before = thread_cpu(pid)
    wall, generated = asyncio.run(_workload(url, rep))
    after = thread_cpu(pid)
    used = sorted((after[t] - before.get(t, 0.0) for t in after), reverse=True)
    per_tok = 1e3 / max(1, generated)
    return {
        "tok_s": generated / wall,
        "cpu_ms": sum(used) * per_tok,
        "other_ms": sum(used[2:]) * per_tok,
        "main_ms": (after.get(pid, 0.0) - before.get(pid, 0.0)) * per_tok,
    }


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=4)
    args = p.parse_args(argv)
    common = common_flags(default_model(), 2, 8192, 4)
    specs = [
        llama_server_spec(ensure_llama_server(), common, None, []),
        ours_spec(common, None, []),
    ]
    rows: dict[str, list[dict[str, float]]] = {s.name: [] for s in specs}
    for rep in range(args.repeats):
        for spec in specs if rep % 2 == 0 else specs[::-1]:
            sp = start(spec, LOGS)
            try:
                wait_ready(sp)
                asyncio.run(_workload(sp.url, -1))  # warm-up
                m = measure(sp.url, sp.proc.pid, rep)
            finally:
                stop(sp)
            rows[spec.name].append(m)
            print(
                f"repeat {rep + 1} {spec.name}: " + ", ".join(f"{k} {v:.2f}" for k, v in m.items())
            )
            time.sleep(1)
    print(
        "\n| server | tok/s ↑ | CPU per token, ms | of it outside the compute threads, ms | main thread, ms |"
    )
    print("|---|---|---|---|---|")
    for name, ms in rows.items():
        med = {k: statistics.median(m[k] for m in ms) for k in ms[0]}
        print(
            f"| {name} | {med['tok_s']:.1f} | {med['cpu_ms']:.1f} | {med['other_ms']:.2f} "
            f"| {med['main_ms']:.2f} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
