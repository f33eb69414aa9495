"""Metrics end to end: deltas equal the responses' timings; a real Prometheus scrapes them."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

from .conftest import ROOT, free_port, long_text


def scrape(server) -> dict[str, float]:
    text = server.client.get("/metrics").text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def delta(after, before, name):
    return after.get(name, 0.0) - before.get(name, 0.0)


@pytest.fixture(scope="module")
def msrv(request):
    from .conftest import ServerProc

    s = ServerProc("--metrics", "-np", "2", "-c", "4096")
    request.addfinalizer(s.stop)
    return s


def test_metrics_off_is_501(server):
    r = server.client.get("/metrics")
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"


def test_metric_deltas_match_response_timings(msrv):
    c = msrv.client
    before = scrape(msrv)
    timings = []

    def done(body, path="/completion"):
        r = c.post(path, json=body)
        r.raise_for_status()
        timings.append(r.json()["timings"])
        return r.json()

    base = long_text(150, seed=5)
    done({"prompt": base + " Question one?", "n_predict": 4, "temperature": 0})
    done({"prompt": base + " Question two?", "n_predict": 4, "temperature": 0})  # shared prefix
    convs = [f"Conversation {i}. " + long_text(120, seed=i + 10) for i in range(3)]
    first = [done({"prompt": p, "n_predict": 6, "temperature": 0}) for p in convs]
    restored = done(
        {"prompt": convs[0] + first[0]["content"] + " Next:", "n_predict": 4, "temperature": 0}
    )
    done(
        {"model": "x", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
        "/v1/chat/completions",
    )
    # a stream the client abandons: not counted in the llamacpp counters
    with httpx.stream(
        "POST",
        msrv.url + "/completion",
        timeout=60,
        json={
            "prompt": "Tell a long story.",
            "n_predict": 4000,
            "stream": True,
            "ignore_eos": True,
        },
    ) as s:
        for i, _ in enumerate(s.iter_lines()):
            if i >= 4:
                break
    msrv.wait_idle()
    after = scrape(msrv)
    assert restored["tokens_cached"] > 100  # a real RAM-cache restore happened
    assert delta(after, before, "llamacpp:prompt_tokens_total") == sum(
        t["prompt_n"] for t in timings
    )
    assert delta(after, before, "llamacpp:prompt_tokens_cached_total") == sum(
        t["cache_n"] for t in timings
    )
    assert delta(after, before, "llamacpp:tokens_predicted_total") == sum(
        t["predicted_n"] for t in timings
    )
    assert delta(after, before, "llamaslot_cancelled_predicted_tokens_total") >= 1
    assert after["llamacpp:requests_processing"] == 0
    assert delta(after, before, "llamaslot_cache_loads_total") >= 1
    assert (
        delta(after, before, 'llamaslot_requests_total{endpoint="/completion",outcome="ok"}') == 7
    )
    assert delta(after, before, "llamaslot_time_to_first_token_seconds_count") == 8


def test_promtool_finds_only_the_llama_server_colon_names(msrv):
    r = msrv.client.get("/metrics")
    text = r.text
    # llama-server's header, in its case: some clients look it up case-sensitively
    sent = {k: v for k, v in r.headers.raw}
    assert abs(int(sent[b"Process-Start-Time-Unix"]) - time.time()) < 3600
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    problems = [p for p in (r.stdout + r.stderr).splitlines() if p.strip()]
    # llama-server's names and vLLM's (the model-server protocol's, which llm-d reads) contain
    # ':' (kept so their dashboards and routers work); promtool's lint flags that rule only.
    # Everything else must be clean, and the exposition must parse.
    other = [
        p
        for p in problems
        if not re.match(r"^(llamacpp|vllm):\w+ metric names should not contain ':'$", p)
    ]
    assert other == []
    assert any(p.startswith("llamacpp:prompt_tokens_total") for p in problems)


def test_prometheus_scrapes_the_server(msrv, tmp_path: Path):
    cfg = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())
    job = cfg["scrape_configs"][0]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{msrv.port}"]}]
    job["scrape_interval"] = "1s"
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    prom = subprocess.Popen(
        [
            shutil.which("prometheus") or "prometheus",
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tempfile.mkdtemp(dir=tmp_path)}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        msrv.client.post(
            "/completion", json={"prompt": long_text(60, seed=9), "n_predict": 2}
        ).raise_for_status()
        r = msrv.client.post(
            "/completion", json={"prompt": long_text(60, seed=9) + " more", "n_predict": 2}
        )
        assert r.json()["tokens_cached"] > 0
        expected = scrape(msrv)["llamacpp:prompt_tokens_cached_total"]
        got = None
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                q = httpx.get(
                    f"http://127.0.0.1:{port}/api/v1/query",
                    params={"query": "llamacpp:prompt_tokens_cached_total"},
                    timeout=5,
                ).json()
                res = q["data"]["result"]
                if res:
                    got = float(res[0]["value"][1])
                    if got == expected:
                        break
            except (httpx.TransportError, json.JSONDecodeError, KeyError):
                pass
            time.sleep(0.5)
        assert got == expected
        assert res[0]["metric"]["job"] == "llama-slot-server"
    finally:
        prom.terminate()
        prom.wait(10)
