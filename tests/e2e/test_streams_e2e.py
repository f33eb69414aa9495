"""Resumable streams (X-Conversation-Id, llama-server's /v1/stream routes) on a real server
and the real model: a named stream survives its client, replays byte for byte, follows live,
stops on DELETE and expires when nobody comes back; an unnamed one still ends with its
client. Output text is never asserted (only the stream's structure and token counts)."""

from __future__ import annotations

import collections
import contextlib
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote

import httpx
import pytest

from server.router.conv_map import MAP_MAX

from .conftest import ServerProc, gemma_path

pytestmark = pytest.mark.e2e

CHAT = {"messages": [{"role": "user", "content": "Tell me a long story."}], "stream": True}
LONG = {**CHAT, "max_tokens": 4000, "ignore_eos": True}  # runs far past any test's cut


def frames(data: bytes) -> list[bytes]:
    """The SSE events of ``data``, each with its blank line (an unterminated tail dropped)."""
    parts = data.split(b"\n\n")
    return [p + b"\n\n" for p in parts[:-1]]


def conv() -> str:
    return f"test-{uuid.uuid4().hex}"


def read_some(s: ServerProc, path: str, body: dict, cid: str, n: int, **hdr: str) -> list[bytes]:
    """Open a named stream, read its first ``n`` events byte for byte, then drop the
    connection (a reload, a phone losing its network)."""
    got = b""
    headers = {"X-Conversation-Id": cid, **hdr}
    with (
        httpx.Client(base_url=s.url, timeout=120) as c,
        c.stream("POST", path, json=body, headers=headers) as r,
    ):
        assert r.status_code == 200, r.read()
        for chunk in r.iter_raw():
            got += chunk
            if len(frames(got)) >= n:
                break
    return frames(got)[:n]


def replay(s: ServerProc, cid: str, query: str = "from=0", **hdr: str) -> bytes:
    r = s.client.get(f"/v1/stream?conv_id={cid}&{query}", headers=hdr)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    return r.content


def metric(s: ServerProc, name: str) -> float:
    for line in s.client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def chunks(events: list[bytes]) -> Iterator[dict]:
    for e in events:
        text = e.decode()
        if text.startswith("data: {"):
            yield json.loads(text[len("data: ") :])


@pytest.fixture(scope="module")
def srv() -> Iterator[ServerProc]:
    s = ServerProc("-np", "2", "--metrics", "--stream-ttl", "120")
    yield s
    s.stop()


