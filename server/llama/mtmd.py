"""The only module that talks to libmtmd (llama.cpp's multimodal library, issue 42).

``Projector`` loads a projector file (``--mmproj``) against the text model and turns a
rendered prompt holding media markers plus the images' bytes into ``Piece``s: runs of text
tokens and ``EncodedImage``s (server.image_types: the image's identity and embeddings). Decoding the
bytes (stb_image inside libmtmd), tokenizing and CLIP-encoding run on the caller's thread
(the prep pools' media lane, never the event loop or the engine thread), one at a time per
projector (an mtmd context is not thread-safe; ``lock``), with the caller's ``between``
called while waiting for the lock and before each image (server.cancel.checkpoint: a
request whose client left stops within one image). Every image's bytes must have been
bounded by the caller first (server/media/image_inputs.py reads the size from the header: no
decompression bombs reach stb_image; server/media/media_scope.py bounds a request's pixels).

An image's identity is a hash of its decoded pixels (RGB bytes, width, height) and of the
projector (its file's hash and the token limits): the same picture in other bytes (another
PNG encoder, a JPEG re-save that decodes equal) is the same image. ``EmbeddingCache``
keeps embeddings by identity (bounded RAM), so an image is encoded once.

Both caches are keyed within the caller's ``scope`` (its tenant, --cache-isolation), as the
text caches are: a hit is faster and moves the counters (``llamaslot_images_encoded``,
``..._embedding_cache_hits``), so a cache shared across tenants would tell one client that
another sent an image. The identity itself (in the prompt's placeholders) is the pixels'.

A client re-sends the same bytes with every turn of a conversation. Their identity is then
known from the bytes alone (``KnownBytes``: a hash of the bytes to the identity and size),
and while the cache holds the embeddings, a follow-up neither decodes the image nor hashes
its pixels (a 2048x1536 PNG: ~30 ms here): libmtmd tokenizes the prompt with a stand-in in
its place, a placeholder bitmap of the same size (no pixels: nothing to preprocess; the
chunks depend on the size only), and no stand-in is ever encoded (``_StandInMissed``: the
prompt is tokenized again from the real pixels, as it is when a projector's preprocessing
refuses a placeholder).

``decode_embeddings`` puts an image's embeddings into the llama context at given positions
(a llama_batch with ``embd``): it is a memory operation, called by the backend's
``decode_image`` on the runner's behalf only (tests/unit/test_one_phase.py).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as L
import numpy as np
from llama_cpp import mtmd_cpp as M

from ..image_types import EncodedImage, MediaError
from ..lru import SizedLRU
from .mtmd_text import TextTokens
from .own_thread import run_on_own_thread

log = logging.getLogger("server.llama.mtmd")

CHUNK_TEXT = 0
CHUNK_IMAGE = 1


# What stb_image does not decode, libmtmd's helper hands to ffmpeg/ffprobe (a subprocess on
# client bytes): pointed at a directory without them, that path fails without running one.
# The callers also pass only PNG, JPEG, GIF and BMP bytes (server/media/image_inputs.py).
_NO_VIDEO = M.mtmd_helper_init_opt_default()
_NO_VIDEO.video_params.ffmpeg_bin_dir = b"/nonexistent/llama-slot-server-no-video"


def media_marker() -> str:
    """The text that stands for an image in a prompt, as llama-server's: ``LLAMA_MEDIA_MARKER``
    when set, else ``<__media_XXXX__>`` random per process (a client reads it from /props),
    so text that happens to hold a fixed marker never becomes an image slot."""
    env = os.environ.get("LLAMA_MEDIA_MARKER")
    return env if env else f"<__media_{secrets.token_hex(8)}__>"


_MARKER = media_marker()


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _mtmd_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    # libmtmd prints every image's preprocessing: only warnings and errors (levels 3, 4)
    if level in (3, 4) and text:
        msg = text.decode("utf-8", "replace").rstrip()
        if msg:
            log.log(logging.WARNING if level == 3 else logging.ERROR, "%s", msg)


@dataclass(frozen=True)
class ProjectorOptions:
    path: str
    n_threads: int = 4
    use_gpu: bool = True
    image_min_tokens: int = -1  # -1: the projector's default
    image_max_tokens: int = -1
    cache_bytes: int = 256 << 20  # the embedding cache's RAM (0: none)
    # most image tokens encoded in one pass (--mtmd-batch-max-tokens, llama-server's 1024):
    # images of one prompt that miss the cache are encoded together up to it, where the
    # projector batches at all (libmtmd's mtmd_batch; else one image a pass)
    batch_max_tokens: int = 1024


Piece = list[int] | EncodedImage


@dataclass
class CacheCounters:
    hits: int = 0
    misses: int = 0
    encoded: int = 0
    encode_ms: float = 0.0
    evicted: int = 0
    decoded: int = 0  # images decoded from their bytes (stb_image), not from KnownBytes
    pixels_decoded: int = 0  # their pixels (width x height as decoded)


class EmbeddingCache(SizedLRU[bytes, np.ndarray]):
    """Image embeddings by identity, least recently used first out, within ``max_bytes``,
    counted (``counters``, under ``lock``). Thread-safe (the prep pools read and fill it)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(max_bytes, lambda embd: int(embd.nbytes))
        self.counters = CacheCounters()

    def get(self, key: bytes) -> np.ndarray | None:
        embd = super().get(key)
        with self.lock:
            if embd is None:
                self.counters.misses += 1
            else:
                self.counters.hits += 1
        return embd

    def put(self, key: bytes, value: np.ndarray) -> int:
        gone = super().put(key, value)
        with self.lock:
            self.counters.evicted += gone
        return gone

    def holds(self, key: bytes) -> bool:
        """Whether the embeddings under ``key`` are cached (not counted as a hit or miss)."""
        return key in self

    @staticmethod
    def key(identity: bytes, scope: bytes) -> bytes:
        """Where ``identity``'s embeddings are kept for ``scope`` (a tenant; ``b""``:
        everyone's, the identity itself)."""
        if not scope:
            return identity
        h = hashlib.blake2b(len(scope).to_bytes(4, "little") + scope, digest_size=16)
        h.update(identity)
        return h.digest()


