"""Anthropic's Messages API end to end, through the real ``anthropic`` SDK (and raw HTTP for
the wire format): answers, streams, tools, token counts, keys and error shapes, on the
default model. Nothing asserts what the model writes; counts come from the server's own
accounting (usage, /slots, /metrics)."""

from __future__ import annotations

import json
import re
import threading
import time

import anthropic
import httpx
import jsonschema
import pytest

from .conftest import ServerProc, long_text

KEY = "anthropic-e2e-key"

WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
SEARCH = {
    "name": "search_docs",
    "description": "Search the project's documentation",
    "input_schema": {
        "type": "object",
        "properties": {"query": {"type": "string"}},
        "required": ["query"],
    },
}


@pytest.fixture(scope="module")
def srv():
    # two slots and no queue: a third concurrent request is refused (overloaded)
    s = ServerProc("-np", "2", "-c", "8192", "--api-key", KEY, "--max-queue", "0", "--metrics")
    s.client.headers["x-api-key"] = KEY
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0, timeout=120)


def events_of(srv: ServerProc, body: dict) -> list[tuple[str, dict]]:
    """A raw stream's (event name, data) pairs."""
    out = []
    with srv.client.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[6:])))
    return out


def assert_stream_grammar(events: list[tuple[str, dict]]) -> None:
    """Anthropic's order: message_start, pings, then blocks (start, deltas, stop, indices
    0, 1, ...), message_delta, message_stop; each data ``type`` is its event's name."""
    assert all(name == data["type"] for name, data in events), events
    names = " ".join(name for name, _ in events)
    block = r"content_block_start( content_block_delta)* content_block_stop"
    assert re.fullmatch(rf"message_start( ping)*( {block})* message_delta message_stop", names), (
        names
    )
    starts = [d["index"] for n, d in events if n == "content_block_start"]
    assert starts == list(range(len(starts)))
    index = -1
    for name, data in events:
        if name == "content_block_start":
            index = data["index"]
        elif name in ("content_block_delta", "content_block_stop"):
            assert data["index"] == index


def test_plain_and_system_prompts(client, srv):
    plain = client.messages.create(
        model="any", max_tokens=12, messages=[{"role": "user", "content": "Say hello"}]
    )
    assert plain.type == "message" and plain.role == "assistant"
    assert plain.id.startswith("msg_")
    assert plain.stop_reason in ("end_turn", "max_tokens")
    assert plain.usage.output_tokens > 0
    assert all(b.type == "text" for b in plain.content)
    model_id = srv.client.get("/v1/models").json()["data"][0]["id"]
    assert plain.model == model_id
    system = "You are a terse assistant that answers in one word."
    with_system = client.messages.create(
        model="any",
        max_tokens=12,
        system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "Say hello"}],
    )
    u, p = with_system.usage, plain.usage
    grown = len(srv.tokenize(system, add_special=False))
    total = lambda x: x.input_tokens + x.cache_read_input_tokens  # noqa: E731
    # the system prompt is in the prompt: at least its own tokens more
    assert total(u) >= total(p) + grown - 2


def test_multi_turn_history_is_rendered(client):
    turns = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hi there! How can I help?"}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "a joke"}],
        },
    ]
    n_all = client.messages.count_tokens(model="any", messages=turns).input_tokens
    n_last = client.messages.count_tokens(model="any", messages=turns[2:]).input_tokens
    assert n_all > n_last
    m = client.messages.create(model="any", max_tokens=8, messages=turns)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == n_all


def test_stream_event_order_and_sdk_accumulation(client, srv):
    body = {
        "model": "any",
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "Count to five"}],
    }
    events = events_of(srv, body)
    assert_stream_grammar(events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] > 0
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert deltas and all(d["type"] == "text_delta" for d in deltas)
    end = events[-2][1]
    assert end["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert end["usage"]["output_tokens"] > 0
    assert "timings" not in events[-1][1]
    with client.messages.stream(**body) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].text == text
    assert final.usage.output_tokens > 0 and final.stop_reason in ("end_turn", "max_tokens")


def test_long_prompt_stream_pings_while_the_prompt_is_processed(srv):
    # three ubatches of prompt: a progress event each, the first opening the message
    body = {
        "model": "any",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": long_text(1200, 3)}],
    }
    events = events_of(srv, body)
    assert_stream_grammar(events)
    assert sum(n == "ping" for n, _ in events) >= 2


