"""The serving ceiling: the server's own CPU per delivered token, with a free model.

The engine runs on ``bench.step_cost``'s ``NullBackend`` (decode and sampling cost nothing)
behind the real app (``server.http.app.create_app``: every route and middleware) and
uvicorn, in a server process of its own; N clients in this process send requests
concurrently (raw HTTP/1.1 over asyncio streams, so the client costs little of the
machine's CPU). Reported per configuration: the server process's CPU time (user + system,
all threads, read from ``/proc/<pid>/stat``) per generated token delivered, and tokens per
second delivered. Every configuration runs ``--rounds`` times; best and median are given
(the least disturbed round is the measure on a shared machine).

    python -m bench.ceiling                                  # the full matrix
    python -m bench.ceiling --streams 64 --endpoints cmpl --modes stream --rounds 3
    python -m bench.ceiling --decode-ms 2                    # a model step of 2 ms

``--decode-ms``: each decode sleeps that long (the GIL released, as llama_decode does),
which stands for a GPU's step; 0 (the default) is the ceiling itself, where the engine
runs ahead of every reader.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

from bench.cpu import _TICK, ForeignCpu, _proc_jiffies

ENDPOINTS = {
    "cmpl": "/v1/completions",
    "chat": "/v1/chat/completions",
    "native": "/completion",
}
PROMPT = "The quick brown fox jumps over the lazy dog and keeps running through the field"
_PREDICTED = re.compile(rb'"(?:predicted_n|tokens_predicted)":\s*(\d+)')


# ---- the server process ---------------------------------------------------------


def _ceiling_backend(n_seq: int, decode_ms: float):  # noqa: ANN202 (test-only types)
    """NullBackend with a word tokenizer and a few-byte piece per token (``" tok"``)."""
    from bench.step_cost import NullBackend

    class CeilingBackend(NullBackend):
        bos_text = "<bos>"
        eos_text = "<eos>"
        n_ctx_train = 1 << 20
        n_params = 0
        model_size = 0
        chat_template = None
        architecture = "gemma3"

        def tokenize(self, text: str, add_special: bool = False, parse_special: bool = False):
            return [hash(w) % 800 + 1 for w in text.split()] or [1]

        def detokenize(self, tokens: list[int]) -> str:
            return " tok" * len(tokens)

        def token_to_piece(self, token: int, special: bool = False) -> bytes:
            return b" tok"

        def close(self) -> None:
            pass

        def decode(self, start: int, count: int) -> int:
            if decode_ms > 0:
                time.sleep(decode_ms / 1e3)
            return 0

    return CeilingBackend(n_seq)


def serve(port: int, slots: int, decode_ms: float) -> None:
    """Run the real app on the ceiling backend (``load`` replaced: no model file)."""
    import uvicorn

    from server.engine.engine import Engine
    from server.http import app as app_module
    from server.http.heap import settle_heap
    from server.settings.config import Settings
    from server.templates.chat_template import BUILTIN_TEMPLATES, ChatTemplate

    def load(st) -> None:  # noqa: ANN001
        b = _ceiling_backend(slots, decode_ms)
        st.backend = b
        st.model_name = st.model_path = "null"
        st.template = ChatTemplate(BUILTIN_TEMPLATES["gemma"], "<bos>", "<eos>", name="gemma")
        engine = Engine(b, app_module.engine_options(st.settings, False))
        engine.stats.observers.append(st.metrics.observe)
        engine.start()
        st.engine = engine
        st.loading = False

    app_module.load = load  # type: ignore[assignment]
    settings = Settings(parallel=slots, cache_ram=0, webui=False, port=port, prefix_share=False)
    app = app_module.create_app(settings)
    settle_heap()  # as server.cli.main does
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# ---- the clients ----------------------------------------------------------------


def _body(endpoint: str, stream: bool, n_tokens: int) -> bytes:
    if endpoint == "chat":
        body = {
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": n_tokens,
        }
    elif endpoint == "cmpl":
        body = {"prompt": PROMPT, "max_tokens": n_tokens}
    else:
        body = {"prompt": PROMPT, "n_predict": n_tokens}
    body.update(stream=stream, temperature=0, ignore_eos=True, model="null")
    return json.dumps(body).encode()


async def _request(port: int, path: str, body: bytes) -> tuple[int, int]:
    """One request; (tokens delivered, SSE events). The whole response is read to EOF
    (``Connection: close``); the token count is the last ``predicted_n`` it holds."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    writer.write(head + body)
    data = await reader.read(-1)
    writer.close()
    if not data.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"{path}: {data[:300]!r}")
    found = _PREDICTED.findall(data)
    if not found:
        raise RuntimeError(f"{path}: no token count in {data[-300:]!r}")
    return int(found[-1]), data.count(b"data: ")


