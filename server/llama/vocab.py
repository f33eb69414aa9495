"""The vocabulary: ``tokenize`` (llama_tokenize, the one wrapper of it), and the special
tokens, as llama.cpp's tokenizer cuts a text at them
(``llama_vocab::impl::cache_special_tokens``: control, user-defined and unknown tokens),
read once per model by ``Backend.special_tokens`` for ``service.tokenizer``'s cuts."""

from __future__ import annotations

from dataclasses import dataclass

import llama_cpp as L


def tokenize(vocab: object, text: str, add_special: bool, parse_special: bool) -> list[int]:
    """``text``'s token ids (llama_tokenize; a second call with the size it asks for when
    the first buffer is short)."""
    data = text.encode("utf-8")
    cap = len(data) + 8
    buf = (L.llama_token * cap)()
    n = L.llama_tokenize(vocab, data, len(data), buf, cap, add_special, parse_special)
    if n < 0:
        cap = -n
        buf = (L.llama_token * cap)()
        n = L.llama_tokenize(vocab, data, len(data), buf, cap, add_special, parse_special)
    return buf[:n]


@dataclass(frozen=True)
class SpecialToken:
    """A token the tokenizer cuts at: ``control`` ones (control, unknown) only when special
    tokens are parsed, user-defined ones always; ``lstrip``/``rstrip``: it eats the
    whitespace on that side; ``id``: its token id."""

    text: str
    control: bool
    lstrip: bool
    rstrip: bool
    id: int = -1


def special_tokens(vocab: object, n_vocab: int) -> list[SpecialToken] | None:
    """Every special token of ``vocab``; None when one's text is not UTF-8 (then no text
    can be cut safely). One pass over the vocabulary, once per model."""
    control = L.LLAMA_TOKEN_ATTR_CONTROL | L.LLAMA_TOKEN_ATTR_UNKNOWN
    wanted = control | L.LLAMA_TOKEN_ATTR_USER_DEFINED
    out = []
    for tok in range(n_vocab):
        attr = L.llama_vocab_get_attr(vocab, tok)
        if not attr & wanted:
            continue
        try:
            text = (L.llama_vocab_get_text(vocab, tok) or b"").decode("utf-8")
        except UnicodeDecodeError:
            return None
        out.append(
            SpecialToken(
                text,
                bool(attr & control),
                bool(attr & L.LLAMA_TOKEN_ATTR_LSTRIP),
                bool(attr & L.LLAMA_TOKEN_ATTR_RSTRIP),
                tok,
            )
        )
    return out
