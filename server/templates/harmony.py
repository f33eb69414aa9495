"""gpt-oss's Harmony output: messages ``<|channel|>C [to=functions.f] [<|constrain|>json]
<|message|>BODY<|end|>`` (or ``<|call|>`` / ``<|return|>``), each after ``<|start|>assistant``
but the first. ``analysis`` is reasoning, ``final`` (and ``commentary`` without a recipient)
is content, a message to ``functions.f`` is a call whose body is its JSON arguments.

Text that never reaches a ``<|message|>`` (a model that does not write Harmony) is content.
As every parser here, any split of a text gives the merged deltas of the whole."""

from __future__ import annotations

import re
from collections.abc import Callable

from ..schemas.json_body import loads_bounded
from .output_parse import CallDelta, Delta, new_call_id, partial_suffix

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
MAX_HEADER = 512  # a header longer than this is no header: the text is content
_RECIPIENT = re.compile(r"to=functions\.([\w.\-]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


class HarmonyParser:
    """Content, reasoning (``analysis``) and calls of a Harmony output. ``reasoning``:
    analysis goes to the reasoning (else to the content, as reasoning_format none has it)."""

    def __init__(self, reasoning: bool = True, new_id: Callable[[], str] = new_call_id) -> None:
        self.reasoning = reasoning
        self.new_id = new_id
        self.buf = ""
        self.header: str | None = ""  # None: inside a message body
        self.kind = "content"  # the open body's destination: content reasoning call plain
        self.name = ""
        self.args = ""
        self.n_calls = 0

    def feed(self, text: str) -> Delta:
        self.buf += text
        out = Delta()
        while self._step(out, False):
            pass
        return out

    def finish(self) -> Delta:
        out = Delta()
        while self._step(out, True):
            pass
        if self.header is None:
            self._end(out)
        out.content += (self.header or "") + self.buf
        self.buf, self.header = "", ""
        return out

    def _step(self, out: Delta, final: bool) -> bool:
        if self.kind == "plain":
            out.content += self.buf
            self.buf = ""
            return False
        if self.header is not None:
            return self._head(out)
        hits = [(i, e) for e in ENDS if (i := self.buf.find(e)) >= 0]
        if hits:
            i, e = min(hits)
            self._body(out, self.buf[:i])
            self.buf = self.buf[i + (0 if e == "<|start|>" else len(e)) :]
            self._end(out)
            return True
        keep = 0 if final else partial_suffix(self.buf, ENDS)
        self._body(out, self.buf[: len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep :]
        return False

    def _head(self, out: Delta) -> bool:
        assert self.header is not None
        self.header += self.buf
        self.buf = ""
        i = self.header.find(MESSAGE)
        if i < 0:
            if len(self.header) > MAX_HEADER:
                out.content += self.header
                self.header, self.kind = None, "plain"
            return False
        head, self.buf = self.header[:i], self.header[i + len(MESSAGE) :]
        self.header = None
        channel = _CHANNEL.search(head)
        to = _RECIPIENT.search(head)
        if to:
            self.kind, self.name, self.args = "call", to.group(1), ""
        elif channel and channel.group(1) == "analysis" and self.reasoning:
            self.kind = "reasoning"
        else:
            self.kind = "content"
        return True

    def _body(self, out: Delta, text: str) -> None:
        if self.kind == "call":
            self.args += text
        elif self.kind == "reasoning":
            out.reasoning += text
        else:
            out.content += text

    def _end(self, out: Delta) -> None:
        """The message ended: a call is released (its arguments must be a JSON object of a
        bounded depth, else the message is content); the next header starts."""
        if self.kind == "call":
            try:
                ok = isinstance(loads_bounded(self.args), dict)
            except ValueError:  # not JSON, or too deep (TooDeep): kept as text
                ok = False
            if ok:
                out.calls.append(CallDelta(self.n_calls, self.new_id(), self.name, self.args))
                self.n_calls += 1
            else:
                out.content += self.args
        self.header, self.kind, self.args = "", "content", ""