@dataclass
class Round:
    cpu_s: float
    wall_s: float
    tokens: int
    events: int
    foreign: float | None
    loop_cpu_s: float = 0.0  # of cpu_s: the event loop's thread
    steps: int = 0  # the engine's decode steps

    @property
    def us_per_token(self) -> float:
        return self.cpu_s / max(1, self.tokens) * 1e6

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s


async def _round(
    pid: int, port: int, endpoint: str, stream: bool, streams: int, per_client: int, n: int
) -> Round:
    body = _body(endpoint, stream, n)
    path = ENDPOINTS[endpoint]

    async def client() -> tuple[int, int]:
        tok = ev = 0
        for _ in range(per_client):
            t, e = await _request(port, path, body)
            tok, ev = tok + t, ev + e
        return tok, ev

    foreign = ForeignCpu(lambda: [pid])
    foreign.start()
    s0 = await _n_steps(port)
    j0, m0, t0 = _proc_jiffies(pid), _thread_jiffies(pid), time.perf_counter()
    got = await asyncio.gather(*(client() for _ in range(streams)))
    wall, j1, m1 = time.perf_counter() - t0, _proc_jiffies(pid), _thread_jiffies(pid)
    steps = await _n_steps(port) - s0
    return Round(
        (j1 - j0) / _TICK,
        wall,
        sum(t for t, _ in got),
        sum(e for _, e in got),
        foreign.stop(),
        (m1 - m0) / _TICK,
        steps,
    )


def _thread_jiffies(pid: int) -> int:
    """utime + stime of the server's main thread: uvicorn's event loop (the engine and the
    rest run on other threads)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/stat") as f:
            tail = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(tail[11]) + int(tail[12])


@dataclass
class Result:
    endpoint: str
    stream: bool
    streams: int
    rounds: list[Round] = field(default_factory=list)

    def row(self) -> str:
        us = [r.us_per_token for r in self.rounds]
        ts = [r.tok_s for r in self.rounds]
        best = min(self.rounds, key=lambda r: r.us_per_token)
        per_tok = best.events / max(1, best.tokens)
        fg = max((r.foreign or 0.0) for r in self.rounds)
        loop = best.loop_cpu_s / best.cpu_s * 100 if best.cpu_s else 0.0
        per_step = best.tokens / max(1, best.steps)
        return (
            f"| `{ENDPOINTS[self.endpoint]}` | {'stream' if self.stream else 'whole'} "
            f"| {self.streams} | {min(us):.1f} | {statistics.median(us):.1f} "
            f"| {max(ts):,.0f} | {statistics.median(ts):,.0f} | {per_tok:.2f} | {per_step:.1f} | {loop:.0f} % "
            f"| {fg:.2f} |"
        )


HEADER = (
    "| endpoint | mode | streams | server CPU/token, best µs ↓ | median µs ↓ "
    "| tok/s, best ↑ | median ↑ | SSE events/token | tokens/step "
    "| event loop's share | other load, cores |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


def _start_server(port: int, slots: int, decode_ms: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "bench.ceiling", "--serve", str(port), "--slots", str(slots)]
    cmd += ["--decode-ms", str(decode_ms)]
    proc = subprocess.Popen(cmd, cwd=os.path.dirname(os.path.dirname(__file__)) or ".")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            r = asyncio.run(_get_health(port))
            if r:
                return proc
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the ceiling server did not start")


async def _get(port: int, path: str) -> bytes | None:
    """The body of ``GET path``, None unless 200."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    data = await reader.read(-1)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return body if head.startswith(b"HTTP/1.1 200") else None


