"""llama-server flags that were accepted and ignored, now acting: --api-prefix (every route
under the prefix, nothing outside it), --sse-ping-interval and the request's
``sse_ping_interval`` (SSE comment pings while a stream is silent), --reuse-port (two servers
on one port) and --kv-unified-per-slot (the per-slot context cap and the pool it sizes)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx

from tests.e2e.conftest import ROOT, ServerProc, free_port, gemma_path, long_text

PREFIX = "/llm/v2"


class PrefixedServer(ServerProc):
    """A server started with --api-prefix: its client (and readiness probe) use the prefix."""

    def wait_ready(self, timeout: float = 120) -> None:
        self.client = httpx.Client(base_url=self.url + PREFIX, timeout=120)
        super().wait_ready(timeout)


def test_api_prefix_serves_every_route_under_it_and_nothing_outside():
    s = PrefixedServer("--api-prefix", PREFIX + "/", "-np", "1", "-c", "2048")
    try:
        assert s.client.get("/health").json()["status"] == "ok"
        models = s.client.get("/v1/models").json()
        assert models["data"] and models["data"][0]["id"]
        r = s.client.post("/completion", json={"prompt": "Hello", "n_predict": 2})
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 2
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        assert s.client.post("/v1/chat/completions", json=chat).status_code == 200
        # llama-server registers every route at prefix + path, /health too: nothing else
        root = httpx.Client(base_url=s.url, timeout=30)
        for path in ("/health", "/v1/models", "/props", PREFIX, "/llm/v2x/health", "/llm/health"):
            r = root.get(path)
            assert r.status_code == 404, path
            assert r.json()["error"]["code"] == 404
        assert root.post("/completion", json={"prompt": "x"}).status_code == 404
        # The rules below see the path without the prefix: the cross-site guard refuses a
        # foreign page's state change of a local-only route, as it does without a prefix.
        foreign = {"Origin": "http://evil.example"}
        r = s.client.post("/slots/0?action=erase", headers=foreign)
        assert r.status_code == 403, r.text
        # an unknown route under the prefix is the app's own 404; the server keeps serving
        assert s.client.get("/nope").status_code == 404
        assert s.client.get("/health").status_code == 200
    finally:
        s.stop()


def test_api_prefix_and_pings_in_router_mode(tmp_path):
    """The router serves under the prefix (its instances do not: it forwards paths without
    it) and its instances' pings reach the client."""
    (tmp_path / "gemma.gguf").symlink_to(gemma_path())
    s = PrefixedServer("--models-dir", str(tmp_path), "--api-prefix", PREFIX, "-c", "2048")
    try:
        assert [m["id"] for m in s.client.get("/v1/models").json()["data"]] == ["gemma"]
        root = httpx.Client(base_url=s.url, timeout=30)
        assert root.get("/health").status_code == 404
        assert root.get("/v1/models").status_code == 404
        body = {"model": "gemma", "messages": [{"role": "user", "content": long_text(N_WORDS, 3)}]}
        body.update(max_tokens=4, sse_ping_interval=0.2)
        assert _check_stream(_stream_lines(s, "/v1/chat/completions", body)) >= 1
    finally:
        s.stop()


def _stream_lines(s: ServerProc, path: str, body: dict) -> list[str]:
    with s.client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return list(r.iter_lines())


def _check_stream(lines: list[str]) -> int:
    """The stream's ping comments (``:`` lines); every other line is an event's data or
    the blank line that ends it, and the stream ends as usual."""
    pings = sum(1 for ln in lines if ln == ":")
    for ln in lines:
        assert ln == ":" or ln == "" or ln.startswith("data: "), ln
    data = [ln[6:] for ln in lines if ln.startswith("data: ")]
    assert data[-1] == "[DONE]" or json.loads(data[-1]).get("stop") is True
    return pings


# A prompt whose prefill (about 900 tokens, no progress events asked) keeps the stream silent
# for well over the 0.2 s interval on any machine.
N_WORDS = 700