@dataclass(frozen=True)
class Decoded:
    """What decoding an image's bytes told: its identity and size in pixels."""

    identity: bytes
    nx: int
    ny: int


class KnownBytes:
    """Images' bytes already decoded, by a hash of the bytes: their ``Decoded``. Bounded
    (least recently used out); the same bytes always decode to the same pixels."""

    MAX_ENTRIES = 4096

    def __init__(self) -> None:
        self._items: OrderedDict[bytes, Decoded] = OrderedDict()

    @staticmethod
    def key(data: bytes, scope: bytes = b"") -> bytes:
        """The bytes' key within ``scope`` (a tenant; see the module doc)."""
        # SHA-256, not BLAKE2: with the CPU's SHA instructions (x86 since Zen and Ice Lake,
        # ARMv8) it hashes 1.6 MB in ~0.9 ms against ~1.8; every request with an image pays it
        if not scope:
            return hashlib.sha256(data).digest()
        h = hashlib.sha256(len(scope).to_bytes(4, "little") + scope)
        h.update(data)
        return h.digest()

    def get(self, key: bytes) -> Decoded | None:
        got = self._items.get(key)
        if got is not None:
            self._items.move_to_end(key)
        return got

    def put(self, key: bytes, decoded: Decoded) -> None:
        self._items[key] = decoded
        self._items.move_to_end(key)
        while len(self._items) > self.MAX_ENTRIES:
            self._items.popitem(last=False)


class _StandInMissed(Exception):
    """A stand-in's embeddings left the cache before they were taken, or its projector's
    preprocessing refused a placeholder: tokenize again from the pixels."""


def _file_hash(path: str) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.digest()


