"""Reasoning budgets end to end: SmolLM2 with a DeepSeek-R1-distill template from the pinned
llama.cpp's corpus (it opens ``<think>`` at the start of the answer) via ``--jinja
--chat-template-file``. With a budget of N the model writes N reasoning tokens of its own,
then the budget message and ``</think>`` are forced and the answer follows; checked by
exact token accounting (/completion's ``tokens``, chat's per-token logprobs), on
/completion, /v1/chat/completions (``reasoning_budget_tokens`` and its alias
``thinking_budget_tokens``, streamed too), Anthropic's ``thinking.budget_tokens`` and the
server's --reasoning-budget / --reasoning-budget-message.

Outputs are compared only between requests of the same layout (one at a time, cache off)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from tests.llama_sdist import vendored

from .conftest import ServerProc, smollm2_path

TEMPLATE = "models/templates/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"
QUESTION = [{"role": "user", "content": "What is 17 times 23? Think it through."}]
END = "</think>"


def _args(*extra: str) -> list[str]:
    tpl = str(vendored(TEMPLATE))
    return ["-m", smollm2_path(), "--jinja", "--chat-template-file", tpl, "-c", "4096", *extra]


@pytest.fixture(scope="module")
def srv() -> Iterator[ServerProc]:
    s = ServerProc(*_args("-np", "1"))
    yield s
    s.stop()


def forced_tokens(s: ServerProc, message: str) -> list[int]:
    """What the budget forces: the message's tokens, then the end tag's."""
    out = s.tokenize(message, add_special=False) if message else []
    return out + s.tokenize(END, add_special=False)


def chat_tokens(s: ServerProc, **kw: Any) -> tuple[list[str], dict[str, Any]]:
    """A lone chat request's generated tokens (their text, from logprobs) and message."""
    body = {"messages": QUESTION, "max_tokens": 48, "temperature": 0, "cache_prompt": False}
    body |= {"logprobs": True, **kw}
    r = s.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return [e["token"] for e in choice["logprobs"]["content"]], choice["message"]


def assert_budget(texts: list[str], n: int, forced: list[str]) -> None:
    """The first ``n`` tokens are the model's (no end tag among them), then ``forced``
    exactly, then the answer (at least one token)."""
    assert END not in "".join(texts[:n]), texts[:n]
    assert texts[n : n + len(forced)] == forced, (texts[: n + len(forced) + 2], forced)
    assert len(texts) > n + len(forced), texts


def forced_pieces(s: ServerProc, message: str) -> list[str]:
    """``forced_tokens`` as the text of each token (as chat logprobs report them)."""
    out: list[str] = []
    for text in ([message] if message else []) + [END]:
        body = {"content": text, "add_special": False, "with_pieces": True}
        out += [t["piece"] for t in s.client.post("/tokenize", json=body).json()["tokens"]]
    return out


def test_template_opens_thinking(srv: ServerProc):
    prompt = srv.client.post("/apply-template", json={"messages": QUESTION}).json()["prompt"]
    assert prompt.rstrip().endswith("<think>")


@pytest.mark.parametrize("n", [0, 3, 8])
def test_completion_budget_exact(srv: ServerProc, n: int):
    prompt = srv.client.post("/apply-template", json={"messages": QUESTION}).json()["prompt"]
    body = {
        "prompt": prompt,
        "n_predict": 40,
        "temperature": 0,
        "cache_prompt": False,
        "return_tokens": True,
        "reasoning_budget_tokens": n,
        "reasoning_budget_start_tag": "<think>",
        "reasoning_budget_end_tags": [END],
        "reasoning_budget_message": " Done.",
    }
    toks = srv.client.post("/completion", json=body).json()["tokens"]
    forced = forced_tokens(srv, " Done.")
    text = srv.client.post("/detokenize", json={"tokens": toks[:n]}).json()["content"]
    assert END not in text
    assert toks[n : n + len(forced)] == forced, (toks, forced)
    assert len(toks) > n + len(forced)


@pytest.mark.parametrize("field", ["reasoning_budget_tokens", "thinking_budget_tokens"])
def test_chat_budget_then_answer(srv: ServerProc, field: str):
    n, message = 5, "Enough thinking."
    texts, msg = chat_tokens(srv, **{field: n, "reasoning_budget_message": message})
    forced = forced_pieces(srv, message)
    assert_budget(texts, n, forced)
    assert msg["reasoning_content"].strip().endswith(message)
    assert msg["content"].strip(), msg  # the answer follows the forced end


def test_chat_budget_zero_ends_reasoning_at_once(srv: ServerProc):
    texts, msg = chat_tokens(srv, reasoning_budget_tokens=0)
    assert_budget(texts, 0, forced_pieces(srv, ""))
    assert (msg.get("reasoning_content") or "").strip() == ""
    assert msg["content"].strip()


def test_chat_budget_streamed(srv: ServerProc):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(
        model="x",
        messages=QUESTION,  # type: ignore[arg-type]
        max_tokens=48,
        temperature=0,
        stream=True,
        extra_body={"reasoning_budget_tokens": 4, "reasoning_budget_message": "Stop."},
    )
    kinds: list[str] = []
    reasoning = content = ""
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        r = getattr(d, "reasoning_content", None) or ""
        if r:
            kinds.append("r")
            reasoning += r
        if d.content:
            kinds.append("c")
            content += d.content
    assert reasoning.strip().endswith("Stop."), reasoning
    assert content.strip()
    # reasoning first, then the answer: no reasoning after the content began
    assert "r" not in kinds[kinds.index("c") :], kinds


def test_anthropic_thinking_budget_enforced(srv: ServerProc):
    client = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=120)
    msg = client.messages.create(
        model="x",
        max_tokens=60,
        extra_body={"temperature": 0},
        thinking={"type": "enabled", "budget_tokens": 3},
        messages=QUESTION,  # type: ignore[arg-type]
    )
    kinds = [b.type for b in msg.content]
    assert kinds[0] == "thinking" and "text" in kinds, kinds
    thinking = msg.content[0].thinking  # type: ignore[union-attr]
    # the model's 3 tokens, re-tokenized (a token may split or merge): a few at most
    assert len(srv.tokenize(thinking.strip(), add_special=False)) <= 4, thinking
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert text.strip()


def test_server_budget_flags(make_server):
    s = make_server(
        *_args("-np", "1", "--reasoning-budget", "2", "--reasoning-budget-message", "Hm.")
    )
    texts, msg = chat_tokens(s)
    assert_budget(texts, 2, forced_pieces(s, "Hm."))
    assert msg["reasoning_content"].strip().endswith("Hm.")
    # a request's own budget and message win over the server's
    texts, _ = chat_tokens(s, reasoning_budget_tokens=4, reasoning_budget_message="Ok.")
    assert_budget(texts, 4, forced_pieces(s, "Ok."))