def test_a_cut_stream_replays_whole_and_continues_live(srv: ServerProc) -> None:
    cid = conv()
    body = {
        **CHAT,
        "max_tokens": 300,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    first = read_some(srv, "/v1/chat/completions", body, cid, 5)
    again = frames(replay(srv, cid))
    # the replay starts with exactly what the first client got, then everything after it
    assert again[:5] == first
    assert again[-1] == b"data: [DONE]\n\n"
    usage = [c["usage"] for c in chunks(again) if c.get("usage")]
    # the generation was not cancelled when its client left: all 300 tokens
    assert usage and usage[0]["completion_tokens"] == 300
    finals = [c for c in chunks(again) if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in finals] == ["length"]
    srv.wait_idle()


def test_replay_from_a_byte_offset_or_an_event_index(srv: ServerProc) -> None:
    cid = conv()
    r = srv.client.post(
        "/v1/chat/completions", json={**CHAT, "max_tokens": 24}, headers={"X-Conversation-Id": cid}
    )
    whole = r.content
    assert replay(srv, cid) == whole  # finished: the replay is the response itself
    evs = frames(whole)
    cut = sum(len(e) for e in evs[:3])
    assert replay(srv, cid, f"from={cut}") == whole[cut:]
    assert replay(srv, cid, "from_event=3") == whole[cut:]
    assert replay(srv, cid, f"from={cut + 5}") == whole[cut + 5 :]  # llama-server: any byte
    assert replay(srv, cid, f"from={len(whole)}") == b""
    for bad in (f"from={len(whole) + 1}", f"from_event={len(evs) + 1}", "from=abc", "from=-1"):
        assert srv.client.get(f"/v1/stream?conv_id={cid}&{bad}").status_code == 400, bad
    both = srv.client.get(f"/v1/stream?conv_id={cid}&from=0&from_event=0")
    assert both.status_code == 400


def test_lookup_answers_only_for_the_ids_named(srv: ServerProc) -> None:
    a, b = conv(), conv()
    variant = f"{a}::ggml-org/some-model:Q8_0"  # llama-server's per-model ids
    for cid in (a, b, variant):
        r = srv.client.post(
            "/v1/chat/completions",
            json={**CHAT, "max_tokens": 4},
            headers={"X-Conversation-Id": cid},
        )
        assert r.status_code == 200
    look = srv.client.post("/v1/streams/lookup", json={"conversation_ids": [a, "never-seen"]})
    assert look.status_code == 200
    entries = look.json()
    assert sorted(e["conversation_id"] for e in entries) == sorted([a, variant])
    for e in entries:
        assert (
            e["is_done"] is True and e["total_bytes"] > 0 and e["completed_at"] >= e["started_at"]
        )
    assert srv.client.post("/v1/streams/lookup", json={"conversation_ids": []}).json() == []
    assert srv.client.post("/v1/streams/lookup", json={}).status_code == 400


def test_delete_stops_the_generation_and_frees_the_slot(srv: ServerProc) -> None:
    cid = conv()
    stopped = metric(srv, "llamaslot_streams_stopped_total")
    predicted = metric(srv, "llamacpp:tokens_predicted_total")
    read_some(srv, "/v1/chat/completions", LONG, cid, 4)
    assert srv.client.get("/v1/streams/lookup").status_code == 405
    live = srv.client.post("/v1/streams/lookup", json={"conversation_ids": [cid]}).json()
    assert live and live[0]["is_done"] is False  # generating with nobody reading
    assert srv.client.delete(f"/v1/stream?conv_id={cid}").status_code == 204
    srv.wait_idle()
    assert srv.client.get(f"/v1/stream?conv_id={cid}&from=0").status_code == 404
    assert srv.client.delete(f"/v1/stream?conv_id={cid}").status_code == 204  # idempotent
    assert metric(srv, "llamaslot_streams_stopped_total") == stopped + 1
    assert metric(srv, "llamacpp:requests_processing") == 0
    assert metric(srv, "llamacpp:tokens_predicted_total") - predicted < 4000


def test_a_stream_whose_client_left_keeps_the_server_awake(srv: ServerProc) -> None:
    cid = conv()
    read_some(srv, "/v1/chat/completions", LONG, cid, 3)
    # its request is over, its generation is not: no sleep under it
    r = srv.client.post("/sleep?level=1")
    assert r.status_code == 409, r.text
    assert srv.client.delete(f"/v1/stream?conv_id={cid}").status_code == 204
    srv.wait_idle()
    deadline = time.time() + 30
    while srv.client.post("/sleep?level=1").status_code == 409 and time.time() < deadline:
        time.sleep(0.2)  # the stopped stream's producer ends within a step
    assert srv.client.get("/is_sleeping").json()["is_sleeping"] is True
    assert srv.client.post("/wake_up").status_code == 200
    srv.wait_ready()


def test_an_unnamed_stream_still_ends_with_its_client(srv: ServerProc) -> None:
    predicted = metric(srv, "llamacpp:tokens_predicted_total")
    got = b""
    with (
        httpx.Client(base_url=srv.url, timeout=120) as c,
        c.stream("POST", "/v1/chat/completions", json=LONG) as r,
    ):
        for chunk in r.iter_raw():
            got += chunk
            if len(frames(got)) >= 4:
                break
    srv.wait_idle(timeout=60)
    assert metric(srv, "llamacpp:tokens_predicted_total") - predicted < 4000


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 40, "stream": True}),
        ("/completion", {"prompt": "Once upon a time", "n_predict": 40, "stream": True}),
        ("/v1/messages", {**CHAT, "max_tokens": 40}),
        ("/v1/responses", {"input": "Tell me a story.", "max_output_tokens": 40, "stream": True}),
    ],
)
def test_every_streaming_api_replays(srv: ServerProc, path: str, body: dict) -> None:
    cid = conv()
    first = read_some(srv, path, {**body, "ignore_eos": True}, cid, 3)
    again = replay(srv, cid)
    assert frames(again)[:3] == first
    look = srv.client.post("/v1/streams/lookup", json={"conversation_ids": [cid]}).json()
    assert look[0]["total_bytes"] == len(again) and look[0]["is_done"]


