"""Resumable streams through the router (llama-server's router stream routes). The sessions
live in the instances (server.service.stream_buffers); the router remembers which model each
named request went to (``ConvMap``, once its instance accepted it) and sends the stream
routes there:

- ``GET /v1/stream``: passed to the owning instance; 503 (retry) while that model loads,
  404 when no model is known for the id or its instance is gone.
- ``DELETE /v1/stream``: passed to the owning instance when it runs, else (an id the router
  does not know, or no longer) to every running instance: each stops only the caller's
  stream of that id. The id is forgotten; 204 either way.
- ``POST /v1/streams/lookup``: the named ids grouped by owning instance, each instance
  asked for its own (at once); the answers joined. Never a listing: only named ids are
  looked up, through the map's index (no scan of every entry).

The map is keyed by (API key digest, id), as the instances key their sessions, and bounded
per key (server.router.conv_map)."""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..json_value import JsonObject
from ..schemas.errors import APIError
from ..schemas.stream_ids import HEADER, LOOKUP_MAX, check_id, lookup_ids, owner_of, valid_id
from .conv_map import (
    ConvMap,
    Pending,
)
from .instances import LOADING, READY, Instance
from .manager import Manager
from .proxy import Upstream, forward, upstream_headers

log = logging.getLogger("server.router")

LOOKUP_TIMEOUT_S = 2.0  # an instance's lookup answer (llama-server: 250 ms)

router = APIRouter()
_late_stops: set[asyncio.Task[None]] = set()  # settle_request's stops under way


class RouterState(Protocol):
    """What these routes read of the router's state (server.router.routes.RouterState)."""

    manager: Manager
    streams: ConvMap
    internal_key: str
    checks_keys: bool
    timeout: float


def note_request(st: RouterState, request: Request, model: str) -> Pending | None:
    """A named request for ``model`` (a model the router knows: called once it is resolved,
    so an unknown name records nothing) is on its way; None for an unnamed one (a bad id is
    left to the instance's 400). Its ``wanted`` (``st.streams.wanted``) says whether no stop
    (or newer request of the id) came since: as llama-server's router, a named request
    outlives its client while its model loads (only a stop ends it), so a reload can resume
    it. The caller settles it (``settle_request``) once the instance answered."""
    conv_id = request.headers.get(HEADER)
    if not (conv_id and valid_id(conv_id)):
        return None
    return st.streams.begin(owner_of(request), conv_id, model)


def opened_stream(response: Response) -> bool:
    """Whether an instance's answer to a named request opened its stream: a 2xx event
    stream (a refusal is JSON, a non-streamed request's answer too)."""
    media = response.headers.get("content-type", "")
    return 200 <= response.status_code < 300 and media.startswith("text/event-stream")


def settle_request(
    st: RouterState, request: Request, p: Pending, response: Response | None
) -> None:
    """``p``'s instance answered ``response`` (None: no answer): remembered when it opened
    the stream. A stream that a stop meant to end (the stop came while the request was on
    its way, maybe before the instance had it) is stopped on its instance, in the
    background (the answer is not held up)."""
    accepted = response is not None and opened_stream(response)
    if not st.streams.settle(p, accepted):
        return
    inst = st.manager.get(p.model)
    if inst is not None and inst.status in READY:
        task = asyncio.create_task(_stop_on(st, request, inst, p.conv_id))
        _late_stops.add(task)  # a reference until it ends (the loop keeps only weak ones)
        task.add_done_callback(_late_stops.discard)


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


async def _stop_on(st: RouterState, request: Request, inst: Instance, conv_id: str) -> None:
    """The instance's ``DELETE /v1/stream`` for ``conv_id``, with the caller's key (so it
    stops only the caller's stream); a failure is logged."""
    headers = upstream_headers(request, st.internal_key, st.checks_keys)
    url = f"http://127.0.0.1:{inst.port}/v1/stream"
    try:
        await st.manager.client.delete(
            url, params={"conv_id": conv_id}, headers=headers, timeout=LOOKUP_TIMEOUT_S
        )
    except httpx.HTTPError as e:
        log.warning("stream stop on port %d failed: %s", inst.port, type(e).__name__)


@router.delete("/v1/stream")
async def stop(request: Request) -> Response:
    """Stop the stream on its instance and forget it. An id the router does not know (never
    seen, or forgotten) is stopped on every running instance: the stop still reaches the
    generation wherever it runs."""
    st = _state(request)
    conv_id = check_id(request.query_params.get("conv_id"))
    owner = owner_of(request)
    models = st.streams.models(owner, conv_id)
    st.streams.forget(owner, conv_id)  # a request still waiting for its model ends (400)
    running = [i for i in st.manager.instances.values() if i.status in READY]
    targets = [i for i in running if i.name in models] if models else running
    await asyncio.gather(*(_stop_on(st, request, i, conv_id) for i in targets))
    return Response(status_code=204)


async def _ask(st: RouterState, request: Request, model: str, ids: list[str]) -> list[JsonObject]:
    """One instance's lookup entries for ``ids`` (none when it is not running or fails)."""
    inst = st.manager.get(model)
    if inst is None or inst.status not in READY:
        return []
    headers = upstream_headers(request, st.internal_key, st.checks_keys)
    url = f"http://127.0.0.1:{inst.port}/v1/streams/lookup"
    try:
        r = await st.manager.client.post(
            url, json={"conversation_ids": ids}, headers=headers, timeout=LOOKUP_TIMEOUT_S
        )
        found = r.json() if r.status_code == 200 else []
    except (httpx.HTTPError, ValueError):
        return []
    return [e for e in found if isinstance(e, dict)] if isinstance(found, list) else []


@router.post("/v1/streams/lookup")
async def lookup(request: Request) -> JSONResponse:
    """Ask each instance that holds some of the named ids about those ids only."""
    st = _state(request)
    named = st.streams.variants(owner_of(request), lookup_ids(await request.body()))
    per_model: dict[str, list[str]] = {}
    for cid, model in named.items():
        per_model.setdefault(model, []).append(cid)
    asks = [  # an instance takes at most LOOKUP_MAX ids a lookup
        _ask(st, request, m, ids[i : i + LOOKUP_MAX])
        for m, ids in per_model.items()
        for i in range(0, len(ids), LOOKUP_MAX)
    ]
    out: dict[object, object] = {}  # an instance answers "a::m" for "a" and for "a::m"
    for found in await asyncio.gather(*asks):
        for e in found:
            out.setdefault(e.get("conversation_id"), e)
    return JSONResponse(list(out.values()))
