"""The per-token fast path of the streams (issue 33): prebuilt frames give byte for byte the
SSE the per-event path builds (dicts through ``json.dumps``), for every stream shape; a
reader far behind gets its adjacent text merged, one that keeps up never does."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from server.protocols import anthropic, common, native, openai, responses
from server.protocols import responses_mapping as api_responses
from server.protocols.common import Frame, json_ints, json_str, sse
from server.service.tasks import COALESCE_AFTER, coalesced, merge_text
from server.task import (
    FinishReason,
    PromptProgress,
    TaskError,
    TaskResult,
    TextChunk,
    Timings,
    TokenLogprob,
)
from server.templates.chat_plan import plan_chat
from server.templates.chat_template import BUILTIN_TEMPLATES, ChatTemplate
from tests.tool_cases import TEST_TOOL

TEXTS = [
    "Hello",
    " wörld",
    "",
    "日本語のテキスト",
    "emoji 😀👍🏽",
    'quotes " and \\ backslash',
    "control \x00\x01\x1f\t\n\r",
    "separators \u2028\u2029 and \x7f",
    "<think>",
    "</script>",
    '{"json": [1, 2]}',
]


def _chunks(with_lp: bool = False) -> list[TextChunk]:
    lps = [TokenLogprob(7, -0.25, [(7, -0.25), (8, -1.5)])] if with_lp else []
    return [TextChunk(t, [i, i + 1] if i % 2 else [i], list(lps)) for i, t in enumerate(TEXTS)]


def test_frames_fill_as_json_dumps() -> None:
    base = {"id": "x\u00e9", "model": Frame.hole(0), "n": 1}
    frame = Frame.of({**base, "tokens": Frame.hole(1)}, 2)
    assert frame is not None
    for i, text in enumerate(TEXTS):
        toks = list(range(i))
        want = sse({"id": "x\u00e9", "model": text, "n": 1, "tokens": toks})
        assert frame.fill(json_str(text), json_ints(toks)) == want
        assert json_str(text) == json.dumps(text, ensure_ascii=False)
        assert json_ints(toks) == json.dumps(toks)
    # a hole that is missing (or repeated) gives no frame: the caller takes the slow path
    assert Frame.of({"a": "b"}, 1) is None
    assert Frame.of({"a": Frame.hole(0), "b": Frame.hole(0)}, 1) is None


class _Backend:
    def token_to_piece(self, tok: int, special: bool = False) -> bytes:
        return "éa😀"[tok % 3].encode()


BASE = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 1,
    "model": "m ü",
    "system_fingerprint": "b0-slot",
}


def _frames(shape_of: Any, events: list[TextChunk], slow: bool, mp: pytest.MonkeyPatch) -> str:
    """The frames of ``events`` through ``openai._Frames``; ``slow``: no prebuilt frame."""
    with mp.context() as m:
        if slow:
            m.setattr(openai.Frame, "of", classmethod(lambda cls, obj, holes: None))
        frames = openai._Frames(shape_of(), dict(BASE), None)
        out: list[str] = []
        for ev in events:
            frames.add(out, 0, ev)
        result = TaskResult(0, FinishReason.STOP, "", [], 3, Timings(predicted_n=len(events)))
        frames.add(out, 0, result)
    return "".join(out)


@pytest.mark.parametrize("logprobs", [None, 2])
@pytest.mark.parametrize("echo", [False, True])
def test_completion_frames_as_the_per_event_path(
    monkeypatch: pytest.MonkeyPatch, logprobs: int | None, echo: bool
) -> None:
    body = SimpleNamespace(logprobs=logprobs, echo=echo, prompt="Say ünï", n=1)
    group = SimpleNamespace(tasks=[SimpleNamespace(prompt=[1, 2])])

    def shape() -> openai.Shape:
        choices = openai._CompletionChoices(_Backend(), body, group)  # type: ignore[arg-type]
        return openai.Shape(
            "cmpl-", "text_completion", "text_completion", choices.text, choices.final
        )

    events = _chunks(with_lp=logprobs is not None)
    events[3].timings = Timings(predicted_n=4)  # timings_per_token on one chunk
    fast, slow = (_frames(shape, events, s, monkeypatch) for s in (False, True))
    assert fast == slow
    assert fast.count("data: ") == len(events) + 1


CHAT_CASES = {
    "plain": {"reasoning_format": "none"},
    "reasoning": {"reasoning_format": "deepseek"},
    "auto": {},
    "tools": {"tools": [TEST_TOOL]},
}
CHAT_TEXT = [
    "<think>",
    "hmm ü",
    "</think>",
    "Hé",
    "llo 😀",
    ' {"tool_calls": [{"name": "test", ',
    '"arguments": {"success": true}}]}',
]


@pytest.mark.parametrize("case", list(CHAT_CASES))
@pytest.mark.parametrize("logprobs", [False, True])
def test_chat_frames_as_the_per_event_path(
    monkeypatch: pytest.MonkeyPatch, case: str, logprobs: bool
) -> None:
    tpl = ChatTemplate(BUILTIN_TEMPLATES["chatml"])
    body = SimpleNamespace(logprobs=logprobs)

    def shape() -> openai.Shape:
        plan = plan_chat(tpl, **CHAT_CASES[case])  # type: ignore[arg-type]
        return openai._chat_shape(_Backend(), body, 1, plan)  # type: ignore[arg-type]

    lps = [TokenLogprob(1, -0.5, [(1, -0.5)])] if logprobs else []
    events = [TextChunk(t, [1], list(lps)) for t in [*TEXTS, *CHAT_TEXT]]
    fast, slow = (_frames(shape, events, s, monkeypatch) for s in (False, True))
    assert fast == slow


def _native_stream(events: list[Any], n_probs: int, slow: bool, mp: pytest.MonkeyPatch) -> str:
    class Group:
        tasks = [SimpleNamespace(gen=SimpleNamespace(n_probs=n_probs), sampling=None)]

        async def batches(self, coalesce: bool = False):  # noqa: ANN202
            yield [(0, ev) for ev in events[:4]]
            yield [(0, ev) for ev in events[4:]]

    async def collect() -> str:
        return "".join([s async for s in native._stream(None, Group(), [""])])  # type: ignore[arg-type]

    with mp.context() as m:
        if slow:
            m.setattr(native.Frame, "of", classmethod(lambda cls, obj, holes: None))
        m.setattr(native, "completion_probs", lambda st, task, lps: [{"n": len(lps)}])
        return asyncio.run(collect())


@pytest.mark.parametrize("n_probs", [0, 2])
def test_native_frames_as_the_per_event_path(monkeypatch: pytest.MonkeyPatch, n_probs: int) -> None:
    events = _chunks(with_lp=n_probs > 0)
    events[5].timings = Timings(predicted_n=6)
    fast, slow = (_native_stream(events, n_probs, s, monkeypatch) for s in (False, True))
    assert fast == slow
    assert fast.count("data: ") == len(events)
    first = json.loads(fast.split("\n\n")[0].removeprefix("data: "))
    assert first == {
        "index": 0,
        "content": "Hello",
        "stop": False,
        "id_slot": -1,
        "tokens": [0],
    } | ({"completion_probabilities": [{"n": 1}]} if n_probs else {})


# ---- coalescing a reader that is behind --------------------------------------------------


def _text(i: int) -> TextChunk:
    return TextChunk(f"t{i}", [i], [TokenLogprob(i, -1.0, [])], Timings(predicted_n=i))


def test_a_reader_that_keeps_up_gets_every_chunk() -> None:
    batch = [(0, _text(i)) for i in range(COALESCE_AFTER)]
    assert coalesced(batch) == batch


def test_a_reader_far_behind_gets_its_text_merged_in_order() -> None:
    n = COALESCE_AFTER + 10
    result = TaskResult(0, FinishReason.STOP, "", [], 1, Timings())
    batch: list[Any] = [(0, _text(i)) for i in range(n)]
    batch.insert(5, (1, _text(99)))  # another choice's chunk splits the run
    batch.append((0, result))
    out = coalesced(batch)
    assert [i for i, _ in out] == [0, 1, 0, 0]
    first, other, rest, end = (ev for _, ev in out)
    assert other == _text(99) and end is result  # the other choice keeps up: untouched
    merged = merge_text([first, rest])
    assert merged.text == "".join(f"t{i}" for i in range(n))
    assert merged.tokens == list(range(n))
    assert [lp.token for lp in merged.logprobs] == list(range(n))
    assert rest.timings == Timings(predicted_n=n - 1)  # the last chunk's timings


def test_common_json_helpers_are_the_ones_sse_uses() -> None:
    assert common.json_str("é\n") == '"é\\n"'
    assert common.json_ints([]) == "[]" and common.json_ints([3, 1]) == "[3, 1]"


def test_plain_text_takes_the_prebuilt_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    filled: list[str] = []
    fill = Frame.fill
    monkeypatch.setattr(Frame, "fill", lambda self, *f: filled.append(f[0]) or fill(self, *f))
    tpl = ChatTemplate(BUILTIN_TEMPLATES["chatml"])
    plan = plan_chat(tpl)  # the default: reasoning parsed ("auto"), no tools
    shape = openai._chat_shape(_Backend(), SimpleNamespace(logprobs=False), 1, plan)  # type: ignore[arg-type]
    frames = openai._Frames(shape, dict(BASE), None)
    frames.add([], 0, TextChunk("Hé", [1], []))
    frames.add([], 0, TextChunk("llo", [2], []))
    assert filled == ['"Hé"', '"llo"']


# ---- the named-event streams (Anthropic, Responses): a batch is one write -----------------


class _Batches:
    """Stands in for a TaskGroup: ``batches`` yields the given batches of task 0's events
    (and records the ``coalesce`` it was asked for)."""

    def __init__(self, batches: list[list[Any]]) -> None:
        self._batches = batches
        self.coalesce: bool | None = None
        self.closed = False

    async def batches(self, coalesce: bool = False):  # noqa: ANN201
        self.coalesce = coalesce
        try:
            for batch in self._batches:
                yield [(0, ev) for ev in batch]
        finally:
            self.closed = True


def _writes(stream: Any, batches: list[list[Any]]) -> list[str]:
    """What ``stream`` writes for ``batches``, write by write."""
    group = _Batches(batches)

    async def collect() -> list[str]:
        return [s async for s in stream.run(group)]

    out = asyncio.run(collect())
    assert group.coalesce is True and group.closed
    return out


NAMED_CASES = {
    "plain": {"reasoning_format": "none"},
    "reasoning": {"reasoning_format": "deepseek"},
    "tools": {"tools": [TEST_TOOL]},
}


def _named_events(end: Any) -> list[Any]:
    """Progress (the message's opening, then pings), text of every kind, then ``end``."""
    progress = [PromptProgress(9, 2, p, p) for p in (2, 5, 9)]
    texts = [*TEXTS, *CHAT_TEXT]
    timed = {4: Timings(predicted_n=5)}  # timings_per_token on one chunk
    text = [TextChunk(t, [1], [], timed.get(i)) for i, t in enumerate(texts)]
    return [*progress, *text, end]


def _named_stream(route: str, case: str, mp: pytest.MonkeyPatch) -> Any:
    """A stream factory of ``route`` (fixed ids: two streams write the same bytes)."""
    tpl = ChatTemplate(BUILTIN_TEMPLATES["chatml"])
    if route == "anthropic":
        mp.setattr(anthropic, "new_id", lambda prefix: prefix + "1")
        return lambda: anthropic._MessageStream(
            plan_chat(tpl, **NAMED_CASES[case]), "m ü", False, 9
        )  # type: ignore[arg-type]
    mp.setattr(responses, "new_id", lambda prefix: prefix + "1")
    # a fixed clock: two streams straddling a second would differ in created_at
    mp.setattr(api_responses, "time", SimpleNamespace(time=lambda: 1_700_000_000.5))
    return lambda: responses._ResponseStream(plan_chat(tpl, **NAMED_CASES[case]), "m ü")  # type: ignore[arg-type]


def _per_event(stream: Any, events: list[Any]) -> list[str]:
    """The SSE text of each event rendered alone (``add``), in order."""
    out: list[str] = []
    for ev in events:
        frames: list[str] = []
        stream.add(frames, 0, ev)
        out.append("".join(frames))
    return out


@pytest.mark.parametrize("route", ["anthropic", "responses"])
@pytest.mark.parametrize("case", list(NAMED_CASES))
@pytest.mark.parametrize("error", [False, True])
def test_named_event_batches_as_the_per_event_stream(
    monkeypatch: pytest.MonkeyPatch, route: str, case: str, error: bool
) -> None:
    result = TaskResult(0, FinishReason.STOP, "", [], 9, Timings(predicted_n=18, cache_n=2))
    events = _named_events(TaskError(408, "timed out", "timeout_error") if error else result)
    make = _named_stream(route, case, monkeypatch)
    per_event = _per_event(make(), events)  # each event alone, as they were sent
    with monkeypatch.context() as m:  # no prebuilt frame: every event built as a dict
        m.setattr(common.Frame, "of", classmethod(lambda cls, obj, holes: None))
        assert _per_event(make(), events) == per_event
    assert _writes(make(), [[ev] for ev in events]) == [w for w in per_event if w]
    cuts = [0, 1, 3, 4, 9, 12, len(events) - 1, len(events)]
    batches = [events[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    want = ["".join(per_event[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]
    assert _writes(make(), batches) == [w for w in want if w]  # one write per batch
    frames = "".join(per_event).split("\n\n")
    assert frames[0].startswith(("event: message_start\n", "event: response.created\n"))
    assert frames[1].startswith(("event: ping\n", "event: response.in_progress\n"))
    assert ("timed out" in frames[-2]) is error and frames[-1] == ""


@pytest.mark.parametrize("route", ["anthropic", "responses"])
def test_named_plain_text_takes_the_prebuilt_frame(
    monkeypatch: pytest.MonkeyPatch, route: str
) -> None:
    filled: list[str] = []
    fill = Frame.fill
    monkeypatch.setattr(Frame, "fill", lambda self, *f: filled.append(f[0]) or fill(self, *f))
    stream = _named_stream(route, "plain", monkeypatch)()
    texts = ["Hé", "llo", " 😀"]
    _per_event(stream, [TextChunk(t, [1], []) for t in texts])
    assert filled == ['"llo"', '" 😀"']  # the first opens the message and its text block
