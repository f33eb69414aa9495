"""The ``--ui-mcp-proxy`` CORS proxy under attack (issue 25, section 3), over real HTTP.

Every target is a listener on a loopback address started here: an ``http.server`` that can
hold its answer, redirect, or answer with a page and cookies, and a raw socket that plays an
FTP server. The proxy runs in real uvicorn: in this process without the model (lifespan off:
the proxy needs none) for most checks, and as a real server process with the model where
the check is that prompts stay fast while the proxy is busy or looped.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

import httpx
import pytest
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from server.http.app import create_app
from server.settings.config import parse_settings

from .conftest import ServerProc, free_port

HOLD_S = 8.0  # the longest a held target answer waits (bounds every test that holds one)
PREFIX = "x-llama-server-proxy-header-"


# ---- loopback targets ---------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    """``/hold``: answers once released (or after HOLD_S); ``/redirect?to=URL&code=N``;
    ``/page``: HTML with cookies and origin-wide headers; anything else: JSON ``ok``."""

    server: Target

    def _answer(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        headers = {k.lower(): v for k, v in self.headers.items()}
        self.server.record(self.command, self.path, headers, self.rfile.read(n))
        url = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        if url.path == "/hold":
            self.server.release.wait(HOLD_S)
        if url.path == "/redirect":
            self.send_response(int(query.get("code", "302")))
            self.send_header("Location", query["to"])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        page = url.path == "/page"
        body = b"<script>alert(document.cookie)</script>" if page else b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Type", "text/html" if page else "application/json")
        if page:
            self.send_header("Set-Cookie", "session=stolen; Path=/")
            self.send_header("Clear-Site-Data", '"*"')
            self.send_header("Strict-Transport-Security", "max-age=31536000")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


class Target(ThreadingHTTPServer):
    """An HTTP listener on 127.0.0.1 that records every request it gets (method, path,
    lower-case headers, body)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.base = f"http://127.0.0.1:{self.server_port}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def record(self, *request: Any) -> None:
        with self.lock:
            self.seen.append(request)

    def count(self, path: str) -> int:
        with self.lock:
            return sum(1 for r in self.seen if urlsplit(r[1]).path == path)

    def wait_for(self, path: str, n: int, timeout: float = 10) -> int:
        """How many requests for ``path`` came, waiting up to ``timeout`` s for ``n``."""
        deadline = time.monotonic() + timeout
        while self.count(path) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.count(path)

    def stop(self) -> None:
        self.release.set()
        self.shutdown()
        self.server_close()


