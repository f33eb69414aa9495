"""Workload 17 (images, issue 42): its projector, prompts, server configurations and how it
reads each server's encode time. (Running it needs the servers: `python -m bench.run
--only 17`.)"""

from __future__ import annotations

import asyncio
import base64
import struct
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench import images
from bench.client import StreamResult
from bench.prompts import PromptBook
from bench.run import variant_specs
from bench.servers import LLAMA_SERVER, OURS, ServerProcess, ServerSpec
from bench.workloads import FULL, QUICK, WORKLOADS


async def _words(text: str) -> list[str]:  # a tokenizer: one piece per word
    return [w + " " for w in text.split()]


def test_w17_runs_both_servers_on_the_same_projector() -> None:
    """Three configurations: -mm at llama-server's own verbosity (its timings), -mm-lv4
    whose log times llama-server's encodes (it answers slower at that verbosity), both on
    the SigLIP-B-sized projector, and -mm-toy on the toy one."""
    w = WORKLOADS[17]
    base = [
        ServerSpec(LLAMA_SERVER, ["llama-server", "-m", "m.gguf"]),
        ServerSpec(OURS, [sys.executable, "-m", "server", "-m", "m.gguf"]),
    ]
    specs = variant_specs(base, w.variants, not w.variants_only, Path("/tmp/run"))
    llama, llama_log, llama_toy, ours, ours_log, ours_toy = specs
    assert (llama.name, ours.name) == (images.LLAMA_MM, images.OURS_MM)
    assert (llama_log.name, ours_log.name) == (images.LLAMA_LOG, images.OURS_LOG)
    proj = str(images.PROJECTOR)
    assert llama.argv[-2:] == ["--mmproj", proj] and "-lv" not in llama.argv
    assert ours.argv[-3:] == ["--mmproj", proj, "--metrics"]  # its encode time
    assert llama_log.argv[-4:] == ["--mmproj", proj, "-lv", "4"]  # its encode log is level 4
    # ours: the same file, --metrics for its encode time, its own log level (the last wins)
    assert ours_log.argv[-7:] == ["--mmproj", proj, "-lv", "4", "--metrics", "-lv", "3"]
    toy = str(images.TOY.path())
    assert toy != proj and llama_toy.argv[-2:] == ["--mmproj", toy]
    assert ours_toy.argv[-3:] == ["--mmproj", toy, "--metrics"]
    assert (llama_toy.name, ours_toy.name) == (images.LLAMA_TOY, images.OURS_TOY)
    ratios = {(r.num, r.key) for r in w.variant_ratios}
    assert (images.OURS_MM, "conv_ttft_later_ms") in ratios
    assert (images.OURS_LOG, "encode_ms") in ratios
    assert (images.OURS_TOY, "conv_ttft_later_ms") in ratios
    # written when the workload was imported
    assert images.PROJECTOR.is_file() and images.TOY.path().is_file()
    assert "8 questions" in w.describe(QUICK) and "16 questions" in w.describe(FULL)


