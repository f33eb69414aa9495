"""The sampler order (``samplers`` in both of llama-server's forms), which stages a chain
runs, where -bs samples them, and the reasoning budget's bookkeeping (slot/reasoning_budget.py,
service/budget.py), without a model."""

from __future__ import annotations

import pytest

from server.engine.sampling_paths import PENALTIES, REQUEST, SAMPLERS, cpu_reason
from server.schemas.bodies import ChatRequest, NativeCompletionRequest
from server.schemas.errors import APIError
from server.service.budget import budget_ask
from server.settings.config import Settings
from server.slot.reasoning_budget import BudgetTracker
from server.task import (
    DEFAULT_SAMPLERS,
    GenParams,
    ReasoningBudget,
    SamplingParams,
    Task,
    sampler_order,
)
from server.templates.reasoning_tags import ReasoningTags, reasoning_tags


def test_sampler_order_forms():
    assert sampler_order("edskypmxt") == DEFAULT_SAMPLERS
    names = ["penalties", "DRY", "top-n-sigma", "topk", "typ", "nucleus", "min_p", "xtc", "temp"]
    assert sampler_order(names) == DEFAULT_SAMPLERS
    assert sampler_order(["adaptive-p", "infill"]) == ("adaptive_p", "infill")
    assert sampler_order("kk") == ("top_k", "top_k")  # repeated as given
    with pytest.raises(ValueError, match="'z'"):
        sampler_order("kz")
    with pytest.raises(ValueError, match="'nope'"):
        sampler_order(["top_k", "nope"])


def test_stages_leave_out_what_changes_nothing():
    assert SamplingParams().stages() == ["top_k", "top_p", "min_p", "temperature"]
    # temperature 0: an argmax; only the stages that may move it stay
    greedy = SamplingParams(temperature=0.0, top_n_sigma=1.0, typical_p=0.5)
    assert greedy.stages() == []
    moved = SamplingParams(temperature=0.0, dry_multiplier=0.8)
    assert moved.stages() == ["dry"]
    # XTC reads the probabilities the truncation before it leaves: they stay
    xtc = SamplingParams(temperature=0.0, dry_multiplier=0.8, xtc_probability=0.5)
    assert xtc.stages() == ["dry", "top_k", "top_p", "min_p", "xtc"]
    assert SamplingParams(xtc_probability=0.5, xtc_threshold=0.6).stages()[-1] == "temperature"
    assert SamplingParams(mirostat=2, dry_multiplier=1.0).stages() == ["temperature", "mirostat"]
    order = SamplingParams(samplers=("temperature", "top_k"), top_n_sigma=2.0)
    assert order.stages() == ["temperature", "top_k"]  # only the listed ones, in that order


def _task(**kw: object) -> Task:
    return Task([1, 2], SamplingParams(**kw), GenParams(), emit=lambda e: None)  # type: ignore[arg-type]


def test_backend_sampling_fallbacks():
    assert cpu_reason(_task()) == ""
    assert cpu_reason(_task(dynatemp_range=0.5)) == ""  # temp_ext runs in the graph
    assert cpu_reason(_task(dry_multiplier=0.5)) == SAMPLERS
    assert cpu_reason(_task(mirostat=1)) == SAMPLERS
    assert cpu_reason(_task(typical_p=0.5)) == SAMPLERS
    assert cpu_reason(_task(samplers=("top_k", "adaptive_p"))) == SAMPLERS
    assert cpu_reason(_task(repeat_penalty=1.2)) == PENALTIES
    assert cpu_reason(_task(backend_ok=False)) == REQUEST


SPEC = ReasoningBudget(tokens=2, start=b"<think>", end=b"</think>", forced=(90, 91), open=True)
PIECES = {1: b"a", 2: b"b", 3: b"c", 4: b"</th", 5: b"ink>", 6: b"<think>", 7: b"x"}


def _run(spec: ReasoningBudget, sampled: list[int]) -> list[int]:
    t = BudgetTracker(spec, PIECES.__getitem__)
    return [t.next(s) for s in sampled]


def test_budget_forces_message_and_end_after_n_tokens():
    assert _run(SPEC, [1, 2, 3, 3, 3, 3]) == [1, 2, 90, 91, 3, 3]
    zero = ReasoningBudget(0, SPEC.start, SPEC.end, SPEC.forced, open=True)
    assert _run(zero, [1, 2, 3]) == [90, 91, 3]


def test_budget_ends_with_the_models_own_end_tag():
    # the end tag written in two pieces within the budget: nothing forced
    spec = ReasoningBudget(3, SPEC.start, SPEC.end, SPEC.forced, open=True)
    assert _run(spec, [1, 4, 5, 1, 1, 1]) == [1, 4, 5, 1, 1, 1]


def test_budget_counts_from_the_start_tag():
    closed = ReasoningBudget(1, SPEC.start, SPEC.end, SPEC.forced, open=False)
    assert _run(closed, [7, 7, 6, 1, 2, 2]) == [7, 7, 6, 1, 90, 91]


def _settings(**kw: object) -> Settings:
    return Settings(**kw)  # type: ignore[arg-type]


def test_budget_fields():
    chat = ChatRequest(messages=[{"role": "user", "content": "x"}])  # type: ignore[list-item]
    tags = reasoning_tags("{{ '<think>' }}")
    assert tags == ReasoningTags("<think>", "</think>")
    assert budget_ask(chat, _settings(), tags) is None  # unlimited by default
    ask = budget_ask(chat, _settings(reasoning_budget=5, reasoning_budget_message="m"), tags)
    assert ask is not None and (ask.tokens, ask.message, ask.end) == (5, "m", "</think>")
    alias = ChatRequest(messages=chat.messages, thinking_budget_tokens=3)
    ask = budget_ask(alias, _settings(reasoning_budget=5), tags)
    assert ask is not None and ask.tokens == 3
    both = ChatRequest(messages=chat.messages, reasoning_budget_tokens=1, thinking_budget_tokens=3)
    ask = budget_ask(both, _settings(), tags)
    assert ask is not None and ask.tokens == 1
    # a template without reasoning: nothing to limit
    assert budget_ask(alias, _settings(), None) is None
    # no template: the request names the tags, or it is a 400 naming the missing one
    native = NativeCompletionRequest(prompt="x", reasoning_budget_tokens=2)
    with pytest.raises(APIError, match="reasoning_budget_start_tag"):
        budget_ask(native, _settings(), None, chat=False)
    tagged = NativeCompletionRequest(
        prompt="x",
        reasoning_budget_tokens=2,
        reasoning_budget_start_tag="<t>",
        reasoning_budget_end_tag="</t>",
    )
    ask = budget_ask(tagged, _settings(), None, chat=False)
    assert ask is not None and (ask.start, ask.end) == ("<t>", "</t>")
    # the server's default budget alone does not ask /completion for tags
    assert (
        budget_ask(
            NativeCompletionRequest(prompt="x"), _settings(reasoning_budget=4), None, chat=False
        )
        is None
    )
