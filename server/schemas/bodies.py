"""Request bodies. Every numeric field is range-checked here, before anything reaches llama.cpp."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ..json_value import BodyJson, JsonObject, JsonValue
from .sampler_fields import LlamaRefusedFields, SamplerFields, refuse

MAX_N = 16  # choices per request
MAX_LOGPROBS = 20  # top log-probabilities per token
MAX_STOPS = 16
MAX_STOP_CHARS = 1000  # the partial-match scan per token is linear in this
MAX_BIAS = 1024


class BaseBody(BaseModel):
    """Base of every request body."""

    # Unknown fields are ignored, as OpenAI-compatible servers do.
    model_config = ConfigDict(extra="ignore")


def _absent(v: JsonValue) -> bool:
    return v is None


def _not_true(v: JsonValue) -> bool:
    return v is None or v is False


# Fail closed: OpenAI request fields this server knows but does not implement. A value that
# asks for their behaviour is a 400 naming the field, never silently dropped (README "Fields
# that are refused"); the value each one may take where it asks for nothing is accepted.
# Fields unknown to the server are still ignored, as llama-server does.
UNSUPPORTED: dict[str, tuple[Callable[[JsonValue], bool], str]] = {
    "audio": (_absent, "audio output is not supported"),
    "modalities": (lambda v: v is None or v == ["text"], 'only ["text"] is supported'),
    "prediction": (_absent, "predicted outputs are not supported"),
    "web_search_options": (_absent, "web search is not supported"),
    "functions": (_absent, "the legacy functions field is not supported (use tools)"),
    "function_call": (_absent, "the legacy function_call field is not supported (use tool_choice)"),
    "store": (_not_true, "stored completions are not supported"),
    "verbosity": (_absent, "verbosity is not supported"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "only the default tier exists"),
    "suffix": (lambda v: not v, "suffix (insertion) is not supported"),
    "best_of": (lambda v: v in (None, 1), "best_of other than 1 is not supported"),
    # the Responses API: only its stateless subset (llama-server's wording for the first)
    "previous_response_id": (lambda v: not v, "llama.cpp does not support 'previous_response_id'."),
    "conversation": (_absent, "conversations (stored state) are not supported"),
    "background": (_not_true, "background responses are not supported"),
}


def _refuse_unsupported(v: JsonValue, info: ValidationInfo) -> JsonValue:
    """The field validator of the UNSUPPORTED fields a request model declares."""
    ok, why = UNSUPPORTED[info.field_name or ""]  # always set for a field validator
    if not ok(v):
        raise PydanticCustomError("unsupported_field", f"{why} (this server refuses the field)")
    return v


class StreamOptions(BaseBody):
    """OpenAI's ``stream_options``: ``include_usage`` adds a last chunk with ``usage``."""

    include_usage: bool = False


# The largest LoRA scale, either sign (issue 40): a real adapter runs at 0-2; far beyond,
# a random one already drives the logits to NaN (at 100: empty text, 500s). llama-server
# takes any float; here a scale outside [-10, 10] is a 400 (--lora-scaled: refused at start).
LORA_SCALE_MAX = 10.0


# the widest request priority either way (vLLM takes any integer; these are plenty)
PRIORITY_MAX = 1_000_000


class LoraScale(BaseBody):
    """llama-server's LoRA item: an adapter id (GET /lora-adapters) and its scale, within
    ``LORA_SCALE_MAX`` either way."""

    id: Annotated[int, Field(ge=0, le=1023)]
    scale: Annotated[float, Field(ge=-LORA_SCALE_MAX, le=LORA_SCALE_MAX)] = 0.0


