"""OpenAI API: /v1/completions, /v1/chat/completions, /v1/models.

Both generating endpoints submit through ``service.submit`` and answer through ``respond``;
what is their own is how the body becomes prompts and what a choice looks like."""

from __future__ import annotations

import datetime
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..engine_api import Tokenizer
from ..prompts.chat import plan_chat
from ..prompts.submissions import chat_request, completion_request
from ..schemas.bodies import ChatRequest, CompletionRequest
from ..schemas.errors import APIError
from ..service.state import ServerState, tenant_of
from ..service.submit import submit
from ..service.tasks import TaskGroup
from ..service.usage import finish_reason, merged_timings, usage_of
from ..settings.config import csv_list
from ..task import Event, PromptProgress, TaskError, TaskResult, TextChunk, TokenLogprob
from ..templates.chat_plan import ChatPlan, deltas_of, message_of
from ..templates.output_parse import Delta, Message, parse_message
from .common import (
    SSE_DONE,
    Frame,
    json_str,
    prep,
    sse,
    sse_batches,
    sse_error,
    state_of,
    system_fingerprint,
    token_logprobs,
)
from .native import completion_object
from .streams import sse_response

router = APIRouter()

Choice = dict[str, object]


def _piece(backend: Tokenizer, tok: int) -> str:
    return backend.token_to_piece(tok).decode("utf-8", "replace")


def completion_logprobs(
    backend: Tokenizer, lps: list[TokenLogprob], offset0: int = 0
) -> dict[str, object]:
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


def chat_logprobs(backend: Tokenizer, lps: list[TokenLogprob]) -> dict[str, object]:
    """The chat ``logprobs`` object."""
    return {"content": token_logprobs(backend, lps)}


def _prompt_text(backend: Tokenizer, raw: object, tokens: list[int], i: int) -> str:
    """The text of prompt ``i`` as the client sent it (detokenized if it sent tokens)."""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list) and raw and isinstance(raw[i], str):
        return raw[i]
    return backend.detokenize(tokens)


def input_modalities(st: ServerState) -> list[str]:
    """What a request may carry: text, and images where the projector reads them (never
    audio yet: audio inputs are refused, whatever the projector reads; /props says so too)."""
    p = st.projector
    return ["text"] + (["image"] if p and p.vision else [])


def model_object(st: ServerState) -> dict[str, object]:
    """The served model as OpenAI lists it, with llama-server's ``meta`` and the fields of
    Anthropic's model object (``type``, ``display_name``, ``created_at``), so both SDKs
    read the same list."""
    b = st.backend
    created = datetime.datetime.fromtimestamp(int(st.started), datetime.timezone.utc)
    return {
        "id": st.model_name,
        "aliases": st.model_aliases,
        "tags": sorted(set(csv_list(st.settings.tags))),
        "object": "model",
        "created": int(st.started),
        "owned_by": "llamacpp",
        "type": "model",
        "display_name": st.model_name,
        "created_at": created.isoformat().replace("+00:00", "Z"),
        # what the model reads (image: a --mmproj projector with vision is loaded)
        "architecture": {"input_modalities": input_modalities(st), "output_modalities": ["text"]},
        "meta": {
            "n_vocab": b.n_vocab if b else None,
            "n_ctx_train": b.n_ctx_train if b else None,
            "n_params": b.n_params if b else None,
            "size": b.model_size if b else None,
        },
    }


@router.get("/v1/models")
@router.get("/models")
async def models(request: Request) -> dict[str, object]:
    """The one model this server serves (Anthropic's paging fields too)."""
    st = state_of(request)
    m = model_object(st)
    data = [m, *adapter_models(st)]
    return {
        "object": "list",
        "data": data,
        "has_more": False,
        "first_id": m["id"],
        "last_id": data[-1]["id"],
    }


def adapter_models(st: ServerState) -> list[dict[str, object]]:
    """The named adapters (--lora-alias, and those loaded at run time) as models (vLLM's
    convention: ``parent`` is the base model, ``root`` the adapter file); ``model: NAME``
    selects one."""
    return [
        {
            "id": name,
            "object": "model",
            "created": int(st.started),
            "owned_by": "llamacpp",
            "type": "model",
            "display_name": name,
            "root": a.path,
            "parent": st.model_name,
            "lora_id": a.id,
        }
        for name, a in list(st.adapters.by_alias.items())
    ]


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict[str, object]:
    """One model by its name or an alias (404 otherwise)."""
    st = state_of(request)
    for a in adapter_models(st):
        if a["id"] == model_id:
            return a
    if model_id != st.model_name and model_id not in st.model_aliases:
        raise APIError(404, f"model {model_id!r} not found (this server serves {st.model_name!r})")
    return model_object(st)


