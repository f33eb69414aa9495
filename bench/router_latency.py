"""First-request latency in router mode, ours beside llama-server's router, on the default
model and SmolLM2 (``python -m bench.router_latency [--rounds 3]``):

- cold: the first request for a model no instance serves yet (process start + model load);
- sleeping: the first request after the instance fell asleep (``--sleep-idle-seconds 1``);
- switch: ``--models-max 1``, alternating between the two models (stop one, start the other).

Each figure is the median wall time of a one-token ``/completion`` over the rounds."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.llama_server_tests import llama_server_bin, smollm2_path  # noqa: E402
from tests.e2e.conftest import free_port, gemma_path  # noqa: E402

BODY = {"prompt": "Hello", "n_predict": 1}


def start(cmd: list[str], port: int, log: Path) -> tuple[subprocess.Popen, httpx.Client]:
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300)
    for _ in range(600):
        try:
            if client.get("/health").status_code == 200:
                return proc, client
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"router did not start: {log.read_text()[-2000:]}")


def timed(client: httpx.Client, model: str) -> float:
    """The request's wall time; NaN when it failed (reported, not hidden)."""
    t0 = time.perf_counter()
    try:
        r = client.post("/completion", json={**BODY, "model": model})
        r.raise_for_status()
    except httpx.HTTPError as e:
        print(f"  {model}: request failed: {type(e).__name__}: {e}", file=sys.stderr)
        return float("nan")
    return time.perf_counter() - t0


def status(client: httpx.Client, model: str) -> str:
    data = client.get("/models").json()["data"]
    return next(m["status"]["value"] for m in data if m["id"] == model)


def measure(kind: str, models: Path, rounds: int, work: Path) -> dict[str, float]:
    out: dict[str, list[float]] = {"cold": [], "sleeping": [], "switch": []}
    for n in range(rounds):
        for case, extra in (
            ("cold", []),
            ("sleeping", ["--sleep-idle-seconds", "1"]),
            ("switch", ["--models-max", "1"]),
        ):
            port = free_port()
            base = [sys.executable, "-m", "server"] if kind == "ours" else [str(llama_server_bin())]
            cmd = [
                *base,
                "--models-dir",
                str(models),
                "--port",
                str(port),
                "-c",
                "2048",
                "-np",
                "1",
                *extra,
            ]
            proc, c = start(cmd, port, work / f"{kind}-{case}-{n}.log")
            try:
                if case == "cold":
                    out[case].append(timed(c, "gemma"))
                elif case == "sleeping":
                    timed(c, "gemma")
                    deadline = time.time() + 30
                    while status(c, "gemma") != "sleeping" and time.time() < deadline:
                        time.sleep(0.1)
                    out[case].append(timed(c, "gemma"))
                else:
                    timed(c, "gemma")
                    out[case].append(timed(c, "smollm2"))
                    out[case].append(timed(c, "gemma"))
            finally:
                proc.terminate()
                proc.wait(30)
    return {k: _median(v) for k, v in out.items()}


def _median(values: list[float]) -> float:
    """The median of the requests that answered; NaN when more than half failed."""
    ok = [v for v in values if v == v]
    return statistics.median(ok) if len(ok) * 2 > len(values) else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        models = work / "models"
        models.mkdir()
        (models / "gemma.gguf").symlink_to(gemma_path())
        (models / "smollm2.gguf").symlink_to(smollm2_path())
        res = {kind: measure(kind, models, args.rounds, work) for kind in ("llama-server", "ours")}
    print("| first request | llama-server router (s) | ours (s) | ratio |")
    print("|---|---|---|---|")
    for case in ("cold", "sleeping", "switch"):
        a, b = res["llama-server"][case], res["ours"][case]
        ratio = f"{b / a:.2f}x" if a == a and b == b else "-"
        print(f"| {case} | {_fmt(a)} | {_fmt(b)} | {ratio} |")


def _fmt(v: float) -> str:
    return "failed" if v != v else f"{v:.2f}"


if __name__ == "__main__":
    main()