def test_forced_tool_use_validates_against_its_schema(client):
    m = client.messages.create(
        model="any",
        max_tokens=200,
        tools=[WEATHER, SEARCH],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "What's the weather in Paris?"}],
    )
    assert m.stop_reason == "tool_use"
    (call,) = [b for b in m.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER["input_schema"])
    # a query string has no length bound: room enough that a verbose one still closes
    any_tool = client.messages.create(
        model="any",
        max_tokens=400,
        tools=[WEATHER, SEARCH],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "Find the install guide"}],
    )
    assert any_tool.stop_reason == "tool_use", any_tool.content
    (call,) = [b for b in any_tool.content if b.type == "tool_use"]
    tool = {"get_weather": WEATHER, "search_docs": SEARCH}[call.name]
    jsonschema.validate(call.input, tool["input_schema"])


def test_free_tool_use_is_consistent(client):
    # the model may or may not call: whichever it does, the answer is well formed
    m = client.messages.create(
        model="any",
        max_tokens=80,
        tools=[WEATHER],
        messages=[{"role": "user", "content": "What's the weather in Paris in celsius?"}],
    )
    calls = [b for b in m.content if b.type == "tool_use"]
    if m.stop_reason == "tool_use":
        assert calls
        for c in calls:
            assert c.name == "get_weather" and isinstance(c.input, dict)
    else:
        assert not calls and m.stop_reason in ("end_turn", "max_tokens")
    none = client.messages.create(
        model="any",
        max_tokens=20,
        tools=[WEATHER],
        tool_choice={"type": "none"},
        messages=[{"role": "user", "content": "What's the weather in Paris?"}],
    )
    assert not [b for b in none.content if b.type == "tool_use"]


def test_tool_result_round_trip(client):
    ask = [{"role": "user", "content": "What's the weather in Paris?"}]
    first = client.messages.create(
        model="any",
        max_tokens=80,
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=ask,
    )
    (call,) = [b for b in first.content if b.type == "tool_use"]
    history = [
        *ask,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
    ]
    result = "Sunny and 25 degrees, light wind from the west."
    answered = [
        *history,
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}],
        },
    ]
    second = client.messages.create(model="any", max_tokens=16, tools=[WEATHER], messages=answered)
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # the result is in the prompt: its tokens (and the call's) are counted
    without = client.messages.count_tokens(model="any", tools=[WEATHER], messages=ask).input_tokens
    n = client.messages.count_tokens(model="any", tools=[WEATHER], messages=answered).input_tokens
    assert n >= without + len(result.split())
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == n
    # the turn before is served from the cache: at least the first prompt
    assert second.usage.cache_read_input_tokens >= without - 1
    # an error result, and blocks as content, are taken too
    errored = [
        *history,
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": call.id,
                    "is_error": True,
                    "content": [{"type": "text", "text": "city not found"}],
                }
            ],
        },
    ]
    assert (
        client.messages.create(model="any", max_tokens=4, tools=[WEATHER], messages=errored).content
        is not None
    )


def test_streamed_input_json_deltas_join_into_the_input(client, srv):
    body = {
        "model": "any",
        "max_tokens": 80,
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        "messages": [{"role": "user", "content": "Weather in Oslo, in fahrenheit?"}],
    }
    events = events_of(srv, body)
    assert_stream_grammar(events)
    (start,) = [d for n, d in events if n == "content_block_start"]
    assert start["content_block"]["type"] == "tool_use" and start["content_block"]["input"] == {}
    pieces = [d["delta"]["partial_json"] for n, d in events if n == "content_block_delta"]
    joined = json.loads("".join(pieces))
    jsonschema.validate(joined, WEATHER["input_schema"])
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    with client.messages.stream(**body) as stream:
        final = stream.get_final_message()
    (call,) = final.content
    jsonschema.validate(call.input, WEATHER["input_schema"])


def test_count_tokens_equals_usage(client, srv):
    kw = {
        "model": "any",
        "system": "You answer briefly.",
        "tools": [WEATHER],
        "messages": [
            {"role": "user", "content": "Hi " + long_text(40, 5)},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "The user greets me.", "signature": ""},
                    {"type": "text", "text": "Hello!"},
                ],
            },
            {"role": "user", "content": "What can you do?"},
        ],
    }
    n = client.messages.count_tokens(**kw).input_tokens
    # with the cache off every prompt token is computed: input_tokens is the whole prompt
    cold = client.messages.create(max_tokens=4, extra_body={"cache_prompt": False}, **kw)
    assert cold.usage.input_tokens == n and cold.usage.cache_read_input_tokens == 0
    warm = client.messages.create(max_tokens=4, **kw)
    assert warm.usage.input_tokens + warm.usage.cache_read_input_tokens == n
    assert warm.usage.cache_creation_input_tokens == 0


