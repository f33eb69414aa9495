"""Anthropic's Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

The body becomes a chat request (server.protocols.anthropic_mapping), runs through chat's rendering,
tools, constraints and ``service.submit`` (so every cache tier and prefix sharing serve it
as they serve chat), and answers as a ``message`` or as Anthropic's event stream. Errors
under these paths take Anthropic's shape (server.schemas.errors.error_body_for)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from ..prompts.chat import chat_token_count, plan_chat
from ..prompts.submissions import messages_request
from ..schemas.anthropic_bodies import CountTokensRequest, MessagesRequest
from ..schemas.bodies import ChatRequest
from ..schemas.errors import APIError, anthropic_error_body
from ..service.state import ServerState, tenant_of
from ..service.submit import submit
from ..service.tasks import TaskGroup
from ..task import Event, PromptProgress, TaskError, TaskResult, TextChunk
from ..templates.chat_plan import ChatPlan
from ..templates.output_parse import Delta, Message, parse_message
from .anthropic_mapping import (
    AnthropicInputError,
    content_blocks,
    message_object,
    new_id,
    stop_reason,
    to_chat_body,
    usage,
)
from .common import Frame, json_str, prep, sse_batches, sse_named, state_of
from .streams import sse_response

router = APIRouter()

Ev = tuple[str, dict[str, object]]  # (event type, data)


def _chat_request(body: CountTokensRequest) -> ChatRequest:
    """The chat request of a Messages body: 400 naming what cannot be mapped, the chat
    body's own validation errors otherwise."""
    try:
        return ChatRequest.model_validate(to_chat_body(body))
    except AnthropicInputError as e:
        raise APIError(400, str(e)) from None
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


@router.post("/v1/messages")
@router.post("/messages")
async def messages(body: MessagesRequest, request: Request) -> Response:
    """Create a message: the whole answer, or its event stream."""
    st = state_of(request)
    # a long history, tool schemas: off the loop, in one hand-off
    chat, plan = await prep(request, _chat_and_plan, st, body)
    job = messages_request(st, body, chat, plan)
    group = await submit(st, chat, job, tenant_of(st, request, chat.cache_salt), request)
    omit = body.thinking is not None and body.thinking.display == "omitted"
    if not body.stream:
        (r,) = await group.results(request)
        m = Message(content=r.text) if plan.plain else parse_message(r.text, plan.parser())
        blocks = content_blocks(m, omit)
        out = message_object(new_id("msg_"), st.model_name, blocks, r, bool(m.tool_calls))
        return JSONResponse(out)
    stream = _MessageStream(plan, st.model_name, omit, len(group.tasks[0].prompt))
    return sse_response(request, group, stream.run(group))