async def _get_health(port: int) -> bool:
    return await _get(port, "/health") is not None


async def _n_steps(port: int) -> int:
    """The engine's decode steps so far (/props ``engine.n_steps``)."""
    body = await _get(port, "/props")
    return json.loads(body)["engine"]["n_steps"] if body else 0


def _profiler(out: str | None, pid: int, streams: int) -> subprocess.Popen | None:
    """``py-spy record --gil`` of the server (the thread holding the GIL: where the CPU goes) into
    ``out``-<streams>.txt as collapsed stacks; py-spy from $PY_SPY or PATH (dev only)."""
    if not out:
        return None
    cmd = [os.environ.get("PY_SPY", "py-spy"), "record", "-p", str(pid), "-r", "200", "--gil"]
    cmd += ["-f", "raw", "-o", f"{out}-{streams}.txt"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


_IDLE = ("_worker (concurrent/futures/thread.py", "Condition.wait", "select (selectors.py")


def summarise(path: str, top: int = 25) -> str:
    """The busy samples of a py-spy raw profile: the share of each function, inclusive of
    what it calls (idle waits left out)."""
    incl: dict[str, int] = {}
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            frames = stack.split(";")
            if not frames or any(frames[-1].startswith(i) for i in _IDLE):
                continue
            total += int(n)
            for fr in set(frames):
                key = re.sub(r" \(.*/(site-packages|python3\.\d+)/", " (", fr)
                incl[key] = incl.get(key, 0) + int(n)
    rows = sorted(incl.items(), key=lambda kv: -kv[1])[:top]
    return "\n".join(f"{n / max(1, total) * 100:5.1f} %  {fr}" for fr, n in rows)


def run_matrix(args: argparse.Namespace) -> list[Result]:
    results: list[Result] = []
    for streams in args.streams:
        proc = _start_server(args.port, streams, args.decode_ms)
        spy = _profiler(args.profile, proc.pid, streams)
        try:
            for endpoint in args.endpoints:
                for mode in args.modes:
                    res = Result(endpoint, mode == "stream", streams)
                    per_client = max(1, -(-args.min_tokens // (streams * args.tokens)))
                    go = (proc.pid, args.port, endpoint, res.stream, streams)
                    asyncio.run(_round(*go, 1, args.tokens))  # warm-up
                    for _ in range(args.rounds):
                        res.rounds.append(asyncio.run(_round(*go, per_client, args.tokens)))
                    print(res.row(), flush=True)
                    results.append(res)
        finally:
            if spy is not None:
                spy.send_signal(2)  # py-spy writes its profile on SIGINT
                spy.wait(30)
                print(summarise(f"{args.profile}-{streams}.txt", 60), flush=True)
            proc.terminate()
            proc.wait(15)
    return results


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    p.add_argument("--slots", type=int, default=64, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=18733)
    p.add_argument("--streams", type=int, nargs="+", default=[8, 64, 256])
    p.add_argument("--endpoints", nargs="+", default=list(ENDPOINTS), choices=list(ENDPOINTS))
    p.add_argument("--modes", nargs="+", default=["stream", "whole"], choices=["stream", "whole"])
    p.add_argument("--tokens", type=int, default=128, help="tokens per request")
    p.add_argument("--min-tokens", type=int, default=32768, help="tokens per round, at least")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--decode-ms", type=float, default=0.0)
    p.add_argument("--profile", metavar="PREFIX", help="py-spy record the server to PREFIX-N.txt")
    args = p.parse_args(argv)
    if args.serve:
        serve(args.serve, args.slots, args.decode_ms)
        return
    load = open("/proc/loadavg").read().split()[:3]
    print(
        f"machine: {os.cpu_count()} cores, load average {' '.join(load)}; decode {args.decode_ms} ms"
    )
    print(HEADER, flush=True)
    run_matrix(args)


if __name__ == "__main__":
    main(sys.argv[1:])
