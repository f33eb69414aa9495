"""OpenAI API: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..chat import ROLES, TemplateError
from ..errors import APIError
from ..schemas import ChatRequest, CompletionRequest
from ..service import (
    ServerState,
    TaskGroup,
    check_fits,
    check_tokens,
    finish_reason,
    merged_timings,
    sampling_from,
    stops_from,
    usage_of,
)
from ..types import GenParams, TaskError, TaskResult, TextChunk, TokenLogprob

router = APIRouter()

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def state_of(request: Request) -> ServerState:
    return request.app.state.server


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _piece(backend: Any, tok: int) -> str:
    return backend.token_to_piece(tok).decode("utf-8", "replace")


def completion_logprobs(backend: Any, lps: list[TokenLogprob], offset0: int = 0) -> dict[str, Any]:
    tokens, token_lps, tops, offsets = [], [], [], []
    off = offset0
    for lp in lps:
        t = _piece(backend, lp.token)
        tokens.append(t)
        token_lps.append(lp.logprob)
        tops.append({_piece(backend, i): v for i, v in lp.top})
        offsets.append(off)
        off += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def token_logprobs(
    backend: Any, lps: list[TokenLogprob], with_id: bool = False
) -> list[dict[str, Any]]:
    """Per token: text, log-probability, bytes (and id), with the top alternatives alike.
    The shape of OpenAI's chat ``logprobs.content`` and llama-server's ``completion_probabilities``."""

    def entry(tok: int, lp: float) -> dict[str, Any]:
        raw = backend.token_to_piece(tok)
        e = {"token": raw.decode("utf-8", "replace"), "logprob": lp, "bytes": list(raw)}
        return {"id": tok, **e} if with_id else e

    return [
        {**entry(lp.token, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
        for lp in lps
    ]


def chat_logprobs(backend: Any, lps: list[TokenLogprob]) -> dict[str, Any]:
    return {"content": token_logprobs(backend, lps)}


def _prompts(st: ServerState, prompt: Any) -> list[list[int]]:
    b = st.backend
    if isinstance(prompt, str):
        return [b.tokenize(prompt, add_special=True, parse_special=True)]
    if not prompt:
        raise APIError(400, "the prompt is empty")
    if all(isinstance(x, int) for x in prompt):
        return [list(prompt)]
    out = []
    for p in prompt:
        out.append(
            b.tokenize(p, add_special=True, parse_special=True) if isinstance(p, str) else list(p)
        )
    return out


def _prompt_text(backend: Any, raw: Any, prompts: list[list[int]], i: int) -> str:
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list) and raw and isinstance(raw[i], str):
        return raw[i]
    return backend.detokenize(prompts[i])


def _max_tokens(*values: int | None) -> int:
    for v in values:
        if v is not None:
            return v
    return -1


@router.get("/v1/models")
@router.get("/models")
async def models(request: Request) -> dict[str, Any]:
    st = state_of(request)
    return {
        "object": "list",
        "data": [
            {
                "id": st.model_name,
                "object": "model",
                "created": int(st.started),
                "owned_by": "llamacpp",
                "meta": {
                    "n_vocab": st.backend.n_vocab if st.backend else None,
                    "n_ctx_train": st.backend.n_ctx_train if st.backend else None,
                    "n_params": st.backend.n_params if st.backend else None,
                    "size": st.backend.model_size if st.backend else None,
                },
            }
        ],
    }


@router.post("/v1/completions")
@router.post("/completions")
async def completions(body: CompletionRequest, request: Request):
    st = state_of(request)
    engine = st.require_engine()
    b = st.backend
    # tokenizing a long prompt takes a while: off the event loop, so streams keep flowing
    prompts = await asyncio.to_thread(_prompts, st, body.prompt)
    for p in prompts:
        check_tokens(p, b)
        check_fits(p, b)
    sampling = sampling_from(body, b)
    n_probs = body.logprobs or 0
    gen = GenParams(
        max_tokens=_max_tokens(body.max_tokens, body.n_predict),
        stop=stops_from(body),
        ignore_eos=body.ignore_eos,
        n_probs=n_probs,
        logprobs=body.logprobs is not None,
    )
    group = TaskGroup(
        engine, timeout=body.timeout or st.settings.timeout, max_queue=st.settings.max_queue
    )
    for p in prompts:
        for _ in range(body.n):
            group.add(
                p,
                sampling,
                gen,
                id_slot=body.id_slot,
                cache_prompt=body.cache_prompt,
                stream=body.stream,
            )
    if body.echo and gen.logprobs:
        raise APIError(400, "echo with logprobs is not supported (no prompt log-probabilities)")
    group.submit()
    offsets = [0] * len(group.tasks)
    # echo: the prompt's text opens each choice (in its first chunk when streaming)
    echo = [
        _prompt_text(b, body.prompt, prompts, i // body.n) if body.echo else ""
        for i in range(len(group.tasks))
    ]

    def text_choice(index: int, ev: TextChunk) -> dict[str, Any]:
        lp = completion_logprobs(b, ev.logprobs, offsets[index]) if gen.logprobs else None
        offsets[index] += len(ev.text)
        head, echo[index] = echo[index], ""
        return {"index": index, "text": head + ev.text, "logprobs": lp, "finish_reason": None}

    def final_choice(index: int, r: TaskResult, whole: bool) -> dict[str, Any]:
        lp = completion_logprobs(b, r.logprobs) if whole and gen.logprobs else None
        head, echo[index] = echo[index], ""
        return {
            "index": index,
            "text": head + (r.text if whole else ""),
            "logprobs": lp,
            "finish_reason": finish_reason(r),
        }

    return await respond(
        request,
        group,
        body,
        "cmpl-",
        "text_completion",
        "text_completion",
        st.model_name,
        text_choice,
        final_choice,
    )


def _messages(req: ChatRequest) -> list[dict[str, Any]]:
    out = []
    for m in req.messages:
        if m.role not in ROLES:
            raise APIError(400, f"unknown role {m.role!r} in messages")
        if isinstance(m.content, list):
            texts = []
            for part in m.content:
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"unsupported content part type {part.type!r} (only text)")
                texts.append(part.text)
            content = "\n".join(texts)
        else:
            content = m.content or ""
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": content}
        if m.name:
            msg["name"] = m.name
        out.append(msg)
    return out


def render_chat(st: ServerState, req: ChatRequest) -> tuple[list[int], int]:
    """Prompt tokens and the token index where the last user turn starts (-1 if unknown)."""
    b = st.backend
    try:
        rendered = st.template.render_chat(_messages(req))
    except TemplateError as e:
        raise APIError(400 if e.client else 500, str(e)) from e
    text = rendered.prompt
    # Templates emit BOS themselves; tokenizing with add_special would add a second one.
    has_bos = bool(b.bos_text) and text.startswith(b.bos_text)
    if has_bos:
        text = text[len(b.bos_text) :]
    tokens = b.tokenize(text, add_special=True, parse_special=True)
    user_start = -1
    if rendered.last_user_offset > 0:
        head = rendered.prompt[: rendered.last_user_offset]
        if has_bos:
            head = head[len(b.bos_text) :]
        n_head = len(b.tokenize(head, add_special=True, parse_special=True))
        if tokens[:n_head] == b.tokenize(head, add_special=True, parse_special=True):
            user_start = n_head
    return tokens, user_start


@router.post("/v1/chat/completions")
@router.post("/chat/completions")
async def chat_completions(body: ChatRequest, request: Request):
    st = state_of(request)
    engine = st.require_engine()
    b = st.backend
    prompt, user_start = await asyncio.to_thread(render_chat, st, body)
    check_fits(prompt, b)
    sampling = sampling_from(body, b)
    n_probs = body.top_logprobs or 0
    if n_probs and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true")
    gen = GenParams(
        max_tokens=_max_tokens(body.max_completion_tokens, body.max_tokens),
        stop=stops_from(body),
        ignore_eos=body.ignore_eos,
        n_probs=n_probs,
        logprobs=body.logprobs,
    )
    group = TaskGroup(
        engine, timeout=body.timeout or st.settings.timeout, max_queue=st.settings.max_queue
    )
    for _ in range(body.n):
        group.add(
            prompt,
            sampling,
            gen,
            id_slot=body.id_slot,
            cache_prompt=body.cache_prompt,
            stream=body.stream,
            user_start=user_start,
        )
    group.submit()

    def text_choice(index: int, ev: TextChunk) -> dict[str, Any]:
        lp = chat_logprobs(b, ev.logprobs) if gen.logprobs else None
        return {
            "index": index,
            "delta": {"content": ev.text},
            "logprobs": lp,
            "finish_reason": None,
        }

    def final_choice(index: int, r: TaskResult, whole: bool) -> dict[str, Any]:
        if not whole:
            return {
                "index": index,
                "delta": {},
                "logprobs": None,
                "finish_reason": finish_reason(r),
            }
        return {
            "index": index,
            "message": {"role": "assistant", "content": r.text},
            "logprobs": chat_logprobs(b, r.logprobs) if gen.logprobs else None,
            "finish_reason": finish_reason(r),
        }

    opening = [
        {
            "index": i,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        for i in range(len(group.tasks))
    ]
    return await respond(
        request,
        group,
        body,
        "chatcmpl-",
        "chat.completion",
        "chat.completion.chunk",
        st.model_name,
        text_choice,
        final_choice,
        opening,
    )


async def respond(
    request: Request,
    group: TaskGroup,
    body: CompletionRequest | ChatRequest,
    id_prefix: str,
    obj: str,
    chunk_obj: str,
    fingerprint: str,
    text_choice: Callable[[int, TextChunk], dict[str, Any]],
    final_choice: Callable[[int, TaskResult, bool], dict[str, Any]],
    opening: list[dict[str, Any]] = (),
):
    """The response of an OpenAI completion or chat request: one JSON body, or an SSE stream
    (opening chunks, text chunks, a final chunk per choice with ``timings``, usage, [DONE])."""
    head = {
        "id": id_prefix + uuid.uuid4().hex,
        "object": obj,
        "created": int(time.time()),
        "model": body.model or fingerprint,
        "system_fingerprint": fingerprint,
    }
    if not body.stream:
        results = await group.results(request)
        return JSONResponse(
            {
                **head,
                "choices": [final_choice(i, r, True) for i, r in enumerate(results)],
                "usage": usage_of(results),
                "timings": merged_timings(results).as_dict(),
            }
        )
    base = {**head, "object": chunk_obj}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def events() -> AsyncIterator[str]:
        for choice in opening:
            yield sse({**base, "choices": [choice]})
        results: list[TaskResult] = []
        async for index, ev in group.events():
            if isinstance(ev, TextChunk):
                yield sse({**base, "choices": [text_choice(index, ev)]})
            elif isinstance(ev, TaskResult):
                results.append(ev)
                yield sse(
                    {
                        **base,
                        "choices": [final_choice(index, ev, False)],
                        "timings": ev.timings.as_dict(),
                    }
                )
            elif isinstance(ev, TaskError):
                yield sse({"error": {"code": ev.status, "message": ev.message, "type": ev.type}})
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage_of(results)})
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)
