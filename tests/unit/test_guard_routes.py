"""Every route of the real apps (the single-model server and the router) is declared here as
local-only (it changes server state, reads what only the machine's user may, or reaches other
hosts) or open, and each local-only one is refused from a page elsewhere. A new route that is
in neither list fails ``test_every_route_is_declared``: decide which it is (a local-only one
also goes into ``server.http.middleware.LOCAL_ONLY``). Nothing here loads a model: the guard
answers before any route needs one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from server.http.app import create_app
from server.router.router_app import create_router_app
from server.settings.config import parse_settings

EVIL = {"Origin": "http://evil.example"}
LOCAL = {"Origin": "http://localhost:5173"}

# The single-model server's routes, (method, path template).
SERVER_LOCAL_ONLY = {
    ("GET", "/props"),
    ("POST", "/props"),  # settings
    ("GET", "/slots"),  # other clients' prompts
    ("POST", "/slots/{id_slot}"),  # save, restore, erase
    ("GET", "/cache"),
    ("GET", "/debug/integrity"),
    ("GET", "/lora-adapters"),
    ("POST", "/lora-adapters"),  # every client's adapter scales
    ("POST", "/v1/load_lora_adapter"),  # vLLM's run-time adapters: files of the machine
    ("POST", "/v1/unload_lora_adapter"),
    ("GET", "/cors-proxy"),  # other hosts
    ("POST", "/cors-proxy"),
    ("POST", "/sleep"),  # vLLM's sleep mode: frees the model
    ("POST", "/wake_up"),
}
_GENERATE = [
    "/completion",
    "/completions",
    "/tokenize",
    "/detokenize",
    "/v1/completions",
    "/v1/chat/completions",
    "/chat/completions",
    "/v1/completions/render",
    "/v1/chat/completions/render",
    "/infill",
    "/apply-template",
    "/v1/chat/completions/input_tokens",
    "/chat/completions/input_tokens",
    "/v1/responses",
    "/responses",
    "/v1/responses/input_tokens",
    "/responses/input_tokens",
    "/v1/messages",
    "/messages",
    "/v1/messages/count_tokens",
    "/messages/count_tokens",
    "/v1/embeddings",
    "/embedding",
    "/embeddings",
    "/rerank",
    "/reranking",
    "/v1/rerank",
    "/v1/reranking",
    "/predict",  # Vertex: each instance runs through the whole app (and this guard) again
]
_READ = [
    "/is_sleeping",
    "/health",
    "/v1/health",
    "/v1/models",
    "/models",
    "/v1/models/{model_id:path}",
    "/metrics",
]
_DOCS = ["/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"]
_PAGE = ["/", "/index.html"]
# resumable streams: a stream's id is its capability (and its API key's, with keys)
_STREAMS = {("GET", "/v1/stream"), ("DELETE", "/v1/stream"), ("POST", "/v1/streams/lookup")}
SERVER_OPEN = (
    _STREAMS
    | {("POST", p) for p in _GENERATE}
    | {("GET", p) for p in [*_READ, *_DOCS, *_PAGE]}
    | {("HEAD", p) for p in [*_DOCS, *_PAGE]}
)

# The router's own routes; the catch-all passes every other path to an instance, so every
# local-only route of the server is checked through the router too.
ROUTER_LOCAL_ONLY = {
    ("GET", "/props"),  # with ?model=: the instance's
    ("POST", "/models/load"),
    ("POST", "/models/unload"),
    ("POST", "/sleep"),  # with ?model=: the instance's
    ("POST", "/wake_up"),
}
ROUTER_LOCAL_ONLY_QUERIES = [("GET", "/models?reload=1"), ("GET", "/v1/models?reload=1")]
_CATCH_ALL = {(m, "/{path:path}") for m in ("GET", "POST", "PUT", "PATCH", "DELETE")}
ROUTER_OPEN = (
    {
        ("GET", p)
        for p in ["/health", "/v1/health", "/models", "/v1/models", "/models/sse", "/is_sleeping"]
    }
    | {("GET", p) for p in [*_DOCS, *_PAGE]}
    | {("HEAD", p) for p in [*_DOCS, *_PAGE]}
    | _CATCH_ALL
    | _STREAMS
)
_PAGE_FILES = "/{name}"  # the page's other files, under its prefix


def flat(routes: list[Any]) -> Iterator[Any]:
    """Every route, included routers' too (FastAPI keeps an included router as one entry
    holding its ``original_router``)."""
    for route in routes:
        if hasattr(route, "original_router"):
            yield from flat(route.original_router.routes)
        else:
            yield route


def routes_of(app: FastAPI) -> Iterator[tuple[str, str]]:
    """(method, path) of every route of ``app``; the page's file route by its suffix."""
    for route in flat(app.routes):
        path = getattr(route, "path", "")
        if path.endswith(_PAGE_FILES) and path != "/{path:path}":
            continue  # GET/HEAD of static page files: open
        for method in getattr(route, "methods", None) or ():
            yield method, path


def concrete(path: str) -> str:
    return path.replace("{id_slot}", "0").replace("{model_id:path}", "x")


@pytest.fixture(scope="module")
def server_app() -> FastAPI:
    env = {"AIP_MODE": "PREDICTION"}  # Vertex's /predict too
    return create_app(parse_settings(["--ui-mcp-proxy"], env=env))


@pytest.fixture(scope="module")
def router_app(tmp_path_factory: pytest.TempPathFactory) -> FastAPI:
    d: Path = tmp_path_factory.mktemp("models")
    (d / "a.gguf").write_bytes(b"")
    return create_router_app(parse_settings(["--models-dir", str(d)], env={}), [])


def test_every_route_is_declared(server_app, router_app):
    assert set(routes_of(server_app)) == SERVER_LOCAL_ONLY | SERVER_OPEN
    assert not SERVER_LOCAL_ONLY & SERVER_OPEN
    assert set(routes_of(router_app)) == ROUTER_LOCAL_ONLY | ROUTER_OPEN
    assert not ROUTER_LOCAL_ONLY & ROUTER_OPEN


def _request(app: FastAPI, method: str, path: str, headers: dict[str, str]) -> int:
    c = TestClient(app, raise_server_exceptions=False)
    body = b"{}" if method in ("POST", "PUT", "PATCH") else None
    h = {**headers, "Content-Type": "application/json"} if body else headers
    return c.request(method, path, content=body, headers=h).status_code


@pytest.mark.parametrize("method,path", sorted(SERVER_LOCAL_ONLY))
def test_each_local_only_route_of_the_server_refuses_a_page_elsewhere(server_app, method, path):
    assert _request(server_app, method, concrete(path), EVIL) == 403
    assert _request(server_app, method, concrete(path), LOCAL) != 403


@pytest.mark.parametrize(
    "method,path",
    sorted(ROUTER_LOCAL_ONLY | SERVER_LOCAL_ONLY) + ROUTER_LOCAL_ONLY_QUERIES,
)
def test_each_local_only_route_of_the_router_refuses_a_page_elsewhere(router_app, method, path):
    # the server's, through the catch-all, refused at the router before any model starts
    sep = "&" if "?" in path else "?"
    assert _request(router_app, method, f"{concrete(path)}{sep}model=zz", EVIL) == 403


def test_a_router_listing_without_reload_stays_open(router_app):
    assert _request(router_app, "GET", "/models", EVIL) == 200
    assert _request(router_app, "GET", "/models?reload=1", LOCAL) == 200
