"""Tool-call families end to end: SmolLM2-135M-Instruct serving each family's template of
llama.cpp's corpus (``--jinja --chat-template-file``; the template's tokens are split into
ordinary pieces, its syntax and rendering are real), through the openai SDK:

- a forced call comes back parsed, its arguments valid against the tool's schema;
- a streamed forced call is assembled by the SDK's stream helper into the same shape;
- the next turn (the call and its result sent back) recomputes only the new messages: the
  generated call is byte for byte the call the template renders, so it comes from the cache
  (``prompt_tokens - cached_tokens`` at most the new tokens plus a few).

One template per family (the first of the corpus in name order); test_tool_families.py checks
every template's detection, parser and frame without a model."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from bench.families import WEATHER  # the same tool the side-by-side bench asks for
from server.templates.chat_template import ChatTemplate
from server.templates.output_parse import ToolFormat
from server.templates.tools_prompt import template_tools
from tests.llama_sdist import vendored

from .conftest import ServerProc, smollm2_path

TEMPLATES = vendored("models/templates/README.md").parent
NO_FRAME = {
    "CohereForAI-c4ai-command-r-plus-tool_use",
    "LFM2.5-8B-A1B",
    "LFM2.5-Instruct",
    "LFM2-8B-A1B",
    "MiniMax-M3",
    "google-gemma-4-31B-it-interleaved",
    "google-gemma-4-31B-it",
    "ibm-granite-granite-3.3-2B-Instruct",
    "meetkai-functionary-medium-v3.2",
}


# Hermes as the issue measured it (Qwen3's template), Llama 3 as llama.cpp's tests use it
PREFER = {"hermes": "Qwen-Qwen3-0.6B", "llama3": "meta-llama-Llama-3.3-70B-Instruct"}
FRAMED = (ToolFormat.FAMILY, ToolFormat.HERMES, ToolFormat.LLAMA3)


def _family_templates() -> list[Path]:
    """One template per family whose forced calls follow the template's frame."""
    seen: dict[str, Path] = {f: TEMPLATES / f"{n}.jinja" for f, n in PREFER.items()}
    for p in sorted(TEMPLATES.glob("*.jinja")):
        if p.stem in NO_FRAME:
            continue
        tpl = ChatTemplate(p.read_text(), "<s>", "</s>", name=p.stem)
        tt = template_tools(tpl)
        if "tools" in tpl.variables and tt.fmt in FRAMED:
            seen.setdefault(tt.family, p)
    return list(seen.values())


# Known gaps, measured (README "Model families"): the template renders something the grammar
# cannot know into the call (an id or index of its own) ...
RENDERS_OTHERWISE = {
    "Apriel-1.6-15b-Thinker-fixed": "renders the client's call id into the call",
    "Kimi-K3": "renders an index of its own",
}
# ... or the tokens sampled under the grammar are not those the same text tokenizes to. The
# engine feeds a frame's literal parts as the text tokenizes (forced tokens) and heals the
# prompt's last token into the call's first (`>` `<` as `><`, `\n\n` `{` as `\n` `\n{`);
# left: where the model picks a shorter token than the text's at a literal's edge before a
# hole (muse-glimmer: `"` then `>` for `">`; DeepSeek V3.2's DSML parameters), the call is
# recomputed from there; the prompt before it is still reused
TOKEN_GAP = {
    "muse-glimmer",
    "deepseek-ai-DeepSeek-V3.2",
}

SCHEMA = WEATHER["function"]["parameters"]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MAX = 300


@pytest.fixture(scope="module", params=_family_templates(), ids=lambda p: p.stem)
def client(request: pytest.FixtureRequest) -> Iterator[openai.OpenAI]:
    s = ServerProc(
        "-m", smollm2_path(), "-c", "4096", "-np", "1", "--jinja",
        "--chat-template-file", str(request.param),
    )  # fmt: skip
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
    yield c
    c.close()
    s.stop()


def _valid(call) -> dict:  # noqa: ANN001
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMA)
    return args


