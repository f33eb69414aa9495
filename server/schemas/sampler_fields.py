"""llama-server's request fields beyond OpenAI's (its ``tools/server/server-schema.cpp``):
the samplers every generating endpoint honours (``SamplerFields``: DRY, XTC, mirostat,
typical, top-n-sigma, dynamic temperature, adaptive-p, min_keep, the chain's order,
backend sampling, the reasoning budget), and those this server knows but does not
implement (``LlamaRefusedFields``): a value that asks for their behaviour is a 400 naming
the field, never silently dropped (tests/e2e/test_sampler_fields.py walks the list)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from ..json_value import JsonObject, JsonValue
from ..task import sampler_order

MAX_BREAKERS = 64  # DRY sequence breakers per request
MAX_BREAKER_CHARS = 256
MAX_TAG_CHARS = 256  # reasoning budget tags and message
MAX_MESSAGE_CHARS = 4096

Unit = Annotated[float, Field(ge=0.0, le=1.0)]
Count = Annotated[int, Field(ge=0, le=1_000_000)]
Window = Annotated[int, Field(ge=-1, le=1_000_000)]  # -1: the slot's context


class SamplerFields(BaseModel):
    """The samplers of llama-server's chain, its names and ranges (defaults: the server's,
    ``--dry-multiplier`` ... ``--samplers``). ``samplers`` is a list of names or a string
    of --sampler-seq letters; an unknown one is a 400 (llama-server skips it)."""

    model_config = ConfigDict(extra="ignore")

    dry_multiplier: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    # llama-server puts its default in place of a base below 1; here that is a 400
    dry_base: Annotated[float, Field(ge=1.0, le=100.0)] | None = None
    dry_allowed_length: Count | None = None
    dry_penalty_last_n: Window | None = None
    dry_sequence_breakers: (
        Annotated[
            list[Annotated[str, Field(min_length=1, max_length=MAX_BREAKER_CHARS)]],
            Field(min_length=1, max_length=MAX_BREAKERS),
        ]
        | None
    ) = None
    xtc_probability: Unit | None = None
    xtc_threshold: Unit | None = None
    typical_p: Unit | None = None
    top_n_sigma: Annotated[float, Field(ge=-1.0, le=100.0)] | None = None  # <= 0: off
    dynatemp_range: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    dynatemp_exponent: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    mirostat: Annotated[int, Field(ge=0, le=2)] | None = None
    mirostat_tau: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    mirostat_eta: Annotated[float, Field(ge=0.0, le=10.0)] | None = None
    adaptive_target: Annotated[float, Field(ge=-1.0, le=1.0)] | None = None  # < 0: off
    adaptive_decay: Annotated[float, Field(ge=0.0, le=0.99)] | None = None
    min_keep: Count | None = None
    samplers: str | list[str] | None = None
    # False: this request samples on the CPU under -bs; True without -bs is a 400
    backend_sampling: bool | None = None
    # n_probs reports the sampler chain's final distribution (prob/top_probs)
    post_sampling_probs: bool = False
    # the reasoning budget (llama-server's names; thinking_budget_tokens is its chat alias):
    # -1 the server's --reasoning-budget, 0 ends the reasoning at once
    reasoning_budget_tokens: Annotated[int, Field(ge=-1, le=1_000_000)] | None = None
    thinking_budget_tokens: Annotated[int, Field(ge=-1, le=1_000_000)] | None = None
    reasoning_budget_message: Annotated[str, Field(max_length=MAX_MESSAGE_CHARS)] | None = None
    reasoning_budget_start_tag: Annotated[str, Field(max_length=MAX_TAG_CHARS)] | None = None
    reasoning_budget_end_tags: (
        Annotated[list[Annotated[str, Field(max_length=MAX_TAG_CHARS)]], Field(max_length=16)]
        | None
    ) = None
    reasoning_budget_end_tag: Annotated[str, Field(max_length=MAX_TAG_CHARS)] | None = None

    @field_validator("samplers")
    @classmethod
    def _order(cls, v: str | list[str] | None) -> str | list[str] | None:
        if v is not None:
            sampler_order(v)  # ValueError: a 400 naming the field
        return v


def _unset(v: JsonValue) -> bool:
    return v is None


def _falsy(v: JsonValue) -> bool:
    return not v


# field -> (whether the value asks for nothing, why it is refused)
REFUSED: dict[str, tuple[Callable[[JsonValue], bool], str]] = {
    "n_indent": (_falsy, "n_indent (minimum line indentation) is not supported"),
    "n_cmpl": (lambda v: v in (None, 1), "n_cmpl other than 1 is not supported here"),
    "t_max_predict_ms": (
        lambda v: v is None or (isinstance(v, int | float) and v <= 0),
        "t_max_predict_ms is not supported (use timeout)",
    ),
    "grammar_lazy": (_falsy, "lazy grammars are not supported"),
    "chat_format": (_unset, "chat_format is internal to llama-server"),
    "generation_prompt": (_unset, "generation_prompt is internal to llama-server"),
    "chat_parser": (_unset, "chat_parser is internal to llama-server"),
    "parse_tool_calls": (_unset, "parse_tool_calls is internal to llama-server"),
    "preserved_tokens": (_falsy, "preserved_tokens is internal to llama-server"),
    "grammar_triggers": (_falsy, "grammar_triggers is internal to llama-server"),
    "reasoning_control": (
        _falsy,
        "reasoning_control (ending reasoning at run time) is not supported",
    ),
    "echo": (_falsy, "echo is only supported on /v1/completions"),
    # per endpoint: /completion (chat fields, OpenAI's streamed usage, several choices) ...
    "reasoning_format": (
        lambda v: v in (None, "none"),
        "reasoning_format applies to the chat endpoints",
    ),
    "continue_final_message": (_falsy, "continue_final_message applies to the chat endpoints"),
    "stream_options": (
        lambda v: not getattr(v, "include_usage", False),
        "stream_options.include_usage applies to the OpenAI endpoints",
    ),
    "n": (lambda v: v in (None, 1), "n other than 1 is not supported on /completion"),
    # ... and /v1/chat/completions (the /completion response's own fields)
    "return_tokens": (_falsy, "return_tokens applies to /completion"),
    "response_fields": (_unset, "response_fields applies to /completion"),
}
COMMON = (
    "n_indent",
    "n_cmpl",
    "t_max_predict_ms",
    "grammar_lazy",
    "chat_format",
    "generation_prompt",
    "chat_parser",
    "parse_tool_calls",
    "preserved_tokens",
    "grammar_triggers",
    "reasoning_control",
    "echo",
)


def refuse(v: JsonValue, info: ValidationInfo) -> JsonValue:
    """The field validator of the REFUSED fields a request model declares."""
    ok, why = REFUSED[info.field_name or ""]  # always set for a field validator
    if not ok(v):
        raise PydanticCustomError("unsupported_field", f"{why} (this server refuses the field)")
    return v


Json = str | int | float | bool | list[object] | JsonObject


class LlamaRefusedFields(BaseModel):
    """llama-server's fields this server refuses where they ask for something (REFUSED);
    the bodies of /completion, /infill and /v1/chat/completions declare them."""

    model_config = ConfigDict(extra="ignore")

    n_indent: int | None = None
    n_cmpl: int | None = None
    t_max_predict_ms: float | None = None
    grammar_lazy: bool | None = None
    chat_format: Json | None = None
    generation_prompt: str | None = None
    chat_parser: str | None = None
    parse_tool_calls: bool | None = None
    preserved_tokens: list[object] | None = None
    grammar_triggers: list[object] | None = None
    reasoning_control: bool | None = None
    echo: bool | None = None

    _llama_refused = field_validator(*COMMON)(refuse)
