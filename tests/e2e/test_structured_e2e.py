"""Structured outputs end to end: constrained decoding on the real model, through the openai
SDK and llama-server's native fields; bad schemas and refused fields are 400s."""

from __future__ import annotations

import enum
import json
import math
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

# The model is a weak 270M base: schemas bound strings and arrays, the server bounds
# whitespace and numbers, so every answer ends well inside max_tokens.
MAX_TOKENS = 400


class Role(str, enum.Enum):
    engineer = "engineer"
    teacher = "teacher"
    doctor = "doctor"
    artist = "artist"


class Address(BaseModel):
    city: str = Field(max_length=16)


class Person(BaseModel):
    """Nested object, enum, array and optional field, each bounded: ~60 tokens an answer."""

    name: str = Field(max_length=16)
    role: Role
    address: Address
    skills: list[Annotated[str, Field(max_length=12)]] = Field(max_length=2)
    nickname: str | None = Field(default=None, max_length=12)


PROMPTS = [
    f"Describe a {adj} {job} from {place} as JSON."
    for adj, job, place in [
        ("young", "engineer", "Norway"),
        ("retired", "teacher", "Kenya"),
        ("busy", "doctor", "Brazil"),
        ("famous", "artist", "Japan"),
        ("curious", "engineer", "Canada"),
        ("kind", "teacher", "Peru"),
        ("tired", "doctor", "India"),
        ("bold", "artist", "Mexico"),
        ("quiet", "engineer", "Egypt"),
        ("cheerful", "teacher", "Spain"),
        ("careful", "doctor", "Chile"),
        ("restless", "artist", "Italy"),
        ("patient", "engineer", "Vietnam"),
        ("strict", "teacher", "Poland"),
        ("calm", "doctor", "Ghana"),
        ("playful", "artist", "France"),
        ("clever", "engineer", "Korea"),
        ("gentle", "teacher", "Ireland"),
        ("brave", "doctor", "Nepal"),
        ("shy", "artist", "Morocco"),
    ]
]

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120)


def test_sdk_parse_helper_returns_a_parsed_object_for_every_prompt(oai):
    schema = openai.lib._pydantic.to_strict_json_schema(Person)

    def ask(prompt: str):
        r = oai.chat.completions.parse(
            model="x",
            messages=[{"role": "user", "content": prompt}],
            response_format=Person,
            max_tokens=MAX_TOKENS,
            temperature=0.7,
        )
        return r.choices[0]

    # four at a time: the server's four slots decode them in one batch
    with ThreadPoolExecutor(4) as pool:
        choices = list(pool.map(ask, PROMPTS))
    for c in choices:
        assert c.finish_reason == "stop"
        assert isinstance(c.message.parsed, Person), c.message.content
        jsonschema.validate(json.loads(c.message.content), schema)


def test_stream_of_a_constrained_chat_is_valid_json(oai):
    rf = {
        "type": "json_schema",
        "json_schema": {"name": "p", "schema": PERSON_SCHEMA, "strict": True},
    }
    chunks = list(
        oai.chat.completions.create(
            model="x",
            messages=[{"role": "user", "content": "A person, as JSON."}],
            response_format=rf,
            max_tokens=MAX_TOKENS,
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)


def test_json_object_mode_starts_an_object(oai):
    r = oai.chat.completions.create(
        model="x",
        messages=[{"role": "user", "content": "Write an example"}],
        response_format={"type": "json_object"},
        max_tokens=10,
    )
    assert r.choices[0].message.content.startswith("{")


def test_logprobs_of_a_constrained_slot_are_the_constrained_distribution(oai):
    # the const leaves one token allowed at each step: log-probability 0, nothing else listed
    r = oai.chat.completions.create(
        model="x",
        messages=[{"role": "user", "content": "Say something"}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "c", "schema": {"const": "42"}},
        },
        max_tokens=10,
        logprobs=True,
        top_logprobs=3,
    )
    c = r.choices[0]
    assert c.message.content == '"42"' and c.finish_reason == "stop"
    for t in c.logprobs.content:
        assert math.isclose(t.logprob, 0.0, abs_tol=1e-4)
        assert [x.token for x in t.top_logprobs] == [t.token]  # refused tokens are not listed


