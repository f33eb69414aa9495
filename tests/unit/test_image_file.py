"""The SIMG block (server.tiers.image_file): a state's images named by identity and span,
written and proven again; every way a block can lie is refused."""

from __future__ import annotations

import struct

import pytest

from server.image_types import IMAGE_NAMES, ImageSpan, image_placeholders
from server.tiers import image_file

KEY = b"k" * 16


def tokens_with_images() -> tuple[list[int], bytes, bytes]:
    a, b = b"A" * 16, b"B" * 16
    return [1, 2, *image_placeholders(a, 4), 3, *image_placeholders(b, 3), 4], a, b


def test_a_round_trip_names_each_image_and_proves_it():
    toks, a, b = tokens_with_images()
    blk = image_file.encode(toks, KEY)
    buf = b"x" * 40 + blk
    got = image_file.find(buf, len(buf), 20)
    assert got is not None and got.key == KEY and got.start == 40
    assert got.spans == [ImageSpan(2, 4, a), ImageSpan(7, 3, b)]
    image_file.check(toks, got, KEY)
    assert IMAGE_NAMES.spans(toks) == got.spans


def test_text_only_states_have_no_block():
    assert image_file.encode([1, 2, 3], KEY) == b""
    assert image_file.find(b"y" * 64, 64, 0) is None
    image_file.check([1, 2, 3], None, None)


def _block(toks: list[int]) -> bytearray:
    return bytearray(image_file.encode(toks, KEY))


@pytest.mark.parametrize(
    "change, why",
    [
        (lambda b: b.__setitem__(slice(36, 37), b"Z"), "not the one its block names"),
        (lambda b: struct.pack_into("<I", b, 28, 3), "before 3 name no image"),  # start
        (lambda b: struct.pack_into("<I", b, 32, 99), "out of place"),  # n_tokens
    ],
)
def test_a_tampered_block_is_refused(change, why):
    toks, _, _ = tokens_with_images()
    blk = _block(toks)
    change(blk)
    got = image_file.find(blk, len(blk), 0)
    with pytest.raises(image_file.ImageFileError, match=why):
        image_file.check(toks, got, KEY)


def test_another_projector_none_and_unnamed_placeholders_are_refused():
    toks, _, _ = tokens_with_images()
    got = image_file.find(_block(toks), len(_block(toks)), 0)
    with pytest.raises(image_file.ImageFileError, match="another projector") as e:
        image_file.check(toks, got, b"o" * 16)
    assert e.value.foreign
    with pytest.raises(image_file.ImageFileError, match="no projector"):
        image_file.check(toks, got, None)
    with pytest.raises(image_file.ImageFileError, match="names no images"):
        image_file.check(toks, None, KEY)
    with pytest.raises(image_file.ImageFileError, match="name no image"):
        image_file.check([*toks, -5], got, KEY)


def test_lengths_and_counts_that_do_not_fit_are_refused():
    toks, _, _ = tokens_with_images()
    blk = _block(toks)
    bad = bytearray(blk)
    struct.pack_into("<I", bad, len(bad) - 8, len(bad) + 100)  # longer than the file
    with pytest.raises(image_file.ImageFileError, match="length"):
        image_file.find(bad, len(bad), 0)
    bad = bytearray(blk)
    struct.pack_into("<I", bad, 24, 2**31)  # the count
    with pytest.raises(image_file.ImageFileError, match="do not fit"):
        image_file.find(bad, len(bad), 0)
    with pytest.raises(image_file.ImageFileError, match="no projector"):
        image_file.encode(toks, None)
    with pytest.raises(image_file.ImageFileError, match="not known"):
        image_file.encode([1, -12345, -6789], KEY)
