"""Embeddings and reranking: POST /v1/embeddings (OpenAI), /embedding and /embeddings
(llama-server's native shape), /rerank with its aliases. The bodies and answers are
server.protocols.embedding_shapes'; ``service.embedding_runs.run_embeddings`` puts the prompts on the
engine."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..schemas.errors import APIError
from ..service.embedding_runs import run_embeddings
from ..service.state import ServerState
from ..service.tokenizer import tokenize
from .common import prep, state_of
from .embedding_shapes import (
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

router = APIRouter()


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