@dataclass
class Shape:
    """How one OpenAI endpoint shapes its responses.

    ``text_choice(index, chunk)`` is a streamed text delta (a str: ``plain_choice``'s
    text); ``final_choice(index, result,
    whole)`` ends a choice, holding the whole text when ``whole`` (not streaming) and only
    the finish reason otherwise. ``opening`` chunks start a stream. Streamed, either may
    give a list (chat: a parser releases none or several deltas; the last final one holds
    the finish reason). ``progress_choice(index)`` is the choice of a ``prompt_progress``
    chunk (return_progress)."""

    id_prefix: str
    obj: str
    chunk_obj: str
    text_choice: Callable[[int, TextChunk], Choice | list[Choice] | str]
    final_choice: Callable[[int, TaskResult, bool], Choice | list[Choice]]
    opening: list[Choice] = field(default_factory=list)
    progress_choice: Callable[[int], Choice] = lambda index: {
        "index": index,
        "text": "",
        "logprobs": None,
        "finish_reason": None,
    }
    # ``text_choice`` may give a str: the text of ``plain_choice(index, text)``, the common
    # case, which the stream fills into a prebuilt frame instead of building the choice.
    plain_choice: Callable[[int, str], Choice] = lambda index, text: {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": None,
    }


class _CompletionChoices:
    """The choices of /v1/completions. Stateful per request: a streamed choice's log-prob
    offsets continue from its previous chunk, and its echoed prompt opens its first chunk."""

    def __init__(self, backend: Tokenizer, body: CompletionRequest, group: TaskGroup) -> None:
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

    def text(self, index: int, ev: TextChunk) -> Choice | str:
        if not self.logprobs and not self.echo[index]:
            self.offsets[index] += len(ev.text)
            return ev.text  # the plain choice
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
async def completions(body: CompletionRequest, request: Request) -> Response:
    """Legacy text completions: every prompt ``n`` times, choices prompt-major."""
    st = state_of(request)
    job = completion_request(st, body)
    group = await submit(st, body, job, tenant_of(st, request, body.cache_salt), request)
    choices = _CompletionChoices(st.require_backend(), body, group)
    shape = Shape("cmpl-", "text_completion", "text_completion", choices.text, choices.final)
    return await respond(request, group, body, shape, st.model_name)


def _chat_finish(r: TaskResult, has_calls: bool) -> str:
    """The finish reason, "tool_calls" when the answer called tools and was not cut short."""
    reason = finish_reason(r)
    return "tool_calls" if has_calls and reason == "stop" else reason


