"""A new user's first chat: the server ``./serve.sh`` starts (its command line, from
``SERVE_DRY_RUN=1``) serves SmolLM2-135M-Instruct, an instruct model with a chat template of
its own, and the first chats end by themselves (finish_reason "stop") well before a generous
cap. Greedy sampling (temperature 0): the same answers on every run on one build."""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest

from server.cli.models import SMOLLM2_FILE

from .conftest import ServerProc, serve_sh_args

pytestmark = pytest.mark.e2e

FIRST_CHATS = (
    "Hello there, who are you?",
    "What is the capital of France?",
    "Write a short poem about the sea.",
)
CAP = 512  # far above what an answer that ends by itself needs


@pytest.fixture(scope="module")
def first() -> Iterator[ServerProc]:
    s = ServerProc(*serve_sh_args("-np", "1", "-c", "4096"))
    yield s
    s.stop()


def test_serve_sh_serves_an_instruct_model_with_its_own_template(first: ServerProc):
    props = first.client.get("/props").json()
    assert props["model_path"].endswith(SMOLLM2_FILE)
    assert props["chat_template_name"] == "model"  # the model's own
    assert props["chat_template_fallback"] is False


def test_first_chats_end_by_themselves(first: ServerProc):
    client = openai.OpenAI(base_url=first.url + "/v1", api_key="none", max_retries=0)
    results = []
    for question in FIRST_CHATS:
        t0 = time.perf_counter()
        r = client.chat.completions.create(
            model="any",
            messages=[{"role": "user", "content": question}],
            temperature=0,
            max_tokens=CAP,
        )
        seconds = time.perf_counter() - t0
        assert r.usage is not None
        answer = r.choices[0].message.content or ""
        results.append((question, r.choices[0].finish_reason, r.usage.completion_tokens, seconds))
        print(f"{question!r}: {r.usage.completion_tokens} tokens, {seconds:.1f} s: {answer!r}")
        assert answer.strip(), question
    assert [(q, f) for q, f, _, _ in results] == [(q, "stop") for q in FIRST_CHATS], results
    assert all(n < CAP for _, _, n, _ in results), results
