"""``GET``/``POST /cors-proxy?url=...``: llama-server's experimental CORS proxy
(``server-cors-proxy.h``), which its web UI uses to reach MCP servers a page cannot reach
itself. On only with ``--ui-mcp-proxy``; otherwise 403 ``feature_disabled``, as there.

What it forwards: the method, the body, and only the headers the client names explicitly as
``x-llama-server-proxy-header-<name>`` (sent as ``<name>``), so the client's own
``Authorization``, ``X-Api-Key`` and cookies never reach the target. The target's status,
headers (less hop-by-hop, CORS, cookie and other origin-wide ones) and body come back, the
body streamed. Like any route it needs the API key, and under ``--cors-origins *`` only local
pages may use it (``middleware.RequestGuard``).

Where it is stricter than llama-server (each rule answers a way the proxy was abused):

- Its I/O runs on its own pool of ``POOL_SIZE`` threads, never on the default executor that
  tokenizes prompts; at most ``PER_CLIENT`` exchanges per client address and ``POOL_SIZE``
  in all (429 / 503 beyond), and ``--ui-mcp-proxy-timeout`` seconds (default 30) for the
  connection and each read (504).
- Redirects are followed only to the target's own origin (http/https), at most
  ``MAX_REDIRECTS``, and without the forwarded headers; any other redirect is a 502.
- A target that is this server (its port on a local address, or a request that already
  passed through this proxy, by its ``Via`` token) is refused with 400: no loops.
- The body is inert on the server's origin: ``Content-Disposition: attachment``, a sandbox
  CSP, ``nosniff``, and any type but JSON, SSE and plain text becomes
  ``application/octet-stream``; ``Set-Cookie`` never passes.
- A URL with whitespace, control characters or a malformed host or port is a 400.
"""

from __future__ import annotations

import asyncio
import http.client
import ipaddress
import logging
import re
import secrets
import socket
import ssl
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import SplitResult, quote, urljoin, urlsplit

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ..schemas.errors import APIError
from .common import state_of

router = APIRouter()
log = logging.getLogger("server")

PREFIX = "x-llama-server-proxy-header-"
CHUNK = 64 * 1024
POOL_SIZE = 16  # exchanges at once, all clients together: the proxy pool's threads
PER_CLIENT = 4  # exchanges at once from one client address (an MCP UI needs one or two)
MAX_REDIRECTS = 5
_REDIRECTS = {301, 302, 303, 307, 308}
# Not sent on: http.client writes these itself (and asks for no compression).
_REQUEST_SKIP = {
    "accept-encoding", "transfer-encoding", "content-length", "host", "connection", "via",
}  # fmt: skip
# Not sent back: hop-by-hop ones, and those that would act for the server's whole origin
# (cookies, HSTS, site data, policies, workers, preloads); ours replace the type and policy.
_RESPONSE_SKIP = {
    "server", "transfer-encoding", "content-length", "keep-alive", "connection", "te",
    "trailer", "upgrade", "proxy-authenticate", "proxy-connection", "location",
    "set-cookie", "set-cookie2", "clear-site-data", "strict-transport-security",
    "content-security-policy", "content-security-policy-report-only", "refresh",
    "content-disposition", "content-type", "x-content-type-options", "x-frame-options",
    "permissions-policy", "feature-policy", "service-worker-allowed", "alt-svc", "link",
    "report-to", "reporting-endpoints", "nel", "origin-agent-cluster", "timing-allow-origin",
}  # fmt: skip
_RESPONSE_SKIP_PREFIXES = ("access-control-", "cross-origin-", "sec-")
# Types a browser never renders as a page: passed on; any other becomes octet-stream.
_INERT_TYPES = {"application/json", "text/event-stream", "text/plain", "application/octet-stream"}
_INERT_HEADERS = {
    "Content-Disposition": "attachment",
    "Content-Security-Policy": "sandbox; default-src 'none'",
    "X-Content-Type-Options": "nosniff",
}
_HOSTNAME = re.compile(r"[A-Za-z0-9_.-]+")
_TLS = ssl.create_default_context()
_POOL = ThreadPoolExecutor(POOL_SIZE, thread_name_prefix="cors-proxy")
T = TypeVar("T")


