"""A strict, bounded reader of a GGUF file's header: its key-value pairs and tensor infos
(ggml/src/gguf.cpp's layout, versions 2 and 3, little-endian), read in Python before
llama.cpp sees a file it must not crash on (LoRA adapters: server/llama/lora_check.py).

Contracts:

- ``read_header(f, size, limits)`` reads from the binary file ``f`` positioned at the
  file's start, whose size is ``size``; it never reads past ``limits.max_header_bytes`` nor
  past ``size``, and every count and length is checked against ``limits`` before anything
  is allocated or read. It raises ``GGUFError`` (a ValueError) saying what is wrong.
- What it accepts, gguf.cpp accepts too: the same magic and versions, no empty or repeated
  key, no nested array, ``general.alignment`` a u32 power of two, tensor names shorter than
  64 bytes and unique, at most 4 dimensions, none negative. Tensor types are read, not
  judged (a base model may hold types newer than this table).
- Values: numbers, bools and strings as Python values; an array as ``GGUFArray`` (its
  element type and length; its contents are skipped, never kept).
- ``data_layout(header)`` checks what gguf.cpp checks of the data section: each tensor's
  offset the running (aligned) sum of the previous ones' sizes, rows a whole number of
  blocks. Sizes are known only for ``TYPE_SIZES``' types (those LoRA adapters may use):
  a tensor of another type is a GGUFError there.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import BinaryIO

MAGIC = b"GGUF"
MAX_NAME = 64  # GGML_MAX_NAME: a tensor name is at most 63 bytes
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32

# gguf_type ids, and llama.cpp's names for them (gguf_type_name)
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
KV_TYPE_NAMES = ("u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "str", "arr", "u64", "i64", "f64")  # fmt: skip
_SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f",
           BOOL: "<b", U64: "<Q", I64: "<q", F64: "<d"}  # fmt: skip

# ggml tensor types by id (ggml.h's enum ggml_type), for messages
GGML_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M",
    30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4", 40: "NVFP4", 41: "Q1_0", 42: "Q2_0",
}  # fmt: skip
# (block size in elements, bytes per block) of the types whose layout is checked here
TYPE_SIZES = {0: (1, 4), 1: (1, 2), 30: (1, 2), 8: (32, 34)}  # F32, F16, BF16, Q8_0


class GGUFError(ValueError):
    """The file is not a GGUF header this reader accepts; the message says why."""


@dataclass(frozen=True)
class Limits:
    """Bounds on what one header may hold (each checked before it is read)."""

    max_header_bytes: int
    max_kv: int
    max_tensors: int
    max_string: int  # bytes of one key, string value or tensor name
    max_array: int  # elements of one array


@dataclass(frozen=True)
class GGUFArray:
    elem_type: int
    n: int


@dataclass(frozen=True)
class KV:
    type: int  # a gguf_type id; ARR for an array (``value`` is then a GGUFArray)
    value: object

    def number(self) -> int | float:
        """The value of a key of a numeric type (the caller checked ``type``); GGUFError for
        any other value."""
        v = self.value
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise GGUFError(f"a {kv_type_name(self.type)} value is not a number")
        return v


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ne: tuple[int, ...]  # ggml order (ne0 first), as many as the file gives
    type: int  # a ggml type id
    offset: int  # from the start of the data section


@dataclass(frozen=True)
class Header:
    version: int
    kv: dict[str, KV]
    tensors: list[TensorInfo]
    alignment: int
    data_start: int  # the data section's offset in the file (aligned when it holds tensors)


def kv_type_name(t: int) -> str:
    return KV_TYPE_NAMES[t] if 0 <= t < len(KV_TYPE_NAMES) else f"type {t}"


def ggml_type_name(t: int) -> str:
    return GGML_TYPE_NAMES.get(t, f"type {t}")


def dims4(ne: tuple[int, ...]) -> tuple[int, int, int, int]:
    """A shape as ggml holds it: four dimensions, the missing ones 1."""
    a, b, c, d = ne + (1,) * (MAX_DIMS - len(ne))
    return a, b, c, d


def pad(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


class _Reader:
    """Sequential reads that stop at the header bound and at the end of the file."""

    def __init__(self, f: BinaryIO, size: int, limits: Limits) -> None:
        self.f, self.pos, self.size, self.limits = f, 0, size, limits

    def _room(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise GGUFError(f"the file ends inside {what} (at byte {self.pos})")
        if n > self.limits.max_header_bytes - self.pos:
            raise GGUFError(f"the header is longer than {self.limits.max_header_bytes} bytes")

    def take(self, n: int, what: str) -> bytes:
        self._room(n, what)
        data = self.f.read(n)
        if len(data) != n:  # the file shrank since its size was taken
            raise GGUFError(f"the file ends inside {what} (at byte {self.pos})")
        self.pos += n
        return data

    def skip(self, n: int, what: str) -> None:
        self._room(n, what)
        self.f.seek(n, 1)
        self.pos += n

    def unpack(self, fmt: str, what: str) -> int | float:
        value: int | float = struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]
        return value

    def count(self, what: str, most: int) -> int:
        n = int(self.unpack("<Q", what))
        if n > most:
            raise GGUFError(f"{what} is {n}: more than {most}")
        return n

    def string(self, what: str, keep: bool = True) -> str:
        n = self.count(f"the length of {what}", self.limits.max_string)
        if not keep:
            self.skip(n, what)
            return ""
        try:
            return self.take(n, what).decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{what} is not UTF-8") from None


def _value(r: _Reader, t: int, key: str) -> object:
    """One value of type ``t`` (not an array)."""
    if t == STR:
        return r.string(f"the value of {key!r}")
    if t not in _SCALAR:
        raise GGUFError(f"key {key!r} has an invalid GGUF type ({t})")
    v = r.unpack(_SCALAR[t], f"the value of {key!r}")
    return v != 0 if t == BOOL else v


def _array(r: _Reader, key: str) -> GGUFArray:
    """An array's element type and length; its contents skipped."""
    et = int(r.unpack("<i", f"the element type of {key!r}"))
    n = r.count(f"the length of {key!r}", r.limits.max_array)
    if et == ARR:
        raise GGUFError(f"key {key!r} is an array of arrays")
    if et == STR:
        for _ in range(n):
            r.string(f"an element of {key!r}", keep=False)
    elif et in _SCALAR:
        r.skip(n * struct.calcsize(_SCALAR[et]), f"the elements of {key!r}")
    else:
        raise GGUFError(f"key {key!r} is an array of an invalid GGUF type ({et})")
    return GGUFArray(et, n)


