"""Resumable streams through the router (llama-server's router stream routes). The sessions
live in the instances (server.service.streams); the router remembers which model each
named request went to (``ConvMap``, when it passes the request on) and sends the stream
routes there:

- ``GET /v1/stream``: passed to the owning instance; 503 (retry) while that model loads,
  404 when no model is known for the id or its instance is gone.
- ``DELETE /v1/stream``: passed to the owning instance when it runs; the id is forgotten;
  204 either way.
- ``POST /v1/streams/lookup``: the named ids grouped by owning instance, each instance
  asked for its own; the answers joined. Never a listing: only named ids are looked up.

The map is keyed by (API key digest, id), as the instances key their sessions, and bounded
(the least recently named go first)."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Protocol

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..api.errors import APIError
from ..api.stream_ids import HEADER, check_id, lookup_ids, owner_of, valid_id
from .instances import LOADING, READY, Instance
from .manager import Manager
from .proxy import Upstream, forward, upstream_headers

log = logging.getLogger("server.router")

MAP_MAX = 4096  # conversation ids remembered (a few times any instance's --streams-max)
LOOKUP_TIMEOUT_S = 2.0  # an instance's lookup answer (llama-server: 250 ms)

router = APIRouter()


class ConvMap:
    """(owner, conversation id) -> the model its latest named request went to, with that
    request's ticket (a stop forgets it: a request still waiting for its model to load
    sees its ticket gone and ends)."""

    def __init__(self, max_size: int = MAP_MAX) -> None:
        self.max_size = max_size
        self.entries: collections.OrderedDict[tuple[str, str], tuple[str, int]] = (
            collections.OrderedDict()
        )
        self.tickets = 0

    def remember(self, owner: str, conv_id: str, model: str) -> int:
        key = (owner, conv_id)
        self.tickets += 1
        self.entries[key] = (model, self.tickets)
        self.entries.move_to_end(key)
        while len(self.entries) > self.max_size:
            self.entries.popitem(last=False)
        return self.tickets

    def get(self, owner: str, conv_id: str) -> str | None:
        entry = self.entries.get((owner, conv_id))
        return entry[0] if entry else None

    def holds(self, owner: str, conv_id: str, ticket: int) -> bool:
        """Whether the request of ``ticket`` is still the id's latest, not stopped."""
        entry = self.entries.get((owner, conv_id))
        return entry is not None and entry[1] == ticket

    def forget(self, owner: str, conv_id: str) -> None:
        self.entries.pop((owner, conv_id), None)

    def variants(self, owner: str, conv_id: str) -> list[tuple[str, str]]:
        """The remembered (id, model) that ``conv_id`` names: itself and ``<id>::...``."""
        prefix = conv_id + "::"
        return [
            (cid, m)
            for (o, cid), (m, _) in self.entries.items()
            if o == owner and (cid == conv_id or cid.startswith(prefix))
        ]


class RouterState(Protocol):
    """What these routes read of the router's state (server.router.routes.RouterState)."""

    manager: Manager
    streams: ConvMap
    internal_key: str
    checks_keys: bool
    timeout: float


def note_request(st: RouterState, request: Request, model: str | None) -> Callable[[], bool] | None:
    """Remember where a named request goes (a bad id is left to the instance's 400).
    Returns ``wanted()``, whether no stop (or newer request of the id) came since; None for
    an unnamed request. As llama-server's router: a named request outlives its client while
    its model loads (only a stop ends it), so a reload can resume it."""
    conv_id = request.headers.get(HEADER)
    if not (conv_id and model and valid_id(conv_id)):
        return None
    owner = owner_of(request)
    ticket = st.streams.remember(owner, conv_id, model)
    return lambda: st.streams.holds(owner, conv_id, ticket)


def _state(request: Request) -> RouterState:
    st: RouterState = request.app.state.router
    return st


def _owner(st: RouterState, request: Request, conv_id: str) -> Instance:
    """The instance holding ``conv_id``'s session: 503 while its model loads, 404 when none
    is known or it is not running."""
    model = st.streams.get(owner_of(request), conv_id)
    inst = st.manager.get(model) if model else None
    if inst is not None and inst.status == LOADING:
        raise APIError(503, "Stream owner model is loading, retry later", "unavailable_error")
    if inst is None or inst.status not in READY:
        raise APIError(404, "Stream not found or expired", "not_found_error")
    return inst


@router.get("/v1/stream")
async def replay(request: Request) -> Response:
    """Pass a replay to the instance that holds the stream (held meanwhile: not unloaded)."""
    st = _state(request)
    inst = _owner(st, request, check_id(request.query_params.get("conv_id")))
    release = st.manager.hold(inst)
    headers = upstream_headers(request, st.internal_key, st.checks_keys)
    # a replay waits on the generation: as long as the instance's own request may run
    up = Upstream(inst.port, inst.name, headers, st.timeout + 5.0, release)
    return await forward(st.manager.client_for_proxy, request, b"", up)


@router.delete("/v1/stream")
async def stop(request: Request) -> Response:
    """Stop the stream on its instance (when it runs) and forget it."""
    st = _state(request)
    conv_id = check_id(request.query_params.get("conv_id"))
    try:
        port = _owner(st, request, conv_id).port
    except APIError:
        port = 0
    if port:
        headers = upstream_headers(request, st.internal_key, st.checks_keys)
        url = f"http://127.0.0.1:{port}/v1/stream"
        try:
            await st.manager.client.delete(
                url, params={"conv_id": conv_id}, headers=headers, timeout=LOOKUP_TIMEOUT_S
            )
        except httpx.HTTPError as e:
            log.warning("stream stop on port %d failed: %s", port, type(e).__name__)
    st.streams.forget(owner_of(request), conv_id)
    return Response(status_code=204)


@router.post("/v1/streams/lookup")
async def lookup(request: Request) -> JSONResponse:
    """Ask each instance that holds some of the named ids about those ids only."""
    st = _state(request)
    owner = owner_of(request)
    per_model: dict[str, list[str]] = {}
    for rid in lookup_ids(await request.body()):
        for cid, model in st.streams.variants(owner, rid):
            per_model.setdefault(model, []).append(cid)
    out: list[object] = []
    headers = upstream_headers(request, st.internal_key, st.checks_keys)
    for model, ids in per_model.items():
        inst = st.manager.get(model)
        if inst is None or inst.status not in READY:
            continue
        url = f"http://127.0.0.1:{inst.port}/v1/streams/lookup"
        try:
            r = await st.manager.client.post(
                url, json={"conversation_ids": ids}, headers=headers, timeout=LOOKUP_TIMEOUT_S
            )
        except httpx.HTTPError:
            continue
        if r.status_code == 200 and isinstance(r.json(), list):
            out += [e for e in r.json() if isinstance(e, dict)]
    return JSONResponse(out)
