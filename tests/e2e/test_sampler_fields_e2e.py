"""llama-server's request fields, every one of them, on /completion and /v1/chat/completions:
each is honoured or refused with a 400 naming it, none silently dropped. The field list is
read from the pinned llama.cpp's ``tools/server/server-schema.cpp`` (its names and
aliases): a field added there fails ``test_every_field_is_classified`` until it is handled
here. Then the samplers' behaviour on the real model, read off the chain's final distribution
(``post_sampling_probs``) so that it holds whatever the model's numbers on this CPU: DRY cuts
the token that extends a repeated cycle, XTC drops the likeliest above its threshold, mirostat
truncates, all reproducible with a seed; ``samplers`` in both forms, bad values are 400s, and under -bs the samplers the backend chain lacks fall back to
the CPU.

Generated tokens are only compared between requests of the same layout (one request at a
time, ``cache_prompt`` off), never across batch layouts."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.llama_sdist import vendored

from .conftest import ServerProc


def schema_fields() -> list[str]:
    """Every top-level field name and alias of llama-server's completion schema
    (``make_llama_cmpl_schema``), without the disabled ``#if 0`` block and comments."""
    src = vendored("tools/server/server-schema.cpp").read_text()
    body = src[src.index("make_llama_cmpl_schema") : src.index("task_params eval_llama_cmpl")]
    body = re.sub(r"#if 0.*?#endif", "", body, flags=re.S)
    body = re.sub(r"//[^\n]*", "", body)
    names = re.findall(r'\badd\(\(new field_\w+\("([^"]+)"', body)
    names += re.findall(r'add_alias\("([^"]+)"\)', body)
    return names


USER = [{"role": "user", "content": "Say hello."}]
BUDGET_TAGS = {"reasoning_budget_start_tag": "<think>", "reasoning_budget_end_tags": ["</think>"]}