def test_bad_ids_are_400_and_unknown_ones_404(srv: ServerProc) -> None:
    for bad in ("has space", "x" * 257, "a?b", 'quote"d', ""):
        r = srv.client.post(
            "/v1/chat/completions",
            json={**CHAT, "max_tokens": 4},
            headers={"X-Conversation-Id": bad},
        )
        assert r.status_code == 400, bad
        assert "conversation id" in r.json()["error"]["message"]
    assert srv.client.get("/v1/stream?from=0").status_code == 400
    assert srv.client.get("/v1/stream?conv_id=a%20b").status_code == 400
    assert srv.client.delete("/v1/stream").status_code == 400
    assert srv.client.get(f"/v1/stream?conv_id={conv()}").status_code == 404
    too_many = {"conversation_ids": [f"id{i}" for i in range(257)]}
    assert srv.client.post("/v1/streams/lookup", json=too_many).status_code == 400
    assert srv.client.post("/v1/streams/lookup", json={"conversation_ids": [1]}).status_code == 400
    # a non-streaming request ignores the header, as llama-server
    r = srv.client.post(
        "/v1/chat/completions",
        json={**CHAT, "stream": False, "max_tokens": 4},
        headers={"X-Conversation-Id": "bad id ignored"},
    )
    assert r.status_code == 200
    srv.wait_idle()


@pytest.fixture(scope="module")
def keyed() -> Iterator[ServerProc]:
    s = ServerProc(
        "-np", "3", "--metrics", "--api-key", "k1,k2", "--stream-ttl", "3",
        "--streams-per-key", "2",
    )  # fmt: skip
    yield s
    s.stop()


