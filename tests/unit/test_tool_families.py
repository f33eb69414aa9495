"""Tool-call families (server.templates.families / regions / harmony / frames).

- every template of llama.cpp's corpus (the pinned sdist's ``models/templates``) that takes
  tools has a detected family, enumerated from the corpus itself: a new template whose
  syntax is unknown fails here;
- each family's parser reads hand-written model outputs, whole and split at every character
  (streaming gives the merged deltas of the whole);
- the parser reads back what the template renders for a call, and the forced call's frame,
  learnt from the template, produces exactly those bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server.constrained import lark_constraint
from server.templates.chat_plan import plan_chat
from server.templates.chat_template import ChatTemplate
from server.templates.families import BY_NAME, FAMILIES, detect_family, reasoning_end_tag
from server.templates.frames import derive, grammar, text_of
from server.templates.harmony import HarmonyParser
from server.templates.output_parse import Message, OutputParser, ToolFormat
from server.templates.regions import RegionParser
from server.templates.tool_fields import Tool
from server.templates.tools_prompt import template_tools
from tests.llama_sdist import vendored

TEMPLATES = vendored("models/templates/README.md").parent


def corpus() -> list[Path]:
    """The corpus's templates that take tools (the Hugging Face ``tools`` variable)."""
    out = []
    for p in sorted(TEMPLATES.glob("*.jinja")):
        t = ChatTemplate(p.read_text(), "<s>", "</s>", name=p.stem)
        if "tools" in t.variables:
            out.append(p)
    assert len(out) > 50, out
    return out


CORPUS = corpus()
# templates whose rendering of a call cannot be learnt as a frame: forced calls take the
# generic JSON form
NO_FRAME = {
    "CohereForAI-c4ai-command-r-plus-tool_use",  # tojson(indent=4) arguments
    "LFM2.5-8B-A1B",  # pythonic arguments
    "LFM2.5-Instruct",  # does not render calls
    "LFM2-8B-A1B",  # does not render calls
    "MiniMax-M3",  # parameter names are tags
    "google-gemma-4-31B-it-interleaved",  # {k:<|"|>v<|"|>} arguments
    "google-gemma-4-31B-it",
    "ibm-granite-granite-3.3-2B-Instruct",  # does not render calls
    "meetkai-functionary-medium-v3.2",  # wants arguments as a string
    "fireworks-ai-llama-3-firefunction-v2",  # takes ``functions``, not ``tools``
}


def _tpl(p: Path) -> ChatTemplate:
    return ChatTemplate(p.read_text(), "<s>", "</s>", name=p.stem)


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.stem)
def test_every_corpus_template_with_tools_has_a_family(path: Path) -> None:
    tpl = _tpl(path)
    tt = template_tools(tpl)
    fam = detect_family(tpl.source)
    assert tt.family or fam is not None, f"{path.stem}: no tool-call family detected"
    assert tt.native or path.stem in NO_FRAME, tt


def _parse(p: object, pieces: list[str]) -> Message:
    m = Message()
    for x in pieces:
        m.add(p.feed(x))  # type: ignore[attr-defined]
    m.add(p.finish())  # type: ignore[attr-defined]
    return m


def _calls(m: Message) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in m.tool_calls]


