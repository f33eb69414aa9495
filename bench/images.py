"""Workload 17's runner: images (issue 42), a conversation about a picture and 16 questions
about one picture, side by side with llama-server on the same projector.

No vision model is on PyPI: the projector is a random ``gemma3`` one for the default model
(Gemma 3 270M, ``n_embd`` 640), written once with the ``gguf`` package by
``tests/mmproj_gen.py`` (the tests' writer) into the bench cache: 224-pixel images, 14-pixel
patches pooled by 2 (64 image tokens), and a SigLIP-style encoder of one of two sizes:

- ``SIGLIP_B`` (the -mm configurations): 12 blocks of width 768, SigLIP-B's proportions,
  the smallest vision tower real models ship (SmolVLM's; Gemma 3, Pixtral and Qwen-VL use
  towers of 400-700M parameters at larger images, an encode there costs several times more).
  One encode takes ~390 ms on a 2-core machine.
- ``TOY`` (-mm-toy): 4 blocks of width 256, ~30 ms an encode. With an encode that cheap a
  follow-up's time is its decode in both servers; the configuration shows that bound.

The -mm configurations are sent photo-like 1024x768 PNGs (~1.6 MB, what a chat client sends
for a picture: ``photo_b64``), the -mm-toy ones 256-pixel noise PNGs (``image_b64``): the
toy configurations run the workload as it was first measured. The answers mean nothing; the
decoded pixels, chunks, positions, embeddings and caches are real, in both servers.

Both servers take the same requests: llama-server's ``/completion`` with
``{"prompt": {"prompt_string", "multimodal_data"}}`` (its ``/v1/completions`` answers a JSON
type error there), the prompt in Gemma 3 turn markup with the server's media marker
(``/props`` ``media_marker``) where the image goes, greedy, ``ignore_eos``. The prompts are
longer than the default model's 512-token sliding window.

- **Conversations**: each a long system prompt, an image and a question, then 4 follow-up
  turns, each the previous prompt, its answer and a new question, the image sent again with
  each (as a chat client does). More conversations than slots take turns round-robin, one
  request at a time, so a follow-up finds its conversation out of the slot it left (in the
  RAM cache, as workload 8). Reported: turn-1 TTFT, turn-2+ TTFT (median over the
  follow-ups) and the prompt tokens the follow-ups computed.
- **16 questions about one image**: another system prompt and another image, 16 questions,
  4 in flight over 4 slots. Reported: wall time and TTFT median.

Encode time is what each server reports, summed over both parts: ours its metrics
(``llamaslot_image_encode_seconds`` / ``llamaslot_images_encoded`` on ``/metrics``: the
``--metrics`` flag), llama-server its log at ``-lv 4`` (the time from its slot's
``encoding mtmd batch`` line to libmtmd's ``decoding image batch`` line, by the log's
timestamps). Each counts the CLIP encode only, not decoding the PNG or putting the
embeddings into the KV cache.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import functools
import hashlib
import json
import os
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tests.mmproj_gen import pixels, png, write_gemma3_mmproj

from .client import BenchError, StreamResult
from .prompts import PromptBook, short_text
from .servers import CACHE_ROOT, LLAMA_SERVER, OURS, ServerProcess

MM_SUFFIX = "-mm"  # server name suffix of this workload's configurations
LLAMA_MM = LLAMA_SERVER + MM_SUFFIX
OURS_MM = OURS + MM_SUFFIX
TOY_SUFFIX = "-mm-toy"  # the same on the toy encoder
LLAMA_TOY = LLAMA_SERVER + TOY_SUFFIX
OURS_TOY = OURS + TOY_SUFFIX
# the configurations with llama-server's trace log (-lv 4), read for its encode times only:
# at that verbosity llama-server answers ~10 % slower (turn-2+ TTFT 227 against 206 ms,
# two alternating repeats), so its timings come from the plain -mm configuration
LOG_SUFFIX = "-mm-lv4"
LLAMA_LOG = LLAMA_SERVER + LOG_SUFFIX
OURS_LOG = OURS + LOG_SUFFIX

# The bench projector's geometry: (224 / 14 / 2) ** 2 = 64 tokens an image.
IMAGE_SIZE, PATCH, SCALE = 224, 14, 2
N_IMAGE_TOKENS = (IMAGE_SIZE // PATCH // SCALE) ** 2


@dataclass(frozen=True)
class Encoder:
    """The bench projector's vision tower: its width, feed-forward width, heads, blocks."""

    n_embd: int
    n_ff: int
    n_head: int
    n_block: int

    def path(self) -> Path:
        """Its file in the bench cache (named by its geometry: another size, another file)."""
        name = f"mmproj-gemma3-{IMAGE_SIZE}p{PATCH}s{SCALE}-w{self.n_embd}b{self.n_block}.gguf"
        return CACHE_ROOT / "bench" / name


