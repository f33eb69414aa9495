"""/infill's prompt builder (llama-server's format_prompt_infill) on a fake vocabulary with
FIM tokens, and its body checks."""

from __future__ import annotations

import pytest

from server.prompts.infill_prompt import (
    CHUNK_PREFIX,
    FimTokens,
    InfillInputError,
    InfillLimits,
    check_infill_body,
    infill_prompt,
    tokenize_mixed,
)

BOS, PRE, SUF, MID, REP, SEP = 1, 2, 3, 4, 5, 6
FIM = FimTokens(pre=PRE, suf=SUF, mid=MID, rep=REP, sep=SEP)
FIM_NO_REPO = FimTokens(pre=PRE, suf=SUF, mid=MID)
WIDE = InfillLimits(n_batch=2048, n_predict=-1, n_ctx=8192)


def tok(text: str, add_special: bool = False, parse_special: bool = False) -> list[int]:
    """One token per character (ids 1000+), never BOS: the builder adds specials itself."""
    assert not add_special and not parse_special
    return [1000 + ord(c) for c in text]


def test_prefix_prompt_suffix_middle() -> None:
    p = infill_prompt(tok, FIM_NO_REPO, BOS, "ab", "yz", [], tok("P"), WIDE)
    assert p == [BOS, PRE, *tok("ab"), *tok("P"), SUF, *tok("yz"), MID]


def test_no_bos_when_the_vocabulary_adds_none() -> None:
    p = infill_prompt(tok, FIM_NO_REPO, None, "ab", "yz", [], [], WIDE)
    assert p == [PRE, *tok("ab"), SUF, *tok("yz"), MID]


def test_spm_order_puts_the_suffix_first() -> None:
    lim = InfillLimits(n_batch=2048, n_predict=-1, n_ctx=8192, spm=True)
    p = infill_prompt(tok, FIM_NO_REPO, BOS, "ab", "yz", [], tok("P"), lim)
    assert p == [BOS, SUF, *tok("yz"), PRE, *tok("ab"), *tok("P"), MID]


def test_repo_level_extra_context_goes_before_everything() -> None:
    extra = [{"filename": "a.h", "text": "int a;"}, {"text": "x"}]
    p = infill_prompt(tok, FIM, BOS, "ab", "yz", extra, [], WIDE)
    head = [REP, *tok("myproject\n"), SEP, *tok("a.h\n"), *tok("int a;")]
    head += [SEP, *tok("tmp\n"), *tok("x"), SEP, *tok("filename\n")]
    assert p == [*head, BOS, PRE, *tok("ab"), SUF, *tok("yz"), MID]


def test_extra_chunks_without_sep_token_use_the_snippet_separator() -> None:
    extra = [{"filename": "a.h", "text": "int a;"}]
    p = infill_prompt(tok, FIM_NO_REPO, None, "", "", extra, [], WIDE)
    assert p == [*tok(CHUNK_PREFIX), *tok("int a;"), PRE, SUF, MID]


def test_prefix_and_suffix_are_cut_to_a_batch() -> None:
    # n_batch 16: the prefix keeps its last 12 tokens, the suffix its first 4 - (2 + prompt)
    lim = InfillLimits(n_batch=16, n_predict=-1, n_ctx=8192)
    prefix, suffix = "abcdefghijklmnopqrst", "ABCDEFGH"
    p = infill_prompt(tok, FIM_NO_REPO, None, prefix, suffix, [], tok("P"), lim)
    assert p == [PRE, *tok(prefix[-12:]), *tok("P"), SUF, *tok(suffix[:1]), MID]


def test_extra_context_keeps_its_tail_within_the_context_left() -> None:
    # room for extra: n_ctx - n_batch - 2 * n_predict = 40 - 16 - 2 * 10 = 4 tokens
    lim = InfillLimits(n_batch=16, n_predict=10, n_ctx=40)
    extra = [{"text": "0123456789"}]
    p = infill_prompt(tok, FIM_NO_REPO, None, "a", "b", extra, [], lim)
    assert p == [*tok("6789"), PRE, *tok("a"), SUF, *tok("b"), MID]


def test_mixed_prompts_keep_token_ids() -> None:
    assert tokenize_mixed(tok, ["ab", 7, "c"]) == [*tok("ab"), 7, *tok("c")]


def test_missing_tokens_in_llama_servers_words() -> None:
    assert FimTokens().missing() == (
        "prefix token is missing. suffix token is missing. middle token is missing. "
    )
    assert FimTokens(pre=1, mid=3).missing() == "suffix token is missing. "
    assert FIM.missing() == ""


@pytest.mark.parametrize(
    "chunk",
    [
        {},
        {"filename": "ok"},
        {"filename": 123},
        {"filename": 123, "text": "abc"},
        {"filename": 123, "text": 456},
    ],
)
def test_malformed_extra_chunks_are_refused(chunk: dict) -> None:
    body = {"input_prefix": "a", "input_suffix": "b", "input_extra": [chunk]}
    with pytest.raises(InfillInputError):
        check_infill_body(body)


@pytest.mark.parametrize(
    "body,message",
    [
        ({"input_suffix": "b"}, '"input_prefix" is required'),
        ({"input_prefix": "a"}, '"input_suffix" is required'),
        ({"input_prefix": "a", "input_suffix": "b", "prompt": 3}, '"prompt" must be a string'),
        ({"input_prefix": "a", "input_suffix": "b", "input_extra": {}}, "must be an array"),
        ({"input_prefix": {"x": 1}, "input_suffix": "b"}, '"input_prefix" must be a string'),
    ],
)
def test_body_checks(body: dict, message: str) -> None:
    with pytest.raises(InfillInputError, match=message):
        check_infill_body(body)


def test_a_valid_body_returns_its_extra_chunks() -> None:
    extra = [{"filename": "a", "text": "b"}]
    assert (
        check_infill_body({"input_prefix": "", "input_suffix": "", "input_extra": extra}) == extra
    )
    assert check_infill_body({"input_prefix": "", "input_suffix": ""}) == []
