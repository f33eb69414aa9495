"""server/media/image_inputs.py (issue 42): image inputs bounded before any decoder sees them:
the kind and size from each format's header, truncation from its structure, data URLs
and base64, file:// only under --media-path, the count per request."""

from __future__ import annotations

import base64
import struct

import pytest

from server.llama.mtmd import media_marker
from server.media.image_inputs import (
    MediaInput,
    MediaLimits,
    RecentlyDecoded,
    check_image,
    decode_base64,
    image_bytes,
    image_size,
)
from server.prompts.completion_forms import multimodal_prompt
from server.schemas.errors import APIError
from tests.mmproj_gen import pixels, png, png_header_only

LIMITS = MediaLimits(max_bytes=1 << 20, max_pixels=4096 * 4096, max_count=2)


def jpeg(w: int, h: int) -> bytes:
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\0" + b"\0" * 9
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, h, w, 1) + b"\x01\x11\x00"
    return b"\xff\xd8" + app0 + sof + b"\0" * 16 + b"\xff\xd9"


def gif(w: int, h: int) -> bytes:
    return b"GIF89a" + struct.pack("<HH", w, h) + b"\0" * 8 + b"\x3b"


def bmp(w: int, h: int) -> bytes:
    row = ((w * 24 + 31) // 32) * 4
    head = b"BM" + struct.pack("<IHHI", 54 + row * h, 0, 0, 54)
    dib = struct.pack("<IiiHHIIiiII", 40, w, -h, 1, 24, 0, row * h, 0, 0, 0, 0)
    return head + dib + b"\0" * (row * h)


@pytest.mark.parametrize(
    ("data", "want"),
    [
        (png(pixels(1, 8)), ("PNG", 8, 8)),
        (jpeg(640, 480), ("JPEG", 640, 480)),
        (gif(33, 17), ("GIF", 33, 17)),
        (bmp(5, 3), ("BMP", 5, 3)),
    ],
)
def test_each_kind_reads_its_size_from_the_header_and_is_whole(data, want):
    assert image_size(data, "x") == want
    assert check_image(data, LIMITS, "x") == data


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (png_header_only(100_000, 100_000), "pixels, more than"),
        (png(pixels(1, 8))[:-5], "PNG image is truncated"),
        (jpeg(64, 64)[:-2], "JPEG image is truncated"),
        (gif(9, 9)[:-1] + b"\0" * 80, "GIF image is truncated"),
        (bmp(50, 50)[:-100], "BMP image is truncated"),
        (b"\x89PNG\r\n\x1a\n\0\0", "truncated or malformed"),
        (b"RIFF\0\0\0\0WEBPVP8 ", "WebP"),
        (b"%PDF-1.4", "not an image"),
        (b"", "empty"),
        (b"\x89PNG\r\n\x1a\n" + b"\0" * (2 << 20), "bytes, more than"),
        (png_header_only(0, 5), "0x5 pixels"),
    ],
)
def test_bad_images_are_refused_naming_the_problem(data, why):
    with pytest.raises(APIError, match=why) as e:
        check_image(data, LIMITS, "messages.0.content.1")
    assert e.value.status == 400 and "messages.0.content.1" in str(e.value)


def test_urls_data_urls_base64_and_files(tmp_path):
    b = png(pixels(2, 8))
    b64 = base64.b64encode(b).decode()
    assert image_bytes("data:image/png;base64," + b64, LIMITS, "x") == b
    assert image_bytes(b64, LIMITS, "x") == b  # raw base64
    assert image_bytes(base64.urlsafe_b64encode(b).decode().rstrip("="), LIMITS, "x") == b
    for url, why in [
        ("http://example.com/a.png", "remote image URLs"),
        ("HTTPS://example.com/a.png", "remote image URLs"),
        ("data:image/png,xyz", "only base64"),
        ("data:;;;", "malformed data URL"),
        ("!!!", "not valid base64"),
        ("file://a.png", "--media-path"),
        ("A" * (2 << 20), "more than"),
    ]:
        with pytest.raises(APIError, match=why):
            image_bytes(url, LIMITS, "x")
    root = tmp_path / "media"
    root.mkdir()
    (root / "a.png").write_bytes(b)
    (tmp_path / "secret.png").write_bytes(b)
    (root / "link.png").symlink_to(tmp_path / "secret.png")
    lim = MediaLimits(1 << 20, 1 << 24, 2, str(root))
    assert image_bytes("file://a.png", lim, "x") == b
    assert image_bytes(f"file://{root}/a.png", lim, "x") == b
    # a NUL byte or a lone surrogate: no file can have the name (a 500 before, issue 56)
    nameless = ("file://a.png\x00.txt", "file://a\ud800.png")
    for url in (
        "file://../secret.png",
        "file://link.png",
        "file:///etc/passwd",
        "file://nope.png",
        *nameless,
    ):
        with pytest.raises(APIError, match="no such image under --media-path"):
            image_bytes(url, lim, "x")


