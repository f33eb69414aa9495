"""vLLM's render endpoints: a request's prompt as token ids, rendered and tokenized exactly
as the server would for generation, so a router (llm-d's token producer) computes the same
blocks the server's KV-cache events carry.

``POST /v1/completions/render`` answers a list (one object per prompt of the request);
``POST /v1/chat/completions/render`` one object. Each object has the shape of vLLM's
``GenerateRequest``: ``request_id``, ``token_ids``, ``features`` (null: no multimodal
input), ``sampling_params``, ``model``, ``stream``, ``stream_options``, ``cache_salt``,
``priority``, ``kv_transfer_params``. Nothing is generated; no slot is touched.
"""

from __future__ import annotations

import uuid
from typing import TypeVar

from fastapi import APIRouter, Request

from ..prompts.chat import plan_chat, render_chat
from ..prompts.completion import completion_prompts, max_tokens_of
from ..schemas.bodies import ChatRequest, CompletionRequest, SamplingFields
from ..service.state import ServerState
from ..service.submit import Prompt
from ..service.validation import check_tokens
from .common import prep, state_of

router = APIRouter()
V = TypeVar("V")


def sampling_params(st: ServerState, body: SamplingFields, max_tokens: int) -> dict[str, object]:
    """vLLM's sampling parameters of the request, with this server's defaults for the fields
    it leaves out (--temp, --top-k, ...); ``max_tokens`` None when unlimited."""
    s = st.settings
    stop = body.stop if isinstance(body.stop, list) else ([body.stop] if body.stop else [])

    def pick(v: V | None, default: V) -> V:
        return default if v is None else v

    return {
        "n": getattr(body, "n", 1),
        "temperature": pick(body.temperature, s.temperature),
        "top_p": pick(body.top_p, s.top_p),
        "top_k": pick(body.top_k, s.top_k),
        "min_p": pick(body.min_p, s.min_p),
        "seed": None if pick(body.seed, s.seed) == -1 else pick(body.seed, s.seed),
        "presence_penalty": pick(body.presence_penalty, s.presence_penalty),
        "frequency_penalty": pick(body.frequency_penalty, s.frequency_penalty),
        "repetition_penalty": pick(body.repeat_penalty, s.repeat_penalty),
        "stop": stop,
        "ignore_eos": body.ignore_eos,
        "max_tokens": None if max_tokens < 0 else max_tokens,
    }


def generate_request(
    st: ServerState, body: SamplingFields, tokens: list[int], max_tokens: int
) -> dict[str, object]:
    """One rendered prompt as vLLM's GenerateRequest."""
    return {
        "request_id": uuid.uuid4().hex,
        "token_ids": tokens,
        "features": None,
        "sampling_params": sampling_params(st, body, max_tokens),
        "model": getattr(body, "model", None) or st.model_name,
        "stream": bool(getattr(body, "stream", False)),
        "stream_options": None,
        "cache_salt": body.cache_salt,
        "priority": 0,
        "kv_transfer_params": None,
    }


def _checked_prompts(st: ServerState, prompt: object) -> list[Prompt]:
    """The prompts of a completions body, each token id in the vocabulary (APIError 400)."""
    prompts = completion_prompts(st, prompt)
    for p in prompts:
        check_tokens(p.tokens, st.require_backend())
    return prompts


def _rendered(st: ServerState, body: ChatRequest) -> Prompt:
    """The chat body's prompt as /v1/chat/completions renders it (one worker hand-off)."""
    return render_chat(st, body, plan_chat(st, body))


@router.post("/v1/completions/render")
async def render_completion(body: CompletionRequest, request: Request) -> list[dict[str, object]]:
    """The completions prompt(s) as token ids (text is tokenized as /v1/completions does,
    with BOS and special tokens parsed; token lists are taken as they are, 400 for an id
    outside the vocabulary)."""
    st = state_of(request)
    st.require_engine()
    prompts = await prep(request, _checked_prompts, st, body.prompt)
    limit = max_tokens_of(body.max_tokens, body.n_predict)
    return [generate_request(st, body, p.tokens, limit) for p in prompts]


@router.post("/v1/chat/completions/render")
async def render_chat_completion(body: ChatRequest, request: Request) -> dict[str, object]:
    """The chat request's prompt, rendered by the chat template (tools, reasoning and a
    continued final message as /v1/chat/completions renders them), as token ids."""
    st = state_of(request)
    prompt = await prep(request, _rendered, st, body)
    limit = max_tokens_of(body.max_completion_tokens, body.max_tokens)
    return generate_request(st, body, prompt.tokens, limit)
