"""What a prompt is made of, as prefix matching sees it: a sequence of *items*.

A plain token is an ``int``. An image (next issue) will be one ``ImageItem``: an identity
(a hash of its pixels and of how it was encoded) and the number of KV positions its
embedding takes. Matching compares items, never the positions inside one, so a match (and
therefore a cut) never falls inside an image: two prompts share an image only when they
share the whole item, and the positions a match covers are the sum of its items' lengths.

Nothing else here: the holders of prefixes (slots, in-flight prefills, RAM and disk
entries) are found by the locator (server.kv.locator) and the prefix index
(server.prefix.prefix_index), both through ``common_prefix``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..types import lcp


@dataclass(frozen=True)
class ImageItem:
    """One image of a prompt: atomic for matching. Equal exactly when both fields are
    (the identity alone is not trusted to imply the length)."""

    identity: int | str | bytes
    n_tokens: int

    def __post_init__(self) -> None:
        if self.n_tokens <= 0:
            raise ValueError("an image item takes at least one position")


PromptItem = int | ImageItem


def common_prefix(a: Sequence[PromptItem], b: Sequence[PromptItem]) -> int:
    """How many leading items ``a`` and ``b`` share: whole items only (an image matches an
    equal image, never a token or another image: ``types.lcp`` compares items with ``==``,
    identity first, in 64-item slices at C speed, then one by one)."""
    if not a or not b or a[0] != b[0]:
        return 0
    return lcp(a, b)


def n_positions(items: Sequence[PromptItem], n_items: int | None = None) -> int:
    """KV positions the first ``n_items`` items take (all of them by default): a token one,
    an image its ``n_tokens``."""
    head = items if n_items is None else items[:n_items]
    return sum(1 if isinstance(x, int) else x.n_tokens for x in head)