def test_api_key_is_enforced(srv):
    body = {"model": "any", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    wrong = anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(**body)
    assert e.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "Invalid API Key"},
    }
    r = httpx.post(srv.url + "/v1/messages", json=body)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=srv.url, auth_token=KEY, max_retries=0)
    assert bearer.messages.create(**body).type == "message"
    versioned = httpx.post(
        srv.url + "/v1/messages",
        json=body,
        headers={
            "x-api-key": KEY,
            "anthropic-version": "2023-06-01",
            "anthropic-beta": "tools-2024-04-04",
        },
    )
    assert versioned.status_code == 200


BAD = [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    (
        {
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}],
        },
        "'video'",
    ),
    (
        {
            "max_tokens": 4,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}],
                }
            ],
        },
        "tool_use_id 't1'",
    ),
    (
        {
            "max_tokens": 4,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                        }
                    ],
                }
            ],
        },
        "multimodal projector",
    ),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]}, "role"),
    (
        {
            "max_tokens": 4,
            "messages": [],
            "tools": [{"type": "web_search_20250305", "name": "web_search"}],
        },
        "web_search_20250305",
    ),
    ({"max_tokens": 4, "messages": [], "tools": [{**WEATHER, "strict": True}]}, "strict"),
    ({"max_tokens": 4, "messages": [], "container": "c1"}, "container"),
    (
        {"max_tokens": 4, "messages": [], "thinking": {"type": "enabled", "budget_tokens": 8}},
        "budget_tokens",
    ),
    ({"max_tokens": 4, "messages": [], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
]


@pytest.mark.parametrize("body, named", BAD)
def test_bad_input_is_a_400_in_anthropics_shape(srv, body, named):
    r = srv.client.post("/v1/messages", json={"model": "any", **body})
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert named in err["error"]["message"]
    assert srv.client.get("/health").status_code == 200


def test_error_shapes_of_other_statuses(client, srv):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.batches.list()
    assert e.value.body["error"]["type"] == "not_found_error"
    # a failure mid-stream (the request's own timeout) is an error event, which the SDK raises
    long = {
        "model": "any",
        "max_tokens": 4000,
        "messages": [{"role": "user", "content": "Write a long story"}],
        "extra_body": {"timeout": 1, "ignore_eos": True},
    }
    with pytest.raises(anthropic.APIStatusError) as e, client.messages.stream(**long) as stream:
        for _ in stream:
            pass
    assert e.value.body == {
        "type": "error",
        "error": {"type": "timeout_error", "message": "the request timed out after 1 s"},
    }


def test_full_queue_is_overloaded(client, srv):
    # both slots held by streams (ended by closing them once the refusal is in)
    stop = threading.Event()
    long = {
        "model": "any",
        "max_tokens": 4000,
        "stream": True,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Write a long story"}],
    }

    statuses: list[int] = []

    def hold() -> None:
        with srv.client.stream("POST", "/v1/messages", json=long) as r:
            statuses.append(r.status_code)
            for _ in r.iter_lines():
                if stop.is_set():
                    break

    srv.wait_idle()  # no slot still ending an earlier test's request: both are taken here
    busy = [threading.Thread(target=hold) for _ in range(2)]
    for t in busy:
        t.start()
    try:
        deadline = time.time() + 60
        while sum(s["is_processing"] for s in srv.slots()) < 2 and time.time() < deadline:
            time.sleep(0.05)
        assert statuses == [200, 200]
        with pytest.raises(anthropic.APIStatusError) as e:
            client.messages.create(
                model="any", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
            )
        assert e.value.status_code == 503
        assert e.value.body["error"]["type"] == "overloaded_error"
        assert e.value.response.headers["retry-after"] == "1"
    finally:
        stop.set()
        for t in busy:
            t.join()
        srv.wait_idle()


def scrape(srv: ServerProc) -> dict[str, float]:
    out = {}
    for line in srv.client.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_agent_conversation_reads_follow_ups_from_the_cache(client, srv):
    """System prompt and tools, a tool call, its result, then a question: every follow-up
    turn's prompt is >= 90 % cache reads, and /slots and the metrics count the same."""
    system = "You are a coding agent. Project notes follow.\n" + long_text(900, 1)
    tools = [WEATHER, SEARCH]
    messages: list[dict] = [{"role": "user", "content": "Read the notes. " + long_text(300, 2)}]
    srv.wait_idle()
    for turn in range(4):
        before = scrape(srv)
        forced = {"type": "tool", "name": "search_docs", "disable_parallel_tool_use": True}
        m = client.messages.create(
            model="any",
            max_tokens=40,
            system=system,
            tools=tools,
            tool_choice=forced if turn % 2 == 0 else {"type": "auto"},
            messages=messages,
        )
        u = m.usage
        total = u.input_tokens + u.cache_read_input_tokens
        assert (
            total
            == client.messages.count_tokens(
                model="any", system=system, tools=tools, messages=messages
            ).input_tokens
        )
        if turn == 0:
            assert total > 1500
        else:
            assert u.cache_read_input_tokens >= 0.9 * total, (turn, u)
        after = scrape(srv)
        assert (
            after["llamacpp:prompt_tokens_cached_total"]
            - before["llamacpp:prompt_tokens_cached_total"]
            == u.cache_read_input_tokens
        )
        assert (
            after["llamacpp:prompt_tokens_total"] - before["llamacpp:prompt_tokens_total"]
            == u.input_tokens
        )
        (slot,) = [s for s in srv.wait_idle() if s["n_prompt_tokens"] == total]
        assert slot["n_prompt_tokens_cache"] == u.cache_read_input_tokens
        messages.append(
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]}
        )
        calls = [b for b in m.content if b.type == "tool_use"]
        if calls:
            result = [
                {"type": "tool_result", "tool_use_id": c.id, "content": "Found: install with pip."}
                for c in calls
            ]
            messages.append({"role": "user", "content": result})
        else:
            messages.append({"role": "user", "content": "Thanks. Next step?"})
    srv.assert_integrity()


