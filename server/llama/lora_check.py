"""LoRA adapter files checked before llama.cpp reads them (issue 56).

llama.cpp's adapter loader (src/llama-adapter.cpp) trusts the file: it reads
``general.type``, ``general.architecture`` and ``adapter.type`` with the string getter and
``adapter.lora.alpha`` with the f32 one, which abort the process (GGML_ASSERT) on another
type; it checks only a tensor's first two dimensions, not its type, so a 3-D tensor or an
I32 or F64 one loads and then aborts or crashes the first decode that applies it (ggml's
matmul has no kernel for them). ``check_fd`` refuses every such file, and everything else
llama.cpp would read wrong, first.

Contracts of ``check_fd(fd, base)`` (ValueError ``LoraFileError`` naming what is wrong):

- The header is read by ``gguf_header.read_header`` within ``ADAPTER_LIMITS``.
- Keys: ``general.type`` a str, ``"adapter"``; ``general.architecture`` a str, the base
  model's; ``adapter.type`` a str, ``"lora"``; ``adapter.lora.alpha`` (optional) a finite
  f32; ``adapter.lora.task_name`` and ``adapter.lora.prompt_prefix`` (optional) strs;
  ``adapter.alora.invocation_tokens`` (optional) an array of u32; ``general.alignment``
  at most ``MAX_ALIGNMENT``. Other keys may hold any GGUF type (llama.cpp only prints them).
- Tensors: at least one pair. Each is named ``<T>.lora_a`` or ``<T>.lora_b`` for a base
  tensor ``T`` of two or more dimensions, with both halves present, or ends in
  ``_norm.weight`` (llama.cpp skips those); each has a type of ``USABLE`` (the adapter
  matmul's: F32, F16, BF16, Q8_0). Shapes, ggml order, for a base ``T`` of
  ``[n_in, n_out, *rest]``: ``lora_a`` is ``[n_in, r, *rest]``, ``lora_b`` ``[r, n_out,
  *rest]`` (``token_embd.weight``: ``[r, n_out]`` and ``[r, n_in]``, llama.cpp's
  flipped embedding pair), with the same rank ``1 <= r <= min(n_in, n_out)``.
- Data: each tensor at the offset GGUF's layout gives it, wholly inside the file; nothing
  after the data section but its padding. The result is the file's size (those bytes are
  all llama.cpp reads).
- ``base_model(path)`` reads the base model's architecture and tensor shapes from its
  GGUF header(s) (every split of a split model), once per file version (cached).
"""

from __future__ import annotations

import functools
import math
import os
import re
import stat
from dataclasses import dataclass
from typing import BinaryIO

from .gguf_header import (
    ARR,
    F32,
    KV,
    STR,
    U16,
    U32,
    GGUFArray,
    GGUFError,
    Header,
    Limits,
    TensorInfo,
    data_layout,
    dims4,
    ggml_type_name,
    kv_type_name,
    read_header,
)

# an adapter's header: a few keys and a pair of small tensor infos per adapted weight
ADAPTER_LIMITS = Limits(
    max_header_bytes=64 << 20, max_kv=4096, max_tensors=1 << 16, max_string=1 << 20,
    max_array=1 << 20,
)  # fmt: skip
# a base model's (trusted, given at start): a vocabulary of a few hundred thousand strings
BASE_LIMITS = Limits(
    max_header_bytes=1 << 30, max_kv=1 << 16, max_tensors=1 << 20, max_string=1 << 26,
    max_array=1 << 30,
)  # fmt: skip
USABLE = {0: "F32", 1: "F16", 30: "BF16", 8: "Q8_0"}  # ggml type ids the adapter matmul takes
MAX_ALIGNMENT = 1 << 16
_USABLE_TEXT = ", ".join(USABLE.values())


class LoraFileError(ValueError):
    """An adapter file llama.cpp must not read; the message says what is wrong."""


