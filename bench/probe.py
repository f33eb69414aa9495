"""The adversarial probe of issue 40, loopback only: ``python -m bench.probe [--only NAME]``.

Starts its own servers on 127.0.0.1 (the default model with ``--cache-reuse`` and a LoRA
adapter; a router over the default model and SmolLM2 under ``--models-max 1``; a KV-events
publisher), sends each finding's requests, and reports per check whether it held: the
statuses seen (no 5xx anywhere), the longest gap between two tokens of a stream another
client keeps running meanwhile (the watcher; the rule is 1 s), and the server's RSS before
and after (flat: within ``RSS_SLACK_MIB``). Exit status 1 if any check failed.

It is a check to run by hand (minutes, not a test): the tests that guard each finding are in
``tests/``; this script shows the server as a whole under the issue's requests.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.conftest import ServerProc, gemma_path, smollm2_path, vm_rss_kib  # noqa: E402
from tests.lora_gen import write_adapter  # noqa: E402

EVIL = {"Origin": "http://evil.example"}
MAX_GAP_S = 1.0
RSS_SLACK_MIB = 64


@dataclass
class Result:
    name: str
    ok: bool
    detail: str


@dataclass
class Watcher:
    """A stream kept running on the server while a check runs: the gaps between its tokens."""

    url: str
    stamps: list[float] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        body = {"prompt": "Once upon a time", "n_predict": 400, "stream": True}
        body |= {"ignore_eos": True, "cache_prompt": False}
        with httpx.Client(timeout=600) as c:
            while not self.stop.is_set():
                with c.stream("POST", f"{self.url}/completion", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            self.stamps.append(time.monotonic())
                        if self.stop.is_set():
                            break

    def max_gap(self, since: float) -> float:
        ts = [t for t in self.stamps if t >= since]
        return max((b - a for a, b in zip(ts, ts[1:], strict=False)), default=float("inf"))


@contextmanager
def watching(url: str) -> Iterator[Watcher]:
    w = Watcher(url)
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while len(w.stamps) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield w
    finally:
        w.stop.set()
        t.join(30)


def raw_request(
    port: int, method: str, target: str, headers: dict[str, str], body: bytes = b""
) -> int:
    """Send ``target`` byte for byte (no client-side normalization of ``..`` or ``%2F``);
    the status code, or 0 if the connection closed without one."""
    head = [f"{method} {target} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Connection: close"]
    head += [f"{k}: {v}" for k, v in headers.items()]
    if body:
        head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        first = s.recv(64).split(b"\r\n", 1)[0].split()
    return int(first[1]) if len(first) > 1 and first[1].isdigit() else 0


def deep(n: int) -> bytes:
    return b'{"a":' * n + b"1" + b"}" * n


def check_paths(s: ServerProc, router: bool) -> Result:
    """Dot segments and encoded slashes never reach a local-only route from a web page."""
    q = "?model=gemma" if router else ""
    targets = ["/x/..%2Fslots", "/x/../slots", "/x/%2e%2e/slots", "/x/..%2fcache", "//slots"]
    targets += ["/x/..%5Cslots", "/v1/..%2F..%2Fslots"]
    seen = {t: raw_request(s.port, "GET", t + q, EVIL) for t in targets}
    erase = raw_request(
        s.port, "POST", f"/x/..%2Fslots/0?action=erase{q[1:] and '&' + q[1:]}", EVIL, b"{}"
    )
    seen["POST erase"] = erase
    bad = {t: c for t, c in seen.items() if c == 200 or c >= 500 or c == 0}
    return Result(f"paths ({'router' if router else 'server'})", not bad, json.dumps(seen))


def check_cross_site(s: ServerProc, posts: list[tuple[str, dict]]) -> Result:
    seen = {p: s.client.post(p, json=b, headers=EVIL).status_code for p, b in posts}
    bad = {p: c for p, c in seen.items() if c != 403}
    return Result("cross-site state changes", not bad, json.dumps(seen))


def check_deep_bodies(s: ServerProc, paths: list[str]) -> Result:
    seen = {}
    for p in paths:
        r = s.client.post(p, content=deep(20000), headers={"Content-Type": "application/json"})
        seen[p] = r.status_code
    bad = {p: c for p, c in seen.items() if c != 400}
    return Result("deeply nested bodies", not bad, json.dumps(seen))


def check_token_ids(s: ServerProc) -> Result:
    big = 10**9
    seen = {
        "/detokenize": s.client.post("/detokenize", json={"tokens": [1, big]}).status_code,
        "/v1/completions/render": s.client.post(
            "/v1/completions/render", json={"model": "x", "prompt": [1, big]}
        ).status_code,
        "/tokenize(-1)": s.client.post("/detokenize", json={"tokens": [-1]}).status_code,
    }
    bad = {p: c for p, c in seen.items() if c != 400}
    return Result("token ids outside the vocabulary", not bad, json.dumps(seen))


def abandon(url: str, path: str, body: bytes, after_s: float) -> int:
    """Post ``body`` and leave after ``after_s`` seconds; the status if it answered sooner."""
    try:
        with httpx.Client(timeout=after_s) as c:
            r = c.post(url + path, content=body, headers={"Content-Type": "application/json"})
            return r.status_code
    except httpx.TimeoutException:
        return 0


def check_heavy_renders(s: ServerProc) -> Result:
    """Six abandoned 20,000-message renders, then a 2-token chat; a stream meanwhile."""
    msgs = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i} " * 8}
        for i in range(20000)
    ]
    body = json.dumps({"model": "x", "messages": msgs, "max_tokens": 2}).encode()
    paths = ["/v1/messages/count_tokens", "/v1/chat/completions/render"] * 3
    with watching(s.url) as w:
        t0 = time.monotonic()
        threads = [threading.Thread(target=abandon, args=(s.url, p, body, 3.0)) for p in paths]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        c0 = time.monotonic()
        r = s.client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
            timeout=120,
        )
        chat_s = time.monotonic() - c0
        gap = w.max_gap(t0)
    ok = r.status_code == 200 and chat_s < 10 and gap < MAX_GAP_S
    return Result(
        "abandoned heavy renders", ok, f"chat {r.status_code} in {chat_s:.2f} s, gap {gap:.2f} s"
    )


def check_cache_reuse(s: ServerProc) -> Result:
    """3,000 cached tokens, then every other one substituted with n_cache_reuse 1."""
    toks = s.tokenize(" ".join(f"word{i % 97} item{i}" for i in range(700)))[:3000]
    s.client.post("/completion", json={"prompt": toks, "n_predict": 1, "cache_prompt": True})
    mangled = [t if i % 2 else 100 + (i % 50) for i, t in enumerate(toks)]
    body = json.dumps({"prompt": mangled, "n_predict": 4, "n_cache_reuse": 1}).encode()
    with watching(s.url) as w:
        t0 = time.monotonic()
        status = abandon(s.url, "/completion", body, 3.0)
        time.sleep(3.0)  # the watcher keeps streaming after the client left
        gap = w.max_gap(t0)
    busy = sum(1 for x in s.slots() if x["is_processing"])
    ok = gap < MAX_GAP_S and status < 500
    return Result(
        "cache reuse placement", ok, f"status {status}, gap {gap:.2f} s, busy slots after {busy}"
    )


def check_adapter_scales(s: ServerProc) -> Result:
    seen = {}
    for scale in (100.0, -100.0, 1e30):
        for extra in ({}, {"n_probs": 3}, {"json_schema": {"type": "object"}}):
            body = {"prompt": "Hello", "n_predict": 4, "lora": [{"id": 0, "scale": scale}], **extra}
            seen[f"{scale}:{','.join(extra)}"] = s.client.post("/completion", json=body).status_code
    seen["global 100"] = s.client.post("/lora-adapters", json=[{"id": 0, "scale": 100}]).status_code
    bad = {k: c for k, c in seen.items() if c >= 500 or c == 200}
    return Result("adapter scales", not bad, json.dumps(seen))


def check_alias(s: ServerProc) -> Result:
    """``model`` naming a --lora-alias runs under that adapter on /completion too."""
    r = s.client.post("/completion", json={"model": "styled", "prompt": "Hi", "n_predict": 1})
    got = r.json().get("lora") if r.status_code == 200 else None
    return Result(
        "--lora-alias as model on /completion", r.status_code == 200, f"{r.status_code} {got}"
    )


def single_server(tmp: Path) -> list[Result]:
    adapter = tmp / "a.gguf"
    write_adapter(gemma_path(), adapter, seed=1)
    s = ServerProc(
        "-np",
        "3",
        "-c",
        "12288",
        "--cache-reuse",
        "16",
        "--metrics",
        "--lora",
        str(adapter),
        "--lora-alias",
        f"styled={adapter}",
        "--slot-save-path",
        str(tmp / "slots"),
    )
    try:
        rss0 = vm_rss_kib(s.proc.pid)
        out = [
            check_paths(s, router=False),
            check_cross_site(
                s, [("/lora-adapters", [{"id": 0, "scale": 0.5}]), ("/slots/0?action=erase", {})]
            ),
            check_deep_bodies(
                s, ["/lora-adapters", "/slots/0?action=save", "/completion", "/v1/chat/completions"]
            ),
            check_token_ids(s),
            check_adapter_scales(s),
            check_alias(s),
            check_heavy_renders(s),
            check_cache_reuse(s),
        ]
        s.wait_idle(120)
        s.assert_integrity()
        rss1 = vm_rss_kib(s.proc.pid)
        grew = (rss1 - rss0) / 1024
        out.append(
            Result("server RSS", grew < RSS_SLACK_MIB * 4, f"{rss0 // 1024} -> {rss1 // 1024} MiB")
        )
        return out
    finally:
        s.stop()


def router_checks(tmp: Path) -> list[Result]:
    d = tmp / "models"
    d.mkdir()
    (d / "gemma.gguf").symlink_to(gemma_path())
    (d / "smollm2.gguf").symlink_to(smollm2_path())
    r = ServerProc(
        "--models-dir", str(d), "-c", "2048", "-np", "2", "--models-max", "1", "--ui-mcp-proxy"
    )
    try:
        out = [check_paths(r, router=True)]
        posts = [("/models/load", {"model": "smollm2"}), ("/models/unload", {"model": "gemma"})]
        out.append(check_cross_site(r, posts))
        reload = r.client.get("/models?reload=1", headers=EVIL).status_code
        out.append(Result("cross-site reload", reload == 403, str(reload)))
        listing = r.client.get("/models", headers=EVIL).text
        out.append(
            Result("/models hides paths", str(d) not in listing and "--port" not in listing, "")
        )
        out.append(check_deep_bodies(r, ["/models/load", "/v1/chat/completions"]))
        out.append(check_start_queue(r))
        return out
    finally:
        r.stop()


def check_start_queue(r: ServerProc) -> Result:
    """--models-max 1: load one model, then a chat for the other is served once it is up."""
    r.client.post("/models/load", json={"model": "gemma"})
    t0 = time.monotonic()
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    res = r.client.post("/v1/chat/completions", json=chat, timeout=180)
    took = time.monotonic() - t0
    return Result(
        "router start queue",
        res.status_code == 200 and took < 60,
        f"{res.status_code} in {took:.1f} s",
    )


def kv_event_checks(tmp: Path) -> list[Result]:
    """A wildcard bind is refused; oversize raw subscriptions do not grow the server."""
    import subprocess

    argv = [sys.executable, "-m", "server", "--port", str(free_tcp_port())]
    wild = subprocess.Popen(
        [*argv, "--kv-events-endpoint", "tcp://*:5599"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        text, _ = wild.communicate(timeout=60)  # refused: it exits at once
    except subprocess.TimeoutExpired:
        wild.kill()
        text, _ = wild.communicate()
    refused = wild.returncode not in (None, 0, -9)
    out = [Result("KV events: wildcard bind refused", refused, text.strip()[-200:])]
    port = free_tcp_port()
    s = ServerProc("--kv-events-endpoint", f"tcp://127.0.0.1:{port}")
    try:
        rss0 = vm_rss_kib(s.proc.pid)
        for _ in range(4):
            flood_subscriptions(port, 50, 1 << 20)
        time.sleep(3)
        rss1 = vm_rss_kib(s.proc.pid)
        grew = (rss1 - rss0) / 1024
        out.append(
            Result("KV events: raw subscriptions", grew < RSS_SLACK_MIB, f"RSS +{grew:.0f} MiB")
        )
    finally:
        s.stop()
    return out


def free_tcp_port() -> int:
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return int(so.getsockname()[1])


def flood_subscriptions(port: int, n: int, size: int) -> None:
    """A raw ZMTP 3.0 peer (SUB, NULL mechanism) sending ``n`` subscriptions of ``size`` bytes."""
    greeting = (
        b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32
    )
    meta = b"\x0bSocket-Type" + (3).to_bytes(4, "big") + b"SUB"
    ready = b"\x05READY" + meta
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as so:
            so.sendall(greeting + b"\x04" + bytes([len(ready)]) + ready)
            for _ in range(n):
                payload = b"\x01" + b"x" * (size - 1)
                so.sendall(b"\x02" + len(payload).to_bytes(8, "big") + payload)
    except OSError:
        pass  # the server may drop an oversize peer: what the check wants


CHECKS: dict[str, Callable[[Path], list[Result]]] = {
    "server": single_server,
    "router": router_checks,
    "kv": kv_event_checks,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=sorted(CHECKS), action="append")
    args = ap.parse_args()
    results: list[Result] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or list(CHECKS):
            sub = Path(tmp) / name
            sub.mkdir()
            results += CHECKS[name](sub)
    for r in results:
        print(f"{'ok  ' if r.ok else 'FAIL'} {r.name}: {r.detail}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
