"""llama-server's /apply-template (the prompt a chat request is rendered to) and
/v1/chat/completions/input_tokens (its length in tokens), without generating. The rendering
is /v1/chat/completions' own (tools, tool history, reasoning switches and
chat_template_kwargs included), so the text is what the model would read."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..json_value import JsonObject
from ..prompts.chat import media_input, plan_chat, render_chat, render_prompt
from ..schemas.bodies import ChatRequest
from ..service.state import ServerState
from ..templates.chat_plan import ChatPlan
from .common import prep, state_of

router = APIRouter()


class ApplyTemplateRequest(ChatRequest):
    """A chat body (``add_generation_prompt`` and ``continue_final_message`` included)."""


def render_text(st: ServerState, body: ChatRequest, plan: ChatPlan | None = None) -> str:
    """The chat template's text for ``body``, as /v1/chat/completions renders it (APIError
    400 when the template rejects the messages, 500 when the template itself fails); an
    image is its media marker (checked as a chat request's, with --mmproj)."""
    return render_prompt(st, body, plan or plan_chat(st, body), media_input(st)).prompt


def _n_tokens(st: ServerState, body: ChatRequest) -> int:
    return len(render_chat(st, body, plan_chat(st, body)).tokens)


@router.post("/apply-template")
async def apply_template(body: ApplyTemplateRequest, request: Request) -> JsonObject:
    """``{"prompt": text}``: the rendered conversation, nothing generated."""
    st = state_of(request)
    # requires the engine (the template comes with the model); checks tool schemas: off the loop
    return {"prompt": await prep(request, render_text, st, body)}


@router.post("/v1/chat/completions/input_tokens")
@router.post("/chat/completions/input_tokens")
async def chat_input_tokens(body: ChatRequest, request: Request) -> JsonObject:
    """llama-server's token count of a chat body: the tokens its prompt feeds the model."""
    st = state_of(request)
    n = await prep(request, _n_tokens, st, body)  # checks tool schemas: off the loop
    return {"input_tokens": n, "object": "response.input_tokens"}
