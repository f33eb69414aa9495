"""The ``PromptSource`` of each kind of API body (service.submit): how its prompts become
tokens, its output constraint and its own body checks. Each is a frozen value holding the
request's state and body, so ``service.submit`` never calls back into a route."""

from __future__ import annotations

from dataclasses import dataclass

from ..constrained import Constraint
from ..schemas.bodies import ChatRequest, CompletionRequest, InfillRequest, NativeCompletionRequest
from ..schemas.errors import APIError
from ..service.state import ServerState
from ..service.submit import Prompt
from ..service.validation import constraint_of
from ..templates.chat_plan import ChatPlan
from .chat import chat_constraint, render_chat
from .completion import completion_prompts, infill_prompts, native_prompts


@dataclass(frozen=True)
class ChatSource:
    """A chat-shaped body (OpenAI chat; Anthropic and Responses as their chat request):
    the template's rendering of ``body`` as ``plan`` says. ``openai``: OpenAI's own check
    (top_logprobs needs logprobs)."""

    st: ServerState
    body: ChatRequest
    plan: ChatPlan
    openai: bool = False

    def prompts(self) -> list[Prompt]:
        return [render_chat(self.st, self.body, self.plan)]

    def constraint(self) -> Constraint | None:
        return chat_constraint(self.plan, self.body)

    def check(self) -> None:
        if self.openai and self.body.top_logprobs and not self.body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true")


@dataclass(frozen=True)
class CompletionSource:
    """OpenAI's /v1/completions: every prompt of the body's ``prompt``."""

    st: ServerState
    body: CompletionRequest

    def prompts(self) -> list[Prompt]:
        return completion_prompts(self.st, self.body.prompt)

    def constraint(self) -> Constraint | None:
        return constraint_of(json_schema=self.body.json_schema, grammar=self.body.grammar)

    def check(self) -> None:
        if self.body.echo and self.body.logprobs is not None:
            raise APIError(400, "echo with logprobs is not supported (no prompt log-probabilities)")


@dataclass(frozen=True)
class NativeSource:
    """llama-server's /completion: each of its prompt forms (``raw``: split_prompts')."""

    st: ServerState
    body: NativeCompletionRequest
    raw: list[object]

    def prompts(self) -> list[Prompt]:
        return native_prompts(self.st, self.raw)

    def constraint(self) -> Constraint | None:
        return constraint_of(json_schema=self.body.json_schema, grammar=self.body.grammar)

    def check(self) -> None:
        return None


@dataclass(frozen=True)
class InfillSource:
    """llama-server's /infill: the FIM prompt of the body (``extra``: its checked
    input_extra)."""

    st: ServerState
    body: InfillRequest
    extra: list[dict[str, str]]

    def prompts(self) -> list[Prompt]:
        return infill_prompts(self.st, self.body, self.extra)

    def constraint(self) -> Constraint | None:
        return constraint_of(json_schema=self.body.json_schema, grammar=self.body.grammar)

    def check(self) -> None:
        return None
