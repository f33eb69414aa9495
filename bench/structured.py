"""Workload 10: JSON-schema-constrained generation, side by side with llama-server's
``json_schema`` (both servers take the field on /v1/completions).

Measures the constrained decode rate against the same server's unconstrained rate on the same
prompt and length, whether every answer parses and has the schema's shape, and what a first
request with a new 50-tool schema costs (its compile) over the same request again."""

from __future__ import annotations

import json
import statistics
from typing import Any

from .client import completion_payload, stream_completion

N_INTS = 40
INTS_SCHEMA: dict[str, Any] = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 999},
    "minItems": N_INTS,
    "maxItems": N_INTS,
}
PROMPT = "Here are forty numbers between 0 and 999, written as a JSON array:\n"


def tools_schema(n: int = 50) -> dict[str, Any]:
    """A 50-tool call schema: one call object per tool, each with its own parameters."""
    calls = []
    for i in range(n):
        params = {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 40},
                "limit": {"type": "integer", "minimum": 1, "maximum": 100},
                f"option_{i}": {"type": "string", "enum": ["fast", "exact", f"mode{i}"]},
            },
            "required": ["query"],
            "additionalProperties": False,
        }
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": f"tool_{i}"}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return {"anyOf": calls}


def _valid(text: str) -> bool:
    try:
        v = json.loads(text)
    except ValueError:
        return False
    return isinstance(v, list) and len(v) == N_INTS and all(isinstance(x, int) for x in v)


async def _constrained_vs_free(client: Any, url: str, reps: int) -> dict[str, float | None]:
    constrained, free, valid = [], [], 0
    for i in range(reps):
        prompt = PROMPT + f"(set {i})\n"
        c = await stream_completion(
            client, url, completion_payload(prompt, 256, ignore_eos=False, json_schema=INTS_SCHEMA)
        )
        valid += _valid(c.text)
        n = max(2, c.predicted_n)
        f = await stream_completion(client, url, completion_payload(prompt, n))
        constrained.append(c.timing("predicted_per_second") or 0.0)
        free.append(f.timing("predicted_per_second") or 0.0)
    c_tps, f_tps = statistics.median(constrained), statistics.median(free)
    return {
        "constrained_tps": c_tps,
        "free_tps": f_tps,
        "constrained_over_free": c_tps / f_tps if f_tps else None,
        "valid_share": valid / reps,
    }


async def _compile_cost(client: Any, url: str, tag: str) -> dict[str, float | None]:
    """TTFT of a first request with a new 50-tool schema, and of the same request again."""
    schema = tools_schema()
    schema["$comment"] = tag  # a schema this server has not seen yet
    body = completion_payload("Call one tool. Call: ", 48, ignore_eos=False, json_schema=schema)
    first = await stream_completion(client, url, body)
    again = await stream_completion(client, url, body)
    ms = [None if r.ttft_s is None else r.ttft_s * 1e3 for r in (first, again)]
    return {"tools50_first_ttft_ms": ms[0], "tools50_again_ttft_ms": ms[1]}


async def run_structured(client: Any, url: str, tag: str, reps: int) -> dict[str, float | None]:
    # one warm-up, so that a vocabulary set up once per process is not in the figures
    await stream_completion(
        client, url, completion_payload(PROMPT, 8, ignore_eos=False, json_schema=INTS_SCHEMA)
    )
    return {
        **await _constrained_vs_free(client, url, reps),
        **await _compile_cost(client, url, tag),
    }
