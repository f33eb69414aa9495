"""Incremental JSON scanning for tool-call parsers: where a value or a call object ends in
text that arrives piece by piece. Only structure is checked (brackets, strings, the call
object's keys); arguments are passed on as the model wrote them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

WS = " \t\r\n"
# the keys that hold a call's arguments: OpenAI/Hermes/Mistral, Llama 3.x
ARG_KEYS = ("arguments", "parameters")


class ValueScanner:
    """Finds the end of one JSON value (object, array, string or scalar) fed in pieces.

    ``feed`` returns how many characters of its input belong to the value; ``done`` turns
    true at the value's last character (a scalar ends at the delimiter after it, which is
    not consumed). Leading whitespace is consumed and not part of ``raw``."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_str = False
        self.esc = False
        self.kind = ""  # "{" "[" '"' or "s" (scalar), once the first character is seen
        self.done = False

    def feed(self, s: str) -> int:
        i, n = 0, len(s)
        while i < n and not self.done:
            c = s[i]
            if not self.kind:
                if c in WS:
                    i += 1
                    continue
                self.kind = c if c in '{["' else "s"
                self.in_str = c == '"'
                self.depth = 1 if c in "{[" else 0
                i += 1
                continue
            if self.kind == "s":
                if c in ",}] \t\r\n":
                    self.done = True
                    return i
                i += 1
                continue
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
                    if self.kind == '"':
                        self.done = True
                i += 1
                continue
            if c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
            i += 1
        return i


@dataclass
class CallEvents:
    """What one ``CallReader.feed`` found: the function name (once), argument fragments."""

    name: str | None = None
    args: list[str] = field(default_factory=list)


class CallReader:
    """Reads one call object ``{"name": "f", "arguments": {...}}`` (keys in any order, other
    keys skipped, ``parameters`` accepted for ``arguments``) from text fed in pieces.

    The name is reported once it is complete; argument text is reported as it arrives, but
    only after the name (fragments that come first are held). Arguments written as a JSON
    string are decoded and reported whole. ``state`` ends as "done" or "bad"; ``first_key``
    is the object's first key once read (bare call formats check it before committing)."""

    def __init__(self) -> None:
        self.state = "open"  # open key colon value after done bad
        self.first_key: str | None = None
        self.name: str | None = None
        self._key = ""
        self._cur = ""  # the key being read / the name or string arguments being read
        self._esc = False
        self._scan: ValueScanner | None = None
        self._held: list[str] = []  # argument text seen before the name
        self.had_args = False

    def _fail(self) -> int:
        self.state = "bad"
        return 0

    def feed(self, s: str) -> tuple[int, CallEvents]:
        """Consume a prefix of ``s``; returns (characters consumed, events)."""
        ev = CallEvents()
        i, n = 0, len(s)
        while i < n and self.state not in ("done", "bad"):
            i += self._step(s, i, ev)
        return i, ev

    def _step(self, s: str, i: int, ev: CallEvents) -> int:
        st, c = self.state, s[i]
        if st in ("open", "colon", "after") or (st == "key" and not self._cur):
            if c in WS:
                return 1
            if st == "open":
                if c != "{":
                    return self._fail()
                self.state = "key"
                return 1
            if st == "colon":
                if c != ":":
                    return self._fail()
                self.state, self._scan = "value", None
                return 1
            if st == "after":
                if c == ",":
                    self.state = "key"
                elif c == "}":
                    self._finish(ev)
                else:
                    return self._fail()
                return 1
            # key, nothing read yet
            if c == "}" and self.first_key is None:
                return self._fail()  # an empty object is no call
            if c != '"':
                return self._fail()
            self._cur, self._esc = '"', False
            return 1
        if st == "key":
            return self._string_step(s, i, self._key_done)
        return self._value_step(s, i, ev)

    def _string_step(self, s: str, i: int, done) -> int:  # noqa: ANN001
        """Read string characters into ``_cur`` up to the closing quote."""
        j = i
        while j < len(s):
            c = s[j]
            self._cur += c
            j += 1
            if self._esc:
                self._esc = False
            elif c == "\\":
                self._esc = True
            elif c == '"':
                done()
                break
        return j - i

    def _key_done(self) -> None:
        try:
            self._key = json.loads(self._cur)
        except ValueError:
            self.state = "bad"
            return
        if self.first_key is None:
            self.first_key = self._key
        self._cur = ""
        self.state = "colon"

    def _value_step(self, s: str, i: int, ev: CallEvents) -> int:
        key = self._key
        if self._scan is None and not self._cur:
            c = s[i]
            if c in WS:
                return 1
            if key == "name" or (key in ARG_KEYS and c == '"'):
                if c != '"':
                    return self._fail()
                self._cur, self._esc = '"', False
                return 1
            self._scan = ValueScanner()
        if self._cur:
            return self._string_step(s, i, lambda: self._string_value_done(ev))
        scan = self._scan
        assert scan is not None
        used = scan.feed(s[i:])
        if key in ARG_KEYS:
            self.had_args = True
            self._args(ev, s[i : i + used])
        if scan.done:
            self._scan, self.state = None, "after"
        return used

    def _string_value_done(self, ev: CallEvents) -> None:
        try:
            value = json.loads(self._cur)
        except ValueError:
            self.state = "bad"
            return
        self._cur = ""
        self.state = "after"
        if self._key == "name":
            if not isinstance(value, str) or self.name is not None:
                self.state = "bad"
                return
            self.name = ev.name = value
            ev.args.extend(self._held)
            self._held = []
        else:  # arguments given as a JSON string
            self.had_args = True
            self._args(ev, value)

    def _args(self, ev: CallEvents, text: str) -> None:
        if not text:
            return
        if self.name is None:
            self._held.append(text)
        else:
            ev.args.append(text)

    def _finish(self, ev: CallEvents) -> None:
        if self.name is None:
            self.state = "bad"
            return
        if not self.had_args:
            ev.args.append("{}")
        self.state = "done"
