"""A fleet on one machine: several real replicas of this server, a mixed multi-turn chat
workload whose conversations share a few system prompts, routed three ways:

- ``round-robin``: request i to replica i mod N;
- ``affinity``: nginx's conversation affinity (docker/nginx): a hash of the conversation's
  first user message picks the replica;
- ``precise``: llm-d's precise prefix-cache scorer, fed by the replicas' KV events
  (--kv-events-endpoint), implemented here only: the prompt is rendered by a replica's
  /v1/chat/completions/render, cut into blocks hashed as llm-d's indexer does, and each
  replica scores the longest run of leading blocks it holds, each block weighted by its
  best medium (gpu 1.0, cpu 0.8, disk 0.5: llm-d's defaults plus the disk tier), divided by
  the prompt's blocks; llm-d's queue scorer (1 - waiting/max) and KV-use scorer (1 - use)
  join it with the weights of docker/k8s/llm-d/epp-config.yaml (2, 1, 1); the best wins.

Reports per policy: prompt tokens computed (prompt tokens minus cached), TTFT p50/p95 and
wall time. ``python -m bench.fleet [--replicas 3] [--conversations 9] [--turns 3]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgpack
import zmq

from server.kv_events.kv_blocks import BlockHasher

ROOT = Path(__file__).resolve().parent.parent
MODEL = "fleet"
BS = 16
WEIGHTS = {"GPU": 1.0, "CPU": 0.8, "DISK": 0.5}
SYSTEMS = [
    "You are a support agent for a printing company. " + "Answer politely, cite the manual. " * 30,
    "You are a history tutor. " + "Explain dates, places and people in short sentences. " * 30,
    "You are a code reviewer. " + "Point at bugs first, style last, and be concrete. " * 30,
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Replica:
    port: int
    zport: int
    proc: subprocess.Popen
    client: httpx.Client
    held: dict[str, set[int]] = field(default_factory=lambda: {m: set() for m in WEIGHTS})

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start_replica(threads: int, log_dir: Path) -> Replica:
    port, zport = free_port(), free_port()
    argv = [sys.executable, "-m", "server", "--port", str(port), "-t", str(threads), "-np", "2",
            "-c", "8192", "--metrics", "-a", MODEL, "--cache-ram", "256",
            "--kv-events-endpoint", f"tcp://127.0.0.1:{zport}"]  # fmt: skip
    log = open(log_dir / f"replica-{port}.log", "w")
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    r = Replica(port, zport, proc, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300))
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            if r.client.get("/health").status_code == 200:
                return r
        except httpx.TransportError:
            time.sleep(0.3)
    raise RuntimeError(f"replica on {port} did not start")


class EventIndex:
    """llm-d's view of the fleet, from the replicas' KV events (one SUB per replica)."""

    def __init__(self, replicas: list[Replica]) -> None:
        self.ctx = zmq.Context()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.gaps = 0
        self.threads = [
            threading.Thread(target=self._run, args=(r,), daemon=True) for r in replicas
        ]
        for t in self.threads:
            t.start()

    def _run(self, r: Replica) -> None:
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sock.connect(f"tcp://127.0.0.1:{r.zport}")
        last = -1
        while not self.stop.is_set():
            if not sock.poll(50):
                continue
            _topic, seq_b, payload = sock.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            if last >= 0 and seq != last + 1:
                self.gaps += 1
            last = seq
            _ts, events, _rank = msgpack.unpackb(payload)
            with self.lock:
                for ev in events:
                    self._apply(r, ev)
        sock.close(0)

    @staticmethod
    def _apply(r: Replica, ev: list) -> None:
        if ev[0] == "BlockStored":
            r.held[ev[6]].update(ev[1])
        elif ev[0] == "BlockRemoved":
            r.held[ev[2]].difference_update(ev[1])
        elif ev[0] == "AllBlocksCleared":
            for s in r.held.values():
                s.clear()

    def prefix_score(self, r: Replica, keys: list[int]) -> float:
        """llm-d's rule: the leading blocks held without a break, each at its best medium's
        weight, over the prompt's blocks."""
        score = 0.0
        with self.lock:
            for k in keys:
                w = max((WEIGHTS[m] for m, s in r.held.items() if k in s), default=0.0)
                if w == 0.0:
                    break
                score += w
        return score / max(1, len(keys))

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(2)
        self.ctx.term()


