"""Constrained decoding: the output of a request follows a JSON schema, any JSON object, or a
grammar (GBNF, or Lark as llguidance reads it). The engine is llguidance (chosen by
measurement, see README "Structured outputs").

Two stages, so that every failure is a 400 before anything runs and nothing slow happens on
the engine thread:

1. ``json_schema_constraint`` / ``json_object_constraint`` / ``gbnf_constraint`` /
   ``lark_constraint`` check a request's schema or grammar and return a ``Constraint``: an
   immutable, vocabulary-free value (hashable; ``key`` is its canonical text). They raise
   ``ConstraintError`` naming the offending part (``where``: a JSON pointer into the schema,
   or the grammar's line/rule). Results are kept in an LRU cache keyed by the canonical text.
2. ``ConstraintCompiler(vocab).compile(constraint)`` binds a Constraint to the model's
   vocabulary (the slow step: token trie, lexer) once per key (LRU cache) and returns a
   ``CompiledConstraint``; its ``matcher()`` is a cheap copy for one request. The service
   does this in a worker thread and puts the CompiledConstraint in ``SamplingParams.constraint``:
   a request's ``PromptSource.constraint()`` (server/service/submit.py) gives its
   Constraint, and ``service.submit`` compiles it (ConstraintError becomes a 400 there).

``request_constraint(response_format=..., json_schema=..., grammar=...)`` reads the request
fields (OpenAI's ``response_format``, llama-server's ``json_schema``/``grammar``).

The engine drives a ``Matcher`` per slot: ``allows(token)`` (one token, cheap),
``mask_logits(logits)`` (the full vocabulary, only when the sampled token was refused),
``accept(token)``, ``forced(limit)`` (the tokens the constraint forces next: the engine feeds
them without sampling, engine/executor.py), ``is_done()`` (the grammar is complete and nothing may follow: finish with
"stop"), ``can_end()`` (end-of-generation tokens are allowed), ``rollback(n)`` and ``reset()``.

Tool calling (server.templates) forces a call format with ``json_schema_constraint(schema,
prefix=..., suffix=...)`` or, for alternatives/repetitions, ``lark_constraint`` (Lark with
``%json {...}`` islands, llguidance's syntax). Literal text (prefix, suffix, Lark strings)
matches ordinary tokens only: a control token (Mistral's ``[TOOL_CALLS]``, tokens the
vocabulary marks as special) is matched only by Lark's ``<[id]>`` or ``<name>`` syntax.

Whitespace between JSON tokens is bounded and so are numbers without bounds of their own
(``spec.WHITESPACE``, ``spec.MAX_NUMBER``), so a weak model cannot run on in either.
"""

from __future__ import annotations

from .matcher import (
    CompiledConstraint,
    ConstraintCompiler,
    ConstraintVocab,
    Matcher,
    llama_compiler,
)
from .request import request_constraint
from .spec import (
    Constraint,
    ConstraintError,
    gbnf_constraint,
    json_object_constraint,
    json_schema_constraint,
    lark_constraint,
)

__all__ = [
    "CompiledConstraint",
    "Constraint",
    "ConstraintCompiler",
    "ConstraintError",
    "ConstraintVocab",
    "Matcher",
    "gbnf_constraint",
    "json_object_constraint",
    "json_schema_constraint",
    "lark_constraint",
    "llama_compiler",
    "request_constraint",
]
