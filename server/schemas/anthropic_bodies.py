"""Request bodies of Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``).

Content blocks are a union tagged by ``type``: an unknown block type is a 400 that names it
and the types served. Fields Anthropic defines that this server cannot honour are refused
when they ask for something (``_refuse``); metadata-like fields (``metadata``,
``cache_control``, ``service_tier``, ...) are accepted, as they ask nothing of the output.
llama-server's own sampling fields (``seed``, ``min_p``, ``id_slot``, ``cache_salt``, ...)
are taken too (``SamplingFields``)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from ..json_value import BodyJson, JsonObject, JsonValue
from .bodies import MAX_STOP_CHARS, MAX_STOPS, SamplingFields

MAX_MESSAGES = 100_000  # Anthropic's own limit
MAX_BLOCKS = 10_000  # content blocks in one message


class _Block(BaseModel):
    """Base of content blocks: unknown fields (``citations``, ...) are ignored, as the API's
    other clients send them back in the history."""

    model_config = ConfigDict(extra="ignore")

    # prompt caching breakpoints: every prompt is cached here without being asked
    cache_control: BodyJson = None


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ImageBlock(_Block):
    type: Literal["image"]
    source: JsonObject = Field(default_factory=dict)


class DocumentBlock(_Block):
    """A document; only a plain-text source is served (``{"type": "text", "data": ...}``)."""

    type: Literal["document"]
    source: JsonObject = Field(default_factory=dict)
    title: str | None = None
    context: str | None = None


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1, max_length=256)]
    name: Annotated[str, Field(min_length=1, max_length=256)]
    input: JsonObject = Field(default_factory=dict)


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1, max_length=256)]
    content: str | list[TextBlock | ImageBlock | DocumentBlock] | None = None
    is_error: bool = False


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    """Encrypted reasoning of another server's model: opaque, so it is not rendered."""

    type: Literal["redacted_thinking"]
    data: str = ""


Block = Annotated[
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock,
    Field(discriminator="type"),
]


BLOCK_TYPES = (
    "text",
    "image",
    "document",
    "tool_use",
    "tool_result",
    "thinking",
    "redacted_thinking",
)


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(max_length=MAX_BLOCKS)]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, v: JsonValue) -> JsonValue:
        """An unknown block type named plainly (not as pydantic's union of failures)."""
        for j, b in enumerate(v if isinstance(v, list) else []):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind not in BLOCK_TYPES:
                raise PydanticCustomError(
                    "unknown_block",
                    f"block {j} has type {kind!r}, which this server does not serve "
                    f"(it serves {', '.join(BLOCK_TYPES)})",
                )
        return v


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(BaseModel):
    """Extended thinking: ``enabled`` (with a budget) or ``adaptive`` turn the template's
    thinking on and split the reasoning into ``thinking`` blocks; ``disabled`` turns it off.
    ``display: omitted`` sends the blocks without their text."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(BaseModel):
    """Structured outputs: the answer's text follows ``schema``."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["json_schema"]
    schema_: dict[str, BodyJson] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


# Fields that ask for what this server does not have: a 400 naming them when set.
REFUSED = {
    "container": "containers (code execution) are not supported",
    "mcp_servers": "MCP servers are not supported",
    "context_management": "context management (server-side clearing) is not supported",
}


def _refuse(v: JsonValue, info: ValidationInfo) -> JsonValue:
    if v is not None:
        why = REFUSED[info.field_name or ""]
        raise PydanticCustomError("unsupported_field", f"{why} (this server refuses the field)")
    return v


class CountTokensRequest(SamplingFields):
    """``/v1/messages/count_tokens``: a Messages body without ``max_tokens``."""

    model: str | None = None
    messages: Annotated[list[AnthropicMessage], Field(max_length=MAX_MESSAGES)]
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, BodyJson]] | None = None  # server.protocols.anthropic_mapping checks each
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    chat_template_kwargs: dict[str, BodyJson] | None = None  # llama-server's, passed to chat
    # accepted: they ask nothing of the answer
    metadata: dict[str, BodyJson] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_control: BodyJson = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = None
    # refused when set (REFUSED)
    container: BodyJson = None
    mcp_servers: BodyJson = None
    context_management: BodyJson = None

    _refused = field_validator(*REFUSED)(_refuse)

    @field_validator("stop_sequences")
    @classmethod
    def _stop_sequences(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and len(v) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        if v is not None and any(len(s) > MAX_STOP_CHARS for s in v):
            raise ValueError(f"stop sequences are at most {MAX_STOP_CHARS} characters")
        return v


class MessagesRequest(CountTokensRequest):
    """``/v1/messages``: ``max_tokens`` is required and at least 1, as Anthropic's."""

    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)]