def test_models_list_and_retrieve_with_the_sdk(client, srv):
    (m,) = client.models.list().data
    assert m.type == "model" and m.id == srv.client.get("/v1/models").json()["data"][0]["id"]
    assert m.display_name == m.id and m.created_at.year >= 2024
    assert client.models.retrieve(m.id).id == m.id
    with pytest.raises(anthropic.NotFoundError):
        client.models.retrieve("claude-not-here")


# reasoning, the close, then content: a template that opens <think> (DeepSeek R1's) starts
# the answer in the reasoning (what a seed writes differs between CPUs: a grammar forces both)
THINK_THEN_TEXT = 'root ::= [a-z] [a-z ]{5,15} "</think>" [a-z ]{3,10}'


def test_thinking_blocks(make_server):
    from tests.llama_sdist import vendored

    tpl = vendored("models/templates/llama-cpp-deepseek-r1.jinja")
    s = make_server("--chat-template-file", str(tpl), "-np", "1")
    body = {
        "model": "any",
        "max_tokens": 60,
        "thinking": {"type": "enabled", "budget_tokens": 40},
        "grammar": THINK_THEN_TEXT,
        "messages": [{"role": "user", "content": "What is 2+2?"}],
    }
    m = s.client.post("/v1/messages", json=body).json()
    thinking, text = m["content"]
    assert thinking["type"] == "thinking" and thinking["thinking"] and thinking["signature"] == ""
    assert text["type"] == "text" and text["text"]
    events = events_of(s, body)
    assert_stream_grammar(events)
    kinds = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
    assert kinds == ["thinking", "text"]
    first = [
        d["delta"]["type"] for n, d in events if n == "content_block_delta" and d["index"] == 0
    ]
    assert set(first[:-1]) == {"thinking_delta"} and first[-1] == "signature_delta"
    streamed = "".join(
        d["delta"].get("thinking", "") for n, d in events if n == "content_block_delta"
    )
    assert streamed.strip() and "</think>" not in streamed
    omitted = {**body, "thinking": {"type": "enabled", "budget_tokens": 40, "display": "omitted"}}
    blocks = s.client.post("/v1/messages", json=omitted).json()["content"]
    assert blocks[0] == {"type": "thinking", "thinking": "", "signature": ""}
    # thinking blocks of the history reach a template that renders reasoning
    client = anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0)
    history = [
        {"role": "user", "content": "Fix the bug"},
        {"role": "assistant", "content": [{"type": "text", "text": "Done."}]},
        {"role": "user", "content": "Thanks"},
    ]
    with_thinking = [
        history[0],
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "look at main.py", "signature": ""},
                *history[1]["content"],
            ],
        },
        history[2],
    ]
    n = client.messages.count_tokens(model="any", messages=history).input_tokens
    assert client.messages.count_tokens(model="any", messages=with_thinking).input_tokens >= n
