"""Reliability and tenancy findings, end to end on the default model: the cross-client
prefix probe, /slots parameters, slot actions without --slot-save-path, cross-site requests,
a lone surrogate, a full KV cache, and SIGTERM with streams in flight."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from openai import OpenAI

from .conftest import ServerProc, long_text

MEMO = "Memo 7Q: the vault code is 4{d}19. Keep it. " + long_text(
    1300, seed=3
)  # ~1,550 tokens: 3 windows


@pytest.fixture(scope="module")
def isolated() -> ServerProc:
    s = ServerProc(
        "-np",
        "3",
        "-c",
        "4096",
        "--cache-isolation",
        "key",
        "--metrics",
        env={"LLAMA_API_KEY": "ka,kb"},
    )
    yield s
    s.stop()


def _cached(client: OpenAI, prompt: str, **extra) -> int:
    r = client.completions.create(model="x", prompt=prompt, max_tokens=1, temperature=0, **extra)
    return r.usage.prompt_tokens_details.cached_tokens


def test_the_prefix_probe_learns_nothing_across_keys(isolated):
    a = OpenAI(base_url=isolated.url + "/v1", api_key="ka")
    b = OpenAI(base_url=isolated.url + "/v1", api_key="kb")
    _cached(a, MEMO.format(d=3))
    # B guesses the hidden digit; a salt per guess keeps B's own probes apart too
    seen = {g: _cached(b, MEMO.format(d=g), extra_body={"cache_salt": f"g{g}"}) for g in (3, 8)}
    assert seen == {3: 0, 8: 0}
    # the same probe within A's tenant does tell: that is what isolation takes away
    right = _cached(a, MEMO.format(d=3), extra_body={"cache_salt": None})
    wrong = _cached(a, MEMO.format(d=8))
    assert right > 1000 > wrong  # the right guess hits the whole memo, the wrong one nearly nothing


def test_slots_hide_another_tenants_request_parameters(isolated):
    body = {"prompt": "x", "n_predict": 2000, "ignore_eos": True, "stop": ["SECRET-STOP"]}
    body |= {"seed": 4242, "stream": True}
    h_a = {"Authorization": "Bearer ka"}
    with httpx.stream(
        "POST", isolated.url + "/completion", json=body, headers=h_a, timeout=60
    ) as r:
        # the line iterator is kept: dropped, it is collected and closes the connection, and
        # the server cancels the request (a race with the /slots reads below, seen on CI)
        lines = r.iter_lines()
        next(lines)
        mine = isolated.client.get("/slots", headers=h_a).json()
        theirs = isolated.client.get("/slots", headers={"Authorization": "Bearer kb"}).json()
    busy = [x for x in mine if x["is_processing"]]
    assert busy and busy[0]["params"]["stop"] == ["SECRET-STOP"]
    other = next(x for x in theirs if x["id"] == busy[0]["id"])
    assert "SECRET-STOP" not in json.dumps(theirs) and "4242" not in json.dumps(other["params"])


def test_slot_actions_need_slot_save_path(server):
    for action in ("erase", "save", "restore"):
        r = server.client.post(f"/slots/0?action={action}", json={"filename": "x.bin"})
        assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"


def test_a_web_page_cannot_drive_the_server(server):
    page = {"Origin": "https://evil.example", "Content-Type": "text/plain"}
    r = server.client.post(
        "/v1/completions", content=b'{"prompt":"hi","max_tokens":1}', headers=page
    )
    assert r.status_code == 415
    r = server.client.post(
        "/slots/0?action=erase", json={}, headers={"Origin": "https://evil.example"}
    )
    assert r.status_code == 403
    # curl -d (form type, no Origin) still works
    r = server.client.post(
        "/completion",
        content=b'{"prompt":"hi","n_predict":1}',
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 200


def test_a_lone_surrogate_is_a_400_and_the_server_keeps_serving(server):
    for path in ("/completion", "/v1/completions", "/tokenize"):
        key = "content" if path == "/tokenize" else "prompt"
        raw = b'{"%s": "\\ud800x", "max_tokens": 1}' % key.encode()
        r = server.client.post(path, content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (path, r.text)
        assert "Unicode" in r.json()["error"]["message"]
    assert (
        server.client.post("/completion", json={"prompt": "ok", "n_predict": 1}).status_code == 200
    )


def _kv_counter(s: ServerProc) -> float:
    text = s.client.get("/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("llamaslot_kv_exhausted_total"))
    return float(line.split()[-1])


@pytest.mark.serial  # timed or racing: runs alone
def test_a_full_kv_cache_is_an_error_not_a_quiet_length(make_server):
    # two slots of 64 + 400 tokens cannot both fit 640 cells; either alone can
    s = make_server("-np", "2", "-c", "640", "--metrics", "--no-cache-idle-slots")
    prompt = s.tokenize(long_text(200, seed=2))[:64]
    body = {"prompt": prompt, "n_predict": 400, "ignore_eos": True, "temperature": 0}
    out: list[httpx.Response] = []

    def go(slot: int) -> None:
        out.append(s.client.post("/completion", json={**body, "id_slot": slot}, timeout=600))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in out)
    assert codes == [200, 500], [r.text[:200] for r in out]
    failed = next(r for r in out if r.status_code == 500).json()["error"]
    assert "Context size has been exceeded" in failed["message"]
    assert _kv_counter(s) == 1
    s.assert_integrity()


def _read_stream(url: str, body: dict, got: list) -> None:
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                got.append(line[6:])


@pytest.mark.serial  # timed or racing: runs alone
def test_sigterm_lets_streams_finish_and_ends_the_rest_with_an_error(make_server):
    s = make_server("-np", "2", "-c", "4096")
    url = s.url + "/v1/completions"
    short, long_, queued = [], [], []
    base = {"model": "x", "prompt": "Story:", "stream": True, "temperature": 0}
    runs = [
        # ignore_eos: the short one ends by its length whether or not greedy would end the
        # text first (which differs between CPUs)
        (short, {**base, "max_tokens": 16, "ignore_eos": True}),
        (long_, {**base, "max_tokens": 3500, "ignore_eos": True}),
    ]
    threads = [threading.Thread(target=_read_stream, args=(url, b, g)) for g, b in runs]
    for t in threads:
        t.start()
    while len(long_) < 3:
        time.sleep(0.05)
    late = threading.Thread(target=_read_stream, args=(url, {**base, "max_tokens": 20}, queued))
    late.start()  # waits for a slot: the long stream holds one, the short one the other
    time.sleep(0.3)
    t0 = time.time()
    s.proc.send_signal(signal.SIGTERM)
    for t in [*threads, late]:
        t.join(30)
    assert s.proc.wait(30) == 0 and time.time() - t0 < 15
    # every stream ends properly: a final chunk or the shutdown's error event, then [DONE]
    for got in (short, queued, long_):
        assert got[-1] == "[DONE]", got[-3:]
        last = json.loads(got[-2])
        assert "choices" in last or last["error"]["code"] == 503, last
    # the short one (running, 16 tokens) finishes within the grace time; the long one cannot
    assert json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
    err = json.loads(long_[-2])["error"]
    assert err["code"] == 503 and "shutting down" in err["message"]
