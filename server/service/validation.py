"""Checks a request passes before anything runs: its prompts' tokens and lengths, and
its constraint (schema, grammar), compiled for the model's vocabulary. Each failure is an
APIError 400."""

from __future__ import annotations

import asyncio

from ..constrained import Constraint, ConstraintError, request_constraint
from ..constrained.matcher import compile_executor
from ..engine.model_api import ModelBackend
from ..engine_api import Tokenizer
from ..json_value import JsonValue
from ..schemas.errors import APIError
from ..types import TokenConstraint


def constraint_of(
    *, response_format: JsonValue = None, json_schema: JsonValue = None, grammar: JsonValue = None
) -> Constraint | None:
    """The constraint a request's fields ask for (``constrained.request_constraint``);
    APIError 400 naming the field and the offending part of its schema or grammar."""
    try:
        return request_constraint(
            response_format=response_format, json_schema=json_schema, grammar=grammar
        )
    except ConstraintError as e:
        raise APIError(400, f"cannot constrain the output: {e}") from None


def compile_constraint(backend: ModelBackend, c: Constraint) -> TokenConstraint:
    """``c`` bound to the model's vocabulary (cached per constraint); APIError 400 naming the
    offending part when it cannot be compiled: never unconstrained decoding instead."""
    try:
        return backend.constraint_compiler().compile(c)
    except ConstraintError as e:
        raise APIError(400, f"cannot constrain the output: {e}") from None


async def bind_constraint(backend: ModelBackend, c: Constraint) -> TokenConstraint:
    """``compile_constraint`` off the event loop, on the compile thread: binding takes
    milliseconds to tens of them, and its stack is large enough for whatever a compile child
    passed."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(compile_executor(), compile_constraint, backend, c)


def check_tokens(tokens: list[int], backend: Tokenizer) -> None:
    """APIError 400 unless every token id is in the vocabulary (llama.cpp does not check)."""
    n = backend.n_vocab
    for t in tokens:
        if not 0 <= t < n:
            raise APIError(400, f"token id {t} is outside the vocabulary (0..{n - 1})")


def check_fits(prompt: list[int], backend: ModelBackend) -> None:
    """APIError 400 for an empty prompt or one that leaves no room in a slot's context."""
    if not prompt:
        raise APIError(400, "the prompt is empty")
    if len(prompt) >= backend.n_ctx_slot:
        raise APIError(
            400,
            f"the request ({len(prompt)} prompt tokens) exceeds the available context size "
            f"({backend.n_ctx_slot} tokens), try increasing it",
            "exceed_context_size_error",
            n_prompt_tokens=len(prompt),
            n_ctx=backend.n_ctx_slot,
        )
