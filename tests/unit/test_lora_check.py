"""LoRA adapter files checked before llama.cpp reads them (issue 56: server/llama/lora_check.py,
server/llama/gguf_header.py): each malformed kind that aborted or crashed llama.cpp, and the
others the check refuses, written with the ``gguf`` package (tests/lora_gen.py), each refused
with a message naming what is wrong; a well-formed adapter of the real default model passes
against that model's own header."""

from __future__ import annotations

import os
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from server.llama.lora_check import (
    ADAPTER_LIMITS,
    BaseModel,
    LoraFileError,
    base_model,
    check_fd,
)
from tests.lora_gen import model_tensors, write_adapter, write_for

ARCH = "gemma3"
SHAPES = {  # ggml order (ne0 = n_in first)
    "token_embd.weight": [64, 1000],
    "blk.0.attn_norm.weight": [64],
    "blk.0.attn_q.weight": [64, 128],
    "blk.0.attn_v.weight": [64, 32],
    "blk.0.ffn_down.weight": [256, 64],
}
BASE = BaseModel(ARCH, {k: tuple(v) for k, v in SHAPES.items()})
Q_A = "blk.0.attn_q.weight.lora_a"


def write(path: Path, **kw) -> Path:
    return write_for(ARCH, SHAPES, path, **kw)


def check(path: Path, base: BaseModel = BASE) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        return check_fd(fd, base)
    finally:
        os.close(fd)


def refused(path: Path) -> str:
    with pytest.raises(LoraFileError) as e:
        check(path)
    return str(e.value)


def on(name: str, change):
    """A tensor hook changing only ``name``'s array (``change(array) -> (name, array)``)."""
    return lambda n, t: change(t) if n == name else (n, t)


def test_a_well_formed_adapter_passes_and_its_size_is_what_llama_cpp_reads(tmp_path):
    p = write(tmp_path / "ok.gguf")
    assert check(p) == p.stat().st_size


def test_keys_of_the_wrong_type_are_refused_by_name(tmp_path):
    import gguf

    T = gguf.GGUFValueType
    cases = {  # the three that aborted llama.cpp (GGML_ASSERT in gguf_get_val_str/f32)
        "general.type": ((7, T.UINT32), "general.type is a u32: expected str"),
        "adapter.lora.alpha": (("4", T.STRING), "adapter.lora.alpha is a str: expected f32"),
        "general.architecture": (
            (7, T.UINT32),
            "general.architecture is a u32: expected str",
        ),
        "adapter.type": ((1.0, T.FLOAT64), "adapter.type is a f64: expected str"),
        "general.alignment": ((32, T.UINT64), "general.alignment is a u64: expected u32"),
    }
    for key, (spec, message) in cases.items():
        p = write(tmp_path / f"{key}.gguf", keys={key: spec})
        assert refused(p) == message, key


def test_keys_with_the_wrong_value_are_refused(tmp_path):
    import gguf

    S = gguf.GGUFValueType.STRING
    cases = [
        ({"general.architecture": ("llama", S)},
         "general.architecture is 'llama': expected 'gemma3' (the base model's)"),
        ({"general.type": ("model", S)}, "general.type is 'model': expected 'adapter'"),
        ({"general.type": (None, S)}, "general.type is missing: expected 'adapter'"),
        ({"adapter.type": ("ia3", S)}, "adapter.type is 'ia3': expected 'lora'"),
        ({"adapter.lora.alpha": (float("nan"), gguf.GGUFValueType.FLOAT32)},
         "adapter.lora.alpha is nan: expected a finite number"),
    ]  # fmt: skip
    for i, (keys, message) in enumerate(cases):
        assert refused(write(tmp_path / f"{i}.gguf", keys=keys)) == message


def test_tensors_llama_cpp_cannot_apply_are_refused(tmp_path):
    usable = "an adapter's tensors are F32, F16, BF16, Q8_0"
    cases = {  # a third dimension aborted the first decode; I32 and F64 crashed it
        "3d": (lambda t: (Q_A, np.stack([t, t]))),
        "i32": (lambda t: (Q_A, t.astype(np.int32))),
        "f64": (lambda t: (Q_A, t.astype(np.float64))),
        "i8": (lambda t: (Q_A, t.astype(np.int8))),
        "n_in": (lambda t: (Q_A, t[:, :63])),
        "unknown": (lambda t: ("blk.0.attn_zz.weight.lora_a", t)),
        "suffix": (lambda t: ("blk.0.attn_q.weight.lora_c", t)),
    }
    expected = {
        "3d": f"tensor {Q_A!r} has shape [64, 4, 2]: expected [64, 4] "
        "(the base tensor is [64, 128], the rank 4)",
        "i32": f"tensor {Q_A!r} has type I32: {usable}",
        "f64": f"tensor {Q_A!r} has type F64: {usable}",
        "i8": f"tensor {Q_A!r} has type I8: {usable}",
        "n_in": f"tensor {Q_A!r} has shape [63, 4]: expected [64, 4] "
        "(the base tensor is [64, 128], the rank 4)",
        "unknown": "tensor 'blk.0.attn_zz.weight.lora_a': the base model has no tensor "
        "'blk.0.attn_zz.weight'",
        "suffix": "tensor 'blk.0.attn_q.weight.lora_c' is neither a .lora_a nor a .lora_b",
    }
    for kind, change in cases.items():
        p = write(tmp_path / f"{kind}.gguf", tensor=on(Q_A, change))
        assert refused(p) == expected[kind], kind


