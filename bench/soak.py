"""The soak of issue 56: many clients for minutes, with images, priorities, named streams and
hostile inputs, loopback only: ``python -m bench.soak [--clients 32] [--seconds 180]``.

Starts one server on 127.0.0.1 (the default model, the tests' tiny vision projector,
``-np 4``, ``--scheduling-policy priority``, ``--cache-ram`` ``--ram-mib``, two API keys under
``--cache-isolation key``) and runs ``--clients`` threads that each send, until the time is up,
a random mix of: short text chats at priorities -8..4, chats with one or two images (of a
small pool, so images repeat within and across keys), long low-priority completions
(priority 10..13), named streams (``X-Conversation-Id``) that are read to the end, or left
early and replayed, looked up or deleted, tiny images with huge frames (each a 4xx) and tool
call arguments nested thousands deep (a 400).

It fails (exit status 1) on any 5xx, a dropped connection the client did not cause, a 408 on
a text-only chat (preparation must never queue it behind images), a long completion that did
not finish, the server's death, a failed ``/debug/integrity``, or a resident size after the
run (idle) more than the RAM cache's budget (+1/8 for its buffers, + ``RSS_SLACK_MIB``) above
the size after a warm-up. A check to run by hand (minutes, not a test): the tests that guard
each finding are in ``tests/``.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.conftest import ServerProc, vm_rss_kib  # noqa: E402
from tests.mmproj_gen import pixels, png, tiny_gif, write_gemma3_mmproj  # noqa: E402

KEYS = ("soak-k1", "soak-k2")
RSS_SLACK_MIB = 128
N_IMAGES = 8


def data_url(data: bytes, mime: str) -> str:
    import base64

    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@dataclass
class Tally:
    """What every client saw, by job kind; ``failures`` are the rule's breaches."""

    statuses: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, kind: str, status: int | str, ok: bool, why: str = "") -> None:
        with self.lock:
            self.statuses[f"{kind} {status}"] += 1
            if not ok:
                self.failures.append(f"{kind}: {status} {why}"[:300])


class Client:
    """One soak client: its own connection pool, key and random stream."""

    def __init__(self, url: str, n: int, tally: Tally, images: list[str]) -> None:
        self.url = url
        self.key = KEYS[n % len(KEYS)]
        self.rng = random.Random(n)
        self.tally = tally
        self.images = images
        self.n = n
        self.i = 0
        self.http = httpx.Client(
            base_url=url, timeout=300, headers={"Authorization": f"Bearer {self.key}"}
        )

    def run(self, until: float) -> None:
        jobs = [
            (self.text_chat, 30),
            (self.image_chat, 20),
            (self.named_stream, 18),
            (self.long_completion, 6),
            (self.huge_frames, 8),
            (self.deep_arguments, 8),
            (self.lookup, 10),
        ]
        fns, weights = zip(*jobs, strict=True)
        while time.monotonic() < until:
            job = self.rng.choices(fns, weights)[0]
            self.i += 1
            try:
                job()
            except httpx.TransportError as e:
                self.tally.note(job.__name__, type(e).__name__, False, str(e))

    def _check(self, kind: str, r: httpx.Response, allowed: tuple[int, ...] = ()) -> None:
        s = r.status_code
        ok = s < 500 and (s < 400 or s in allowed)
        self.tally.note(kind, s, ok, r.text[:200] if not ok else "")

    def _chat(self, content: object, priority: int, max_tokens: int) -> dict:
        return {
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "priority": priority,
        }

    def text_chat(self) -> None:
        words = " ".join(self.rng.choice(["sea", "sky", "tree", "stone"]) for _ in range(20))
        body = self._chat(f"Say something about {words}.", self.rng.randint(-8, 4), 16)
        # a 429 is the queue's honest answer under load; a 408 here is the stall
        self._check("text_chat", self.http.post("/v1/chat/completions", json=body), (429,))

    def image_chat(self) -> None:
        parts: list[dict] = [{"type": "text", "text": "What is in these pictures?"}]
        for _ in range(self.rng.randint(1, 2)):
            url = self.rng.choice(self.images)
            parts.append({"type": "image_url", "image_url": {"url": url}})
        body = self._chat(parts, self.rng.randint(-4, 8), 12)
        self._check("image_chat", self.http.post("/v1/chat/completions", json=body), (408, 429))

    def long_completion(self) -> None:
        body = {"prompt": "Once upon a time", "n_predict": 96, "ignore_eos": True}
        body["priority"] = self.rng.randint(10, 13)
        r = self.http.post("/completion", json=body)
        self._check("long_completion", r, (429,))
        if r.status_code == 200 and r.json().get("tokens_predicted") != 96:
            self.tally.note("long_completion", "short", False, r.text[:200])

    def named_stream(self) -> None:
        conv = f"soak-{self.n}-{self.i}"
        body = self._chat("Tell me a story.", self.rng.randint(-2, 6), 48) | {"stream": True}
        leave = self.rng.random() < 0.5
        with self.http.stream(
            "POST", "/v1/chat/completions", json=body, headers={"X-Conversation-Id": conv}
        ) as r:
            self._check("named_stream", r, (429,))
            if r.status_code != 200:
                r.read()
                return
            for n, _line in enumerate(r.iter_lines()):
                if leave and n >= 3:
                    break
        if not leave:
            return
        then = self.rng.choice(("replay", "delete", "lookup"))
        if then == "replay":
            r2 = self.http.get("/v1/stream", params={"conv_id": conv, "from": 0})
            self._check("replay", r2, (404,))  # 404: the stream was dropped (quota)
        elif then == "delete":
            self._check("delete", self.http.delete("/v1/stream", params={"conv_id": conv}))
        else:
            r3 = self.http.post("/v1/streams/lookup", json={"conversation_ids": [conv]})
            self._check("lookup", r3)

    def huge_frames(self) -> None:
        gif = data_url(tiny_gif(8192, 4096), "image/gif")  # 35 bytes, a huge frame
        parts: list[dict] = [{"type": "text", "text": "Describe."}]
        parts += [{"type": "image_url", "image_url": {"url": gif}}] * 16
        r = self.http.post("/v1/chat/completions", json=self._chat(parts, 0, 4))
        ok = 400 <= r.status_code < 500
        self.tally.note("huge_frames", r.status_code, ok, "" if ok else r.text[:200])

    def deep_arguments(self) -> None:
        depth = self.rng.randint(1000, 5000)
        call = {"id": "c1", "type": "function"}
        call["function"] = {"name": "f", "arguments": "[" * depth + "]" * depth}
        messages = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ]
        r = self.http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4})
        ok = r.status_code == 400
        self.tally.note("deep_arguments", r.status_code, ok, "" if ok else r.text[:200])

    def lookup(self) -> None:
        ids = [f"soak-{self.rng.randint(0, 64)}-{self.rng.randint(0, 40)}" for _ in range(64)]
        r = self.http.post("/v1/streams/lookup", json={"conversation_ids": ids})
        self._check("lookup", r)