def _key(k: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {k}"}


def test_an_unread_stream_expires_and_its_generation_stops(keyed: ServerProc) -> None:
    cid = conv()
    read_some(keyed, "/v1/chat/completions", LONG, cid, 3, **_key("k1"))
    deadline = time.time() + 120
    while (
        time.time() < deadline and metric_k(keyed, "llamaslot_streams_expired_generating_total") < 1
    ):
        time.sleep(0.5)
    assert metric_k(keyed, "llamaslot_streams_expired_generating_total") == 1
    slots = keyed.client.get("/slots", headers=_key("k1")).json()
    deadline = time.time() + 30
    while any(x["is_processing"] for x in slots) and time.time() < deadline:
        time.sleep(0.2)
        slots = keyed.client.get("/slots", headers=_key("k1")).json()
    assert not any(x["is_processing"] for x in slots)
    r = keyed.client.get(f"/v1/stream?conv_id={cid}", headers=_key("k1"))
    assert r.status_code == 404


def metric_k(s: ServerProc, name: str) -> float:
    for line in s.client.get("/metrics", headers=_key("k1")).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def test_streams_belong_to_their_api_key_and_are_bounded(keyed: ServerProc) -> None:
    a, b = conv(), conv()
    k1 = _key("k1")
    with contextlib.ExitStack() as open_streams, httpx.Client(base_url=keyed.url) as c:
        for cid in (a, b):  # two streams of k1 generating, their clients reading
            r = open_streams.enter_context(
                c.stream(
                    "POST",
                    "/v1/chat/completions",
                    json=LONG,
                    headers={"X-Conversation-Id": cid, **k1},
                )
            )
            assert r.status_code == 200
            next(r.iter_raw())
        for cid in (a, b):  # a stream holds its key's quota once it generates (not queued)
            _wait_generating(keyed, cid, **k1)
        third = keyed.client.post(
            "/v1/chat/completions", json=LONG, headers={"X-Conversation-Id": conv(), **k1}
        )
        assert third.status_code == 429 and third.headers["retry-after"] == "1"
        # another key neither sees, replays nor stops them
        other = _key("k2")
        look = keyed.client.post(
            "/v1/streams/lookup", json={"conversation_ids": [a, b]}, headers=other
        )
        assert look.json() == []
        assert keyed.client.get(f"/v1/stream?conv_id={a}", headers=other).status_code == 404
        assert keyed.client.delete(f"/v1/stream?conv_id={a}", headers=other).status_code == 204
        mine = keyed.client.post(
            "/v1/streams/lookup", json={"conversation_ids": [a, b]}, headers=k1
        )
        assert len(mine.json()) == 2
        for cid in (a, b):  # their readers see their streams end
            assert keyed.client.delete(f"/v1/stream?conv_id={cid}", headers=k1).status_code == 204
    deadline = time.time() + 30
    while time.time() < deadline:
        slots = keyed.client.get("/slots", headers=k1).json()
        if not any(x["is_processing"] for x in slots):
            break
        time.sleep(0.2)
    assert not any(x["is_processing"] for x in slots)


def test_router_mode_replays_looks_up_and_stops(tmp_path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / "gemma.gguf").symlink_to(gemma_path())
    r = ServerProc("--models-dir", str(models), "-c", "2048", "-np", "2", "--stream-ttl", "120")
    try:
        cid = f"{conv()}::ggml-org/gemma:Q4_K_M"  # llama-server's web UI: "<id>::<model>"
        qs = "conv_id=" + quote(cid, safe="")
        body = {**LONG, "model": "gemma", "max_tokens": 200}
        first = read_some(r, "/v1/chat/completions", body, cid, 4)
        whole = r.client.get(f"/v1/stream?{qs}&from=0")
        assert whole.status_code == 200
        again = frames(whole.content)
        assert again[:4] == first and again[-1] == b"data: [DONE]\n\n"
        assert (
            sum(
                1 for c in chunks(again) if c["choices"] and c["choices"][0]["delta"].get("content")
            )
            > 4
        )
        cut = sum(len(e) for e in again[:2])
        assert r.client.get(f"/v1/stream?{qs}&from={cut}").content == whole.content[cut:]
        base = cid.split("::")[0]
        look = r.client.post("/v1/streams/lookup", json={"conversation_ids": [base, conv()]})
        assert [e["conversation_id"] for e in look.json()] == [cid]
        assert r.client.get(f"/v1/stream?conv_id={conv()}").status_code == 404
        assert r.client.get("/v1/stream?conv_id=a%20b").status_code == 400
        # a stop reaches the instance that holds it
        live = conv()
        read_some(r, "/v1/chat/completions", {**LONG, "model": "gemma"}, live, 3)
        assert r.client.delete(f"/v1/stream?conv_id={live}").status_code == 204
        assert r.client.get(f"/v1/stream?conv_id={live}").status_code == 404
        assert r.client.delete(f"/v1/stream?conv_id={live}").status_code == 204
    finally:
        r.stop()


def _status(r: ServerProc, model: str) -> str:
    return {m["id"]: m["status"]["value"] for m in r.client.get("/models").json()["data"]}[model]


def _wait_loading(r: ServerProc, model: str) -> None:
    deadline = time.time() + 30
    while time.time() < deadline:
        if _status(r, model) == "loading":
            return
        time.sleep(0.01)
    raise AssertionError("the model never was seen loading")


def test_router_while_the_model_loads_a_stop_cancels_and_a_reload_resumes(tmp_path) -> None:
    """llama.cpp's test_stream load-window cases: a stop while the named request waits for
    its model cancels it (400); a client that drops while it waits does not (the replay is a
    503 until the load ends, then the whole answer)."""
    models = tmp_path / "models"
    models.mkdir()
    (models / "gemma.gguf").symlink_to(gemma_path())
    r = ServerProc("--models-dir", str(models), "-c", "2048", "-np", "2")
    try:
        cid, box = conv(), {}
        body = {**CHAT, "model": "gemma", "max_tokens": 512}

        def post() -> None:
            box["r"] = r.client.post(
                "/v1/chat/completions", json=body, headers={"X-Conversation-Id": cid}
            )

        t = threading.Thread(target=post)
        t.start()
        _wait_loading(r, "gemma")
        assert r.client.delete(f"/v1/stream?conv_id={cid}").status_code == 204
        t.join(120)
        assert box["r"].status_code == 400 and "cancelled" in box["r"].text
        assert r.client.get(f"/v1/stream?conv_id={cid}").status_code == 404
        assert r.client.post("/models/unload", json={"model": "gemma"}).status_code == 200
        # a client that leaves while the model loads: the answer is generated all the same
        cid = conv()
        raw = json.dumps({**CHAT, "model": "gemma", "max_tokens": 16}).encode()
        sock = socket.create_connection(("127.0.0.1", r.port))
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nX-Conversation-Id: {cid}\r\n"
            f"Content-Length: {len(raw)}\r\nConnection: close\r\n\r\n"
        )
        sock.sendall(head.encode() + raw)
        _wait_loading(r, "gemma")
        sock.close()
        deadline = time.time() + 120
        while time.time() < deadline:
            before = _status(r, "gemma")
            got = r.client.get(f"/v1/stream?conv_id={cid}&from=0")
            if before == _status(r, "gemma") == "loading":  # loading all along: retry later
                assert got.status_code == 503, got.text
            if got.status_code == 200:
                break
            assert got.status_code in (404, 503), got.text  # 404: the instance took it, not yet
            time.sleep(0.1)
        assert got.status_code == 200
        assert frames(got.content)[-1] == b"data: [DONE]\n\n"
    finally:
        r.stop()


