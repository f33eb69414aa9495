"""Router mode end to end: a router over the default model and SmolLM2, each model its own
server process, real HTTP. Nothing here asserts generated text."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from .conftest import ServerProc, gemma_path, smollm2_path

MODELS = ("gemma", "smollm2")


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("models")
    (d / "gemma.gguf").symlink_to(gemma_path())
    (d / "smollm2.gguf").symlink_to(smollm2_path())
    return d


@pytest.fixture
def make_router(models_dir):
    made: list[ServerProc] = []

    def make(*args: str) -> ServerProc:
        preset = "--models-preset" in args
        base = [] if preset else ["--models-dir", str(models_dir), "-c", "2048"]
        s = ServerProc(*base, "-np", "2", *args)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


def statuses(r: ServerProc, headers: dict | None = None) -> dict[str, dict]:
    res = r.client.get("/models", headers=headers)
    assert res.status_code == 200, res.text
    return {m["id"]: m["status"] for m in res.json()["data"]}


def wait_status(r: ServerProc, name: str, want: str, timeout: float = 60, headers=None) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = statuses(r, headers)[name]
        if st["value"] == want:
            return st
        time.sleep(0.05)
    raise AssertionError(f"{name} never became {want}: {statuses(r, headers)}")


def complete(r: ServerProc, model: str, n: int = 4, headers=None, **kw) -> httpx.Response:
    body = {"model": model, "prompt": "Hello", "max_tokens": n, "ignore_eos": True, **kw}
    return r.client.post("/v1/completions", json=body, headers=headers)


def instance_pid(status: dict) -> int:
    """The pid of the instance whose command line ``status["args"]`` is: the process that
    listens on its port (a forked instance keeps its template's command line)."""
    port = int(status["args"][status["args"].index("--port") + 1])
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if f[1] == f"0100007F:{port:04X}" and f[3] == "0A":  # 127.0.0.1:port, LISTEN
            inodes.add(f"socket:[{f[9]}]")
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (d / "fd").iterdir()):
                return int(d.name)
        except OSError:
            continue
    raise AssertionError(f"no process on port {port}")


