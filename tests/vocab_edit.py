"""A copy of a GGUF model whose control tokens carry other texts (test fixture).

Real models of some families (gpt-oss, Kimi, DeepSeek) have their tool and reasoning
markers as control tokens: one token each, which llama.cpp renders as empty text unless
asked for special pieces. The small test models have none of them. ``with_markers`` writes
a copy of a model in which its own control tokens (ids after the ones it needs: end of
text, turn start and end) are renamed to given markers, so the same path runs on the same
weights: the renamed tokens keep their ids, embeddings and CONTROL type.
"""

from __future__ import annotations

from pathlib import Path

import gguf

TOKENS = "tokenizer.ggml.tokens"
TYPES = "tokenizer.ggml.token_type"


def with_markers(src: str | Path, dst: str | Path, markers: list[str], first_id: int = 3) -> Path:
    """Write ``dst``: ``src`` with tokens ``first_id``, ``first_id + 1``, ... renamed to
    ``markers``. Each renamed token must already be a control token (ValueError if not)."""
    reader = gguf.GGUFReader(str(src))
    tokens = reader.fields[TOKENS].contents()
    types = reader.fields[TYPES].contents()
    for i, m in enumerate(markers, first_id):
        if types[i] != gguf.TokenType.CONTROL:
            raise ValueError(f"token {i} ({tokens[i]!r}) is not a control token")
        tokens[i] = m
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(str(dst), arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = tokens if field.name == TOKENS else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return Path(dst)
