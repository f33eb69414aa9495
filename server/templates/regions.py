"""Tool calls of the families in ``families`` (XML parameters, special-token sections, JSON
lists, pythonic calls): one parser driven by each family's data.

The output is content until a family's opening marker; from there the text is a region of
calls, held until its closing marker (or the end of the output), then read whole: each call
is released as one delta (id, name and arguments together, which the OpenAI SDK assembles
like any other). A region that holds no readable call goes back to the content, markers and
all, so nothing the model wrote is lost and nothing raises. Feeding any split of a text gives
the merged deltas of the whole text: decisions wait for the marker or the region's end.

Work per fed fragment is linear in it: the search for the closing marker resumes where it
left off (``scanned``)."""

from __future__ import annotations

import ast
import json
from collections.abc import Callable

from ..json_value import JsonObject, JsonValue
from ..schemas.json_body import MAX_DEPTH, json_depth, loads_bounded
from .families import Family
from .jsonscan import WS
from .output_parse import CallDelta, Delta, SteppedParser, new_call_id, partial_suffix

MAX_REGION = 1 << 20  # a region longer than this is content: bounded work on any output


def _json_value(text: str) -> JsonValue:
    """A parameter value: JSON when it reads as JSON (of a bounded depth), else the text as a
    string."""
    try:
        return loads_bounded(text)
    except ValueError:
        return text


def _params(fam: Family, body: str) -> JsonObject:
    assert fam.param is not None
    out: JsonObject = {}
    for m in fam.param.finditer(body):
        g = m.groupdict()
        value = g["value"]
        raw = g.get("str") == "true" or g.get("type") == "string"
        out[g["key"].strip()] = value if raw else _json_value(value)
    return out


def _from_json(fam: Family, body: str) -> list[tuple[str, object]]:
    """Calls in a JSON body: objects, lists of objects, or several in a row."""
    dec = json.JSONDecoder()
    items: list[object] = []
    pos, body = 0, body.strip().removeprefix("```json").strip()
    while pos < len(body):
        while pos < len(body) and body[pos] in WS + ",;":
            pos += 1
        if pos >= len(body) or body.startswith("```", pos):
            break
        value, pos = dec.raw_decode(body, pos)
        items.extend(value if isinstance(value, list) else [value])
    calls: list[tuple[str, object]] = []
    for it in items:
        if not isinstance(it, dict):
            raise ValueError("a call is not an object")
        if not fam.name_key:  # {name: arguments}
            calls.extend(it.items())
            continue
        inner = it.get("function")
        fn: JsonObject = inner if isinstance(inner, dict) else it
        name = fn.get(fam.name_key) or fn.get("name")
        args = fn.get(fam.args_key, fn.get("arguments", fn.get("parameters", {})))
        if not isinstance(name, str):
            raise ValueError("a call has no name")
        calls.append((name, args))
    return calls


def _from_python(body: str) -> list[tuple[str, object]]:
    """``[f(a=1, b="x"), ...]``: parsed, never run (literals only)."""
    tree = ast.parse(body.strip(), mode="eval").body
    nodes = tree.elts if isinstance(tree, ast.List | ast.Tuple) else [tree]
    calls: list[tuple[str, object]] = []
    for n in nodes:
        if not isinstance(n, ast.Call) or not isinstance(n.func, ast.Name | ast.Attribute):
            raise ValueError("not a call")
        name = ast.unparse(n.func)
        calls.append((name, {k.arg: ast.literal_eval(k.value) for k in n.keywords if k.arg}))
    return calls


def _from_gemma(body: str) -> JsonObject:
    """Gemma 4's ``{k:<|"|>text<|"|>,n:2}``: strings quoted by ``<|"|>``, keys bare."""
    parts = body.split('<|"|>')
    out = []
    for i, p in enumerate(parts):
        if i % 2:
            out.append(json.dumps(p))
        else:
            out.append(_quote_keys(p))
    value = loads_bounded("".join(out))
    if not isinstance(value, dict):
        raise ValueError("not an object")
    return value


def _quote_keys(text: str) -> str:
    """Bare keys (``{k:`` / ``,k:``) quoted."""
    out, i = [], 0
    while i < len(text):
        c = text[i]
        out.append(c)
        i += 1
        if c in "{,":
            j = text.find(":", i)
            key = text[i:j] if j > 0 else ""
            if key and key.strip().isidentifier():
                out.append(json.dumps(key.strip()))
                i = j
    return "".join(out)


