"""What a projector file (``mmproj*.gguf``) takes, read from its GGUF header without
loading it (router mode lists ``input_modalities`` per model; llama-server asks libmtmd's
``mtmd_get_cap_from_file`` for the same two keys). The router never loads llama.cpp, and
a file is client-placed data: the read is bounded (key count, key and string lengths,
bytes read) and a malformed header is "no capability", never an error."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from ..llama.gguf_header import BOOL, GGUFError, Limits, read_header

_VISION = "clip.has_vision_encoder"
_AUDIO = "clip.has_audio_encoder"
# the projector's header, bounded as every client-placed file is (server/llama/gguf_header.py)
_LIMITS = Limits(
    max_header_bytes=64 << 20, max_kv=4096, max_tensors=1 << 16, max_string=1 << 20,
    max_array=1 << 24,
)  # fmt: skip


@dataclass(frozen=True)
class Caps:
    vision: bool = False
    audio: bool = False


def projector_caps(path: str) -> Caps:
    """The projector's vision and audio flags (both False for a file that is no readable
    GGUF projector)."""
    try:
        with open(path, "rb") as f:
            kv = read_header(f, os.fstat(f.fileno()).st_size, _LIMITS).kv
    except (OSError, GGUFError):
        return Caps()

    def flag(key: str) -> bool:
        v = kv.get(key)
        return v is not None and v.type == BOOL and v.value is True

    return Caps(flag(_VISION), flag(_AUDIO))


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
