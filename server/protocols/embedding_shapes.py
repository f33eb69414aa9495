"""Embedding and reranking requests (--embedding, --reranking): their inputs, checks and
response shapes, as llama-server's ``handle_embeddings_impl`` and ``post_rerank`` make them.
``server.service.embedding_runs.run_embeddings`` hands the prompts to the engine and waits.

Nothing here talks to llama.cpp: prompts are tokenized through a ``tokenize(text,
add_special)`` callable and the rerank prompt's special tokens come in ``RerankParts``."""

from __future__ import annotations

import base64
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeGuard

import numpy as np

from ..engine_api import EmbedResult, too_large
from ..schemas.bodies import BaseBody
from ..schemas.errors import APIError
from ..settings.config import Settings

# llama_pooling_type values of --pooling's names
POOLING = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}
POOLING_NONE = 0
POOLING_RANK = 4

Tokenize = Callable[[str, bool], list[int]]  # (text, add_special) -> tokens, specials parsed

_ELEMENTS = (
    '"prompt" elements must be a string, a list of tokens, a JSON object containing a prompt '
    "string, or a list of mixed strings & tokens."
)


# ---- settings ---------------------------------------------------------------------------


def embeddings_on(s: Settings) -> bool:
    """--embedding, or --reranking (which implies it, as in llama-server)."""
    return s.embedding or s.reranking


def pooling_of(s: Settings) -> int:
    """The llama_pooling_type asked for: rank with --reranking, else --pooling (-1: the
    model's own)."""
    if s.reranking:
        return POOLING_RANK
    return POOLING[s.pooling] if s.pooling else -1


# ---- request bodies -----------------------------------------------------------------------


class EmbeddingRequest(BaseBody):
    """/v1/embeddings, /embedding(s). ``input`` (or llama-server's ``content``): a string, a
    token list, a mixed list of strings and tokens, ``{"prompt_string": ...}``, ``{"content":
    [text parts]}``, or an array of these. Checked by ``embedding_prompts``."""

    input: object = None
    content: object = None
    encoding_format: object = None
    embd_normalize: int | None = None
    model: str | None = None


class RerankRequest(BaseBody):
    """/rerank (Jina's shape: ``documents``; TEI's: ``texts``, answered with a bare list)."""

    query: object = None
    documents: object = None
    texts: object = None
    top_n: int | None = None
    return_text: bool = False
    model: str | None = None


# ---- inputs -------------------------------------------------------------------------------


def _is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def _mixed(items: Sequence[object], tokenize: Tokenize) -> list[int]:
    """llama-server's ``tokenize_mixed``: strings tokenized (specials added to the first
    element only), integers taken as token ids."""
    out: list[int] = []
    for i, p in enumerate(items):
        if isinstance(p, str):
            out += tokenize(p, i == 0)
        elif _is_int(p):
            out.append(p)
        else:
            raise APIError(400, _ELEMENTS)
    return out


def _content_text(parts: object) -> str:
    """The text of an OpenAI content array; only text parts (the model is not multimodal)."""
    if not isinstance(parts, list):
        raise APIError(400, '"content" must be an array of content parts')
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise APIError(
                400, f"unsupported content part type {kind!r}: only text parts are accepted"
            )
        texts.append(part["text"])
    return "".join(texts)


def _subprompt(p: object, tokenize: Tokenize) -> list[int]:
    """One prompt (llama-server's ``tokenize_input_subprompt`` plus OpenAI content)."""
    if isinstance(p, str):
        return tokenize(p, True)
    if isinstance(p, list):
        return _mixed(p, tokenize)
    if isinstance(p, dict) and "content" in p:
        return tokenize(_content_text(p["content"]), True)
    if isinstance(p, dict) and isinstance(p.get("prompt_string"), str):
        if "multimodal_data" in p:
            raise APIError(400, "the model does not accept multimodal data")
        return tokenize(p["prompt_string"], True)
    raise APIError(400, _ELEMENTS)


def embedding_prompts(raw: object, tokenize: Tokenize) -> list[list[int]]:
    """The prompts of an embeddings ``input``: an array without token ids is several
    prompts; anything else is one. APIError 400 for a malformed or empty input."""
    if isinstance(raw, list) and not any(_is_int(x) for x in raw):
        if not raw:
            raise APIError(400, '"input" must not be empty')
        return [_subprompt(p, tokenize) for p in raw]
    return [_subprompt(raw, tokenize)]


def check_prompts(prompts: list[list[int]], n_vocab: int, n_ubatch: int, n_ctx: int) -> None:
    """APIError 400 for an empty prompt, a token outside the vocabulary, or a prompt that
    does not fit a slot's context or one physical batch (pooling needs it whole in one)."""
    for toks in prompts:
        if not toks:
            raise APIError(400, "Input content cannot be empty")
        arr = np.asarray(toks, dtype=np.int64)
        bad = arr[(arr < 0) | (arr >= n_vocab)]
        if bad.size:
            raise APIError(
                400, f"token id {int(bad[0])} is outside the vocabulary (0..{n_vocab - 1})"
            )
        # llama-server's order for a prompt it cannot split: the batch first
        if len(toks) > n_ubatch:
            raise APIError(400, too_large(len(toks), n_ubatch))
        if len(toks) > n_ctx:
            raise APIError(
                400,
                f"input ({len(toks)} tokens) is larger than the max context size ({n_ctx} "
                "tokens). skipping",
                "exceed_context_size_error",
                n_prompt_tokens=len(toks),
                n_ctx=n_ctx,
            )