def test_constrained_and_free_requests_share_the_batch(server, oai):
    def constrained():
        return server.client.post(
            "/completion",
            json={
                "prompt": "Numbers:",
                "json_schema": {"type": "array", "items": {"type": "integer"}, "maxItems": 50},
                "n_predict": 60,
            },
        ).json()

    def free():
        # ignore_eos: 40 tokens whatever the random seed samples (an early end included)
        body = {"prompt": "Once upon a time", "n_predict": 40, "ignore_eos": True}
        return server.client.post("/completion", json=body).json()

    with ThreadPoolExecutor(2) as pool:
        a, b = pool.submit(constrained), pool.submit(free)
        ra, rb = a.result(), b.result()
    assert rb["tokens_predicted"] == 40
    if ra["stop_type"] == "eos":  # the array closed within n_predict
        assert isinstance(json.loads(ra["content"]), list)
    else:
        assert ra["content"].startswith("[")


# ---- llama-server's fields on the completion endpoints ----------------------------------


def test_native_completion_json_schema_and_grammar(server):
    r = server.client.post(
        "/completion",
        json={"prompt": "Person record:", "json_schema": PERSON_SCHEMA, "n_predict": MAX_TOKENS},
    ).json()
    assert r["stop_type"] == "eos", r
    jsonschema.validate(json.loads(r["content"]), PERSON_SCHEMA)
    g = 'root ::= ("yes" | "no") ", because " [a-z ]{1,20} "."'
    r = server.client.post(
        "/completion", json={"prompt": "Is the sky blue?", "grammar": g, "n_predict": 40}
    ).json()
    assert r["content"].startswith(("yes, because ", "no, because ")) and r["content"].endswith(".")
    assert r["stop_type"] == "eos"


def test_penalties_with_a_constraint(server):
    # penalties remember accepted tokens: the server samples without accepting, checks the
    # pick, and accepts only the final token (with n_probs: masks first)
    for n_probs in (0, 2):
        body = {
            "prompt": "Person record:",
            "json_schema": PERSON_SCHEMA,
            "n_predict": MAX_TOKENS,
            "repeat_penalty": 1.3,
            "presence_penalty": 0.5,
            "n_probs": n_probs,
        }
        r = server.client.post("/completion", json=body).json()
        assert r["stop_type"] == "eos", r
        jsonschema.validate(json.loads(r["content"]), PERSON_SCHEMA)


def test_v1_completions_json_schema_and_grammar(oai):
    r = oai.completions.create(
        model="x",
        prompt="Person record:",
        max_tokens=MAX_TOKENS,
        extra_body={"json_schema": PERSON_SCHEMA},
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), PERSON_SCHEMA)
    r = oai.completions.create(
        model="x",
        prompt="Pick colors:",
        max_tokens=20,
        extra_body={
            "grammar": 'root ::= ("red" | "green" | "blue") (", " ("red" | "green" | "blue")){0,2}'
        },
    )
    words = r.choices[0].text.split(", ")
    assert 1 <= len(words) <= 3 and set(words) <= {"red", "green", "blue"}


# ---- llama.cpp's own response_format cases (tools/server/tests/unit/test_chat_completion.py)


CHAT = [
    {"role": "system", "content": "You are a coding assistant."},
    {"role": "user", "content": "Write an example"},
]


