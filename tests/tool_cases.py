"""Tool definitions from llama.cpp's own server tests (test_tool_call.py), shared by the
unit and end-to-end tests; the Responses API takes the same functions unwrapped."""

from __future__ import annotations

TEST_TOOL = {
    "type": "function",
    "function": {
        "name": "test",
        "description": "",
        "parameters": {
            "type": "object",
            "properties": {"success": {"type": "boolean", "const": True}},
            "required": ["success"],
        },
    },
}

PYTHON = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Runs code in an ipython interpreter and returns the result.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "maxLength": 30}},
            "required": ["code"],
            "additionalProperties": False,
        },
    },
}

# the Responses API's form: the function's fields beside "type", not under "function"
PYTHON_RESPONSES = {"type": "function", **PYTHON["function"]}