def test_the_projector_matches_the_default_model_and_gives_64_tokens(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    path = images.ensure_projector(images.TOY, tmp_path / "p.gguf")  # the small one: quick
    r = gguf.GGUFReader(str(path))

    def u32(key: str) -> int:
        f = r.fields[key]
        return int(f.parts[f.data[0]][0])

    size, patch, scale = (
        u32(f"clip.vision.{k}") for k in ("image_size", "patch_size", "projector.scale_factor")
    )
    assert (size // patch // scale) ** 2 == images.N_IMAGE_TOKENS == 64
    proj = next(t for t in r.tensors if t.name == "mm.input_projection.weight")
    assert list(proj.shape)[0] == 640  # ggml's first dimension: Gemma 3 270M's n_embd
    assert images.ensure_projector(images.TOY, path) == path  # there: not written again
    assert images.SIGLIP_B.path() == images.PROJECTOR != images.TOY.path()


def test_images_are_seeded_pngs() -> None:
    a, b = images.image_b64("k1"), images.image_b64("k2")
    assert a == images.image_b64("k1") and a != b
    raw = base64.b64decode(a)
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", raw[16:24]) == (256, 256)
    p, q = images.photo_b64("k1"), images.photo_b64("k2")
    assert p == images.photo_b64("k1") and p != q
    raw = base64.b64decode(p)
    assert struct.unpack(">II", raw[16:24]) == (images.PHOTO_W, images.PHOTO_H) == (1024, 768)
    assert 1_000_000 < len(raw) < 2_400_000  # a photo's PNG: not noise's, nor a flat image's


def test_encode_time_from_llama_server_log_and_from_our_metrics(tmp_path: Path) -> None:
    log = tmp_path / "llama.log"
    log.write_bytes(  # as llama-server -lv 4 writes them (minutes.seconds.ms.us)
        b"0.08.959.551 I srv  load_model: loaded multimodal model\n"
        b"1.25.721.240 I slot process_mtmd: id  2 | task 10 | encoding mtmd batch from idx = 606\n"
        b"1.28.037.808 I decoding image batch 1/1, n_tokens_batch = 64\n"
        b"1.40.822.274 I image decoded (batch 1/1) in 12785 ms\n"
        b"59.59.990.000 I slot process_mtmd: id  1 | task 22 | encoding mtmd batch from idx = 6\n"
        b"60.00.031.500 I decoding image batch 1/1, n_tokens_batch = 64\n"
    )
    metrics = (
        "# HELP llamaslot_images_encoded_total Images encoded by the projector\n"
        "llamaslot_images_encoded_total 2.0\n"
        "llamaslot_image_encode_seconds_total 0.0625\n"
    )

    def handler(req: httpx.Request) -> httpx.Response:
        assert req.url.path == "/metrics"
        return httpx.Response(200, text=metrics)

    async def three() -> tuple[images.Encodes, images.Encodes, images.Encodes]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
            traced = ServerSpec(images.LLAMA_LOG, ["llama-server", "-lv", "4"])
            llama = ServerProcess(traced, 1, None, log)  # type: ignore[arg-type]
            plain = ServerProcess(ServerSpec(images.LLAMA_MM, []), 1, None, log)  # type: ignore[arg-type]
            ours = ServerProcess(ServerSpec(images.OURS_MM, []), 2, None, log)  # type: ignore[arg-type]
            return (
                await images.encodes(c, llama),
                await images.encodes(c, plain),
                await images.encodes(c, ours),
            )

    llama, plain, ours = asyncio.run(three())
    assert llama.count == 2.0 and llama.ms == pytest.approx(2316.568 + 41.5)
    assert (plain.count, plain.ms) == (None, None)  # no trace log: not known
    assert (ours.count, ours.ms) == (2.0, 62.5)


def _fake_stream(sent: list[tuple[str, str]]) -> Any:
    async def stream(client: Any, url: str, prompt: str, image: str, out: int) -> StreamResult:
        sent.append((prompt, image))
        return StreamResult(0.01, 0.1, " answer", 1, {"prompt_n": 5}, None)

    return stream


def test_conversations_go_round_robin_and_resend_their_image(monkeypatch: Any) -> None:
    sent: list[tuple[str, str]] = []
    monkeypatch.setattr(images, "stream_native", _fake_stream(sent))

    async def marker(client: Any, url: str) -> str:
        return "<M>"

    monkeypatch.setattr(images, "_marker", marker)
    shape = images.ImageShape(3, 40, 2, 4, 2, 2, 5)
    first, later = asyncio.run(images.conversations(None, "u", PromptBook(_words), "k", shape))  # type: ignore[arg-type]
    assert (len(first), len(later)) == (3, 6)
    prompts = [p for p, _ in sent]
    assert len({img for _, img in sent}) == 3  # one image per conversation
    for i in range(3):  # turns of conversation i: i, i + 3, i + 6
        p0, p1, p2 = prompts[i], prompts[i + 3], prompts[i + 6]
        assert p0.count("<M>") == 1 and p1.startswith(p0 + " answer<end_of_turn>\n")
        assert p2.startswith(p1) and p2.endswith("<start_of_turn>model\n")
        assert sent[i][1] == sent[i + 3][1] == sent[i + 6][1]
        assert len(p0.split()) >= 40  # the system prompt


def test_run_images_counts_both_parts_encodes_and_tokens(monkeypatch: Any) -> None:
    sent: list[tuple[str, str]] = []
    monkeypatch.setattr(images, "stream_native", _fake_stream(sent))

    async def marker(client: Any, url: str) -> str:
        return "<M>"

    counts = iter([images.Encodes(1, 10.0), images.Encodes(4, 70.0), images.Encodes(5, 90.0)])

    async def encodes(client: Any, sp: Any) -> images.Encodes:
        return next(counts)

    monkeypatch.setattr(images, "_marker", marker)
    monkeypatch.setattr(images, "encodes", encodes)
    shape = images.ImageShape(2, 20, 1, 3, 2, 2, 5)
    sp = ServerProcess(ServerSpec(images.OURS_MM, []), 1, None, Path("/x"))  # type: ignore[arg-type]
    m, ttft = asyncio.run(images.run_images(None, sp, PromptBook(_words), "k", shape))  # type: ignore[arg-type]
    assert len(sent) == 2 * 2 + 3 and len(ttft) == 2 + 3  # follow-ups and questions
    assert (m["conv_encode_ms"], m["q16_encode_ms"], m["encode_ms"]) == (60.0, 20.0, 80.0)
    assert m["encoded"] == 4 and m["encode_ms_each"] == 20.0
    assert m["conv_prompt_later"] == 10.0 and m["q16_prompt"] == 15.0
    assert all(len(img) > 1_000_000 for _, img in sent)  # -mm: the photos

    sent.clear()
    counts = iter([images.Encodes(1, 10.0)] * 3)
    toy = ServerProcess(ServerSpec(images.OURS_TOY, []), 1, None, Path("/x"))  # type: ignore[arg-type]
    asyncio.run(images.run_images(None, toy, PromptBook(_words), "k", shape))  # type: ignore[arg-type]
    assert {img for _, img in sent} == {  # -mm-toy: the 256-pixel noise, as first measured
        images.image_b64(f"k-conv-c{i}-img") for i in range(2)
    } | {images.image_b64("k-q16-img")}


def test_a_get_on_a_connection_the_server_closed_goes_once_more() -> None:
    """llama-server closes a kept-alive connection after 100 requests: the /props or
    /metrics GET that meets it is sent again, not counted as the server failing."""
    calls: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        calls.append(req.url.path)
        if len(calls) == 1:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return httpx.Response(200, json={"media_marker": "<M>"})

    async def marker() -> str:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
            return await images._marker(c, "http://x")

    assert asyncio.run(marker()) == "<M>" and calls == ["/props", "/props"]
