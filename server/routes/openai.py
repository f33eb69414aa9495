"""OpenAI API: /v1/completions, /v1/chat/completions, /v1/models.

Both generating endpoints submit through ``service.submit`` and answer through ``respond``;
what is their own is how the body becomes prompts and what a choice looks like."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..chat import ROLES, TemplateError
from ..errors import APIError
from ..schemas import ChatRequest, CompletionRequest
from ..service import (
    Prompt,
    ServerState,
    Submission,
    TaskGroup,
    finish_reason,
    merged_timings,
    submit,
    usage_of,
)
from ..types import TaskError, TaskResult, TextChunk, TokenLogprob
from .common import SSE_DONE, SSE_HEADERS, sse, sse_error, state_of, token_logprobs

router = APIRouter()

Choice = dict[str, Any]


def _piece(backend: Any, tok: int) -> str:
    return backend.token_to_piece(tok).decode("utf-8", "replace")


def completion_logprobs(backend: Any, lps: list[TokenLogprob], offset0: int = 0) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object; ``offset0`` is the choice's text length so
    far (streamed chunks continue the offsets of the ones before)."""
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


def chat_logprobs(backend: Any, lps: list[TokenLogprob]) -> dict[str, Any]:
    """The chat ``logprobs`` object."""
    return {"content": token_logprobs(backend, lps)}


def _prompts(st: ServerState, prompt: Any) -> list[Prompt]:
    """A completions ``prompt`` (text, tokens, or a list of either) as one Prompt each."""
    b = st.backend
    if isinstance(prompt, str):
        return [Prompt(b.tokenize(prompt, add_special=True, parse_special=True))]
    if not prompt:
        raise APIError(400, "the prompt is empty")
    if all(isinstance(x, int) for x in prompt):
        return [Prompt(list(prompt))]
    return [
        Prompt(
            b.tokenize(p, add_special=True, parse_special=True) if isinstance(p, str) else list(p)
        )
        for p in prompt
    ]


def _prompt_text(backend: Any, raw: Any, tokens: list[int], i: int) -> str:
    """The text of prompt ``i`` as the client sent it (detokenized if it sent tokens)."""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list) and raw and isinstance(raw[i], str):
        return raw[i]
    return backend.detokenize(tokens)


def _max_tokens(*values: int | None) -> int:
    """The first limit the client set, by precedence; -1 (no limit) if none."""
    for v in values:
        if v is not None:
            return v
    return -1


@router.get("/v1/models")
@router.get("/models")
async def models(request: Request) -> dict[str, Any]:
    """The one model this server serves, with llama-server's ``meta``."""
    st = state_of(request)
    b = st.backend
    return {
        "object": "list",
        "data": [
            {
                "id": st.model_name,
                "object": "model",
                "created": int(st.started),
                "owned_by": "llamacpp",
                "meta": {
                    "n_vocab": b.n_vocab if b else None,
                    "n_ctx_train": b.n_ctx_train if b else None,
                    "n_params": b.n_params if b else None,
                    "size": b.model_size if b else None,
                },
            }
        ],
    }


@dataclass
class Shape:
    """How one OpenAI endpoint shapes its responses.

    ``text_choice(index, chunk)`` is a streamed text delta; ``final_choice(index, result,
    whole)`` ends a choice, holding the whole text when ``whole`` (not streaming) and only
    the finish reason otherwise. ``opening`` chunks start a stream."""

    id_prefix: str
    obj: str
    chunk_obj: str
    text_choice: Callable[[int, TextChunk], Choice]
    final_choice: Callable[[int, TaskResult, bool], Choice]
    opening: list[Choice] = field(default_factory=list)


