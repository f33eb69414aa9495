"""Incremental detokenization with stop strings: a possible stop prefix is held back."""

from __future__ import annotations

import codecs
from typing import NamedTuple


class Release(NamedTuple):
    text: str  # text that can be sent now
    stop: str  # the stop string that matched ("" if none); generation ends when set


class TextStream:
    """Feeds token bytes, releases text that can no longer be part of a stop string.

    Invariant: ``held`` is the shortest suffix of the generated text that is still a
    proper prefix of some stop string (or an incomplete UTF-8 sequence in the decoder).
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._max = max((len(s) for s in self.stops), default=0)
        self._dec: codecs.BufferedIncrementalDecoder = codecs.getincrementaldecoder("utf-8")(
            "replace"
        )
        self.held = ""

    def feed(self, piece: bytes) -> str:
        """The text ``piece`` completes (an incomplete UTF-8 sequence waits in the decoder);
        what ``push`` releases when there are no stop strings, without its ``Release``: the
        per-token path of most runs (bench/step_cost.py)."""
        dec = self._dec
        if not dec.buffer and piece.isascii():  # nothing pending: the decoder would agree
            return piece.decode("ascii")
        return dec.decode(piece)

    def push(self, piece: bytes) -> Release:
        if not self.stops:  # nothing is ever held back then (``held`` stays "")
            return Release(self.feed(piece), "")
        text = self.held + self.feed(piece)
        first = -1
        word = ""
        for s in self.stops:
            i = text.find(s)
            if i >= 0 and (first < 0 or i < first):
                first, word = i, s
        if first >= 0:
            self.held = ""
            return Release(text[:first], word)
        keep = self._partial_suffix(text)
        self.held = text[len(text) - keep :] if keep else ""
        return Release(text[: len(text) - keep], "")

    def flush(self) -> str:
        """Text still held at the end of generation (no stop matched): it belongs to the output."""
        rest = self.held + self._dec.decode(b"", final=True)
        self.held = ""
        return rest

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        upto = min(len(text), self._max - 1)
        for k in range(upto, 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