def encoding_base64(fmt: object) -> bool:
    """``encoding_format``: float (default) or base64."""
    if fmt is None or fmt == "float":
        return False
    if fmt == "base64":
        return True
    raise APIError(400, "The format to return the embeddings in. Can be either float or base64")


# ---- outputs ------------------------------------------------------------------------------


def normalize(vecs: np.ndarray, mode: int) -> np.ndarray:
    """Row-wise llama.cpp ``common_embd_normalize``: -1 none, 0 max absolute scaled to the
    int16 range, 2 Euclidean, other p > 0 the p-norm (1: taxicab). A zero row stays zero."""
    v = vecs.astype(np.float64)
    if mode == -1:
        return vecs.astype(np.float32)
    if mode == 0:
        norm = np.abs(v).max(axis=1) / 32760.0
    elif mode == 2:
        norm = np.sqrt((v * v).sum(axis=1))
    else:
        norm = (np.abs(v) ** mode).sum(axis=1) ** (1.0 / mode)
    scale = np.divide(1.0, norm, out=np.zeros_like(norm), where=norm > 0)
    return (v * scale[:, None]).astype(np.float32)


def oai_embeddings(
    results: list[EmbedResult], model: str, use_base64: bool, mode: int
) -> dict[str, object]:
    """/v1/embeddings: llama-server's ``format_embeddings_response_oaicompat``."""
    data = []
    for i, r in enumerate(results):
        vec = normalize(r.vectors[:1], mode)[0]
        if use_base64:
            b64 = base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
            item = {
                "embedding": b64,
                "index": i,
                "object": "embedding",
                "encoding_format": "base64",
            }
        else:
            item = {"embedding": vec.tolist(), "index": i, "object": "embedding"}
        data.append(item)
    n = sum(r.n_tokens for r in results)
    usage = {"prompt_tokens": n, "total_tokens": n}
    return {"model": model, "object": "list", "usage": usage, "data": data}


def native_embeddings(
    results: list[EmbedResult], pooled: bool, mode: int
) -> list[dict[str, object]]:
    """/embedding: ``[{"index", "embedding": [[...], ...]}]``, one row per token with pooling
    none (not normalized, as llama-server), else the one pooled row normalized by ``mode``."""
    return [
        {"index": i, "embedding": (normalize(r.vectors, mode) if pooled else r.vectors).tolist()}
        for i, r in enumerate(results)
    ]


# ---- reranking ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RerankParts:
    """What a rerank prompt is built from: the model's "rerank" template (with {query} and
    {document}) if it has one, else its special tokens and whether the vocabulary adds them."""

    template: str | None
    bos: int
    eos: int  # the SEP token where the vocabulary has no EOS
    sep: int
    add_bos: bool
    add_eos: bool
    add_sep: bool


def rerank_prompt(query: str, doc: str, parts: RerankParts, tokenize: Tokenize) -> list[int]:
    """llama-server's ``format_prompt_rerank``: [BOS] query [EOS] [SEP] doc [EOS]."""
    if parts.template is not None:
        text = parts.template.replace("{query}", query).replace("{document}", doc)
        return tokenize(text, False)
    out: list[int] = [parts.bos] if parts.add_bos else []
    out += tokenize(query, False)
    out += [parts.eos] if parts.add_eos else []
    out += [parts.sep] if parts.add_sep else []
    out += tokenize(doc, False)
    out += [parts.eos] if parts.add_eos else []
    return out


def rerank_inputs(body: RerankRequest) -> tuple[str, list[str]]:
    """The query and the documents (or TEI's texts); APIError 400 as llama-server words it."""
    if body.query is None:
        raise APIError(400, '"query" must be provided')
    if not isinstance(body.query, str):
        raise APIError(400, '"query" must be a string')
    docs = body.documents if body.documents is not None else body.texts
    if not isinstance(docs, list) or not docs or not all(isinstance(d, str) for d in docs):
        raise APIError(400, '"documents" must be a non-empty string array')
    return body.query, docs


def rerank_response(
    body: RerankRequest, model: str, results: list[EmbedResult], docs: list[str]
) -> object:
    """llama-server's ``format_response_rerank``: results sorted by score, the first top_n;
    TEI's shape (``texts`` given) is the bare list with ``score`` (and ``text``)."""
    tei = body.texts is not None and body.documents is None
    label = "score" if tei else "relevance_score"
    items = []
    for i, r in enumerate(results):
        item: dict[str, float | int | str] = {"index": i, label: float(r.vectors[0][0])}
        if tei and body.return_text:
            item["text"] = docs[i]
        items.append(item)
    items.sort(key=lambda x: -float(x[label]))  # the score, a float
    top_n = len(docs) if body.top_n is None else body.top_n
    items = items[: max(0, top_n)]
    if tei:
        return items
    n = sum(r.n_tokens for r in results)
    return {
        "model": model,
        "object": "list",
        "usage": {"prompt_tokens": n, "total_tokens": n},
        "results": items,
    }
