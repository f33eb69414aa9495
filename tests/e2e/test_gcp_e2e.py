"""Vertex AI prediction (AIP_MODE=PREDICTION, as llama-server): /predict runs each instance
through the route its @requestFormat names, all at once, answered in order."""

from __future__ import annotations

import httpx
import pytest

from .conftest import ServerProc, free_port

KEY = "gcp-key"


@pytest.fixture(scope="module")
def srv():
    port = free_port()
    env = {"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": str(port), "AIP_HEALTH_ROUTE": "healthz"}
    # --port names another port: AIP_HTTP_PORT wins, as in llama-server
    s = ServerProc("-np", "2", "--api-key", KEY, "--port", str(free_port()), env=env, port=port)
    s.client.headers["Authorization"] = f"Bearer {KEY}"
    yield s
    s.stop()


def chat(text: str, **kw) -> dict:
    return {
        "@requestFormat": "chatCompletions",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": text}],
        **kw,
    }


def test_instances_answer_in_order_through_their_routes(srv):
    instances = [
        chat("Say hello"),
        chat("Say world", stream=True),  # streaming is off here
        {
            "@requestFormat": "/v1/messages",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
        },
        {"@requestFormat": "tokenize", "content": "hello world"},
        {"@requestFormat": "noSuchRoute"},
        {"max_tokens": 4},
        chat("x", max_tokens=-5),
    ]
    r = srv.client.post("/predict", json={"instances": instances})
    assert r.status_code == 200, r.text
    p = r.json()["predictions"]
    assert len(p) == len(instances)
    for answer in p[:2]:
        assert answer["object"] == "chat.completion"
        assert answer["choices"][0]["message"]["role"] == "assistant"
        assert answer["usage"]["completion_tokens"] > 0
    assert p[2]["type"] == "message" and p[2]["usage"]["output_tokens"] > 0
    assert p[3]["tokens"] == srv.tokenize("hello world", add_special=False)
    assert p[4]["error"]["message"] == "no handler registered for @requestFormat: noSuchRoute"
    assert p[5]["error"]["message"] == "each instance must include a string @requestFormat"
    assert p[6]["error"]["code"] == 400  # the route's own validation error
    assert srv.wait_idle()


def test_bad_bodies_and_keys(srv):
    assert srv.client.post("/predict", json={"nope": 1}).status_code == 400
    many = srv.client.post("/predict", json={"instances": [{}] * 129})
    assert many.status_code == 400 and "128" in many.json()["error"]["message"]
    assert httpx.post(srv.url + "/predict", json={"instances": []}).status_code == 401
    # the health route Vertex probes is public, as /health is
    assert httpx.get(srv.url + "/healthz").json() == {"status": "ok"}
