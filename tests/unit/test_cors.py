"""CORS as llama-server answers it (``--cors-origins``, ``--cors-credentials``, preflights),
layered under the request guard, and the ``--ui-mcp-proxy`` CORS proxy. The whole app runs
without a model: these layers answer before any route needs one."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from fastapi.testclient import TestClient

from server.http.app import create_app
from server.settings.config import parse_settings

PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "x"}
LOADING = 503  # /health without a model: the request got past the guard


def client(*argv: str) -> TestClient:
    return TestClient(create_app(parse_settings(list(argv), env={})))


def preflight(c: TestClient, origin: str, path: str = "/completions"):
    return c.options(path, headers={"Origin": origin, **PREFLIGHT})


def test_default_preflight_is_llama_servers():
    r = preflight(client("--api-key", "k"), "https://web.mydomain.fr")
    assert r.status_code == 200 and r.content == b""  # before the key check
    assert r.headers["access-control-allow-origin"] == "https://web.mydomain.fr"
    assert r.headers["access-control-allow-credentials"] == "true"
    assert r.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
    assert r.headers["access-control-allow-headers"] == "*"
    assert "Origin" in r.headers["vary"]
    # in llama-server's case: llama.cpp's tests look the names up case-sensitively
    assert {k for k, _ in r.headers.raw} >= {b"Access-Control-Allow-Origin", b"Vary"}
    # any path, any Origin text: llama-server answers every OPTIONS
    assert preflight(client(), "localhost", "/nowhere").headers["access-control-allow-origin"] == (
        "localhost"
    )


def test_without_credentials_any_origin_is_a_star():
    c = client("--no-cors-credentials", "--cors-methods", "GET", "--cors-headers", "a,b")
    r = preflight(c, "https://app.example")
    assert r.headers["access-control-allow-origin"] == "*"
    assert r.headers["access-control-allow-credentials"] == "false"
    assert r.headers["access-control-allow-methods"] == "GET"
    assert r.headers["access-control-allow-headers"] == "a,b"
    assert c.get("/health").headers["access-control-allow-origin"] == "*"


LOCAL = ["http://localhost", "http://localhost:8080", "http://127.0.0.1:3000", "http://[::1]"]
FOREIGN = ["http://evil.com", "http://notlocalhost", "http://localhost.evil.com", "null"]


@pytest.mark.parametrize("argv", [["--cors-origins", "localhost"], ["--tools", "all"]])
def test_localhost_reflects_only_local_pages(argv):
    c = client(*argv)
    for origin in LOCAL:
        assert preflight(c, origin).headers["access-control-allow-origin"] == origin
        r = c.get("/health", headers={"Origin": origin})
        assert r.status_code == LOADING and r.headers["access-control-allow-origin"] == origin
    for origin in FOREIGN:
        r = preflight(c, origin)
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        # the guard goes further than llama-server: the request itself is refused
        r = c.post("/tokenize", json={"content": "x"}, headers={"Origin": origin})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers


def test_explicit_origins_win_over_the_tools_default():
    c = client("--tools", "all", "--cors-origins", "https://app.example, localhost")
    assert preflight(c, "https://app.example").headers["access-control-allow-origin"] == (
        "https://app.example"
    )
    assert preflight(c, "http://127.0.0.1:5173").headers["access-control-allow-origin"]
    assert "access-control-allow-origin" not in preflight(c, "https://evil.example").headers
    r = c.get("/health", headers={"Origin": "https://evil.example"})
    assert r.status_code == 403


def test_cross_site_cookies_are_refused_under_the_wildcard():
    c = client()
    page = {"Origin": "https://evil.example", "Cookie": "sso=1"}
    r = c.get("/health", headers=page)
    assert r.status_code == 403 and "cookies" in r.json()["error"]["message"]
    assert c.get("/health", headers={"Origin": "https://evil.example"}).status_code == LOADING
    # the same site (Origin host = Host), local pages and curl keep their cookies
    for ok in ({"Origin": "https://testserver"}, {"Origin": "http://localhost:1"}, {}):
        assert c.get("/health", headers={**ok, "Cookie": "a=b"}).status_code == LOADING, ok
    # a page named in --cors-origins may send them
    named = client("--cors-origins", "https://evil.example")
    assert named.get("/health", headers=page).status_code == LOADING


def test_completions_is_the_native_route():
    from server.protocols import native, openai

    def paths(router) -> set[str]:
        return {r.path for r in router.routes}

    assert {"/completion", "/completions"} <= paths(native.router)
    assert "/v1/completions" in paths(openai.router) and "/completions" not in paths(openai.router)


# ---- /cors-proxy -------------------------------------------------------------------------


class _Target(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        self.server.seen.append((self.command, self.path, dict(self.headers), self.rfile.read(n)))
        if self.path.startswith("/moved"):
            self.send_response(302)
            self.send_header("Location", "/capture?after=redirect")
            self.end_headers()
            return
        self.send_response(201)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Access-Control-Allow-Origin", "https://target.example")
        self.send_header("X-Target", "yes")
        self.end_headers()
        self.wfile.write(b"data: ok\n\n")

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def target() -> Iterator[ThreadingHTTPServer]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Target)
    srv.seen = []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_proxy_is_off_by_default(target):
    r = client().get(f"/cors-proxy?url=http://127.0.0.1:{target.server_port}/x")
    assert r.status_code == 403
    assert r.json() == {
        "error": {"message": "this feature is disabled", "type": "feature_disabled"}
    }
    assert target.seen == []


def test_proxy_forwards_only_explicit_headers(target):
    c = client("--ui-mcp-proxy", "--api-key", "k")
    url = f"/cors-proxy?url=http://127.0.0.1:{target.server_port}/capture?q=1"
    secret = {"Authorization": "Bearer k", "X-Api-Key": "k", "Cookie": "s=1"}
    explicit = {
        "x-llama-server-proxy-header-accept": "application/json",
        "X-Llama-Server-Proxy-Header-Authorization": "Bearer explicit",
    }
    r = c.get(url, headers={**secret, "Proxy-Authorization": "Basic x", **explicit})
    assert r.status_code == 201 and r.text == "data: ok\n\n"
    assert r.headers["content-type"] == "text/event-stream" and r.headers["x-target"] == "yes"
    assert "access-control-allow-origin" not in r.headers  # the target's CORS is not ours
    method, path, headers, _ = target.seen[-1]
    got = {k.lower(): v for k, v in headers.items()}
    assert (method, path) == ("GET", "/capture?q=1")
    assert got["accept"] == "application/json" and got["authorization"] == "Bearer explicit"
    assert not {"proxy-authorization", "x-api-key", "cookie"} & set(got)
    assert c.get(url).status_code == 401  # the proxy needs the key like any route


def test_proxy_posts_the_body_and_follows_redirects(target):
    c = client("--ui-mcp-proxy")
    base = f"/cors-proxy?url=http://127.0.0.1:{target.server_port}"
    r = c.post(f"{base}/rpc", json={"jsonrpc": "2.0"})
    assert r.status_code == 201
    assert target.seen[-1][:2] == ("POST", "/rpc") and target.seen[-1][3] == b'{"jsonrpc":"2.0"}'
    assert c.get(f"{base}/moved").status_code == 201
    assert target.seen[-1][1] == "/capture?after=redirect"


@pytest.mark.parametrize(
    "url, message",
    [
        ("127.0.0.1/x", "no scheme"),
        ("ftp://127.0.0.1/x", "unsupported URL scheme"),
        ("http:///x", "missing host"),
        ("http://u:p@127.0.0.1/x", "authentication in target URL"),
    ],
)
def test_proxy_refuses_bad_targets(url, message):
    r = client("--ui-mcp-proxy").get("/cors-proxy", params={"url": url})
    assert r.status_code == 400 and message in r.json()["error"]["message"]


def test_proxy_is_for_local_pages_only_under_the_wildcard(target):
    c = client("--ui-mcp-proxy")
    url = f"/cors-proxy?url=http://127.0.0.1:{target.server_port}/x"
    assert c.get(url, headers={"Origin": "https://evil.example"}).status_code == 403
    assert c.get(url, headers={"Origin": "http://localhost:5173"}).status_code == 201
    assert len(target.seen) == 1
