"""A prompt's images as every layer sees them (issue 42): the bytes decoded and encoded
(``EncodedImage``), their placeholder tokens, where they sit in a prompt (``PromptImage``,
``ImageSpan``), their names in files, and the projector protocol (``ImageProjector``) that
libmtmd implements. A leaf: it imports nothing of the server's."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class MediaError(ValueError):
    """A client's image that cannot be used: a 400 naming what is wrong."""

    status = 400


@dataclass(frozen=True, eq=False)
class EncodedImage:
    """An image as the projector gave it: ``identity`` (a hash of its decoded pixels and of
    the projector), ``embd`` ((n_tokens, n_embd) float32, numpy), whether its tokens attend
    both ways (``non_causal``: decoded in one ubatch) and whether it was encoded for this
    request (False: the embedding cache had it)."""

    identity: bytes
    embd: np.ndarray
    non_causal: bool
    encoded: bool
    encode_ms: float = 0.0

    @property
    def n_tokens(self) -> int:
        return int(self.embd.shape[0])


def image_placeholders(identity: bytes, n: int) -> list[int]:
    """The ``n`` prompt entries standing for an image's positions: negative (never a token
    id), drawn from its identity. A slot's tokens stay one entry per KV position, and any
    prefix match over them stops at the first entry of a different image (a mismatch there
    has odds 2**-31), so a match covers an image whole or not at all."""
    seed = int.from_bytes(identity[:16].ljust(16, b"\0"), "little") ^ n
    vals = np.random.default_rng(seed).integers(1, 2**31 - 1, size=n)
    out = [-int(v) for v in vals]
    if out:
        IMAGE_NAMES.note(identity, out)
    return out


@dataclass(frozen=True)
class ImageSpan:
    """An image's placeholders in a token list: ``tokens[start:start + n_tokens]``, named by
    ``identity`` (b"": a placeholder run no image of this process is known by)."""

    start: int
    n_tokens: int
    identity: bytes

    @property
    def end(self) -> int:
        return self.start + self.n_tokens


class ImageNames:
    """Which image a placeholder run stands for (issue 42): the tiers that keep a slot's
    tokens past this process (disk files, slot files) and the KV events name each image by
    its identity, which the placeholders alone do not give back. Every image whose
    placeholders were drawn (``image_placeholders``) or proven from a file is noted here:
    its first placeholder -> (identity, length, last placeholder), least recently used
    first out past ``max_items``. Any thread."""

    def __init__(self, max_items: int = 1 << 15) -> None:
        self.max_items = max_items
        self._lock = threading.Lock()
        self._by_first: OrderedDict[int, tuple[bytes, int, int]] = OrderedDict()

    def note(self, identity: bytes, placeholders: Sequence[int]) -> None:
        with self._lock:
            self._by_first[placeholders[0]] = (identity, len(placeholders), placeholders[-1])
            self._by_first.move_to_end(placeholders[0])
            while len(self._by_first) > self.max_items:
                self._by_first.popitem(last=False)

    def spans(self, tokens: Sequence[int]) -> list[ImageSpan]:
        """The images among ``tokens`` (runs of negative entries), in order. A run whose
        first entry names no known image (or whose length or last entry disagree) is one
        span with an empty identity up to the run's end; an image cut short by the end of
        ``tokens`` keeps its whole ``n_tokens`` (its ``end`` then lies past them)."""
        if not tokens or min(tokens) >= 0:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        neg = np.flatnonzero(arr < 0)
        out: list[ImageSpan] = []
        i = 0
        while i < len(neg):
            pos = int(neg[i])
            with self._lock:
                got = self._by_first.get(int(arr[pos]))
            end = pos + got[1] if got is not None else len(arr)
            if got is not None and (end > len(arr) or int(arr[end - 1]) == got[2]):
                out.append(ImageSpan(pos, got[1], got[0]))
            else:  # unknown: the whole run of negative entries
                after = np.flatnonzero(arr[pos:] >= 0)
                end = pos + int(after[0]) if len(after) else len(arr)
                out.append(ImageSpan(pos, end - pos, b""))
            i = int(np.searchsorted(neg, end))
        return out


IMAGE_NAMES = ImageNames()


@dataclass(frozen=True, eq=False)
class PromptImage:
    """An image of a task's prompt at positions ``start``..``start + n_tokens - 1``: the
    prompt holds its placeholders there, the runner decodes its embeddings."""

    start: int
    image: EncodedImage

    @property
    def n_tokens(self) -> int:
        return self.image.n_tokens

    @property
    def end(self) -> int:
        return self.start + self.image.n_tokens


class ImageProjector(Protocol):
    """A loaded projector (server.llama.mtmd.Projector) as the front end uses it."""

    marker: str
    key: bytes  # the projector's own hash: images' identities and files name it
    vision: bool
    audio: bool

    def tokenize(
        self,
        text: str,
        images: list[bytes],
        scope: bytes = b"",
        between: Callable[[], None] = ...,
    ) -> list[list[int] | EncodedImage]:
        """``text`` with one ``marker`` per image as text token runs and encoded images
        (add_special, special tokens parsed), its caches keyed within ``scope`` (the
        request's tenant); ``between`` is called before each image is decoded (it may
        raise to stop the work); raises MediaError."""
        ...

    def close(self) -> None: ...
