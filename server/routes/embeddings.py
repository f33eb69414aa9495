"""Embeddings and reranking: POST /v1/embeddings (OpenAI), /embedding and /embeddings
(llama-server's native shape), /rerank with its aliases. The bodies and answers are
server.api.embeddings'; ``run_embeddings`` puts the prompts on the engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..api.embeddings import (
    POOLING_NONE,
    POOLING_RANK,
    EmbeddingRequest,
    RerankParts,
    RerankRequest,
    check_prompts,
    embedding_prompts,
    embeddings_on,
    encoding_base64,
    native_embeddings,
    oai_embeddings,
    pooling_of,
    rerank_inputs,
    rerank_prompt,
    rerank_response,
)
from ..api.errors import APIError
from ..engine.embed import EmbedEvent, EmbedResult, EmbedTask
from ..engine.engine import EngineDead
from ..engine.event_sink import Emitter
from ..service.sink import emitter
from ..service.state import ServerState
from ..service.tasks import until_disconnected
from ..service.tokenizer import tokenize
from ..types import TaskError
from .common import prep, state_of

router = APIRouter()


# ---- running on the engine ---------------------------------------------------------------


# put in a request's event queue when its client disconnected
class _ClientGone:
    """The type of CLIENT_GONE (a sentinel the type checker can tell from an event)."""


CLIENT_GONE = _ClientGone()


def _emitter(
    loop: asyncio.AbstractEventLoop, q: asyncio.Queue[EmbedEvent | _ClientGone]
) -> Emitter[EmbedEvent]:
    """A task's ``emit``: thread-safe; the engine batches deliveries per loop
    (service/sink.py)."""
    return emitter(loop, q.put_nowait)


async def run_embeddings(
    st: ServerState, prompts: list[list[int]], request: Request | None = None
) -> list[EmbedResult]:
    """Embed ``prompts`` on the engine, one task each (they share decodes with every other
    request's); results in prompt order. APIError: 503 when the queue is full or the engine
    stopped, 408 after the server's --timeout, a task's error as it comes. With ``request``,
    a client that disconnects cancels the prompts not embedded yet (within ~0.25 s); the
    answer then goes nowhere."""
    engine = st.require_engine()
    loop = asyncio.get_running_loop()
    q: asyncio.Queue[EmbedEvent | _ClientGone] = asyncio.Queue()
    emit = _emitter(loop, q)
    tasks = [EmbedTask(toks, emit, index=i) for i, toks in enumerate(prompts)]
    max_queue = st.settings.max_queue
    # a request's prompts count as one request: it is refused only behind a full queue
    if engine.queue_depth() >= max_queue + engine.n_idle_slots():
        raise APIError(
            503,
            f"the server is busy: more than {max_queue} requests are waiting",
            "unavailable_error",
            headers={"Retry-After": "1"},
        )
    out: list[EmbedResult | None] = [None] * len(tasks)
    deadline = time.monotonic() + st.settings.timeout
    watcher = None
    if request is not None:  # a disconnect ends the wait below with CLIENT_GONE
        watcher = asyncio.create_task(until_disconnected(request))
        watcher.add_done_callback(lambda _: q.put_nowait(CLIENT_GONE))
    try:
        for t in tasks:
            engine.submit(t)
        for _ in tasks:
            ev = await asyncio.wait_for(q.get(), max(0.0, deadline - time.monotonic()))
            if isinstance(ev, _ClientGone):
                raise APIError(499, "the client disconnected", "cancelled_error")
            if isinstance(ev, TaskError):
                raise APIError(ev.status, ev.message, ev.type, headers=None, **ev.extra)
            out[ev.index] = ev
    except EngineDead as e:
        raise APIError(503, str(e), "unavailable_error") from e
    except asyncio.TimeoutError:
        raise APIError(
            408, f"the request timed out after {st.settings.timeout:g} s", "timeout_error"
        ) from None
    finally:
        if watcher is not None:
            watcher.cancel()
        for t in tasks:
            t.cancel()  # those still waiting are dropped; finished ones ignore it
    return [r for r in out if r is not None]


def _tokenizer(st: ServerState) -> Callable[[str, bool], list[int]]:
    b = st.require_backend()
    return lambda text, add_special: tokenize(b, text, add_special, True)


def _checked(st: ServerState, make: Callable[[], list[list[int]]]) -> list[list[int]]:
    """``make()``'s prompts, checked (worker thread: tokenizing may take a while)."""
    prompts = make()
    b = st.require_backend()
    check_prompts(prompts, b.n_vocab, min(b.n_ubatch, b.n_batch), b.n_ctx_slot)
    return prompts


async def _embeddings(request: Request, body: EmbeddingRequest, oai: bool) -> JSONResponse:
    st = state_of(request)
    if not embeddings_on(st.settings):
        raise APIError(501, "This server does not support embeddings. Start it with `--embeddings`")
    st.require_engine()
    b = st.require_backend()
    if oai and b.pooling == POOLING_NONE:
        raise APIError(
            400, "Pooling type 'none' is not OAI compatible. Please use a different pooling type"
        )
    if body.input is not None:
        raw = body.input
    elif body.content is not None:
        raw, oai = body.content, False  # "content" is llama-server's, answered in its shape
    else:
        raise APIError(400, '"input" or "content" must be provided')
    use_base64 = encoding_base64(body.encoding_format)
    tok = _tokenizer(st)
    prompts = await prep(request, _checked, st, lambda: embedding_prompts(raw, tok))
    results = await run_embeddings(st, prompts, request)
    mode = st.settings.embd_normalize if body.embd_normalize is None else body.embd_normalize
    if oai:
        # the response is built here, not by FastAPI's encoder (which walks every float)
        return JSONResponse(oai_embeddings(results, body.model or st.model_name, use_base64, mode))
    return JSONResponse(native_embeddings(results, b.pooling != POOLING_NONE, mode))


@router.post("/v1/embeddings")
async def embeddings_oai(request: Request, body: EmbeddingRequest) -> JSONResponse:
    """OpenAI's embeddings: ``data[i].embedding`` (floats or base64), ``usage``."""
    return await _embeddings(request, body, oai=True)


@router.post("/embedding")
@router.post("/embeddings")
async def embeddings_native(request: Request, body: EmbeddingRequest) -> JSONResponse:
    """llama-server's native embeddings: ``[{"index", "embedding": [[...]]}]``."""
    return await _embeddings(request, body, oai=False)


@router.post("/rerank")
@router.post("/reranking")
@router.post("/v1/rerank")
@router.post("/v1/reranking")
async def rerank(request: Request, body: RerankRequest) -> Response:
    """llama-server's reranking (needs --reranking, i.e. pooling rank): each document scored
    against the query, sorted, the first ``top_n``."""
    st = state_of(request)
    if not embeddings_on(st.settings) or pooling_of(st.settings) != POOLING_RANK:
        raise APIError(501, "This server does not support reranking. Start it with `--reranking`")
    st.require_engine()
    query, docs = rerank_inputs(body)
    parts = RerankParts(*st.require_backend().rerank_parts())
    tok = _tokenizer(st)
    make = lambda: [rerank_prompt(query, d, parts, tok) for d in docs]  # noqa: E731
    prompts = await prep(request, _checked, st, make)
    results = await run_embeddings(st, prompts, request)
    return JSONResponse(rerank_response(body, body.model or st.model_name, results, docs))
