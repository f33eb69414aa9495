"""Settings: one field per llama-server flag, with its default; also read from LLAMA_ARG_* variables."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field


class Settings(BaseModel):
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    ctx_size: int = Field(8192, ge=0)
    parallel: int = Field(4, ge=1, le=256)
    batch_size: int = Field(2048, ge=1)
    ubatch_size: int = Field(512, ge=1)
    threads: int = -1
    threads_batch: int = -1
    n_gpu_layers: int = -1
    kv_unified: bool = True
    swa_full: bool = False
    flash_attn: str = "auto"
    slot_prompt_similarity: float = Field(0.10, ge=0.0, le=1.0)
    n_predict: int = -1
    alias: str | None = None
    chat_template: str | None = None
    chat_template_file: str | None = None
    seed: int = -1
    slots: bool = True
    cache_ram: int = Field(8192, ge=-1)
    cache_ram_tokens: int = Field(0, ge=0)
    cache_idle_slots: bool = True
    ctx_checkpoints: int = Field(32, ge=0)
    checkpoint_min_step: int = Field(8192, ge=0)
    metrics: bool = False
    prefix_share: bool = True
    prefix_share_min: int = Field(128, ge=0)
    api_key: str | None = None
    api_key_file: str | None = None
    cors_origins: str = "*"
    cors_methods: str = "*"
    cors_headers: str = "*"
    max_body_mb: float = Field(16, gt=0)
    max_queue: int = Field(256, ge=0)
    timeout: float = Field(600, gt=0)
    slot_save_path: str | None = None
    verbose: bool = False


@dataclass(frozen=True)
class Opt:
    flags: tuple[str, ...]
    dest: str
    env: str
    help: str
    kind: Any = str  # a type, or "bool" for a --x / --no-x pair
    neg: tuple[str, ...] = ()
    choices: tuple[str, ...] | None = None


OPTIONS: list[Opt] = [
    Opt(
        ("-m", "--model"),
        "model",
        "LLAMA_ARG_MODEL",
        "GGUF model path (default: the embedded Gemma 3 270M package)",
    ),
    Opt(("--host",), "host", "LLAMA_ARG_HOST", "address to listen on (default: 127.0.0.1)"),
    Opt(("--port",), "port", "LLAMA_ARG_PORT", "port to listen on (default: 8080)", int),
    Opt(
        ("-c", "--ctx-size"),
        "ctx_size",
        "LLAMA_ARG_CTX_SIZE",
        "total KV context size in tokens (default: 8192; 0 = the model's training context)",
        int,
    ),
    Opt(
        ("-np", "--parallel"),
        "parallel",
        "LLAMA_ARG_N_PARALLEL",
        "number of slots (default: 4)",
        int,
    ),
    Opt(
        ("-b", "--batch-size"),
        "batch_size",
        "LLAMA_ARG_BATCH",
        "logical batch: most tokens decoded in one step (default: 2048)",
        int,
    ),
    Opt(
        ("-ub", "--ubatch-size"),
        "ubatch_size",
        "LLAMA_ARG_UBATCH",
        "physical batch size (default: 512)",
        int,
    ),
    Opt(
        ("-t", "--threads"),
        "threads",
        "LLAMA_ARG_THREADS",
        "threads for generation (default: all cores)",
        int,
    ),
    Opt(
        ("-tb", "--threads-batch"),
        "threads_batch",
        "LLAMA_ARG_THREADS_BATCH",
        "threads for prompt processing (default: same as --threads)",
        int,
    ),
    Opt(
        ("-ngl", "--n-gpu-layers", "--gpu-layers"),
        "n_gpu_layers",
        "LLAMA_ARG_N_GPU_LAYERS",
        "layers to offload to the GPU (default: all)",
        int,
    ),
    Opt(
        ("-kvu", "--kv-unified"),
        "kv_unified",
        "LLAMA_ARG_KV_UNIFIED",
        "one KV buffer shared by all slots (default: on)",
        "bool",
        neg=("--no-kv-unified", "-no-kvu"),
    ),
    Opt(
        ("--swa-full",),
        "swa_full",
        "LLAMA_ARG_SWA_FULL",
        "full-size KV cache for sliding-window layers (default: off)",
        "bool",
    ),
    Opt(
        ("-fa", "--flash-attn"),
        "flash_attn",
        "LLAMA_ARG_FLASH_ATTN",
        "flash attention: on, off or auto (default: auto)",
        str,
        choices=("on", "off", "auto"),
    ),
    Opt(
        ("-sps", "--slot-prompt-similarity"),
        "slot_prompt_similarity",
        "LLAMA_ARG_SLOT_PROMPT_SIMILARITY",
        "how much of a prompt must match a slot's tokens to pick that slot (default: 0.10, 0 = off)",
        float,
    ),
    Opt(
        ("-n", "--n-predict"),
        "n_predict",
        "LLAMA_ARG_N_PREDICT",
        "most tokens to generate per request (default: -1, unlimited)",
        int,
    ),
    Opt(("-a", "--alias"), "alias", "LLAMA_ARG_ALIAS", "model name reported by the API"),
    Opt(
        ("--chat-template",),
        "chat_template",
        "LLAMA_ARG_CHAT_TEMPLATE",
        "built-in chat template name (chatml, gemma, llama3, mistral) or a Jinja template",
    ),
    Opt(
        ("--chat-template-file",),
        "chat_template_file",
        "LLAMA_ARG_CHAT_TEMPLATE_FILE",
        "file holding a Jinja chat template",
    ),
    Opt(
        ("-s", "--seed"),
        "seed",
        "LLAMA_ARG_SEED",
        "default sampling seed (default: -1, random)",
        int,
    ),
    Opt(
        ("--slots",),
        "slots",
        "LLAMA_ARG_ENDPOINT_SLOTS",
        "expose the /slots endpoint (default: on)",
        "bool",
        neg=("--no-slots",),
    ),
    Opt(
        ("-cram", "--cache-ram"),
        "cache_ram",
        "LLAMA_ARG_CACHE_RAM",
        "RAM prompt cache size in MiB (default: 8192, -1 = no limit, 0 = off)",
        int,
    ),
    Opt(
        ("--cache-ram-tokens",),
        "cache_ram_tokens",
        "LLAMA_ARG_CACHE_RAM_TOKENS",
        "RAM prompt cache token limit (default: the context size; raised to what the byte "
        "limit holds)",
        int,
    ),
    Opt(
        ("--cache-idle-slots",),
        "cache_idle_slots",
        "LLAMA_ARG_CACHE_IDLE_SLOTS",
        "save idle slots to the RAM cache when a task starts, and clear them in unified KV mode "
        "(default: on; needs --cache-ram)",
        "bool",
        neg=("--no-cache-idle-slots",),
    ),
    Opt(
        ("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints"),
        "ctx_checkpoints",
        "LLAMA_ARG_CTX_CHECKPOINTS",
        "most context checkpoints per slot for SWA/recurrent models (default: 32, 0 = off)",
        int,
    ),
    Opt(
        ("-cms", "--checkpoint-min-step"),
        "checkpoint_min_step",
        "LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT",
        "least spacing in tokens between mid-prompt checkpoints (default: 8192)",
        int,
    ),
    Opt(
        ("--slot-save-path",),
        "slot_save_path",
        "LLAMA_ARG_SLOT_SAVE_PATH",
        "directory for POST /slots/{id}?action=save|restore (default: off)",
    ),
    Opt(
        ("--api-key",),
        "api_key",
        "LLAMA_API_KEY",
        "API key(s), comma-separated; every endpoint but /health then needs one (default: none)",
    ),
    Opt(
        ("--api-key-file",),
        "api_key_file",
        "LLAMA_ARG_API_KEY_FILE",
        "file with API keys, one per line",
    ),
    Opt(
        ("--cors-origins",),
        "cors_origins",
        "LLAMA_ARG_CORS_ORIGINS",
        "allowed CORS origins, comma-separated (default: *)",
    ),
    Opt(
        ("--cors-methods",),
        "cors_methods",
        "LLAMA_ARG_CORS_METHODS",
        "allowed CORS methods, comma-separated (default: *)",
    ),
    Opt(
        ("--cors-headers",),
        "cors_headers",
        "LLAMA_ARG_CORS_HEADERS",
        "allowed CORS request headers, comma-separated (default: *)",
    ),
    Opt(
        ("--max-body-mb",),
        "max_body_mb",
        "LLAMA_ARG_MAX_BODY_MB",
        "largest request body in MiB; larger ones get 413 (default: 16)",
        float,
    ),
    Opt(
        ("--max-queue",),
        "max_queue",
        "LLAMA_ARG_MAX_QUEUE",
        "most requests waiting for a slot; beyond it 503 with Retry-After (default: 256)",
        int,
    ),
    Opt(
        ("-to", "--timeout"),
        "timeout",
        "LLAMA_ARG_TIMEOUT",
        'seconds a request may run before it is ended (default: 600; per request: "timeout")',
        float,
    ),
    Opt(
        ("--prefix-share",),
        "prefix_share",
        "LLAMA_ARG_PREFIX_SHARE",
        "share prompt prefixes between slots with seq_cp, also while another request is "
        "still computing them (default: on; needs unified KV)",
        "bool",
        neg=("--no-prefix-share",),
    ),
    Opt(
        ("--prefix-share-min",),
        "prefix_share_min",
        "LLAMA_ARG_PREFIX_SHARE_MIN",
        "least shared prefix (tokens) worth waiting for while another request computes it "
        "(default: 128; 0 = never wait)",
        int,
    ),
    Opt(
        ("--metrics",),
        "metrics",
        "LLAMA_ARG_ENDPOINT_METRICS",
        "expose Prometheus metrics at /metrics (default: off)",
        "bool",
    ),
    Opt(("-v", "--verbose"), "verbose", "LLAMA_ARG_VERBOSE", "debug logging", "bool"),
]

_TRUE = {"1", "true", "yes", "on", "enabled"}
_FALSE = {"0", "false", "no", "off", "disabled"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m server",
        description="OpenAI-compatible llama.cpp server with slot-level KV reuse. "
        "Every flag can also be set with the environment variable shown.",
    )
    for o in OPTIONS:
        if o.kind == "bool":
            g = p.add_mutually_exclusive_group()
            g.add_argument(
                *o.flags,
                dest=o.dest,
                action="store_true",
                default=None,
                help=f"{o.help} [env {o.env}]",
            )
            if o.neg:
                g.add_argument(
                    *o.neg,
                    dest=o.dest,
                    action="store_false",
                    default=None,
                    help=f"turn off {o.flags[-1]}",
                )
        else:
            p.add_argument(
                *o.flags,
                dest=o.dest,
                type=o.kind,
                default=None,
                choices=o.choices,
                help=f"{o.help} [env {o.env}]",
            )
    return p


def _env_value(o: Opt, raw: str) -> Any:
    if o.kind == "bool":
        v = raw.strip().lower()
        if v in _TRUE:
            return True
        if v in _FALSE:
            return False
        raise ValueError(f"{o.env}: expected a boolean, got {raw!r}")
    return raw if o.kind is str else o.kind(raw)


def parse_settings(argv: list[str] | None = None, env: dict[str, str] | None = None) -> Settings:
    """Flags win over environment variables, which win over defaults."""
    env = os.environ if env is None else env
    args = build_parser().parse_args(argv)
    values: dict[str, Any] = {}
    for o in OPTIONS:
        if o.env in env and env[o.env] != "":
            values[o.dest] = _env_value(o, env[o.env])
        cli = getattr(args, o.dest)
        if cli is not None:
            values[o.dest] = cli
    return Settings(**values)


def load_api_keys(s: Settings) -> list[str]:
    keys = [k.strip() for k in (s.api_key or "").split(",") if k.strip()]
    if s.api_key_file:
        with open(s.api_key_file, encoding="utf-8") as f:
            keys += [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    return keys
