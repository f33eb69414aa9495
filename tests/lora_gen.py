"""Small random low-rank LoRA adapters in llama.cpp's GGUF format, for the tests (issue 32).

``write_adapter(model, out)`` reads the base model's tensor shapes with the ``gguf`` package
and writes, for each targeted weight ``blk.N.<name>.weight`` (ggml shape [n_in, n_out]),
the pair llama.cpp's adapter loader expects (src/llama-adapter.cpp): ``<tensor>.lora_a``
of ggml shape [n_in, rank] and ``<tensor>.lora_b`` of [rank, n_out] (numpy shapes are the
reverse), f32, with ``general.type = adapter``, ``general.architecture`` the model's,
``adapter.type = lora`` and ``adapter.lora.alpha`` (``write_for``: keys and tensors
replaced, for malformed ones). llama.cpp adds
``scale * alpha / rank * B @ A`` to each weight's product. Random, seeded: two seeds give
two different adapters of the same model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

TARGETS = ("attn_q", "attn_v", "ffn_down")


# a key to write: its value and gguf.GGUFValueType (value None: the key is left out)
KeySpec = tuple[object, object]
# (name, numpy array) -> (name, array) as written: a test's way to break one tensor
TensorHook = Callable[[str, np.ndarray], tuple[str, np.ndarray]]


def write_adapter(model: str | Path, out: str | Path, **kw: Any) -> Path:
    """Write a random adapter for ``model`` to ``out``; returns ``out``. The keywords are
    ``write_for``'s (``seed``, ``rank``, ``alpha``, ``std``, ``targets``, ``keys``,
    ``tensor``)."""
    arch, shapes = model_tensors(model)
    return write_for(arch, shapes, out, **kw)


def write_for(
    arch: str,
    shapes: dict[str, list[int]],
    out: str | Path,
    *,
    seed: int = 0,
    rank: int = 4,
    alpha: float = 4.0,
    std: float = 0.1,
    targets: tuple[str, ...] = TARGETS,
    keys: dict[str, KeySpec] | None = None,
    tensor: TensorHook | None = None,
) -> Path:
    """Write a random adapter for a model given by its architecture and tensor shapes (ggml
    order) to ``out``; returns ``out``. ``std``: the entries' standard deviation (B @ A then
    has entries of about ``rank * std**2``). ``keys``: keys written over the usual ones (a value None leaves the key out;
    ``general.architecture`` too); ``tensor``: applied to each tensor before it is
    written (malformed adapters for the tests of server/llama/lora_check.py)."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(alpha))
    for key, (value, vtype) in (keys or {}).items():
        if value is None:
            w.kv_data[0].pop(key, None)
        else:
            w.kv_data[0][key] = gguf.GGUFValue(value=value, type=vtype)
    for name, shape in shapes.items():
        if not name.startswith("blk.") or name.split(".")[2] not in targets:
            continue
        n_in, n_out = shape[0], shape[1]  # ggml order: ne0, ne1
        base = name.removesuffix(".weight")
        a = rng.normal(0.0, std, size=(rank, n_in)).astype(np.float32)
        b = rng.normal(0.0, std, size=(n_out, rank)).astype(np.float32)
        for t_name, t in ((f"{base}.weight.lora_a", a), (f"{base}.weight.lora_b", b)):
            w.add_tensor(*(tensor(t_name, t) if tensor else (t_name, t)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out)


_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # type: bytes


def model_tensors(model: str | Path) -> tuple[str, dict[str, list[int]]]:
    """The model's architecture and its tensors' ggml shapes, read from the GGUF header
    (gguf.GGUFReader parses the whole vocabulary: half a minute on the default model)."""
    import struct

    with open(model, "rb") as f:
        buf = f.read(64 << 20)  # the header (a 262k-token vocabulary) fits
    magic, _ver, n_t, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
    assert magic == b"GGUF", magic
    pos = 24

    def string(p: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, p)
        return buf[p + 8 : p + 8 + n].decode("utf-8", "replace"), p + 8 + n

    def skip(t: int, p: int) -> int:
        if t == 8:
            return string(p)[1]
        if t == 9:
            et, n = struct.unpack_from("<IQ", buf, p)
            p += 12
            if et in _SCALAR:
                return p + n * _SCALAR[et]
            for _ in range(n):
                p = skip(et, p)
            return p
        return p + _SCALAR[t]

    arch = ""
    for _ in range(n_kv):
        key, pos = string(pos)
        (t,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if key == "general.architecture":
            arch = string(pos)[0]
        pos = skip(t, pos)
    shapes: dict[str, list[int]] = {}
    for _ in range(n_t):
        name, pos = string(pos)
        (nd,) = struct.unpack_from("<I", buf, pos)
        dims = list(struct.unpack_from(f"<{nd}Q", buf, pos + 4))
        pos += 4 + 8 * nd + 4 + 8  # dims, type, offset
        shapes[name] = dims
    return arch, shapes
