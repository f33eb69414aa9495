"""A model's control tokens as the chat families meet them (llama-server's "preserved
tokens").

Real models of several families have their markers as control tokens, one token each:
gpt-oss (``<|channel|>``, ``<|message|>``, ``<|call|>``, ...), Kimi K2, DeepSeek. Two
things follow, and this module serves both:

- llama.cpp renders a control token as empty text unless asked for its special piece, so
  a parser would never see the markers the model wrote. The markers a request's parser
  reads are rendered as text: ``preserved(template_source)`` names them (the control
  tokens the template writes).
- A grammar's literal text is matched against tokens' text, and a control token has none
  (llguidance marks it special), so a forced call's frame could only spell a marker out in
  other tokens, which the model never does and which llguidance's own tokenization of the
  literal contradicts (a 400 before the fix). ``split`` cuts a literal at control texts so
  the grammar names those tokens by id (``<[id]>``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ControlTokens:
    """``ids``: each control token's text and id (texts that are not empty)."""

    ids: dict[str, int]
    _lengths: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _first: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "_lengths", tuple(sorted({len(t) for t in self.ids}, reverse=True))
        )
        object.__setattr__(self, "_first", frozenset(t[0] for t in self.ids))

    @classmethod
    def of(cls, tokens: Iterable[tuple[str, int]]) -> ControlTokens:
        """From (text, id) pairs; the first id of a text wins, empty texts are left out."""
        ids: dict[str, int] = {}
        for text, tok in tokens:
            if text and text not in ids:
                ids[text] = tok
        return cls(ids)

    def _at(self, text: str, p: int) -> str | None:
        """The longest control text starting at ``p`` (llama.cpp's tokenizer prefers it)."""
        if text[p] not in self._first:
            return None
        for n in self._lengths:
            t = text[p : p + n]
            if len(t) == n and t in self.ids:
                return t
        return None

    def split(self, text: str) -> list[str | int]:
        """``text`` as plain pieces and control token ids, in order (linear in the text for
        a fixed vocabulary: a few lengths are tried where a control text may start)."""
        out: list[str | int] = []
        start = p = 0
        while p < len(text):
            hit = self._at(text, p)
            if hit is None:
                p += 1
                continue
            if p > start:
                out.append(text[start:p])
            out.append(self.ids[hit])
            p = start = p + len(hit)
        if start < len(text):
            out.append(text[start:])
        return out

    def preserved(self, source: str) -> frozenset[int]:
        """The control tokens whose text ``source`` (a chat template) holds: the markers
        its parser reads, rendered as text in the answer."""
        return frozenset(piece for piece in self.split(source) if isinstance(piece, int))


NO_CONTROL = ControlTokens({})
