"""--sleep-idle-seconds end to end: the model is freed when idle (resident memory falls),
read-only endpoints leave it asleep, a task wakes it, and with --cache-disk a long
conversation resumes from the disk tier after waking. Also per instance in router mode."""

from __future__ import annotations

import json
import threading
import time

import httpx

from .conftest import ServerProc, long_text, smollm2_path, vm_rss_kib


def wait_sleeping(s: ServerProc, want: bool = True, timeout: float = 20, **params) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if s.client.get("/props", params=params).json()["is_sleeping"] is want:
            return
        time.sleep(0.1)
    raise AssertionError(f"is_sleeping never became {want}")


def test_sleep_frees_memory_and_disk_tier_carries_the_conversation(make_server, tmp_path):
    s = make_server(
        "--sleep-idle-seconds", "1", "--metrics", "--cache-disk", str(tmp_path / "disk")
    )
    prompt = long_text(1400)
    first = s.client.post(
        "/completion", json={"prompt": prompt, "n_predict": 4, "ignore_eos": True}
    )
    assert first.status_code == 200
    n_first = first.json()["tokens_evaluated"]
    assert n_first > 1500
    awake = vm_rss_kib(s.proc.pid)
    wait_sleeping(s)
    asleep = vm_rss_kib(s.proc.pid)
    # the model file alone is 253 MB (mapped, so resident once read), plus context and KV
    assert awake - asleep > 200_000, (awake, asleep)
    # read-only endpoints answer and neither wake it nor reset its timer
    for _ in range(3):
        assert s.client.get("/health").status_code == 200
        assert s.client.get("/models").status_code == 200
        assert "llamacpp:tokens_predicted_total 4.0" in s.client.get("/metrics").text
        time.sleep(0.4)
    assert s.client.get("/props").json()["is_sleeping"] is True
    # a task wakes it and waits: the follow-up resumes from the disk tier
    follow = prompt + first.json()["content"] + " And then the next chapter began."
    r = s.client.post("/completion", json={"prompt": follow, "n_predict": 2, "ignore_eos": True})
    assert r.status_code == 200
    body = r.json()
    total = body["tokens_evaluated"]
    assert total > n_first and body["tokens_cached"] >= 0.9 * total, body["timings"]
    assert s.client.get("/props").json()["is_sleeping"] is False


def test_tokenize_wakes_it(make_server):
    s = make_server("--sleep-idle-seconds", "1", "-m", smollm2_path())
    wait_sleeping(s)
    assert s.client.post("/tokenize", json={"content": "Hello"}).status_code == 200
    assert s.client.get("/props").json()["is_sleeping"] is False
    wait_sleeping(s)  # and it falls asleep again


def test_router_instance_sleeps_and_wakes(make_server, tmp_path):
    (tmp_path / "small.gguf").symlink_to(smollm2_path())
    r = make_server("--models-dir", str(tmp_path), "--sleep-idle-seconds", "1")
    events: list[dict] = []
    ready = threading.Event()

    def listen() -> None:
        with httpx.Client(base_url=r.url, timeout=60) as c, c.stream("GET", "/models/sse") as s:
            ready.set()
            for line in s.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))

    threading.Thread(target=listen, daemon=True).start()
    assert ready.wait(10)
    body = {"model": "small", "prompt": "Hi", "n_predict": 2}
    assert r.client.post("/completion", json=body).status_code == 200

    def status() -> str:
        return {m["id"]: m["status"]["value"] for m in r.client.get("/models").json()["data"]}[
            "small"
        ]

    deadline = time.time() + 20
    while status() != "sleeping" and time.time() < deadline:
        time.sleep(0.1)
    assert status() == "sleeping"
    assert r.client.get("/props", params={"model": "small"}).json()["is_sleeping"] is True
    assert r.client.post("/completion", json=body).status_code == 200
    time.sleep(1.0)
    seen = [e["data"]["status"] for e in events if e["model"] == "small"]
    assert seen[:3] == ["loading", "loaded", "sleeping"], seen
    assert "loaded" in seen[3:], seen  # woken by the second request


# ---- vLLM's sleep mode by hand: POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping ----


def first_turn(s: ServerProc) -> tuple[str, int]:
    """A conversation's first turn, several 512-token windows long: (the follow-up's prompt,
    the first turn's prompt tokens)."""
    prompt = long_text(1400)
    r = s.client.post("/completion", json={"prompt": prompt, "n_predict": 4, "ignore_eos": True})
    assert r.status_code == 200
    n_first = r.json()["tokens_evaluated"]
    assert n_first > 1500
    return prompt + r.json()["content"] + " And then the next chapter began.", n_first


