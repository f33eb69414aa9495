"""Incremental parsers for model output: content, reasoning and tool calls.

Every parser is fed text fragments (``feed``) and ends with ``finish``; each call returns a
``Delta``. Decisions wait until enough text has arrived (a fragment that may be the start of
a marker is held back), so the merged deltas of any split of a text equal those of the
whole text fed at once: streaming and non-streaming give the same message.

Formats (``ToolFormat``), one call ``C = {"name": "f", "arguments": {...}}``:

- hermes:  ``<tool_call>C</tool_call>`` anywhere in the text (Hermes 2/3, Qwen 2.5/3);
- llama3:  ``C`` (``"parameters"`` for ``"arguments"``) at the start of the output, after
  an optional ``<|python_tag|>``; several separated by ``;`` or whitespace (Llama 3.1-3.3);
- mistral: ``[TOOL_CALLS][C, ...]`` or ``[TOOL_CALLS]f[ARGS]{...}``; ``[TOOL_CALLS]`` is a
  control token that is not rendered in the text, so ``[C, ...]`` at the start of the output
  counts too (Mistral Nemo, Small, Devstral, Ministral);
- generic: ``{"tool_calls": [C, ...]}`` as the whole output, the
  form this server asks for in the system prompt of templates without tool support.
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ..json_value import JsonObject
from .jsonscan import WS, CallReader


class ToolFormat(str, enum.Enum):
    HERMES = "hermes"
    LLAMA3 = "llama3"
    MISTRAL = "mistral"
    GENERIC = "generic"
    FAMILY = "family"  # another family of ``families``: read by ``regions``/``harmony``


@dataclass
class CallDelta:
    """A piece of tool call ``index``: its id and name come first (once), then arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class Delta:
    """What one ``feed``/``finish`` released."""

    content: str = ""
    reasoning: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls)

    def extend(self, other: Delta) -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        for c in other.calls:
            last = self.calls[-1] if self.calls else None
            if last is not None and last.index == c.index and c.id is None:
                last.arguments += c.arguments
            else:
                self.calls.append(CallDelta(c.index, c.id, c.name, c.arguments))


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it

    def as_openai(self) -> JsonObject:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class Message:
    """A whole parsed message (the merge of every delta)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, d: Delta) -> None:
        self.content += d.content
        self.reasoning += d.reasoning
        for c in d.calls:
            if c.index == len(self.tool_calls):
                self.tool_calls.append(ToolCall(c.id or "", c.name or "", ""))
            self.tool_calls[c.index].arguments += c.arguments


_ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def new_call_id() -> str:
    """OpenAI-style call id: ``call_`` and 24 random alphanumerics."""
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


def new_mistral_id() -> str:
    """Mistral's templates accept only 9 alphanumerics as a call id (and check it)."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


@dataclass(frozen=True)
class _Spec:
    """How a format wraps its calls (see the module docstring)."""

    markers: tuple[str, ...]  # open a call block anywhere in the content
    bare: bool  # a block may also open at the start of the output without a marker
    head: tuple[str, ...]  # tokens (whitespace between) after the opener
    sep: str  # separates calls in a block ("" : one call per block)
    tail: tuple[str, ...]  # tokens that close the block
    bare_keys: tuple[str, ...] = ()  # a bare block's first call must start with one of these
    name_args: str = ""  # "f[ARGS]{...}" calls after a marker (Mistral v7+)


SPECS = {
    ToolFormat.HERMES: _Spec(("<tool_call>",), False, (), "", ("</tool_call>",)),
    ToolFormat.LLAMA3: _Spec(("<|python_tag|>",), True, (), ";", (), ("name", "type")),
    ToolFormat.MISTRAL: _Spec(("[TOOL_CALLS]",), True, ("[",), ",", ("]",), ("name",), "[ARGS]"),
    ToolFormat.GENERIC: _Spec((), True, ("{", '"tool_calls"', ":", "["), ",", ("]", "}")),
}


_NOT_NAME = set(" \t\r\n\"'[]{}(),:;<>")


