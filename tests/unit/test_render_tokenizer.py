"""server.service.tokenizer: a long text tokenized in pieces gives the ids of tokenizing it
whole, and the work grows linearly with the number of special tokens in it.

``PartitionBackend`` does what llama.cpp's tokenizer does with special tokens
(``tokenizer_st_partition``: token by token, longest first, leftmost matches, lstrip/rstrip,
user-defined tokens cut even without parse_special; SPM's space prefix after a special
token; BOS and EOS), tokenizes raw text in 3-character pieces (a piece boundary moved by
a wrong cut changes the ids), and charges each call what llama.cpp's costs: the square of
its special tokens (its fragment-list walks) plus its length.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from server.cancel import CancelFlag, Cancelled, run_with
from server.llama.vocab import SpecialToken, special_tokens
from server.service import tokenizer
from server.service.tokenizer import CHUNK, Special, Splitter, tokenize, tokenize_at

SPACE = " \t\n\v\f\r"
PIECES: dict[str, int] = {}  # raw text piece -> id, shared: every backend numbers alike


class PartitionBackend:
    def __init__(
        self, specials: list[Special], add_bos: bool = True, add_eos: bool = False
    ) -> None:
        self._specials = specials
        # llama.cpp: longest first (std::sort; equal lengths here keep their order)
        self.order = sorted(specials, key=lambda s: -len(s.text))
        self.ids = {s.text: i for i, s in enumerate(specials)}
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.bos_id, self.eos_id = 9000, 9001
        self.space_prefix = True
        self.calls = 0
        self.cost = 0
        self.chars = 0

    def special_tokens(self) -> list[Special]:
        return self._specials

    def _partition(self, text: str, parse_special: bool) -> list[tuple[str, int, int]]:
        buf = [("raw", 0, len(text))] if text else []
        for sp in self.order:
            if not parse_special and sp.control:
                continue
            out: list[tuple[str, int, int]] = []
            for kind, off, n in buf:
                if kind != "raw":
                    out.append((kind, off, n))
                    continue
                while True:
                    m = text.find(sp.text, off, off + n)
                    if m < 0:
                        if n > 0:
                            out.append(("raw", off, n))
                        break
                    left = m - off
                    if sp.lstrip:
                        while left > 0 and text[off + left - 1] in SPACE:
                            left -= 1
                    if left > 0:
                        out.append(("raw", off, left))
                    out.append(("tok", self.ids[sp.text], 0))
                    r_off, r_n = m + len(sp.text), off + n - (m + len(sp.text))
                    if sp.rstrip:
                        while r_n > 0 and text[r_off] in SPACE:
                            r_off, r_n = r_off + 1, r_n - 1
                    off, n = r_off, r_n
                    if n <= 0:
                        break
            buf = out
        return buf

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        frags = self._partition(text, parse_special)
        k = sum(1 for f in frags if f[0] == "tok")
        self.calls += 1
        self.cost += k * k + len(text)
        self.chars += len(text)
        out = [self.bos_id] if add_special and self.add_bos else []
        prev_special = True
        for kind, off, n in frags:
            if kind == "tok":
                out.append(off)
                prev_special = True
                continue
            raw = (" " if self.space_prefix and prev_special else "") + text[off : off + n]
            for i in range(0, len(raw), 3):
                out.append(10_000 + PIECES.setdefault(raw[i : i + 3], len(PIECES)))
            prev_special = False
        if add_special and self.add_eos:
            out.append(self.eos_id)
        return out


CHATML = [
    Special("<|im_start|>"),
    Special("<|im_end|>"),
    Special("<|endoftext|>"),
    Special("<tool_call>", control=False),
]


def chatml(n: int) -> str:
    return "".join(
        f"<|im_start|>{'user' if i % 2 == 0 else 'assistant'}\nmessage {i} <tool_call> "
        f"words {'x' * (i % 7)}<|im_end|>\n"
        for i in range(n)
    )


def test_long_chat_same_ids_and_linear_work() -> None:
    """The ids of the whole text; the charged work per message flat from 1,000 to 16,000
    messages (whole, it grows with the number of messages: quadratic)."""
    per_message = []
    for n in (1_000, 4_000, 16_000):
        text = chatml(n)
        whole = PartitionBackend(CHATML)
        expected = whole.tokenize(text, True, True)
        b = PartitionBackend(CHATML)
        assert tokenize(b, text, True, True) == expected
        per_message.append(b.cost / n)
        assert whole.cost / n > 3 * n  # the quadratic it replaces
        assert b.chars <= len(text) + 8  # every character tokenized once (plus the empty text)
    assert max(per_message) < 1.5 * min(per_message), per_message


def test_mark_gives_the_token_index_of_the_last_user_turn() -> None:
    text = chatml(2_000)
    mark = text.rindex("<|im_start|>user")
    b = PartitionBackend(CHATML)
    tokens, at = tokenize_at(b, text, True, True, [mark])
    assert at[mark] > 0
    assert tokens[: at[mark]] == PartitionBackend(CHATML).tokenize(text[:mark], True, True)


# Tricky vocabularies: strip attributes, overlapping and nested special texts, one that
# starts with whitespace, user-defined ones (cut without parse_special too).
TRICKY = [
    Special("<s>"),
    Special("<|a|>", lstrip=True),
    Special("<|b|>", rstrip=True),
    Special("<|a|><|b|>"),
    Special("|>x"),
    Special("\n\n", control=False),
    Special("<|", control=False),
    Special("ab<", control=False),
]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("add_eos", [False, True])
def test_random_texts_with_tricky_specials_tokenize_alike(seed: int, add_eos: bool) -> None:
    rng = random.Random(seed)
    alphabet = ["<|a|>", "<|b|>", "<s>", "|>", "x", "a", "b", "<", " ", "\n", "\t", "word "]
    text = "".join(rng.choice(alphabet) for _ in range(30_000))
    for parse_special in (True, False):
        for add_special in (True, False):
            whole = PartitionBackend(TRICKY, add_eos=add_eos)
            want = whole.tokenize(text, add_special, parse_special)
            b = PartitionBackend(TRICKY, add_eos=add_eos)
            tokenizer._cache.clear()  # noqa: SLF001 - each backend reads its own
            got = tokenize(b, text, add_special, parse_special)
            assert got == want, (seed, parse_special, add_special)
            assert b.calls > 2  # it was cut


def test_splitter_refuses_unsafe_cuts() -> None:
    s = Splitter(TRICKY)
    # "|>x" starts inside "<|b|>x": a cut before <|b|> would split it
    assert not s.cut_ok("yy<|b|>x", 2, "<|b|>")
    # an lstrip token after whitespace: the whitespace belongs to the cut
    assert not s.cut_ok("yy <|a|>", 3, "<|a|>")
    # "<|" nested at the cut is fine: the longer "<|a|>" is cut out first
    assert s.cut_ok("yy<|a|>", 2, "<|a|>")
    assert s.cut_ok("yyz<s>", 3, "<s>")


def test_short_text_and_unknown_vocabulary_are_one_call() -> None:
    b = PartitionBackend(CHATML)
    tokenize(b, chatml(10), True, True)
    assert b.calls == 1

    class Plain:
        calls = 0

        def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
            self.calls += 1
            return [len(text)]

    p = Plain()
    assert tokenize(p, "x" * (3 * CHUNK), True, True) == [3 * CHUNK]
    assert p.calls == 1


def test_cancelled_between_pieces() -> None:
    b = PartitionBackend(CHATML)
    flag = CancelFlag()
    text = chatml(4_000)

    def work() -> list[int]:
        flag.cancel("the client left")  # as if it left while the first piece ran
        return tokenize(b, text, True, True)

    with pytest.raises(Cancelled):
        run_with(flag, work, ())
    assert b.calls <= 2  # the empty text (BOS) and at most one piece


# ---- the real vocabulary ----------------------------------------------------------------


class RealVocab:
    """The default model's tokenizer (vocabulary-only load), as the backend offers it."""

    def __init__(self, path: str) -> None:
        import llama_cpp as L

        self.L = L
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.vocab_only = True
        self.model = L.llama_model_load_from_file(path.encode(), mp)
        assert self.model
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.add_bos = bool(L.llama_vocab_get_add_bos(self.vocab))

    def special_tokens(self) -> list[SpecialToken] | None:
        return special_tokens(self.vocab, self.n_vocab)

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode()
        buf = (self.L.llama_token * (len(data) + 8))()
        n = self.L.llama_tokenize(
            self.vocab, data, len(data), buf, len(buf), add_special, parse_special
        )
        return list(buf[:n])


