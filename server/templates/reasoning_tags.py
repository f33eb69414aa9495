"""Which tags open and close a chat template's reasoning: the one lookup the reasoning
budget (server.service.budget) forces the end tag from. The tags are the template's
tool-call family's (``<think>``, ``[THINK]``, ``<seed:think>``, ...: server.templates.families
holds the one table); this module gives them the budget's shape."""

from __future__ import annotations

from dataclasses import dataclass

from . import families


@dataclass(frozen=True)
class ReasoningTags:
    """The text that opens a template's reasoning block and the text that ends it; the
    budget writes ``end`` (after its message) when the budget is spent."""

    start: str
    end: str


def reasoning_tags(template_source: str) -> ReasoningTags | None:
    """The reasoning tags of the template whose Jinja source is ``template_source``: its
    tool-call family's (server.templates.families, the one table of families), None when
    the template opens no reasoning block this server knows."""
    start, end = families.reasoning_tags(template_source)
    return ReasoningTags(start, end) if start in template_source else None