SIGLIP_B = Encoder(n_embd=768, n_ff=3072, n_head=12, n_block=12)
TOY = Encoder(n_embd=256, n_ff=1024, n_head=4, n_block=4)
PROJECTOR = SIGLIP_B.path()
MM_FLAGS = ("--mmproj", str(PROJECTOR))
TOY_FLAGS = ("--mmproj", str(TOY.path()))
OURS_MM_FLAGS = ("--metrics",)  # ours reports its encode time on /metrics

# llama-server at -lv 4: its slot logs "encoding mtmd batch" before the CLIP encode and
# libmtmd's helper "decoding image batch" after it; each line starts with the log's
# timestamp (minutes.seconds.ms.us since start)
_LLAMA_STAMP = re.compile(rb"^(\d+)\.(\d+)\.(\d+)\.(\d+) ")
_LLAMA_ENCODING = b"encoding mtmd batch"
_LLAMA_DECODING = b"decoding image batch"
_OURS_METRIC = re.compile(
    r"^(llamaslot_image_encode_seconds|llamaslot_images_encoded)(?:_total)? (\S+)$", re.M
)


def ensure_projector(encoder: Encoder = SIGLIP_B, path: Path | None = None) -> Path:
    """Write the bench projector with ``encoder`` at ``path`` (default: its file in the
    bench cache) unless it is there (seeded: always the same file); a temporary name then a
    rename, so a concurrent run never reads half a file.
    Needs the ``gguf`` package (a dev dependency); without it the file stays missing and
    both servers fail to start, which the runner reports as n/a."""
    path = path or encoder.path()
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        write_gemma3_mmproj(
            tmp, n_embd=encoder.n_embd, n_ff=encoder.n_ff, n_head=encoder.n_head,
            n_block=encoder.n_block, image_size=IMAGE_SIZE, patch=PATCH, scale=SCALE,
        )  # fmt: skip
    except ImportError:
        return path
    tmp.replace(path)
    return path