def _model_path(name: str) -> str:
    if name == "gemma":  # the default model: SentencePiece, 6,414 special tokens
        from server.http.app import default_model_path

        return default_model_path()
    from tests.e2e.conftest import smollm2_path  # byte-level BPE, <|im_start|> markers

    return smollm2_path()


@pytest.fixture(scope="module", params=["gemma", "smollm2"])
def real(request: pytest.FixtureRequest) -> Any:
    v = RealVocab(_model_path(request.param))
    yield v
    v.L.llama_model_free(v.model)


def test_real_vocabulary_same_ids(real: Any) -> None:
    """The default model's own template markers, other special and user-defined tokens,
    whitespace runs and non-ASCII text in the messages: the pieces give the ids of the
    whole, with and without BOS and special-token parsing."""
    rng = random.Random(7)
    words = [
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "hello",
        " ",
        "  ",
        "\n",
        "\n\n",
        "\t",
        "<start_of_turn>",
        "<end_of_turn>",
        "<unused3>",
        "<b>",
        "</b>",
        "<pad>",
        "日本語",
        "é",
        "<",
        ">",
        "user",
        "model",
    ]
    turns = []
    for i in range(1_500):
        body = "".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        role = "user" if i % 2 == 0 else "model"
        turns.append(f"<start_of_turn>{role}\n{body}<end_of_turn>\n<|im_start|>{role}\n")
    text = "".join(turns)
    assert len(text) > 4 * CHUNK

    class Counting:
        vocab, n_vocab, add_bos = real.vocab, real.n_vocab, real.add_bos
        calls: list[int] = []

        def special_tokens(self) -> list[SpecialToken] | None:
            return real.special_tokens()

        def tokenize(self, t: str, a: bool, p: bool) -> list[int]:
            self.calls.append(len(t))
            return real.tokenize(t, a, p)

    c = Counting()
    for add_special in (True, False):
        for parse_special in (True, False):
            want = real.tokenize(text, add_special, parse_special)
            c.calls = []
            assert tokenize(c, text, add_special, parse_special) == want
            if tokenizer.splitter_of(c, parse_special) is not None:
                assert len(c.calls) > 3 and max(c.calls) < 3 * CHUNK
            else:  # nothing llama.cpp cuts at (SmolLM2 has no user-defined tokens): one call
                assert len(c.calls) == 1 and not parse_special
