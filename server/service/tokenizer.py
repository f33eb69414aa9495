"""Tokenizing long texts in time linear in their length.

llama.cpp's tokenizer first cuts the text at special tokens (``tokenizer_st_partition``),
and each cut walks its fragment list from the start (``std::distance``, ``std::next``): a
text with k special tokens costs O(k^2). A rendered chat has two or three special tokens a
message, so 4,000 messages took 18 s and 20,000 over two minutes.

``tokenize`` gives the same token ids by tokenizing the text in pieces of about ``CHUNK``
characters, each cut made just before a special token where the cut cannot change the
partition (``Splitter.cut_ok``), and checks the request's cancellation flag between pieces.
The partition of the whole text is then the partitions of the pieces, in order: no special
text occurs across the cut, the piece after it starts with that special token, and no
whitespace a token strips (``lstrip``/``rstrip``) lies across it. BOS and EOS
(``add_special``) come once, from tokenizing the empty text.

Short texts, and backends whose special tokens are unknown (test fakes), are tokenized whole.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

from ..cancel import checkpoint
from ..engine_api import Tokenizer
from ..templates.control_tokens import NO_CONTROL, ControlTokens

CHUNK = 16 * 1024  # characters per piece (a piece holds a few hundred special tokens)
_SPACE = frozenset(" \t\n\v\f\r")  # C's isspace, which llama.cpp strips with


@dataclass(frozen=True)
class Special:
    """A token llama.cpp cuts the text at: ``control`` ones (control, unknown) only when
    special tokens are parsed, user-defined ones always."""

    text: str
    control: bool = True
    lstrip: bool = False
    rstrip: bool = False
    id: int = -1


class Splitter:
    """Where a text may be cut (before tokenizing each piece alone) without changing its
    tokens, for one set of special tokens."""

    def __init__(self, specials: Iterable[Special]) -> None:
        by_text: dict[str, Special] = {}
        for s in specials:
            old = by_text.get(s.text)
            if old is not None:  # the same text twice: the stricter attributes
                s = Special(s.text, s.control, s.lstrip or old.lstrip, s.rstrip or old.rstrip)
            by_text[s.text] = s
        self.by_text = by_text
        self.maxlen = max(map(len, by_text), default=0)
        # the lengths of the special texts, and their first characters: a position starts
        # one only if its character is one of them
        self.lengths = sorted({len(t) for t in by_text}, reverse=True)
        self.first = frozenset(t[0] for t in by_text if t)
        self.usable = bool(by_text) and "" not in by_text

    def special_at(self, text: str, p: int) -> str | None:
        """The longest special text starting at ``p`` (the one llama.cpp would prefer)."""
        if text[p] not in self.first:
            return None
        for n in self.lengths:
            t = text[p : p + n]
            if len(t) == n and t in self.by_text:
                return t
        return None

    def cut_ok(self, text: str, p: int, s: str) -> bool:
        """Whether cutting ``text`` at ``p``, where special text ``s`` starts, keeps the
        partition: ``s`` is no stripped whitespace's neighbour, and no special text other than
        ``s`` at ``p`` starts where it would reach ``p`` or overlap ``s``."""
        if s[0] in _SPACE or (self.by_text[s].lstrip and p > 0 and text[p - 1] in _SPACE):
            return False
        end = p + len(s)
        for q in range(max(0, p - self.maxlen + 1), end):
            if text[q] not in self.first or q == p:
                continue
            for n in self.lengths:
                if q + n <= p:
                    break  # shorter ones end before p
                t = text[q : q + n]
                if len(t) == n and t in self.by_text:
                    return False
        # at p itself: only s (the longest there) may start; a shorter one nested in it is
        # fine (s is found first), a longer one was excluded by special_at
        return True

    def cuts(self, text: str, every: int = CHUNK) -> list[int]:
        """Cut positions about ``every`` characters apart (none where none is safe)."""
        out: list[int] = []
        pos = every
        n = len(text)
        while pos < n:
            p = self._next_cut(text, pos, min(n, pos + every))
            if p is None:
                pos += every
                continue
            out.append(p)
            pos = p + every
        return out

    def _next_cut(self, text: str, start: int, stop: int) -> int | None:
        for p in range(start, stop):
            if text[p] not in self.first:
                continue
            s = self.special_at(text, p)
            if s is not None and self.cut_ok(text, p, s):
                return p
        return None


def _read_specials(backend: Tokenizer) -> list[Special] | None:
    """The special tokens of a backend's vocabulary (``Backend.special_tokens``: llama.cpp's
    ``cache_special_tokens``); None when the backend has none to give (a test fake) or a
    token text is not UTF-8."""
    own = getattr(backend, "special_tokens", None)
    if not callable(own):
        return None
    specials = own()
    if specials is None:
        return None
    return [Special(t.text, t.control, t.lstrip, t.rstrip, t.id) for t in specials]


@dataclass
class _Splitters:
    parsed: Splitter | None  # parse_special: every special token
    raw: Splitter | None  # not parse_special: the user-defined ones


_cache: weakref.WeakKeyDictionary[Tokenizer, _Splitters] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def splitter_of(backend: Tokenizer, parse_special: bool) -> Splitter | None:
    """The backend's splitter (read once per backend), None where it cannot be cut."""
    with _lock:
        got = _cache.get(backend)
        if got is None:
            specials = _read_specials(backend)
            if specials is None:
                got = _Splitters(None, None)
            else:
                parsed = Splitter(specials)
                raw = Splitter(s for s in specials if not s.control)
                got = _Splitters(parsed if parsed.usable else None, raw if raw.usable else None)
            _cache[backend] = got
    return got.parsed if parse_special else got.raw


