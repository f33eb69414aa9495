"""OpenAI API: /v1/completions, /v1/chat/completions, /v1/models.

Both generating endpoints submit through ``service.submit`` and answer through ``respond``;
what is their own is how the body becomes prompts and what a choice looks like."""

from __future__ import annotations

import datetime
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..api.cancel import checkpoint
from ..api.chat import (
    ROLES,
    ChatTemplate,
    Continuation,
    Rendered,
    TemplateError,
    thinking_forced_open,
)
from ..api.errors import APIError
from ..api.schemas import ChatRequest, CompletionRequest
from ..api.tools.parse import Delta, Message, parse_message
from ..api.tools.plan import ChatPlan, deltas_of, message_of, plan_chat
from ..api.tools.prompt import prepare
from ..api.tools.spec import ToolSpecError
from ..cli.config import csv_list
from ..constrained import Constraint
from ..service.state import ServerState, tenant_of
from ..service.submit import Prompt, Submission, submit
from ..service.tasks import TaskGroup
from ..service.tokenizer import tokenize, tokenize_at
from ..service.usage import finish_reason, merged_timings, usage_of
from ..service.validation import constraint_of
from ..types import Event, PromptProgress, TaskError, TaskResult, TextChunk, TokenLogprob
from .common import (
    SSE_DONE,
    SSE_HEADERS,
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
        return [Prompt(tokenize(b, prompt, True, True))]
    if not prompt:
        raise APIError(400, "the prompt is empty")
    if all(isinstance(x, int) for x in prompt):
        return [Prompt(list(prompt))]
    out = []
    for p in prompt:
        checkpoint()
        out.append(Prompt(tokenize(b, p, True, True) if isinstance(p, str) else list(p)))
    return out


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


def model_object(st: ServerState) -> dict[str, Any]:
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
        "meta": {
            "n_vocab": b.n_vocab if b else None,
            "n_ctx_train": b.n_ctx_train if b else None,
            "n_params": b.n_params if b else None,
            "size": b.model_size if b else None,
        },
    }


@router.get("/v1/models")
@router.get("/models")
async def models(request: Request) -> dict[str, Any]:
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


def adapter_models(st: ServerState) -> list[dict[str, Any]]:
    """The --lora-alias adapters as models (vLLM's convention: ``parent`` is the base
    model, ``root`` the adapter file); ``model: NAME`` selects one."""
    return [
        {
            "id": a.alias,
            "object": "model",
            "created": int(st.started),
            "owned_by": "llamacpp",
            "type": "model",
            "display_name": a.alias,
            "root": a.path,
            "parent": st.model_name,
            "lora_id": a.id,
        }
        for a in st.adapters.adapters
        if a.alias
    ]


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict[str, Any]:
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
        constraint=lambda: constraint_of(json_schema=body.json_schema, grammar=body.grammar),
        return_progress=body.return_progress,
        timings_per_token=body.timings_per_token,
    )
    group = await submit(st, body, job, tenant_of(st, request, body.cache_salt), request)
    choices = _CompletionChoices(st.backend, body, group)
    shape = Shape("cmpl-", "text_completion", "text_completion", choices.text, choices.final)
    return await respond(request, group, body, shape, st.model_name)


def _messages(req: ChatRequest) -> list[dict[str, Any]]:
    """The messages as the chat template takes them: text parts joined, developer as system."""
    out = []
    for m in req.messages:
        checkpoint()  # the client may have left: stop between messages
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
        if m.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        out.append(msg)
    return out


def _continuation(
    st: ServerState, req: ChatRequest, messages: list[dict[str, Any]]
) -> tuple[Continuation | None, bool]:
    """Whether the final message is continued (and then taken off ``messages``), and whether
    the template opens the assistant turn, as llama-server decides: ``continue_final_message``
    (true, "content" or "reasoning_content"), else a final assistant message is continued
    (--prefill-assistant, on by default). APIError 400 for the combinations it refuses."""
    mode = req.continue_final_message
    add_gen = req.add_generation_prompt
    if mode is None and st.settings.prefill_assistant and messages[-1]["role"] == "assistant":
        if len(messages) >= 2 and messages[-2]["role"] == "assistant":
            raise APIError(400, "Cannot have 2 or more assistant messages at the end of the list.")
        mode, add_gen = True, False
    if not mode:
        return None, add_gen
    if add_gen:
        raise APIError(
            400, "Cannot set both add_generation_prompt and continue_final_message to true."
        )
    last, raw = messages.pop(), req.messages[-1]
    if last.get("tool_calls"):
        raise APIError(400, "Cannot continue an assistant message that contains tool calls.")
    # parts join with a blank line here (llama.cpp's render_content), with "\n" elsewhere
    if isinstance(raw.content, list):
        content = "\n\n".join(p.text or "" for p in raw.content)
    else:
        content = last["content"]
    reasoning = last.get("reasoning_content") or ""
    if mode is True:  # auto: the reasoning when there is nothing else to continue
        mode = "reasoning_content" if reasoning and not content else "content"
    return Continuation(content, reasoning, mode == "reasoning_content"), False