# field -> (the request fragment that asks for its behaviour, "ok" or "refused"); the
# fragment may add what the field needs to mean something. Per endpoint where they differ.
COMMON: dict[str, tuple[dict[str, Any], str]] = {
    "verbose": ({"verbose": True}, "ok"),
    "timings_per_token": ({"timings_per_token": True}, "ok"),
    "stream": ({"stream": True}, "ok"),
    "cache_prompt": ({"cache_prompt": False}, "ok"),
    "return_progress": ({"return_progress": True, "stream": True}, "ok"),
    "sse_ping_interval": ({"sse_ping_interval": 5}, "ok"),
    "n_predict": ({"n_predict": 1}, "ok"),
    "max_completion_tokens": ({"max_completion_tokens": 1}, "ok"),
    "max_tokens": ({"max_tokens": 1}, "ok"),
    "n_indent": ({"n_indent": 4}, "refused"),
    "n_keep": ({"n_keep": 4}, "ok"),
    "n_discard": ({"n_discard": 4}, "ok"),
    "n_cmpl": ({"n_cmpl": 2}, "refused"),
    "n_cache_reuse": ({"n_cache_reuse": 8}, "ok"),
    "t_max_predict_ms": ({"t_max_predict_ms": 100}, "refused"),
    "top_k": ({"top_k": 5}, "ok"),
    "top_p": ({"top_p": 0.5}, "ok"),
    "min_p": ({"min_p": 0.1}, "ok"),
    "top_n_sigma": ({"top_n_sigma": 1.5}, "ok"),
    "xtc_probability": ({"xtc_probability": 0.5}, "ok"),
    "xtc_threshold": ({"xtc_threshold": 0.2}, "ok"),
    "typical_p": ({"typical_p": 0.9}, "ok"),
    "temperature": ({"temperature": 0.5}, "ok"),
    "dynatemp_range": ({"dynatemp_range": 0.3}, "ok"),
    "dynatemp_exponent": ({"dynatemp_exponent": 1.5}, "ok"),
    "repeat_last_n": ({"repeat_last_n": 32}, "ok"),
    "repeat_penalty": ({"repeat_penalty": 1.1}, "ok"),
    "frequency_penalty": ({"frequency_penalty": 0.5}, "ok"),
    "presence_penalty": ({"presence_penalty": 0.5}, "ok"),
    "dry_multiplier": ({"dry_multiplier": 0.8}, "ok"),
    "dry_base": ({"dry_base": 2.0}, "ok"),
    "dry_allowed_length": ({"dry_allowed_length": 3}, "ok"),
    "dry_penalty_last_n": ({"dry_penalty_last_n": 128}, "ok"),
    "mirostat": ({"mirostat": 2}, "ok"),
    "mirostat_tau": ({"mirostat_tau": 4.0}, "ok"),
    "mirostat_eta": ({"mirostat_eta": 0.2}, "ok"),
    "adaptive_target": ({"adaptive_target": 0.5}, "ok"),
    "adaptive_decay": ({"adaptive_decay": 0.5}, "ok"),
    "seed": ({"seed": 42}, "ok"),
    "n_probs": ({"n_probs": 3}, "ok"),
    "min_keep": ({"min_keep": 2}, "ok"),
    # this server runs without -bs: asking for backend sampling is a 400 naming it
    "backend_sampling": ({"backend_sampling": True}, "refused"),
    "lora": ({"lora": []}, "ok"),
    "dry_sequence_breakers": ({"dry_sequence_breakers": ["\n"]}, "ok"),
    "json_schema": ({"json_schema": {"type": "object"}}, "ok"),
    "grammar": ({"grammar": 'root ::= "a"'}, "ok"),
    "grammar_lazy": ({"grammar_lazy": True}, "refused"),
    "chat_format": ({"chat_format": 1}, "refused"),
    "generation_prompt": ({"generation_prompt": "x"}, "refused"),
    "parse_tool_calls": ({"parse_tool_calls": True}, "refused"),
    "chat_parser": ({"chat_parser": "x"}, "refused"),
    "echo": ({"echo": True}, "refused"),
    "preserved_tokens": ({"preserved_tokens": ["<x>"]}, "refused"),
    "grammar_triggers": ({"grammar_triggers": [{"type": 0, "value": "x"}]}, "refused"),
    "reasoning_control": ({"reasoning_control": True}, "refused"),
    "reasoning_budget_tokens": ({"reasoning_budget_tokens": 4, **BUDGET_TAGS}, "ok"),
    "reasoning_budget_start_tag": ({"reasoning_budget_tokens": 4, **BUDGET_TAGS}, "ok"),
    "reasoning_budget_end_tags": ({"reasoning_budget_tokens": 4, **BUDGET_TAGS}, "ok"),
    "reasoning_budget_end_tag": (
        {"reasoning_budget_tokens": 4, "reasoning_budget_start_tag": "<t>"}
        | {"reasoning_budget_end_tag": "</t>"},
        "ok",
    ),
    "reasoning_budget_message": (
        {"reasoning_budget_tokens": 4, "reasoning_budget_message": "Done.", **BUDGET_TAGS},
        "ok",
    ),
    "logit_bias": ({"logit_bias": {"1": -5}}, "ok"),
    "ignore_eos": ({"ignore_eos": True}, "ok"),
    "stop": ({"stop": ["x"]}, "ok"),
    "samplers": ({"samplers": "kt"}, "ok"),
}
NATIVE = COMMON | {
    "stream_options": ({"stream_options": {"include_usage": True}, "stream": True}, "refused"),
    "return_tokens": ({"return_tokens": True}, "ok"),
    "response_fields": ({"response_fields": ["content"]}, "ok"),
    "n": ({"n": 2}, "refused"),
    "logprobs": ({"logprobs": 3}, "ok"),
    "post_sampling_probs": ({"post_sampling_probs": True, "n_probs": 2}, "ok"),
    "reasoning_format": ({"reasoning_format": "deepseek"}, "refused"),
    "continue_final_message": ({"continue_final_message": True}, "refused"),
}
CHAT = COMMON | {
    "stream_options": ({"stream_options": {"include_usage": True}, "stream": True}, "ok"),
    "return_tokens": ({"return_tokens": True}, "refused"),
    "response_fields": ({"response_fields": ["content"]}, "refused"),
    "n": ({"n": 2}, "ok"),
    "logprobs": ({"logprobs": True, "top_logprobs": 2}, "ok"),
    "post_sampling_probs": ({"post_sampling_probs": True, "logprobs": True}, "ok"),
    "reasoning_format": ({"reasoning_format": "none"}, "ok"),
    "continue_final_message": (
        {"continue_final_message": True, "add_generation_prompt": False}
        | {"messages": [*USER, {"role": "assistant", "content": "Hello"}]},
        "ok",
    ),
}
# /completion's generation_settings echoes these: the value sent is the value run
ECHOED = {
    "top_k", "top_p", "min_p", "top_n_sigma", "xtc_probability", "xtc_threshold",
    "typical_p", "temperature", "dynatemp_range", "dynatemp_exponent", "repeat_last_n",
    "repeat_penalty", "frequency_penalty", "presence_penalty", "dry_multiplier", "dry_base",
    "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers", "mirostat",
    "mirostat_tau", "mirostat_eta", "adaptive_target", "adaptive_decay", "seed", "n_probs",
    "min_keep", "n_keep", "n_discard", "ignore_eos", "stop",
}  # fmt: skip


