"""The router's share of the cross-site rules, without a model: what it passes on to an
instance (the raw path it judged, the cross-site headers, the rule to judge them by), what
``GET /models`` shows to whom, bodies parsed with bounds, and how a cut stream ends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.requests import Request

from server.router.proxy import cut_off_event, upstream_headers, upstream_url
from server.router.router_app import create_router_app
from server.router.routes import UPSTREAM_GRACE_S, silence_limit
from server.settings.config import parse_settings

EVIL = {"Origin": "http://evil.example"}


@pytest.fixture
def router_app(tmp_path: Path) -> FastAPI:
    (tmp_path / "a.gguf").write_bytes(b"")
    argv = ["--models-dir", str(tmp_path), "--timeout", "30"]
    return create_router_app(parse_settings(argv, env={}), argv)


def _request(headers: list[tuple[bytes, bytes]], raw_path: bytes = b"/v1/completions") -> Request:
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "raw_path": raw_path,
        "query_string": b"",
        "headers": headers,
    }
    return Request(scope)


def test_the_instance_gets_the_raw_path_the_router_judged():
    scope = {"path": "/v1/models/a b", "raw_path": b"/v1/models/a%20b", "query_string": b"x=1"}
    assert upstream_url(scope, 9000) == "http://127.0.0.1:9000/v1/models/a%20b?x=1"


def test_cross_site_headers_go_on_to_be_judged_again_and_cookies_stop():
    sent = [
        (b"origin", b"http://evil.example"),
        (b"referer", b"http://evil.example/page"),
        (b"sec-fetch-site", b"cross-site"),
        (b"cookie", b"session=secret"),
        (b"authorization", b"Bearer client"),
    ]
    out = dict(upstream_headers(_request(sent), "internal", router_keys=False))
    assert out[b"origin"] == b"http://evil.example"
    assert out[b"referer"] == b"http://evil.example/page"
    assert out[b"sec-fetch-site"] == b"cross-site"
    assert b"cookie" not in out
    assert out[b"authorization"] == b"Bearer internal"


def test_instances_judge_by_the_routers_cors_origins(tmp_path: Path):
    (tmp_path / "a.gguf").write_bytes(b"")
    argv = ["--models-dir", str(tmp_path), "--cors-origins", "https://app.example"]
    app = create_router_app(parse_settings(argv, env={}), argv)
    manager = app.state.router.manager
    inst = manager.get("a")
    inst.port = 1234
    args = manager._argv(inst)
    assert args[args.index("--cors-origins") + 1] == "https://app.example"


def test_models_shows_paths_and_command_lines_to_no_page_elsewhere(router_app):
    inst = router_app.state.router.manager.get("a")
    inst.argv = ["python", "-m", "server", "-m", "/secret/a.gguf"]
    c = TestClient(router_app)
    for headers in (EVIL, {"Referer": "http://evil.example/x"}, {"Sec-Fetch-Site": "cross-site"}):
        listed = c.get("/models", headers=headers).json()["data"]
        assert [m["id"] for m in listed] == ["a"]
        assert "/secret" not in json.dumps(listed) and "a.gguf" not in json.dumps(listed)
        assert "args" not in listed[0]["status"] and "path" not in listed[0]
    for headers in ({}, {"Origin": "http://localhost:3000"}):
        mine = c.get("/v1/models", headers=headers).json()["data"][0]
        assert mine["path"].endswith("a.gguf") and mine["status"]["args"] == inst.argv


def test_models_shows_paths_to_key_holders(tmp_path: Path):
    (tmp_path / "a.gguf").write_bytes(b"")
    argv = ["--models-dir", str(tmp_path), "--api-key", "k"]
    c = TestClient(create_router_app(parse_settings(argv, env={}), argv))
    listed = c.get("/models", headers={**EVIL, "Authorization": "Bearer k"}).json()["data"]
    assert listed[0]["path"].endswith("a.gguf")


@pytest.mark.parametrize("path", ["/v1/completions", "/models/load", "/models/unload"])
def test_deeply_nested_bodies_are_400_not_500(router_app, path):
    c = TestClient(router_app, raise_server_exceptions=False)
    for body in (b"[" * 100_000, b'{"model": ' + b"[" * 600 + b"]" * 600 + b"}"):
        r = c.post(path, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (path, r.status_code, r.text[:200])
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert c.get("/health").status_code == 200


def test_silence_limit_follows_the_instances_timeout_and_the_requests(router_app):
    st = router_app.state.router
    inst = st.manager.get("a")
    assert st.timeout == 30
    assert silence_limit(st, inst, None) == 30 + UPSTREAM_GRACE_S
    assert silence_limit(st, inst, 100.0) == 100 + UPSTREAM_GRACE_S
    inst.spec.args["timeout"] = "7"  # a preset's own
    assert silence_limit(st, inst, None) == 7 + UPSTREAM_GRACE_S


def test_a_cut_openai_stream_ends_with_its_error_and_done():
    for path in ("/v1/chat/completions", "/chat/completions", "/v1/completions"):
        events = cut_off_event(path, "m").decode().strip().split("\n\n")
        assert json.loads(events[0].removeprefix("data: "))["error"]["code"] == 503
        assert events[-1] == "data: [DONE]"
    native = cut_off_event("/completion", "m", 504, "went silent").decode()
    assert "[DONE]" not in native and '"code": 504' in native
    anthropic = cut_off_event("/v1/messages", "m").decode()
    assert "event: error" in anthropic and "[DONE]" not in anthropic
