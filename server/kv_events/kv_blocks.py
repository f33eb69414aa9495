"""KV-cache blocks as llm-d's indexer sees them: full blocks of ``block_size`` tokens, each
named by a hash chained to its parent's, and vLLM's event tuples that carry them.

The hash scheme is llm-d-kv-cache's request-key scheme (``kvblock.chunkedTokenDatabase``),
so the block hashes a server publishes are the very keys llm-d's indexer computes from the
same tokens:

- a block's hash is FNV-1a 64 of the canonical CBOR encoding of the array
  ``[parent_hash, token_ids, extra]`` (unsigned integers in their shortest form; ``extra`` is
  null, or the block's extra features: here, under --cache-isolation, ``[{"Hash": tenant}]``);
- the first block's parent is the model's root: FNV-1a 64 of ``[fnv1a64(hash_seed), null,
  model_name]`` (llm-d's ``hashSeed``, empty by default; the model name is the one in the
  events' topic).

They match the indexer configured with ``tokenProcessorConfig.blockSize`` equal to
``--kv-block-size`` and ``hashSeed`` empty; the indexer maps them to its own keys either way
(it recomputes keys from ``token_ids``), so another seed costs nothing but the identity.

Event tuples (vLLM's msgspec ``array_like`` encoding, which llm-d's vLLM adapter parses by
position): ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium]`` (+ ``lora_name, extra_keys`` when extra keys are set),
``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``.
Images (issue 42): a block holding positions of an image has the image's identity (hex)
among its extra keys (vLLM's multimodal ``extra_keys``, after the tenant's), hashed into its
key as ``[{"Hash": tenant}, {"Hash": image}, ...]``; its image positions are token id
IMAGE_TOKEN_ID (0) in the hash and in ``token_ids``. Text-only blocks are unchanged.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Sequence

from ..image_types import IMAGE_NAMES

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
_MASK = (1 << 64) - 1

# The media a server's blocks live in (llm-d lower-cases them into its device tiers)
MEDIUM_GPU = "GPU"  # a slot's sequence in the llama.cpp KV cache (on whatever device)
MEDIUM_CPU = "CPU"  # the RAM prompt cache (--cache-ram)
MEDIUM_DISK = "DISK"  # the disk tier (--cache-disk), files and entries queued for its writer

# an event tuple's fields (see the module docstring): its tag, a medium, block hashes or
# token ids, a parent hash or block size, null, extra keys (one list per block)
EventField = str | int | None | list[int] | list[list[str]] | list[list[str] | None]
Event = list[EventField]


def fnv1a64(data: bytes, h: int = FNV_OFFSET) -> int:
    """FNV-1a, 64 bits (Go's hash/fnv New64a)."""
    for b in data:
        h = ((h ^ b) * FNV_PRIME) & _MASK
    return h


def _head(major: int, n: int) -> bytes:
    """A CBOR item head: major type and argument, in the shortest form (canonical)."""
    m = major << 5
    if n < 24:
        return bytes((m | n,))
    if n < 0x100:
        return bytes((m | 24, n))
    if n < 0x10000:
        return struct.pack(">BH", m | 25, n)
    if n < 0x100000000:
        return struct.pack(">BI", m | 26, n)
    return struct.pack(">BQ", m | 27, n)


_NULL = b"\xf6"
_small: list[bytes] | None = None  # heads of the integers below 65536, built once, whole
_small_lock = threading.Lock()


def _small_heads() -> list[bytes]:
    """The table, built on first use under a lock and published complete (threads hash
    concurrently: the engine, the disk tier's scanner and writer)."""
    global _small
    table = _small
    if table is None:
        with _small_lock:
            if _small is None:
                _small = [_head(0, t) for t in range(0x10000)]
            table = _small
    return table


def _uints(tokens: Sequence[int]) -> bytes:
    small = _small_heads()
    return _head(4, len(tokens)) + b"".join(
        small[t] if t < 0x10000 else _head(0, t) for t in tokens
    )


def _text(s: str) -> bytes:
    b = s.encode("utf-8")
    return _head(3, len(b)) + b


def extra_cbor(extra: str | None | tuple[str, ...]) -> bytes:
    """A block's extra features as llm-d encodes them: null, or ``[{"Hash": extra}, ...]``
    (one map per key: the tenant's, then each image's the block holds)."""
    keys = (extra,) if isinstance(extra, str) else extra or ()
    if not keys:
        return _NULL
    return _head(4, len(keys)) + b"".join(b"\xa1" + _text("Hash") + _text(k) for k in keys)


# An image's positions in a block's published token ids (the placeholders are negative,
# never token ids): what a block holds of an image is named by its extra keys instead.
IMAGE_TOKEN_ID = 0


def public_tokens(tokens: Sequence[int]) -> list[int]:
    """``tokens`` as published and hashed: each image position as IMAGE_TOKEN_ID."""
    return [t if t >= 0 else IMAGE_TOKEN_ID for t in tokens]


def image_keys(tokens: Sequence[int], bs: int, start: int, end: int) -> list[tuple[str, ...]]:
    """Per full block ``start..end-1`` of ``tokens``: the identities (hex) of the images it
    holds positions of, vLLM's multimodal ``extra_keys`` (empty for a text block)."""
    out: list[tuple[str, ...]] = [() for _ in range(start, end)]
    begin = start * bs  # back to the start of the run of placeholders the range starts in
    while begin > 0 and tokens[begin - 1] < 0:
        begin -= 1
    for sp in IMAGE_NAMES.spans(tokens[begin : end * bs]):
        a, z = begin + sp.start, begin + sp.end
        name = sp.identity.hex() if sp.identity else f"image:{-tokens[a]:x}"
        for b in range(max(start, a // bs), min(end, (z - 1) // bs + 1)):
            out[b - start] += (name,)
    return out


def block_hash(parent: int, tokens: Sequence[int], extra: bytes = _NULL) -> int:
    """The hash of one block: FNV-1a 64 of CBOR ``[parent, tokens, extra]`` (``extra``
    already encoded, ``extra_cbor``; an image's positions hashed as IMAGE_TOKEN_ID)."""
    if tokens and min(tokens) < 0:
        tokens = public_tokens(tokens)
    return fnv1a64(b"\x83" + _head(0, parent) + _uints(tokens) + extra)


def root_hash(model: str, seed: str = "") -> int:
    """The parent of a model's first block (llm-d's init hash)."""
    return fnv1a64(b"\x83" + _head(0, fnv1a64(seed.encode())) + _NULL + _text(model))


def tenant_extra(tenant: str) -> str | None:
    """The extra feature that keeps a tenant's blocks apart (--cache-isolation): a digest of
    the tenant's name; None for everyone's (``""``)."""
    if not tenant:
        return None
    return "tenant:" + hashlib.sha256(tenant.encode("utf-8", "surrogatepass")).hexdigest()[:32]


class BlockHasher:
    """Chained block hashes of token sequences, for one model and block size.

    A memo keyed by (parent, block tokens, extra) makes the same prefix in a slot, a RAM
    entry and a disk file cost one hash (thread-safe enough under the GIL: a lost insert
    is recomputed). ``hashes`` returns the hashes of the full blocks ``start..end-1``.
    """

    MEMO_MAX = 1 << 16

    def __init__(self, block_size: int, model: str, seed: str = "") -> None:
        if block_size <= 0:
            raise ValueError("the block size must be positive")
        self.block_size = block_size
        self.root = root_hash(model, seed)
        self._memo: dict[tuple[int, tuple[int, ...], tuple[str, ...]], int] = {}
        self._extra: dict[tuple[str, ...], bytes] = {}

    def hashes(
        self,
        tokens: Sequence[int],
        tenant: str = "",
        start: int = 0,
        end: int | None = None,
        parent: int | None = None,
        keys: list[tuple[str, ...]] | None = None,
    ) -> list[int]:
        """Hashes of blocks ``start`` up to ``end`` (default: every full block) of
        ``tokens``; ``parent`` is block ``start - 1``'s hash (the root when start is 0).
        A block's extra keys are the tenant's (--cache-isolation) and the identities of the
        images it holds (``image_keys``); with a ``keys`` list, each block's are appended."""
        bs = self.block_size
        n = len(tokens) // bs if end is None else min(end, len(tokens) // bs)
        h = self.root if parent is None else parent
        ten = tenant_extra(tenant)
        base: tuple[str, ...] = () if ten is None else (ten,)
        some = n > start and min(tokens[start * bs : n * bs]) < 0  # one block, usually
        imgs = image_keys(tokens, bs, start, n) if some else None
        memo, out = self._memo, []
        for i in range(start, n):
            blk = tuple(tokens[i * bs : (i + 1) * bs])
            extra = base + imgs[i - start] if imgs is not None else base
            key = (h, blk, extra)
            got = memo.get(key)
            if got is None:
                if len(memo) >= self.MEMO_MAX:
                    memo.clear()
                enc = self._extra.get(extra)
                if enc is None:
                    if len(self._extra) >= self.MEMO_MAX:
                        self._extra.clear()
                    enc = self._extra[extra] = extra_cbor(extra)
                got = memo[key] = block_hash(h, blk, enc)
            h = got
            out.append(h)
            if keys is not None:
                keys.append(extra)
        return out


def stored_event(
    hashes: list[int],
    parent: int | None,
    tokens: list[int],
    block_size: int,
    medium: str,
    extra: str | None | list[tuple[str, ...]] = None,
) -> Event:
    """vLLM's BlockStored: positional, lora_id null; with extra keys (``extra``: one for
    every block, or each block's own) also lora_name (null) and extra_keys (one list per
    block, null for a block without any). Image positions are published as IMAGE_TOKEN_ID."""
    if tokens and min(tokens) < 0:
        tokens = public_tokens(tokens)
    ev: Event = ["BlockStored", hashes, parent, tokens, block_size, None, medium]
    if isinstance(extra, str):
        ev += [None, [[extra] for _ in hashes]]
    elif extra and any(extra):
        ev += [None, [list(k) if k else None for k in extra]]
    return ev


def removed_event(hashes: list[int], medium: str) -> Event:
    return ["BlockRemoved", hashes, medium]


def cleared_event() -> Event:
    return ["AllBlocksCleared"]