def _look(s: ServerProc, ids: list[str], **hdr: str) -> list[dict]:
    r = s.client.post("/v1/streams/lookup", json={"conversation_ids": ids}, headers=hdr)
    assert r.status_code == 200, r.text
    return r.json()


def _wait_generating(s: ServerProc, cid: str, **hdr: str) -> None:
    """Until stream ``cid`` has written tokens (past its opening event): it has a slot."""
    deadline = time.time() + 60
    while time.time() < deadline:
        if _look(s, [cid], **hdr)[0]["total_events"] >= 3:
            return
        time.sleep(0.1)
    raise AssertionError(f"stream {cid} never generated")


def _idle(s: ServerProc, path: str, timeout: float = 60, **hdr: str) -> bool:
    """Whether no slot ``path`` (``/slots``) lists is processing, within ``timeout``."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not any(x["is_processing"] for x in s.client.get(path, headers=hdr).json()):
            return True
        time.sleep(0.2)
    return False


def _flood(s: ServerProc, n: int, **hdr: str) -> collections.Counter:
    """``n`` named requests for a model nobody has, each its own id: their statuses."""
    body = {**CHAT, "model": "no-such-model", "max_tokens": 4}

    def one(i: int) -> int:
        headers = {"X-Conversation-Id": f"flood-{i}", **hdr}
        return s.client.post("/v1/chat/completions", json=body, headers=headers).status_code

    with ThreadPoolExecutor(8) as pool:
        return collections.Counter(pool.map(one, range(n)))


def test_router_one_key_s_flood_leaves_another_key_s_streams_and_its_stop(tmp_path) -> None:
    """Issue 56, 3: k2's named requests for an unknown model (each a fast 400) filled the
    router's one map of stream owners, so k1's lookup answered [], its replay 404, and its
    stop a 204 that reached no instance while its generation ran on. Now a 400 records
    nothing (k2's own earlier stream is still found after more of them than the router
    remembers per key), k1's stream is found and replayed, and its stop ends it."""
    models = tmp_path / "models"
    models.mkdir()
    (models / "gemma.gguf").symlink_to(gemma_path())
    r = ServerProc(
        "--models-dir", str(models), "-c", "8192", "-np", "2", "--api-key", "k1,k2",
        "--stream-ttl", "300",
    )  # fmt: skip
    k1, k2 = _key("k1"), _key("k2")
    try:
        live, own = conv(), conv()
        long = {**LONG, "model": "gemma", "max_tokens": 8000}  # runs past the test
        read_some(r, "/v1/chat/completions", long, live, 3, **k1)
        short = {**CHAT, "model": "gemma", "max_tokens": 4}
        read_some(r, "/v1/chat/completions", short, own, 2, **k2)
        assert _flood(r, MAP_MAX + 50, **k2) == {400: MAP_MAX + 50}
        assert [e["conversation_id"] for e in _look(r, [own], **k2)] == [own]
        found = _look(r, [live], **k1)
        assert [e["conversation_id"] for e in found] == [live] and found[0]["is_done"] is False
        with (
            httpx.Client(base_url=r.url, timeout=120) as c,
            c.stream("GET", f"/v1/stream?conv_id={live}&from=0", headers=k1) as again,
        ):
            assert again.status_code == 200
            assert next(again.iter_raw()).startswith(b"data: ")
        assert r.client.delete(f"/v1/stream?conv_id={live}", headers=k1).status_code == 204
        assert _idle(r, "/slots?model=gemma", **k1)  # the instance's generation stopped
        assert _look(r, [live], **k1) == []
        assert r.client.get(f"/v1/stream?conv_id={live}", headers=k1).status_code == 404
    finally:
        r.stop()


