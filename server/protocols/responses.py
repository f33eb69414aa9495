"""OpenAI's Responses API, the stateless subset llama-server serves: the body becomes a chat
request (server.protocols.responses_mapping), runs through chat's rendering, tools and ``service.submit``, and
answers as a ``response`` object or llama-server's stream of Responses events
(``event: <type>`` lines; no [DONE])."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from ..prompts.chat import chat_token_count, plan_chat
from ..prompts.submissions import responses_request
from ..schemas.bodies import ChatRequest, ResponsesRequest
from ..schemas.errors import APIError
from ..service.state import ServerState, tenant_of
from ..service.submit import submit
from ..service.tasks import TaskGroup
from ..task import Event, PromptProgress, TaskError, TaskResult, TextChunk
from ..templates.chat_plan import ChatPlan
from ..templates.output_parse import Delta, Message, ToolCall, parse_message
from .common import Frame, json_str, prep, sse_batches, sse_error, sse_named, state_of
from .responses_mapping import (
    ResponsesInputError,
    call_item,
    message_item,
    new_id,
    output_items,
    reasoning_item,
    response_object,
    text_part,
    to_chat_body,
    usage,
)
from .streams import sse_response

router = APIRouter()

Ev = tuple[str, dict[str, object]]  # (event type, data)


def _chat_request(body: ResponsesRequest) -> ChatRequest:
    """The chat request of a Responses body; 400 with llama-server's message when the input
    cannot be mapped, the chat body's own validation errors otherwise."""
    raw = body.model_dump(exclude_unset=True, by_alias=True)
    try:
        return ChatRequest.model_validate(to_chat_body(raw))
    except ResponsesInputError as e:
        raise APIError(400, str(e)) from None
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


@router.post("/v1/responses")
@router.post("/responses")
async def responses(body: ResponsesRequest, request: Request) -> Response:
    """Create a response (never stored): the answer's output items, or their stream."""
    st = state_of(request)
    # the items mapped, tool schemas checked: off the loop, in one hand-off
    chat, plan = await prep(request, _chat_and_plan, st, body)
    job = responses_request(st, chat, plan)
    group = await submit(st, chat, job, tenant_of(st, request, chat.cache_salt), request)
    model = chat.model or st.model_name
    if not chat.stream:
        (r,) = await group.results(request)
        m = Message(content=r.text) if plan.plain else parse_message(r.text, plan.parser())
        out = output_items(m, new_id("msg_"), new_id("rs_"))
        use = usage(r.n_prompt, r.timings.predicted_n, r.timings.cache_n)
        return JSONResponse(response_object(new_id("resp_"), model, out, use))
    stream = _ResponseStream(plan, model)
    return sse_response(request, group, stream.run(group))


@router.post("/v1/responses/input_tokens")
@router.post("/responses/input_tokens")
async def responses_input_tokens(body: ResponsesRequest, request: Request) -> dict[str, object]:
    """llama-server's token count of a Responses body: the tokens its chat prompt feeds the
    model (nothing generated)."""
    st = state_of(request)
    n = await prep(request, _n_tokens, st, body)
    return {"input_tokens": n, "object": "response.input_tokens"}


def _chat_and_plan(st: ServerState, body: ResponsesRequest) -> tuple[ChatRequest, ChatPlan]:
    chat = _chat_request(body)
    return chat, plan_chat(st, chat)


def _n_tokens(st: ServerState, body: ResponsesRequest) -> int:
    return chat_token_count(st, _chat_request(body))


