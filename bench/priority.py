"""TTFT of a high-priority request under a full batch of low-priority streams (issue 44).

Starts the server twice on the default model with ``-np 4``: once as it is by default
(``--scheduling-policy fcfs``: the request waits for a slot to free), once with
``--scheduling-policy priority`` (it preempts the latest low-priority stream into the RAM
cache). Each round: four streamed low-priority requests (``--low-tokens`` each, ``ignore_eos``)
fill every slot; once all four stream, one short high-priority request is sent; its TTFT
(request sent to first text chunk, by the client) and the low streams' wall time are
reported, as medians over ``--rounds``. Under fcfs the request is sent with priority 0 (the
only value fcfs takes).

    .venv/bin/python -m bench.priority [--rounds 3] [--low-tokens 256] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def _stream(url: str, body: dict, first: threading.Event | None = None) -> float:
    """Stream a /completion; the seconds to its first text chunk (sets ``first`` there)."""
    t0 = time.perf_counter()
    ttft = -1.0
    with httpx.stream("POST", url + "/completion", json=body, timeout=1200) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if ttft < 0 and json.loads(line[6:]).get("content"):
                ttft = time.perf_counter() - t0
                if first is not None:
                    first.set()
    return ttft


def _round(url: str, policy: str, low_tokens: int, r: int) -> tuple[float, float]:
    """One round: the high request's TTFT and the four low streams' wall time."""
    started = [threading.Event() for _ in range(4)]
    prio = 10 if policy == "priority" else 0
    lows = [
        threading.Thread(
            target=_stream,
            args=(
                url,
                {
                    "prompt": f"Round {r}, list {i}. Animals, one per line:\n",
                    "n_predict": low_tokens,
                    "ignore_eos": True,
                    "temperature": 0,
                    "stream": True,
                    "priority": prio,
                },
                started[i],
            ),
        )
        for i in range(4)
    ]
    t0 = time.perf_counter()
    for t in lows:
        t.start()
    for ev in started:
        ev.wait(600)
    high = {
        "prompt": f"Round {r}. Name one colour:",
        "n_predict": 8,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "priority": 0,
    }
    ttft = _stream(url, high)
    for t in lows:
        t.join()
    return ttft, time.perf_counter() - t0


def _serve(policy: str, port: int, threads: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "server", "--port", str(port), "-np", "4"]
    cmd += ["--scheduling-policy", policy]
    if threads > 0:
        cmd += ["-t", str(threads)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    c = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5)
    while True:
        try:
            if c.get("/health").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode})")
        time.sleep(0.3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--low-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--port", type=int, default=18411)
    args = ap.parse_args()
    for policy in ("fcfs", "priority"):
        proc = _serve(policy, args.port, args.threads)
        try:
            url = f"http://127.0.0.1:{args.port}"
            _round(url, policy, 8, -1)  # warm-up
            got = [_round(url, policy, args.low_tokens, r) for r in range(args.rounds)]
        finally:
            proc.terminate()
            proc.wait(30)
        ttft = statistics.median(x[0] for x in got)
        wall = statistics.median(x[1] for x in got)
        print(
            f"{policy:8s} high-priority TTFT median {ttft * 1e3:8.1f} ms "
            f"(each: {', '.join(f'{x[0] * 1e3:.0f}' for x in got)}), "
            f"low streams' wall {wall:.1f} s"
        )


if __name__ == "__main__":
    main()
