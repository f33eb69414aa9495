"""A tiny random vision projector (mmproj GGUF) for the tests (issue 42), and PNG files.

``write_gemma3_mmproj(out)`` writes a ``gemma3``-type projector that libmtmd loads against
the default model (Gemma 3 270M, ``n_embd`` 640): a one-block SigLIP-style encoder over
64-pixel images of 8-pixel patches, pooled by ``scale`` (2) per side, so each image is
``(64 / 8 / 2) ** 2 == 16`` tokens. Random weights, seeded: the answers mean nothing; the
chunks, positions, embeddings and caches are real. Key types follow clip.cpp's readers
exactly (u32 / f32 / bool / string / f32 arrays): a wrong type aborts the loading process,
so a new key is tried in a subprocess first.

``png(pixels)`` writes an RGB PNG with zlib + struct (no Pillow), ``compress`` and
``filter_type`` choosing other bytes for the same pixels.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

IMAGE_SIZE = 64
PATCH = 8
SCALE = 2
N_IMAGE_TOKENS = (IMAGE_SIZE // PATCH // SCALE) ** 2


def write_gemma3_mmproj(
    out: str | Path,
    *,
    n_embd_text: int = 640,
    n_embd: int = 32,
    n_ff: int = 48,
    n_head: int = 2,
    n_block: int = 1,
    seed: int = 0,
    image_size: int = IMAGE_SIZE,
    patch: int = PATCH,
    scale: int = SCALE,
) -> Path:
    """Write the projector to ``out``; returns ``out``. ``n_embd_text``: the text model's
    embedding width (``mm.input_projection.weight``'s first ggml dimension). An image is
    ``(image_size // patch // scale) ** 2`` tokens (the defaults: ``N_IMAGE_TOKENS``); the
    benchmark (bench/images.py) writes a larger encoder whose encode time is measurable."""
    import gguf

    rng = np.random.default_rng(seed)

    def rand(*shape: int, std: float = 0.05) -> np.ndarray:
        return rng.normal(0.0, std, size=shape).astype(np.float32)

    w = gguf.GGUFWriter(str(out), "clip")
    w.add_string("general.name", "tiny-gemma3-mmproj")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", "gemma3")
    w.add_uint32("clip.vision.image_size", image_size)
    w.add_uint32("clip.vision.patch_size", patch)
    w.add_uint32("clip.vision.embedding_length", n_embd)
    w.add_uint32("clip.vision.feed_forward_length", n_ff)
    w.add_uint32("clip.vision.block_count", n_block)
    w.add_uint32("clip.vision.attention.head_count", n_head)
    w.add_uint32("clip.vision.projection_dim", n_embd_text)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    w.add_uint32("clip.vision.projector.scale_factor", scale)
    w.add_bool("clip.use_gelu", True)
    n_patches = (image_size // patch) ** 2
    # numpy shapes are ggml's reversed: conv kernel [p, p, 3, n_embd] in ggml order
    w.add_tensor("v.patch_embd.weight", rand(n_embd, 3, patch, patch).astype(np.float16))
    w.add_tensor("v.patch_embd.bias", rand(n_embd))
    w.add_tensor("v.position_embd.weight", rand(n_patches, n_embd))
    for i in range(n_block):
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(f"v.blk.{i}.{name}.weight", rand(n_embd, n_embd))
            w.add_tensor(f"v.blk.{i}.{name}.bias", rand(n_embd))
        for name in ("ln1", "ln2"):
            w.add_tensor(f"v.blk.{i}.{name}.weight", 1.0 + rand(n_embd))
            w.add_tensor(f"v.blk.{i}.{name}.bias", rand(n_embd))
        # ffn_down's first ggml dimension is n_ff (not n_embd): clip.cpp's legacy swap stays off
        w.add_tensor(f"v.blk.{i}.ffn_up.weight", rand(n_ff, n_embd))
        w.add_tensor(f"v.blk.{i}.ffn_up.bias", rand(n_ff))
        w.add_tensor(f"v.blk.{i}.ffn_down.weight", rand(n_embd, n_ff))
        w.add_tensor(f"v.blk.{i}.ffn_down.bias", rand(n_embd))
    w.add_tensor("v.post_ln.weight", 1.0 + rand(n_embd))
    w.add_tensor("v.post_ln.bias", rand(n_embd))
    w.add_tensor("mm.soft_emb_norm.weight", rand(n_embd))
    w.add_tensor("mm.input_projection.weight", rand(n_embd, n_embd_text, std=0.5))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out)


def pixels(seed: int, size: int = IMAGE_SIZE) -> np.ndarray:
    """A random RGB image, ``size`` x ``size`` (uint8, shape (h, w, 3))."""
    return np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png(px: np.ndarray, *, compress: int = 6, filter_type: int = 0) -> bytes:
    """``px`` (uint8, (h, w, 3)) as an RGB PNG. Filter 0 (none) or 1 (sub), any zlib
    level: the same pixels in different bytes."""
    h, w, _ = px.shape
    rows = []
    for y in range(h):
        row = px[y].astype(np.int16).reshape(-1)
        if filter_type == 1:
            row = row - np.concatenate([np.zeros(3, np.int16), row[:-3]])
        rows.append(bytes([filter_type]) + (row % 256).astype(np.uint8).tobytes())
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    raw = zlib.compress(b"".join(rows), compress)
    return (
        b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", raw) + _chunk(b"IEND", b"")
    )


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` and whose data is a few bytes: a
    decompression bomb's shape, refused from the header before any decoding."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", ihdr)
        + _chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + _chunk(b"IEND", b"")
    )


def tiny_gif(width: int, height: int) -> bytes:
    """A valid GIF of 35 bytes whose logical screen is ``width`` x ``height``, with one
    1x1 frame: stb_image decodes (and clears) the whole screen, ~0.5-1.25 s at 8192x4096
    on 2 cores (issue 56)."""
    screen = struct.pack("<HHBBB", width, height, 0x80, 0, 0) + b"\0\0\0\xff\xff\xff"
    # one 1x1 frame, LZW minimum code size 2: clear, index 0, end (3-bit codes)
    frame = b"\x2c" + struct.pack("<HHHHB", 0, 0, 1, 1, 0) + b"\x02\x02\x44\x01\x00"
    return b"GIF89a" + screen + frame + b"\x3b"


def _seg(marker: int, body: bytes) -> bytes:
    return bytes([0xFF, marker]) + struct.pack(">H", len(body) + 2) + body


def tiny_jpeg(width: int, height: int) -> bytes:
    """A valid grayscale baseline JPEG of 142 bytes whose frame is ``width`` x ``height``:
    every 8x8 block is DC 0 and end-of-block, two bits each, and the scan's few bytes run
    out (stb_image reads the rest as zeros): it decodes the whole frame (issue 56)."""
    dqt = _seg(0xDB, b"\x00" + b"\x01" * 64)
    sof = _seg(0xC0, struct.pack(">BHHB", 8, height, width, 1) + b"\x01\x11\x00")
    one_code = b"\x01" + b"\x00" * 15 + b"\x00"  # one code of length 1, for symbol 0
    dht = _seg(0xC4, b"\x00" + one_code) + _seg(0xC4, b"\x10" + one_code)
    sos = _seg(0xDA, b"\x01\x01\x00\x00\x3f\x00")
    return b"\xff\xd8" + dqt + sof + dht + sos + b"\x00\x00" + b"\xff\xd9"


def scans_jpeg(width: int, height: int, n_scans: int) -> bytes:
    """A valid grayscale progressive JPEG: a DC scan, then ``n_scans`` AC scans of 11 bytes
    each, every one a single end-of-band run over the whole frame (the bits run out: stb_image
    reads zeros), which stb_image still walks block by block (issue 56)."""
    dqt = _seg(0xDB, b"\x00" + b"\x01" * 64)
    sof = _seg(0xC2, struct.pack(">BHHB", 8, height, width, 1) + b"\x01\x11\x00")
    dc_table = b"\x00" + b"\x01" + b"\x00" * 15 + b"\x00"  # one 1-bit code: DC diff 0
    ac_table = b"\x10" + b"\x01" + b"\x00" * 15 + b"\xe0"  # one 1-bit code: EOB run 2^14+
    dht = _seg(0xC4, dc_table) + _seg(0xC4, ac_table)
    dc = _seg(0xDA, b"\x01\x01\x00\x00\x00\x00") + b"\x00"
    ac = _seg(0xDA, b"\x01\x01\x00\x01\x3f\x00") + b"\x00"
    return b"\xff\xd8" + dqt + sof + dht + dc + ac * n_scans + b"\xff\xd9"
