"""Pure ASGI middlewares (they keep streaming responses and disconnect detection intact).

They sit below the routes: they import nothing from ``server.protocols``."""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from urllib.parse import parse_qsl

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..schemas.errors import error_body_for
from .cors import (
    LOCAL_HOSTS,
    CorsPolicy,
    hostname,
    is_local_origin,
    normalize_origin,
    origin_host,
)
from .metrics import ServerMetrics, endpoint_label

# Load balancers probe these without credentials.
PUBLIC_PATHS = {"/health", "/v1/health"}

Headers = list[tuple[bytes, bytes]]


async def send_json(
    send: Send, status: int, body: dict[str, object], headers: Headers | None = None
) -> None:
    """Answer with ``body`` as JSON without calling the app."""
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


def _header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower case, as ASGI gives them), or None."""
    for k, v in scope.get("headers", []):
        if k == name:
            return v
    return None


# Raw-path text that some later reader (a proxy, httpx, a file system) may decode or fold
# into a separator: encoded slashes and backslashes.
_ENCODED_SEPARATORS = ("%2f", "%5c")


def path_problem(path: str, raw_path: bytes | None) -> str | None:
    """Why a request path is refused, or None. Every rule about paths (the local-only
    endpoints, routing, the router's forward) reads the path as it is; a path another hop
    could read differently would walk around them: a dot segment (``/x/../slots``, also
    encoded), an empty one (``//``), a backslash or an encoded slash or backslash (decoded,
    ``/x/..%2Fslots`` is ``/x/../slots``), a control character. Both the decoded ``path``
    and the ``raw_path`` the client sent are checked."""
    raw = raw_path.decode("latin-1") if raw_path is not None else path
    for text in (path, raw):
        if not text.startswith("/"):
            return "the path must start with '/'"
        if "\\" in text:
            return "the path may not hold a backslash"
        if any(ord(c) < 0x20 or c == "\x7f" for c in text):
            return "the path may not hold a control character"
        segments = text.split("/")[1:]
        if any(seg in (".", "..") for seg in segments):
            return "the path may not hold '.' or '..' segments"
        if "" in segments[:-1]:
            return "the path may not hold an empty segment ('//')"
    lowered = raw.lower()
    if any(sep in lowered for sep in _ENCODED_SEPARATORS):
        return "the path may not hold an encoded slash or backslash (%2F, %5C)"
    return None


class ApiKeyAuth:
    """Every endpoint but /health needs a key: ``Authorization: Bearer KEY`` or ``X-Api-Key``.

    Keys are compared in constant time, against every configured key (no early exit).
    CORS preflights (OPTIONS) are answered by the CORS layer outside this one. ``public``:
    more paths that need no key (the web page's files: the page asks for the key itself).
    """

    def __init__(self, app: ASGIApp, keys: list[str], public: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys if k]
        self.public = PUBLIC_PATHS | public

    def _valid(self, given: bytes) -> bool:
        """Whether ``given`` is a configured key; the time taken does not say which or how
        close (every key is compared, each in constant time)."""
        ok = False
        for k in self.keys:
            ok |= hmac.compare_digest(given, k)
        return ok

    @staticmethod
    def _remember(scope: Scope, key: bytes) -> None:
        """The request's key, as a tenant name (--cache-isolation key): a digest, so the key
        itself never reaches logs or /slots."""
        digest = hashlib.sha256(key).hexdigest()[:16]
        scope.setdefault("state", {})["api_key_id"] = digest

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or not self.keys
            or scope.get("path") in self.public
            or scope.get("method") == "OPTIONS"
        ):
            await self.app(scope, receive, send)
            return
        given = b""
        auth = _header(scope, b"authorization")
        if auth and auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        else:
            given = (_header(scope, b"x-api-key") or b"").strip()
        if given and self._valid(given):
            self._remember(scope, given)
            await self.app(scope, receive, send)
            return
        await send_json(
            send,
            401,
            error_body_for(scope.get("path", ""), 401, "Invalid API Key"),
            [(b"www-authenticate", b"Bearer")],
        )


class BodyLimit:
    """Bodies over the limit get 413 before the app sees them (chunked bodies included)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        too_big = error_body_for(
            scope.get("path", ""), 413, f"request body exceeds {self.max_bytes} bytes"
        )
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await send_json(send, 413, too_big)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await send_json(send, 413, too_big)
                return
            chunks.append(body)
            if not msg.get("more_body"):
                break
        # The app reads the body again: hand it over whole, then pass on what follows
        # (the disconnect that streaming responses wait for).
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


@dataclass(frozen=True)
class LocalOnly:
    """A family of endpoints only local pages (and clients that send no ``Origin``) may
    reach: ``path`` and every path under it, for ``methods`` (empty: every method), and, when
    ``query`` is set, only when the query string names that parameter."""

    path: str
    methods: frozenset[str] = frozenset()
    query: str = ""

    def matches(self, method: str, path: str, query_string: bytes) -> bool:
        if path != self.path and not path.startswith(self.path + "/"):
            return False
        if self.methods and method not in self.methods:
            return False
        if not self.query:
            return True
        pairs = parse_qsl(query_string.decode("latin-1"), keep_blank_values=True)
        return any(k == self.query for k, _ in pairs)


# Endpoints that change server state (files, slots, settings, adapters, which models run) or
# read what only the machine's user may (other clients' prompts, paths), or reach other hosts
# (the CORS proxy): not for any web page elsewhere. One table for the server and the router
# (which proxies every other path to an instance: the same rule holds there). A new endpoint
# that changes state belongs here; tests/unit/test_guard_routes.py lists every route.
LOCAL_ONLY = (
    LocalOnly("/slots"),
    LocalOnly("/cache"),
    LocalOnly("/props"),
    LocalOnly("/cors-proxy"),
    LocalOnly("/lora-adapters"),
    LocalOnly("/v1/load_lora_adapter"),  # vLLM's run-time adapters (--enable-lora-runtime)
    LocalOnly("/v1/unload_lora_adapter"),
    LocalOnly("/debug"),
    LocalOnly("/sleep"),  # vLLM's sleep mode: frees the model (GET /is_sleeping is open)
    LocalOnly("/wake_up"),
    LocalOnly("/models/load"),  # the router's
    LocalOnly("/models/unload"),
    LocalOnly("/models", query="reload"),
    LocalOnly("/v1/models", query="reload"),
)


def local_only(scope: Scope) -> bool:
    """Whether the request is one of ``LOCAL_ONLY``'s."""
    method, path = scope.get("method", "GET"), scope.get("path", "")
    query = scope.get("query_string", b"")
    return any(rule.matches(method, path, query) for rule in LOCAL_ONLY)


def referer_origin(referer: str) -> str | None:
    """The origin (``scheme://host[:port]``, normalized) of a ``Referer`` URL; None if it
    names none (empty, relative or opaque)."""
    if "://" not in referer:
        return None
    scheme, rest = referer.split("://", 1)
    authority = rest.split("/", 1)[0].split("?", 1)[0].split("#", 1)[0]
    if not scheme or not authority:
        return None
    return normalize_origin(f"{scheme}://{authority.rsplit('@', 1)[-1]}")


def from_foreign_page(scope: Scope) -> bool:
    """Whether a page on another host sent this request: its ``Origin`` (or, lacking one,
    its ``Referer``'s origin) names a host that is not local (``null`` included), or, with
    neither, ``Sec-Fetch-Site`` says cross-site or same-site. curl and SDKs: False."""
    raw = _header(scope, b"origin")
    if raw is not None:
        return not is_local_origin(normalize_origin(raw.decode("latin-1")))
    referer = referer_origin((_header(scope, b"referer") or b"").decode("latin-1"))
    if referer is not None:
        return not is_local_origin(referer)
    return _header(scope, b"sec-fetch-site") in (b"cross-site", b"same-site")


def _json_type(ctype: bytes) -> bool:
    media = ctype.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or media.endswith(b"+json")


class RequestGuard:
    """What a web page must not do to a server it can reach (DNS rebinding, cross-site
    requests that need no CORS preflight):

    - a path that another hop could read differently (``path_problem``: dot segments,
      ``//``, backslashes, encoded slashes) is refused (400) before any rule reads it;
    - with ``allowed_hosts``, the Host header must name one of them (403);
    - a request with an ``Origin`` must come from an allowed origin: one of ``cors_origins``
      when set (the item ``localhost``: any local page); when it is ``*`` (the default), any
      origin may generate, but only local pages (localhost, 127.0.0.1, [::1]) may reach the
      endpoints of ``LOCAL_ONLY`` (state, private reads, the CORS proxy), and a page on
      another site may not send cookies (403: preflights allow credentials, as
      llama-server's do, so a browser would otherwise send the user's cookies to a
      cookie-authenticating proxy in front);
    - a request to those endpoints without an ``Origin`` (an ``<img>``, a link: browsers
      send none on such GETs) is judged by its ``Referer``'s origin the same way, and
      refused when ``Sec-Fetch-Site`` says it is cross-site or same-site and no ``Referer``
      names the page; curl and SDKs send neither and pass;
    - a POST body must be JSON (``application/json`` or ``+json``, else 415); a missing type
      and curl's form type pass only without an Origin, so ``curl -d`` keeps working.

    Bodies that pass are handed on as JSON (llama-server reads them whatever the type).
    """

    def __init__(self, app: ASGIApp, cors_origins: list[str], allowed_hosts: list[str]) -> None:
        self.app = app
        # which origins are named: the same rule as the CORS headers' (cors.CorsPolicy)
        self.cors = CorsPolicy(",".join(cors_origins))
        self.hosts = {hostname(h) for h in allowed_hosts}

    def _origin_refusal(self, scope: Scope, origin: str) -> tuple[int, str] | None:
        local = origin_host(origin) in LOCAL_HOSTS
        if not self.cors.any_origin:
            if self.cors.allows(origin):
                return None
            return 403, f"origin {origin!r} is not allowed (--cors-origins)"
        if local_only(scope) and not local:
            return 403, f"origin {origin!r} may not change server state; see --cors-origins"
        host = hostname((_header(scope, b"host") or b"").decode("latin-1"))
        if _header(scope, b"cookie") and not local and origin_host(origin) != host:
            return 403, f"origin {origin!r} may not send cookies; see --cors-origins"
        return None

    def _fetch_refusal(self, scope: Scope) -> tuple[int, str] | None:
        """A request without ``Origin`` to a state or proxy route. Browsers send none on a
        GET that is not ``fetch``'s (an ``<img>``, a link, a navigation), so a page elsewhere
        could make the server act with it: ``Sec-Fetch-Site`` says where such a request came
        from, and ``Referer`` which page sent it, judged like an ``Origin``. Without either
        (curl, SDKs) it passes; a cross-site one without a ``Referer`` does not."""
        if not local_only(scope):
            return None
        site = _header(scope, b"sec-fetch-site")
        if site in (b"same-origin", b"none"):  # the server's own pages, or the user's typing
            return None
        referer = referer_origin((_header(scope, b"referer") or b"").decode("latin-1"))
        if referer is not None:
            return self._origin_refusal(scope, referer)
        if site is None:
            return None
        return 403, "a cross-site request may not change server state; see --cors-origins"

    def _refusal(self, scope: Scope) -> tuple[int, str] | None:
        if self.hosts:
            host = (_header(scope, b"host") or b"").decode("latin-1")
            if hostname(host) not in self.hosts:
                return 403, f"host {host!r} is not allowed (--allowed-hosts)"
        origin_raw = _header(scope, b"origin")
        origin = normalize_origin(origin_raw.decode("latin-1")) if origin_raw else None
        if scope.get("method") != "OPTIONS":
            refusal = (
                self._origin_refusal(scope, origin)
                if origin is not None
                else self._fetch_refusal(scope)
            )
            if refusal is not None:
                return refusal
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            ctype = _header(scope, b"content-type")
            lenient = origin is None and (
                ctype is None or ctype.startswith(b"application/x-www-form-urlencoded")
            )
            has_body = _header(scope, b"content-length") not in (None, b"0")
            if not lenient and (ctype is not None or has_body) and not _json_type(ctype or b""):
                kind = (ctype or b"none").decode("latin-1")
                return 415, f"the body must be JSON (Content-Type application/json), not {kind}"
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        problem = path_problem(scope.get("path", ""), scope.get("raw_path"))
        if problem is not None:  # before any rule reads the path
            await send_json(send, 400, error_body_for("", 400, problem))
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await send_json(send, refusal[0], error_body_for(scope.get("path", ""), *refusal))
            return
        if scope.get("method") == "POST":
            headers = [(k, v) for k, v in scope.get("headers", []) if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


class RequestCounter:
    """Counts requests by endpoint and outcome (status class)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = endpoint_label(scope.get("path", ""))
        status = 500  # what counts if the app fails before it starts a response

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.count_request(endpoint, status)


class ApiPrefix:
    """--api-prefix: every route is served under ``prefix`` (llama-server registers each at
    prefix + path, /health included): ``prefix/x`` reaches the app as ``/x``, so every rule
    below (the path check, the guard, the key's public paths, metrics) sees the path as
    without a prefix; any other path is a 404 the app never sees. Outermost."""

    def __init__(self, app: ASGIApp, prefix: str) -> None:
        self.app = app
        self.prefix = prefix  # "/a/b": no trailing slash (Settings._prefix)
        self.raw = prefix.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        raw = scope.get("raw_path")
        # the prefix must be the decoded and the raw path's first segments, both (an
        # encoded prefix is no prefix: the two readings of the path would differ)
        under = path.startswith(self.prefix + "/") and (
            raw is None or raw.startswith(self.raw + b"/")
        )
        if not under:
            if scope["type"] == "http":
                await send_json(send, 404, error_body_for(path, 404, "File Not Found"))
            return  # a websocket not accepted: closed with 403 by the server
        scope = dict(scope)
        scope["path"] = path[len(self.prefix) :]
        if raw is not None:
            scope["raw_path"] = raw[len(self.raw) :]
        await self.app(scope, receive, send)
