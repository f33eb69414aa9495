"""Schemas and grammars that used to kill or freeze the server (issue 25, findings 1, 2, 6).

Each crash body ended the process with a segfault (llguidance overflowed its stack while
validating); each freeze body held the event loop for seconds to minutes, so /health and every
other client's stream stopped. Now: the crash bodies are 400s that name the limit, the server
lives, and while a slow body compiles (in a child process) a canary stream keeps flowing."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from .conftest import ServerProc


def ref_chain(n: int) -> dict:
    """``d_i = {"$ref": d_(i+1)}``, n links."""
    defs = {f"d_{i}": {"$ref": f"#/$defs/d_{i + 1}"} for i in range(n)}
    defs[f"d_{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d_0"}


def object_chain(n: int) -> dict:
    """n objects whose one property refers to the next."""
    defs = {
        f"d_{i}": {"type": "object", "properties": {"p": {"$ref": f"#/$defs/d_{i + 1}"}}}
        for i in range(n)
    }
    defs[f"d_{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d_0"}


def anchor_chain(n: int) -> dict:
    """n subschemas reached through ``$id`` / ``$anchor`` references, each to the next."""
    defs = {
        f"a{i}": {"$id": f"urn:a{i}", "$anchor": f"a{i}", "$ref": f"urn:a{i + 1}"} for i in range(n)
    }
    defs[f"a{n}"] = {"$id": f"urn:a{n}", "type": "integer"}
    return {"type": "object", "properties": {"x": {"$ref": "urn:a0"}}, "$defs": defs}


def rule_chain(n: int) -> str:
    """A GBNF grammar chaining n rules, listed from the end."""
    lines = [f'r{n} ::= "end"'] + [f'r{i} ::= "x" r{i + 1}' for i in range(n - 1, -1, -1)]
    return "\n".join([*lines, "root ::= r0"])


def slow_schema() -> dict:
    """About 50 KB: 1,000 references to a definition with 300 patterns, one of them bad; the
    error search used to recompile every subschema (101.6 s on the event loop)."""
    pats = [
        {"type": "string", "pattern": f"^(a|b)*{'c' * (i % 7)}[0-9]{{1,{i % 9 + 1}}}$"}
        for i in range(299)
    ]
    pats.append({"type": "string", "pattern": "^(unclosed"})
    props = {f"p{i}": {"$ref": "#/$defs/many"} for i in range(1000)}
    return {"type": "object", "properties": props, "$defs": {"many": {"anyOf": pats}}}


@pytest.fixture(scope="module")
def srv():
    s = ServerProc("-np", "2", "--constraint-timeout", "3")
    yield s
    s.stop()


def _alive(s: ServerProc) -> None:
    assert s.proc.poll() is None, s.log_path.read_text()[-3000:]
    assert s.client.get("/health").status_code == 200


def _assert_400(r: httpx.Response, *words: str) -> None:
    assert r.status_code == 400, r.text[:500]
    msg = r.json()["error"]["message"]
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize(
    "path,body,names",
    [
        (
            "/completion",
            lambda: {"prompt": "x", "grammar": rule_chain(5000)},
            "--constraint-max-depth",
        ),
        (
            "/completion",
            lambda: {"prompt": "x", "json_schema": ref_chain(4000)},
            "--constraint-max-depth",
        ),
        (
            "/completion",
            lambda: {"prompt": "x", "json_schema": object_chain(1000)},
            "--constraint-max-depth",
        ),
        (
            "/v1/chat/completions",
            lambda: {
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": ref_chain(3000)},
                },
            },
            "--constraint-max-depth",
        ),
        (
            "/v1/chat/completions",
            lambda: {
                "messages": [{"role": "user", "content": "hi"}],
                "tool_choice": "required",
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": anchor_chain(5000)},
                    }
                ],
            },
            "--constraint-max-depth",
        ),
    ],
    ids=["gbnf-rule-chain", "ref-chain", "object-chain", "chat-ref-chain", "tool-anchor-chain"],
)
def test_crash_bodies_are_400s_and_the_server_lives(srv, path, body, names):
    r = srv.client.post(path, json={**body(), "n_predict": 4, "max_tokens": 4})
    _assert_400(r, names)
    _alive(srv)


def test_a_body_past_the_static_limits_costs_a_child_not_the_server(make_server):
    """With the depth limit lifted, the chain reaches llguidance: in a compile child, which
    dies of it; the request gets a 400 and the server goes on."""
    s = make_server(
        "-np", "1", "--constraint-max-depth", "100000", "--constraint-max-bytes", "10000000"
    )
    r = s.client.post(
        "/completion", json={"prompt": "x", "n_predict": 2, "json_schema": ref_chain(5000)}
    )
    _assert_400(r, "the compiler failed on it")
    _alive(s)
    ok = s.client.post(
        "/completion", json={"prompt": "x", "n_predict": 2, "json_schema": {"type": "integer"}}
    )
    assert ok.status_code == 200, ok.text  # a new child took the dead one's place


def _canary(srv: ServerProc, gaps: list[float], stop: threading.Event) -> None:
    """Streams tokens until ``stop``; records the gaps between chunks."""
    body = {"prompt": "Count: one, two,", "n_predict": 4000, "stream": True, "ignore_eos": True}
    with (
        httpx.Client(base_url=srv.url, timeout=60) as c,
        c.stream("POST", "/completion", json=body) as r,
    ):
        last = None
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last = now
            if stop.is_set():
                return


def _health_latency(srv: ServerProc, out: list[float], stop: threading.Event) -> None:
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        while not stop.is_set():
            t = time.monotonic()
            c.get("/health")
            out.append(time.monotonic() - t)
            time.sleep(0.05)


@pytest.mark.parametrize(
    "body,why",
    [
        (lambda: {"prompt": "x", "json_schema": slow_schema()}, "#"),
        (
            lambda: {"prompt": "x", "json_schema": {"enum": [f"v{i}" for i in range(60000)]}},
            "--constraint-max-enum",
        ),
    ],
    ids=["slow-failing-schema", "huge-enum"],
)
def test_freeze_bodies_do_not_stop_other_clients(srv, body, why):
    gaps: list[float] = []
    health: list[float] = []
    stop = threading.Event()
    threads = [
        threading.Thread(target=_canary, args=(srv, gaps, stop)),
        threading.Thread(target=_health_latency, args=(srv, health, stop)),
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while len(gaps) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    n_before = len(gaps)
    t0 = time.monotonic()
    r = srv.client.post("/completion", json={**body(), "n_predict": 4})
    took = time.monotonic() - t0
    time.sleep(0.3)
    stop.set()
    for t in threads:
        t.join(60)
    _assert_400(r, why)
    during = gaps[n_before:]
    assert during, "the canary stream stopped"
    assert max(during) < 0.5, (max(during), took)
    assert max(health) < 0.5, max(health)
    # a failure is remembered: the same body again is answered at once
    t0 = time.monotonic()
    _assert_400(srv.client.post("/completion", json={**body(), "n_predict": 4}), why)
    assert time.monotonic() - t0 < max(1.0, took / 2), (time.monotonic() - t0, took)


def test_many_tools_are_bounded(srv):
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"f{i}",
                "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
            },
        }
        for i in range(200)
    ]
    r = srv.client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 2},
    )
    _assert_400(r, "--constraint-max-tools")


def test_small_wrong_answers_are_400s(srv):
    r = srv.client.post(
        "/completion", json={"prompt": "x", "n_predict": 4, "json_schema": {"$ref": "#"}}
    )
    _assert_400(r, "admits no output")
    _assert_400(srv.client.post("/completion", json={"prompt": "", "n_predict": 2}), "empty")
    _assert_400(
        srv.client.post(
            "/completion", json={"prompt": "x", "n_predict": 2, "logit_bias": {"5": "x"}}
        ),
        "logit_bias",
    )
    _alive(srv)


def test_schemas_still_constrain(srv):
    """The child compiles what the server then enforces: the output parses as the schema."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    r = srv.client.post(
        "/completion",
        json={
            "prompt": "A JSON object:",
            "n_predict": 256,
            "json_schema": schema,
            "temperature": 0,
        },
    )
    assert r.status_code == 200, r.text
    out = r.json()
    # whitespace is bounded, so the document ends well within 256 tokens, whatever is sampled
    assert out["stop_type"] != "limit", out
    assert 0 <= json.loads(out["content"])["n"] <= 9