class FtpListener:
    """A raw socket on 127.0.0.1 that greets like an FTP server and keeps what it is sent."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.received = b""
        self.connections = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            with conn:
                conn.settimeout(2)
                conn.sendall(b"220 ftp ready\r\n")
                try:
                    self.received += conn.recv(4096)
                    conn.sendall(b"530 not logged in\r\n")
                except OSError:
                    pass

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(5)
        self.sock.close()


@pytest.fixture
def target() -> Iterator[Target]:
    t = Target()
    yield t
    t.stop()


# ---- the proxy in real uvicorn ------------------------------------------------------------


class Recorder:
    """ASGI wrapper that notes every request the app gets: (path, lower-case headers)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.seen: list[tuple[str, dict[str, str]]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = {k.decode(): v.decode("latin-1") for k, v in scope["headers"]}
            self.seen.append((scope["path"], headers))
        await self.app(scope, receive, send)


class Proxy:
    """The server app, proxy on, in uvicorn on 127.0.0.1 (no model: lifespan off)."""

    def __init__(self, *argv: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        settings = parse_settings(["--ui-mcp-proxy", "--port", str(self.port), *argv], env={})
        self.app = Recorder(create_app(settings))
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, lifespan="off", log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.server.started, "uvicorn did not start"
        self.client = httpx.Client(base_url=self.base, timeout=HOLD_S + 10)

    def get(self, url: str, **kw: Any) -> httpx.Response:
        return self.client.get("/cors-proxy", params={"url": url}, **kw)

    def stop(self) -> None:
        self.client.close()
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def make_proxy() -> Iterator[Any]:
    made: list[Proxy] = []

    def make(*argv: str) -> Proxy:
        made.append(Proxy(*argv))
        return made[-1]

    yield make
    for p in made:
        p.stop()


def assert_error(r: httpx.Response, status: int, words: str) -> None:
    """``r`` is an OpenAI-shaped error with ``status`` whose message holds ``words``."""
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["code"] == status and isinstance(err["type"], str), err
    assert words in err["message"], err


# ---- redirects ----------------------------------------------------------------------------


def test_redirect_to_ftp_is_not_followed(make_proxy, target):
    ftp = FtpListener()
    try:
        to = f"ftp://127.0.0.1:{ftp.port}/file"
        r = make_proxy().get(f"{target.base}/redirect?to={quote(to, safe='')}")
        time.sleep(0.3)  # a follower would have connected by now
        assert ftp.connections == 0 and b"USER" not in ftp.received, ftp.received
        assert_error(r, 502, "redirect not followed")
    finally:
        ftp.stop()


def test_redirect_to_another_host_is_not_followed_and_keeps_the_headers(make_proxy, target):
    other = Target()
    try:
        to = f"{other.base}/capture"
        auth = {f"{PREFIX}authorization": "Bearer mcp-secret"}
        r = make_proxy().get(f"{target.base}/redirect?to={quote(to, safe='')}", headers=auth)
        leaked = [h.get("authorization") for _, _, h, _ in other.seen]
        assert other.wait_for("/capture", 1, timeout=0.5) == 0, leaked
        assert target.seen[-1][2].get("authorization") == "Bearer mcp-secret"
        assert_error(r, 502, "another origin")
    finally:
        other.stop()


@pytest.mark.parametrize("path", ["/slots", "/props"])
def test_redirect_to_the_servers_own_routes_is_not_followed(make_proxy, target, path):
    p = make_proxy()
    auth = {f"{PREFIX}authorization": "Bearer mcp-secret"}
    r = p.get(f"{target.base}/redirect?to={quote(p.base + path, safe='')}", headers=auth)
    reached = [(s, h.get("authorization")) for s, h in p.app.seen]
    assert reached == [("/cors-proxy", None)]  # nothing reached /slots, /props
    assert_error(r, 502, "another origin")


def test_same_origin_redirect_is_followed_without_the_forwarded_headers(make_proxy, target):
    auth = {f"{PREFIX}authorization": "Bearer mcp-secret", f"{PREFIX}x-mcp": "1"}
    r = make_proxy().get(f"{target.base}/redirect?to=/after&code=307", headers=auth)
    assert r.status_code == 200 and r.json() == {"ok": True}
    first, after = target.seen[-2], target.seen[-1]
    assert first[2].get("authorization") == "Bearer mcp-secret" and first[2].get("x-mcp") == "1"
    assert urlsplit(after[1]).path == "/after"
    assert not {"authorization", "x-mcp"} & {k.lower() for k in after[2]}


# ---- what comes back ----------------------------------------------------------------------


def test_the_targets_page_is_inert_on_the_servers_origin(make_proxy, target):
    r = make_proxy().get(f"{target.base}/page")
    assert r.status_code == 200
    assert r.content == b"<script>alert(document.cookie)</script>"  # the bytes, untouched
    assert r.headers["content-type"] == "application/octet-stream"
    assert r.headers["content-disposition"] == "attachment"
    assert "sandbox" in r.headers["content-security-policy"]
    assert r.headers["x-content-type-options"] == "nosniff"
    for name in ("set-cookie", "clear-site-data", "strict-transport-security"):
        assert name not in r.headers, name
    # JSON (what MCP servers answer) keeps its type
    assert make_proxy().get(f"{target.base}/j").headers["content-type"] == "application/json"


# ---- malformed URLs -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "tail",
    ["/a b", "/x\r\nX-Injected: 1", "/\x00", ":99999/", ":0/"],
)
def test_malformed_urls_are_400_errors(make_proxy, target, tail):
    r = make_proxy().get(target.base + tail)
    assert_error(r, 400, "invalid target URL")
    assert target.seen == []


def test_a_bracket_host_without_its_end_is_a_400(make_proxy):
    assert_error(make_proxy().get("http://[::1/x"), 400, "invalid target URL")


# ---- the request guard --------------------------------------------------------------------


def test_cross_site_gets_without_origin_are_refused(make_proxy, target):
    p = make_proxy()
    url = f"{target.base}/j"
    refused = [
        {"Sec-Fetch-Site": "cross-site"},  # an <img> on another site (no Referer sent)
        {"Sec-Fetch-Site": "same-site"},
        {"Sec-Fetch-Site": "cross-site", "Referer": "https://evil.example/page"},
        {"Referer": "https://evil.example/page"},  # a browser without Sec-Fetch-*
    ]
    for headers in refused:
        assert_error(p.get(url, headers=headers), 403, "")
    r = p.client.get("/slots", headers={"Sec-Fetch-Site": "cross-site"})
    assert r.status_code == 403
    assert target.seen == []
    allowed = [
        {},  # curl, SDKs
        {"Sec-Fetch-Site": "same-origin"},
        {"Sec-Fetch-Site": "none"},  # typed in the address bar
        {"Sec-Fetch-Site": "cross-site", "Referer": "http://localhost:5173/app"},
    ]
    for headers in allowed:
        assert p.get(url, headers=headers).status_code == 200, headers
    named = make_proxy("--cors-origins", "https://app.example")
    ok = {"Sec-Fetch-Site": "cross-site", "Referer": "https://app.example/ui"}
    assert named.get(url, headers=ok).status_code == 200
    assert named.get(url, headers={"Referer": "https://evil.example/"}).status_code == 403


# ---- loops ---------------------------------------------------------------------------------


def nested(base: str, inner: str, depth: int) -> str:
    """A proxy URL of ``base`` that proxies itself ``depth`` times, then ``inner``."""
    url = inner
    for _ in range(depth):
        url = f"{base}/cors-proxy?url={quote(url, safe='')}"
    return url


def test_a_url_to_the_proxy_itself_is_refused(make_proxy, target):
    p = make_proxy()
    for host in ("127.0.0.1", "localhost", "127.0.0.9"):
        r = p.get(nested(f"http://{host}:{p.port}", f"{target.base}/j", 7), timeout=10)
        assert_error(r, 400, "proxy loop")
    assert target.seen == [] and len(p.app.seen) == 3


def test_a_loop_through_another_proxy_is_refused_by_its_via_hop(make_proxy, target):
    a, b = make_proxy(), make_proxy()
    # a -> b -> a: no address check sees it (b's target is a's port), the Via hop does
    r = a.get(nested(b.base, nested(a.base, f"{target.base}/j", 1), 1), timeout=10)
    assert r.status_code == 400 and "proxy loop" in r.json()["error"]["message"]
    assert target.seen == []
    assert b.get(f"{target.base}/j").status_code == 200  # no Via: fine


# ---- bounded concurrency ---------------------------------------------------------------------


def client_from(ip: str, base: str) -> httpx.Client:
    """A client whose connections come from loopback address ``ip`` (another client)."""
    transport = httpx.HTTPTransport(local_address=ip)
    return httpx.Client(base_url=base, transport=transport, timeout=HOLD_S + 10)


def test_one_client_gets_at_most_four_proxy_requests_at_once(make_proxy, target):
    p = make_proxy()
    url = f"{target.base}/hold"
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(p.get, url) for _ in range(6)]
        assert target.wait_for("/hold", 4) == 4
        time.sleep(0.3)
        busy = [f.result(timeout=5) for f in futures if f.done()]
        assert len(busy) == 2 and all(r.status_code == 429 for r in busy), busy
        assert "retry-after" in busy[0].headers
        # another client is not counted with this one
        with client_from("127.0.0.2", p.base) as other:
            f = pool.submit(other.get, "/cors-proxy", params={"url": f"{target.base}/hold"})
            assert target.wait_for("/hold", 5) == 5
            target.release.set()
            assert f.result(timeout=HOLD_S).status_code == 200
        assert (
            sorted(f.result(timeout=HOLD_S).status_code for f in futures) == [200] * 4 + [429] * 2
        )
    assert p.get(f"{target.base}/j").status_code == 200  # every slot was given back