def _match_tokens(buf: str, pos: int, tokens: tuple[str, ...]) -> tuple[str, int]:
    """Match ``tokens`` at ``buf[pos:]`` with whitespace between them:
    ("ok", end), ("partial", pos) when ``buf`` ends inside a match, or ("fail", pos)."""
    for tok in tokens:
        while pos < len(buf) and buf[pos] in WS:
            pos += 1
        rest = buf[pos : pos + len(tok)]
        if rest != tok:
            return ("partial" if tok.startswith(rest) else "fail"), pos
        pos += len(tok)
    return "ok", pos


def partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if m.startswith(text[-k:]):
                best = k
                break
    return best


class SteppedParser:
    """A streaming parser run as a state machine over ``buf``: ``_step`` makes one
    transition into a Delta and says whether it could; ``feed`` appends text and steps
    while it can. Subclasses end the output in ``finish`` (``drain(final=True)`` first)."""

    buf: str

    def _step(self, out: Delta, final: bool) -> bool:
        raise NotImplementedError

    def drain(self, final: bool) -> Delta:
        """Every transition ``buf`` allows now (``final``: no more text will come)."""
        out = Delta()
        while self._step(out, final):
            pass
        return out

    def feed(self, text: str) -> Delta:
        self.buf += text
        return self.drain(final=False)