@pytest.fixture(scope="module")
def srv() -> Iterator[ServerProc]:
    s = ServerProc("-c", "4096", "-np", "2")
    yield s
    s.stop()


def test_every_field_is_classified():
    names = set(schema_fields())
    assert len(names) > 60, sorted(names)  # the parse found the schema
    assert names == set(NATIVE), (names - set(NATIVE), set(NATIVE) - names)
    assert names == set(CHAT), (names - set(CHAT), set(CHAT) - names)


def _post(s: ServerProc, path: str, body: dict[str, Any]) -> tuple[int, str, Any]:
    r = s.client.post(path, json=body)
    ctype = r.headers.get("content-type", "")
    data = r.json() if ctype.startswith("application/json") else None
    return r.status_code, r.text, data


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(float(a), float(b), rel_tol=1e-6)
    return a == b


@pytest.mark.parametrize("endpoint", ["/completion", "/v1/chat/completions"])
def test_each_field_honoured_or_refused_by_name(srv: ServerProc, endpoint: str):
    native = endpoint == "/completion"
    table = NATIVE if native else CHAT
    base: dict[str, Any] = (
        {"prompt": "Hello", "n_predict": 2} if native else {"messages": USER, "max_tokens": 2}
    )
    wrong = []
    for name in schema_fields():
        fragment, expect = table[name]
        status, text, data = _post(srv, endpoint, {**base, **fragment})
        if expect == "refused":
            if status != 400 or name not in text:
                wrong.append(f"{name}: expected a 400 naming it, got {status} {text[:200]}")
            continue
        if status != 200:
            wrong.append(f"{name}: expected 200, got {status} {text[:200]}")
            continue
        if native and name in ECHOED and data is not None:
            got = data["generation_settings"].get(name)
            if not _same(got, fragment[name]):
                wrong.append(f"{name}: sent {fragment[name]!r}, ran with {got!r}")
    assert wrong == []
    assert srv.client.get("/health").status_code == 200


def test_samplers_order_is_echoed(srv: ServerProc):
    body = {"prompt": "Hello", "n_predict": 1}
    got = _post(srv, "/completion", {**body, "samplers": ["Top-K", "temp", "dry"]})[2]
    assert got["generation_settings"]["samplers"] == ["top_k", "temperature", "dry"]
    default = _post(srv, "/completion", body)[2]["generation_settings"]["samplers"]
    assert default == [
        "penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
        "temperature",
    ]  # fmt: skip


# --- behaviour on the real model -------------------------------------------------------

CYCLE = "1 2 3 4 5 " * 5 + "1 2 3"
STORY = "Once upon a time, in a small village by the sea,"


def tokens(s: ServerProc, prompt: str, n: int = 16, **kw: Any) -> list[int]:
    """The token ids a lone /completion generates (same layout every call: cache off)."""
    body = {"prompt": prompt, "n_predict": n, "cache_prompt": False, "return_tokens": True}
    r = s.client.post("/completion", json={**body, **kw})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


# the model's own distribution at temperature 1, nothing truncated: what each sampler below
# changes is read off the chain's final distribution (post_sampling_probs), a rule that holds
# whatever the model's numbers are on this CPU
PLAIN = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 1}


def chain_probs(s: ServerProc, prompt: str, n: int = 20, **kw: Any) -> tuple[int, dict[int, float]]:
    """The first token a lone /completion samples, and the n likeliest candidates of the
    sampler chain's final distribution (id -> probability, those left at 0 absent)."""
    body = {"prompt": prompt, "n_predict": 1, "cache_prompt": False, "n_probs": n}
    body |= {"post_sampling_probs": True, **PLAIN, **kw}
    r = s.client.post("/completion", json=body)
    assert r.status_code == 200, r.text
    cp = r.json()["completion_probabilities"][0]
    return cp["id"], {t["id"]: t["prob"] for t in cp["top_probs"]}


def _ranked(p: dict[int, float]) -> list[int]:
    return sorted(p, key=lambda i: -p[i])


