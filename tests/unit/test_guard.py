"""RequestGuard: what a web page may not make the server do (cross-site requests without a
preflight, DNS rebinding), while curl and SDKs (no Origin header) keep working."""

from __future__ import annotations

import asyncio

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from server.http.middleware import RequestGuard


async def _echo(request: Request) -> JSONResponse:
    return JSONResponse({"ctype": request.headers.get("content-type"), "path": request.url.path})


def client(cors: list[str] | None = None, hosts: list[str] | None = None) -> TestClient:
    routes = [Route(p, _echo, methods=["GET", "POST"]) for p in ("/v1/completions", "/slots/0")]
    app = RequestGuard(Starlette(routes=routes), cors or ["*"], hosts or [])
    return TestClient(app, base_url="http://127.0.0.1:8080")


def test_a_text_plain_body_from_another_site_is_refused():
    # the no-preflight cross-site POST of the finding: text/plain, read back by the page
    r = client().post(
        "/v1/completions",
        content=b'{"prompt":"x"}',
        headers={"Origin": "https://evil.example", "Content-Type": "text/plain"},
    )
    assert r.status_code == 415 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "ctype", ["application/json", "application/json; charset=utf-8", "application/vnd.api+json"]
)
def test_json_types_pass_and_reach_the_app_as_json(ctype):
    r = client().post("/v1/completions", content=b"{}", headers={"Content-Type": ctype})
    assert r.status_code == 200 and r.json()["ctype"] == "application/json"


def test_curl_d_keeps_working_without_an_origin():
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    assert client().post("/v1/completions", content=b"{}", headers=form).status_code == 200
    assert client().post("/v1/completions", content=b"{}").status_code == 200  # no type at all
    with_origin = {**form, "Origin": "http://localhost:3000"}
    assert client().post("/v1/completions", content=b"{}", headers=with_origin).status_code == 415
    text = {"Content-Type": "text/plain"}
    assert client().post("/v1/completions", content=b"{}", headers=text).status_code == 415


def test_state_changing_endpoints_take_only_local_origins_by_default():
    js = {"Content-Type": "application/json"}
    evil = client().post(
        "/slots/0?action=save", json={}, headers={**js, "Origin": "https://evil.example"}
    )
    assert evil.status_code == 403 and evil.json()["error"]["type"] == "permission_error"
    for origin in ("http://localhost:5173", "http://127.0.0.1", "http://[::1]:8080"):
        r = client().post("/slots/0?action=save", json={}, headers={**js, "Origin": origin})
        assert r.status_code == 200, origin
    # generation stays open to any origin until --cors-origins says otherwise
    r = client().post("/v1/completions", json={}, headers={"Origin": "https://app.example"})
    assert r.status_code == 200
    assert client().post("/slots/0", json={}).status_code == 200  # curl: no Origin


def test_cors_origins_limits_every_endpoint():
    c = client(cors=["https://app.example"])
    assert (
        c.post("/v1/completions", json={}, headers={"Origin": "https://app.example"}).status_code
        == 200
    )
    assert c.post("/slots/0", json={}, headers={"Origin": "https://app.example"}).status_code == 200
    r = c.post("/v1/completions", json={}, headers={"Origin": "https://evil.example"})
    assert r.status_code == 403
    assert c.get("/v1/completions", headers={"Origin": "http://localhost"}).status_code == 403


def test_allowed_hosts_stops_dns_rebinding():
    c = client(hosts=["127.0.0.1", "llm.internal"])
    assert c.get("/v1/completions").status_code == 200
    assert c.get("/v1/completions", headers={"Host": "llm.internal:8080"}).status_code == 200
    r = c.get("/v1/completions", headers={"Host": "attacker.example:8080"})
    assert r.status_code == 403 and "attacker.example" in r.json()["error"]["message"]
    assert client().get("/v1/completions", headers={"Host": "anything"}).status_code == 200


async def _asgi_status(path: str, raw_path: bytes, headers: list | None = None) -> int:
    """The status RequestGuard (over an app answering 200) gives a request with this decoded
    ``path`` and this ``raw_path``, as uvicorn hands them over."""
    seen: list[int] = []

    async def ok(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        if message["type"] == "http.response.start":
            seen.append(message["status"])

    scope = {
        "type": "http",
        "method": "GET",
        "path": path,
        "raw_path": raw_path,
        "query_string": b"model=b",
        "headers": [(b"host", b"127.0.0.1:8080"), *(headers or [])],
    }
    await RequestGuard(ok, ["*"], [])(scope, receive, send)
    return seen[0]


@pytest.mark.parametrize(
    "path,raw",
    [
        ("/x/../slots", b"/x/..%2Fslots"),  # the finding: decoded, it walks up to /slots
        ("/x/../cache", b"/x/..%2fcache"),
        ("/x/../slots", b"/x/%2e%2e/slots"),
        ("/x/../slots", b"/x/../slots"),
        ("/./slots", b"/./slots"),
        ("//slots", b"//slots"),
        ("/x\\..\\slots", b"/x%5C..%5Cslots"),
        ("/x\\..\\slots", b"/x\\..\\slots"),
        ("/v1/models/a/b", b"/v1/models/a%2Fb"),  # an encoded slash a later hop may decode
        ("/slots\x00", b"/slots%00"),
        ("/v1/completions/..", b"/v1/completions/.."),
    ],
)
def test_a_path_another_hop_could_read_otherwise_is_400_before_any_rule(path, raw):
    assert asyncio.run(_asgi_status(path, raw)) == 400
    evil = [(b"origin", b"http://evil.example")]
    assert asyncio.run(_asgi_status(path, raw, evil)) == 400


@pytest.mark.parametrize(
    "path,raw",
    [
        ("/v1/chat/completions", b"/v1/chat/completions"),
        ("/v1/models/org/m:Q8_0", b"/v1/models/org/m:Q8_0"),
        ("/v1/models/a b", b"/v1/models/a%20b"),
        ("/slots/", b"/slots/"),
        ("/x/..a/b.", b"/x/..a/b."),  # dots inside a name are no segments
    ],
)
def test_plain_paths_pass(path, raw):
    assert asyncio.run(_asgi_status(path, raw)) == 200


def test_the_server_refuses_the_findings_path_from_a_page_elsewhere():
    from server.http.app import create_app
    from server.settings.config import parse_settings

    c = TestClient(create_app(parse_settings([], env={})), raise_server_exceptions=False)
    for path in ("/x/..%2Fslots", "/x/..%2Fcache", "/x/..%2Fslots/0?action=erase"):
        r = c.get(path, headers={"Origin": "http://evil.example"})
        assert r.status_code == 400, (path, r.status_code)
        assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "method,path",
    [
        ("POST", "/lora-adapters"),
        ("POST", "/models/load"),
        ("POST", "/models/unload"),
        ("GET", "/models?reload=1"),
        ("GET", "/v1/models?reload=yes"),
        ("GET", "/debug/integrity"),
    ],
)
def test_state_changes_beyond_slots_take_only_local_origins(method, path):
    from server.http.middleware import local_only

    base, _, query = path.partition("?")
    scope = {"method": method, "path": base, "query_string": query.encode()}
    assert local_only(scope)
    assert not local_only({**scope, "path": "/v1/completions"})


def test_listing_models_without_reload_is_no_state_change():
    from server.http.middleware import local_only

    assert not local_only({"method": "GET", "path": "/models", "query_string": b"x=1"})
    assert not local_only({"method": "GET", "path": "/models/sse", "query_string": b""})