class ToolParser(SteppedParser):
    """Content and tool calls of one output in format ``fmt`` (see the module docstring).

    A block that turns out not to be a call before its name is known goes back to the
    content; once a call's name has been released the call stays, even if the text after
    it breaks the format (it is then reported as far as it went, like a truncated call)."""

    def __init__(self, fmt: ToolFormat, new_id: Callable[[], str] = new_call_id) -> None:
        self.spec = SPECS[fmt]
        self.fmt = fmt
        self.new_id = new_id
        self.buf = ""
        self.mode = "content"  # content head call sep tail
        self.at_start = True  # nothing but whitespace so far: a bare block may open
        self.block = ""  # raw text of the open block, while it may still be content
        self.committed = False  # the open block released a call
        self.reader: CallReader | None = None
        self.n_calls = 0
        self.name_style = False  # reading "f[ARGS]{...}"
        self.skip_ws = False  # drop whitespace that follows a closed block

    # ---- public ----------------------------------------------------------------------

    def finish(self) -> Delta:
        out = self.drain(final=True)
        if self.mode == "content" or not self.committed:
            out.content += self.block + self.buf
        self.buf = self.block = ""
        return out

    # ---- the machine -----------------------------------------------------------------

    def _step(self, out: Delta, final: bool) -> bool:
        """One transition; False when it needs more text."""
        if self.mode == "content":
            return self._content(out, final)
        if self.mode == "head":
            return self._tokens(self.spec.head, out, final, then="call")
        if self.mode == "pick":
            return self._pick(out, final)
        if self.mode == "call":
            return self._call(out, final)
        if self.mode == "sep":
            return self._sep(out, final)
        return self._tokens(self.spec.tail, out, final, then="content")

    def _content(self, out: Delta, final: bool) -> bool:
        if self.skip_ws:
            self.buf = self.buf.lstrip(WS)
            if not self.buf:
                return False
            self.skip_ws = False
        buf = self.buf
        if self.at_start:
            stripped = buf.lstrip(WS)
            if not stripped:
                return False
            if not final and any(m.startswith(stripped) for m in self.spec.markers):
                return False  # a marker or a bare block: not known yet
            if self.spec.bare and not stripped.startswith(self.spec.markers or ("\0",)):
                self.at_start = False
                return self._open(out, buf, len(buf) - len(stripped), len(buf) - len(stripped))
        found = [(buf.find(m), m) for m in self.spec.markers]
        found = [(i, m) for i, m in found if i >= 0]
        if found:
            i, m = min(found)
            self.at_start = False
            return self._open(out, buf, i, i + len(m))
        keep = 0 if final else partial_suffix(buf, self.spec.markers)
        text = buf[: len(buf) - keep]
        # whitespace before a call is no content: hold it until something else follows
        body = text.rstrip(WS)
        if body:
            self.at_start = False
        if final:
            body = text
        out.content += body
        self.buf = buf[len(body) :]
        return False

    def _open(self, out: Delta, buf: str, start: int, after: int) -> bool:
        """A block opens at ``start`` (its marker ends at ``after``); whitespace before it
        is dropped."""
        out.content += buf[:start].rstrip(WS)
        self.block = buf[start:after]
        self.buf = buf[after:]
        self.committed = False
        self.name_style = False
        # after a Mistral marker: "[C, ...]" or "f[ARGS]{...}"
        self.mode = "pick" if self.spec.name_args and start != after else "head"
        return True

    def _pick(self, out: Delta, final: bool) -> bool:
        stripped = self.buf.lstrip(WS)
        if not stripped:
            if final:
                self._abandon(out)
                return True
            return False
        self.name_style = not stripped.startswith("[")
        self.mode = "call" if self.name_style else "head"
        return True

    def _tokens(self, tokens: tuple[str, ...], out: Delta, final: bool, then: str) -> bool:
        status, end = _match_tokens(self.buf, 0, tokens)
        if status == "ok":
            self._take(end)
            if then == "call":
                self.mode = "call"
            else:
                self._closed()
            return True
        if status == "partial" and not final:
            return False
        if status == "partial" and then == "content":
            self._closed()  # a closing tag cut short by the end of the output
            self.buf = ""
            return True
        self._abandon(out)
        return True

    def _closed(self) -> None:
        """The block closed: back to content, whitespace right after it dropped."""
        self.mode = "content"
        self.block = ""
        self.skip_ws = True

    def _take(self, n: int) -> None:
        if not self.committed:
            self.block += self.buf[:n]
        self.buf = self.buf[n:]

    def _abandon(self, out: Delta) -> None:
        """The block is not (or no longer) in the format: its text is content."""
        if not self.committed:
            out.content += self.block
        self.block = ""
        self.mode = "content"
        self.reader = None

    def _call(self, out: Delta, final: bool) -> bool:
        if self.name_style:
            return self._name_call(out, final)
        if self.reader is None:
            self.reader = CallReader()
        r = self.reader
        used, ev = r.feed(self.buf)
        self._take(used)
        bare_bad = (
            not self.committed
            and self.spec.bare_keys
            and r.first_key is not None
            and r.first_key not in self.spec.bare_keys
        )
        if r.state == "bad" or bare_bad:
            self._abandon(out)
            return True
        self._emit(out, ev.name, ev.args)
        if r.state == "done":
            self.reader = None
            self.mode = "sep" if self.spec.sep else "tail"
            return True
        return False

    def _emit(self, out: Delta, name: str | None, args: list[str]) -> None:
        if name is not None:
            self.committed = True
            self.block = ""
            out.calls.append(CallDelta(self.n_calls, self.new_id(), name))
            self.n_calls += 1
        text = "".join(args)
        if text:
            out.calls.append(CallDelta(self.n_calls - 1, arguments=text))

    def _sep(self, out: Delta, final: bool) -> bool:
        buf = self.buf.lstrip(WS)
        if not buf:
            if final:
                self.mode = "content"
            return False
        self.buf = buf
        sep = self.spec.sep
        if buf.startswith(sep):
            self.buf = buf[len(sep) :]
            self.mode = "call"
            return True
        if self.fmt is ToolFormat.LLAMA3:
            if buf.startswith("{"):
                self.mode = "call"
                return True
            if buf.startswith("<|python_tag|>"):
                self.buf = buf[len("<|python_tag|>") :]
                self.mode = "call"
                return True
            if "<|python_tag|>".startswith(buf) and not final:
                return False
        self.mode = "tail"
        return True

    def _name_call(self, out: Delta, final: bool) -> bool:
        """Mistral's ``f[ARGS]{...}``: the name up to ``[ARGS]`` (or the ``{`` of the
        arguments, as the control token may not be rendered), then the arguments."""
        if self.reader is None:
            buf = self.buf
            cuts = [x for x in (buf.find("[ARGS]"), buf.find("{")) if x >= 0]
            cut = min(cuts) if cuts else len(buf) - partial_suffix(buf, ("[ARGS]",))
            name = buf[:cut].strip(WS)
            if any(c in _NOT_NAME for c in name) or len(name) > 256 or (cuts and not name):
                self._abandon(out)
                return True
            if not cuts:
                if final:
                    self._abandon(out)
                    return True
                return False
            skip = cut + (len("[ARGS]") if buf.startswith("[ARGS]", cut) else 0)
            self.reader = CallReader()
            self.reader.name = name
            self.reader.state = "value"
            self.reader._key = "arguments"
            self._take(skip)
            self._emit(out, name, [])
        r = self.reader
        used, ev = r.feed(self.buf)
        self.buf = self.buf[used:]
        self._emit(out, None, ev.args)
        if r.state == "after" or r.state == "bad":
            self.reader = None
            self._closed()
            return True
        return False