def _chat_shape(backend: Tokenizer, body: ChatRequest, n_choices: int, plan: ChatPlan) -> Shape:
    """The chat response's choices: a message each, or role, deltas, finish. The output goes
    through one parser per choice (reasoning, tool calls: server.templates) unless plain."""
    want_lp = body.logprobs
    parsers = [plan.parser() for _ in range(n_choices)]
    calls_mode = plan.spec.parse_calls
    said = [False] * n_choices  # a choice's stream carried content

    def chunks(index: int, d: Delta, lp: dict[str, object] | None) -> list[Choice]:
        deltas = deltas_of(d) or ([{}] if lp else [])
        return [
            {"index": index, "delta": x, "logprobs": lp if i == 0 else None, "finish_reason": None}
            for i, x in enumerate(deltas)
        ]

    def text_choice(index: int, ev: TextChunk) -> list[Choice] | str:
        lp = chat_logprobs(backend, ev.logprobs) if want_lp else None
        d = Delta(content=ev.text) if plan.plain else parsers[index].feed(ev.text)
        said[index] = said[index] or bool(d.content)
        if d.content and not d.reasoning and not d.calls and lp is None:
            return d.content  # one {"content": ...} delta: the plain choice
        return chunks(index, d, lp)

    def final_choice(index: int, r: TaskResult, whole: bool) -> list[Choice] | Choice:
        if not whole:
            p = parsers[index]
            rest = Delta() if plan.plain else p.finish()
            calls = p.tools is not None and p.tools.n_calls > 0
            flush = chunks(index, rest, None)
            end = {"index": index, "delta": {}, "logprobs": None}
            if calls_mode and not calls and not said[index] and not rest.content:
                flush.append({**end, "delta": {"content": ""}, "finish_reason": None})
            return [*flush, {**end, "finish_reason": _chat_finish(r, calls)}]
        m = Message(content=r.text) if plan.plain else parse_message(r.text, plan.parser())
        return {
            "index": index,
            "message": message_of(m),
            "logprobs": chat_logprobs(backend, r.logprobs) if want_lp else None,
            "finish_reason": _chat_finish(r, bool(m.tool_calls)),
        }

    # The content starts null, as llama-server's; with tools it turns "" at the end if
    # neither content nor calls came (as the non-streamed message).
    opening: list[Choice] = [
        {
            "index": i,
            "delta": {"role": "assistant", "content": None},
            "logprobs": None,
            "finish_reason": None,
        }
        for i in range(n_choices)
    ]

    shape = Shape(
        "chatcmpl-", "chat.completion", "chat.completion.chunk", text_choice, final_choice, opening
    )
    shape.progress_choice = _chat_progress_choice
    shape.plain_choice = _chat_plain_choice
    return shape


def _chat_plain_choice(index: int, text: str) -> Choice:
    return {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}


def _chat_progress_choice(index: int) -> Choice:
    """A chat progress chunk's choice: llama-server repeats the opening delta with each."""
    return {
        "index": index,
        "delta": {"role": "assistant", "content": None},
        "logprobs": None,
        "finish_reason": None,
    }


@router.post("/v1/chat/completions")
@router.post("/chat/completions")
async def chat_completions(body: ChatRequest, request: Request) -> Response:
    """Chat completions: the messages rendered by the chat template, ``n`` choices."""
    st = state_of(request)
    plan = await prep(request, plan_chat, st, body)  # checks tool schemas: off the loop
    job = chat_request(st, body, plan)
    group = await submit(st, body, job, tenant_of(st, request, body.cache_salt), request)
    shape = _chat_shape(st.require_backend(), body, len(group.tasks), plan)
    return await respond(request, group, body, shape, st.model_name)


async def respond(
    request: Request,
    group: TaskGroup,
    body: CompletionRequest | ChatRequest,
    shape: Shape,
    model_name: str,
) -> Response:
    """The response of an OpenAI completion or chat request: one JSON body, or an SSE stream
    (opening chunks, text chunks, a final chunk per choice with ``timings``, usage, [DONE])."""
    head = {
        "id": shape.id_prefix + uuid.uuid4().hex,
        "object": shape.obj,
        "created": int(time.time()),
        "model": body.model or model_name,
        "system_fingerprint": system_fingerprint(),
    }
    st = state_of(request)
    verbose = _verbose_of(st, group) if _wants_verbose(st, body) else None
    if not body.stream:
        results = await group.results(request)
        out = {
            **head,
            "choices": [shape.final_choice(i, r, True) for i, r in enumerate(results)],
            "usage": usage_of(results),
            "timings": merged_timings(results).as_dict(),
        }
        if verbose is not None:
            out["__verbose"] = verbose(0, results[0], True)
        return JSONResponse(out)
    base = {**head, "object": shape.chunk_obj}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return sse_response(request, group, _stream(group, shape, base, include_usage, verbose))


def _wants_verbose(st: ServerState, body: CompletionRequest | ChatRequest) -> bool:
    """llama-server's ``verbose``: the request's, by default on with --verbose (there:
    a verbosity above 9, which --verbose sets)."""
    if body.verbose is not None:
        return body.verbose
    return st.settings.verbose or st.settings.log_verbosity > 9


Verbose = Callable[[int, TaskResult, bool], dict[str, object]]


def _verbose_of(st: ServerState, group: TaskGroup) -> Verbose:
    """``verbose(index, result, whole)``: llama-server's ``__verbose`` debug object of a
    choice, its /completion result (content empty when streamed), with the prompt as the
    model read it (special tokens written out)."""

    def verbose(index: int, r: TaskResult, whole: bool) -> dict[str, object]:
        task = group.tasks[index]
        raw = b"".join(st.require_backend().token_to_piece(t, special=True) for t in task.prompt)
        prompt = raw.decode("utf-8", "replace")
        return completion_object(st, task, r, r.text if whole else "", prompt)

    return verbose