class Projector:
    """A loaded projector (see the module doc). ``model`` is the text model's llama_model."""

    def __init__(self, opts: ProjectorOptions, model: L.llama_model_p) -> None:
        if not Path(opts.path).is_file():
            raise FileNotFoundError(f"projector file not found: {opts.path}")
        M.mtmd_log_set(_mtmd_log, None)
        M.mtmd_helper_log_set(_mtmd_log, None)
        cp = M.mtmd_context_params_default()
        cp.use_gpu = opts.use_gpu
        cp.n_threads = max(1, opts.n_threads)
        cp.print_timings = False
        cp.warmup = True
        cp.image_min_tokens = opts.image_min_tokens
        cp.image_max_tokens = opts.image_max_tokens
        cp.batch_max_tokens = opts.batch_max_tokens
        self._marker_c = _MARKER.encode()  # libmtmd copies it; kept alive anyway
        cp.media_marker = self._marker_c
        # its warm-up encodes: on a thread of its own (own_thread: libgomp's pools)
        ctx = run_on_own_thread(
            lambda: M.mtmd_init_from_file(opts.path.encode(), model, cp), "projector-load"
        )
        if not ctx:
            raise ValueError(f"could not load the projector {opts.path} for this model")
        self.ctx = ctx
        self.cache = EmbeddingCache(opts.cache_bytes)
        self.known = KnownBytes()  # under ``lock``
        self.lock = threading.Lock()
        self.vision = bool(M.mtmd_support_vision(ctx))
        self.audio = bool(M.mtmd_support_audio(ctx))
        self.mrope = bool(M.mtmd_decode_use_mrope(ctx))
        self.marker = _MARKER
        self.n_embd = int(L.llama_model_n_embd(model))
        vocab = L.llama_model_get_vocab(model)
        self.texts = TextTokens(vocab)  # the text between markers, tokenized once per text
        # what mtmd_tokenize adds with add_special (ours always): BOS first, EOS last
        self._bos = [L.llama_vocab_bos(vocab)] if L.llama_vocab_get_add_bos(vocab) else []
        self._eos = [L.llama_vocab_eos(vocab)] if L.llama_vocab_get_add_eos(vocab) else []
        limits = f"{opts.image_min_tokens}:{opts.image_max_tokens}".encode()
        self.key = hashlib.blake2b(_file_hash(opts.path) + limits, digest_size=16).digest()
        if self.mrope:
            self.close()
            raise ValueError("projectors with M-RoPE positions (Qwen-VL) are not supported yet")

    def close(self) -> None:
        if self.ctx:
            M.mtmd_free(self.ctx)
            self.ctx = None

    def identity(self, px: bytes, nx: int, ny: int) -> bytes:
        """The image's identity: its pixels, size and this projector (see the module doc)."""
        h = hashlib.blake2b(digest_size=16)
        h.update(self.key)
        h.update(nx.to_bytes(4, "little") + ny.to_bytes(4, "little"))
        h.update(px)
        return h.digest()

    def tokenize(
        self,
        text: str,
        images: list[bytes],
        scope: bytes = b"",
        between: Callable[[], None] = lambda: None,
    ) -> list[Piece]:
        """``text`` (one media marker per image, in order) with ``images`` (bounded bytes)
        as pieces: text tokens (special tokens parsed, BOS added as the model wants) and
        encoded images, the caches read and filled within ``scope`` (a tenant). Raises
        MediaError for an image that does not decode, a marker count that does not match,
        or a preprocessing failure; whatever ``between`` raises (it is called while
        waiting for the lock and before each image is decoded)."""
        n_markers = text.count(self.marker)
        if n_markers != len(images):
            raise MediaError(f"the prompt has {n_markers} media markers for {len(images)} images")
        while not self.lock.acquire(timeout=0.05):  # another request's images: still wanted?
            between()
        try:
            try:
                return self._tokenize(text, images, scope, between, stand_ins=True)
            except _StandInMissed:
                return self._tokenize(text, images, scope, between, stand_ins=False)
        finally:
            self.lock.release()

    def _tokenize(
        self,
        text: str,
        images: list[bytes],
        scope: bytes,
        between: Callable[[], None],
        stand_ins: bool,
    ) -> list[Piece]:
        bitmaps: list[M.mtmd_bitmap_p] = []
        held: list[M.mtmd_input_chunks_p] = []  # libmtmd's chunks of each image, freed last
        standing: set[bytes] = set()  # identities whose bitmap is a placeholder stand-in
        try:
            self._bitmaps(images, scope, between, stand_ins, bitmaps, standing)
            try:
                layout = self._layout(text, bitmaps, held)
            except MediaError:
                if standing:  # a preprocessor that wants pixels: from the real ones
                    raise _StandInMissed from None
                raise
            return self._pieces(layout, standing, scope)
        finally:
            for chunks in held:
                M.mtmd_input_chunks_free(chunks)
            for b in bitmaps:
                M.mtmd_bitmap_free(b)

    def _bitmaps(
        self,
        images: list[bytes],
        scope: bytes,
        between: Callable[[], None],
        stand_ins: bool,
        bitmaps: list[M.mtmd_bitmap_p],
        standing: set[bytes],
    ) -> None:
        """Each image's bitmap into ``bitmaps`` (the caller frees them, also when this
        raises): a stand-in where the bytes are known and their embeddings cached within
        ``scope`` (its identity then joins ``standing``), else the decoded image."""
        for i, data in enumerate(images):
            key = KnownBytes.key(data, scope)
            known = self.known.get(key) if stand_ins else None
            if known is not None and self.cache.holds(EmbeddingCache.key(known.identity, scope)):
                bitmaps.append(_stand_in(known))
                standing.add(known.identity)
                continue
            between()  # a decode may take a second: stop first if the work was dropped
            bmp, decoded = self._bitmap(i, data)
            bitmaps.append(bmp)
            self.known.put(key, decoded)

    def _bitmap(self, i: int, data: bytes) -> tuple[M.mtmd_bitmap_p, Decoded]:
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        bmp = M.mtmd_helper_bitmap_init_from_buf(self.ctx, buf, len(data), False, _NO_VIDEO)
        if not bmp:
            raise MediaError(f"image {i}: the data could not be decoded as an image")
        if M.mtmd_bitmap_is_audio(bmp):
            M.mtmd_bitmap_free(bmp)
            raise MediaError(f"image {i}: audio input is not supported")
        nx, ny = M.mtmd_bitmap_get_nx(bmp), M.mtmd_bitmap_get_ny(bmp)
        n = M.mtmd_bitmap_get_n_bytes(bmp)
        px = ctypes.string_at(M.mtmd_bitmap_get_data(bmp), n)
        decoded = Decoded(self.identity(px, nx, ny), nx, ny)
        with self.cache.lock:
            self.cache.counters.decoded += 1
            self.cache.counters.pixels_decoded += nx * ny
        M.mtmd_bitmap_set_id(bmp, decoded.identity.hex().encode())
        return bmp, decoded

    def _layout(
        self, text: str, bitmaps: list[M.mtmd_bitmap_p], held: list[M.mtmd_input_chunks_p]
    ) -> list[list[int] | M.mtmd_input_chunk_p]:
        """``text`` (one marker per bitmap) cut as ``mtmd_tokenize`` cuts it
        (server/llama/mtmd_text.py): runs of text ids, from ``self.texts``, and each image's
        media chunk, its begin and end text joined to the runs around it; BOS first and EOS
        last as the model wants. The images' chunk lists go to ``held`` (the caller frees
        them once their chunks are read)."""
        out: list[list[int] | M.mtmd_input_chunk_p] = []
        run: list[int] = [*self._bos]
        for i, part in enumerate(text.split(self.marker)):
            run.extend(self.texts.ids(part))
            if i == len(bitmaps):
                break
            chunks = self._image_chunks(bitmaps[i])
            held.append(chunks)
            for j in range(M.mtmd_input_chunks_size(chunks)):
                c = M.mtmd_input_chunks_get(chunks, j)
                if M.mtmd_input_chunk_get_type(c) == CHUNK_TEXT:
                    run.extend(_chunk_ids(c))
                    continue
                if run:
                    out.append(run)
                out.append(c)
                run = []
        run.extend(self._eos)
        if run:
            out.append(run)
        return out

    def _image_chunks(self, bitmap: M.mtmd_bitmap_p) -> M.mtmd_input_chunks_p:
        """libmtmd's chunks for one image alone: its begin text, media chunk(s), end text."""
        part = M.mtmd_input_part(None, bitmap)
        parts = (ctypes.POINTER(M.mtmd_input_part) * 1)(ctypes.pointer(part))
        chunks = M.mtmd_input_chunks_init()
        if M.mtmd_tokenize_from_parts(self.ctx, chunks, parts, 1, False) != 0:
            M.mtmd_input_chunks_free(chunks)
            raise MediaError("an image could not be preprocessed for the projector")
        return chunks

    def _pieces(
        self,
        layout: list[list[int] | M.mtmd_input_chunk_p],
        standing: set[bytes],
        scope: bytes,
    ) -> list[Piece]:
        """Text runs as token lists, images as EncodedImages: the embedding cache's (within
        ``scope``) where it has them, the others encoded (``_encode_missing``: batched up to
        batch_max_tokens). ``standing``: images whose chunk holds a placeholder stand-in,
        never to be encoded."""
        out: list[Piece] = []
        images: list[tuple[int, M.mtmd_input_chunk_p, bytes]] = []  # (index in out, ...)
        for c in layout:
            if isinstance(c, list):
                out.append(c)
                continue
            kind = M.mtmd_input_chunk_get_type(c)
            if kind == CHUNK_IMAGE:
                n_tokens = M.mtmd_input_chunk_get_n_tokens(c)
                if M.mtmd_input_chunk_get_n_pos(c) != n_tokens:
                    raise MediaError("this projector's image positions are not supported")
                identity = bytes.fromhex((M.mtmd_input_chunk_get_id(c) or b"").decode())
                images.append((len(out), c, identity))
                out.append([])  # filled below
            else:
                raise MediaError("audio input is not supported")
        found: dict[bytes, EncodedImage] = {}
        missing: list[tuple[M.mtmd_input_chunk_p, bytes]] = []
        for _, c, identity in images:
            if identity in found or any(identity == m[1] for m in missing):
                continue
            embd = self.cache.get(EmbeddingCache.key(identity, scope))
            non_causal = bool(M.mtmd_decode_use_non_causal(self.ctx, c))
            if embd is not None and embd.shape[0] == M.mtmd_input_chunk_get_n_tokens(c):
                found[identity] = EncodedImage(identity, embd, non_causal, encoded=False)
            elif identity in standing:
                raise _StandInMissed
            else:
                missing.append((c, identity))
        found.update(self._encode_missing(missing, scope))
        for at, _, identity in images:
            out[at] = found[identity]
        return out

    def _encode_missing(
        self, missing: list[tuple[M.mtmd_input_chunk_p, bytes]], scope: bytes
    ) -> dict[bytes, EncodedImage]:
        """Encode the images the cache lacks, in prompt order, as few passes as libmtmd's
        batch takes (its batch_max_tokens; a projector that does not batch: one a pass)."""
        done: dict[bytes, EncodedImage] = {}
        i = 0
        while i < len(missing):
            batch = M.mtmd_batch_init(self.ctx)
            if not batch:
                raise MediaError("the image could not be encoded")
            try:
                j = i
                while j < len(missing) and M.mtmd_batch_add_chunk(batch, missing[j][0]) == 0:
                    j += 1
                j = max(j, i + 1)  # the first always goes in (an empty batch is an error)
                t0 = time.perf_counter()
                # a thread of its own: a pool kept on this one would slow every decode
                encode = functools.partial(M.mtmd_batch_encode, batch)
                if run_on_own_thread(encode, "image-encode") != 0:
                    raise MediaError("the image could not be encoded")
                ms = (time.perf_counter() - t0) * 1e3 / (j - i)
                for c, identity in missing[i:j]:
                    done[identity] = self._take(batch, c, identity, ms, scope)
            finally:
                M.mtmd_batch_free(batch)
            i = j
        return done

    def _take(
        self,
        batch: M.mtmd_batch_p,
        c: M.mtmd_input_chunk_p,
        identity: bytes,
        ms: float,
        scope: bytes,
    ) -> EncodedImage:
        """One encoded image's embeddings, copied out of the batch and cached (within
        ``scope``)."""
        n_tokens = M.mtmd_input_chunk_get_n_tokens(c)
        out = M.mtmd_batch_get_output_embd(batch, c)
        if not out:
            raise MediaError("the image could not be encoded")
        n_embd = self.n_embd
        embd = np.ctypeslib.as_array(out, shape=(n_tokens * n_embd,)).reshape(n_tokens, n_embd)
        embd = embd.copy()
        embd.flags.writeable = False  # shared by every request of this image (the cache)
        cache = self.cache
        cache.put(EmbeddingCache.key(identity, scope), embd)
        with cache.lock:
            cache.counters.encoded += 1
            cache.counters.encode_ms += ms
        non_causal = bool(M.mtmd_decode_use_non_causal(self.ctx, c))
        return EncodedImage(identity, embd, non_causal, encoded=True, encode_ms=ms)


