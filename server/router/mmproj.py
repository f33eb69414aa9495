"""What a projector file (``mmproj*.gguf``) takes, read from its GGUF header without
loading it (router mode lists ``input_modalities`` per model; llama-server asks libmtmd's
``mtmd_get_cap_from_file`` for the same two keys). The router never loads llama.cpp, and
a file is client-placed data: the read is bounded (key count, key and string lengths,
bytes read) and a malformed header is "no capability", never an error."""

from __future__ import annotations

import functools
import os
import struct
from dataclasses import dataclass
from typing import BinaryIO

_VISION = "clip.has_vision_encoder"
_AUDIO = "clip.has_audio_encoder"
_MAX_KV = 4096
_MAX_STR = 1 << 20
_MAX_READ = 64 << 20
# GGUF value types -> fixed sizes (8: string, 9: array are read apart)
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_BOOL = 7


@dataclass(frozen=True)
class Caps:
    vision: bool = False
    audio: bool = False


class _Bad(Exception):
    pass


class _Reader:
    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.n = 0

    def take(self, n: int) -> bytes:
        self.n += n
        if n < 0 or self.n > _MAX_READ:
            raise _Bad
        b = self.f.read(n)
        if len(b) != n:
            raise _Bad
        return b

    def u32(self) -> int:
        return int(struct.unpack("<I", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self.take(8))[0])

    def string(self) -> bytes:
        n = self.u64()
        if n > _MAX_STR:
            raise _Bad
        return self.take(n)

    def skip(self, kind: int) -> None:
        if kind == 8:
            self.string()
        elif kind == 9:
            inner, count = self.u32(), self.u64()
            if inner in _SIZES:
                self.take(_SIZES[inner] * count)
            else:
                for _ in range(min(count, _MAX_READ)):
                    self.skip(inner)
        elif kind in _SIZES:
            self.take(_SIZES[kind])
        else:
            raise _Bad


def projector_caps(path: str) -> Caps:
    """The projector's vision and audio flags (both False for a file that is no readable
    GGUF projector)."""
    found: dict[str, bool] = {}
    try:
        with open(path, "rb") as f:
            r = _Reader(f)
            if r.take(4) != b"GGUF" or r.u32() not in (2, 3):
                return Caps()
            r.u64()  # tensors
            n_kv = r.u64()
            for _ in range(min(n_kv, _MAX_KV)):
                key = r.string().decode("utf-8", "replace")
                kind = r.u32()
                if key in (_VISION, _AUDIO) and kind == _BOOL:
                    found[key] = r.take(1) != b"\0"
                    if len(found) == 2:
                        break
                else:
                    r.skip(kind)
    except (OSError, _Bad, struct.error):
        pass
    return Caps(found.get(_VISION, False), found.get(_AUDIO, False))


@functools.lru_cache(maxsize=256)
def _cached(path: str, _mtime_ns: int, _size: int) -> Caps:
    return projector_caps(path)


def input_modalities(mmproj: str | None) -> list[str]:
    """A model's ``input_modalities`` as the router lists them: text, and images where its
    projector (``--mmproj``) reads them (never audio yet: the instances refuse audio
    inputs, whatever the projector reads). The header is read once per file version
    (cached)."""
    if not mmproj:
        return ["text"]
    try:
        st = os.stat(mmproj)
    except OSError:
        return ["text"]
    caps = _cached(mmproj, st.st_mtime_ns, st.st_size)
    return ["text"] + (["image"] if caps.vision else [])