# ---- the target URL ---------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A checked target: ``host`` is ASCII (IDNA), without brackets; ``path`` holds the
    query, percent-encoded; no user info, no fragment."""

    scheme: str
    host: str
    port: int
    path: str

    @property
    def origin(self) -> tuple[str, str, int]:
        return (self.scheme, self.host.lower(), self.port)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.path}"


def _ascii_host(name: str) -> str:
    """``name`` as it goes on the wire: an IP literal, or an IDNA-encoded DNS name."""
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        pass
    try:
        host = name.encode("idna").decode("ascii")
    except UnicodeError:
        raise APIError(400, f"invalid target URL: bad host {name!r}") from None
    if not _HOSTNAME.fullmatch(host):
        raise APIError(400, f"invalid target URL: bad host {name!r}")
    return host


def parse_target(url: str) -> Target:
    """The target of ``?url=``, checked as llama-server checks it, and stricter: no
    whitespace or control characters, a well-formed host and port (400 otherwise)."""
    if "://" not in url:
        raise APIError(400, "invalid URL: no scheme")
    if any(c <= " " or c == "\x7f" for c in url):
        raise APIError(400, "invalid target URL: it holds whitespace or control characters")
    try:
        parts: SplitResult = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise APIError(400, f"invalid target URL: {e}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise APIError(400, f"unsupported URL scheme in target URL: {parts.scheme}")
    if not parts.hostname:
        raise APIError(400, "invalid target URL: missing host")
    if parts.password:
        raise APIError(400, "authentication in target URL is not supported")
    if port == 0:
        raise APIError(400, "invalid target URL: port 0")
    # non-ASCII path and query text is sent percent-encoded (what a browser does)
    path = quote(parts.path or "/", safe="/%:@!$&'()*+,;=~")
    query = f"?{quote(parts.query, safe='/?%:@!$&()*+,;=~')}" if parts.query else ""
    default = 443 if scheme == "https" else 80
    return Target(scheme, _ascii_host(parts.hostname), port or default, path + query)


def redirect_target(first: Target, current: Target, location: str) -> Target:
    """Where a redirect from ``current`` to ``location`` goes, if it may be followed: an
    http(s) URL of ``first``'s origin. Else 502 (the target, not the client, is at fault)."""
    try:
        nxt = parse_target(urljoin(current.url, location.strip()))
    except APIError as e:
        raise APIError(502, f"redirect not followed: {e.message}") from None
    if nxt.origin != first.origin:
        raise APIError(502, "redirect to another origin not followed")
    return nxt


# a socket address as getaddrinfo gives it: (host, port) or, IPv6, (host, port, flow, scope)
SockAddr = tuple[str, int] | tuple[str, int, int, int]


def forwarded_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The ``x-llama-server-proxy-header-*`` headers, prefix removed; nothing else."""
    out: dict[str, str] = {}
    for key, value in headers.items():
        name = key.lower()
        if name.startswith(PREFIX) and name[len(PREFIX) :] not in ("", *_REQUEST_SKIP):
            out[name[len(PREFIX) :]] = value
    return out


# ---- admission: bounded concurrency -----------------------------------------------------


class Admission:
    """Exchanges in flight, per client and in all. ``enter`` refuses past the limits (429
    for one client, 503 for all), so a request never waits for the pool: each admitted
    exchange holds at most one pool thread at a time. Thread-safe (apps run in any loop)."""

    def __init__(self, total: int, per_client: int) -> None:
        self.total, self.per_client = total, per_client
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()

    def enter(self, client: str) -> None:
        with self.lock:
            if self.counts.get(client, 0) >= self.per_client:
                msg = f"too many proxy requests from this client at once (most {self.per_client})"
                raise APIError(429, msg, "rate_limit_error", headers={"Retry-After": "1"})
            if sum(self.counts.values()) >= self.total:
                msg = f"the proxy is busy: {self.total} requests are in flight"
                raise APIError(503, msg, headers={"Retry-After": "1"})
            self.counts[client] = self.counts.get(client, 0) + 1

    def leave(self, client: str) -> None:
        with self.lock:
            left = self.counts.get(client, 0) - 1
            if left > 0:
                self.counts[client] = left
            else:
                self.counts.pop(client, None)


ADMISSION = Admission(POOL_SIZE, PER_CLIENT)


async def in_pool(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` on the proxy's own threads, so that a slow target never holds a thread
    of the default executor (prompts are tokenized there)."""
    return await asyncio.get_running_loop().run_in_executor(_POOL, fn, *args)


# ---- the exchange with the target (blocking: runs in the pool) --------------------------


@dataclass(frozen=True)
class Call:
    """What the client asked the proxy to send, and this server's own ports (loops)."""

    target: Target
    method: str
    body: bytes | None
    headers: dict[str, str]  # the forwarded ones
    via: str  # the Via header to send: the incoming one's hops and ours
    timeout: float
    own_ports: frozenset[int]


def _is_local(ip: str) -> bool:
    """Whether ``ip`` is an address of this machine (what a socket can bind to)."""
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    if addr.is_loopback or addr.is_unspecified:
        return True
    family = socket.AF_INET6 if addr.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, 0))
        except OSError:
            return False
    return True


