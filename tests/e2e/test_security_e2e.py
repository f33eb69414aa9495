"""Keys, CORS, bad input, hostile templates, disconnect storms, backpressure, timeouts, SIGTERM."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from .conftest import ServerProc, long_text


@pytest.fixture(scope="module")
def keyed(tmp_path_factory) -> ServerProc:
    d = tmp_path_factory.mktemp("keys")
    (d / "keys.txt").write_text("# keys\nk3-from-file\n\n")
    s = ServerProc(
        "--api-key-file",
        str(d / "keys.txt"),
        "--metrics",
        "-np",
        "2",
        "-c",
        "2048",
        "--max-body-mb",
        "0.5",
        env={"LLAMA_API_KEY": "k1,k2"},
    )
    yield s
    s.stop()


PROTECTED = [
    ("GET", "/v1/models", None),
    ("GET", "/props", None),
    ("GET", "/slots", None),
    ("GET", "/metrics", None),
    ("GET", "/cache", None),
    ("GET", "/debug/integrity", None),
    ("POST", "/tokenize", {"content": "hi"}),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    ),
    ("POST", "/completion", {"prompt": "hi", "n_predict": 1}),
    ("POST", "/detokenize", {"tokens": [1]}),
]


def call(s, method, path, body, headers=None):
    return s.client.request(method, path, json=body, headers=headers or {})


@pytest.mark.parametrize("method,path,body", PROTECTED)
def test_key_matrix(keyed, method, path, body):
    r = call(keyed, method, path, body)
    assert r.status_code == 401
    assert r.json() == {
        "error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}
    }
    assert call(keyed, method, path, body, {"Authorization": "Bearer wrong"}).status_code == 401
    assert call(keyed, method, path, body, {"X-Api-Key": "k1x"}).status_code == 401
    assert call(keyed, method, path, body, {"Authorization": "Bearer k1"}).status_code == 200
    assert call(keyed, method, path, body, {"X-Api-Key": "k2"}).status_code == 200
    assert (
        call(keyed, method, path, body, {"Authorization": "Bearer k3-from-file"}).status_code == 200
    )


def test_completions_is_the_native_route_behind_the_key(keyed):
    # llama-server's /completions is /completion (its test_security posts there with a key)
    body = {"prompt": "I believe the meaning of life is", "n_predict": 2}
    assert call(keyed, "POST", "/completions", body).status_code == 401
    for headers in ({"Authorization": "Bearer k1"}, {"X-Api-Key": "k2"}):
        r = call(keyed, "POST", "/completions", body, headers)
        assert r.status_code == 200 and "content" in r.json() and "error" not in r.json()


def test_health_is_public(keyed):
    assert keyed.client.get("/health").json() == {"status": "ok"}


def test_cors_preflight_is_answered(keyed):
    r = keyed.client.options(
        "/v1/chat/completions",
        headers={
            "Origin": "https://example.org",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    # llama-server's answer: the Origin echoed back, with credentials (--cors-credentials)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "https://example.org"
    assert r.headers["access-control-allow-credentials"] == "true"
    assert r.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
    r = keyed.client.get("/health", headers={"Origin": "https://example.org"})
    assert r.headers["access-control-allow-origin"] == "https://example.org"


def test_body_over_limit_is_413(keyed):
    big = {"prompt": "x" * 600_000, "max_tokens": 1}
    r = keyed.client.post("/completion", json=big, headers={"X-Api-Key": "k1"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"

    def chunks():
        for _ in range(6):
            yield b"x" * 100_000

    r = keyed.client.post("/completion", content=chunks(), headers={"X-Api-Key": "k1"})
    assert r.status_code == 413


BAD = [
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ', "invalid_request_error"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, "invalid_request_error"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, "invalid_request_error"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "invalid_request_error"),
    ("/v1/completions", {"prompt": "hi", "n": 10_000}, "invalid_request_error"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 500}, "invalid_request_error"),
    ("/v1/completions", {"prompt": "hi", "top_k": -1}, "invalid_request_error"),
    ("/v1/completions", {"prompt": "hi", "top_k": 10_000_000}, "invalid_request_error"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "invalid_request_error"),
    ("/v1/completions", {"prompt": [999_999_999], "max_tokens": 1}, "invalid_request_error"),
    ("/v1/completions", {"prompt": [1, -5], "max_tokens": 1}, "invalid_request_error"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 5}}, "invalid_request_error"),
    ("/v1/completions", {"prompt": "hi", "id_slot": 99}, "invalid_request_error"),
    ("/v1/completions", {"prompt": []}, "invalid_request_error"),
    ("/v1/completions", [1, 2, 3], "invalid_request_error"),
    ("/v1/completions", {"prompt": long_text(3000)}, "exceed_context_size_error"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "wizard", "content": "hi"}]},
        "invalid_request_error",
    ),
    ("/v1/chat/completions", {"messages": []}, "invalid_request_error"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "invalid_request_error",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3},
        "invalid_request_error",
    ),
    ("/completion", {"prompt": "hi", "n_probs": 10_000}, "invalid_request_error"),
    ("/completion", {"prompt": "hi", "stop": ["x" * 5000]}, "invalid_request_error"),
    ("/completion", {"prompt": "hi", "n_predict": -7}, "invalid_request_error"),
    ("/completion", {"prompt": "hi", "repeat_last_n": -9}, "invalid_request_error"),
    ("/completion", {"prompt": "hi", "timeout": -1}, "invalid_request_error"),
    ("/detokenize", {"tokens": [10**12]}, "invalid_request_error"),
    ("/tokenize", {"content": 5}, "invalid_request_error"),
]


def test_bad_input_matrix(make_server):
    s = make_server("-np", "2", "-c", "2048")
    for path, body, etype in BAD:
        if isinstance(body, bytes):
            r = s.client.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            r = s.client.post(path, json=body)
        assert r.status_code == 400, (path, body, r.text)
        err = r.json()["error"]
        assert err["type"] == etype and err["code"] == 400 and err["message"], (path, body, err)
        assert "Traceback" not in r.text
    r = s.client.post("/v1/completions", json={"prompt": long_text(3000)})
    assert r.json()["error"]["n_ctx"] == 2048 and r.json()["error"]["n_prompt_tokens"] > 2048
    # still serving, nothing leaked (ignore_eos: 3 tokens whatever the random seed samples)
    after = {"prompt": "Hello", "n_predict": 3, "ignore_eos": True}
    assert s.client.post("/completion", json=after).json()["tokens_predicted"] == 3
    assert not any(x["is_processing"] for x in s.slots())


def test_hostile_chat_template_executes_nothing(make_server, tmp_path: Path):
    marker = tmp_path / "pwned"
    tpl = tmp_path / "evil.jinja"
    tpl.write_text(
        "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}"
        "{{ ''.__class__.__mro__[1].__subclasses__() }}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    s = make_server("--chat-template-file", str(tpl), "-np", "1", "-c", "1024")
    r = s.client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert r.status_code == 500
    assert "unsafe" in r.json()["error"]["message"]
    assert not marker.exists()
    assert s.client.post("/completion", json={"prompt": "ok", "n_predict": 2}).status_code == 200


def test_template_raise_exception_is_a_client_error(make_server, tmp_path: Path):
    tpl = tmp_path / "strict.jinja"
    tpl.write_text(
        "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be user') }}"
        "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    s = make_server("--chat-template-file", str(tpl), "-np", "1", "-c", "1024")
    r = s.client.post(
        "/v1/chat/completions",
        # a final assistant message would be continued, not rendered: a user one follows
        json={
            "messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "ok"}]
        },
    )
    assert r.status_code == 400 and "first message must be user" in r.json()["error"]["message"]


@pytest.mark.serial  # timed or racing: runs alone
def test_storm_of_clients_with_early_disconnects(make_server):
    s = make_server("--metrics", "-np", "4", "-c", "4096")
    results = {"ok": 0, "dropped": 0, "errors": []}
    lock = threading.Lock()

    def client(i: int) -> None:
        body = {"prompt": f"Client {i} says:", "max_tokens": 24, "stream": True, "ignore_eos": True}
        try:
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=120) as r:
                for n, line in enumerate(r.iter_lines()):
                    if i % 4 == 0 and n >= 1:
                        with lock:
                            results["dropped"] += 1
                        return  # leave early
                    if line == "data: [DONE]":
                        with lock:
                            results["ok"] += 1
        except Exception as e:  # pragma: no cover - reported below
            with lock:
                results["errors"].append(repr(e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["errors"] == [] and results["ok"] == 48 and results["dropped"] == 16
    slots = s.wait_idle(timeout=20)
    assert not any(x["is_processing"] for x in slots)
    metrics = s.client.get("/metrics").text
    assert "llamacpp:requests_processing 0.0" in metrics
    assert "llamacpp:requests_deferred 0.0" in metrics
    s.assert_integrity()
    # ignore_eos: 4 tokens whatever the random seed samples (an early end included)
    after = {"prompt": "After the storm", "n_predict": 4, "ignore_eos": True}
    assert s.client.post("/completion", json=after).json()["tokens_predicted"] == 4


@pytest.mark.serial  # timed or racing: runs alone
def test_queue_limit_answers_503_with_retry_after(make_server):
    s = make_server("-np", "1", "-c", "1024", "--max-queue", "1")
    codes: list[int] = []
    headers: list[str | None] = []

    def one():
        r = httpx.post(
            s.url + "/completion",
            json={"prompt": "Go", "n_predict": 40, "ignore_eos": True},
            timeout=120,
        )
        codes.append(r.status_code)
        headers.append(r.headers.get("retry-after"))

    ts = [threading.Thread(target=one) for _ in range(6)]
    for t in ts:
        t.start()
        time.sleep(0.05)
    for t in ts:
        t.join()
    assert codes.count(200) >= 2 and 503 in codes
    assert all(h == "1" for c, h in zip(codes, headers, strict=True) if c == 503)


@pytest.mark.serial  # timed or racing: runs alone
def test_request_timeout_ends_the_request_and_frees_the_slot(server):
    r = server.client.post(
        "/completion",
        json={"prompt": "Long", "n_predict": 5000, "ignore_eos": True, "timeout": 0.5},
    )
    assert r.status_code == 408 and r.json()["error"]["type"] == "timeout_error"
    server.wait_idle(timeout=5)


@pytest.mark.serial  # timed or racing: runs alone
def test_sigterm_during_a_stream_exits_cleanly(make_server):
    s = make_server("-np", "1", "-c", "1024")
    got = []
    with httpx.stream(
        "POST",
        s.url + "/completion",
        timeout=60,
        json={"prompt": "Story:", "n_predict": 3000, "stream": True, "ignore_eos": True},
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                got.append(json.loads(line[6:]))
            if len(got) == 3:
                s.proc.send_signal(signal.SIGTERM)
                break
    assert s.proc.wait(30) == 0


@pytest.mark.serial  # timed or racing: runs alone
def test_failed_load_answers_503_then_the_process_exits(tmp_path):
    """While the model loads, and once it has failed, requests get a fast 503 (never a hang
    or a 200); then the process exits with status 1, as llama-server does."""
    import subprocess
    import sys

    from .conftest import ROOT, free_port, terminate

    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", "--port", str(port), "-m", str(bad)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        seen = []
        deadline = time.time() + 60
        while proc.poll() is None and time.time() < deadline:
            try:
                t0 = time.time()
                r = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
                seen.append((r.status_code, time.time() - t0))
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        assert proc.wait(30) == 1
        assert all(code == 503 and dt < 2 for code, dt in seen), seen
    finally:
        terminate(proc, 10)
