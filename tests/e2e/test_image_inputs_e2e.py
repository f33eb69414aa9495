"""Image inputs in every API (issue 42) on a real server with the generated projector
(tests/mmproj_gen.py, 16 tokens per 64-pixel image): /completion's and /v1/completions'
``multimodal_data`` with the media marker /props gives, Anthropic images inside tool
results and ``url`` sources, several images in one prompt under --mtmd-batch-max-tokens,
and the kinds of bad image, each a 400 naming what is wrong, the server serving after."""

from __future__ import annotations

import base64
import os
import re
import struct

import anthropic
import httpx
import openai
import pytest

from tests.mmproj_gen import N_IMAGE_TOKENS, pixels, png, png_header_only, write_gemma3_mmproj

from .conftest import ServerProc, long_text
from .test_images_e2e import corrupt_png, data_url, metric

CTX = 2048
MAX_MIB = 1


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = tmp_path_factory.mktemp("image-inputs")
    mm = write_gemma3_mmproj(d / "mmproj.gguf")
    media = d / "media"
    media.mkdir()
    (media / "cat.png").write_bytes(png(pixels(7)))
    (d / "outside.png").write_bytes(png(pixels(8)))
    os.symlink(d / "outside.png", media / "escape.png")  # a link out of --media-path
    s = ServerProc(
        "--mmproj", str(mm), "-np", "1", "-c", str(CTX), "--metrics",
        "--media-path", str(media), "--image-max-count", "3",
        "--image-max-mib", str(MAX_MIB), "--mtmd-batch-max-tokens", "32",
    )  # fmt: skip
    yield s
    s.stop()


def b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def marker(s: ServerProc) -> str:
    m = s.client.get("/props").json()["media_marker"]
    assert re.fullmatch(r"<__media_[0-9a-f]{16}__>", m), m  # random per process
    return m


def turn(s: ServerProc, question: str, n_images: int = 1) -> str:
    return (
        "<start_of_turn>user\n"
        + f"{marker(s)}\n" * n_images
        + f"{question}<end_of_turn>\n<start_of_turn>model\n"
    )


def test_completion_multimodal_data_and_its_cache(srv):
    prompt = {
        "prompt_string": turn(srv, "What is this?"),
        "multimodal_data": [b64(png(pixels(11)))],
    }
    body = {"prompt": prompt, "n_predict": 4, "temperature": 0}
    r1 = srv.client.post("/completion", json=body)
    assert r1.status_code == 200, r1.text
    t1 = r1.json()["timings"]
    n = t1["cache_n"] + t1["prompt_n"]
    text_only = len(srv.tokenize(turn(srv, "What is this?").replace(marker(srv), ""), True))
    assert n >= text_only + N_IMAGE_TOKENS
    # the same prompt again: all of it but its last token from the slot
    r2 = srv.client.post("/completion", json=body).json()["timings"]
    assert (r2["cache_n"], r2["prompt_n"]) == (n - 1, 1)
    # /v1/completions takes the same object form (as llama-server does)
    r3 = srv.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
    assert r3.status_code == 200, r3.text
    assert r3.json()["usage"]["prompt_tokens"] == n
    assert r3.json()["timings"]["cache_n"] == n - 1


@pytest.mark.parametrize(
    ("prompt", "why"),
    [
        ({"prompt_string": "look <x> here", "multimodal_data": "abc"}, "must be a list of base64"),
        ({"prompt_string": ["a", 1], "multimodal_data": []}, "must be a string"),
        ({"prompt_string": "no marker", "multimodal_data": [b64(png(pixels(1)))]}, "media markers"),
        ({"prompt_string": "x", "multimodal_data": ["@@@"]}, "multimodal_data.0: the image data is not valid base64"),
        ({"prompt_string": "x", "multimodal_data": [b64(b"GIF89a")]}, "multimodal_data.0: the GIF header"),
        ({"prompt_string": "x", "multimodal_data": ["aGk="] * 4}, "more than 3 images"),
        ({"prompt_string": "a {m} b", "multimodal_data": [b64(corrupt_png())]}, "multimodal_data.0: the data could not be decoded"),
    ],
)  # fmt: skip
def test_bad_multimodal_data_is_400(srv, prompt, why):
    if isinstance(prompt["prompt_string"], str):  # {m}: the server's media marker
        prompt = {**prompt, "prompt_string": prompt["prompt_string"].replace("{m}", marker(srv))}
    r = srv.client.post("/completion", json={"prompt": prompt, "n_predict": 2})
    assert r.status_code == 400 and why in r.json()["error"]["message"], r.text


