"""Images end to end (issue 42): a real server on the default model (Gemma 3 270M, SWA
window 512) with the generated projector (tests/mmproj_gen.py: 16 tokens per 64-pixel
image), driven by the openai and anthropic SDKs over HTTP, on prompts of several windows.

Token accounting is exact where the prompt is known: a repeat of a conversation's first
turn keeps all of it but its last token; a different image keeps exactly the text before
the image; a follow-up computes only what is new. Bad images are 400s naming the problem,
and the server keeps serving with a clean integrity check."""

from __future__ import annotations

import base64
import re
import struct
import zlib

import anthropic
import openai
import pytest

from tests.mmproj_gen import N_IMAGE_TOKENS, pixels, png, png_header_only, write_gemma3_mmproj

from .conftest import ServerProc, long_text

SYSTEM = "You describe pictures. " + long_text(1400, seed=3)
ASK = "What is in this picture? Answer in one short sentence."


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = tmp_path_factory.mktemp("images")
    mm = write_gemma3_mmproj(d / "mmproj.gguf")
    (d / "media").mkdir()
    (d / "media" / "cat.png").write_bytes(png(pixels(7)))
    s = ServerProc(
        "--mmproj", str(mm), "-np", "1", "-c", "8192", "--metrics",
        "--media-path", str(d / "media"), "--image-max-count", "3",
    )  # fmt: skip
    yield s
    s.stop()


def data_url(b: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(b).decode()


def first_turn(b: bytes) -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": ASK},
                {"type": "image_url", "image_url": {"url": data_url(b)}},
            ],
        },
    ]


def oai(s: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=300)


def chat(s: ServerProc, messages: list[dict], max_tokens: int = 24) -> dict:
    r = oai(s).chat.completions.with_raw_response.create(
        model="x",
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,  # type: ignore[arg-type]
    )
    return r.http_response.json()


def metric(s: ServerProc, name: str) -> float:
    text = s.client.get("/metrics").text
    m = re.search(rf"^{name}(?:_total)? ([0-9.e+-]+)$", text, re.M)
    assert m is not None, name
    return float(m.group(1))


def image_start(s: ServerProc, messages: list[dict]) -> int:
    """The prompt position of the (one) image: the tokens of the rendered text before the
    media marker, and the ``<start_of_image>`` token the projector puts before it."""
    plain = [
        {"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
         "\n".join(p.get("text", "<__media__>") for p in m["content"])}
        for m in messages
    ]  # fmt: skip
    r = s.client.post("/apply-template", json={"messages": plain})
    text = r.json()["prompt"]
    return len(s.tokenize(text[: text.index("<__media__>")], add_special=False)) + 1


def test_props_and_models_show_vision(srv):
    assert srv.client.get("/props").json()["modalities"] == {"vision": True, "audio": False}
    m = oai(srv).models.list().data[0]
    assert "image" in m.model_extra["architecture"]["input_modalities"]


def test_a_conversation_about_an_image_reuses_it_and_its_text(srv):
    msgs = first_turn(png(pixels(1)))
    encoded0, decoded0 = (
        metric(srv, "llamaslot_images_encoded"),
        metric(srv, "llamaslot_images_decoded"),
    )
    r1 = chat(srv, msgs)
    t1 = r1["timings"]
    p1 = t1["cache_n"] + t1["prompt_n"]
    assert r1["usage"]["prompt_tokens"] == p1 > 3 * 512 + N_IMAGE_TOKENS
    assert r1["choices"][0]["message"]["role"] == "assistant"
    assert metric(srv, "llamaslot_images_decoded") == decoded0 + 1
    # turn 2: the image and all the first turn's text come from the slot
    cached0 = metric(srv, "llamaslot_image_tokens_cached")
    answer = r1["choices"][0]["message"]["content"]
    msgs2 = msgs + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And what colour is it mostly?"},
    ]
    r2 = chat(srv, msgs2)
    t2 = r2["timings"]
    p2 = t2["cache_n"] + t2["prompt_n"]
    assert r2["usage"]["prompt_tokens"] == p2
    assert t2["cache_n"] >= p1 and t2["prompt_n"] <= p2 - p1
    assert metric(srv, "llamaslot_images_decoded") == decoded0 + 1  # not decoded again
    assert metric(srv, "llamaslot_image_tokens_cached") == cached0 + N_IMAGE_TOKENS
    assert metric(srv, "llamaslot_images_encoded") == encoded0 + 1
    # the same pixels in other PNG bytes: the same image (all of turn 1 but its last token)
    other_bytes = png(pixels(1), compress=1, filter_type=1)
    assert other_bytes != png(pixels(1))
    r3 = chat(srv, first_turn(other_bytes))
    assert r3["timings"]["cache_n"] == p1 - 1 and r3["timings"]["prompt_n"] == 1
    assert metric(srv, "llamaslot_images_encoded") == encoded0 + 1  # the embedding cache's
    # another image: the match stops exactly where the image starts
    start = image_start(srv, msgs)
    r4 = chat(srv, first_turn(png(pixels(2))))
    assert r4["timings"]["cache_n"] == start
    assert r4["timings"]["prompt_n"] == p1 - start
    assert metric(srv, "llamaslot_images_encoded") == encoded0 + 2
    srv.assert_integrity()


