"""Each API body as the one typed engine request (``service.submit.Submission``): its
prompt source (``sources``) and how its tasks run. Routes call one of these, then
``service.submit``; the answer's shape stays theirs."""

from __future__ import annotations

from dataclasses import replace

from ..schemas.anthropic_bodies import MessagesRequest
from ..schemas.bodies import (
    ChatRequest,
    CompletionRequest,
    InfillRequest,
    NativeCompletionRequest,
    SamplingFields,
)
from ..service.budget import BudgetAsk, budget_ask
from ..service.state import ServerState
from ..service.submit import PromptSource, Submission
from ..templates.chat_plan import ChatPlan
from ..templates.reasoning_tags import reasoning_tags
from .completion import max_tokens_of
from .sources import ChatSource, CompletionSource


def chat_budget(st: ServerState, chat: ChatRequest, plan: ChatPlan) -> BudgetAsk | None:
    """A chat request's reasoning budget, between its template's reasoning tags."""
    tags = reasoning_tags(st.template.source) if st.template is not None else None
    return budget_ask(chat, st.settings, tags, lambda: plan.forced_open)


def text_budget(st: ServerState, body: SamplingFields, prompt: object) -> BudgetAsk | None:
    """The reasoning budget of a request without a template (tags of its own): open at
    once where a text ``prompt`` ends with the start tag (a chat prompt rendered by the
    client), else where the output writes it."""
    ask = budget_ask(body, st.settings, None, chat=False)
    if ask is None or not isinstance(prompt, str) or not prompt.rstrip().endswith(ask.start):
        return ask
    return replace(ask, opened=_opened)


def _opened() -> bool:
    return True


def completion_request(st: ServerState, body: CompletionRequest) -> Submission:
    """/v1/completions: every prompt ``n`` times, choices prompt-major."""
    return Submission(
        source=CompletionSource(st, body),
        max_tokens=max_tokens_of(body.max_tokens, body.n_predict),
        stream=body.stream,
        n_probs=body.logprobs or 0,
        logprobs=body.logprobs is not None,
        n=body.n,
        return_progress=body.return_progress,
        timings_per_token=body.timings_per_token,
        post_sampling=body.post_sampling_probs,
        budget=text_budget(st, body, body.prompt),
    )


def chat_request(st: ServerState, body: ChatRequest, plan: ChatPlan) -> Submission:
    """/v1/chat/completions: the rendered conversation, ``n`` choices."""
    return Submission(
        source=ChatSource(st, body, plan, openai=True),
        max_tokens=max_tokens_of(body.max_completion_tokens, body.max_tokens, body.n_predict),
        stream=body.stream,
        n_probs=body.top_logprobs or 0,
        logprobs=body.logprobs,
        n=body.n,
        return_progress=body.return_progress,
        timings_per_token=body.timings_per_token,
        post_sampling=body.post_sampling_probs,
        budget=chat_budget(st, body, plan),
        preserved=plan.preserved,
    )


def messages_request(
    st: ServerState, body: MessagesRequest, chat: ChatRequest, plan: ChatPlan
) -> Submission:
    """Anthropic's /v1/messages, run as its chat request ``chat``. The first progress event
    opens the stream (the cached share is known then); later ones are pings while a long
    prompt is processed."""
    return Submission(
        source=ChatSource(st, chat, plan),
        max_tokens=body.max_tokens,
        stream=body.stream,
        return_progress=body.stream,
        budget=chat_budget(st, chat, plan),  # thinking.budget_tokens
        preserved=plan.preserved,
    )


def responses_request(st: ServerState, chat: ChatRequest, plan: ChatPlan) -> Submission:
    """OpenAI's /v1/responses, run as its chat request ``chat``."""
    return Submission(
        source=ChatSource(st, chat, plan),
        max_tokens=max_tokens_of(chat.max_completion_tokens, chat.max_tokens, chat.n_predict),
        stream=chat.stream,
        return_progress=chat.return_progress,
        timings_per_token=chat.timings_per_token,
        budget=chat_budget(st, chat, plan),
        preserved=plan.preserved,
    )


def native_request(
    st: ServerState, body: NativeCompletionRequest | InfillRequest, source: PromptSource
) -> Submission:
    """llama-server's /completion and /infill (``source``: NativeSource or InfillSource).
    /completion's aliases: ``max_completion_tokens`` (before ``max_tokens``) and ``logprobs``
    for ``n_probs``."""
    limit = getattr(body, "max_completion_tokens", None)
    n_probs = body.n_probs or getattr(body, "logprobs", None) or 0
    return Submission(
        source=source,
        max_tokens=max_tokens_of(limit, body.max_tokens, body.n_predict),
        stream=body.stream,
        n_probs=n_probs,
        logprobs=n_probs > 0,
        return_progress=body.return_progress,
        timings_per_token=body.timings_per_token,
        post_sampling=body.post_sampling_probs,
        budget=text_budget(st, body, body.prompt),
    )