def test_several_images_in_one_prompt_encode_each_once(srv):
    encoded = metric(srv, "llamaslot_images_encoded")
    a, b = b64(png(pixels(21))), b64(png(pixels(22)))
    prompt = {"prompt_string": turn(srv, "Compare them.", 3), "multimodal_data": [a, b, a]}
    r = srv.client.post("/completion", json={"prompt": prompt, "n_predict": 4})
    assert r.status_code == 200, r.text
    t = r.json()["timings"]
    assert t["cache_n"] + t["prompt_n"] > 3 * N_IMAGE_TOKENS
    assert metric(srv, "llamaslot_images_encoded") == encoded + 2  # a twice: encoded once


def ac(s: ServerProc) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0, timeout=300)


def image_block(b: bytes) -> dict:
    return {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": b64(b)},
    }


def test_anthropic_image_in_a_tool_result(srv):
    decoded = metric(srv, "llamaslot_images_decoded")
    tool = {"name": "camera", "description": "Takes a photo.", "input_schema": {"type": "object"}}
    msgs: list = [
        {"role": "user", "content": "Take a photo and tell me what you see."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "camera", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "text", "text": "Here is the photo."}, image_block(png(pixels(31)))]}]},
    ]  # fmt: skip
    r = ac(srv).messages.create(model="x", messages=msgs, tools=[tool], max_tokens=8)  # type: ignore[arg-type]
    total = r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0)
    assert total > N_IMAGE_TOKENS and r.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert metric(srv, "llamaslot_images_decoded") == decoded + 1
    # an error result with an image, and a url source (remote fetching is off: refused)
    msgs[2]["content"][0]["is_error"] = True
    r2 = ac(srv).messages.create(model="x", messages=msgs, tools=[tool], max_tokens=4)  # type: ignore[arg-type]
    assert r2.usage.input_tokens + (r2.usage.cache_read_input_tokens or 0) > total
    url = {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}
    msgs[2]["content"][0]["content"][1] = url
    with pytest.raises(anthropic.BadRequestError, match="remote image URLs are not fetched"):
        ac(srv).messages.create(model="x", messages=msgs, tools=[tool], max_tokens=4)  # type: ignore[arg-type]


def truncated_gif() -> bytes:
    """A GIF whose header says 64 x 64 and which ends before its trailer."""
    return b"GIF89a" + struct.pack("<HH", 64, 64) + b"\x00\x00\x00" + b"\x01" * 30


def truncated_bmp() -> bytes:
    """An uncompressed 64 x 64 BMP header without its rows."""
    info = struct.pack("<IiiHHIIiiII", 40, 64, 64, 1, 24, 0, 0, 0, 0, 0, 0)
    return b"BM" + struct.pack("<IHHI", 54, 0, 0, 54) + info


SVG = b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg" width="64" height="64"/>'

# (what the client sends as image_url.url, what the 400 says)
BAD = [
    (data_url(png(pixels(1))[:60]), "PNG image is truncated"),
    (data_url(corrupt_png()), "could not be decoded"),
    (data_url(b"\xff\xd8\xff\xc0\0\x11\x08\0\x40\0\x40" + b"\0" * 40), "JPEG image is truncated"),
    (data_url(truncated_gif()), "GIF image is truncated"),
    (data_url(truncated_bmp()), "BMP image is truncated"),
    (data_url(b"GIF89a\x40"), "GIF header is truncated or malformed"),
    (data_url(png_header_only(0, 64)), "header says 0x64 pixels"),
    (data_url(png_header_only(100000, 100000)), "100000x100000 = 10000000000 pixels, more than"),
    (data_url(b"\x00\x01\x02\x03" * 16), "not an image this server reads"),
    (data_url(b"RIFF\0\0\0\0WEBPVP8 " + b"\0" * 20), "WebP images are not supported"),
    (data_url(SVG), "SVG images are not supported"),
    (data_url(b"plain text, not a picture at all"), "not an image this server reads"),
    (data_url(b""), "the image is empty"),
    ("data:image/png;base64,@@@not-base64@@@", "not valid base64"),
    ("data:text/plain;base64," + b64(png(pixels(1))), "a data URL of 'text/plain', not an image"),
    ("data:image/png,rawbytes", "only base64 data URLs"),
    ("data:image/png;base64", "a malformed data URL"),
    ("http://127.0.0.1/cat.png", "remote image URLs are not fetched"),
    ("https://example.com/cat.png", "remote image URLs are not fetched"),
    ("file:///etc/passwd", "no such image under --media-path"),
    ("file://../outside.png", "no such image under --media-path"),
    ("file://escape.png", "no such image under --media-path"),  # a symlink out
    # no file has such a name: the OS calls raise ValueError on it (was a 500, issue 56)
    ("file://cat.png\u0000.txt", "no such image under --media-path"),
    (data_url(b"\x89PNG\r\n\x1a\n" + b"\0" * ((MAX_MIB << 20) + 10)), f"more than {MAX_MIB << 20} bytes"),
]  # fmt: skip


