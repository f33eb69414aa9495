"""RequestGuard: what a web page may not make the server do (cross-site requests without a
preflight, DNS rebinding), while curl and SDKs (no Origin header) keep working."""

from __future__ import annotations

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
