"""return_progress: llama-server's prompt_progress events over a long prompt decoded in
several chunks (-b/-ub 256), on /completion and chat; without it the stream is unchanged."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from .conftest import ServerProc, long_text


@pytest.fixture(scope="module")
def small_batch() -> Iterator[ServerProc]:
    s = ServerProc("-b", "256", "-ub", "256", "-np", "1")
    yield s
    s.stop()


def _events(s: ServerProc, path: str, body: dict) -> list[dict]:
    out = []
    with s.client.stream("POST", path, json=body, timeout=600) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def _check_progress(progress: list[dict], total: int, min_events: int) -> None:
    """Monotonic, ending at the prompt's whole length, starting at its cached part."""
    assert len(progress) >= min_events, progress
    assert all(p["total"] == total for p in progress)
    assert progress[0]["processed"] == progress[0]["cache"]
    assert progress[-1]["processed"] == total
    done = [p["processed"] for p in progress]
    assert done == sorted(done) and len(set(done)) == len(done)
    times = [p["time_ms"] for p in progress]
    assert times == sorted(times)


def test_completion_progress_over_a_long_prompt(small_batch: ServerProc) -> None:
    prompt = long_text(1400)
    n_prompt = len(small_batch.tokenize(prompt))
    assert n_prompt > 1500
    # three tokens of text whatever greedy would write (which differs between CPUs): no end
    # of generation (ignore_eos), and each token letters or spaces (a grammar), never an
    # empty piece
    body = {"prompt": prompt, "n_predict": 3, "stream": True, "temperature": 0}
    body |= {"ignore_eos": True, "grammar": "root ::= [a-z ]+"}
    events = _events(small_batch, "/completion", {**body, "return_progress": True})
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    # a first event, then one per 256-token chunk at least
    _check_progress(progress, n_prompt, min_events=1 + n_prompt // 256)
    first_text = next(i for i, e in enumerate(events) if e["content"])
    assert all("prompt_progress" not in e for e in events[first_text:])
    assert all(e["content"] == "" and e["stop"] is False for e in events[:first_text])
    assert events[-1]["stop"] is True and events[-1]["tokens_evaluated"] == n_prompt
    assert events[-1]["tokens_predicted"] == 3

    # the same request without return_progress (its prompt now cached): no progress, and
    # the stream is the text chunks and the final object only
    plain = _events(small_batch, "/completion", body)
    assert not any("prompt_progress" in e for e in plain)
    assert all(e["content"] for e in plain[:-1]) and plain[-1]["stop"] is True
    assert len(plain) == plain[-1]["tokens_predicted"] + 1


def test_chat_progress(small_batch: ServerProc) -> None:
    messages = [{"role": "user", "content": long_text(500, seed=3) + " Summarize."}]
    prompt = small_batch.client.post("/apply-template", json={"messages": messages}).json()
    n_prompt = len(small_batch.tokenize(prompt["prompt"], add_special=False))
    # ignore_eos: the answer runs to its limit whether or not greedy would end the turn
    # first (which differs between CPUs)
    body = {"messages": messages, "max_tokens": 3, "stream": True, "temperature": 0}
    body["ignore_eos"] = True
    events = _events(small_batch, "/v1/chat/completions", {**body, "return_progress": True})
    with_progress = [e for e in events if "prompt_progress" in e]
    for e in with_progress:
        assert e["object"] == "chat.completion.chunk"
        assert e["choices"][0]["delta"] == {"role": "assistant", "content": None}
    _check_progress([e["prompt_progress"] for e in with_progress], n_prompt, min_events=3)
    assert events[-1]["choices"][0]["finish_reason"] == "length"

    plain = _events(small_batch, "/v1/chat/completions", body)
    assert not any("prompt_progress" in e for e in plain)
    assert plain[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
