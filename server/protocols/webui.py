"""GET / and /webui/*: the chat page (on by default; ``--no-webui`` turns it off, as in
llama-server).

The page is built from ``webui/`` (``webui/build.sh``, npm at build time only) into
``server/webui/static``, which ships inside the package: serving it needs no Node.js and
loads nothing from another host. ``index.html`` is served at ``/`` and ``/index.html``,
every other file under ``/webui/``. These paths need no API key (``page_paths``; the page
asks for one when the API answers 401), as llama-server's UI assets need none.

Every answer carries a strict Content-Security-Policy: scripts, styles, images and
connections from this origin only (images also as data: URLs: the thumbnails of
attached images), no inline script or style, no framing. So even a model
answer that got past the page's sanitizer could not run a script or send data elsewhere.
"""

from __future__ import annotations

import hashlib
import mimetypes
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, Request, Response

STATIC = Path(__file__).resolve().parents[1] / "webui" / "static"
PREFIX = "/webui/"
INDEX = "index.html"

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}
_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}


@dataclass(frozen=True)
class Asset:
    body: bytes
    media_type: str
    etag: str


def load_assets(directory: Path = STATIC) -> dict[str, Asset]:
    """The page's files by name (plain files directly in ``directory``), read once. Empty
    when the directory is missing (a checkout without the built page)."""
    out: dict[str, Asset] = {}
    if not directory.is_dir():
        return out
    for p in sorted(directory.iterdir()):
        if not p.is_file() or p.name.startswith("."):
            continue
        body = p.read_bytes()
        kind = _TYPES.get(p.suffix) or mimetypes.guess_type(p.name)[0] or "application/octet-stream"
        if kind.startswith("text/") and "charset" not in kind:
            kind += "; charset=utf-8"
        out[p.name] = Asset(body, kind, '"' + hashlib.sha256(body).hexdigest()[:32] + '"')
    return out


def page_paths(assets: dict[str, Asset]) -> frozenset[str]:
    """The request paths that serve the page: public, like /health (no API key)."""
    names = {PREFIX + n for n in assets if n != INDEX}
    return frozenset({"/", "/" + INDEX, *names}) if INDEX in assets else frozenset(names)


def _answer(request: Request, asset: Asset) -> Response:
    """The asset, or 304 when the browser holds this version (``If-None-Match``). Always
    revalidated (``no-cache``): names carry no hash, so a new build is seen on reload."""
    headers = {**_SECURITY_HEADERS, "ETag": asset.etag, "Cache-Control": "no-cache"}
    tags = [
        t.strip().removeprefix("W/") for t in request.headers.get("if-none-match", "").split(",")
    ]
    if asset.etag in tags:
        return Response(status_code=304, headers=headers)
    body = b"" if request.method == "HEAD" else asset.body
    headers["Content-Length"] = str(len(asset.body))
    return Response(body, media_type=asset.media_type, headers=headers)


def make_router(assets: dict[str, Asset] | None = None) -> APIRouter:
    """The page's routes over ``assets`` (default: the shipped files). An unknown name
    under /webui/ is a 404."""
    files = load_assets() if assets is None else assets
    router = APIRouter()

    @router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    @router.api_route("/" + INDEX, methods=["GET", "HEAD"], include_in_schema=False)
    async def index(request: Request) -> Response:
        if INDEX not in files:
            return Response("the web page is not built (webui/build.sh)", 404)
        return _answer(request, files[INDEX])

    @router.api_route(PREFIX + "{name}", methods=["GET", "HEAD"], include_in_schema=False)
    async def asset(name: str, request: Request) -> Response:
        if name == INDEX or name not in files:
            return Response("not found", 404, headers={"Cache-Control": "no-cache"})
        return _answer(request, files[name])

    return router