class SamplingFields(BaseBody, SamplerFields):
    """Fields every generating endpoint takes: sampler settings (with llama-server's own,
    ``SamplerFields``), stop strings, slot choice, prompt caching and a per-request timeout
    (``service.submit`` reads them)."""

    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=1_000_000)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=-1, le=2**63 - 1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repeat_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    repeat_last_n: Annotated[int, Field(ge=-1, le=1_000_000)] | None = None
    logit_bias: dict[str, BodyJson] | list[list[object]] | None = (
        None  # service.sampling._logit_bias
    )
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    id_slot: Annotated[int, Field(ge=-1, le=1023)] = -1
    cache_prompt: bool = True
    n_probs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] = 0
    # llama-server's prompt_progress events in streamed responses
    return_progress: bool = False
    timings_per_token: bool = False  # llama-server's timings on every streamed chunk
    # llama-server's debug field: __verbose in OpenAI responses (default: --verbose)
    verbose: bool | None = None
    timeout: Annotated[float, Field(gt=0, le=86_400)] | None = None  # seconds
    # llama-server's: seconds a stream may stay silent before an SSE comment ping (<= 0:
    # never; default --sse-ping-interval)
    sse_ping_interval: Annotated[float, Field(ge=-1, le=86_400)] | None = None
    # vLLM's field: names the tenant whose cached prefixes this request may reuse
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    # llama-server's constrained decoding (server.constrained.request_constraint reads them)
    json_schema: BodyJson = None
    grammar: BodyJson = None
    # speculative decoding, in llama-server's former per-request keys (dotted JSON names):
    # narrow the server's --spec-* settings; "speculative.n_max": 0 turns it off
    spec_n_max: int | None = Field(None, ge=0, le=256, alias="speculative.n_max")
    spec_n_min: int | None = Field(None, ge=0, le=256, alias="speculative.n_min")
    spec_p_min: float | None = Field(None, ge=0.0, le=1.0, alias="speculative.p_min")
    # --context-shift: prompt tokens kept (-1: all; default: --keep), and tokens dropped
    # after them (0: half of the rest), as llama-server's n_keep / n_discard
    n_keep: Annotated[int, Field(ge=-1, le=1_000_000)] | None = None
    n_discard: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    # --cache-reuse for this request (0: off; default: the server's); llama-server's field
    n_cache_reuse: Annotated[int, Field(ge=0, le=1_000_000)] | None = None
    # vLLM's scheduling priority: lower is served first (needs --scheduling-policy priority;
    # under fcfs only 0 is taken, as vLLM does)
    priority: Annotated[int, Field(ge=-PRIORITY_MAX, le=PRIORITY_MAX)] = 0
    # llama-server's per-request adapter scales; an adapter left out runs at 0 (issue 32)
    lora: Annotated[list[LoraScale], Field(max_length=1024)] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop strings are at most {MAX_STOP_CHARS} characters")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(
        cls, v: JsonObject | list[list[object]] | None
    ) -> JsonObject | list[list[object]] | None:
        if v is not None and len(v) > MAX_BIAS:
            raise ValueError(f"at most {MAX_BIAS} logit_bias entries")
        return v


# the object form is llama-server's {"prompt_string": ..., "multimodal_data": [...]}
Prompt = str | list[int] | list[str] | list[list[int]] | JsonObject