def test_images_per_request_are_counted():
    m = MediaInput("<__media__>", LIMITS)
    url = "data:image/png;base64," + base64.b64encode(png(pixels(3, 8))).decode()
    assert m.add_url(url, "a") == "<__media__>" and m.add_url(url, "b") == "<__media__>"
    with pytest.raises(APIError, match="more than 2 images"):
        m.add_url(url, "c")
    assert len(m.images) == 2


def test_media_types_svg_and_the_multimodal_prompt_form(monkeypatch):
    b64 = base64.b64encode(png(pixels(3, 8))).decode()
    with pytest.raises(APIError, match="a data URL of 'application/pdf', not an image"):
        image_bytes("data:application/pdf;base64," + b64, LIMITS, "x")
    assert image_bytes("data:image/jpeg;base64," + b64, LIMITS, "x")  # kind from the bytes
    svg = b'\xef\xbb\xbf<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg"/>'
    with pytest.raises(APIError, match="SVG images are not supported"):
        image_size(svg, "x")
    assert multimodal_prompt("text", 4) is None
    assert multimodal_prompt({"prompt_string": "a"}, 4) is None
    assert multimodal_prompt({"prompt_string": "a <m>", "multimodal_data": [b64]}, 4) == (
        "a <m>",
        [b64],
    )
    for bad, why in [
        ({"prompt_string": [1, 2], "multimodal_data": []}, "must be a string"),
        ({"prompt_string": "a", "multimodal_data": [1]}, "list of base64 strings"),
        ({"prompt_string": "a", "multimodal_data": ["x"] * 5}, "more than 4 images"),
    ]:
        with pytest.raises(APIError, match=why):
            multimodal_prompt(bad, 4)
    monkeypatch.setenv("LLAMA_MEDIA_MARKER", "<img>")
    assert media_marker() == "<img>"
    monkeypatch.delenv("LLAMA_MEDIA_MARKER")
    a, b = media_marker(), media_marker()
    assert a != b and a.startswith("<__media_") and a.endswith("__>")


def test_every_base64_form_decodes_to_the_same_bytes_and_bad_ones_are_refused():
    """The canonical form takes a fast path (binascii's strict mode); wrapped lines,
    URL-safe letters and missing padding take the general one, to the same bytes."""
    data = bytes(range(256)) * 3 + b"\x00\xff"  # every byte, and a length not /3
    canon = base64.b64encode(data).decode()
    forms = [
        canon,
        canon.rstrip("="),
        "\n".join(canon[i : i + 76] for i in range(0, len(canon), 76)),
        " " + canon + "\r\n",
        base64.urlsafe_b64encode(data).decode(),
        base64.urlsafe_b64encode(data).decode().rstrip("="),
    ]
    assert all(decode_base64(f, LIMITS, "x") == data for f in forms)
    for bad in (canon[:-4] + "!!==", "=" + canon, canon + "=A", "é" + canon, canon[:-1] + "*"):
        with pytest.raises(APIError, match="not valid base64"):
            decode_base64(bad, LIMITS, "x")


def test_large_texts_decoded_lately_are_taken_from_the_bounded_memo():
    """A chat client re-sends its image every turn: the same large text decodes once; the
    memo holds at most its byte bound, least recently used out; a bad text is never kept."""
    big = [bytes([i]) * (60 << 10) for i in range(4)]  # 80 KiB of base64 each: kept
    texts = [base64.b64encode(b).decode() for b in big]
    recent = RecentlyDecoded(max_bytes=3 * (60 << 10))
    assert decode_base64(texts[0], LIMITS, "x", recent) == big[0] and len(recent) == 1
    key0 = RecentlyDecoded.key(texts[0])
    assert key0 is not None and recent.get(key0) == big[0]
    # a hit returns what the memo holds, without decoding (shown by planting other bytes)
    recent.put(key0, b"planted")
    assert decode_base64(texts[0], LIMITS, "x", recent) == b"planted"
    recent.put(key0, big[0])
    for t in texts[1:3]:
        decode_base64(t, LIMITS, "x", recent)
    decode_base64(texts[0], LIMITS, "x", recent)  # 0 used again: 1 is now the oldest
    decode_base64(texts[3], LIMITS, "x", recent)  # over the bound: 1 goes
    held = [RecentlyDecoded.key(t) for t in texts]
    assert [recent.get(k) is not None for k in held if k] == [True, False, True, True]
    # not kept: short texts, and texts that are not base64 (refused as before)
    small = base64.b64encode(b"abc").decode()
    assert RecentlyDecoded.key(small) is None
    bad = texts[1][:-4] + "!!=="
    with pytest.raises(APIError, match="not valid base64"):
        decode_base64(bad, LIMITS, "x", recent)
    assert len(recent) == 3 and recent.get(RecentlyDecoded.key(bad) or b"") is None
