"""Issue 56, end to end on the default model with the generated projector: tiny files that
declare huge frames (a 35-byte GIF, a 142-byte JPEG at 8192x4096, exactly --image-max-pixels)
are bounded per request from their headers (413 before any decode) and per API key in
flight (429); their decoding runs on a lane of its own, so a text-only chat is answered
while they are prepared; a client that leaves stops its images within one; and under
--cache-isolation key one key's image is never another's cache hit."""

from __future__ import annotations

import base64
import itertools
import json
import re
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.mmproj_gen import pixels, png, tiny_gif, tiny_jpeg, write_gemma3_mmproj

from .conftest import ServerProc

W, H = 8192, 4096  # 32 Mi pixels: --image-max-pixels' default, so each passes alone
BIG = W * H
PREP_TIMEOUT = 6  # s: a text chat's preparation takes milliseconds; before, it waited ~20 s


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> Iterator[ServerProc]:
    mm = write_gemma3_mmproj(tmp_path_factory.mktemp("budget") / "mmproj.gguf")
    s = ServerProc(
        "--mmproj", str(mm), "-np", "1", "-c", "2048", "--metrics",
        "--request-prep-timeout", str(PREP_TIMEOUT),
    )  # fmt: skip
    yield s
    s.stop()


def url(data: bytes, kind: str = "gif") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def image_chat(images: list[str], max_tokens: int = 2) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in images]
    content = [*parts, {"type": "text", "text": "What are these?"}]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


_WIDTHS = itertools.count()


def huge(n: int) -> tuple[list[str], int]:
    """``n`` tiny files of about 8192x4096 (GIFs and JPEGs in turn) and their pixels; each
    a width of its own, so that no cache knows it (every one must be decoded)."""
    widths = [W - next(_WIDTHS) for _ in range(n)]
    urls = [
        url(tiny_gif(w, H)) if i % 2 == 0 else url(tiny_jpeg(w, H), "jpeg")
        for i, w in enumerate(widths)
    ]
    return urls, sum(widths) * H


def metric_or_none(s: ServerProc, name: str, headers: dict[str, str] | None = None) -> float | None:
    """A counter's value; None where the server has no such metric."""
    text = s.client.get("/metrics", headers=headers or {}).text
    m = re.search(rf"^{name}(?:_total)? ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m is not None else None


def metric(s: ServerProc, name: str, headers: dict[str, str] | None = None) -> float:
    value = metric_or_none(s, name, headers)
    assert value is not None, name
    return value


def test_a_request_of_sixteen_tiny_huge_images_is_refused_from_the_headers(srv):
    """Before: 200 after decoding all 16 (20-54 s on a loaded machine, ~1.6 GB of RSS).
    Now the fifth is refused from its header and nothing is decoded; four (the budget:
    4 x --image-max-pixels) decode, exactly their pixels."""
    decoded0 = metric_or_none(srv, "llamaslot_image_pixels_decoded")
    r = srv.client.post("/v1/chat/completions", json=image_chat(huge(16)[0]))
    assert r.status_code == 413, r.text
    assert decoded0 is not None
    err = r.json()["error"]
    assert err["type"] == "request_too_large" and "--image-max-request-pixels" in err["message"]
    assert "messages.0.content.4" in err["message"]
    # Anthropic's token count decodes images as a generation does: bounded alike
    blocks = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/gif", "data": d}}
        for d in [base64.b64encode(tiny_gif(W, H)).decode()] * 16  # the same one: one header
    ]
    content = [*blocks, {"type": "text", "text": "What are these?"}]
    body = {"model": "x", "max_tokens": 1, "messages": [{"role": "user", "content": content}]}
    r = srv.client.post("/v1/messages/count_tokens", json=body)
    assert r.status_code == 413, r.text
    assert metric(srv, "llamaslot_image_pixels_decoded") == decoded0  # nothing decoded
    four, n_pixels = huge(4)
    assert 3 * BIG < n_pixels <= 4 * BIG  # within the budget
    r = srv.client.post("/v1/chat/completions", json=image_chat(four))
    assert r.status_code == 200, r.text
    assert metric(srv, "llamaslot_image_pixels_decoded") == decoded0 + n_pixels
    srv.assert_integrity()