class ReasoningSplitter:
    """Splits ``<think>...</think>`` at the start of the output from what follows (the
    ``deepseek`` reasoning format). ``forced_open``: the prompt ended inside an open
    ``<think>`` (the template wrote it), so the output starts in the reasoning. Whitespace
    around the reasoning is dropped."""

    def __init__(
        self, forced_open: bool = False, tags: tuple[str, str] = ("<think>", "</think>")
    ) -> None:
        self.OPEN, self.CLOSE = tags  # the family's reasoning tags (families.reasoning_tags)
        self.mode = "think" if forced_open else "start"
        self.buf = ""
        self.skip_ws = True

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) released by ``text``."""
        self.buf += text
        reasoning = content = ""
        while True:
            if self.mode == "start":
                stripped = self.buf.lstrip(WS)
                if stripped.startswith(self.OPEN):
                    self.buf = stripped[len(self.OPEN) :]
                    self.mode, self.skip_ws = "think", True
                    continue
                if not final and self.OPEN.startswith(stripped):
                    return reasoning, content  # "" or a prefix of <think>: wait
                self.mode, self.skip_ws = "after", False
                continue
            if self.skip_ws:
                self.buf = self.buf.lstrip(WS)
                if not self.buf and not final:
                    return reasoning, content
                self.skip_ws = False
            if self.mode == "after":
                content, self.buf = content + self.buf, ""
                return reasoning, content
            i = self.buf.find(self.CLOSE)
            if i >= 0:
                reasoning += self.buf[:i].rstrip(WS)
                self.buf = self.buf[i + len(self.CLOSE) :]
                self.mode, self.skip_ws = "after", True
                continue
            # held back: a possible start of </think>, and trailing whitespace (dropped if
            # </think> follows, and at the end)
            keep = 0 if final else partial_suffix(self.buf, (self.CLOSE,))
            body = self.buf[: len(self.buf) - keep].rstrip(WS)
            reasoning += body
            self.buf = "" if final else self.buf[len(body) :]
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        return self.feed("", final=True)


class CallParser(Protocol):
    """What reads calls out of the content: ``ToolParser``, ``regions.RegionParser``,
    ``harmony.HarmonyParser``."""

    n_calls: int

    def feed(self, text: str) -> Delta: ...

    def finish(self) -> Delta: ...


class OutputParser:
    """The chat output pipeline: reasoning split (when enabled), then tool calls (when a
    format is given, or a ``calls`` parser), else plain content."""

    def __init__(
        self,
        tool_format: ToolFormat | None = None,
        *,
        reasoning: bool = False,
        forced_open: bool = False,
        new_id: Callable[[], str] = new_call_id,
        calls: CallParser | None = None,
        tags: tuple[str, str] = ("<think>", "</think>"),
    ) -> None:
        self.splitter = ReasoningSplitter(forced_open, tags) if reasoning else None
        self.tools: CallParser | None = calls
        if calls is None and tool_format is not None:
            self.tools = ToolParser(tool_format, new_id)

    def _route(self, reasoning: str, content: str, final: bool) -> Delta:
        if self.tools is None:
            return Delta(content=content, reasoning=reasoning)
        d = self.tools.feed(content)
        if final:
            d.extend(self.tools.finish())
        d.reasoning = reasoning + d.reasoning  # a calls parser may read reasoning too
        return d

    def feed(self, text: str) -> Delta:
        if self.splitter is None:
            return self._route("", text, False)
        r, c = self.splitter.feed(text)
        return self._route(r, c, False)

    def finish(self) -> Delta:
        if self.splitter is None:
            return self._route("", "", True)
        r, c = self.splitter.finish()
        return self._route(r, c, True)


def parse_message(text: str, parser: OutputParser) -> Message:
    """The whole message of ``text`` (non-streaming: one feed, then finish)."""
    m = Message()
    m.add(parser.feed(text))
    m.add(parser.finish())
    return m
