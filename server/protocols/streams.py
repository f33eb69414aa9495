"""Resumable streams' endpoints (llama-server's ``/v1/stream`` routes) and ``sse_response``,
the one way every streaming API answers (server.service.stream_buffers holds the sessions):

- ``GET /v1/stream?conv_id=ID&from=N`` (or ``&from_event=K``): the stream's bytes from byte
  ``N`` (event ``K``), then live until it ends; 404 unknown or expired, 400 bad or lost
  position.
- ``POST /v1/streams/lookup`` ``{"conversation_ids": [...]}``: the caller's sessions among
  the ids it names (and their ``<id>::<model>`` variants), nothing else.
- ``DELETE /v1/stream?conv_id=ID``: stop the generation, drop the buffer; 204 (also when
  there was none, as llama-server).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..schemas.errors import APIError
from ..schemas.stream_ids import check_id, lookup_ids, owner_of
from ..service.stream_buffers import group_started, requested_name
from ..service.tasks import TaskGroup
from .common import SSE_HEADERS, state_of

router = APIRouter()


def sse_response(request: Request, group: TaskGroup, source: AsyncIterator[str]) -> Response:
    """A streamed answer: ``source`` straight to the client, or, when the request names a
    stream (``X-Conversation-Id``), into its session, which the client then reads like any
    later reader (the generation goes on when it leaves). A session that cannot be opened
    (429) cancels ``group``'s tasks."""
    st = state_of(request)
    try:
        conv_id = requested_name(st.streams, request)
        if conv_id is None:
            return StreamingResponse(source, media_type="text/event-stream", headers=SSE_HEADERS)
        session = st.streams.open(owner_of(request), conv_id, source, group_started(group))
    except BaseException:
        group.cancel()
        raise
    body = st.streams.read(session, 0)
    return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)


def _count(name: str, raw: str | None) -> int | None:
    """A ``from``/``from_event`` query value: None when absent, else a non-negative int."""
    if raw is None or raw == "":
        return None
    if not raw.isdigit() or len(raw) > 18:
        raise APIError(400, f"Invalid '{name}' offset")
    return int(raw)


@router.get("/v1/stream")
async def replay(request: Request) -> Response:
    """Replay a named stream from a byte offset (``from``, llama-server's) or an event
    index (``from_event``), then follow it live."""
    st = state_of(request)
    q = request.query_params
    conv_id = check_id(q.get("conv_id"))
    offset, event = _count("from", q.get("from")), _count("from_event", q.get("from_event"))
    if offset is not None and event is not None:
        raise APIError(400, "give 'from' or 'from_event', not both")
    session = st.streams.get(owner_of(request), conv_id)
    if session is None:
        raise APIError(404, "Stream not found or expired", "not_found_error")
    start, skip = session.position(offset, event)
    st.streams.stats.replays += 1
    body = st.streams.read(session, start, skip)
    return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)


@router.delete("/v1/stream")
async def stop(request: Request) -> Response:
    """Stop a named stream's generation (its slot is freed) and drop its buffer."""
    st = state_of(request)
    conv_id = check_id(request.query_params.get("conv_id"))
    st.streams.stop(owner_of(request), conv_id)
    return Response(status_code=204)


@router.post("/v1/streams/lookup")
async def lookup(request: Request) -> JSONResponse:
    """The caller's sessions among the ids it names: llama-server's entries
    (``conversation_id``, ``is_done``, ``total_bytes``, ``started_at``, ``completed_at``)
    plus ``total_events``."""
    st = state_of(request)
    ids = lookup_ids(await request.body())
    return JSONResponse(st.streams.lookup(owner_of(request), ids))
