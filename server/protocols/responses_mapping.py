"""The OpenAI Responses API mapped onto chat, as llama-server maps it: a Responses body
becomes a chat body (``to_chat_body``, after llama-server's
server_chat_convert_responses_to_chatcmpl), and a parsed chat answer becomes Responses
output items (``output_items``) and the ``response`` object. Stateless: nothing is stored,
so ``previous_response_id`` and friends are refused (server.schemas.bodies.UNSUPPORTED)."""

from __future__ import annotations

import time
import uuid

from ..cancel import checkpoint
from ..json_value import JsonObject, JsonValue
from ..templates.output_parse import Message, ToolCall


class ResponsesInputError(ValueError):
    """The body cannot be mapped onto chat (a 400 with llama-server's message)."""


def new_id(prefix: str) -> str:
    """``resp_``/``msg_``/``rs_`` ids with 32 random characters, as llama-server's."""
    return prefix + uuid.uuid4().hex


def _is_str(item: JsonObject, key: str) -> bool:
    return isinstance(item.get(key), str)


def _is_list(item: JsonObject, key: str) -> bool:
    return isinstance(item.get(key), list)


def _input_parts(content: list[JsonValue]) -> list[JsonValue]:
    """A user/system/developer message's parts as chat content parts."""
    parts: list[JsonValue] = []
    for item in content:
        p = item if isinstance(item, dict) else {}
        kind = p.get("type", "")
        if kind == "input_text":
            if "text" not in p:
                raise ResponsesInputError("'Input text' requires 'text'")
            parts.append({"type": "text", "text": p["text"]})
        elif kind == "input_image":
            if "image_url" not in p:
                raise ResponsesInputError("'image_url' is required")
            parts.append({"type": "image_url", "image_url": {"url": p["image_url"]}})
        elif kind == "input_file":
            raise ResponsesInputError("'input_file' is not supported by llamacpp at this moment")
        else:
            raise ResponsesInputError(
                "'type' must be one of 'input_text', 'input_image', or 'input_file'"
            )
    return parts


def _output_parts(item: JsonObject) -> list[JsonValue]:
    """An assistant message item's content (a string, or output_text/refusal parts) as chat
    text parts; a refusal is kept as text (chat content here is text only)."""
    content = item.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    parts: list[JsonValue] = []
    for p in content if isinstance(content, list) else []:
        p = p if isinstance(p, dict) else {}  # no "type": refused below
        kind = p.get("type", "")
        if kind in ("output_text", "input_text"):
            if not _is_str(p, "text"):
                raise ResponsesInputError("'Output text' requires 'text'")
            parts.append({"type": "text", "text": p["text"]})
        elif kind == "refusal":
            if not _is_str(p, "refusal"):
                raise ResponsesInputError("'Refusal' requires 'refusal'")
            parts.append({"type": "text", "text": p["refusal"]})
        else:
            raise ResponsesInputError("'type' must be one of 'output_text' or 'refusal'")
    return parts


def _assistant(messages: list[JsonObject]) -> JsonObject | None:
    """The previous message when it is the assistant's: later items merge into it."""
    if messages and messages[-1].get("role") == "assistant":
        return messages[-1]
    return None


def _tool_output(item: JsonObject) -> JsonObject:
    """A function_call_output item as a ``tool`` message."""
    out = item["output"]
    if isinstance(out, list):
        parts: list[JsonValue] = []
        for p in out:
            if not isinstance(p, dict) or "type" not in p:
                raise ResponsesInputError("Output of tool call missing 'type' field")
            if p["type"] == "input_text":
                parts.append({"type": "text", "text": p.get("text")})
            elif p["type"] == "input_image":
                if "image_url" not in p:
                    raise ResponsesInputError("'image_url' is required")
                parts.append({"type": "image_url", "image_url": {"url": p["image_url"]}})
            else:
                raise ResponsesInputError(
                    "Output of tool call should be 'Input text' or 'Input image'"
                )
        out = parts
    return {"role": "tool", "content": out, "tool_call_id": item["call_id"]}


def _add_function_call(
    messages: list[JsonObject], prev: JsonObject | None, item: JsonObject
) -> None:
    """A function_call item as a tool call on the last assistant message (or a new one)."""
    call = {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }
    if prev is not None:
        # a list unless the client's own assistant item set it otherwise (then a 400)
        calls = prev.setdefault("tool_calls", [])
        if not isinstance(calls, list):
            raise ResponsesInputError("an assistant item's 'tool_calls' must be a list")
        calls.append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _add_item(messages: list[JsonObject], item: JsonValue) -> None:
    """One input item appended to (or merged into the last of) the chat messages."""
    if not isinstance(item, dict):
        raise ResponsesInputError("Cannot determine type of 'item'")
    item = dict(item)
    prev = _assistant(messages)
    role, kind = item.get("role"), item.get("type")
    if isinstance(item.get("content"), str):
        item["content"] = [{"type": "input_text", "text": item["content"]}]
    if _is_list(item, "content") and role in ("user", "system", "developer"):
        msg = {k: v for k, v in item.items() if k not in ("type", "status")}
        content = item["content"]
        assert isinstance(content, list)  # _is_list above
        messages.append({**msg, "content": _input_parts(content)})
    elif role == "assistant" and kind in (None, "message"):  # llama-server: "message" only
        parts = _output_parts(item)
        if prev is not None:
            content = prev.get("content")
            if not isinstance(content, list):
                content = prev["content"] = []
            content.extend(parts)
        else:
            msg = {k: v for k, v in item.items() if k not in ("type", "status")}
            messages.append({**msg, "content": parts})
    elif kind == "function_call" and all(
        _is_str(item, k) for k in ("arguments", "call_id", "name")
    ):
        _add_function_call(messages, prev, item)
    elif kind == "function_call_output" and _is_str(item, "call_id") and "output" in item:
        if not isinstance(item["output"], str | list):
            raise ResponsesInputError("Cannot determine type of 'item'")
        messages.append(_tool_output(item))
    elif kind == "reasoning" and _is_list(item, "summary"):
        content = item.get("content")
        if not isinstance(content, list):
            raise ResponsesInputError("item['content'] is not an array")
        if not content:
            raise ResponsesInputError("item['content'] is empty")
        if not isinstance(content[0], dict) or not _is_str(content[0], "text"):
            raise ResponsesInputError("item['content']['text'] is not a string")
        if prev is not None:
            prev["reasoning_content"] = content[0]["text"]
        else:
            messages.append(
                {"role": "assistant", "content": [], "reasoning_content": content[0]["text"]}
            )
    else:
        raise ResponsesInputError("Cannot determine type of 'item'")