def test_keyless_clients_share_no_per_owner_stream_quota() -> None:
    """Issue 56, 6: without keys every client is one owner, so one client's named streams
    (the chat page names every answer) made every other client's a 429. Three clients'
    named chats on one slot with --streams-per-key 1: all are taken (two queue)."""
    s = ServerProc("-np", "1", "--streams-per-key", "1")
    try:
        ids = [conv() for _ in range(3)]
        with contextlib.ExitStack() as held:
            for cid in ids:
                c = held.enter_context(httpx.Client(base_url=s.url, timeout=120))
                got = held.enter_context(
                    c.stream(
                        "POST",
                        "/v1/chat/completions",
                        json=LONG,
                        headers={"X-Conversation-Id": cid},
                    )
                )
                assert got.status_code == 200, got.read()
            assert sorted(e["conversation_id"] for e in _look(s, ids)) == sorted(ids)
            for cid in ids:
                assert s.client.delete(f"/v1/stream?conv_id={cid}").status_code == 204
        assert _idle(s, "/slots")
    finally:
        s.stop()


def test_a_queued_named_stream_holds_none_of_its_key_s_quota() -> None:
    """Issue 56, 6: a named stream waiting for a slot took its key's quota before it
    generated anything. With one slot busy and --streams-per-key 1, k1's two named
    streams queue (both taken); once one of them generates, a third is a 429."""
    s = ServerProc("-np", "1", "--api-key", "k1,k2", "--streams-per-key", "1")
    k1 = _key("k1")
    try:
        a, b = conv(), conv()
        with contextlib.ExitStack() as held, httpx.Client(base_url=s.url, timeout=120) as c:
            busy = held.enter_context(
                c.stream("POST", "/v1/chat/completions", json=LONG, headers=_key("k2"))
            )
            assert busy.status_code == 200
            next(busy.iter_raw())  # k2's unnamed stream: first in the queue, on the slot
            for cid in (a, b):
                got = held.enter_context(
                    c.stream(
                        "POST",
                        "/v1/chat/completions",
                        json=LONG,
                        headers={"X-Conversation-Id": cid, **k1},
                    )
                )
                assert got.status_code == 200, got.read()
            busy.close()  # its client leaves: the slot goes to a
            _wait_generating(s, a, **k1)
            third = s.client.post(
                "/v1/chat/completions", json=LONG, headers={"X-Conversation-Id": conv(), **k1}
            )
            assert third.status_code == 429, third.text
            for cid in (a, b):
                assert s.client.delete(f"/v1/stream?conv_id={cid}", headers=k1).status_code == 204
        assert _idle(s, "/slots", **k1)
    finally:
        s.stop()