def start_server(tmp: Path, ram_mib: int, threads: int) -> ServerProc:
    proj = write_gemma3_mmproj(tmp / "mmproj.gguf")
    args = ["--mmproj", str(proj), "-np", "4", "-c", "8192", "--scheduling-policy", "priority"]
    args += ["--cache-ram", str(ram_mib), "--api-key", ",".join(KEYS)]
    args += ["--cache-isolation", "key", "--metrics", "-t", str(threads)]
    return ServerProc(*args, env={"SOAK": "1"})


def warm_up(sp: ServerProc, images: list[str]) -> None:
    c = httpx.Client(base_url=sp.url, timeout=300, headers={"Authorization": f"Bearer {KEYS[0]}"})
    for url in images[:2]:
        parts = [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": url}}]
        body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 4}
        c.post("/v1/chat/completions", json=body).raise_for_status()


def settle(sp: ServerProc, timeout: float = 120) -> int:
    """Wait for idle slots; the server's RSS in KiB afterwards."""
    h = {"Authorization": f"Bearer {KEYS[0]}"}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        slots = sp.client.get("/slots", headers=h).json()
        if not any(s["is_processing"] for s in slots):
            break
        time.sleep(0.5)
    time.sleep(2)
    return vm_rss_kib(sp.proc.pid)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=180)
    ap.add_argument("--ram-mib", type=int, default=256, help="the server's --cache-ram")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    images = [data_url(png(pixels(seed)), "image/png") for seed in range(N_IMAGES)]
    tally = Tally()
    with tempfile.TemporaryDirectory() as d:
        sp = start_server(Path(d), a.ram_mib, a.threads)
        try:
            warm_up(sp, images)
            rss0 = settle(sp)
            until = time.monotonic() + a.seconds
            clients = [Client(sp.url, n, tally, images) for n in range(a.clients)]
            threads = [threading.Thread(target=c.run, args=(until,)) for c in clients]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            alive = sp.proc.poll() is None
            rss1 = settle(sp) if alive else 0
            h = {"Authorization": f"Bearer {KEYS[0]}"}
            integrity = sp.client.get("/debug/integrity", headers=h).json() if alive else {}
        finally:
            sp.stop()
    return report(a, tally, alive, integrity, rss0, rss1)


def report(
    a: argparse.Namespace, tally: Tally, alive: bool, integrity: dict, rss0: int, rss1: int
) -> int:
    budget_mib = a.ram_mib * 9 / 8 + RSS_SLACK_MIB
    grew_mib = (rss1 - rss0) / 1024
    print(json.dumps(dict(sorted(tally.statuses.items())), indent=1))
    print(f"server alive: {alive}; integrity: {integrity}")
    print(f"RSS after warm-up {rss0 / 1024:.0f} MiB, after the run {rss1 / 1024:.0f} MiB")
    print(f"(grew {grew_mib:.0f} MiB; the bound: {budget_mib:.0f} MiB)")
    fails = list(tally.failures)
    if not alive:
        fails.append("the server died")
    if alive and integrity.get("ok") is not True:
        fails.append(f"integrity: {integrity}")
    if alive and grew_mib > budget_mib:
        fails.append(f"RSS grew {grew_mib:.0f} MiB > {budget_mib:.0f}")
    for f in fails[:40]:
        print("FAIL", f)
    print(f"{len(fails)} failures" if fails else "every check held")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
