"""/apply-template's rendering on real model templates: llama.cpp's own test_template.py
cases (reasoning switches, dates, the generation prompt), with and without tools."""

from __future__ import annotations

import datetime
from types import SimpleNamespace

import pytest

from server.prompts.chat import plan_chat as _plan
from server.protocols.apply_template import ApplyTemplateRequest, render_text
from server.service.state import ServerState
from server.settings.config import Settings
from server.templates.chat_template import ChatTemplate
from tests.llama_sdist import vendored
from tests.tool_cases import TEST_TOOL

TOOLS = pytest.mark.parametrize("tools", [None, [], [TEST_TOOL]], ids=["none", "empty", "tool"])


def _state(name: str, reasoning: str = "auto") -> ServerState:
    """A loaded server's state, as far as /apply-template reads it."""
    st = ServerState(settings=Settings(reasoning=reasoning), loading=False)
    st.engine = SimpleNamespace(alive=True)  # type: ignore[assignment]
    src = vendored(f"models/templates/{name}.jinja").read_text()
    st.template = ChatTemplate(src, "<s>", "</s>", name=name)
    return st


def _render(st: ServerState, **body) -> str:  # noqa: ANN003
    req = ApplyTemplateRequest(messages=[{"role": "user", "content": "What is today?"}], **body)
    return render_text(st, req, _plan(st, req))


@TOOLS
@pytest.mark.parametrize(
    "name,reasoning,end",
    [
        ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "on", "<think>\n"),
        ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "auto", "<think>\n"),
        ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "off", "<think>\n</think>"),
        ("Qwen-Qwen3-0.6B", "auto", "<|im_start|>assistant\n"),
        ("Qwen-Qwen3-0.6B", "off", "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        ("Qwen-QwQ-32B", "auto", "<|im_start|>assistant\n<think>\n"),
        ("Qwen-QwQ-32B", "off", "<|im_start|>assistant\n<think>\n</think>"),
        (
            "CohereForAI-c4ai-command-r7b-12-2024-tool_use",
            "auto",
            "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
        ),
        (
            "CohereForAI-c4ai-command-r7b-12-2024-tool_use",
            "off",
            "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|><|END_THINKING|>",
        ),
    ],
)
def test_reasoning(name: str, reasoning: str, end: str, tools: list | None) -> None:
    assert _render(_state(name, reasoning), tools=tools).endswith(end)


@TOOLS
@pytest.mark.parametrize(
    "name,fmt",
    [
        ("meta-llama-Llama-3.3-70B-Instruct", "%d %b %Y"),
        ("fireworks-ai-llama-3-firefunction-v2", "%b %d %Y"),
    ],
)
def test_date_inside_prompt(name: str, fmt: str, tools: list | None) -> None:
    assert datetime.date.today().strftime(fmt) in _render(_state(name), tools=tools)


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_add_generation_prompt(add_generation_prompt: bool) -> None:
    st = _state("meta-llama-Llama-3.3-70B-Instruct")
    prompt = _render(st, add_generation_prompt=add_generation_prompt)
    assert ("<|start_header_id|>assistant<|end_header_id|>" in prompt) == add_generation_prompt


def test_tools_reach_a_native_template() -> None:
    prompt = _render(_state("Qwen-Qwen3-0.6B"), tools=[TEST_TOOL])
    assert '"name": "test"' in prompt and "<tools>" in prompt