def test_forced_call_then_next_turn_cached(
    client: openai.OpenAI, request: pytest.FixtureRequest
) -> None:
    r1 = client.chat.completions.create(
        model="m", messages=MESSAGES, tools=[WEATHER], tool_choice="required",
        max_tokens=MAX, seed=1, temperature=0, logprobs=True,
    )  # fmt: skip
    ch = r1.choices[0]
    raw = b"".join(bytes(t.bytes or []) for t in ch.logprobs.content).decode()
    assert ch.finish_reason == "tool_calls", (raw, ch)
    (call,) = ch.message.tool_calls
    _valid(call)
    history = [
        *MESSAGES,
        ch.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'},
    ]
    r2 = client.chat.completions.create(
        model="m", messages=history, tools=[WEATHER], max_tokens=1, temperature=0
    )
    # the template renders the generated call byte for byte
    p1 = _prompt(client, MESSAGES)
    p2 = _prompt(client, history)
    if request.node.callspec.id not in RENDERS_OTHERWISE:
        assert raw.strip() in p2, (raw, p2[len(p1) - 40 :])
    # and the cache serves all of the next prompt up to where the texts part: the end of
    # the call, or earlier where the template renders the generation prompt otherwise in
    # history (MiniMax, Nemotron 3: an opened <think> dropped), less a token or two that
    # merge across that point
    shared = _shared(p1, raw, p2)
    cacheable = _count(client, shared)
    cached = r2.usage.prompt_tokens_details.cached_tokens or 0
    gap = request.node.callspec.id in RENDERS_OTHERWISE or request.node.callspec.id in TOKEN_GAP
    if gap:  # known gaps (README): at least the whole first prompt is reused
        cacheable = min(cacheable, r1.usage.prompt_tokens)
    assert cached >= cacheable - 2, (raw, shared[len(p1) - 40 :], r1.usage, r2.usage)
    # llama-server's accounting says the same: what the next turn computed is what follows
    # the shared text (the new messages, and the call where a gap is known), give or take
    # the tokens that merge across that point
    t2 = r2.model_extra["timings"]
    assert t2["cache_n"] == cached
    assert t2["prompt_n"] <= r2.usage.prompt_tokens - cacheable + 2, (t2, cacheable)


def _shared(p1: str, raw: str, p2: str) -> str:
    """The text the first turn's KV and the next turn's prompt share. The answer's first
    token may carry the prompt's last bytes (the engine heals the prompt's last token into
    a forced call's first, as the joined text tokenizes): those bytes count once."""
    joined = [p1 + raw] + [p1[:-k] + raw for k in range(1, 9) if p1.endswith(raw[:k])]
    return max((os.path.commonprefix([j, p2]) for j in joined), key=len)


def _prompt(client: openai.OpenAI, messages: list) -> str:
    r = client.post(
        "/../apply-template",
        body={"messages": messages, "tools": [WEATHER]},
        cast_to=httpx.Response,
    )
    return r.json()["prompt"]


def _count(client: openai.OpenAI, text: str) -> int:
    r = client.post("/../tokenize", body={"content": text}, cast_to=httpx.Response)
    return len(r.json()["tokens"])


def test_streamed_named_call_assembled_by_the_sdk(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(
        model="m", messages=MESSAGES, tools=[WEATHER], tool_choice=NAMED,
        max_tokens=MAX, seed=2, temperature=0,
    ) as stream:  # fmt: skip
        final = stream.get_final_completion()
    ch = final.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    (call,) = ch.message.tool_calls
    _valid(call)
    assert call.id


def test_a_template_without_a_frame_still_forces_a_valid_call() -> None:
    """Gemma 4 renders arguments in a shape no grammar can learn (``{k:<|"|>v<|"|>}``): a
    forced call takes the generic JSON form and comes back parsed, not refused."""
    s = ServerProc(
        "-m", smollm2_path(), "-c", "4096", "-np", "1", "--jinja",
        "--chat-template-file", str(TEMPLATES / "google-gemma-4-31B-it.jinja"),
    )  # fmt: skip
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        r = c.chat.completions.create(
            model="m", messages=MESSAGES, tools=[WEATHER], tool_choice="required",
            max_tokens=MAX, seed=1, temperature=0,
        )  # fmt: skip
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        (call,) = ch.message.tool_calls
        _valid(call)
        c.close()
    finally:
        s.stop()