def test_pairs_and_ranks_must_agree(tmp_path):
    q_b = "blk.0.attn_q.weight.lora_b"
    other_rank = write(tmp_path / "r.gguf", tensor=on(q_b, lambda t: (q_b, np.hstack([t, t]))))
    assert refused(other_rank) == (
        f"tensor {Q_A!r} has shape [64, 4]: expected [64, 8] "
        "(the base tensor is [64, 128], the rank 8)"
    )
    v_b = "blk.0.attn_v.weight.lora_b"  # renamed to a norm tensor, which llama.cpp skips
    half = write(tmp_path / "h.gguf", tensor=on(v_b, lambda t: ("blk.0.v_norm.weight", t)))
    assert refused(half) == "'blk.0.attn_v.weight' has a lora_a but no lora_b"
    big = write(tmp_path / "big.gguf", rank=40)  # attn_v is [64, 32]
    assert refused(big) == (
        "tensor 'blk.0.attn_v.weight.lora_b' has rank 40: expected 1 to 32 for the base "
        "tensor's [64, 32]"
    )
    with pytest.raises(LoraFileError) as e:  # a base whose attn_q is a vector
        check(
            write(tmp_path / "v.gguf"),
            BaseModel(ARCH, {**BASE.shapes, "blk.0.attn_q.weight": (64,)}),
        )
    assert str(e.value) == "'blk.0.attn_q.weight' is a vector in the base model: it takes no LoRA"


def test_tensor_data_must_lie_inside_the_file_and_nothing_follow_it(tmp_path):
    p = write(tmp_path / "cut.gguf")
    size = p.stat().st_size  # the last tensor (ffn_down's lora_b, 1,024 bytes) ends here
    os.truncate(p, size - 100)
    assert refused(p) == (
        f"tensor 'blk.0.ffn_down.weight.lora_b''s data ends at byte {size}, past the end "
        f"of the file ({size - 100} bytes)"
    )
    q = write(tmp_path / "long.gguf")
    with open(q, "ab") as f:
        f.write(b"\0" * 100)
    assert refused(q) == f"100 bytes follow the tensor data (at byte {size})"


def _raw(*parts: bytes) -> bytes:
    return b"".join(parts)


def _s(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def test_the_header_reader_is_bounded_before_it_allocates(tmp_path):
    head = b"GGUF" + struct.pack("<I", 3)
    cases = {
        "counts": (head + struct.pack("<QQ", 0, 1 << 40), "the key count is 1099511627776: "
                   f"more than {ADAPTER_LIMITS.max_kv}"),
        "key": (head + struct.pack("<QQQ", 0, 1, 1 << 40), "the length of key 0 is "
                f"1099511627776: more than {ADAPTER_LIMITS.max_string}"),
        "nested": (head + struct.pack("<QQ", 0, 1) + _s(b"k") + struct.pack("<iiQ", 9, 9, 1),
                   "key 'k' is an array of arrays"),
        "short": (head + struct.pack("<QQ", 0, 1) + _s(b"k") + struct.pack("<i", 8)
                  + struct.pack("<Q", 50) + b"abc", "the file ends inside the value of 'k' "
                  "(at byte 45)"),
        "magic": (b"not an adapter", "not a GGUF file (no GGUF magic)"),
        "version": (b"GGUF" + struct.pack("<I", 1) + b"\0" * 16,
                    "GGUF version 1: only versions 2 and 3 are read"),
    }  # fmt: skip
    for kind, (data, message) in cases.items():
        p = tmp_path / f"{kind}.gguf"
        p.write_bytes(data)
        assert refused(p) == message, kind


def _returns(fifo: Path, call) -> BaseException | None:
    """What ``call()`` raises, waiting at most 5 s (a blocking open of ``fifo`` is then let
    go by a writer, and the test fails)."""
    done: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            done.append(None)
        except Exception as e:
            done.append(e)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(5)
    if th.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        th.join(5)
        pytest.fail("the open of a FIFO waited for a writer")
    return done[0]


def test_a_fifo_is_not_a_regular_file_and_nothing_waits_on_it(tmp_path):
    from server.schemas.errors import APIError
    from server.service.adapters import file_digest
    from server.service.lora_runtime import open_checked

    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    assert refused(fifo) == "not a regular file"
    e = _returns(fifo, lambda: file_digest(str(fifo)))  # --lora at start, a wake's reload
    assert isinstance(e, OSError) and "not a regular file" in str(e)
    root = os.path.realpath(tmp_path)  # POST /v1/load_lora_adapter
    e = _returns(fifo, lambda: open_checked(root, os.path.join(root, "pipe.gguf")))
    assert isinstance(e, APIError) and e.status == 403


def test_the_default_models_header_and_a_generated_adapter(tmp_path):
    from tests.e2e.conftest import gemma_path

    model = gemma_path()
    t0 = time.perf_counter()
    base = base_model(model)
    took = time.perf_counter() - t0
    arch, shapes = model_tensors(model)  # lora_gen's own parser
    assert base.arch == arch and base.shapes == {k: tuple(v) for k, v in shapes.items()}
    assert took < 5, took  # a 262k-token vocabulary skipped, not parsed into objects
    p = write_adapter(model, tmp_path / "a.gguf")
    assert check(p, base) == p.stat().st_size
    assert base_model(model) is base  # read once