def second_turn(s: ServerProc, follow: str) -> dict:
    r = s.client.post("/completion", json={"prompt": follow, "n_predict": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def asleep(s: ServerProc) -> bool:
    flag = s.client.get("/is_sleeping").json()["is_sleeping"]
    assert s.client.get("/props").json()["is_sleeping"] is flag
    return flag


def test_sleep_level_1_keeps_the_model_and_the_conversation_in_ram(make_server):
    # no disk tier: level 1 keeps the slots in the RAM cache across the sleep; a task wakes it
    s = make_server("-np", "2")
    assert s.client.post("/sleep", params={"level": "3"}).status_code == 400
    assert s.client.post("/sleep", params={"level": "x"}).status_code == 400
    follow, n_first = first_turn(s)
    awake = vm_rss_kib(s.proc.pid)
    r = s.client.post("/sleep")  # level 1 by default
    assert r.status_code == 200 and r.json() == {"is_sleeping": True, "level": 1}
    assert asleep(s)
    # the context and KV freed (~65 MB here), the model's 253 MB kept
    assert 30_000 < awake - vm_rss_kib(s.proc.pid) < 200_000, (awake, vm_rss_kib(s.proc.pid))
    assert s.client.get("/health").status_code == 200
    assert asleep(s)  # read-only endpoints leave it asleep
    body = second_turn(s, follow)  # a task wakes it, and its prompt comes from the RAM cache
    assert body["tokens_cached"] >= n_first - 1, body
    assert not asleep(s)


def test_sleep_level_2_frees_the_ram_cache_the_disk_tier_carries_it(make_server, tmp_path):
    s = make_server("-np", "2", "--cache-disk", str(tmp_path / "disk"))
    follow, n_first = first_turn(s)
    awake = vm_rss_kib(s.proc.pid)
    r = s.client.post("/sleep", params={"level": "2"})
    assert r.status_code == 200 and r.json()["level"] == 2
    assert asleep(s)
    assert awake - vm_rss_kib(s.proc.pid) > 200_000  # the model freed too
    assert s.client.post("/wake_up", params={"tags": "bogus"}).status_code == 400
    r = s.client.post("/wake_up", params={"tags": "weights,kv_cache"})
    assert r.status_code == 200 and r.json() == {"is_sleeping": False}
    assert not asleep(s)
    body = second_turn(s, follow)
    assert body["tokens_cached"] >= n_first - 1, body


def test_level_2_without_a_disk_tier_forgets_the_conversation(make_server):
    # the rule stated in README: level 1 then 2 (deepened while asleep) frees the RAM cache
    s = make_server("-np", "1", "-m", smollm2_path())
    prompt = long_text(1400)
    r = s.client.post("/completion", json={"prompt": prompt, "n_predict": 2})
    assert r.status_code == 200
    assert s.client.post("/sleep").json()["level"] == 1
    assert s.client.post("/sleep", params={"level": "2"}).json()["level"] == 2
    assert s.client.post("/wake_up").status_code == 200
    r = s.client.post("/completion", json={"prompt": prompt, "n_predict": 2})
    assert r.json()["tokens_cached"] == 0, r.json()


def test_sleep_endpoints_need_the_key_and_refuse_other_pages(make_server):
    s = make_server("-np", "1", "-m", smollm2_path(), "--api-key", "k1")
    evil = {"Origin": "http://evil.example", "Authorization": "Bearer k1"}
    for path in ("/sleep", "/wake_up"):
        assert s.client.post(path).status_code == 401
        assert s.client.post(path, headers=evil).status_code == 403
    assert s.client.get("/is_sleeping").status_code == 401
    key = {"Authorization": "Bearer k1"}
    assert s.client.post("/sleep", headers=key).status_code == 200
    assert s.client.get("/is_sleeping", headers=key).json() == {"is_sleeping": True}
    assert s.client.post("/wake_up", headers=key).status_code == 200
    assert s.client.get("/is_sleeping", headers=key).json() == {"is_sleeping": False}


def test_router_sleeps_and_wakes_the_named_instance(make_server, tmp_path):
    (tmp_path / "small.gguf").symlink_to(smollm2_path())
    r = make_server("--models-dir", str(tmp_path))
    assert r.client.post("/sleep").status_code == 400  # which instance?
    # not running: never started just to be put to sleep
    assert r.client.post("/sleep", params={"model": "small"}).status_code == 400
    body = {"model": "small", "prompt": "Hi", "n_predict": 2}
    assert r.client.post("/completion", json=body).status_code == 200
    small = {"model": "small"}
    assert r.client.post("/sleep", params={**small, "level": "2"}).json()["level"] == 2
    assert r.client.get("/is_sleeping", params=small).json() == {"is_sleeping": True}
    assert r.client.post("/wake_up", params=small).status_code == 200
    assert r.client.get("/is_sleeping", params=small).json() == {"is_sleeping": False}