def chat(s: ServerProc, content: list[dict], max_tokens: int = 4) -> dict:
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=300)
    r = c.chat.completions.with_raw_response.create(
        model="x",
        messages=[{"role": "user", "content": content}],  # type: ignore[misc,list-item]
        max_tokens=max_tokens,
    )
    return r.http_response.json()


def img(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize(("url", "why"), BAD)
def test_each_bad_image_is_a_400_naming_it(srv, url, why):
    with pytest.raises(openai.BadRequestError) as e:
        chat(srv, [{"type": "text", "text": "What is it?"}, img(url)])
    assert why in str(e.value) and "messages.0.content.1: " in str(e.value), str(e.value)


def test_too_many_images_too_many_tokens_and_still_serving(srv):
    good = img(data_url(png(pixels(3))))
    with pytest.raises(openai.BadRequestError, match="more than 3 images"):
        chat(srv, [{"type": "text", "text": "Compare."}] + [good] * 4)
    # image tokens over the context: the text alone fits, its three images do not
    words = long_text(4000, seed=5).split()
    n = int(len(words) * (CTX - 25) / len(srv.tokenize(" ".join(words))))
    while len(srv.tokenize(" ".join(words[:n]))) > CTX - 25:
        n -= 4
    text = " ".join(words[:n])
    assert len(srv.tokenize(text)) + 3 * N_IMAGE_TOKENS > CTX
    with pytest.raises(openai.BadRequestError, match="exceeds the available context size"):
        chat(srv, [{"type": "text", "text": text}] + [good] * 3)
    # a body that is no JSON image at all, then a good request: the server serves
    r = httpx.post(
        srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": [img(5)]}]}
    )  # type: ignore[arg-type]
    assert r.status_code == 400
    ok = chat(srv, [{"type": "text", "text": "And this one?"}, good, img("file://cat.png")], 8)
    assert ok["usage"]["prompt_tokens"] > 2 * N_IMAGE_TOKENS
    srv.assert_integrity()


def test_router_pairs_a_folders_projector_with_its_model(tmp_path):
    """Router mode: a models-dir subfolder's ``*mmproj*.gguf`` goes to its model's instance
    as --mmproj (llama-server's rule), /models says the model reads images, and an image
    chat through the router is answered by that instance; a plain model lists text only."""
    from .conftest import gemma_path

    vl = tmp_path / "gemma-vl"
    vl.mkdir()
    (vl / "gemma-3-270m.gguf").symlink_to(gemma_path())
    write_gemma3_mmproj(vl / "gemma-3-270m-mmproj-f16.gguf")
    (tmp_path / "plain.gguf").symlink_to(gemma_path())
    r = ServerProc("--models-dir", str(tmp_path), "-c", "2048", "-np", "1")
    try:
        models = {m["id"]: m for m in r.client.get("/models").json()["data"]}
        assert models["gemma-vl"]["architecture"]["input_modalities"] == ["text", "image"]
        assert models["plain"]["architecture"]["input_modalities"] == ["text"]
        body = {
            "model": "gemma-vl",
            "max_tokens": 4,
            "messages": [
                {"role": "user", "content": [img(data_url(png(pixels(51)))), {"type": "text", "text": "What?"}]}
            ],
        }  # fmt: skip
        res = r.client.post("/v1/chat/completions", json=body, timeout=300)
        assert res.status_code == 200, res.text
        assert res.json()["usage"]["prompt_tokens"] > N_IMAGE_TOKENS
        args = r.client.get("/models").json()["data"]
        (vl_status,) = [m["status"] for m in args if m["id"] == "gemma-vl"]
        assert str(vl / "gemma-3-270m-mmproj-f16.gguf") in vl_status["args"]
        res = r.client.post("/v1/chat/completions", json={**body, "model": "plain"}, timeout=300)
        assert res.status_code == 400 and "--mmproj" in res.json()["error"]["message"]
    finally:
        r.stop()
