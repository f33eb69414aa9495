"""ggml's tensor data types as llama-server names its KV cache types (``-ctk``/``-ctv``).

Pure data: this module imports nothing (not llama_cpp, nothing of ``server``), so the layers
that must not load llama.cpp (``server.tiers``, ``server.kv``, the engine) and the CLI's flag table
may read it. The ids are ggml.h's ``enum ggml_type``; they are stored in slot files (SKVT)
and compared with what a saved state holds, so they never change for a name.
"""

from __future__ import annotations

# the names llama-server accepts for -ctk / -ctv, in its help text's order
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")

# their ggml type ids (ggml.h's enum ggml_type)
CACHE_TYPE_IDS: dict[str, int] = {
    "f32": 0,
    "f16": 1,
    "bf16": 30,
    "q8_0": 8,
    "q4_0": 2,
    "q4_1": 3,
    "iq4_nl": 20,
    "q5_0": 6,
    "q5_1": 7,
}

# the quantized ones (a quantized V cache needs flash attention)
QUANTIZED = frozenset(k for k in CACHE_TYPE_IDS if k not in ("f32", "f16", "bf16"))


def cache_type_name(type_id: int) -> str:
    """A ggml type id as llama-server spells the cache type (``type 12`` for another)."""
    return next((k for k, v in CACHE_TYPE_IDS.items() if v == type_id), f"type {type_id}")
