"""Images in every cache tier (issue 42), end to end: real servers on the default model
(Gemma 3 270M, SWA window 512) with the generated projector (16 tokens per image), prompts
of several windows. The disk tier and slot files keep an image conversation across a
restart (the file names each image's identity and span: server.tiers.image_file), a file
whose image block is tampered with or was made by another projector is refused with
nothing loaded, and the KV events name the image in its blocks' extra keys."""

from __future__ import annotations

import signal
import struct
from pathlib import Path

import pytest

from server.kv_events.kv_blocks import block_hash, extra_cbor
from server.tiers import image_file
from tests.mmproj_gen import N_IMAGE_TOKENS, pixels, png, write_gemma3_mmproj

from .conftest import free_port
from .test_images_e2e import chat, first_turn, metric
from .test_llmd_e2e import BS, Subscriber, wait_for


@pytest.fixture(scope="module")
def projectors(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("projectors")
    return write_gemma3_mmproj(d / "a.gguf"), write_gemma3_mmproj(d / "b.gguf", seed=1)


def turn_two(msgs: list[dict], r1: dict, answer: str | None = None) -> list[dict]:
    text = r1["choices"][0]["message"]["content"] if answer is None else answer
    return msgs + [
        {"role": "assistant", "content": text},
        {"role": "user", "content": "And what colour is it mostly?"},
    ]


def held(r: dict) -> int:
    return r["timings"]["cache_n"] + r["timings"]["prompt_n"]


def test_the_disk_tier_keeps_an_image_conversation_over_a_restart(
    make_server, projectors, tmp_path
):
    args = ("--mmproj", str(projectors[0]), "-np", "1", "-c", "8192", "--metrics",
            "--cache-disk", str(tmp_path))  # fmt: skip
    a = make_server(*args)
    msgs = first_turn(png(pixels(11)))
    r1 = chat(a, msgs)
    p1 = held(r1)
    a.proc.send_signal(signal.SIGTERM)  # the idle slot is written on the way out
    assert a.proc.wait(60) == 0
    files = list(tmp_path.glob("*.lsc"))
    assert len(files) == 1 and struct.pack("<I", image_file.SIMG_MAGIC) in files[0].read_bytes()
    b = make_server(*args)
    assert b.client.get("/cache").json()["disk"]["n_entries"] == 1
    # the same pixels in other PNG bytes: the second turn recomputes only its new text
    msgs_b = first_turn(png(pixels(11), compress=1, filter_type=1))
    r2 = chat(b, turn_two(msgs_b, r1))
    assert r2["timings"]["cache_n"] >= p1 and r2["timings"]["prompt_n"] <= held(r2) - p1
    assert metric(b, "llamaslot_images_decoded") == 0  # its KV came from the file
    assert metric(b, "llamaslot_image_tokens_cached") == N_IMAGE_TOKENS
    assert b.client.get("/cache").json()["disk"]["counters"]["hits"] == 1
    # SWA (window 512): a turn that takes another answer than the one generated cuts back
    # to the end of turn 2's prompt, past the image: a checkpoint resumes it there
    r3 = chat(b, turn_two(turn_two(msgs_b, r1), r2, "Something else entirely."))
    assert r3["timings"]["cache_n"] >= held(r2) - 1, (r3["timings"], held(r2))
    b.assert_integrity()


def _tamper(src: Path, dst: Path) -> None:
    """A copy of ``src`` whose image block names another identity (its first byte)."""
    b = bytearray(src.read_bytes())
    n, _v, magic = struct.unpack_from("<III", b, len(b) - 12)  # the STNT footer
    end = len(b) - 12 - n if magic == 0x544E5453 else len(b)
    block = image_file.find(b, end, 0)
    assert block is not None and len(block.spans) == 1
    at = block.start + image_file.HEAD.size + 8  # the first record's identity
    b[at] ^= 0xFF
    dst.write_bytes(bytes(b))


def test_a_slot_file_holding_an_image_is_restored_and_proven(make_server, projectors, tmp_path):
    saves = tmp_path / "slots"
    saves.mkdir()
    base = ("-np", "1", "-c", "8192", "--metrics", "--slot-save-path", str(saves),
            "--no-cache-idle-slots")  # fmt: skip
    a = make_server("--mmproj", str(projectors[0]), *base)
    msgs = first_turn(png(pixels(12)))
    r1 = chat(a, msgs)
    p1 = held(r1)
    saved = a.client.post("/slots/0?action=save", json={"filename": "img.bin"})
    assert saved.status_code == 200, saved.text
    n_saved = saved.json()["n_saved"]
    assert n_saved >= p1
    a.stop()
    _tamper(saves / "img.bin", saves / "tampered.bin")
    b = make_server("--mmproj", str(projectors[0]), *base)
    # a tampered image block: refused, nothing loaded
    r = b.client.post("/slots/0?action=restore", json={"filename": "tampered.bin"})
    assert r.status_code == 400 and "image" in r.json()["error"]["message"], r.text
    assert b.slots()[0]["n_tokens"] == 0
    b.assert_integrity()
    # the file as saved: restored, and the next turn about the image is cached
    r = b.client.post("/slots/0?action=restore", json={"filename": "img.bin"})
    assert r.status_code == 200 and r.json()["n_restored"] == n_saved, r.text
    r2 = chat(b, turn_two(msgs, r1))
    assert r2["timings"]["cache_n"] >= p1 and r2["timings"]["prompt_n"] <= held(r2) - p1
    assert metric(b, "llamaslot_images_decoded") == 0
    # saved again from the restored slot: its image is still named
    again = b.client.post("/slots/0?action=save", json={"filename": "again.bin"})
    assert again.status_code == 200, again.text
    b.assert_integrity()
    b.stop()
    # another projector: the file's images are not this server's
    c = make_server("--mmproj", str(projectors[1]), *base)
    r = c.client.post("/slots/0?action=restore", json={"filename": "img.bin"})
    assert r.status_code == 400 and "another projector" in r.json()["error"]["message"], r.text
    assert c.slots()[0]["n_tokens"] == 0
    c.assert_integrity()


def test_kv_events_name_the_image_in_its_blocks(make_server, projectors):
    port = free_port()
    sub = Subscriber(f"tcp://127.0.0.1:{port}")
    try:
        s = make_server("--mmproj", str(projectors[0]), "-np", "1", "-c", "8192",
                        "--kv-events-endpoint", f"tcp://127.0.0.1:{port}", "-a", "gemma")  # fmt: skip
        r1 = chat(s, first_turn(png(pixels(13))))

        def stored(since: int = 0) -> list[list]:
            evs = sub.events()[since:]
            return [e for e in evs if e[0] == "BlockStored" and e[6] == "GPU"]

        def names(since: int = 0) -> set[str]:
            return {k for ks in _image_blocks(stored(since)).values() for k in ks}

        wait_for(lambda: sum(len(e[1]) for e in stored()) >= held(r1) // BS, "the slot's blocks")
        keys = _image_blocks(stored())
        first = names()
        assert len(first) == 1 and len(next(iter(first))) == 32  # the identity, in hex
        assert 1 <= len(keys) <= 2  # the blocks the image's 16 positions fall in
        # the same pixels in other bytes after other text (new blocks): the same name again
        n0 = len(sub.events())
        chat(s, other_text(first_turn(png(pixels(13), compress=1)), "One."))
        wait_for(lambda: names(n0), "the image's blocks again")
        assert names(n0) == first
        # another image: another name
        n1 = len(sub.events())
        chat(s, other_text(first_turn(png(pixels(14))), "Two."))
        wait_for(lambda: names(n1), "the other image's blocks")
        assert len(names(n1)) == 1 and names(n1) != first
        s.assert_integrity()
    finally:
        sub.close()


def other_text(msgs: list[dict], head: str) -> list[dict]:
    """``msgs`` with ``head`` before the system prompt: every block's chain differs."""
    return [{**msgs[0], "content": head + " " + msgs[0]["content"]}, *msgs[1:]]


def _image_blocks(stored: list[list]) -> dict[int, tuple[str, ...]]:
    """Every published block that has extra keys: its hash -> its keys, each checked to be
    the hash llm-d computes from the published parent, token ids and extra keys."""
    out: dict[int, tuple[str, ...]] = {}
    for ev in stored:
        if len(ev) < 9 or ev[8] is None:
            continue
        hashes, parent, toks = ev[1], ev[2], ev[3]
        for i, h in enumerate(hashes):
            keys = ev[8][i]
            p = parent if i == 0 else hashes[i - 1]
            blk = toks[i * BS : (i + 1) * BS]
            assert all(t >= 0 for t in blk)
            if keys:
                assert block_hash(p, blk, extra_cbor(tuple(keys))) == h
                assert 0 in blk  # the image's positions, as token id 0
                out[h] = tuple(keys)
    return out
