"""The images a saved state holds, named in its file (issue 42): the SIMG block.

A slot's tokens hold each image as its placeholders (``types.image_placeholders``: negative
entries drawn from the image's identity), stored as they are in the file's token list. The
placeholders do not give the identity back, so a file holding images names them in one
block at the end of its body (a slot file: after its appendices, before the STNT footer; a
disk-tier file: just before the trailer), found from its end without parsing the state:

    u32 'SIMG' magic | u32 version 1 | 16 bytes the projector's key | u32 count |
    count x (u32 start, u32 n_tokens, 16 bytes identity) | u32 block length | u32 'SIMG'

A file without images has no block (text-only files are byte for byte what they were).
Reading never trusts it (``check``): the projector must be this server's (an image's
embeddings are only valid for the projector that made them), the spans ordered, inside the
tokens, each exactly the placeholders its identity draws, and every negative entry inside
one. A proven file's images are noted (``types.IMAGE_NAMES``) so later saves and the KV
events name them too; a restored image then matches a later request with the same pixels
like any other (same identity, same placeholders).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from ..image_types import IMAGE_NAMES, ImageSpan, image_placeholders

SIMG_MAGIC = 0x474D4953  # 'SIMG'
VERSION = 1
HEAD = struct.Struct("<II16sI")  # magic, version, projector key, count
REC = struct.Struct("<II16s")  # start, n_tokens, identity
TAIL = struct.Struct("<II")  # block length, magic
MAX_IMAGES = 4096  # images one file may name: each costs a placeholder draw to check
KEY_BYTES = 16


class ImageFileError(ValueError):
    """A file's images cannot be used (``foreign``: made with another projector)."""

    def __init__(self, message: str, foreign: bool = False) -> None:
        super().__init__(message)
        self.foreign = foreign


@dataclass(frozen=True)
class ImageBlock:
    """A file's SIMG block: the projector key, the images, where the block starts."""

    key: bytes
    spans: list[ImageSpan]
    start: int


def has_images(tokens: Sequence[int]) -> bool:
    return bool(tokens) and min(tokens) < 0


def encode(tokens: Sequence[int], key: bytes | None) -> bytes:
    """The SIMG block naming ``tokens``' images (b"" without any). Raises ImageFileError
    when an image is not known by its identity any more, is cut short, or no projector is
    loaded: such a state cannot be written so that it is proven when read."""
    spans = IMAGE_NAMES.spans(tokens)
    if not spans:
        return b""
    if key is None or len(key) != KEY_BYTES:
        raise ImageFileError("the state holds images but no projector is loaded")
    if len(spans) > MAX_IMAGES:
        raise ImageFileError(f"the state holds {len(spans)} images, more than {MAX_IMAGES}")
    recs = []
    for s in spans:
        if not s.identity or s.end > len(tokens):
            raise ImageFileError(f"the image at position {s.start} is not known any more")
        recs.append(REC.pack(s.start, s.n_tokens, s.identity[:KEY_BYTES].ljust(KEY_BYTES, b"\0")))
    body = HEAD.pack(SIMG_MAGIC, VERSION, key, len(spans)) + b"".join(recs)
    return body + TAIL.pack(len(body) + TAIL.size, SIMG_MAGIC)


def find(buf: bytes | bytearray | memoryview | mmap.mmap, end: int, body: int) -> ImageBlock | None:
    """The SIMG block ending at ``end`` in ``buf`` (None when there is none); nothing
    before ``body`` (the header, tokens and the state's 8-byte header) may be part of it.
    Raises ImageFileError for a block that does not hold together."""
    if end - body < HEAD.size + TAIL.size:
        return None
    length, magic = TAIL.unpack_from(buf, end - TAIL.size)
    if magic != SIMG_MAGIC:
        return None
    start = end - length
    if length < HEAD.size + TAIL.size or start < body:
        raise ImageFileError("its image block's length does not fit the file")
    m, version, key, count = HEAD.unpack_from(buf, start)
    if m != SIMG_MAGIC or version != VERSION:
        raise ImageFileError(f"its image block has magic {m:#x}, version {version}")
    if count > MAX_IMAGES or HEAD.size + count * REC.size + TAIL.size != length:
        raise ImageFileError(f"its image block's {count} images do not fit its length")
    spans = []
    for i in range(count):
        st, n, ident = REC.unpack_from(buf, start + HEAD.size + i * REC.size)
        spans.append(ImageSpan(st, n, bytes(ident)))
    return ImageBlock(bytes(key), spans, start)


def check(tokens: Sequence[int], block: ImageBlock | None, key: bytes | None) -> None:
    """Prove ``tokens``' placeholders are exactly the images ``block`` names, made by the
    projector ``key`` (this server's; None: none loaded). Raises ImageFileError; on success
    the images are noted by their identities (``IMAGE_NAMES``)."""
    if block is None:
        if has_images(tokens):
            raise ImageFileError("it holds negative token ids but names no images")
        return
    if key is None:
        raise ImageFileError("it holds images, and this server has no projector (--mmproj)", True)
    if block.key != key:
        raise ImageFileError("its images were made by another projector (--mmproj)", True)
    pos = 0
    for s in block.spans:
        if s.start < pos or s.n_tokens <= 0 or s.end > len(tokens):
            raise ImageFileError(f"its image at {s.start} ({s.n_tokens} tokens) is out of place")
        if min(tokens[pos : s.start], default=0) < 0:
            raise ImageFileError(f"negative token ids before {s.start} name no image")
        if list(tokens[s.start : s.end]) != image_placeholders(s.identity, s.n_tokens):
            raise ImageFileError(f"the image at {s.start} is not the one its block names")
        pos = s.end
    if min(tokens[pos:], default=0) < 0:
        raise ImageFileError(f"negative token ids after {pos} name no image")