@router.post("/v1/messages/count_tokens")
@router.post("/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
    """The prompt tokens a Messages body feeds the model (system, tools and thinking
    history included): ``input_tokens + cache_read_input_tokens`` of its answer."""
    st = state_of(request)
    return {"input_tokens": await prep(request, _n_tokens, st, body)}


def _chat_and_plan(st: ServerState, body: CountTokensRequest) -> tuple[ChatRequest, ChatPlan]:
    chat = _chat_request(body)
    return chat, plan_chat(st, chat)


def _n_tokens(st: ServerState, body: CountTokensRequest) -> int:
    return chat_token_count(st, _chat_request(body))


class _MessageStream:
    """One streamed message. Invariant: at most one content block is open; a delta of
    another kind (or a new tool call) closes it and opens the next, so indices rise by one
    and every ``content_block_start`` has its ``content_block_stop``."""

    def __init__(self, plan: ChatPlan, model: str, omit: bool, n_prompt: int) -> None:
        self.plan = plan
        self.parser = plan.parser()
        self.model = model
        self.omit = omit
        self.n_prompt = n_prompt
        self.msg_id = new_id("msg_")
        self.started = False
        self.index = -1
        self.open: str | None = None  # the open block's type
        self.n_calls = 0
        self.frames: dict[int, Frame | None] = {}  # text_delta frames by block index

    def run(self, group: TaskGroup) -> AsyncIterator[str]:
        """The message's SSE, one write per batch of engine events (``sse_batches``). A
        reader far behind gets its text merged: one ``text_delta`` (or parser delta) for
        the run, which these events carry as well as many (no log-probs, no timings)."""
        return sse_batches(group, self.add, coalesce=True)

    def add(self, out: list[str], _index: int, ev: Event) -> None:
        """Append the events of one engine event to ``out``: the first progress or text
        opens the message (``message_start``), later progress is a ``ping``; an error
        is Anthropic's ``error`` event."""
        if isinstance(ev, PromptProgress):
            out.append(sse_named(self._start(ev.cache) or [("ping", {"type": "ping"})]))
        elif isinstance(ev, TextChunk):
            d = Delta(content=ev.text) if self.plan.plain else self.parser.feed(ev.text)
            frame = self._text_frame(d)
            if frame is not None:
                out.append(frame.fill(json_str(d.content)))
            else:
                out.append(sse_named(self._start(0) + self._deltas(d)))
        elif isinstance(ev, TaskResult):
            rest = Delta() if self.plan.plain else self.parser.finish()
            out.append(
                sse_named(self._start(ev.timings.cache_n) + self._deltas(rest) + self._end(ev))
            )
        elif isinstance(ev, TaskError):
            body = anthropic_error_body(ev.status, ev.message)
            out.append(sse_named([("error", body)]))

    def _text_frame(self, d: Delta) -> Frame | None:
        """The prebuilt ``text_delta`` frame of the open text block, where ``d`` is only
        more of its text (the message started): the bytes ``_deltas(d)`` would give."""
        if not (self.started and self.open == "text" and d.content) or d.reasoning or d.calls:
            return None
        if self.index not in self.frames:
            delta = self._delta({"type": "text_delta", "text": Frame.hole(0)})
            self.frames[self.index] = Frame.named(*delta, 1)
        return self.frames[self.index]

    def _start(self, cached: int) -> list[Ev]:
        """``message_start``, once: the message without content, the prompt's usage."""
        if self.started:
            return []
        self.started = True
        use = {
            "input_tokens": self.n_prompt - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": 0,
        }
        message: dict[str, object] = {
            "id": self.msg_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": use,
        }
        return [("message_start", {"type": "message_start", "message": message})]

    def _close(self) -> list[Ev]:
        """Close the open block (a thinking block gets its, empty, signature first)."""
        if self.open is None:
            return []
        out: list[Ev] = []
        if self.open == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": ""}))
        out.append(("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.open = None
        return out

    def _open(self, block: dict[str, object]) -> list[Ev]:
        out = self._close()
        self.index += 1
        self.open = str(block["type"])  # each block's "type": a str
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        return [*out, ("content_block_start", start)]

    def _delta(self, delta: dict[str, object]) -> Ev:
        return "content_block_delta", {
            "type": "content_block_delta",
            "index": self.index,
            "delta": delta,
        }

    def _deltas(self, d: Delta) -> list[Ev]:
        """The events of one parser delta: reasoning, text, then tool call pieces."""
        out: list[Ev] = []
        if d.reasoning:
            if self.open != "thinking":
                out += self._open({"type": "thinking", "thinking": "", "signature": ""})
            if not self.omit:
                out.append(self._delta({"type": "thinking_delta", "thinking": d.reasoning}))
        if d.content:
            if self.open != "text":
                out += self._open({"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": d.content}))
        for c in d.calls:
            if c.id is not None:
                self.n_calls += 1
                block: dict[str, object] = {
                    "type": "tool_use",
                    "id": c.id,
                    "name": c.name or "",
                    "input": {},
                }
                out += self._open(block)
            if c.arguments:
                out.append(self._delta({"type": "input_json_delta", "partial_json": c.arguments}))
        return out

    def _end(self, r: TaskResult) -> list[Ev]:
        """The last block closed, the stop reason with the whole usage, the end."""
        reason, sequence = stop_reason(r, self.n_calls > 0)
        delta: dict[str, object] = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage(r),
        }
        return [
            *self._close(),
            ("message_delta", delta),
            ("message_stop", {"type": "message_stop"}),
        ]
