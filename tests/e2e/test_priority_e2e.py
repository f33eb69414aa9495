"""--scheduling-policy priority end to end: a high-priority request preempts one of four
low-priority streams that hold every slot; the preempted stream pauses, resumes from the
RAM cache without recomputing, and its answer arrives whole."""

from __future__ import annotations

import json
import threading

import httpx

LOW_TOKENS = 160
HIGH_TOKENS = 8


def metric(s, line_start: str) -> float:
    for line in s.client.get("/metrics").text.splitlines():
        if line.startswith(line_start):
            return float(line.split()[-1])
    raise KeyError(line_start)


def stream_completion(url: str, body: dict, chunks: list[dict], started: threading.Event) -> None:
    """POST a streamed /completion, keeping every chunk; ``started`` is set at the first."""
    with httpx.stream("POST", url + "/completion", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
                started.set()


def low_body(i: int) -> dict:
    return {
        "prompt": f"Stream {i}. Write a long list of animals, one per line:\n",
        "n_predict": LOW_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "timings_per_token": True,
        "priority": 10,
    }


def test_a_high_priority_request_preempts_a_low_stream_that_resumes_from_ram(make_server):
    s = make_server("-np", "4", "--scheduling-policy", "priority", "--metrics")
    lows: list[list[dict]] = [[] for _ in range(4)]
    started = [threading.Event() for _ in range(4)]
    threads = [
        threading.Thread(target=stream_completion, args=(s.url, low_body(i), lows[i], started[i]))
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for ev in started:
        assert ev.wait(300)
    assert all(x["is_processing"] for x in s.slots())  # four streams hold every slot
    high = s.client.post(
        "/completion",
        json={
            "prompt": "Name one colour:",
            "n_predict": HIGH_TOKENS,
            "ignore_eos": True,
            "temperature": 0,
            "priority": 0,
        },
        timeout=600,
    ).json()
    for t in threads:
        t.join(600)
    finals = [c[-1] for c in lows]
    assert all(f["stop"] for f in finals)
    preempted = [i for i, f in enumerate(finals) if f["timings"].get("preempted")]
    assert len(preempted) == 1, [f["timings"] for f in finals]
    v = preempted[0]
    vf = finals[v]
    t = vf["timings"]
    # the high request ran where the victim ran, and the victim came back to that slot once
    # it was free again (the three others held theirs to the end)
    assert high["tokens_predicted"] == HIGH_TOKENS and high["timings"].get("preempted") is None
    assert vf["id_slot"] == high["id_slot"]
    # whole answer: every token streamed once, counted once
    streamed = sum(len(c.get("tokens", [])) for c in lows[v][:-1])
    assert t["predicted_n"] == vf["tokens_predicted"] == LOW_TOKENS == streamed
    # resumed from the RAM cache: the prompt and the answer so far came back, nothing was
    # recomputed (cache_n: the whole prompt, prompt_n: 0)
    n_prompt = vf["tokens_evaluated"]
    assert (t["cache_n"], t["prompt_n"]) == (n_prompt, 0)
    assert n_prompt < t["resumed_n"] < n_prompt + LOW_TOKENS
    # the pause: the victim's chunks before and after its resume (timings_per_token) span
    # the whole high-priority request, by the server's own clock
    timed = [c["timings"] for c in lows[v][:-1] if "timings" in c]
    cut = next(i for i, x in enumerate(timed) if x.get("preempted"))
    # its KV held the prompt and every token sampled but the last (the next to decode)
    n_before = t["resumed_n"] - n_prompt + 1
    assert cut > 0 and timed[cut - 1]["predicted_n"] <= n_before < timed[cut]["predicted_n"]
    gap = timed[cut]["predicted_ms"] - timed[cut - 1]["predicted_ms"]
    assert gap >= high["timings"]["prompt_ms"] + high["timings"]["predicted_ms"]
    assert metric(s, 'llamaslot_priority_preemptions_total{priority="10"}') == 1
    assert metric(s, 'llamaslot_priority_requests_total{priority="0"}') == 1
    assert metric(s, 'llamaslot_priority_requests_total{priority="10"}') == 4
    s.wait_idle()
    s.assert_integrity()


def test_priority_is_refused_under_fcfs_and_bounded(make_server):
    s = make_server("-np", "1")
    r = s.client.post("/completion", json={"prompt": "Hi", "n_predict": 1, "priority": 3})
    assert r.status_code == 400 and "--scheduling-policy priority" in r.json()["error"]["message"]
    r = s.client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "priority": 2},
    )
    assert r.status_code == 400 and "--scheduling-policy" in r.json()["error"]["message"]
    r = s.client.post(  # Anthropic Messages: an extension field, as llama-server's own
        "/v1/messages",
        json={
            "model": "m",
            "max_tokens": 1,
            "messages": [{"role": "user", "content": "Hi"}],
            "priority": 1,
        },
    )
    assert r.status_code == 400 and "--scheduling-policy" in r.text
    ok = s.client.post("/completion", json={"prompt": "Hi", "n_predict": 1, "priority": 0})
    assert ok.status_code == 200
    big = s.client.post("/completion", json={"prompt": "Hi", "n_predict": 1, "priority": 10**9})
    assert big.status_code == 400