def test_sse_ping_interval_flag_pings_a_silent_stream_and_the_request_can_disable_it():
    s = ServerProc("--sse-ping-interval", "0.2", "-np", "1", "-c", "2048", "-b", "256")
    try:
        chat = {"messages": [{"role": "user", "content": long_text(N_WORDS, 1)}]}
        chat["max_tokens"] = 4
        pings = _check_stream(_stream_lines(s, "/v1/chat/completions", chat))
        assert pings >= 1
        # the request's sse_ping_interval wins over the flag: -1 (or 0) never pings
        for off in (-1, 0):
            body = {"prompt": long_text(N_WORDS, 2 + off), "n_predict": 4}
            body.update(sse_ping_interval=off, cache_prompt=False)
            assert _check_stream(_stream_lines(s, "/completion", body)) == 0
        r = s.client.post("/completion", json={"prompt": "x", "sse_ping_interval": -2})
        assert r.status_code == 400
    finally:
        s.stop()


def test_request_sse_ping_interval_pings_under_the_default(server):
    """The default (llama-server's 30 s) never pings a short stream; the request's field
    asks for a 0.2 s interval (Anthropic's stream, to cover another writer)."""
    body = {"model": "x", "max_tokens": 4, "cache_prompt": False}
    body["messages"] = [{"role": "user", "content": long_text(N_WORDS, 5)}]
    lines = _stream_lines(server, "/v1/messages", {**body, "sse_ping_interval": 0.2})
    assert sum(1 for ln in lines if ln == ":") >= 1
    assert any(ln.startswith("event: message_stop") for ln in lines)
    lines = _stream_lines(server, "/v1/messages", body)
    assert ":" not in lines


def _aliases_answering(s: ServerProc, want: set[str], timeout: float = 60) -> set[str]:
    """The model aliases seen answering ``s``'s port, each request on a new connection (the
    kernel spreads those over every socket bound to the port), until all of ``want``."""
    seen: set[str] = set()
    deadline = time.time() + timeout
    while not want <= seen and time.time() < deadline:
        try:
            seen.add(httpx.get(f"{s.url}/v1/models", timeout=30).json()["data"][0]["id"])
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    return seen


def test_reuse_port_lets_two_servers_share_a_port():
    port = free_port()
    args = ("--reuse-port", "-np", "1", "-c", "1024")
    a = ServerProc(*args, "--alias", "server-a", port=port)
    b = ServerProc(*args, "--alias", "server-b", port=port)
    try:
        # both bound at once: connections reach each (a b that could not bind never answers)
        assert {"server-a", "server-b"} <= _aliases_answering(a, {"server-a", "server-b"})
        assert a.proc.poll() is None and b.proc.poll() is None
        # without the flag the port is taken: that server exits instead of serving
        cmd = [sys.executable, "-m", "server", "--port", str(port), "-np", "1", "-c", "1024"]
        c = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert c.returncode != 0
        assert "address already in use" in (c.stdout + c.stderr).lower()
    finally:
        a.stop()
        b.stop()


def test_kv_unified_per_slot_caps_a_slot_and_sizes_the_pool():
    s = ServerProc("--kv-unified-per-slot", "512", "-np", "2")
    try:
        props = s.client.get("/props").json()
        assert (props["n_ctx"], props["n_ctx_slot"]) == (1024, 512)  # no -c: 2 * 512
        r = s.client.post("/completion", json={"prompt": long_text(600), "n_predict": 2})
        assert r.status_code == 400, r.text  # over a slot's 512 tokens
        assert s.client.post("/completion", json={"prompt": "Hi", "n_predict": 2}).is_success
    finally:
        s.stop()
    s = ServerProc("--kv-unified-per-slot", "512", "-np", "2", "-c", "4096")
    try:
        props = s.client.get("/props").json()
        assert (props["n_ctx"], props["n_ctx_slot"]) == (4096, 512)  # -c keeps the pool
    finally:
        s.stop()
