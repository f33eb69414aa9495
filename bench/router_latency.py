"""First-request latency in router mode, ours beside llama-server's router, on the default
model and SmolLM2 (``python -m bench.router_latency [--rounds 3]``):

- cold: the first request for a model no instance serves yet (process start + model load),
  sent as soon as the router's ``/health`` answers;
- cold, router up 5 s: the same, 5 s after the router answered (ours: its template process
  has imported the server by then);
- sleeping: the first request after the instance fell asleep (``--sleep-idle-seconds 1``);
- switch: ``--models-max 1``, alternating between the two models (stop one, start the other).

Each figure is the median wall time of a one-token ``/completion`` over the rounds; the
servers alternate within each round (the machine's load drifts). ``--plain`` adds ours with
``LLAMA_ROUTER_ZYGOTE=0`` (each instance spawned as a new interpreter, as before issue 45)."""

from __future__ import annotations

import argparse
import os
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


CASES = ("cold", "cold, router up 5 s", "sleeping", "switch")
KINDS = ("llama-server", "ours", "ours, plain spawn")


def start(
    cmd: list[str], port: int, log: Path, env: dict[str, str]
) -> tuple[subprocess.Popen, httpx.Client]:
    proc = subprocess.Popen(
        cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, **env}
    )
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


def measure(kind: str, models: Path, n: int, work: Path, out: dict[str, list[float]]) -> None:
    """One round of every case for ``kind``, appended to ``out``."""
    for case, extra in (
        ("cold", []),
        ("cold, router up 5 s", []),
        ("sleeping", ["--sleep-idle-seconds", "1"]),
        ("switch", ["--models-max", "1"]),
    ):
        port = free_port()
        base = (
            [str(llama_server_bin())]
            if kind == "llama-server"
            else [sys.executable, "-m", "server"]
        )
        env = {"LLAMA_ROUTER_ZYGOTE": "0"} if kind == "ours, plain spawn" else {}
        cmd = [*base, "--models-dir", str(models), "--port", str(port), "-c", "2048", "-np", "1"]
        log = work / f"{kind}-{case}-{n}.log".replace(" ", "_").replace(",", "")
        proc, c = start([*cmd, *extra], port, log, env)
        try:
            if case == "cold":
                out[case].append(timed(c, "gemma"))
            elif case.startswith("cold"):
                time.sleep(5)
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


def _median(values: list[float]) -> float:
    """The median of the requests that answered; NaN when more than half failed."""
    ok = [v for v in values if v == v]
    return statistics.median(ok) if len(ok) * 2 > len(values) else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--plain", action="store_true", help="also ours without the template")
    args = ap.parse_args()
    kinds = KINDS if args.plain else KINDS[:2]
    raw: dict[str, dict[str, list[float]]] = {k: {c: [] for c in CASES} for k in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        models = work / "models"
        models.mkdir()
        (models / "gemma.gguf").symlink_to(gemma_path())
        (models / "smollm2.gguf").symlink_to(smollm2_path())
        for n in range(args.rounds):
            for kind in kinds:
                measure(kind, models, n, work, raw[kind])
    res = {k: {c: _median(v) for c, v in raw[k].items()} for k in kinds}
    print("| first request | " + " | ".join(f"{k} (s)" for k in kinds) + " | ratio |")
    print("|---" * (len(kinds) + 2) + "|")
    for case in CASES:
        a, b = res["llama-server"][case], res["ours"][case]
        ratio = f"{b / a:.2f}x" if a == a and b == b else "-"
        cells = " | ".join(_fmt(res[k][case]) for k in kinds)
        print(f"| {case} | {cells} | {ratio} |")
    print("raw:", raw)


def _fmt(v: float) -> str:
    return "failed" if v != v else f"{v:.2f}"


if __name__ == "__main__":
    main()