def test_dry_cuts_the_token_that_extends_a_cycle(srv: ServerProc):
    # the token that extends the repeated cycle: the one that followed the prompt's last
    # token each time before (tokenizer facts, not the model's choice)
    ids = srv.client.post("/tokenize", json={"content": CYCLE}).json()["tokens"]
    follows = {ids[i + 1] for i in range(len(ids) - 1) if ids[i] == ids[-1]}
    assert len(follows) == 1, ids
    (extend,) = follows
    _, plain = chain_probs(srv, CYCLE)
    assert plain.get(extend, 0.0) > 0.05, plain  # the model would copy the cycle
    dry_kw = {"dry_multiplier": 0.8, "dry_allowed_length": 2}
    picked, dry = chain_probs(srv, CYCLE, **dry_kw)
    # DRY's penalty grows with the repeat's length (here ~50 tokens): the token is gone
    assert dry.get(extend, 0.0) < plain[extend] / 100, (plain, dry)
    assert picked != extend
    # its window and multiplier matter: either off leaves the distribution as it was
    for off in ({"dry_penalty_last_n": 0}, {"dry_multiplier": 0.0}):
        same = chain_probs(srv, CYCLE, **{**dry_kw, **off})[1]
        assert same.keys() == plain.keys(), off
        assert all(abs(same[i] - plain[i]) < 1e-6 for i in plain), (off, same, plain)
    # and seeded generation under DRY repeats itself (the same layout: the same tokens)
    kw = {"temperature": 0, **dry_kw}
    assert tokens(srv, CYCLE, **kw) == tokens(srv, CYCLE, **kw)


def test_xtc_removes_the_likeliest_above_its_threshold(srv: ServerProc):
    _, plain = chain_probs(srv, STORY)
    p1, p2, p3 = (plain[i] for i in _ranked(plain)[:3])
    top1, top2 = _ranked(plain)[:2]
    assert p2 > p3, plain  # a threshold between them: exactly the top two are above it
    thr = (p2 + p3) / 2
    _, xtc = chain_probs(srv, STORY, xtc_probability=1.0, xtc_threshold=thr)
    # XTC drops every candidate above the threshold but the least likely of them
    assert top1 not in xtc, (plain, xtc)
    assert _ranked(xtc)[0] == top2
    assert xtc[top2] == pytest.approx(p2 / (1 - p1), rel=1e-3)
    # a threshold above 0.5 turns it off
    off = chain_probs(srv, STORY, xtc_probability=1.0, xtc_threshold=0.6)[1]
    assert all(abs(off[i] - plain[i]) < 1e-6 for i in plain)


def test_mirostat_truncates_the_distribution(srv: ServerProc):
    _, plain = chain_probs(srv, STORY)
    ranked = _ranked(plain)
    for mode in (1, 2):
        _, m = chain_probs(srv, STORY, mirostat=mode)
        # a top-k style cut of the same distribution: the same order, every survivor
        # scaled by one factor (1 / the mass kept), and some mass cut at tau 5
        shared = [i for i in ranked if i in m]
        assert shared == _ranked(m)[: len(shared)] and shared == ranked[: len(shared)], m
        scale = m[ranked[0]] / plain[ranked[0]]
        assert all(m[i] / plain[i] == pytest.approx(scale, rel=1e-3) for i in shared), m
        assert scale > 1.01, (mode, plain, m)
    # mirostat 2 keeps the tokens whose surprise is under mu = 2 tau (bits): with mu
    # between the second and third likeliest, exactly those two
    p1, p2, p3 = (plain[i] for i in ranked[:3])
    assert p2 > p3, plain
    mu = (-math.log2(p2) - math.log2(p3)) / 2
    _, m2 = chain_probs(srv, STORY, mirostat=2, mirostat_tau=mu / 2)
    assert m2.keys() == set(ranked[:2]), (plain, m2)
    assert m2[ranked[0]] == pytest.approx(p1 / (p1 + p2), rel=1e-3)


def test_typical_sigma_dynatemp_change_the_distribution(srv: ServerProc):
    _, plain = chain_probs(srv, STORY)
    fields = {"typical_p": 0.5, "top_n_sigma": 1.0, "dynatemp_range": 0.5}
    _, got = chain_probs(srv, STORY, **fields)
    assert max(abs(got.get(i, 0.0) - plain[i]) for i in plain) > 0.02, (plain, got)