P2 = ("get_w", {"city": "Paris", "n": 2})
R3 = ("get_r", {"q": "a<b"})
# (family, model output, content, calls): as such models write them
OUTPUTS = [
    ("qwen3-coder", "Sure.\n<tool_call>\n<function=get_w>\n<parameter=city>\nParis\n</parameter>\n<parameter=n>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_r>\n<parameter=q>\na<b\n</parameter>\n</function>\n</tool_call>", "Sure.", [P2, R3]),
    ("seed-oss", "<seed:tool_call>\n<function=get_w>\n<parameter=city>Paris</parameter>\n<parameter=n>2</parameter>\n</function>\n</seed:tool_call>", "", [P2]),
    ("glm", "ok<tool_call>get_w\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>n</arg_key>\n<arg_value>2</arg_value>\n</tool_call><tool_call>get_r<arg_key>q</arg_key><arg_value>a<b</arg_value></tool_call>", "ok", [P2, R3]),
    ("hy3", "<tool_calls:opensource>\n<tool_call:opensource>get_w<tool_sep:opensource>\n<arg_key:opensource>city</arg_key:opensource>\n<arg_value:opensource>Paris</arg_value:opensource>\n<arg_key:opensource>n</arg_key:opensource>\n<arg_value:opensource>2</arg_value:opensource>\n</tool_call:opensource>", "<tool_calls:opensource>", [P2]),
    ("minimax-m2", '<minimax:tool_call>\n<invoke name="get_w">\n<parameter name="city">Paris</parameter>\n<parameter name="n">2</parameter>\n</invoke>\n<invoke name="get_r">\n<parameter name="q">a<b</parameter>\n</invoke>\n</minimax:tool_call>', "", [P2, R3]),
    ("deepseek-dsml", '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_w">\n<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n<｜DSML｜parameter name="n" string="false">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>', "", [P2]),
    ("deepseek-r1", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_w\n```json\n{"city": "Paris", "n": 2}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_r\n```json\n{"q": "a<b"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "", [P2, R3]),
    ("kimi-k2", 'Let me.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_w:0<|tool_call_argument_begin|>{"city": "Paris", "n": 2}<|tool_call_end|><|tool_call_begin|>functions.get_r:1<|tool_call_argument_begin|>{"q": "a<b"}<|tool_call_end|><|tool_calls_section_end|>', "Let me.", [P2, R3]),
    ("kimi-k3", '<|open|>tools<|sep|><|open|>call tool="get_w" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|><|open|>argument key="n" type="number"<|sep|>2<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>', "", [P2]),
    ("solar-open", '<|tool_calls|><|tool_call:begin|>abc<|tool_call:name|>get_w<|tool_call:args|>{"city": "Paris", "n": 2}<|tool_call:end|><|calls|>', "", [P2]),
    ("minicpm5", 'x <function name="get_w"><param name="city">Paris</param><param name="n">2</param></function>', "x", [P2]),
    ("gemma4", '<|tool_call>call:get_w{city:<|"|>Paris<|"|>,n:2}<tool_call|>', "", [P2]),
    ("lfm2", '<|tool_call_start|>[get_w(city="Paris", n=2), get_r(q="a<b")]<|tool_call_end|>', "", [P2, R3]),
    ("command-r7b", '<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "get_w", "parameters": {"city": "Paris", "n": 2}}\n]<|END_ACTION|>', "", [P2]),
    ("apertus", '<|tools_prefix|>[{"get_w": {"city": "Paris", "n": 2}}, {"get_r": {"q": "a<b"}}]<|tools_suffix|>', "", [P2, R3]),
    ("nemotron-v2", '<TOOLCALL>[{"name": "get_w", "arguments": {"city": "Paris", "n": 2}}]</TOOLCALL>', "", [P2]),
    ("apriel", '<tool_calls>[{"name": "get_w", "arguments": {"city": "Paris", "n": 2}, "id": "x"}]</tool_calls>', "", [P2]),
    ("apriel", '<tool_calls>\n{"name": "get_w", "arguments": {"city": "Paris", "n": 2}}\n{"name": "get_r", "arguments": {"q": "a<b"}}\n</tool_calls>', "", [P2, R3]),
    ("granite-3", '<|tool_call|>[{"name": "get_w", "arguments": {"city": "Paris", "n": 2}}]', "", [P2]),
    ("firefunction-v2", ' functools[{"name": "get_w", "arguments": {"city": "Paris", "n": 2}}]', "", [P2]),
    ("gigachat3.1", '<|function_call|>{"name": "get_w", "arguments": {"city": "Paris", "n": 2}}', "", [P2]),
    ("functionary-v3.1", '<function=get_w>{"city": "Paris", "n": 2}</function><function=get_r>{"q": "a<b"}</function>', "", [P2, R3]),
    # (the first recipient follows the prompt's ">>>": an answer opening with a call is left)
    ("functionary-v3.2", 'I will.>>>get_w\n{"city": "Paris", "n": 2}>>>get_r\n{"q": "a<b"}', "I will.", [P2, R3]),
    ("atem", '<atem:function_calls>\n<atem:invoke name="get_w">\n<atem:parameter name="city">Paris</atem:parameter>\n<atem:parameter name="n">2</atem:parameter>\n</atem:invoke>\n</atem:function_calls>', "", [P2]),
]  # fmt: skip


def _splits(text: str) -> list[list[str]]:
    return [[text]] + [[text[:i], text[i:]] for i in range(1, len(text))] + [list(text)]


@pytest.mark.parametrize("fam,text,content,calls", OUTPUTS, ids=[o[0] for o in OUTPUTS])
def test_family_parser_whole_and_split(fam: str, text: str, content: str, calls: list) -> None:
    for pieces in _splits(text):
        m = _parse(RegionParser(BY_NAME[fam]), pieces)
        assert (m.content, _calls(m)) == (content, calls), pieces
        assert all(c.id for c in m.tool_calls)


def test_every_region_family_has_a_hand_written_case() -> None:
    region = {f.name for f in FAMILIES if f.call is not None}
    assert region - {o[0] for o in OUTPUTS} <= {"minimax-m3", "command-r-plus", "gigachat3"}


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\n<function=get_w>\n<parameter=city>\nPar",  # cut short
        "<tool_call>not a call</tool_call> after",
        "plain answer, no call",
    ],
)
def test_unreadable_region_is_content(text: str) -> None:
    for pieces in _splits(text):
        m = _parse(RegionParser(BY_NAME["qwen3-coder"]), pieces)
        assert (m.content, m.tool_calls) == (text, []), pieces


