"""``GET``/``POST /cors-proxy?url=...``: llama-server's experimental CORS proxy
(``server-cors-proxy.h``), which its web UI uses to reach MCP servers a page cannot reach
itself. On only with ``--ui-mcp-proxy``; otherwise 403 ``feature_disabled``, as there.

What it forwards: the method, the body, and only the headers the client names explicitly as
``x-llama-server-proxy-header-<name>`` (sent as ``<name>``), so the client's own
``Authorization``, ``X-Api-Key`` and cookies never reach the target. The target's status,
headers (less hop-by-hop and CORS ones) and body come back, the body streamed. Redirects are
followed, as llama-server's client does. Like any route it needs the API key, and under
``--cors-origins *`` only local pages may use it (``middleware.RequestGuard``).
"""

from __future__ import annotations

import asyncio
import logging
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import SplitResult, urlsplit

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..errors import APIError
from .common import state_of

router = APIRouter()
log = logging.getLogger("server")

PREFIX = "x-llama-server-proxy-header-"
TIMEOUT_S = 600  # llama-server's read and write timeouts for the proxied request
CHUNK = 64 * 1024
# Not sent on: llama-server lets its client compute these (and asks for no compression).
_REQUEST_SKIP = {"accept-encoding", "transfer-encoding", "content-length", "host", "connection"}
# Not sent back: hop-by-hop, and CORS headers (ours are written by server.cors).
_RESPONSE_SKIP = {"server", "transfer-encoding", "content-length", "keep-alive", "connection"}


@dataclass(frozen=True)
class Target:
    """A checked target URL: what is requested (no user info)."""

    url: str
    host: str


def parse_target(url: str) -> Target:
    """The target of ``?url=``, checked as llama-server checks it (400 otherwise)."""
    if "://" not in url:
        raise APIError(400, "invalid URL: no scheme")
    try:
        parts: SplitResult = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise APIError(400, f"invalid target URL: {e}") from None
    if parts.scheme not in ("http", "https"):
        raise APIError(400, f"unsupported URL scheme in target URL: {parts.scheme}")
    if not parts.hostname:
        raise APIError(400, "invalid target URL: missing host")
    if parts.password:
        raise APIError(400, "authentication in target URL is not supported")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    netloc = host if port is None else f"{host}:{port}"
    path = parts.path or "/"
    query = f"?{parts.query}" if parts.query else ""
    return Target(f"{parts.scheme}://{netloc}{path}{query}", netloc)


def forwarded_headers(headers: Any) -> dict[str, str]:
    """The ``x-llama-server-proxy-header-*`` headers, prefix removed; nothing else."""
    out: dict[str, str] = {}
    for key, value in headers.items():
        name = key.lower()
        if name.startswith(PREFIX) and name[len(PREFIX) :] not in ("", *_REQUEST_SKIP):
            out[name[len(PREFIX) :]] = value
    return out


def _open(req: urllib.request.Request) -> Any:
    """The target's response (error statuses included); OSError if it cannot be reached."""
    # No environment proxies: the operator asked for this URL, not for a detour.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        return opener.open(req, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as e:
        return e


async def _body(resp: Any) -> AsyncIterator[bytes]:
    read = getattr(resp, "read1", None) or resp.read
    try:
        while chunk := await asyncio.to_thread(read, CHUNK):
            yield chunk
    finally:
        resp.close()


async def proxy(request: Request, method: str) -> Response:
    if not state_of(request).settings.ui_mcp_proxy:
        body = {"error": {"message": "this feature is disabled", "type": "feature_disabled"}}
        return JSONResponse(body, status_code=403)
    target = parse_target(request.query_params.get("url", ""))
    data = await request.body() if method == "POST" else None
    req = urllib.request.Request(target.url, data=data, method=method)
    for name, value in forwarded_headers(request.headers).items():
        req.add_header(name, value)
    log.info("proxying %s request to %s", method, target.url.split("?", 1)[0])
    try:
        resp = await asyncio.to_thread(_open, req)
    except (OSError, ValueError) as e:
        raise APIError(500, f"proxy error: {e}") from None
    headers = {
        k: v
        for k, v in resp.headers.items()
        if k.lower() not in _RESPONSE_SKIP and not k.lower().startswith("access-control-")
    }
    return StreamingResponse(_body(resp), status_code=resp.getcode(), headers=headers)


@router.get("/cors-proxy")
async def cors_proxy_get(request: Request) -> Response:
    return await proxy(request, "GET")


@router.post("/cors-proxy")
async def cors_proxy_post(request: Request) -> Response:
    return await proxy(request, "POST")