def _kvs(r: _Reader, n_kv: int) -> dict[str, KV]:
    out: dict[str, KV] = {}
    for i in range(n_kv):
        key = r.string(f"key {i}")
        if not key:
            raise GGUFError(f"key {i} is empty")
        if key in out:
            raise GGUFError(f"key {key!r} is repeated")
        t = int(r.unpack("<i", f"the type of {key!r}"))
        out[key] = KV(ARR, _array(r, key)) if t == ARR else KV(t, _value(r, t, key))
    return out


def _alignment(kv: dict[str, KV]) -> int:
    a = kv.get("general.alignment")
    if a is None:
        return DEFAULT_ALIGNMENT
    if a.type != U32:
        raise GGUFError(f"general.alignment is a {kv_type_name(a.type)}: expected u32")
    n = int(a.number())  # a u32: an int
    if n <= 0 or n & (n - 1):
        raise GGUFError(f"general.alignment {n} is not a power of two")
    return n


def _tensor(r: _Reader, i: int, seen: set[str]) -> TensorInfo:
    name = r.string(f"the name of tensor {i}")
    if len(name.encode()) >= MAX_NAME:
        raise GGUFError(f"tensor name {name[:80]!r} is longer than {MAX_NAME - 1} bytes")
    if name in seen:
        raise GGUFError(f"tensor {name!r} is repeated")
    seen.add(name)
    n_dims = int(r.unpack("<I", f"the dimensions of {name!r}"))
    if n_dims > MAX_DIMS:
        raise GGUFError(f"tensor {name!r} has {n_dims} dimensions: at most {MAX_DIMS}")
    ne = tuple(int(r.unpack("<q", f"the shape of {name!r}")) for _ in range(n_dims))
    if any(n < 0 for n in ne):
        raise GGUFError(f"tensor {name!r} has a negative dimension {list(ne)}")
    n_el = 1
    for n in ne:
        n_el *= n
    if n_el >= 1 << 63:
        raise GGUFError(f"tensor {name!r} has too many elements {list(ne)}")
    t = int(r.unpack("<i", f"the type of {name!r}"))
    offset = int(r.unpack("<Q", f"the offset of {name!r}"))
    return TensorInfo(name, ne, t, offset)


def nbytes(t: TensorInfo) -> int:
    """The tensor's data size; GGUFError for a type outside TYPE_SIZES or rows that are
    not a whole number of its blocks."""
    if t.type not in TYPE_SIZES:
        raise GGUFError(f"tensor {t.name!r} has type {ggml_type_name(t.type)}, not read here")
    block, size = TYPE_SIZES[t.type]
    ne = dims4(t.ne)
    if ne[0] % block:
        raise GGUFError(
            f"tensor {t.name!r} has rows of {ne[0]} {ggml_type_name(t.type)} values: "
            f"not a multiple of its block size {block}"
        )
    return ne[0] // block * size * ne[1] * ne[2] * ne[3]


def data_layout(h: Header) -> tuple[list[tuple[TensorInfo, int, int]], int]:
    """Each tensor with its data's start and end in the file, and the end of the data
    section (its last tensor padded to the alignment): module docstring."""
    out = []
    at = 0
    for t in h.tensors:
        if t.offset != at:
            raise GGUFError(f"tensor {t.name!r} is at offset {t.offset}: expected {at}")
        n = nbytes(t)
        out.append((t, h.data_start + at, h.data_start + at + n))
        at += pad(n, h.alignment)
    return out, h.data_start + at


def read_header(f: BinaryIO, size: int, limits: Limits) -> Header:
    """The header of the GGUF file ``f`` (module docstring)."""
    r = _Reader(f, size, limits)
    if r.take(4, "the magic") != MAGIC:
        raise GGUFError("not a GGUF file (no GGUF magic)")
    version = int(r.unpack("<I", "the version"))
    if version not in (2, 3):
        raise GGUFError(f"GGUF version {version}: only versions 2 and 3 are read")
    n_tensors = r.count("the tensor count", limits.max_tensors)
    n_kv = r.count("the key count", limits.max_kv)
    kv = _kvs(r, n_kv)
    alignment = _alignment(kv)
    seen: set[str] = set()
    tensors = [_tensor(r, i, seen) for i in range(n_tensors)]
    data_start = pad(r.pos, alignment) if tensors else r.pos
    return Header(version, kv, tensors, alignment, data_start)