def _seed(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little")


def image_b64(key: str) -> str:
    """A seeded 256-pixel RGB PNG (noise: libmtmd resizes it to the projector's 224), base64:
    the -mm-toy configurations' image."""
    return base64.b64encode(png(pixels(_seed(key), 256))).decode()


PHOTO_W, PHOTO_H = 1024, 768


def photo(seed: int, w: int = PHOTO_W, h: int = PHOTO_H) -> np.ndarray:
    """A seeded photo-like RGB image (uint8, (h, w, 3)): smooth colour fields (a random
    grid every 64 pixels, interpolated) with sensor-like noise, so its PNG has a photo's
    size (~1.6 MB at 1024x768), not noise's (2.4 MB) nor a flat image's (a few KB)."""
    rng = np.random.default_rng(seed)
    grid = rng.integers(0, 256, size=(h // 64 + 2, w // 64 + 2, 3)).astype(np.float32)
    ys = np.linspace(0, grid.shape[0] - 1.001, h)
    xs = np.linspace(0, grid.shape[1] - 1.001, w)
    y0, x0 = ys.astype(int), xs.astype(int)
    fy, fx = (ys - y0)[:, None, None], (xs - x0)[None, :, None]
    img = (
        grid[y0][:, x0] * (1 - fy) * (1 - fx)
        + grid[y0 + 1][:, x0] * fy * (1 - fx)
        + grid[y0][:, x0 + 1] * (1 - fy) * fx
        + grid[y0 + 1][:, x0 + 1] * fy * fx
    )
    img += rng.normal(0, 6, size=img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


@functools.lru_cache(maxsize=32)  # each repeat's images go to every server: made once
def photo_b64(key: str) -> str:
    """A seeded 1024x768 photo-like PNG (``photo``; PNG's sub filter), base64: what a chat
    client sends for a picture, and the -mm configurations' image."""
    return base64.b64encode(png(photo(_seed(key)), filter_type=1)).decode()


def image_maker(sp: ServerProcess) -> Callable[[str], str]:
    """The image a configuration is sent: the toy ones the 256-pixel noise PNG (the
    workload as it was first measured), the others the photo."""
    return image_b64 if sp.name.endswith(TOY_SUFFIX) else photo_b64


@dataclass(frozen=True)
class ImageShape:
    convs: int  # image conversations, round-robin over the slots
    system: int  # tokens of each system prompt
    follow_ups: int  # turns after the first, in the conversation
    questions: int  # about one image
    concurrency: int  # questions in flight
    out: int  # tokens per answer
    words: int  # per question
    # the image each conversation or question is sent, by key (base64): the configuration's
    # (run_images sets it: image_maker)
    image: Callable[[str], str] = photo_b64


def _turn(question: str) -> str:
    return f"<start_of_turn>user\n{question}<end_of_turn>\n<start_of_turn>model\n"


def _first_turn(system: str, marker: str, question: str) -> str:
    return _turn(f"{system}\n\n{marker}\n{question}")


async def stream_native(
    client: httpx.AsyncClient, url: str, prompt: str, image: str, out: int
) -> StreamResult:
    """One streamed ``/completion`` with one image; TTFT is the first non-empty content."""
    body = {
        "prompt": {"prompt_string": prompt, "multimodal_data": [image]},
        "n_predict": out,
        "temperature": 0.0,
        "ignore_eos": True,
        "cache_prompt": True,
        "stream": True,
    }
    try:
        return await _stream_once(client, url, body)
    except httpx.RemoteProtocolError:
        # a kept-alive connection the server had closed (llama-server's HTTP library closes
        # one after 100 requests): nothing was sent back, the request never ran; once more
        return await _stream_once(client, url, body)


async def _stream_once(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> StreamResult:
    t0 = time.perf_counter()
    ttft: float | None = None
    parts: list[str] = []
    timings: dict[str, Any] | None = None
    async with client.stream("POST", f"{url}/completion", json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            raise BenchError(f"POST /completion -> {resp.status_code}: {text[:300]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise BenchError(f"stream error: {chunk['error']}")
            if chunk.get("content"):
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                parts.append(chunk["content"])
            timings = chunk.get("timings") or timings
    total = time.perf_counter() - t0
    return StreamResult(ttft, total, "".join(parts), len(parts), timings, None)


@dataclass
class Encodes:
    count: float | None  # None: not known (llama-server without its trace log)
    ms: float | None


def _traced(sp: ServerProcess) -> bool:
    """Whether llama-server runs at the verbosity that logs its encodes (-lv 4)."""
    argv = sp.spec.argv
    return any(a == "-lv" and b == "4" for a, b in zip(argv, argv[1:], strict=False))


async def encodes(client: httpx.AsyncClient, sp: ServerProcess) -> Encodes:
    """The server's encode counters so far: ours from /metrics, llama-server from its log
    (at -lv 4; unknown otherwise)."""
    if not sp.name.startswith(OURS) and not _traced(sp):
        return Encodes(None, None)
    if sp.name.startswith(OURS):
        resp = await _get(client, f"{sp.url}/metrics")
        resp.raise_for_status()
        got = {m.group(1): float(m.group(2)) for m in _OURS_METRIC.finditer(resp.text)}
        if len(got) != 2:
            raise BenchError("/metrics has no image encode counters (--metrics, --mmproj?)")
        return Encodes(got["llamaslot_images_encoded"], got["llamaslot_image_encode_seconds"] * 1e3)
    return llama_encodes(sp.log_path.read_bytes())


def _stamp_ms(line: bytes) -> float | None:
    m = _LLAMA_STAMP.match(line)
    if m is None:
        return None
    mins, secs, ms, us = (int(g) for g in m.groups())
    return (mins * 60 + secs) * 1e3 + ms + us / 1e3


def llama_encodes(log: bytes) -> Encodes:
    """llama-server's encodes in its log: each from an "encoding mtmd batch" line to the
    next "decoding image batch" line (the server encodes one slot's image at a time, on its
    main loop, then decodes it into the slot)."""
    count, total = 0, 0.0
    start: float | None = None
    for line in log.splitlines():
        if _LLAMA_ENCODING in line:
            start = _stamp_ms(line)
        elif _LLAMA_DECODING in line and start is not None:
            end = _stamp_ms(line)
            if end is not None:
                count, total = count + 1, total + end - start
            start = None
    return Encodes(float(count), total)


async def _get(client: httpx.AsyncClient, url: str) -> httpx.Response:
    """GET ``url``, once more on a kept-alive connection the server had closed (as
    ``stream_native``: llama-server closes one after 100 requests, whichever that is)."""
    try:
        return await client.get(url)
    except httpx.RemoteProtocolError:
        return await client.get(url)


async def _marker(client: httpx.AsyncClient, url: str) -> str:
    resp = await _get(client, f"{url}/props")
    resp.raise_for_status()
    marker = resp.json().get("media_marker")
    if not marker:
        raise BenchError("/props has no media_marker (started without --mmproj?)")
    return str(marker)


async def conversations(
    client: httpx.AsyncClient, url: str, book: PromptBook, key: str, shape: ImageShape
) -> tuple[list[StreamResult], list[StreamResult]]:
    """``convs`` conversations, each its own system prompt and image, taking turns
    round-robin one request at a time (more conversations than slots: each follow-up finds
    its conversation out of the slot it left). Returns the first turns and the follow-ups."""
    marker = await _marker(client, url)
    images = [shape.image(f"{key}-c{i}-img") for i in range(shape.convs)]
    prompts = [
        _first_turn(
            await book.text(f"{key}-c{i}-sys", shape.system),
            marker,
            short_text(f"{key}-c{i}-q0", shape.words),
        )
        for i in range(shape.convs)
    ]
    first: list[StreamResult] = []
    later: list[StreamResult] = []
    for turn in range(1 + shape.follow_ups):
        for i in range(shape.convs):
            r = await stream_native(client, url, prompts[i], images[i], shape.out)
            (later if turn else first).append(r)
            ask = _turn(short_text(f"{key}-c{i}-q{turn + 1}", shape.words))
            prompts[i] += r.text + "<end_of_turn>\n" + ask
    return first, later


async def questions(
    client: httpx.AsyncClient, url: str, book: PromptBook, key: str, shape: ImageShape
) -> tuple[float, list[StreamResult]]:
    """``questions`` about one image, ``concurrency`` in flight: wall seconds and results."""
    marker = await _marker(client, url)
    image = shape.image(f"{key}-img")
    system = await book.text(f"{key}-sys", shape.system)
    prompts = [
        _first_turn(system, marker, short_text(f"{key}-q{i}", shape.words))
        for i in range(shape.questions)
    ]
    sem = asyncio.Semaphore(shape.concurrency)

    async def one(p: str) -> StreamResult:
        async with sem:
            return await stream_native(client, url, p, image, shape.out)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - t0, list(results)


def _less(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _ms(results: list[StreamResult]) -> list[float]:
    return [r.ttft_s * 1e3 for r in results if r.ttft_s is not None]


async def run_images(
    client: httpx.AsyncClient, sp: ServerProcess, book: PromptBook, key: str, shape: ImageShape
) -> tuple[dict[str, float | None], list[float]]:
    """Both parts on one server: the metrics and every TTFT (ms)."""
    e0 = await encodes(client, sp)
    shape = dataclasses.replace(shape, image=image_maker(sp))
    first, later_turns = await conversations(client, sp.url, book, f"{key}-conv", shape)
    e1 = await encodes(client, sp)
    wall, answers = await questions(client, sp.url, book, f"{key}-q16", shape)
    e2 = await encodes(client, sp)
    later = _ms(later_turns)
    later_n = [r.prompt_n for r in later_turns]
    q16_n = [r.prompt_n for r in answers]
    encoded = _less(e2.count, e0.count)
    encode_ms = _less(e2.ms, e0.ms)
    metrics: dict[str, float | None] = {
        "conv_ttft_turn1_ms": statistics.median(_ms(first)) if _ms(first) else None,
        "conv_ttft_later_ms": statistics.median(later) if later else None,
        "conv_prompt_later": None if None in later_n else float(sum(n or 0 for n in later_n)),
        "conv_encode_ms": _less(e1.ms, e0.ms),
        "q16_wall_s": wall,
        "q16_ttft_p50_ms": statistics.median(_ms(answers)) if _ms(answers) else None,
        "q16_prompt": None if None in q16_n else float(sum(n or 0 for n in q16_n)),
        "q16_encode_ms": _less(e2.ms, e1.ms),
        "encode_ms": encode_ms,
        "encoded": encoded,
        "encode_ms_each": encode_ms / encoded if encode_ms is not None and encoded else None,
    }
    return metrics, later + _ms(answers)