def _addresses(target: Target, own_ports: frozenset[int]) -> list[SockAddr]:
    """The target's socket addresses; 400 if one of them is this server (a proxy loop)."""
    try:
        infos = socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise APIError(502, f"proxy error: cannot resolve {target.host!r}: {e}") from None
    # a SOCK_STREAM lookup of a host name gives IPv4 and IPv6 addresses only
    addrs = [info[4] for info in infos if isinstance(info[4][0], str)]
    if target.port in own_ports and any(_is_local(str(a[0])) for a in addrs):
        raise APIError(400, "invalid target URL: it is this server (a proxy loop)")
    return addrs


def _connect(target: Target, addrs: list[SockAddr], timeout: float) -> socket.socket:
    """A connection to one of ``addrs`` (the ones checked: a second DNS answer cannot move
    it), TLS-wrapped for https."""
    error: OSError = OSError(f"no address for {target.host}")
    for addr in addrs:
        try:
            sock = socket.create_connection(addr[:2], timeout=timeout)
            break
        except OSError as e:
            error = e
    else:
        raise error
    if target.scheme == "https":
        try:
            return _TLS.wrap_socket(sock, server_hostname=target.host)
        except BaseException:
            sock.close()
            raise
    return sock


class Abort:
    """How the event loop ends an exchange a pool thread is blocked in (waiting for the
    target's head, say) when the client goes away: the thread names each socket it opens,
    ``abort`` shuts the named one down, and no later one is kept."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.aborted = False

    def watch(self, sock: socket.socket) -> None:
        """From the pool: ``sock`` is the exchange's socket now (closed if aborted)."""
        with self.lock:
            if self.aborted:
                sock.close()
                raise ConnectionAbortedError("the client went away")
            self.sock = sock

    def abort(self) -> None:
        with self.lock:
            self.aborted = True
            if self.sock is not None:
                _shut(self.sock)


def _shut(sock: socket.socket) -> None:
    """Shut ``sock`` down both ways: a read blocked on it in another thread returns."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not connected, or gone already


class Exchange:
    """One request sent and its response's head read. ``close`` may come from any thread:
    it shuts the socket down, which also ends a read blocked in the pool."""

    def __init__(self, sock: socket.socket, resp: http.client.HTTPResponse) -> None:
        self.sock, self.resp = sock, resp
        self.closed = False

    def read(self) -> bytes:
        return b"" if self.closed else self.resp.read1(CHUNK)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        _shut(self.sock)
        self.resp.close()
        self.sock.close()


def _send(
    target: Target,
    sock: socket.socket,
    call: Call,
    method: str,
    body: bytes | None,
    headers: dict[str, str],
) -> Exchange:
    """``method`` to ``target`` on the connected ``sock``; the response's head read."""
    cls = http.client.HTTPSConnection if target.scheme == "https" else http.client.HTTPConnection
    conn = cls(target.host, target.port, timeout=call.timeout)
    conn.sock = sock  # connected (and checked) already: http.client only writes and reads
    try:
        conn.request(method, target.path, body=body, headers=headers)
        return Exchange(sock, conn.getresponse())
    except BaseException:
        sock.close()
        raise


def exchange(call: Call, abort: Abort) -> Exchange:
    """``call`` sent, redirects followed as far as ``redirect_target`` allows. After a
    redirect only ``Via`` is sent: no forwarded header reaches any URL but the one the client
    named. 303 (and 301/302 after a POST) turn into a GET without body, as browsers do.
    Each socket is named to ``abort`` as soon as it is open."""
    target, method, body = call.target, call.method, call.body
    headers = {**call.headers, "Via": call.via}
    for _ in range(MAX_REDIRECTS + 1):
        addrs = _addresses(target, call.own_ports)
        sock = _connect(target, addrs, call.timeout)
        abort.watch(sock)
        ex = _send(target, sock, call, method, body, headers)
        location = ex.resp.getheader("location")
        if ex.resp.status not in _REDIRECTS or location is None:
            return ex
        ex.close()
        target = redirect_target(call.target, target, location)
        headers = {"Via": call.via}
        if ex.resp.status == 303 or (ex.resp.status in (301, 302) and method == "POST"):
            method, body = "GET", None
    raise APIError(502, f"proxy error: more than {MAX_REDIRECTS} redirects")


# ---- the response -----------------------------------------------------------------------


