"""Which tags open and close a chat template's reasoning: the one lookup the reasoning
budget (server.service.budget) forces the end tag from. ``reasoning_tags`` reads the
template's source; a family with its own reasoning syntax (Harmony's channels, ``[THINK]``,
``<seed:think>``) adds a row to ``FAMILIES`` (first match wins, so put the more specific
markers first)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningTags:
    """The text that opens a template's reasoning block and the text that ends it; the
    budget writes ``end`` (after its message) when the budget is spent."""

    start: str
    end: str


# (a marker found in the template's source, its tags), most specific first
FAMILIES: tuple[tuple[str, ReasoningTags], ...] = (
    ("<seed:think>", ReasoningTags("<seed:think>", "</seed:think>")),
    ("[THINK]", ReasoningTags("[THINK]", "[/THINK]")),
    ("<think>", ReasoningTags("<think>", "</think>")),
)


def reasoning_tags(template_source: str) -> ReasoningTags | None:
    """The reasoning tags of the template whose Jinja source is ``template_source``; None
    when it has no reasoning block this server knows."""
    for marker, tags in FAMILIES:
        if marker in template_source:
            return tags
    return None