HARMONY = (
    "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary"
    ' to=functions.get_w <|constrain|>json<|message|>{"city": "Paris", "n": 2}<|call|>'
)


def test_harmony_channels_whole_and_split() -> None:
    for pieces in _splits(HARMONY):
        m = _parse(HarmonyParser(), pieces)
        assert (m.reasoning, m.content, _calls(m)) == ("Need weather.", "", [P2]), pieces
    final = (
        "<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>final<|message|>Hi!"
    )
    for pieces in _splits(final):
        m = _parse(HarmonyParser(), pieces)
        assert (m.reasoning, m.content, m.tool_calls) == ("hm", "Hi!", [])
    m = _parse(HarmonyParser(reasoning=False), [final])
    assert m.content == "hmHi!"


@pytest.mark.parametrize(
    "tags,text",
    [
        (("<seed:think>", "</seed:think>"), "<seed:think>hmm</seed:think>Answer"),
        (("[THINK]", "[/THINK]"), "[THINK]hmm[/THINK]Answer"),
        (("<think>", "</think>"), "<think>\nhmm\n</think>\n\nAnswer"),
    ],
)
def test_reasoning_tags_per_family(tags: tuple[str, str], text: str) -> None:
    for pieces in _splits(text):
        m = _parse(OutputParser(reasoning=True, tags=tags), pieces)
        assert (m.reasoning, m.content) == ("hmm", "Answer"), pieces


@pytest.mark.parametrize(
    "name,tag",
    [
        ("openai-gpt-oss-120b", "<|end|>"),
        ("ByteDance-Seed-OSS", "</seed:think>"),
        ("mistralai-Ministral-3-14B-Reasoning-2512", "[/THINK]"),
        ("Qwen-Qwen3-0.6B", "</think>"),
        ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "</think>"),
    ],
)
def test_reasoning_end_tag(name: str, tag: str) -> None:
    assert reasoning_end_tag((TEMPLATES / f"{name}.jinja").read_text()) == tag


def _kw(tpl: ChatTemplate) -> dict:
    return {"enable_thinking": True} if "enable_thinking" in tpl.variables else {}


FAMILY_TEMPLATES = [p for p in CORPUS if template_tools(_tpl(p)).fmt is ToolFormat.FAMILY]


@pytest.mark.parametrize("path", FAMILY_TEMPLATES, ids=lambda p: p.stem)
def test_frame_renders_as_the_template(path: Path) -> None:
    """The forced call's bytes (the frame with a call filled in) equal what the template
    renders for that call, and the family's parser reads them back."""
    tpl = _tpl(path)
    frame = derive(tpl, _kw(tpl))
    if path.stem in NO_FRAME:
        assert frame is None
        return
    assert frame is not None, path.stem
    args = {"city": "Paris", "n": 2}
    tool = Tool(
        "get_w",
        "",
        {
            "type": "object",
            "properties": {"city": {"type": "string"}, "n": {"type": "integer"}},
            "required": ["city", "n"],
        },
    )
    tools = [tool.as_openai()]
    user = [{"role": "user", "content": "hi"}]
    call = {"id": "pr0be0001", "type": "function", "function": {"name": "get_w", "arguments": args}}
    whole = tpl.render(
        [*user, {"role": "assistant", "content": "", "tool_calls": [call]}],
        False,
        tools=tools,
        **_kw(tpl),
    )
    mine = text_of(frame, "get_w", args)
    assert mine in whole, (mine, whole)
    fam = template_tools(tpl).family
    p = HarmonyParser() if fam == "gpt-oss" else RegionParser(BY_NAME[fam])
    m = _parse(p, [mine])
    assert _calls(m) == [("get_w", args)], mine
    lark_constraint(grammar(frame, [tool]))  # llguidance takes it


def test_the_models_own_call_id_is_kept() -> None:
    """Kimi K2 writes the call's id into the call ("functions.f:0"), and its template renders
    it back from the id the client returns: the parser hands out the model's id."""
    text = OUTPUTS[7][1]
    m = _parse(RegionParser(BY_NAME["kimi-k2"]), [text])
    assert [c.id for c in m.tool_calls] == ["functions.get_w:0", "functions.get_r:1"]


@pytest.mark.parametrize(
    "path", [p for p in FAMILY_TEMPLATES if p.stem in NO_FRAME], ids=lambda p: p.stem
)
def test_a_forced_call_without_a_frame_takes_the_generic_json_form(path: Path) -> None:
    """Where no frame can be learnt, a forced call is not refused: it is constrained to the
    generic JSON form and parsed as such (what these templates got before families)."""
    tools = [Tool("get_w", "", {"type": "object", "properties": {}}).as_openai()]
    plan = plan_chat(
        _tpl(path), tools=tools, tool_choice="required", chat_template_kwargs=_kw(_tpl(path))
    )
    assert plan.frame is None and plan.fmt is ToolFormat.GENERIC
    assert plan.constraint() is not None