@dataclass(frozen=True)
class BaseModel:
    """What an adapter is checked against: the base model's architecture and tensors."""

    arch: str
    shapes: dict[str, tuple[int, ...]]  # tensor name -> ggml shape (ne0 first)


# ---- the base model -------------------------------------------------------------------

_SPLIT = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")


def _header_of(path: str) -> Header:
    with open(path, "rb", buffering=1 << 16) as f:
        return read_header(f, os.fstat(f.fileno()).st_size, BASE_LIMITS)


def base_model(path: str) -> BaseModel:
    """The base model at ``path`` (module docstring); ValueError where its header cannot
    be read. Cached by the file's identity: a model file replaced is read again."""
    st = os.stat(path)
    return _base_model(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _base_model(path: str, _size: int, _mtime: int) -> BaseModel:
    first = _header_of(path)
    arch = first.kv.get("general.architecture")
    if arch is None or arch.type != STR:
        raise ValueError(f"the model {path!r} names no general.architecture")
    headers = [first]
    count = first.kv.get("split.count")
    m = _SPLIT.match(path)
    if count is not None and count.type == U16 and int(count.number()) > 1 and m:
        n = int(count.number())
        # llama.cpp's llama_split_path: PREFIX-%05d-of-%05d.gguf, numbered from 1
        headers += [_header_of(f"{m.group(1)}-{i:05d}-of-{n:05d}.gguf") for i in range(2, n + 1)]
    shapes = {t.name: t.ne for h in headers for t in h.tensors}
    return BaseModel(str(arch.value), shapes)


# ---- keys -----------------------------------------------------------------------------


def _typed(kv: dict[str, KV], key: str, want: int) -> KV | None:
    v = kv.get(key)
    if v is not None and v.type != want:
        raise LoraFileError(f"{key} is a {kv_type_name(v.type)}: expected {kv_type_name(want)}")
    return v


def _require_str(kv: dict[str, KV], key: str, want: str, whose: str) -> None:
    v = _typed(kv, key, STR)
    if v is None:
        raise LoraFileError(f"{key} is missing: expected {want!r}")
    if v.value != want:
        raise LoraFileError(f"{key} is {str(v.value)[:100]!r}: expected {want!r}{whose}")


def check_keys(kv: dict[str, KV], arch: str) -> None:
    """The keys llama.cpp reads with a typed getter (module docstring)."""
    _require_str(kv, "general.type", "adapter", "")
    _require_str(kv, "general.architecture", arch, " (the base model's)")
    _require_str(kv, "adapter.type", "lora", "")
    alpha = _typed(kv, "adapter.lora.alpha", F32)
    if alpha is not None and not math.isfinite(alpha.number()):
        raise LoraFileError(f"adapter.lora.alpha is {alpha.value}: expected a finite number")
    for key in ("adapter.lora.task_name", "adapter.lora.prompt_prefix"):
        _typed(kv, key, STR)
    tokens = _typed(kv, "adapter.alora.invocation_tokens", ARR)
    arr = tokens.value if tokens is not None else None
    if isinstance(arr, GGUFArray) and arr.elem_type != U32:
        et = kv_type_name(arr.elem_type)
        raise LoraFileError(f"adapter.alora.invocation_tokens holds {et}: expected u32")
    align = _typed(kv, "general.alignment", U32)
    if align is not None and int(align.number()) > MAX_ALIGNMENT:
        raise LoraFileError(f"general.alignment {align.value} is above {MAX_ALIGNMENT}")


# ---- tensors --------------------------------------------------------------------------


def _shown(ne: tuple[int, ...]) -> list[int]:
    """A ggml shape without its trailing 1s (as ggml treats them), for messages."""
    out = list(ne)
    while len(out) > 2 and out[-1] == 1:
        out.pop()
    return out


def _pairs(tensors: list[TensorInfo], base: BaseModel) -> dict[str, list[TensorInfo | None]]:
    """Base tensor name -> [lora_a, lora_b]; the names and types checked."""
    pairs: dict[str, list[TensorInfo | None]] = {}
    for t in tensors:
        if t.type not in USABLE:
            raise LoraFileError(
                f"tensor {t.name!r} has type {ggml_type_name(t.type)}: an adapter's "
                f"tensors are {_USABLE_TEXT}"
            )
        half = {".lora_a": 0, ".lora_b": 1}.get(t.name[-7:])
        if half is None:
            if t.name.endswith("_norm.weight"):
                continue  # llama.cpp skips these (it never reads their data)
            raise LoraFileError(f"tensor {t.name!r} is neither a .lora_a nor a .lora_b")
        target = t.name[:-7]
        if target not in base.shapes:
            raise LoraFileError(f"tensor {t.name!r}: the base model has no tensor {target!r}")
        pairs.setdefault(target, [None, None])[half] = t
    return pairs


def _check_pair(target: str, shape: tuple[int, ...], a: TensorInfo, b: TensorInfo) -> None:
    """One pair's shapes against its base tensor's (module docstring)."""
    if len(shape) < 2:
        raise LoraFileError(f"{target!r} is a vector in the base model: it takes no LoRA")
    n_in, n_out, *rest = dims4(shape)
    r = dims4(b.ne)[0]  # llama.cpp's rank (alpha / rank scales the product)
    if not 1 <= r <= min(n_in, n_out):
        raise LoraFileError(
            f"tensor {b.name!r} has rank {r}: expected 1 to {min(n_in, n_out)} "
            f"for the base tensor's {_shown(shape)}"
        )
    if target.endswith("token_embd.weight"):  # llama.cpp's embedding pair: rows of A
        want_a, want_b = (r, n_out, *rest), (r, n_in, *rest)
    else:
        want_a, want_b = (n_in, r, *rest), (r, n_out, *rest)
    for t, want in ((a, want_a), (b, want_b)):
        if dims4(t.ne) != want:
            raise LoraFileError(
                f"tensor {t.name!r} has shape {list(t.ne)}: expected {_shown(tuple(want))} "
                f"(the base tensor is {_shown(shape)}, the rank {r})"
            )


def check_tensors(tensors: list[TensorInfo], base: BaseModel) -> None:
    """Names, types, pairs and shapes (module docstring)."""
    pairs = _pairs(tensors, base)
    if not pairs:
        raise LoraFileError("the file holds no LoRA tensors")
    for target, (a, b) in pairs.items():
        if a is None or b is None:
            have, lacks = ("lora_a", "lora_b") if b is None else ("lora_b", "lora_a")
            raise LoraFileError(f"{target!r} has a {have} but no {lacks}")
        _check_pair(target, base.shapes[target], a, b)


# ---- the file -------------------------------------------------------------------------


def check_data(h: Header, size: int) -> None:
    """Every tensor's data inside the file, nothing after the data section but padding."""
    layout, end = data_layout(h)
    for t, _start, stop in layout:
        if stop > size:
            raise LoraFileError(
                f"tensor {t.name!r}'s data ends at byte {stop}, past the end of the "
                f"file ({size} bytes)"
            )
    if size > end:
        raise LoraFileError(f"{size - end} bytes follow the tensor data (at byte {end})")


def check_file(f: BinaryIO, size: int, base: BaseModel) -> None:
    """The adapter file ``f`` (at its start, ``size`` bytes) against ``base``."""
    try:
        h = read_header(f, size, ADAPTER_LIMITS)
        check_keys(h.kv, base.arch)
        check_tensors(h.tensors, base)
        check_data(h, size)
    except GGUFError as e:
        raise LoraFileError(str(e)) from None


def check_fd(fd: int, base: BaseModel) -> int:
    """Check the open adapter file ``fd`` from its start (module docstring); its size.
    LoraFileError for anything but a regular file that passes."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise LoraFileError("not a regular file")
    os.lseek(fd, 0, os.SEEK_SET)
    with open(fd, "rb", buffering=1 << 16, closefd=False) as f:
        check_file(f, st.st_size, base)
    return st.st_size