def test_a_client_that_goes_away_gives_its_slot_back(make_proxy, target):
    p = make_proxy()
    for _ in range(3):  # more rounds than the client's four slots
        with ThreadPoolExecutor(4) as pool:
            futures = [
                pool.submit(p.get, f"{target.base}/hold", timeout=httpx.Timeout(10, read=0.5))
                for _ in range(4)
            ]
            for f in futures:
                with pytest.raises(httpx.ReadTimeout):
                    f.result(timeout=HOLD_S)
    target.release.set()
    deadline = time.monotonic() + 5
    while (r := p.get(f"{target.base}/j")).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert r.status_code == 200


def test_a_silent_target_times_out_after_the_flag(make_proxy, target):
    p = make_proxy("--ui-mcp-proxy-timeout", "1")
    t0 = time.monotonic()
    r = p.get(f"{target.base}/hold")
    assert_error(r, 504, "no answer within 1 s")
    assert time.monotonic() - t0 < 4


# ---- the server stays fast (real process, real model) ------------------------------------------


@pytest.fixture(scope="module")
def model_server() -> Iterator[ServerProc]:
    s = ServerProc("--ui-mcp-proxy", "-np", "2", "-c", "2048")
    yield s
    s.stop()


def timed(s: ServerProc, runs: int = 4) -> dict[str, list[float]]:
    """Seconds for ``runs`` rounds of one /tokenize then one short /completion (each must
    answer 200). /tokenize comes first: it waits for the default executor and nothing else,
    so a blocked executor shows there."""
    out: dict[str, list[float]] = {"/tokenize": [], "/completion": []}
    for _ in range(runs):
        for path, body in [
            ("/tokenize", {"content": "The quick brown fox"}),
            ("/completion", {"prompt": "The quick brown fox", "n_predict": 1, "temperature": 0}),
        ]:
            t0 = time.monotonic()
            r = s.client.post(path, json=body, timeout=HOLD_S + 10)
            out[path].append(round(time.monotonic() - t0, 3))
            assert r.status_code == 200, r.text
    return out


