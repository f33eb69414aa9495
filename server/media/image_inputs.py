"""Image inputs of the chat APIs (issue 42): bytes from a data URL, raw base64 or a
``file://`` path under ``--media-path``, each bounded before any decoder sees it.

Bounds, in order: the encoded size (``--image-max-mib``, checked on the base64 text
before decoding it), the kind (PNG, JPEG, GIF or BMP, read from the magic bytes: what
stb_image decodes; anything else never reaches libmtmd), the width and height read from
the header in Python (``--image-max-pixels``: a decompression bomb is refused before a
byte is inflated), a JPEG's scans (``MAX_JPEG_SCANS``: each costs a pass over the frame),
and the images per request (``--image-max-count``). Remote ``http(s)``
URLs are refused (no fetching). Every refusal is a 400 naming the image and the problem.
Within a request's ``MediaScope`` (server/media/media_scope.py) each image's header pixels
are also charged against the request's budget (413) before anything decodes it, and the
recently decoded base64 texts are kept per tenant.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
import struct
import zlib
from dataclasses import dataclass, field

from ..lru import SizedLRU
from ..schemas.errors import APIError
from . import media_scope

NO_IMAGES = (
    "image input is not supported: this server runs without a multimodal projector "
    "(llama-server's --mmproj)"
)
KINDS = "PNG, JPEG, GIF or BMP"
_DATA_URL = re.compile(r"^data:([\w.+-]+/[\w.+-]+)?((?:;[\w-]+=[^;,]*)*)(;base64)?,", re.I)


@dataclass(frozen=True)
class MediaLimits:
    max_bytes: int = 10 << 20
    max_pixels: int = 1 << 25
    max_count: int = 16
    media_path: str | None = None  # file:// inputs only under it (None: refused)


def _png(b: bytes) -> tuple[int, int] | None:
    if len(b) < 24 or b[12:16] != b"IHDR":
        return None
    w, h = struct.unpack(">II", b[16:24])
    return w, h


def _gif(b: bytes) -> tuple[int, int] | None:
    return struct.unpack("<HH", b[6:10]) if len(b) >= 10 else None


def _bmp(b: bytes) -> tuple[int, int] | None:
    if len(b) < 26:
        return None
    (size,) = struct.unpack("<I", b[14:18])
    if size == 12:
        return struct.unpack("<HH", b[18:22])
    w, h = struct.unpack("<ii", b[18:26])
    return abs(w), abs(h)


_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _jpeg(b: bytes) -> tuple[int, int] | None:
    """The frame header's size: a walk over the segments (each step moves forward)."""
    i = 2
    while i + 9 <= len(b):
        if b[i] != 0xFF:
            return None
        marker = b[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            i += 2
            continue
        (length,) = struct.unpack(">H", b[i + 2 : i + 4])
        if marker in _SOF:
            h, w = struct.unpack(">HH", b[i + 5 : i + 9])
            return w, h
        if length < 2:
            return None
        i += 2 + length
    return None


def _is_svg(data: bytes) -> bool:
    head = data[:1024].lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    return head.startswith((b"<svg", b"<?xml")) and b"<svg" in head


def image_size(data: bytes, where: str) -> tuple[str, int, int]:
    """(kind, width, height) from the header; APIError 400 for another kind of file or a
    header too short to say."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        kind, size = "PNG", _png(data)
    elif data.startswith(b"\xff\xd8"):
        kind, size = "JPEG", _jpeg(data)
    elif data[:6] in (b"GIF87a", b"GIF89a"):
        kind, size = "GIF", _gif(data)
    elif data.startswith(b"BM"):
        kind, size = "BMP", _bmp(data)
    elif data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        raise APIError(400, f"{where}: WebP images are not supported (send {KINDS})")
    elif _is_svg(data):
        raise APIError(400, f"{where}: SVG images are not supported (send {KINDS})")
    else:
        raise APIError(400, f"{where}: not an image this server reads (send {KINDS})")
    if size is None:
        raise APIError(400, f"{where}: the {kind} header is truncated or malformed")
    return kind, size[0], size[1]


def _png_complete(b: bytes) -> bool:
    """Every chunk whole with its CRC right, up to IEND."""
    i = 8
    while i + 12 <= len(b):
        (n,) = struct.unpack(">I", b[i : i + 4])
        end = i + 12 + n
        if end > len(b):
            return False
        kind = b[i + 4 : i + 8]
        if zlib.crc32(b[i + 4 : end - 4]) != struct.unpack(">I", b[end - 4 : end])[0]:
            return False
        if kind == b"IEND":
            return True
        i = end
    return False


def _bmp_complete(b: bytes, w: int, h: int) -> bool:
    """An uncompressed bitmap holds all its rows (compressed ones: left to the decoder)."""
    if len(b) < 34:
        return False
    (off,) = struct.unpack("<I", b[10:14])
    (bpp,) = struct.unpack("<H", b[28:30])
    (compression,) = struct.unpack("<I", b[30:34])
    return compression != 0 or off + ((w * bpp + 31) // 32) * 4 * h <= len(b)


def complete(kind: str, b: bytes, w: int, h: int) -> bool:
    """Whether the file is whole (not cut short), by its structure, without decoding it:
    a truncated image fails here, not in the decoder (whose fallback would try ffmpeg)."""
    if kind == "PNG":
        return _png_complete(b)
    if kind == "JPEG":
        return b.rfind(b"\xff\xd9", max(0, len(b) - 4096)) >= 0
    if kind == "GIF":
        return b.rfind(b"\x3b", max(0, len(b) - 64)) >= 0
    return _bmp_complete(b, w, h)


# stb_image walks every block of the frame once per scan: a progressive JPEG of 110 KB
# holding 10,000 near-empty scans of a 4096x4096 frame took 3.3 s to decode (10 MiB of them,
# at that rate: minutes). libjpeg's progressive script writes 10 scans for a colour image.
MAX_JPEG_SCANS = 256


def _jpeg_scans(b: bytes) -> int:
    """Start-of-scan markers in a JPEG: an upper bound of its scans (entropy-coded data
    stuffs every 0xFF byte, so only a segment's payload could add a false one)."""
    return b.count(b"\xff\xda")


def check_image(data: bytes, limits: MediaLimits, where: str) -> bytes:
    """``data`` when it is an image within the limits (see the module doc); else 400. In a
    request's scope its pixels are charged to the request (413 past its budget): before
    its structure is even walked, so an image over the budget costs nothing more."""
    if not data:
        raise APIError(400, f"{where}: the image is empty")
    if len(data) > limits.max_bytes:
        raise APIError(
            400, f"{where}: the image is {len(data)} bytes, more than {limits.max_bytes}"
        )
    kind, w, h = image_size(data, where)
    if w <= 0 or h <= 0:
        raise APIError(400, f"{where}: the {kind} header says {w}x{h} pixels")
    if w * h > limits.max_pixels:
        raise APIError(
            400,
            f"{where}: the image is {w}x{h} = {w * h} pixels, more than {limits.max_pixels}",
        )
    if kind == "JPEG" and (scans := _jpeg_scans(data)) > MAX_JPEG_SCANS:
        raise APIError(400, f"{where}: the JPEG has {scans} scans, more than {MAX_JPEG_SCANS}")
    scope = media_scope.current()
    if scope is not None:
        scope.charge(w * h, where)  # stb_image decodes a GIF's first frame only: w x h
    if not complete(kind, data, w, h):
        raise APIError(400, f"{where}: the {kind} image is truncated or corrupt")
    return data


class RecentlyDecoded(SizedLRU[bytes, bytes]):
    """Large base64 texts decoded lately, by a hash of the text: their bytes. A chat client
    sends the same image with every turn; a hit costs a hash of the text (SHA-256: ~1 ms for
    2 MB with the CPU's SHA instructions) instead of decoding it (~4.6 ms). Bounded by the
    bytes it holds (least recently used out); thread-safe (requests are prepared on several
    threads). The same text always decodes to the same bytes, so a hit is exact. Kept per
    tenant (``key``'s ``scope``): a hit is faster, so a shared entry would tell a client
    that another sent the same text."""

    MIN_TEXT = 64 << 10  # shorter texts decode in well under a millisecond: not kept

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        super().__init__(max_bytes, len)

    @staticmethod
    def key(text: str, scope: bytes = b"") -> bytes | None:
        """The text's key within ``scope`` (a tenant: ``MediaScope.cache_scope``); None for
        a text not worth keeping (short, or not ASCII: then it is not base64 either, and
        the decoder refuses it)."""
        if len(text) < RecentlyDecoded.MIN_TEXT or not text.isascii():
            return None
        # the scope's length first: no two (scope, text) pairs hash the same bytes
        h = hashlib.sha256(len(scope).to_bytes(4, "little") + scope)
        h.update(text.encode("ascii"))
        return h.digest()


RECENT = RecentlyDecoded()  # the process's: what it holds is only what clients sent


def decode_base64(
    text: str, limits: MediaLimits, where: str, recent: RecentlyDecoded = RECENT
) -> bytes:
    """Base64 text (the standard or URL-safe alphabet, padding optional) as bytes, its
    size bounded before decoding; a large text the request's tenant sent lately is taken
    from ``recent``."""
    if len(text) > limits.max_bytes * 4 // 3 + 8:
        raise APIError(400, f"{where}: the image is more than {limits.max_bytes} bytes")
    scope = media_scope.current()
    key = recent.key(text, scope.cache_scope if scope is not None else b"")
    data = recent.get(key) if key is not None else None
    if data is None:
        data = _decode_base64(text, where)
        if key is not None:
            recent.put(key, data)
    return data


def _decode_base64(text: str, where: str) -> bytes:
    """The decode itself (any of the forms ``decode_base64`` takes); 400 when not base64."""
    try:  # the canonical form (padded, no whitespace), in C: 0.5 ms for 260 KB, not 1.2
        return binascii.a2b_base64(text, strict_mode=True)  # type: ignore[call-arg,unused-ignore]
    except (binascii.Error, ValueError, TypeError):  # TypeError: Python 3.10 has no strict_mode
        pass  # the other forms below: whitespace, URL-safe, no padding, or not base64
    s = "".join(text.split())
    s += "=" * (-len(s) % 4)
    try:
        return base64.b64decode(s.replace("-", "+").replace("_", "/"), validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"{where}: the image data is not valid base64") from None


def _file(url: str, limits: MediaLimits, where: str) -> bytes:
    """A ``file://`` path, only under --media-path (resolved: no way out by .. or links).
    APIError 400 for any path that names no readable file there, including one no file
    can have (a NUL byte, a lone surrogate: the OS calls raise ValueError on those)."""
    if not limits.media_path:
        raise APIError(400, f"{where}: file:// images need the server's --media-path")
    root = os.path.realpath(limits.media_path)
    rel = url[len("file://") :]
    missing = APIError(400, f"{where}: no such image under --media-path: {rel!r}")
    try:
        path = os.path.realpath(
            os.path.join(root, rel.lstrip("/") if not rel.startswith(root) else rel)
        )
        if os.path.commonpath([root, path]) != root or not os.path.isfile(path):
            raise missing
        if os.path.getsize(path) > limits.max_bytes:
            raise APIError(400, f"{where}: the image is more than {limits.max_bytes} bytes")
        with open(path, "rb") as f:
            return f.read(limits.max_bytes + 1)
    except (ValueError, OSError):  # unencodable, or gone or unreadable since the check
        raise missing from None


def image_bytes(url: str, limits: MediaLimits, where: str) -> bytes:
    """The image an OpenAI ``image_url.url`` names: a data URL (base64), raw base64, or a
    ``file://`` path under --media-path; remote URLs are refused. Checked (check_image)."""
    low = url[:16].lower()
    if low.startswith(("http://", "https://")):
        raise APIError(400, f"{where}: remote image URLs are not fetched; send a data URL")
    if low.startswith("file://"):
        return check_image(_file(url, limits, where), limits, where)
    m = _DATA_URL.match(url[:512])
    if m is not None:
        media = (m.group(1) or "").lower()
        if media and not media.startswith("image/"):
            raise APIError(400, f"{where}: a data URL of {media!r}, not an image")
        if not m.group(3):
            raise APIError(400, f"{where}: only base64 data URLs are supported")
        url = url[m.end() :]
    elif low.startswith("data:"):
        raise APIError(400, f"{where}: a malformed data URL")
    return check_image(decode_base64(url, limits, where), limits, where)


@dataclass
class MediaInput:
    """The images of one request as its messages are rendered: each image's bytes, in
    prompt order, and the media marker that stands in the text where it goes."""

    marker: str
    limits: MediaLimits
    images: list[bytes] = field(default_factory=list)
    wheres: list[str] = field(default_factory=list)  # each image's place in the body

    def add(self, data: bytes, where: str = "") -> str:
        """Take an image (checked already); the marker to put in the text."""
        if len(self.images) >= self.limits.max_count:
            raise APIError(400, f"more than {self.limits.max_count} images in one request")
        self.images.append(data)
        self.wheres.append(where)
        return self.marker

    def add_url(self, url: str, where: str) -> str:
        if len(self.images) >= self.limits.max_count:
            raise APIError(400, f"more than {self.limits.max_count} images in one request")
        return self.add(image_bytes(url, self.limits, where), where)