class CompletionRequest(SamplingFields):
    """/v1/completions. ``max_tokens`` wins over llama-server's ``n_predict``."""

    model: str | None = None
    prompt: Prompt
    max_tokens: Annotated[int, Field(ge=-1, le=1_000_000)] | None = None
    n_predict: Annotated[int, Field(ge=-1, le=1_000_000)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    user: str | None = None
    suffix: BodyJson = None  # refused (UNSUPPORTED)
    best_of: BodyJson = None  # refused above 1 (UNSUPPORTED)

    _refused = field_validator("suffix", "best_of")(_refuse_unsupported)

    @model_validator(mode="after")
    def _n_probs(self) -> CompletionRequest:
        """llama-server's ``n_probs``: the ``logprobs`` of that many top tokens."""
        if self.n_probs > 0 and self.logprobs is None:
            self.logprobs = self.n_probs
        return self


class ContentPart(BaseBody):
    """A chat content part: ``text``, or ``image_url`` (with --mmproj; server.media.image_inputs);
    others are a 400."""

    type: str
    text: str | None = None
    image_url: JsonObject | str | None = None


class CalledFunction(BaseBody):
    """The function of an assistant message's tool call: OpenAI sends ``arguments`` as JSON
    text (an object is accepted too)."""

    name: str
    arguments: str | JsonObject = "{}"


class MessageToolCall(BaseBody):
    """A tool call in the history (an assistant message's ``tool_calls``)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(BaseBody):
    """A chat message; the role is checked against the template's roles when rendering.
    Assistant messages may carry ``tool_calls`` (content then null), ``tool`` messages the
    ``tool_call_id`` they answer; ``reasoning_content`` goes to templates that show it."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatRequest(SamplingFields, LlamaRefusedFields):
    """/v1/chat/completions. ``max_completion_tokens`` wins over ``max_tokens``, which wins
    over llama-server's ``n_predict``."""

    model: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=-1, le=1_000_000)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=-1, le=1_000_000)] | None = None
    n_predict: Annotated[int, Field(ge=-1, le=1_000_000)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    user: str | None = None
    response_format: BodyJson = None  # server.constrained.request_constraint reads it
    # tool calling and reasoning (server.templates checks them: 400 for malformed tools)
    tools: BodyJson = None
    tool_choice: BodyJson = None
    parallel_tool_calls: bool | None = None
    reasoning_format: Literal["none", "auto", "deepseek"] | None = None
    chat_template_kwargs: dict[str, BodyJson] | None = None
    reasoning_effort: str | None = None
    # vLLM's: open the assistant turn; continue the final message instead (llama-server
    # also continues a final assistant message by itself: --prefill-assistant)
    add_generation_prompt: bool = True
    continue_final_message: bool | Literal["content", "reasoning_content"] | None = None
    # refused when they ask for something (UNSUPPORTED)
    audio: BodyJson = None
    modalities: BodyJson = None
    prediction: BodyJson = None
    web_search_options: BodyJson = None
    functions: BodyJson = None
    function_call: BodyJson = None
    store: BodyJson = None
    verbosity: BodyJson = None
    service_tier: BodyJson = None
    return_tokens: bool | None = None  # refused (sampler_fields.REFUSED): /completion's
    response_fields: list[str] | None = None

    _chat_refused = field_validator("return_tokens", "response_fields")(refuse)

    @model_validator(mode="after")
    def _n_probs(self) -> ChatRequest:
        """llama-server's ``n_probs`` on chat: the logprobs of that many top tokens."""
        if self.n_probs > 0 and not self.logprobs:
            self.logprobs, self.top_logprobs = True, self.top_logprobs or self.n_probs
        return self

    _refused = field_validator(
        "audio",
        "modalities",
        "prediction",
        "web_search_options",
        "functions",
        "function_call",
        "store",
        "verbosity",
        "service_tier",
    )(_refuse_unsupported)


class NativeCompletionRequest(SamplingFields, LlamaRefusedFields):
    """llama-server's /completion. ``max_tokens`` wins over ``n_predict``. ``prompt`` takes
    every form of llama-server's (server.prompts.completion_forms checks it)."""

    prompt: BodyJson
    model: str | None = None  # a --lora-alias runs that adapter (service/adapters.py)
    n_predict: Annotated[int, Field(ge=-1, le=1_000_000)] = -1
    max_tokens: Annotated[int, Field(ge=-1, le=1_000_000)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=-1, le=1_000_000)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None  # n_probs' alias
    stream: bool = False
    # only these fields of the final object ("a/b": a nested one, moved to the top)
    response_fields: list[str] | None = None
    return_tokens: bool = False  # the final object's ``tokens``: the generated token ids
    # refused where they ask for something (sampler_fields.REFUSED)
    reasoning_format: str | None = None
    continue_final_message: bool | str | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None

    _native_refused = field_validator(
        "reasoning_format", "continue_final_message", "stream_options", "n"
    )(refuse)


class TokenizeRequest(BaseBody):
    """/tokenize (llama-server's defaults: no BOS, special tokens parsed)."""

    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(BaseBody):
    """/detokenize."""

    tokens: list[int]


class SlotActionBody(BaseBody):
    """The body of /slots/{id}?action=save|restore: a file name within --slot-save-path."""

    filename: str


Role = Literal["system", "user", "assistant", "tool", "developer", "function"]


class InfillRequest(SamplingFields, LlamaRefusedFields):
    """llama-server's /infill. The FIM fields are checked by ``server.prompts.infill_prompt`` (in llama-server's
    order and words, after the model's FIM tokens), so they are untyped here."""

    input_prefix: BodyJson = None
    input_suffix: BodyJson = None
    input_extra: BodyJson = None
    prompt: BodyJson = None
    model: str | None = None  # as /completion's
    n_predict: Annotated[int, Field(ge=-1, le=1_000_000)] = -1
    max_tokens: Annotated[int, Field(ge=-1, le=1_000_000)] | None = None
    stream: bool = False
    response_fields: list[str] | None = None  # as /completion's
    return_tokens: bool = False  # as /completion's


class ResponsesRequest(SamplingFields):
    """/v1/responses: server.protocols.responses_mapping maps it onto a chat body, which ChatRequest then
    checks. Fields not named here pass through to that chat body (hence extra="allow");
    those that need stored state are refused (UNSUPPORTED)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    stream: bool = False
    previous_response_id: BodyJson = None
    store: BodyJson = None
    background: BodyJson = None
    conversation: BodyJson = None

    _refused = field_validator("previous_response_id", "store", "background", "conversation")(
        _refuse_unsupported
    )