_control: weakref.WeakKeyDictionary[Tokenizer, ControlTokens] = weakref.WeakKeyDictionary()


def control_tokens(backend: Tokenizer) -> ControlTokens:
    """The backend's control tokens (read once per backend; none for a test fake): control
    ones, and user-defined ones written ``<...>``, which llguidance takes for special
    tokens too (``constrained.matcher.ConstraintVocab.from_llama``), so no grammar's
    literal text matches them either."""
    with _lock:
        got = _control.get(backend)
        if got is None:
            specials = _read_specials(backend)
            got = NO_CONTROL
            if specials:
                got = ControlTokens.of((t.text, t.id) for t in specials if _marker(t) and t.id >= 0)
            _control[backend] = got
    return got


def _marker(t: Special) -> bool:
    return t.control or (t.text.startswith("<") and t.text.endswith(">"))


def _ends(
    backend: Tokenizer, add_special: bool, parse_special: bool
) -> tuple[list[int], list[int]]:
    """What ``add_special`` puts before and after a text: the empty text's tokens, split as
    llama.cpp adds them (BOS before, EOS or SEP after; two: one each)."""
    if not add_special:
        return [], []
    empty = backend.tokenize("", True, parse_special)
    if len(empty) >= 2:
        return empty[:1], empty[1:]
    if empty and getattr(backend, "add_bos", False):
        return empty, []
    return [], empty


def tokenize(backend: Tokenizer, text: str, add_special: bool, parse_special: bool) -> list[int]:
    """``backend.tokenize(text, add_special, parse_special)``, the same ids, in time linear in
    the text (see the module docstring); checks the request's cancellation between pieces."""
    return tokenize_at(backend, text, add_special, parse_special, ())[0]


def tokenize_at(
    backend: Tokenizer, text: str, add_special: bool, parse_special: bool, marks: Iterable[int]
) -> tuple[list[int], dict[int, int]]:
    """``tokenize``, and for each character offset in ``marks`` where the text could be cut,
    the index of the token it starts at (tokenizing ``text[:mark]`` alone gives exactly the
    tokens before it). Marks where no cut is safe, and all of them for a short text, are
    left out of the dict."""
    marks = set(marks)
    splitter = splitter_of(backend, parse_special) if len(text) > CHUNK else None
    if splitter is None:  # short (one call is fast), or the special tokens are unknown
        return backend.tokenize(text, add_special, parse_special), {}
    cuts = set(splitter.cuts(text))
    for m in marks:
        s = splitter.special_at(text, m) if 0 < m < len(text) else None
        if s is not None and splitter.cut_ok(text, m, s):
            cuts.add(m)
    head, tail = _ends(backend, add_special, parse_special)
    out = list(head)
    at: dict[int, int] = {}
    prev = 0
    for p in [*sorted(cuts), len(text)]:
        checkpoint()
        out += backend.tokenize(text[prev:p], False, parse_special)
        if p in marks:  # the piece after p starts at the next token
            at[p] = len(out)
        prev = p
    out += tail
    # with a suffix (EOS), the text before a mark tokenized alone ends with it: no mark
    return out, at if not tail else {}