@pytest.mark.parametrize(
    ("response_format", "n_predicted", "pattern"),
    [
        # upstream's regexes, where they are not about their model's words: "[ -3000 ]" there
        # is any tuple of one integer here (a draft-04 items list, read as llama.cpp reads
        # it), with room for 16 digits (one token each) and whitespace: 40 tokens, not 10
        ({"type": "json_object", "schema": {"const": "42"}}, 6, r'"42"'),
        (
            {"type": "json_object", "schema": {"items": [{"type": "integer"}]}},
            40,
            r"\[\s*-?[0-9]{1,16}\s*\]$",
        ),
        (
            {"type": "json_schema", "json_schema": {"schema": {"const": "foooooo"}}},
            10,
            r'"foooooo"',
        ),
        ({"type": "json_object"}, 10, r"\{"),
    ],
)
def test_llama_cpp_response_format_cases(server, response_format, n_predicted, pattern):
    body = {"max_tokens": n_predicted, "messages": CHAT, "response_format": response_format}
    r = server.client.post("/chat/completions", json=body)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["message"]["content"]
    assert re.match(pattern, content), content


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "sound"},
        {"type": "json_object", "schema": 123},
        {"type": "json_object", "schema": {"type": 123}},
        {"type": "json_object", "schema": {"type": "hiccup"}},
    ],
)
def test_llama_cpp_invalid_response_formats_are_400(server, response_format):
    body = {"max_tokens": 4, "messages": CHAT, "response_format": response_format}
    r = server.client.post("/chat/completions", json=body)
    assert r.status_code == 400 and "error" in r.json()


def test_llama_cpp_chat_json_schema_and_grammar_fields(server):
    body = {"max_tokens": 6, "messages": CHAT, "json_schema": {"const": "42"}}
    assert (
        server.client.post("/chat/completions", json=body).json()["choices"][0]["message"][
            "content"
        ]
        == '"42"'
    )
    body = {"max_tokens": 6, "messages": CHAT, "grammar": 'root ::= "a"{5,5}'}
    r = server.client.post("/chat/completions", json=body).json()
    assert (
        r["choices"][0]["message"]["content"] == "aaaaa"
        and r["choices"][0]["finish_reason"] == "stop"
    )
    body = {"max_tokens": 8, "messages": CHAT, "grammar": "root ::= this is (not valid GBNF"}
    r = server.client.post("/chat/completions", json=body)
    assert r.status_code == 400 and "error" in r.json()


# ---- fail closed --------------------------------------------------------------------------


def test_schema_that_cannot_be_compiled_is_400_naming_the_part(oai, server):
    bad = {"type": "object", "properties": {"when": {"type": "string", "pattern": "([0-9]"}}}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model="x",
            messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "b", "schema": bad}},
        )
    msg = e.value.body["message"]
    assert "response_format.json_schema.schema#/properties/when" in msg, msg
    r = server.client.post(
        "/completion",
        json={"prompt": "x", "json_schema": {"type": "object", "properties": {"a": {"not": {}}}}},
    )
    assert r.status_code == 400 and "json_schema#/properties/a" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("endpoint", "field", "value"),
    [
        ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
        ("/v1/chat/completions", "modalities", ["text", "audio"]),
        ("/v1/chat/completions", "prediction", {"type": "content", "content": "x"}),
        ("/v1/chat/completions", "web_search_options", {}),
        ("/v1/chat/completions", "store", True),
        ("/v1/completions", "suffix", "and then"),
        ("/v1/completions", "best_of", 3),
    ],
)
def test_known_but_unsupported_fields_are_400_naming_the_field(server, endpoint, field, value):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "prompt": "hi",
        "max_tokens": 2,
        field: value,
    }
    r = server.client.post(endpoint, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(field + ":")


def test_known_fields_that_ask_for_nothing_and_unknown_fields_pass(server):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "store": False,
        "modalities": ["text"],
        "no_such_field": 1,
    }
    assert server.client.post("/v1/chat/completions", json=body).status_code == 200
    r = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "hi", "max_tokens": 2, "best_of": 1, "suffix": ""},
    )
    assert r.status_code == 200
