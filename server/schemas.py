"""Request bodies. Every numeric field is range-checked here, before anything reaches llama.cpp."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_N = 16  # choices per request
MAX_LOGPROBS = 20  # top log-probabilities per token
MAX_STOPS = 16
MAX_STOP_CHARS = 1000  # the partial-match scan per token is linear in this
MAX_BIAS = 1024


class _Req(BaseModel):
    """Base of every request body."""

    # Unknown fields are ignored, as OpenAI-compatible servers do.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Req):
    """OpenAI's ``stream_options``: ``include_usage`` adds a last chunk with ``usage``."""

    include_usage: bool = False


class SamplingFields(_Req):
    """Fields every generating endpoint takes: sampler settings, stop strings, slot choice,
    prompt caching and a per-request timeout (``service.submit`` reads them)."""

    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=1_000_000)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=-1, le=2**63 - 1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repeat_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    repeat_last_n: Annotated[int, Field(ge=-1, le=1_000_000)] | None = None
    logit_bias: dict[str, float] | list[list[Any]] | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    id_slot: Annotated[int, Field(ge=-1, le=1023)] = -1
    cache_prompt: bool = True
    n_probs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] = 0
    timeout: Annotated[float, Field(gt=0, le=86_400)] | None = None  # seconds

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
    def _bias(cls, v: Any) -> Any:
        if v is not None and len(v) > MAX_BIAS:
            raise ValueError(f"at most {MAX_BIAS} logit_bias entries")
        return v


Prompt = str | list[int] | list[str] | list[list[int]]


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


class ContentPart(_Req):
    """A chat content part; only ``text`` parts are served (others are a 400)."""

    type: str
    text: str | None = None


class Message(_Req):
    """A chat message; the role is checked against the template's roles when rendering."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatRequest(SamplingFields):
    """/v1/chat/completions. ``max_completion_tokens`` wins over ``max_tokens``."""

    model: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=-1, le=1_000_000)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=-1, le=1_000_000)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    user: str | None = None


class NativeCompletionRequest(SamplingFields):
    """llama-server's /completion. ``max_tokens`` wins over ``n_predict``."""

    prompt: str | list[int]
    n_predict: Annotated[int, Field(ge=-1, le=1_000_000)] = -1
    max_tokens: Annotated[int, Field(ge=-1, le=1_000_000)] | None = None
    stream: bool = False


class TokenizeRequest(_Req):
    """/tokenize (llama-server's defaults: no BOS, special tokens parsed)."""

    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(_Req):
    """/detokenize."""

    tokens: list[int]


class SlotActionBody(_Req):
    """The body of /slots/{id}?action=save|restore: a file name within --slot-save-path."""

    filename: str


Role = Literal["system", "user", "assistant", "tool", "developer", "function"]