def response_headers(resp: http.client.HTTPResponse) -> dict[str, str]:
    """The target's headers that may stand on this server's origin, and ours that keep its
    body inert there (a page of the target's must not run as ours, nor set our cookies)."""
    out: dict[str, str] = {}
    for key, value in resp.getheaders():
        name = key.lower()
        if name in _RESPONSE_SKIP or name.startswith(_RESPONSE_SKIP_PREFIXES):
            continue
        if name == "www-authenticate" and value.split(" ", 1)[0].lower() in ("basic", "digest"):
            continue  # would open a login prompt in the name of this server
        out[key] = value
    ctype = resp.getheader("content-type") or ""
    media = ctype.split(";", 1)[0].strip().lower()
    inert = media in _INERT_TYPES or media.endswith("+json")
    return {**out, **_INERT_HEADERS, "Content-Type": ctype if inert else "application/octet-stream"}


class Relay(StreamingResponse):
    """The target's response, streamed from the pool. ``done`` (close the exchange, leave
    admission) runs once whatever ends the response: the end of the body, a failed read,
    or a client that went away before the body started."""

    def __init__(self, ex: Exchange, done: Callable[[], None]) -> None:
        self.ex, self.done = ex, done
        super().__init__(self._chunks(), ex.resp.status, response_headers(ex.resp))

    async def _chunks(self) -> AsyncIterator[bytes]:
        try:
            while chunk := await in_pool(self.ex.read):
                yield chunk
        except (OSError, http.client.HTTPException) as e:
            # the head is sent already: the stream just ends (the client sees it cut)
            log.warning("proxy: the target's body ended early: %s", e)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.done()


def _own_ports(request: Request) -> frozenset[int]:
    """The ports this server answers on: the configured one and the one of this request."""
    ports = {state_of(request).settings.port}
    server = request.scope.get("server")
    if server and server[1]:
        ports.add(int(server[1]))
    return frozenset(ports)


def via_token(request: Request) -> str:
    """This app's ``Via`` hop name, random per app: a request that carries it came through
    this proxy, so proxying it again would be a loop (whatever address reached us)."""
    state = request.app.state
    if not hasattr(state, "cors_proxy_via"):
        state.cors_proxy_via = f"1.1 llama-slot-server-{secrets.token_hex(6)}"
    return state.cors_proxy_via


async def _call(request: Request, method: str) -> Call:
    """The checked request: its target and what to send (400 for a bad URL or a loop)."""
    target = parse_target(request.query_params.get("url", ""))
    token = via_token(request)
    incoming = request.headers.get("via", "")
    if token in incoming:
        raise APIError(400, "invalid target URL: it leads back to this server (a proxy loop)")
    return Call(
        target=target,
        method=method,
        body=await request.body() if method == "POST" else None,
        headers=forwarded_headers(request.headers),
        via=f"{incoming}, {token}" if incoming else token,
        timeout=state_of(request).settings.ui_mcp_proxy_timeout,
        own_ports=_own_ports(request),
    )


async def _gone(request: Request) -> None:
    """Returns when the client has gone away (its connection closed)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _start(call: Call, request: Request) -> Exchange | None:
    """``exchange(call)`` in the pool, ended early if the client goes away meanwhile (then
    None); the target's failures as 502, its silence as 504. Returns only once the pool
    thread is done with it, so an admitted request never holds more than one thread."""
    abort = Abort()
    job = asyncio.ensure_future(in_pool(exchange, call, abort))
    gone = asyncio.ensure_future(_gone(request))
    try:
        await asyncio.wait({job, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    left = gone.done() and not gone.cancelled() and gone.exception() is None
    if left:
        abort.abort()
    try:
        ex = await job
    except TimeoutError:
        if left:
            return None
        raise APIError(504, f"proxy error: no answer within {call.timeout:g} s") from None
    except (OSError, http.client.HTTPException, ValueError) as e:
        if left:
            return None
        raise APIError(502, f"proxy error: {e}") from None
    if left:
        ex.close()
        return None
    return ex


async def proxy(request: Request, method: str) -> Response:
    """One proxied request, admitted first (429/503 past the limits), relayed streaming."""
    if not state_of(request).settings.ui_mcp_proxy:
        body = {"error": {"message": "this feature is disabled", "type": "feature_disabled"}}
        return JSONResponse(body, status_code=403)
    call = await _call(request, method)
    client = request.client.host if request.client else ""
    ADMISSION.enter(client)
    try:
        log.info("proxying %s request to %s", method, call.target.url.split("?", 1)[0])
        ex = await _start(call, request)
    except BaseException:
        ADMISSION.leave(client)
        raise
    if ex is None:  # nobody to answer
        ADMISSION.leave(client)
        return Response(status_code=499)
    left = False

    def done() -> None:
        nonlocal left
        ex.close()
        if not left:
            left = True
            ADMISSION.leave(client)

    return Relay(ex, done)


@router.get("/cors-proxy")
async def cors_proxy_get(request: Request) -> Response:
    return await proxy(request, "GET")


@router.post("/cors-proxy")
async def cors_proxy_post(request: Request) -> Response:
    return await proxy(request, "POST")