def _template(st: ServerState) -> ChatTemplate:
    """The model's chat template; APIError 503 while no model is loaded (it comes with it)."""
    if st.template is None:
        raise APIError(503, "Loading model", "unavailable_error")
    return st.template


def render_prompt(st: ServerState, req: ChatRequest, plan: ChatPlan) -> Rendered:
    """The chat template's rendering of ``req``: tools and tool history as ``plan`` says
    (server.api.tools.prompt), a continued final message as ``_continuation`` says. APIError 400
    when the template rejects the messages, 500 when the template itself fails."""
    messages = _messages(req)
    continuation, add_gen = _continuation(st, req, messages)
    try:
        tpl = _template(st)
        prepared = prepare(tpl, messages, plan.spec, plan.kwargs)
        return tpl.render_chat(
            prepared.messages,
            add_generation_prompt=add_gen,
            continuation=continuation,
            **prepared.extra,
        )
    except TemplateError as e:
        raise APIError(400 if e.client else 500, str(e)) from e


def render_chat(st: ServerState, req: ChatRequest, plan: ChatPlan) -> Prompt:
    """Prompt tokens and the token index where the last user turn starts (-1 if unknown).
    Whether the prompt leaves the answer inside an open ``<think>`` is noted in
    ``plan.forced_open``."""
    b = st.backend
    rendered = render_prompt(st, req, plan)
    plan.forced_open = rendered.in_reasoning or thinking_forced_open(rendered.prompt)
    text = rendered.prompt
    # Templates emit BOS themselves; tokenizing with add_special would add a second one.
    has_bos = bool(b.bos_text) and text.startswith(b.bos_text)
    if has_bos:
        text = text[len(b.bos_text) :]
    # the last user turn's offset in ``text``: tokenized in pieces (linear time, see
    # service.tokenizer), where a piece starts there its first token is the answer
    mark = rendered.last_user_offset - (len(b.bos_text) if has_bos else 0)
    tokens, at = tokenize_at(b, text, True, True, [mark] if mark > 0 else [])
    user_start = at.get(mark, -1)
    if rendered.last_user_offset > 0 and mark not in at:
        head = rendered.prompt[: rendered.last_user_offset]
        if has_bos:
            head = head[len(b.bos_text) :]
        head_tokens = tokenize(b, head, True, True)
        # The boundary counts only where the head tokenizes alike alone and within the
        # whole prompt (a token may straddle it).
        if tokens[: len(head_tokens)] == head_tokens:
            user_start = len(head_tokens)
    return Prompt(tokens, user_start)


def _chat_finish(r: TaskResult, has_calls: bool) -> str:
    """The finish reason, "tool_calls" when the answer called tools and was not cut short."""
    reason = finish_reason(r)
    return "tool_calls" if has_calls and reason == "stop" else reason


