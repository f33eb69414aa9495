"""llama-server's ``prompt`` forms for /completion (its ``tokenize_input_prompts``).

A prompt is text, a list of token ids, a list mixing ids and text (``[12, "text", 34]``), or
an object ``{"prompt_string": text-or-mixed}``. A list with no token id at its top level is a
list of such prompts, each its own task: ``[[1, 2], "text", {"prompt_string": "x"}]``.
An object may carry ``multimodal_data``, a list of base64 images, one per media marker of
its ``prompt_string`` (/props ``media_marker``): read by ``multimodal_prompt``, taken with
``--mmproj`` only (server.prompts.completion).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeGuard

from ..schemas.errors import APIError

PROMPT_STRING = "prompt_string"
MULTIMODAL = "multimodal_data"

# (text, add_special) -> token ids, special tokens parsed (llama-server's common_tokenize)
Tokenize = Callable[[str, bool], list[int]]

_BAD_ELEMENT = (
    '"prompt" elements must be a string, a list of tokens, a JSON object containing a prompt '
    "string, or a list of mixed strings & tokens."
)
_NO_MTMD = "Multimodal data provided, but model does not support multimodal requests."


def _is_token(x: object) -> TypeGuard[int]:
    # JSON true/false arrive as bool, a subclass of int: they are no token ids
    return isinstance(x, int) and not isinstance(x, bool)


def split_prompts(raw: object) -> list[object]:
    """The prompts of a request's ``prompt``: a list without a token id at its top level is
    a list of prompts; anything else is one. APIError 400 for an empty list."""
    if isinstance(raw, list) and not any(_is_token(x) for x in raw):
        if not raw or "" in raw:
            raise APIError(400, '"prompt" must not be empty')
        return list(raw)
    if raw == "":  # nothing to continue (BOS alone): a client's mistake, not a request
        raise APIError(400, '"prompt" must not be empty')
    return [raw]


def _mixed(p: str | list[object], tokenize: Tokenize) -> list[int]:
    """Text, or ids and text in order; BOS (add_special) only where the first part is text."""
    if isinstance(p, str):
        return tokenize(p, True)
    out: list[int] = []
    for i, x in enumerate(p):
        if isinstance(x, str):
            out.extend(tokenize(x, i == 0))
        elif _is_token(x):
            out.append(x)
        else:
            raise APIError(400, _BAD_ELEMENT)
    return out


def multimodal_prompt(p: object, max_count: int) -> tuple[str, list[str]] | None:
    """``(prompt_string, base64 texts)`` of a prompt object with ``multimodal_data``, None
    for any other prompt. APIError 400 for a malformed one (llama-server needs the prompt
    string to be text there) or more than ``max_count`` images."""
    if not (isinstance(p, dict) and PROMPT_STRING in p and MULTIMODAL in p):
        return None
    text, data = p[PROMPT_STRING], p[MULTIMODAL]
    if not isinstance(text, str):
        raise APIError(400, f'"{PROMPT_STRING}" must be a string with "{MULTIMODAL}"')
    if not isinstance(data, list) or not all(isinstance(x, str) for x in data):
        raise APIError(400, f'"{MULTIMODAL}" must be a list of base64 strings')
    if len(data) > max_count:
        raise APIError(400, f"more than {max_count} images in one request")
    return text, data


def prompt_tokens(p: object, tokenize: Tokenize) -> list[int]:
    """The token ids of one prompt (an element of ``split_prompts``); APIError 400 for a
    form llama-server refuses, or for multimodal data."""
    if isinstance(p, str | list):
        return _mixed(p, tokenize)
    if isinstance(p, dict) and PROMPT_STRING in p:
        if MULTIMODAL in p:
            raise APIError(400, _NO_MTMD)
        inner = p[PROMPT_STRING]
        if isinstance(inner, str | list):
            return _mixed(inner, tokenize)
    raise APIError(400, _BAD_ELEMENT)


def prompt_echo(p: object) -> str:
    """The text /completion echoes as ``prompt`` for one prompt: its text where it is text
    (or an object holding text), otherwise empty."""
    if isinstance(p, str):
        return p
    if isinstance(p, dict) and isinstance(p.get(PROMPT_STRING), str):
        return p[PROMPT_STRING]
    return ""