def test_anthropic_image_blocks_and_a_cached_follow_up(srv):
    c = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=300)
    img = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png(pixels(5))).decode()},
    }  # fmt: skip
    msgs: list = [{"role": "user", "content": [img, {"type": "text", "text": ASK}]}]
    r1 = c.messages.create(model="x", system=SYSTEM, messages=msgs, max_tokens=24)
    total1 = r1.usage.input_tokens + (r1.usage.cache_read_input_tokens or 0)
    assert r1.content and total1 > 3 * 512
    text = "".join(b.text for b in r1.content if b.type == "text")
    msgs += [
        {"role": "assistant", "content": text or "I see."},
        {"role": "user", "content": "Why?"},
    ]
    r2 = c.messages.create(model="x", system=SYSTEM, messages=msgs, max_tokens=24)
    assert (r2.usage.cache_read_input_tokens or 0) >= total1


def test_responses_input_image_and_apply_template(srv):
    url = data_url(png(pixels(6)))
    c = oai(srv)
    r = c.responses.create(
        model="x",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": ASK},
                    {"type": "input_image", "image_url": url, "detail": "auto"},
                ],
            }
        ],
        max_output_tokens=8,
    )
    assert r.status in ("completed", "incomplete") and r.usage is not None
    assert r.usage.input_tokens > N_IMAGE_TOKENS
    t = srv.client.post("/apply-template", json={"messages": first_turn(png(pixels(6)))})
    marker = srv.client.get("/props").json()["media_marker"]
    assert t.status_code == 200 and t.json()["prompt"].count(marker) == 1


def test_a_file_under_media_path_is_read(srv):
    msgs = first_turn(b"")
    msgs[1]["content"][1]["image_url"]["url"] = "file://cat.png"
    r = chat(srv, msgs, max_tokens=4)
    assert r["usage"]["prompt_tokens"] > 3 * 512


def corrupt_png() -> bytes:
    """A PNG whose chunks and CRCs are right but whose IDAT does not inflate."""
    b = bytearray(png(pixels(1)))
    n = struct.unpack(">I", b[33:37])[0]  # IDAT follows the 25-byte IHDR chunk
    b[41 : 41 + n] = b"\x55" * n
    b[41 + n : 45 + n] = struct.pack(">I", zlib.crc32(bytes(b[37 : 41 + n])))
    return bytes(b)


BAD = [
    (data_url(png(pixels(1))[:60]), "PNG image is truncated"),  # cut after the header
    (data_url(corrupt_png()), "could not be decoded"),  # whole, but its data is not zlib
    (data_url(b"\xff\xd8\xff\xc0\0\x11\x08\0\x40\0\x40" + b"\0" * 40), "JPEG image is truncated"),
    (data_url(png_header_only(100000, 100000)), "pixels, more than"),  # a bomb's header
    (data_url(b"GIF89a" + b"\0" * 2), "truncated or malformed"),
    ("data:image/png;base64," + base64.b64encode(b"plain text, not a picture").decode(), "not an image"),
    (data_url(b"RIFF\0\0\0\0WEBPVP8 " + b"\0" * 20), "WebP"),
    ("data:image/png;base64,@@@not-base64@@@", "not valid base64"),
    ("https://example.com/cat.png", "remote image URLs"),
    ("file://../../etc/passwd", "no such image under --media-path"),
    ("data:image/png,rawbytes", "only base64 data URLs"),
    (data_url(b""), "empty"),
]  # fmt: skip


@pytest.mark.parametrize(("url", "why"), BAD)
def test_bad_images_are_400s_naming_the_problem(srv, url, why):
    msgs = first_turn(b"")
    msgs[1]["content"][1]["image_url"]["url"] = url
    with pytest.raises(openai.BadRequestError) as e:
        chat(srv, msgs, max_tokens=4)
    assert why in str(e.value)


def test_too_many_images_and_the_server_keeps_serving(srv):
    part = {"type": "image_url", "image_url": {"url": data_url(png(pixels(3)))}}
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Compare."}] + [part] * 4}]
    with pytest.raises(openai.BadRequestError, match="more than 3 images"):
        chat(srv, msgs, max_tokens=4)
    # text-only chat with the projector loaded: served, and its follow-up reuses the slot
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there."}]
    r1 = chat(srv, msgs)
    msgs += [
        {"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And then?"},
    ]
    r2 = chat(srv, msgs)
    assert r2["timings"]["cache_n"] >= r1["usage"]["prompt_tokens"]
    srv.assert_integrity()