def assert_fast(t: dict[str, list[float]]) -> None:
    """Every /tokenize under 1 s; the best /completion too (on this 2-core machine shared
    with other work a lone completion can take seconds with nothing else running: the best
    of four separates that noise from a server that cannot answer)."""
    assert max(t["/tokenize"]) < 1.0 and min(t["/completion"]) < 1.0, t


def test_prompts_stay_fast_while_ten_slow_proxy_requests_are_in_flight(model_server, target):
    s = model_server
    timed(s, 1)  # warm
    before = timed(s)
    clients = [client_from(f"127.0.0.{2 + i // 4}", s.url) for i in range(10)]
    with ThreadPoolExecutor(10) as pool:
        futures = [
            pool.submit(c.get, "/cors-proxy", params={"url": f"{target.base}/hold"})
            for c in clients
        ]
        in_flight = target.wait_for("/hold", 10, timeout=HOLD_S / 4)
        during = timed(s)
        target.release.set()
        statuses = [f.result(timeout=HOLD_S + 10).status_code for f in futures]
    for c in clients:
        c.close()
    print(f"canary: before {before}, during {during} with {in_flight} proxy requests held")
    assert_fast(during)
    assert in_flight == 10 and statuses == [200] * 10


def test_a_proxy_nested_eight_deep_leaves_the_server_answering(model_server, target):
    s = model_server
    r = s.client.get(
        "/cors-proxy", params={"url": nested(s.url, f"{target.base}/j", 7)}, timeout=10
    )
    assert_error(r, 400, "proxy loop")
    assert_fast(timed(s))
    assert s.client.get("/health").status_code == 200
