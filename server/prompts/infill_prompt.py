"""Fill-in-the-middle: the model's FIM tokens, the checks of an /infill body and the prompt
it becomes, as llama-server's ``format_prompt_infill`` builds it (repo-level pattern,
https://arxiv.org/pdf/2409.12186):

    [FIM_REP]myproject\\n[FIM_SEP]file0\\nextra0 ... [FIM_SEP]filename\\n
    [FIM_PRE]prefix prompt [FIM_SUF]suffix [FIM_MID]

The extra context takes what the context leaves after a batch and twice n_predict; the
prefix and suffix are cut to fit one batch (3:1). Pure functions over a ``tokenize``
callable: the route supplies the model's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeGuard

from ..types import TOKEN_NULL, FimTokens

Tokenize = Callable[[str, bool, bool], list[int]]  # (text, add_special, parse_special)

# llama-server's separator of extra chunks where the model has no FIM_SEP token
CHUNK_PREFIX = "\n\n--- snippet ---\n\n"


class InfillInputError(ValueError):
    """The body is malformed (a 400 with llama-server's message)."""


def check_infill_body(body: dict[str, object]) -> list[dict[str, str]]:
    """llama-server's checks of an /infill body, in its order; returns ``input_extra`` (an
    empty list when absent). InfillInputError with its message otherwise."""
    if "prompt" in body and not isinstance(body["prompt"], str):
        raise InfillInputError('"prompt" must be a string')
    if "input_prefix" not in body:
        raise InfillInputError('"input_prefix" is required')
    if "input_suffix" not in body:
        raise InfillInputError('"input_suffix" is required')
    for name in ("input_prefix", "input_suffix"):
        if not is_mixed(body[name]):
            raise InfillInputError(f'"{name}" must be a string or an array of strings and tokens')
    extra = body.get("input_extra", [])
    if not isinstance(extra, list):
        raise InfillInputError(
            '"input_extra" must be an array of {"filename": string, "text": string}'
        )
    for chunk in extra:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise InfillInputError(
                'extra_context chunk must contain a "text" field with a string value'
            )
        if "filename" in chunk and not isinstance(chunk["filename"], str):
            raise InfillInputError('extra_context chunk\'s "filename" field must be a string')
    return extra


Mixed = str | list[str | int]  # llama-server's "mixed" prompt


def is_mixed(v: object) -> TypeGuard[Mixed]:
    """A string, or a list of strings and token ids (llama-server's "mixed" prompt)."""
    if isinstance(v, str):
        return True
    return isinstance(v, list) and all(
        isinstance(x, str) or (isinstance(x, int) and not isinstance(x, bool)) for x in v
    )


def tokenize_mixed(tokenize: Tokenize, v: str | list[str | int]) -> list[int]:
    """A mixed prompt's tokens: strings tokenized without BOS or special-token parsing,
    ids taken as they are."""
    if isinstance(v, str):
        return tokenize(v, False, False)
    out: list[int] = []
    for x in v:
        out.extend(tokenize(x, False, False) if isinstance(x, str) else [x])
    return out


@dataclass(frozen=True)
class InfillLimits:
    """The sizes the prompt is cut to: the server's -b, -n and a slot's context."""

    n_batch: int
    n_predict: int
    n_ctx: int
    spm: bool = False  # --spm-infill: suffix/prefix/middle order instead of prefix/suffix


def _extra_tokens(tokenize: Tokenize, fim: FimTokens, extra: list[dict[str, str]]) -> list[int]:
    """The repo-level context before the FIM prefix: repo name, then each chunk under its
    file name (or a plain separator where the model has no FIM_SEP)."""
    out: list[int] = []
    if fim.rep != TOKEN_NULL:
        out += [fim.rep, *tokenize("myproject\n", False, False)]
    for chunk in extra:
        if fim.sep != TOKEN_NULL:
            out += [fim.sep, *tokenize(chunk.get("filename", "tmp") + "\n", False, False)]
        else:
            out += tokenize(CHUNK_PREFIX, False, False)
        out += tokenize(chunk["text"], False, False)
    if fim.sep != TOKEN_NULL:
        out += [fim.sep, *tokenize("filename\n", False, False)]
    return out


def infill_prompt(
    tokenize: Tokenize,
    fim: FimTokens,
    bos: int | None,
    prefix: str | list[str | int],
    suffix: str | list[str | int],
    extra: list[dict[str, str]],
    prompt: list[int],
    lim: InfillLimits,
) -> list[int]:
    """The /infill prompt (llama-server's format_prompt_infill); ``bos`` is the BOS token
    when the vocabulary adds one, else None."""
    t_prefix = tokenize_mixed(tokenize, prefix)
    t_suffix = tokenize_mixed(tokenize, suffix)
    extra_toks = _extra_tokens(tokenize, fim, extra)

    n_prefix_take = min(len(t_prefix), 3 * (lim.n_batch // 4))
    n_suffix_take = min(len(t_suffix), max(0, lim.n_batch // 4 - (2 + len(prompt))))
    n_extra_take = min(max(0, lim.n_ctx - lim.n_batch - 2 * lim.n_predict), len(extra_toks))

    head = [fim.pre, *t_prefix[len(t_prefix) - n_prefix_take :], *prompt]
    tail = [fim.suf, *t_suffix[:n_suffix_take]]
    first, second = (tail, head) if lim.spm else (head, tail)
    if bos is not None:
        first = [bos, *first]
    taken = extra_toks[len(extra_toks) - n_extra_take :] if n_extra_take else []
    return [*taken, *first, *second, fim.mid]