def test_a_text_chat_is_answered_while_media_requests_are_prepared(srv):
    """Sixteen clients each send 4 huge tiny images (each within the request's budget),
    then a text-only chat. Before, they held every light worker while the projector
    decoded one at a time, and the text chat waited past --request-prep-timeout (408).
    Now the images decode on the media lane, at most two requests of the key's budget at
    a time (the others: 429), and the text chat is answered."""
    statuses: list[int] = []
    refused: list[httpx.Response] = []

    bodies = [image_chat(huge(4)[0]) for _ in range(16)]

    def media(body: dict) -> None:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            r = c.post("/v1/chat/completions", json=body)
        statuses.append(r.status_code)
        if r.status_code == 429:
            refused.append(r)

    threads = [threading.Thread(target=media, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    time.sleep(1)  # a head start (not a bound): the media requests are in before the chat
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}
    r = srv.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    for t in threads:
        t.join()
    assert set(statuses) <= {200, 408, 429} and len(statuses) == 16, statuses
    assert refused, statuses  # the key's budget: two requests' pixels in flight at most
    err = refused[0].json()["error"]
    assert err["type"] == "rate_limit_error" and "--image-max-key-pixels" in err["message"]
    assert refused[0].headers["retry-after"] == "1"
    srv.assert_integrity()


def raw_post(s: ServerProc, path: str, body: dict) -> socket.socket:
    """The request sent on a socket of its own, left open (the caller closes it)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", s.port))
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def test_a_client_that_leaves_stops_its_images_within_one(srv):
    """A client sends 4 huge tiny images and leaves once the first has decoded. Before,
    all 4 were decoded under the projector's lock; now the work stops before the next
    image once the server sees the client gone (a poll every 0.25 s; an image ~0.5 s)."""

    def small_image(seed: int) -> None:
        """A request that takes the projector once whatever holds it has let go of it."""
        r = srv.client.post("/v1/chat/completions", json=image_chat([url(png(pixels(seed)))]))
        assert r.status_code == 200, r.text

    small_image(5)  # work an earlier test abandoned has stopped by now
    decoded0 = metric(srv, "llamaslot_image_pixels_decoded")
    sock = raw_post(srv, "/v1/chat/completions", image_chat(huge(4)[0]))
    deadline = time.monotonic() + 120
    while metric(srv, "llamaslot_image_pixels_decoded") == decoded0:
        assert time.monotonic() < deadline, "the first image never decoded"
        time.sleep(0.02)
    sock.close()
    small_image(6)
    assert metric(srv, "llamaslot_image_pixels_decoded") - decoded0 <= 3 * BIG + 64 * 64
    srv.assert_integrity()


@pytest.fixture(scope="module")
def isolated(tmp_path_factory) -> Iterator[ServerProc]:
    mm = write_gemma3_mmproj(tmp_path_factory.mktemp("isolated") / "mmproj.gguf")
    s = ServerProc(
        "--mmproj", str(mm), "-np", "1", "-c", "2048", "--metrics",
        "--cache-isolation", "key", env={"LLAMA_API_KEY": "ka,kb"},
    )  # fmt: skip
    yield s
    s.stop()


def counters(s: ServerProc) -> tuple[float, float]:
    """(images encoded, embedding cache hits)."""
    h = {"Authorization": "Bearer ka"}
    return metric(s, "llamaslot_images_encoded", h), metric(
        s, "llamaslot_image_embedding_cache_hits", h
    )


def decoded(s: ServerProc) -> float | None:
    """Images decoded from their bytes (None: a server without the counter)."""
    return metric_or_none(s, "llamaslot_image_files_decoded", {"Authorization": "Bearer ka"})


def test_one_keys_image_is_never_another_keys_cache_hit(isolated):
    """Before: kb sending ka's image was an embedding cache hit (encoded unchanged, hits
    +1), which told kb that someone had sent it; an unseen image moved the encode counter.
    Now kb decodes and encodes it as its own; ka's own follow-up is still a hit."""
    image = url(png(pixels(9)), "png")

    def send(key: str) -> None:
        r = isolated.client.post(
            "/v1/chat/completions",
            json=image_chat([image]),
            headers={"Authorization": f"Bearer {key}"},
        )
        assert r.status_code == 200, r.text

    (e0, h0), d0 = counters(isolated), decoded(isolated)
    send("ka")
    assert counters(isolated) == (e0 + 1, h0)
    send("kb")
    assert counters(isolated) == (e0 + 2, h0)  # as if nobody had sent it
    send("ka")
    assert counters(isolated) == (e0 + 2, h0 + 1)  # ka's own: still cached for ka
    assert d0 is not None and decoded(isolated) == d0 + 2  # ka's follow-up: not decoded