def test_listing_routing_concurrency_and_streaming(make_router):
    r = make_router()
    assert r.client.get("/health").status_code == 200
    props = r.client.get("/props").json()
    assert props["role"] == "router" and props["max_instances"] == 4 and props["models_autoload"]
    assert {k: v["value"] for k, v in statuses(r).items()} == dict.fromkeys(MODELS, "unloaded")
    # both models at once: each request reaches its own model
    out: dict[str, httpx.Response] = {}
    threads = [
        threading.Thread(target=lambda m=m: out.__setitem__(m, complete(r, m, 8))) for m in MODELS
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for m in MODELS:
        assert out[m].status_code == 200, out[m].text
        assert out[m].json()["model"] == m and out[m].json()["usage"]["completion_tokens"] == 8
    assert {k: v["value"] for k, v in statuses(r).items()} == dict.fromkeys(MODELS, "loaded")
    assert r.client.get("/v1/models").json()["data"][0]["id"] == "gemma"
    # GET routes by ?model=; unknown and missing names are 400s naming the problem
    assert r.client.get("/props", params={"model": "smollm2"}).json()["model_alias"] == "smollm2"
    bad = complete(r, "no-such-model")
    assert bad.status_code == 400 and "no-such-model" in bad.json()["error"]["message"]
    assert r.client.post("/v1/completions", json={"prompt": "x"}).status_code == 400
    assert r.client.get("/slots").status_code == 400
    # streaming passes through event by event
    body = {
        "model": "smollm2",
        "prompt": "Hi",
        "max_tokens": 16,
        "ignore_eos": True,
        "stream": True,
    }
    with r.client.stream("POST", "/v1/completions", json=body) as s:
        events = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert len(events) >= 16 and events[-1] == "data: [DONE]"


def test_client_disconnect_cancels_the_instance_task(make_router):
    r = make_router()
    assert complete(r, "smollm2").status_code == 200
    body = {
        "model": "smollm2",
        "prompt": "Hi",
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(base_url=r.url, timeout=60) as c,
        c.stream("POST", "/v1/completions", json=body) as s,
    ):
        lines = s.iter_lines()
        for _ in range(3):
            next(lines)
    deadline = time.time() + 10
    while time.time() < deadline:
        slots = r.client.get("/slots", params={"model": "smollm2"}).json()
        if not any(x["is_processing"] for x in slots):
            break
        time.sleep(0.1)
    assert not any(x["is_processing"] for x in slots), slots


def test_models_max_1_evicts_the_idle_one_never_the_busy_one(make_router):
    r = make_router("--models-max", "1")
    assert complete(r, "gemma").status_code == 200
    done: dict[str, tuple[float, httpx.Response]] = {}

    def run(model: str, n: int) -> None:
        res = complete(r, model, n)
        done[model] = (time.time(), res)

    busy = threading.Thread(target=run, args=("gemma", 150))
    busy.start()
    time.sleep(0.5)  # gemma is generating
    other = threading.Thread(target=run, args=("smollm2", 4))
    other.start()
    busy.join(120)
    other.join(120)
    g_at, g = done["gemma"]
    s_at, s = done["smollm2"]
    assert g.status_code == 200 and g.json()["usage"]["completion_tokens"] == 150
    assert s.status_code == 200 and s_at > g_at  # it waited for gemma to finish
    st = statuses(r)
    assert st["smollm2"]["value"] == "loaded" and st["gemma"]["value"] == "unloaded"
    assert not st["gemma"].get("failed")


def test_no_autoload_with_explicit_load_and_unload(make_router):
    r = make_router("--no-models-autoload")
    assert r.client.get("/props").json()["models_autoload"] is False
    res = complete(r, "smollm2")
    assert res.status_code == 400 and "not loaded" in res.json()["error"]["message"]
    assert statuses(r)["smollm2"]["value"] == "unloaded"
    assert r.client.post("/models/load", json={"model": "smollm2"}).json() == {"success": True}
    wait_status(r, "smollm2", "loaded")
    assert r.client.post("/models/load", json={"model": "smollm2"}).status_code == 400
    assert complete(r, "smollm2").status_code == 200
    assert r.client.post("/models/unload", json={"model": "smollm2"}).json() == {"success": True}
    assert statuses(r)["smollm2"]["value"] == "unloaded"
    assert r.client.post("/models/unload", json={"model": "smollm2"}).status_code == 400
    assert r.client.post("/models/load", json={"model": "nope"}).status_code == 404


def test_preset_with_per_model_flags(make_router, tmp_path):
    preset = tmp_path / "models.ini"
    preset.write_text(
        "version = 1\n[*]\nc = 1024\nnp = 1\n"
        f"[gemma]\nmodel = {gemma_path()}\nctx-size = 1536\n"
        f"[small]\nmodel = {smollm2_path()}\nLLAMA_ARG_N_PREDICT = 3\nload-on-startup = true\n"
    )
    # the command line's -np 2 wins over [*]'s np = 1
    r = make_router("--models-preset", str(preset))
    wait_status(r, "small", "loaded")  # load-on-startup
    g = r.client.get("/props", params={"model": "gemma"}).json()
    s = r.client.get("/props", params={"model": "small"}).json()
    assert (g["n_ctx"], g["total_slots"]) == (1536, 2)  # model section over [*]
    assert (s["n_ctx"], s["total_slots"]) == (1024, 2)  # [*]
    res = r.client.post("/completion", json={"model": "small", "prompt": "Hi", "ignore_eos": True})
    assert res.json()["tokens_predicted"] == 3  # the section's -n default
    args = statuses(r)["small"]["args"]
    assert args[args.index("--predict") + 1] == "3"


def test_killed_instance_gives_503_and_restarts(make_router):
    r = make_router()
    assert complete(r, "gemma").status_code == 200
    assert complete(r, "smollm2").status_code == 200
    pid = instance_pid(statuses(r)["gemma"])
    result: list[httpx.Response] = []
    t = threading.Thread(target=lambda: result.append(complete(r, "gemma", 1500)))
    t.start()
    lines: list[str] = []
    openai: list[str] = []

    def stream(path: str, out: list[str], **kw) -> None:
        body = {"model": "gemma", "prompt": "Hi", "stream": True, **kw}
        with r.client.stream("POST", path, json=body) as res:
            out.extend(x for x in res.iter_lines() if x.startswith("data: "))

    streams = [
        threading.Thread(target=stream, args=("/completion", lines), kwargs={"n_predict": 1500}),
        threading.Thread(
            target=stream,
            args=("/v1/completions", openai),
            kwargs={"max_tokens": 1500, "ignore_eos": True},
        ),
    ]
    for th in streams:
        th.start()
    time.sleep(1.0)  # generating
    os.kill(pid, signal.SIGKILL)
    t.join(60)
    for th in streams:
        th.join(60)
    assert result[0].status_code == 503, result[0].text
    # a stream cut off by the crash ends with an error event (its 200 went out already);
    # an OpenAI stream then with [DONE], as every OpenAI stream ends
    assert json.loads(lines[-1][6:])["error"]["code"] == 503, lines[-3:]
    assert openai[-1] == "data: [DONE]", openai[-3:]
    assert json.loads(openai[-2][6:])["error"]["code"] == 503, openai[-3:]
    st = wait_status(r, "gemma", "unloaded")
    assert st["failed"] is True and st["exit_code"] == -signal.SIGKILL
    assert r.client.get("/health").status_code == 200
    assert complete(r, "smollm2").status_code == 200  # the other model is untouched
    assert statuses(r)["smollm2"]["value"] == "loaded"
    assert complete(r, "gemma").status_code == 200  # started again
    assert statuses(r)["gemma"]["value"] == "loaded"


def test_api_key_is_checked_at_the_router(make_router):
    r = make_router("--api-key", "sk-router")
    key = {"Authorization": "Bearer sk-router"}
    assert r.client.get("/health").status_code == 200
    assert r.client.get("/models").status_code == 401
    res = complete(r, "smollm2")
    assert res.status_code == 401 and res.json()["error"]["type"] == "authentication_error"
    assert complete(r, "smollm2", headers=key).status_code == 200
    # the instance itself listens on 127.0.0.1 and wants a key too
    st = statuses(r, key)["smollm2"]
    port = st["args"][st["args"].index("--port") + 1]
    assert st["args"][st["args"].index("--host") + 1] == "127.0.0.1"
    direct = httpx.post(f"http://127.0.0.1:{port}/completion", json={"prompt": "x", "n_predict": 1})
    assert direct.status_code == 401
    assert "sk-router" not in json.dumps(st)


EVIL = {"Origin": "http://evil.example"}


def test_a_page_elsewhere_can_neither_walk_around_nor_change_state(make_router):
    # router defaults (no key, --cors-origins *), the CORS proxy on: the probe's paths are
    # refused before any rule reads them, and nothing starts
    r = make_router("--ui-mcp-proxy")
    target = f"http://127.0.0.1:{r.port}/props"
    for method, path in [
        ("GET", "/x/..%2Fslots?model=smollm2"),
        ("GET", "/x/..%2Fcache?model=smollm2"),
        ("POST", "/x/..%2Fslots/0?action=erase"),
        ("GET", f"/x/..%2Fcors-proxy?model=smollm2&url={target}"),
        ("GET", "/x/%2e%2e/slots?model=smollm2"),
    ]:
        res = r.client.request(method, path, json={"model": "smollm2"}, headers=EVIL)
        assert res.status_code == 400, (path, res.status_code, res.text[:200])
    # the state changes of the finding, from the same page: 403
    assert r.client.post("/models/load", json={"model": "smollm2"}, headers=EVIL).status_code == 403
    assert r.client.get("/models?reload=1", headers=EVIL).status_code == 403
    res = r.client.post("/lora-adapters", json={"model": "smollm2"}, headers=EVIL)
    assert res.status_code == 403
    res = r.client.post("/models/unload", json={"model": "smollm2"}, headers=EVIL)
    assert res.status_code == 403
    # the listing is open, with names only
    listed = r.client.get("/models", headers=EVIL).json()["data"]
    assert {m["id"] for m in listed} == set(MODELS)
    assert all("path" not in m and "args" not in m["status"] for m in listed)
    assert {k: v["value"] for k, v in statuses(r).items()} == dict.fromkeys(MODELS, "unloaded")
    # a local page still reaches the instance's local-only endpoints (it judges the Origin
    # the router passes on by the same rule)
    local = {"Origin": "http://localhost:5173"}
    res = r.client.get("/slots", params={"model": "smollm2"}, headers=local)
    assert res.status_code == 200 and isinstance(res.json(), list)
    assert "path" in r.client.get("/models").json()["data"][0]  # curl: no Origin


def test_an_allowed_origin_passes_at_the_router_and_its_instance(make_router):
    r = make_router("--cors-origins", "https://app.example")
    app = {"Origin": "https://app.example"}
    res = complete(r, "smollm2", headers=app)
    assert res.status_code == 200, res.text
    assert res.headers["access-control-allow-origin"] == "https://app.example"
    assert complete(r, "smollm2", headers=EVIL).status_code == 403


def _raw_request(port: int, body: dict) -> socket.socket:
    """A POST sent on a bare socket (closed by the caller, like a client that leaves)."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    s.sendall(head.encode() + data)
    return s


def test_the_start_queue_wakes_when_a_load_finishes(make_router, tmp_path):
    # --models-max 1: a start waiting for room is served once the loading model is ready
    # (it may be stopped then), not when some unrelated request to it ends
    preset = tmp_path / "models.ini"
    preset.write_text(
        f"version = 1\n[*]\nc = 1024\n[b]\nmodel = {smollm2_path()}\n"
        f"[c]\nmodel = {smollm2_path()}\n"
    )
    r = make_router("--models-preset", str(preset), "--models-max", "1")
    assert r.client.post("/models/load", json={"model": "b"}).json() == {"success": True}
    res = complete(r, "c")  # queued behind b's load; nothing else happens
    assert res.status_code == 200, res.text
    assert {k: v["value"] for k, v in statuses(r).items()} == {"b": "unloaded", "c": "loaded"}
    # a client that leaves while b loads: the next model's request is still served
    gone = _raw_request(r.port, {"model": "b", "prompt": "Hi", "max_tokens": 2})
    wait_status(r, "b", "loading")
    gone.close()
    res = complete(r, "c")
    assert res.status_code == 200, res.text
    assert statuses(r)["c"]["value"] == "loaded"


def test_a_frozen_instance_times_out_and_its_stream_ends_with_done(make_router):
    r = make_router("--timeout", "2")  # instances end requests at 2 s; frozen: 2 + grace
    assert complete(r, "smollm2").status_code == 200
    pid = instance_pid(statuses(r)["smollm2"])
    body = {"model": "smollm2", "prompt": "Hi", "max_tokens": 4000, "stream": True}
    lines: list[str] = []
    plain: list[httpx.Response] = []
    with (
        httpx.Client(base_url=r.url, timeout=60) as c,
        c.stream("POST", "/v1/completions", json={**body, "ignore_eos": True}) as s,
    ):
        it = s.iter_lines()
        for line in it:
            if line.startswith("data: "):
                break
        os.kill(pid, signal.SIGSTOP)  # frozen mid-answer
        try:
            t = threading.Thread(target=lambda: plain.append(complete(r, "smollm2")))
            t.start()
            lines.extend(x for x in it if x.startswith("data: "))
            t.join(60)
        finally:
            os.kill(pid, signal.SIGCONT)
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert json.loads(lines[-2][6:])["error"]["code"] == 504, lines[-3:]
    assert plain[0].status_code == 504, plain[0].text
    assert "sent nothing" in plain[0].json()["error"]["message"]
    assert complete(r, "smollm2").status_code == 200  # thawed, it serves again
