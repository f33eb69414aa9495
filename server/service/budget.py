"""A request's reasoning budget: llama-server's ``reasoning_budget_tokens`` (chat alias
``thinking_budget_tokens``, Anthropic's ``thinking.budget_tokens``; -1: the server's
--reasoning-budget), its message (--reasoning-budget-message) and the tags it works
between (the template's, server.templates.reasoning_tags, or the request's
``reasoning_budget_start_tag`` / ``reasoning_budget_end_tags``). The engine enforces it
(server.slot.reasoning_budget)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..engine_api import Tokenizer
from ..schemas.bodies import SamplingFields
from ..schemas.errors import APIError
from ..settings.config import Settings
from ..task import ReasoningBudget
from ..templates.reasoning_tags import ReasoningTags


def _never() -> bool:
    return False


@dataclass(frozen=True)
class BudgetAsk:
    """A budget before tokenizing: ``opened()`` tells, once the prompt is rendered, whether
    it ended inside the reasoning (the template opened it)."""

    tokens: int
    start: str
    end: str
    message: str
    opened: Callable[[], bool] = _never

    def resolve(self, tok: Tokenizer) -> ReasoningBudget:
        """The engine's budget: the message and end tag as the tokens to force (special
        tokens parsed, as llama-server tokenizes them). Call after rendering the prompt."""
        forced = tok.tokenize(self.message, False, True) if self.message else []
        forced += tok.tokenize(self.end, False, True)
        return ReasoningBudget(
            self.tokens, self.start.encode(), self.end.encode(), tuple(forced), self.opened()
        )


def budget_ask(
    body: SamplingFields,
    settings: Settings,
    tags: ReasoningTags | None,
    opened: Callable[[], bool] = _never,
    chat: bool = True,
) -> BudgetAsk | None:
    """The budget ``body`` runs under (None: unlimited, or nothing to limit). ``tags``: the
    chat template's (None where it has no reasoning). Without a template (``chat`` false:
    /completion, /v1/completions, /infill) a request names the tags itself: APIError 400
    naming the missing one when it asks for a budget."""
    given = body.reasoning_budget_tokens
    if given is None:
        given = body.thinking_budget_tokens
    n = settings.reasoning_budget if given in (None, -1) else given
    assert n is not None  # --reasoning-budget is an int
    if n < 0:
        return None
    ends = [t for t in body.reasoning_budget_end_tags or [] if t]
    ends += [body.reasoning_budget_end_tag] if body.reasoning_budget_end_tag else []
    start = body.reasoning_budget_start_tag or (tags.start if tags else "")
    end = ends[0] if ends else (tags.end if tags else "")
    if not start or not end:
        if not chat and given not in (None, -1):
            field = "reasoning_budget_start_tag" if not start else "reasoning_budget_end_tags"
            raise APIError(400, f"reasoning_budget_tokens without a template needs {field}")
        return None  # the template has no reasoning: nothing to limit
    message = body.reasoning_budget_message
    if message is None:
        message = settings.reasoning_budget_message or ""
    return BudgetAsk(n, start, end, message, opened)