class _CompletionChoices:
    """The choices of /v1/completions. Stateful per request: a streamed choice's log-prob
    offsets continue from its previous chunk, and its echoed prompt opens its first chunk."""

    def __init__(self, backend: Any, body: CompletionRequest, group: TaskGroup) -> None:
        self.b = backend
        self.logprobs = body.logprobs is not None
        self.offsets = [0] * len(group.tasks)
        # choice i runs prompt i // n (service.submit's order)
        self.echo = [
            _prompt_text(backend, body.prompt, t.prompt, i // body.n) if body.echo else ""
            for i, t in enumerate(group.tasks)
        ]

    def _head(self, index: int) -> str:
        # the echo goes out once: with the first chunk of the choice
        head, self.echo[index] = self.echo[index], ""
        return head

    def text(self, index: int, ev: TextChunk) -> Choice:
        lp = (
            completion_logprobs(self.b, ev.logprobs, self.offsets[index]) if self.logprobs else None
        )
        self.offsets[index] += len(ev.text)
        return {
            "index": index,
            "text": self._head(index) + ev.text,
            "logprobs": lp,
            "finish_reason": None,
        }

    def final(self, index: int, r: TaskResult, whole: bool) -> Choice:
        lp = completion_logprobs(self.b, r.logprobs) if whole and self.logprobs else None
        return {
            "index": index,
            "text": self._head(index) + (r.text if whole else ""),
            "logprobs": lp,
            "finish_reason": finish_reason(r),
        }


@router.post("/v1/completions")
@router.post("/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    """Legacy text completions: every prompt ``n`` times, choices prompt-major."""
    st = state_of(request)

    def no_echo_logprobs() -> None:
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo with logprobs is not supported (no prompt log-probabilities)")

    job = Submission(
        prompts=lambda: _prompts(st, body.prompt),
        max_tokens=_max_tokens(body.max_tokens, body.n_predict),
        stream=body.stream,
        n_probs=body.logprobs or 0,
        logprobs=body.logprobs is not None,
        n=body.n,
        check=no_echo_logprobs,
    )
    group = await submit(st, body, job)
    choices = _CompletionChoices(st.backend, body, group)
    shape = Shape("cmpl-", "text_completion", "text_completion", choices.text, choices.final)
    return await respond(request, group, body, shape, st.model_name)


def _messages(req: ChatRequest) -> list[dict[str, Any]]:
    """The messages as the chat template takes them: text parts joined, developer as system."""
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


def render_chat(st: ServerState, req: ChatRequest) -> Prompt:
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
        head_tokens = b.tokenize(head, add_special=True, parse_special=True)
        # The boundary counts only where the head tokenizes alike alone and within the
        # whole prompt (a token may straddle it).
        if tokens[: len(head_tokens)] == head_tokens:
            user_start = len(head_tokens)
    return Prompt(tokens, user_start)


def _chat_shape(backend: Any, body: ChatRequest, n_choices: int) -> Shape:
    """The chat response's choices: a message each, or role, content deltas, finish."""
    want_lp = body.logprobs

    def text_choice(index: int, ev: TextChunk) -> Choice:
        lp = chat_logprobs(backend, ev.logprobs) if want_lp else None
        return {
            "index": index,
            "delta": {"content": ev.text},
            "logprobs": lp,
            "finish_reason": None,
        }

    def final_choice(index: int, r: TaskResult, whole: bool) -> Choice:
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
            "logprobs": chat_logprobs(backend, r.logprobs) if want_lp else None,
            "finish_reason": finish_reason(r),
        }

    opening = [
        {
            "index": i,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        for i in range(n_choices)
    ]
    return Shape(
        "chatcmpl-", "chat.completion", "chat.completion.chunk", text_choice, final_choice, opening
    )


@router.post("/v1/chat/completions")
@router.post("/chat/completions")
async def chat_completions(body: ChatRequest, request: Request) -> Response:
    """Chat completions: the messages rendered by the chat template, ``n`` choices."""
    st = state_of(request)

    def top_logprobs_needs_logprobs() -> None:
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true")

    job = Submission(
        prompts=lambda: [render_chat(st, body)],
        max_tokens=_max_tokens(body.max_completion_tokens, body.max_tokens),
        stream=body.stream,
        n_probs=body.top_logprobs or 0,
        logprobs=body.logprobs,
        n=body.n,
        check=top_logprobs_needs_logprobs,
    )
    group = await submit(st, body, job)
    shape = _chat_shape(st.backend, body, len(group.tasks))
    return await respond(request, group, body, shape, st.model_name)


async def respond(
    request: Request,
    group: TaskGroup,
    body: CompletionRequest | ChatRequest,
    shape: Shape,
    fingerprint: str,
) -> Response:
    """The response of an OpenAI completion or chat request: one JSON body, or an SSE stream
    (opening chunks, text chunks, a final chunk per choice with ``timings``, usage, [DONE])."""
    head = {
        "id": shape.id_prefix + uuid.uuid4().hex,
        "object": shape.obj,
        "created": int(time.time()),
        "model": body.model or fingerprint,
        "system_fingerprint": fingerprint,
    }
    if not body.stream:
        results = await group.results(request)
        return JSONResponse(
            {
                **head,
                "choices": [shape.final_choice(i, r, True) for i, r in enumerate(results)],
                "usage": usage_of(results),
                "timings": merged_timings(results).as_dict(),
            }
        )
    base = {**head, "object": shape.chunk_obj}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return StreamingResponse(
        _stream(group, shape, base, include_usage),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )


async def _stream(
    group: TaskGroup, shape: Shape, base: dict[str, Any], include_usage: bool
) -> AsyncIterator[str]:
    """The SSE events of a streamed OpenAI response; ``base`` is every chunk's envelope.
    A failed choice sends an error event (the status line went out already) and the stream
    still ends with [DONE], as OpenAI clients expect."""
    for choice in shape.opening:
        yield sse({**base, "choices": [choice]})
    results: list[TaskResult] = []
    async for index, ev in group.events():
        if isinstance(ev, TextChunk):
            yield sse({**base, "choices": [shape.text_choice(index, ev)]})
        elif isinstance(ev, TaskResult):
            results.append(ev)
            final = shape.final_choice(index, ev, False)
            yield sse({**base, "choices": [final], "timings": ev.timings.as_dict()})
        elif isinstance(ev, TaskError):
            yield sse_error(ev)
    if include_usage:
        yield sse({**base, "choices": [], "usage": usage_of(results)})
    yield SSE_DONE