def _chat_shape(backend: Any, body: ChatRequest, n_choices: int, plan: ChatPlan) -> Shape:
    """The chat response's choices: a message each, or role, deltas, finish. The output goes
    through one parser per choice (reasoning, tool calls: server.api.tools) unless plain."""
    want_lp = body.logprobs
    parsers = [plan.parser() for _ in range(n_choices)]
    calls_mode = plan.spec.parse_calls
    said = [False] * n_choices  # a choice's stream carried content

    def chunks(index: int, d: Delta, lp: Any) -> list[Choice]:
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
    opening = [
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


def _plan(st: ServerState, body: ChatRequest) -> ChatPlan:
    """The request's tools and reasoning handling; APIError 400 for malformed tool fields
    or a forced call together with another constraint on the output."""
    st.require_engine()  # the template comes with the model
    template = _template(st)
    # Server defaults (llama-server's --reasoning-format, --chat-template-kwargs, -rea and
    # --reasoning-effort) under the request's own values.
    s = st.settings
    effort = s.reasoning_effort
    server_kwargs = dict(s.chat_template_kwargs or {})
    if s.reasoning != "auto":  # -rea on|off: the template's thinking switch
        server_kwargs.setdefault("enable_thinking", s.reasoning == "on")
    try:
        plan = plan_chat(
            template,
            tools=body.tools,
            tool_choice=body.tool_choice,
            parallel_tool_calls=body.parallel_tool_calls,
            reasoning_format=body.reasoning_format,
            # llama-server's deepseek-legacy also keeps the tags in content: not done here
            default_reasoning_format=s.reasoning_format.replace("deepseek-legacy", "deepseek"),
            chat_template_kwargs={**server_kwargs, **(body.chat_template_kwargs or {})},
            reasoning_effort=body.reasoning_effort or effort,
        )
    except ToolSpecError as e:
        raise APIError(400, str(e)) from None
    if plan.spec.forced and (body.response_format or body.json_schema or body.grammar):
        field = "response_format" if body.response_format else "json_schema or grammar"
        raise APIError(400, f"{field} cannot be combined with a forced tool_choice")
    return plan


def chat_constraint(plan: ChatPlan, body: ChatRequest) -> Constraint | None:
    """A chat request's constraint: the forced call's, else what its ``response_format``,
    ``json_schema`` or ``grammar`` asks for. Compiles the client's schema (in a compile
    child): call it from a worker thread (``Submission.constraint``)."""
    return _tool_constraint(plan) or constraint_of(
        response_format=body.response_format, json_schema=body.json_schema, grammar=body.grammar
    )


def _tool_constraint(plan: ChatPlan) -> Constraint | None:
    """The forced call's constraint (None unless tool_choice forces one)."""
    try:
        return plan.constraint()
    except ToolSpecError as e:
        raise APIError(400, str(e)) from None


@router.post("/v1/chat/completions")
@router.post("/chat/completions")
async def chat_completions(body: ChatRequest, request: Request) -> Response:
    """Chat completions: the messages rendered by the chat template, ``n`` choices."""
    st = state_of(request)

    def top_logprobs_needs_logprobs() -> None:
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true")

    plan = await prep(request, _plan, st, body)  # checks tool schemas: off the loop
    job = Submission(
        prompts=lambda: [render_chat(st, body, plan)],
        max_tokens=_max_tokens(body.max_completion_tokens, body.max_tokens),
        stream=body.stream,
        n_probs=body.top_logprobs or 0,
        logprobs=body.logprobs,
        n=body.n,
        check=top_logprobs_needs_logprobs,
        constraint=lambda: chat_constraint(plan, body),
        return_progress=body.return_progress,
        timings_per_token=body.timings_per_token,
    )
    group = await submit(st, body, job, tenant_of(st, request, body.cache_salt), request)
    shape = _chat_shape(st.backend, body, len(group.tasks), plan)
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
    return StreamingResponse(
        _stream(group, shape, base, include_usage, verbose),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )


def _wants_verbose(st: ServerState, body: CompletionRequest | ChatRequest) -> bool:
    """llama-server's ``verbose``: the request's, by default on with --verbose (there:
    a verbosity above 9, which --verbose sets)."""
    if body.verbose is not None:
        return body.verbose
    return st.settings.verbose or st.settings.log_verbosity > 9


Verbose = Callable[[int, TaskResult, bool], dict[str, Any]]


def _verbose_of(st: ServerState, group: TaskGroup) -> Verbose:
    """``verbose(index, result, whole)``: llama-server's ``__verbose`` debug object of a
    choice, its /completion result (content empty when streamed), with the prompt as the
    model read it (special tokens written out)."""

    def verbose(index: int, r: TaskResult, whole: bool) -> dict[str, Any]:
        task = group.tasks[index]
        raw = b"".join(st.backend.token_to_piece(t, special=True) for t in task.prompt)
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

    def __init__(self, shape: Shape, base: dict[str, Any], verbose: Verbose | None) -> None:
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
    base: dict[str, Any],
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