def load_scores(r: Replica) -> tuple[float, float]:
    """(waiting, KV use) from the replica's protocol metrics."""
    waiting = use = 0.0
    for line in r.client.get("/metrics").text.splitlines():
        if line.startswith("vllm:num_requests_waiting"):
            waiting = float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:kv_cache_usage_perc"):
            use = float(line.rsplit(" ", 1)[1])
    return waiting, use


class Router:
    def __init__(self, policy: str, replicas: list[Replica], index: EventIndex | None) -> None:
        self.policy, self.replicas, self.index = policy, replicas, index
        self.n = 0
        self.lock = threading.Lock()
        self.hasher = BlockHasher(BS, MODEL)

    def pick(self, body: dict) -> Replica:
        if self.policy == "round-robin":
            with self.lock:
                self.n += 1
                return self.replicas[(self.n - 1) % len(self.replicas)]
        if self.policy == "affinity":
            first = next(m["content"] for m in body["messages"] if m["role"] == "user")
            h = int(hashlib.md5(first.encode()).hexdigest(), 16)
            return self.replicas[h % len(self.replicas)]
        return self._precise(body)

    def _precise(self, body: dict) -> Replica:
        assert self.index is not None
        rendered = self.replicas[0].client.post("/v1/chat/completions/render", json=body)
        keys = self.hasher.hashes(rendered.json()["token_ids"])
        best, best_score = self.replicas[0], -1.0
        for r in self.replicas:
            waiting, use = load_scores(r)
            score = 2.0 * self.index.prefix_score(r, keys) + (1.0 - use) + 1.0 / (1.0 + waiting)
            if score > best_score:
                best, best_score = r, score
        return best


@dataclass
class Turn:
    prompt_tokens: int
    cached: int
    ttft_s: float


def chat(r: Replica, body: dict) -> tuple[Turn, str]:
    """One streamed chat completion: its token accounting, time to first token, answer."""
    t0 = time.perf_counter()
    ttft, text, usage = 0.0, [], {}
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with r.client.stream("POST", "/v1/chat/completions", json=stream) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices", []):
                piece = ch.get("delta", {}).get("content")
                if piece:
                    ttft = ttft or time.perf_counter() - t0
                    text.append(piece)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return Turn(usage["prompt_tokens"], cached, ttft or time.perf_counter() - t0), "".join(text)


def conversation(i: int, turns: int, router: Router, max_tokens: int) -> list[Turn]:
    msgs = [{"role": "system", "content": SYSTEMS[i % len(SYSTEMS)]}]
    out = []
    for t in range(turns):
        msgs.append({"role": "user", "content": f"Customer {i}, question {t}: tell me more."})
        body = {"model": MODEL, "messages": msgs, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        turn, answer = chat(router.pick(body), body)
        out.append(turn)
        msgs.append({"role": "assistant", "content": answer})
    return out


def run_policy(policy: str, args: argparse.Namespace, log_dir: Path) -> dict:
    replicas = [start_replica(args.threads, log_dir) for _ in range(args.replicas)]
    index = EventIndex(replicas) if policy == "precise" else None
    time.sleep(0.5)  # the subscribers connect
    try:
        router = Router(policy, replicas, index)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            futs = [pool.submit(conversation, i, args.turns, router, args.max_tokens)
                    for i in range(args.conversations)]  # fmt: skip
            turns = [t for f in futs for t in f.result()]
        wall = time.perf_counter() - t0
    finally:
        if index is not None:
            index.close()
        for r in replicas:
            r.proc.terminate()
        for r in replicas:
            r.proc.wait(30)
    ttfts = sorted(t.ttft_s for t in turns)
    return {
        "policy": policy,
        "requests": len(turns),
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "prompt_tokens_computed": sum(t.prompt_tokens - t.cached for t in turns),
        "ttft_p50_s": round(statistics.median(ttfts), 3),
        "ttft_p95_s": round(ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))], 3),
        "wall_s": round(wall, 2),
        "event_gaps": index.gaps if index is not None else 0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--conversations", type=int, default=9)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 3))
    p.add_argument("--policies", default="round-robin,affinity,precise")
    p.add_argument("--out", default="")
    args = p.parse_args()
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "fleet-bench"
    log_dir.mkdir(exist_ok=True)
    results = []
    for pol in args.policies.split(","):
        results.append(run_policy(pol, args, log_dir))
        print(json.dumps(results[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