class _ResponseStream:
    """One streamed response: llama-server's events from the parsed chat deltas. The
    created/in_progress pair opens at the first engine event; a progress event
    (return_progress) repeats in_progress with ``prompt_progress``."""

    def __init__(self, plan: ChatPlan, model: str) -> None:
        self.plan = plan
        self.parser = plan.parser()
        self.model = model
        self.resp_id, self.msg_id, self.rs_id = new_id("resp_"), new_id("msg_"), new_id("rs_")
        self.msg = Message()
        self.created = self.text_started = self.thinking_started = False
        self.fc_ids: dict[int, str] = {}  # call index -> its fc_ item id
        # the message's text deltas, prebuilt (None: built per event)
        delta = _ev("response.output_text.delta", item_id=self.msg_id, delta=Frame.hole(0))
        self.text_frame = Frame.named(*delta, 1)

    def run(self, group: TaskGroup) -> AsyncIterator[str]:
        """The response's SSE, one write per batch of engine events (``sse_batches``). A
        reader far behind gets its text merged: one ``output_text.delta`` (or parser
        delta) for the run, with the run's last timings (no log-probs are streamed)."""
        return sse_batches(group, self.add, coalesce=True)

    def add(self, out: list[str], _index: int, ev: Event) -> None:
        """Append the events of one engine event to ``out``: the first one opens the
        response (created, in_progress); a text chunk's ``timings`` (timings_per_token)
        go on its last event; an error is llama-server's error event."""
        if isinstance(ev, PromptProgress):
            events = self._head(progress=True)
            events[-1][1]["prompt_progress"] = ev.as_dict()
            out.append(sse_named(events))
        elif isinstance(ev, TextChunk):
            d = Delta(content=ev.text) if self.plan.plain else self.parser.feed(ev.text)
            frame = self._text_frame(d) if ev.timings is None else None
            if frame is not None:
                self.msg.add(d)
                out.append(frame.fill(json_str(d.content)))
                return
            events = self._head() + self._deltas(d)
            if events and ev.timings is not None:  # timings_per_token
                events[-1][1]["timings"] = ev.timings.as_dict()
            out.append(sse_named(events))
        elif isinstance(ev, TaskResult):
            rest = Delta() if self.plan.plain else self.parser.finish()
            out.append(sse_named(self._head() + self._deltas(rest) + self._done(ev)))
        elif isinstance(ev, TaskError):
            out.append(sse_error(ev))

    def _text_frame(self, d: Delta) -> Frame | None:
        """The prebuilt ``output_text.delta`` frame, where ``d`` is only more text of the
        started message: the bytes ``_head() + _deltas(d)`` would give."""
        if not (self.created and self.text_started and d.content) or d.reasoning or d.calls:
            return None
        return self.text_frame

    def _status(self, kind: str) -> Ev:
        response = {"id": self.resp_id, "object": "response", "status": "in_progress"}
        return kind, {"type": kind, "response": response}

    def _head(self, progress: bool = False) -> list[Ev]:
        if not self.created:
            self.created = True
            return [self._status("response.created"), self._status("response.in_progress")]
        return [self._status("response.in_progress")] if progress else []

    def _deltas(self, d: Delta) -> list[Ev]:
        """The events of one parser delta: reasoning, text, then tool call pieces, each kind
        opening its output item the first time."""
        self.msg.add(d)
        out: list[Ev] = []
        if d.reasoning:
            if not self.thinking_started:
                self.thinking_started = True
                item = {**reasoning_item(self.rs_id, ""), "content": [], "status": "in_progress"}
                out.append(_ev("response.output_item.added", item=item))
            out.append(_ev("response.reasoning_text.delta", delta=d.reasoning, item_id=self.rs_id))
        if d.content:
            if not self.text_started:
                self.text_started = True
                item = {**message_item(self.msg_id, ""), "content": [], "status": "in_progress"}
                out.append(_ev("response.output_item.added", item=item))
                part = {"type": "output_text", "text": ""}
                out.append(_ev("response.content_part.added", item_id=self.msg_id, part=part))
            out.append(_ev("response.output_text.delta", item_id=self.msg_id, delta=d.content))
        for c in d.calls:
            if c.id is not None:
                item = call_item(ToolCall(c.id, c.name or "", ""), status="in_progress")
                self.fc_ids[c.index] = str(item["id"])  # call_item's "id": a str
                out.append(_ev("response.output_item.added", item=item))
            if c.arguments:
                fc_id = self.fc_ids.get(c.index, "")
                out.append(
                    _ev("response.function_call_arguments.delta", delta=c.arguments, item_id=fc_id)
                )
        return out

    def _done(self, r: TaskResult) -> list[Ev]:
        """The closing events: each output item done, then response.completed with the
        whole response, its usage and llama-server's ``timings``."""
        m, out, events = self.msg, [], []
        if m.reasoning:
            item = reasoning_item(self.rs_id, m.reasoning)
            events.append(_ev("response.output_item.done", item=item))
            out.append(item)
        if m.content:
            events.append(_ev("response.output_text.done", item_id=self.msg_id, text=m.content))
            part = text_part(m.content)
            events.append(_ev("response.content_part.done", item_id=self.msg_id, part=part))
            item = message_item(self.msg_id, m.content)
            events.append(_ev("response.output_item.done", item=item))
            out.append(item)
        for c in m.tool_calls:
            item = call_item(c)
            events.append(_ev("response.output_item.done", item=item))
            out.append(item)
        use = usage(r.n_prompt, r.timings.predicted_n, r.timings.cache_n)
        response = response_object(self.resp_id, self.model, out, use)
        completed = _ev("response.completed", response=response)
        completed[1]["timings"] = r.timings.as_dict()
        return [*events, completed]


def _ev(kind: str, **data: object) -> Ev:
    return kind, {"type": kind, **data}