@pytest.mark.parametrize(
    "fields",
    [
        {"xtc_probability": 1.0, "xtc_threshold": 0.05},
        {"mirostat": 1, "temperature": 1.0},
        {"mirostat": 2, "temperature": 1.0},
        {"typical_p": 0.5, "top_n_sigma": 1.0, "dynatemp_range": 0.5, "temperature": 1.0},
    ],
    ids=["xtc", "mirostat1", "mirostat2", "typical-sigma-dynatemp"],
)
def test_seeded_samplers_repeat(srv: ServerProc, fields: dict[str, Any]):
    """The same seed, the same layout: the same tokens (what each sampler does to the
    distribution is checked above, not here: which tokens a seed draws is the CPU's)."""
    first = tokens(srv, STORY, seed=7, **{"temperature": 0, **fields})
    second = tokens(srv, STORY, seed=7, **{"temperature": 0, **fields})
    assert first == second


def test_samplers_order_in_both_forms(srv: ServerProc):
    kw = {"temperature": 1.0, "seed": 11}
    letters = tokens(srv, STORY, samplers="kt", **kw)
    names = tokens(srv, STORY, samplers=["top_k", "temperature"], **kw)
    kebab = tokens(srv, STORY, samplers=["TOP-K", "temp"], **kw)
    assert letters == names == kebab
    chat = srv.client.post(
        "/v1/chat/completions",
        json={"messages": USER, "max_tokens": 4, "samplers": "kt", "seed": 11},
    )
    assert chat.status_code == 200, chat.text


@pytest.mark.parametrize(
    "field,value",
    [
        ("dry_base", 0.5),
        ("dry_multiplier", -1),
        ("dry_allowed_length", -2),
        ("dry_penalty_last_n", -5),
        ("dry_sequence_breakers", []),
        ("dry_sequence_breakers", "\n"),
        ("xtc_probability", 2),
        ("xtc_threshold", -0.1),
        ("typical_p", 1.5),
        ("mirostat", 3),
        ("mirostat_tau", -1),
        ("min_keep", -1),
        ("samplers", "kz"),
        ("samplers", ["top_k", "nope"]),
        ("samplers", 5),
        ("adaptive_decay", 1.0),
        ("reasoning_budget_tokens", -2),
    ],
)
@pytest.mark.parametrize("endpoint", ["/completion", "/v1/chat/completions"])
def test_bad_values_are_400_naming_the_field(srv: ServerProc, endpoint, field, value):
    base: dict[str, Any] = (
        {"prompt": "Hello", "n_predict": 1}
        if endpoint == "/completion"
        else {"messages": USER, "max_tokens": 1}
    )
    r = srv.client.post(endpoint, json={**base, field: value})
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


def test_budget_on_completion_needs_its_tags(srv: ServerProc):
    r = srv.client.post(
        "/completion", json={"prompt": "Hi", "n_predict": 1, "reasoning_budget_tokens": 3}
    )
    assert r.status_code == 400 and "reasoning_budget_start_tag" in r.text
    r = srv.client.post(
        "/completion",
        json={
            "prompt": "Hi",
            "n_predict": 1,
            "reasoning_budget_tokens": 3,
            "reasoning_budget_start_tag": "<think>",
        },
    )
    assert r.status_code == 400 and "reasoning_budget_end_tags" in r.text


# --- backend sampling (-bs) ------------------------------------------------------------


def fallbacks(s: ServerProc) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in s.client.get("/metrics").text.splitlines():
        m = re.match(r'llamaslot_backend_sampling_fallbacks_total\{reason="(\w+)"\} (\S+)', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def test_backend_sampling_falls_back_for_cpu_only_samplers(make_server):
    s = make_server("-bs", "--metrics", "-c", "2048", "-np", "1")
    cases = [
        ({"dry_multiplier": 0.8}, "samplers"),
        ({"xtc_probability": 0.5, "xtc_threshold": 0.1}, "samplers"),
        ({"mirostat": 2}, "samplers"),
        ({"typical_p": 0.5}, "samplers"),
        ({"backend_sampling": False}, "request"),
    ]
    for fields, reason in cases:
        before = fallbacks(s).get(reason, 0.0)
        toks = tokens(s, STORY, n=4, seed=3, **fields)
        assert len(toks) == 4
        assert fallbacks(s).get(reason, 0.0) == before + 1, (fields, fallbacks(s))
    # what the backend chain runs stays there: dynamic temperature and min_keep
    r = s.client.post(
        "/completion",
        json={"prompt": STORY, "n_predict": 2, "dynatemp_range": 0.3, "backend_sampling": True},
    )
    assert r.status_code == 200, r.text