def read_region(fam: Family, region: str) -> list[tuple[str, str, str]]:
    """(name, arguments JSON text, id) of every call in ``region`` (id: what the model wrote
    as the call's id, where the family writes one, else ""); ValueError when none can be
    read (the region is then content)."""
    assert fam.call is not None
    calls: list[tuple[str, str, str]] = []
    for m in fam.call.finditer(region):
        g = m.groupdict()
        if fam.body == "json":
            pairs = _from_json(fam, g["body"])
        elif fam.body == "python":
            pairs = _from_python(g["body"])
        elif fam.body == "gemma":
            pairs = [(g["name"], _from_gemma(g["body"]))]
        elif g.get("args") is not None:
            args = g["args"].strip()
            if not isinstance(loads_bounded(args), dict):
                raise ValueError("arguments are not an object")
            calls.append((g["name"].strip(), args, (g.get("id") or "").strip()))
            continue
        else:
            pairs = [(g["name"].strip(), _params(fam, g["body"]))]
        for name, args in pairs:
            if not isinstance(args, dict):
                raise ValueError("arguments are not an object")
            # as deep as a body this server reads, at most: deeper, the region is content
            # (what reads the arguments again, as Anthropic's ``input``, never recurses)
            if json_depth(args, MAX_DEPTH) > MAX_DEPTH:
                raise ValueError("arguments nest too deep")
            calls.append((name, json.dumps(args, ensure_ascii=False), ""))
    if not calls:
        raise ValueError("no call")
    return calls


class RegionParser(SteppedParser):
    """Content and calls of one output in family ``fam`` (see the module docstring)."""

    def __init__(self, fam: Family, new_id: Callable[[], str] = new_call_id) -> None:
        self.fam = fam
        self.new_id = new_id
        self.buf = ""
        self.region: str | None = None  # the open region's text (marker included)
        self.scanned = 0  # region[:scanned] holds no closing marker
        self.n_calls = 0
        self.skip_ws = False  # drop whitespace that follows a region

    def finish(self) -> Delta:
        out = self.drain(final=True)
        if self.region is not None:
            self._close(out, self.region)
        out.content += self.buf
        self.buf = ""
        return out

    def _step(self, out: Delta, final: bool) -> bool:
        if self.region is None:
            return self._content(out, final)
        self.region += self.buf
        self.buf = ""
        closes = self.fam.closes
        hits = [(i, c) for c in closes if (i := self.region.find(c, self.scanned)) >= 0]
        if hits:
            i, c = min(hits)
            end = i + len(c)
            region, self.buf = self.region[:end], self.region[end:]
            self._close(out, region)
            return True
        longest = max((len(c) for c in closes), default=1)
        self.scanned = max(0, len(self.region) - longest)
        if len(self.region) > MAX_REGION:
            out.content += self.region
            self.region = None
        return False

    def _content(self, out: Delta, final: bool) -> bool:
        if self.skip_ws:
            self.buf = self.buf.lstrip(WS)
            if not self.buf:
                return False
            self.skip_ws = False
        buf = self.buf
        found = [(i, m) for m in self.fam.opens if (i := buf.find(m)) >= 0]
        if found:
            i, _ = min(found)
            out.content += buf[:i].rstrip(WS) if i else ""
            self.region, self.buf, self.scanned = "", buf[i:], 0
            return True
        keep = 0 if final else partial_suffix(buf, self.fam.opens)
        body = buf[: len(buf) - keep]
        if not final:  # whitespace before a region is no content: held until text follows
            body = body.rstrip(WS)
        out.content += body
        self.buf = buf[len(body) :]
        return False

    def _close(self, out: Delta, region: str) -> None:
        """The region ended: its calls released, or its text as content."""
        self.region = None
        self.scanned = 0
        try:
            calls = read_region(self.fam, region)
        except (ValueError, SyntaxError, RecursionError, MemoryError):
            out.content += region
            return
        for name, args, call_id in calls:
            # the model's own id where the family writes one (Kimi's "functions.f:0"): the
            # template renders it back from the id the client returns
            out.calls.append(CallDelta(self.n_calls, call_id or self.new_id(), name, args))
            self.n_calls += 1
        self.skip_ws = True