def _tools(tools: JsonValue) -> list[JsonObject]:
    """Function tools in chat's shape; other tool types (web search, ...) are skipped, as
    llama-server skips them."""
    if not isinstance(tools, list):
        raise ResponsesInputError("'tools' must be an array of objects")
    out: list[JsonObject] = []
    for t in tools:
        if not isinstance(t, dict) or t.get("type") != "function":
            continue
        fn = {k: v for k, v in t.items() if k != "type"}
        fn.setdefault("strict", True)
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: JsonValue) -> JsonValue:
    """Responses' ``{"type": "function", "name": ...}`` as chat's named tool choice."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def to_chat_body(body: JsonObject) -> JsonObject:
    """The chat body of a Responses body: ``instructions`` as a system message, then
    ``input`` (text, or message / function call / call output / reasoning items),
    ``max_output_tokens`` as ``max_tokens``, function ``tools``, ``reasoning.effort``.
    Other fields pass through (sampling, chat_template_kwargs, ...)."""
    if "input" not in body:
        raise ResponsesInputError("'input' is required")
    chat = {k: v for k, v in body.items() if k not in ("input", "instructions", "n")}
    messages: list[JsonObject] = []
    if "instructions" in body:
        messages.append({"role": "system", "content": body["instructions"] or ""})
    value = body["input"]
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    elif isinstance(value, list):
        for item in value:
            checkpoint()  # the client may have left: stop between items
            _add_item(messages, item)
    else:
        raise ResponsesInputError("'input' must be a string or array of objects")
    chat["messages"] = [*messages]
    if "tools" in body:
        tools = _tools(body["tools"]) if body["tools"] is not None else []
        chat.pop("tools")
        if tools:
            chat["tools"] = [*tools]
    if "tool_choice" in body:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if "max_output_tokens" in body:
        chat["max_tokens"] = chat.pop("max_output_tokens")
    reasoning = chat.pop("reasoning", None)
    if isinstance(reasoning, dict) and "effort" in reasoning:
        chat["reasoning_effort"] = reasoning["effort"]
    return chat


# ---- output ------------------------------------------------------------------------------


def call_item(c: ToolCall, status: str = "completed") -> JsonObject:
    """A function_call output item: ``call_id`` is the chat call's id, ``id`` its fc_ twin."""
    return {
        "id": "fc_" + c.id.removeprefix("call_"),
        "type": "function_call",
        "status": status,
        "arguments": c.arguments,
        "call_id": c.id,
        "name": c.name,
    }


def reasoning_item(item_id: str, text: str) -> JsonObject:
    return {
        "id": item_id,
        "summary": [],
        "type": "reasoning",
        "content": [{"text": text, "type": "reasoning_text"}],
        "encrypted_content": "",
        "status": "completed",
    }


def text_part(text: str) -> JsonObject:
    return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}


def message_item(item_id: str, text: str) -> JsonObject:
    return {
        "id": item_id,
        "type": "message",
        "status": "completed",
        "role": "assistant",
        "content": [text_part(text)],
    }


def output_items(m: Message, msg_id: str, rs_id: str) -> list[JsonObject]:
    """A whole answer's output: reasoning, then the message, then each tool call (items
    that would be empty are left out)."""
    out = []
    if m.reasoning:
        out.append(reasoning_item(rs_id, m.reasoning))
    if m.content:
        out.append(message_item(msg_id, m.content))
    out.extend(call_item(c) for c in m.tool_calls)
    return out


def usage(n_prompt: int, n_output: int, n_cached: int) -> JsonObject:
    return {
        "input_tokens": n_prompt,
        "output_tokens": n_output,
        "total_tokens": n_prompt + n_output,
        "input_tokens_details": {"cached_tokens": n_cached},
    }


def response_object(
    resp_id: str, model: str, output: list[JsonObject], use: JsonObject
) -> JsonObject:
    """The completed ``response`` object."""
    t = int(time.time())
    return {
        "id": resp_id,
        "object": "response",
        "created_at": t,
        "completed_at": t,
        "status": "completed",
        "model": model,
        "output": [*output],
        "usage": use,
    }
