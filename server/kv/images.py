"""Where a prompt's images are (issue 42): the scheduler's and the placement's questions
about ``Task.images`` (server.image_types.PromptImage), each a scan of a request's few images.

A prompt holds an image as ``n_tokens`` placeholder entries (``types.image_placeholders``),
one per KV position, so the slot store's invariant (one entry per position) holds with
images too; the runner decodes the image's embeddings there in one operation
(``SlotWork.image``). A chunk, a cut or a match never ends inside an image: chunks stop
at an image's start (``next_start``), the image is one work, and a cut that would fall
inside one moves back to its start (``outside``)."""

from __future__ import annotations

from collections.abc import Sequence

from ..image_types import PromptImage


def at(images: Sequence[PromptImage], pos: int) -> PromptImage | None:
    """The image starting at prompt position ``pos``, if one does."""
    for im in images:
        if im.start == pos:
            return im
    return None


def next_start(images: Sequence[PromptImage], cur: int, default: int) -> int:
    """Where the first image after ``cur`` starts (``default`` when none does)."""
    for im in images:
        if im.start > cur:
            return min(im.start, default)
    return default


def _placeholder(x: object) -> bool:
    return isinstance(x, int) and x < 0


def outside(tokens: Sequence[object], n: int) -> int:
    """``n``, or the start of the image whose placeholders (negative entries) ``n`` falls
    inside: keeping ``tokens[:n]`` then never keeps part of an image. (A whole-item image,
    ``prefix.items.ImageItem``, is one entry: an index never falls inside it.)"""
    if n <= 0 or n >= len(tokens) or not _placeholder(tokens[n]):
        return n
    while n > 0 and _placeholder(tokens[n - 1]):
        n -= 1
    return n


def tokens_before(images: Sequence[PromptImage], n: int) -> int:
    """Image positions among the first ``n`` of the prompt (whole images only)."""
    return sum(im.n_tokens for im in images if im.end <= n)