def _chunk_ids(c: M.mtmd_input_chunk_p) -> list[int]:
    """A text chunk's token ids."""
    n = ctypes.c_size_t()
    toks = M.mtmd_input_chunk_get_tokens_text(c, ctypes.byref(n))
    return toks[: n.value]


def _stand_in(known: Decoded) -> M.mtmd_bitmap_p:
    """A placeholder bitmap (no pixels: libmtmd's token-counting bitmap, whose
    preprocessing only sets sizes) of ``known``'s size, named by its identity: libmtmd cuts
    a prompt into the same chunks for it (their token counts follow the image's size, not
    its pixels). Its chunk cannot be encoded, and never is."""
    bmp = M.mtmd_bitmap_init(known.nx, known.ny, None)
    if not bmp:
        raise MediaError("the image could not be prepared")
    M.mtmd_bitmap_set_id(bmp, known.identity.hex().encode())
    return bmp


def decode_embeddings(
    lctx: L.llama_context_p, embd: np.ndarray, pos0: int, seq: int, non_causal: bool
) -> int:
    """Decode ``embd`` ((n, n_embd) float32) into sequence ``seq`` at positions
    pos0..pos0+n-1, no outputs; llama_decode's status. With ``non_causal`` the image's
    tokens attend to each other both ways (causal attention is off for this decode only;
    the caller made sure the image fits one ubatch)."""
    n, n_embd = embd.shape
    batch = L.llama_batch_init(n, n_embd, 1)
    try:
        data = np.ascontiguousarray(embd, dtype=np.float32)
        ctypes.memmove(batch.embd, data.ctypes.data, data.nbytes)
        np.ctypeslib.as_array(batch.pos, shape=(n,))[:] = np.arange(pos0, pos0 + n)
        np.ctypeslib.as_array(batch.n_seq_id, shape=(n,))[:] = 1
        np.ctypeslib.as_array(batch.logits, shape=(n,))[:] = 0
        for i in range(n):
            batch.seq_id[i][0] = seq
        batch.n_tokens = n
        if non_causal:
            L.llama_set_causal_attn(lctx, False)
        try:
            return int(L.llama_decode(lctx, batch))
        finally:
            if non_causal:
                L.llama_set_causal_attn(lctx, True)
    finally:
        L.llama_batch_free(batch)