def _listed(choices: Choice | list[Choice]) -> list[Choice]:
    """A shape's streamed choices: one, or several (a parser may release none or many)."""
    return choices if isinstance(choices, list) else [choices]


def _choices(shape: Shape, index: int, c: Choice | list[Choice] | str) -> list[Choice]:
    """``text_choice``'s result as choices (a str is the plain choice's text)."""
    return [shape.plain_choice(index, c)] if isinstance(c, str) else _listed(c)


class _Frames:
    """The SSE frames of one streamed OpenAI response, event by event: ``base`` is every
    chunk's envelope. Plain text chunks are filled into one prebuilt frame per choice."""

    def __init__(self, shape: Shape, base: dict[str, object], verbose: Verbose | None) -> None:
        self.shape = shape
        self.base = base
        self.verbose = verbose
        self.results: list[TaskResult] = []
        self.plain: dict[int, Frame | None] = {}

    def _plain_frame(self, index: int) -> Frame | None:
        if index not in self.plain:
            choice = self.shape.plain_choice(index, Frame.hole(0))
            self.plain[index] = Frame.of({**self.base, "choices": [choice]}, 1)
        return self.plain[index]

    def text(self, out: list[str], index: int, ev: TextChunk) -> None:
        c = self.shape.text_choice(index, ev)
        if isinstance(c, str) and ev.timings is None:
            frame = self._plain_frame(index)
            if frame is not None:
                out.append(frame.fill(json_str(c)))
                return
        base = self.base
        chunks = [{**base, "choices": [x]} for x in _choices(self.shape, index, c)]
        if chunks and ev.timings is not None:  # timings_per_token: on the last one
            chunks[-1]["timings"] = ev.timings.as_dict()
        out += map(sse, chunks)

    def result(self, out: list[str], index: int, ev: TaskResult) -> None:
        self.results.append(ev)
        *flush, final = _listed(self.shape.final_choice(index, ev, False))
        out += (sse({**self.base, "choices": [choice]}) for choice in flush)
        # id_slot: the slot that ran this choice (llama-server's native chunks carry it)
        chunk = {**self.base, "choices": [final], "timings": ev.timings.as_dict()}
        chunk["id_slot"] = ev.id_slot
        if self.verbose is not None:
            chunk["__verbose"] = self.verbose(index, ev, False)
        out.append(sse(chunk))

    def add(self, out: list[str], index: int, ev: Event) -> None:
        if isinstance(ev, TextChunk):
            self.text(out, index, ev)
        elif isinstance(ev, TaskResult):
            self.result(out, index, ev)
        elif isinstance(ev, PromptProgress):
            choice = self.shape.progress_choice(index)
            out.append(sse({**self.base, "choices": [choice], "prompt_progress": ev.as_dict()}))
        elif isinstance(ev, TaskError):
            out.append(sse_error(ev))


async def _stream(
    group: TaskGroup,
    shape: Shape,
    base: dict[str, object],
    include_usage: bool,
    verbose: Verbose | None = None,
) -> AsyncIterator[str]:
    """The SSE events of a streamed OpenAI response; ``base`` is every chunk's envelope.
    A failed choice sends an error event (the status line went out already) and the stream
    still ends with [DONE], as OpenAI clients expect. A choice's final chunk carries its
    ``timings`` and the ``id_slot`` it ran on; the usage chunk carries the merged timings
    too (llama-server's last chunk has them). The events delivered together go out in one
    write (the same frames, fewer sends); a reader far behind gets its text coalesced
    (``TaskGroup.batches``)."""
    frames = _Frames(shape, base, verbose)
    if shape.opening:
        yield "".join(sse({**base, "choices": [choice]}) for choice in shape.opening)
    async for text in sse_batches(group, frames.add, coalesce=True):
        yield text
    tail = []
    if include_usage:
        results = frames.results
        usage = {"usage": usage_of(results), "timings": merged_timings(results).as_dict()}
        tail.append(sse({**base, "choices": [], **usage}))
    yield "".join([*tail, SSE_DONE])
