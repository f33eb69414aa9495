"""The text of a prompt with images, tokenized as libmtmd tokenizes it, once per text.

``mtmd_tokenize`` cuts a prompt at its media markers and tokenizes each run of text alone
(special tokens parsed, no BOS), each image's begin and end text alone, then puts BOS first
and EOS last as the model wants. A conversation about a picture sends the same long text
before the image (a system prompt, the first question) with every turn: ``TextTokens`` keeps
the ids of each run by its text, so that run is tokenized once; libmtmd is asked for the
images' chunks only (``mtmd_tokenize_from_parts`` with the bitmap alone). The ids are the
ones ``mtmd_tokenize`` gives for the whole prompt (tests/e2e/test_mtmd_e2e.py compares).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from .vocab import tokenize


class TextTokens:
    """Token ids of text runs by their text, least recently used out within ``max_chars``
    characters of text. Thread-safe; the ids lists are shared: never change one."""

    def __init__(self, vocab: object, max_chars: int = 4 << 20) -> None:
        self.vocab = vocab
        self.max_chars = max_chars
        self.chars = 0
        self.hits = 0
        self.misses = 0
        self._items: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()

    def ids(self, text: str) -> list[int]:
        with self._lock:
            got = self._items.get(text)
            if got is not None:
                self._items.move_to_end(text)
                self.hits += 1
                return got
            self.misses += 1
        # a run alone as libmtmd tokenizes it (mtmd_tokenize_text_internal): special
        # tokens parsed, nothing added
        ids = tokenize(self.vocab, text, False, True)
        if len(text) <= self.max_chars:
            self._put(text, ids)
        return ids

    def _put(self, text: str, ids: list[int]) -> None:
        with self._lock:
            if text in self._items:
                return
            self._items[text] = ids
            self.chars += len(text)
            while self.chars > self.max_chars:
                gone, _ = self._items.popitem(last=False)
                self.chars -= len(gone)
