"""The command line's tables: llama-server's flags, with its names, aliases and ``LLAMA_ARG_*``
variables (those of llama-cpp-python 0.3.36's vendored ``tools/server/README.md``).

``OPTIONS`` are the flags this server implements: each is a ``Settings`` field.
``COMPAT`` are the rest of llama-server's flags, accepted so that a llama-server command line
starts this server unchanged, and ignored: their values are still checked (a malformed one is an
error), and ``server.settings.config.ignored_flags`` names the given ones that would change what
llama-server does, for one warning at start-up. A flag moves from ``COMPAT`` to ``OPTIONS``
when it is implemented."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from ..json_value import JsonObject, JsonValue
from ..llama.ggml_types import CACHE_TYPES


def n_gpu_layers(text: str) -> int:
    """``-ngl``: a layer count, or llama-server's ``auto`` / ``all`` (-1: every layer)."""
    if text.strip().lower() in ("auto", "all"):
        return -1
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number, 'auto' or 'all', got {text!r}"
        ) from None


# how a flag's text becomes its value: a type or converter, or one of the names below
# ("bool", SWITCH, BOOL, INT_PAIR) for the flags argparse handles itself
Converter = Callable[[str], object]
FlagKind = Converter | str


@dataclass(frozen=True)
class Opt:
    """An implemented flag: ``dest`` is its ``Settings`` field."""

    flags: tuple[str, ...]
    dest: str
    env: str
    help: str
    kind: FlagKind = (
        str  # a type or converter, or "bool": a switch, or a --x / --no-x pair with neg
    )
    neg: tuple[str, ...] = ()
    choices: tuple[str, ...] | None = None
    repeat: bool = False  # may be given several times: the values are collected in order


def json_object(text: str) -> JsonObject:
    """A JSON object (``--chat-template-kwargs``, ``--ui-config``, ``--mcp-servers-json``)."""
    try:
        v = json.loads(text)
    except json.JSONDecodeError:
        raise _err("a JSON object", text) from None
    if not isinstance(v, dict):
        raise _err("a JSON object", text)
    return v


SPEC_TYPES = [
    "none",
    "draft-simple",
    "draft-eagle3",
    "draft-mtp",
    "draft-dflash",
    "draft-dspark",
    "ngram-simple",
    "ngram-map-k",
    "ngram-map-k4v",
    "ngram-mod",
    "ngram-cache",
]


def spec_types(text: str) -> list[str]:
    """``--spec-type``: comma-separated speculative decoding types (llama-server's names;
    ``server.http.app`` refuses those this server does not implement)."""
    items = _items(text, "speculative decoding types")
    if any(x not in SPEC_TYPES for x in items):
        raise _err("types among " + ",".join(SPEC_TYPES), text)
    return items


def _o(
    flags: str,
    dest: str,
    env: str,
    help: str,
    kind: FlagKind = str,
    *,
    neg: str = "",
    choices: tuple[str, ...] | None = None,
    repeat: bool = False,
) -> Opt:
    return Opt(tuple(flags.split()), dest, env, help, kind, tuple(neg.split()), choices, repeat)


# fmt: off
OPTIONS: list[Opt] = [
    # --- model and context ---
    _o("-m --model", "model", "LLAMA_ARG_MODEL", "GGUF model path (default: the embedded Gemma 3 270M package)"),
    _o("-c --ctx-size", "ctx_size", "LLAMA_ARG_CTX_SIZE", "total KV context size in tokens (default: 8192; 0 = the model's training context)", int),
    _o("-np --parallel", "parallel", "LLAMA_ARG_N_PARALLEL", "number of slots (default: 4; -1 = auto = 4)", int),
    _o("-b --batch-size", "batch_size", "LLAMA_ARG_BATCH", "logical batch: most tokens decoded in one step (default: 2048)", int),
    _o("-ub --ubatch-size", "ubatch_size", "LLAMA_ARG_UBATCH", "physical batch size (default: 512)", int),
    _o("-t --threads", "threads", "LLAMA_ARG_THREADS", "threads for generation (default: all cores)", int),
    _o("-tb --threads-batch", "threads_batch", "LLAMA_ARG_THREADS_BATCH", "threads for prompt processing (default: same as --threads)", int),
    _o("-ngl --gpu-layers --n-gpu-layers", "n_gpu_layers", "LLAMA_ARG_N_GPU_LAYERS", "layers to offload to the GPU: a number, auto or all (default: all)", n_gpu_layers),
    _o("--kv-unified-per-slot", "kv_unified_per_slot", "LLAMA_ARG_KV_UNIFIED_PER_SLOT", "context limit per slot; without -c the KV pool is sized to --parallel * N (default: 0, unset)", int),
    _o("-kvu --kv-unified", "kv_unified", "LLAMA_ARG_KV_UNIFIED", "one KV buffer shared by all slots (default: on)", "bool", neg="-no-kvu --no-kv-unified"),
    _o("--swa-full", "swa_full", "LLAMA_ARG_SWA_FULL", "full-size KV cache for sliding-window layers (default: off)", "bool"),
    _o("-fa --flash-attn", "flash_attn", "LLAMA_ARG_FLASH_ATTN", "flash attention: on, off or auto (default: auto)", choices=("on", "off", "auto")),
    _o("-bs --backend-sampling", "backend_sampling", "LLAMA_ARG_BACKEND_SAMPLING", "run each slot's sampler chain in the decode graph, on the device, when every stage can; grammar, penalties and logprobs sample on the CPU (default: off)", "bool"),
    _o("--sample-threads", "sample_threads", "LLAMA_ARG_SAMPLE_THREADS", "threads sampling the CPU-sampled slots of one step concurrently (default: -1 = auto: on with more than 2 cores; 0 = off)", int),
    # --- scheduling and caches ---
    _o("-sps --slot-prompt-similarity", "slot_prompt_similarity", "LLAMA_ARG_SLOT_PROMPT_SIMILARITY", "how much of a prompt must match a slot's tokens to pick that slot (default: 0.10, 0 = off)", float),
    _o("--step-target-ms", "step_target_ms", "LLAMA_ARG_STEP_TARGET_MS", "while slots generate, cut a step's prompt tokens (at most one ubatch) to what fits in this many ms by the measured step speed, so a long prompt stalls other streams no longer (default: 500, 0 = one ubatch)", float),
    _o("--scheduling-policy", "scheduling_policy", "LLAMA_ARG_SCHEDULING_POLICY", "fcfs: requests in arrival order; priority: by the request's priority field (vLLM's: lower first, ties by arrival), a waiting request preempting a running one of a worse priority into the RAM cache (default: fcfs)", choices=("fcfs", "priority")),
    _o("--priority-aging-seconds", "priority_aging_seconds", "LLAMA_ARG_PRIORITY_AGING_SECONDS", "--scheduling-policy priority: a waiting request's priority improves by one per this many seconds waited, so none starves (default: 10; 0 = no aging)", float),
    _o("-cram --cache-ram", "cache_ram", "LLAMA_ARG_CACHE_RAM", "RAM prompt cache size in MiB (default: 8192, -1 = no limit, 0 = off)", int),
    _o("--cache-ram-tokens", "cache_ram_tokens", "LLAMA_ARG_CACHE_RAM_TOKENS", "RAM prompt cache token limit (default: the context size; raised to what the byte limit holds)", int),
    _o("--cache-disk", "cache_disk", "LLAMA_ARG_CACHE_DISK", "directory for the disk tier under the RAM cache: entries evicted from RAM, and idle slots at shutdown, are kept there; replicas may share it (default: off; needs --cache-ram)"),
    _o("--cache-disk-mib", "cache_disk_mib", "LLAMA_ARG_CACHE_DISK_MIB", "disk tier size in MiB, oldest entries out first (default: 16384, 0 = off)", int),
    _o("--cache-idle-slots", "cache_idle_slots", "LLAMA_ARG_CACHE_IDLE_SLOTS", "save idle slots to the RAM cache when a task starts, and clear them in unified KV mode (default: on; needs --cache-ram)", "bool", neg="--no-cache-idle-slots"),
    _o("-ctxcp --ctx-checkpoints --swa-checkpoints", "ctx_checkpoints", "LLAMA_ARG_CTX_CHECKPOINTS", "most context checkpoints per slot for SWA/recurrent models (default: 32, 0 = off)", int),
    _o("-cms --checkpoint-min-step", "checkpoint_min_step", "LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT", "least spacing in tokens between mid-prompt checkpoints (default: 8192)", int),
    _o("--prefix-share", "prefix_share", "LLAMA_ARG_PREFIX_SHARE", "share prompt prefixes between slots with seq_cp, also while another request is still computing them (default: on; needs unified KV)", "bool", neg="--no-prefix-share"),
    _o("--prefix-share-min", "prefix_share_min", "LLAMA_ARG_PREFIX_SHARE_MIN", "least shared prefix (tokens) worth waiting for while another request computes it (default: 128; 0 = never wait)", int),
    _o("--slot-save-path", "slot_save_path", "LLAMA_ARG_SLOT_SAVE_PATH", "directory for POST /slots/{id}?action=save|restore (default: off)"),
    _o("--cache-isolation", "cache_isolation", "LLAMA_ARG_CACHE_ISOLATION", "keep cached prompts apart: none, per API key, or per cache salt (default: none)", choices=("none", "key", "salt")),
    _o("--kv-events-endpoint", "kv_events_endpoint", "LLAMA_ARG_KV_EVENTS_ENDPOINT", "publish KV-cache events (vLLM's ZMQ wire format, for llm-d's precise prefix-cache scorer) on this ZMQ bind address, e.g. tcp://127.0.0.1:5557; a bare port binds the loopback; another interface needs --kv-events-allow-remote (default: off)"),
    _o("--kv-events-allow-remote", "kv_events_allow_remote", "LLAMA_ARG_KV_EVENTS_ALLOW_REMOTE", "allow --kv-events-endpoint to bind beyond the loopback (tcp://*:5557): anyone who reaches it reads the events, unauthenticated (default: off)", "bool"),
    _o("--kv-events-token-ids", "kv_events_token_ids", "LLAMA_ARG_KV_EVENTS_TOKEN_IDS", "publish the token ids of every block, also under --api-key or --cache-isolation, where they are withheld by default (block hashes only) (default: off)", "bool"),
    _o("--kv-events-topic", "kv_events_topic", "LLAMA_ARG_KV_EVENTS_TOPIC", "topic of the KV-cache events (default: kv@<hostname>@<model alias>)"),
    _o("--kv-block-size", "kv_block_size", "LLAMA_ARG_KV_BLOCK_SIZE", "tokens per KV-cache block in the events and in vllm:cache_config_info; llm-d's indexer takes the same blockSize (default: 16)", int),
    # --- speculative decoding ---
    _o("--spec-type", "spec_type", "LLAMA_ARG_SPEC_TYPE", "speculative decoding: none, ngram-simple (drafts from n-grams already in the context) or draft-simple (a draft model, -md); llama-server's other types are refused (default: none)", spec_types),
    _o("-md --model-draft --spec-draft-model", "spec_draft_model", "LLAMA_ARG_SPEC_DRAFT_MODEL", "draft model for --spec-type draft-simple (default: none; the main model when only --spec-type draft-simple is given)"),
    _o("--spec-draft-n-max", "spec_draft_n_max", "LLAMA_ARG_SPEC_DRAFT_N_MAX", "most tokens the draft model drafts per step (default: 3)", int),
    _o("--spec-draft-n-min", "spec_draft_n_min", "LLAMA_ARG_SPEC_DRAFT_N_MIN", "least draft tokens worth verifying (default: 0)", int),
    _o("--spec-draft-p-min --draft-p-min", "spec_draft_p_min", "LLAMA_ARG_SPEC_DRAFT_P_MIN", "stop drafting when the draft model's top token is less likely than this (default: 0.00)", float),
    _o("-ngld --spec-draft-ngl --gpu-layers-draft --n-gpu-layers-draft", "n_gpu_layers_draft", "LLAMA_ARG_N_GPU_LAYERS_DRAFT", "draft model layers to offload: a number, auto or all (default: all)", n_gpu_layers),
    _o("--spec-ngram-simple-size-n", "spec_ngram_simple_size_n", "", "ngram-simple: length of the n-gram looked up in the context (default: 12)", int),
    _o("--spec-draft-threads -td --threads-draft", "threads_draft", "", "draft model threads for generation (default: same as --threads)", int),
    _o("--spec-draft-threads-batch -tbd --threads-batch-draft", "threads_batch_draft", "", "draft model threads for batches (default: same as --threads-batch)", int),
    _o("--spec-draft-cpu-moe -cmoed --cpu-moe-draft", "cpu_moe_draft", "LLAMA_ARG_SPEC_DRAFT_CPU_MOE", "keep all of the draft model's MoE weights in the CPU", "bool"),
    _o("--spec-ngram-simple-size-m", "spec_ngram_simple_size_m", "", "ngram-simple: most tokens drafted after a match (default: 48)", int),
    _o("--spec-ngram-simple-min-hits", "spec_ngram_simple_min_hits", "", "ngram-simple: accepted for llama-server's command line; its ngram-simple ignores it too (default: 1)", int),
    # --- default sampling: what a request gets for a field it leaves out ---
    _o("-n --predict --n-predict", "n_predict", "LLAMA_ARG_N_PREDICT", "most tokens to generate per request (default: -1, unlimited)", int),
    _o("-s --seed", "seed", "LLAMA_ARG_SEED", "default sampling seed (default: -1, random)", int),
    _o("--temp --temperature", "temperature", "LLAMA_ARG_TEMPERATURE", "default temperature (default: 0.80)", float),
    _o("--top-k", "top_k", "LLAMA_ARG_TOP_K", "default top-k (default: 40, 0 = off)", int),
    _o("--top-p", "top_p", "LLAMA_ARG_TOP_P", "default top-p (default: 0.95, 1.0 = off)", float),
    _o("--min-p", "min_p", "LLAMA_ARG_MIN_P", "default min-p (default: 0.05, 0.0 = off)", float),
    _o("--repeat-last-n", "repeat_last_n", "LLAMA_ARG_REPEAT_LAST_N", "default penalty window in tokens (default: 64, 0 = off, -1 = context)", int),
    _o("--repeat-penalty", "repeat_penalty", "LLAMA_ARG_REPEAT_PENALTY", "default repeat penalty (default: 1.00, 1.0 = off)", float),
    _o("--presence-penalty", "presence_penalty", "LLAMA_ARG_PRESENCE_PENALTY", "default presence penalty (default: 0.00)", float),
    _o("--frequency-penalty", "frequency_penalty", "LLAMA_ARG_FREQUENCY_PENALTY", "default frequency penalty (default: 0.00)", float),
    _o("--samplers", "samplers", "", "default sampler order, names separated by ';' (default: penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature)"),
    _o("--sampler-seq --sampling-seq", "sampler_seq", "", "default sampler order as letters, over --samplers (default: edskypmxt)"),
    _o("--top-nsigma --top-n-sigma", "top_n_sigma", "", "default top-n-sigma (default: -1.0, off)", float),
    _o("--xtc-probability", "xtc_probability", "", "default XTC probability (default: 0.0, off)", float),
    _o("--xtc-threshold", "xtc_threshold", "", "default XTC threshold (default: 0.1; > 0.5: off)", float),
    _o("--typical --typical-p", "typical_p", "", "default locally typical p (default: 1.0, off)", float),
    _o("--dry-multiplier", "dry_multiplier", "", "default DRY multiplier (default: 0.0, off)", float),
    _o("--dry-base", "dry_base", "", "default DRY base (default: 1.75)", float),
    _o("--dry-allowed-length", "dry_allowed_length", "", "default DRY allowed length (default: 2)", int),
    _o("--dry-penalty-last-n", "dry_penalty_last_n", "", "default DRY window (default: 64, 0 = off, -1 = context)", int),
    _o("--dry-sequence-breaker", "dry_sequence_breakers", "", "a DRY sequence breaker, replacing the defaults ('\\n', ':', '\"', '*'); repeatable; 'none': no breakers", repeat=True),
    _o("--adaptive-target", "adaptive_target", "", "default adaptive-p target (default: -1.0, off)", float),
    _o("--adaptive-decay", "adaptive_decay", "", "default adaptive-p decay (default: 0.90)", float),
    _o("--dynatemp-range", "dynatemp_range", "", "default dynamic temperature range (default: 0.0, off)", float),
    _o("--dynatemp-exp", "dynatemp_exponent", "", "default dynamic temperature exponent (default: 1.0)", float),
    _o("--mirostat", "mirostat", "", "default Mirostat (default: 0 = off, 1 = Mirostat, 2 = Mirostat 2.0)", int),
    _o("--mirostat-lr", "mirostat_eta", "", "default Mirostat learning rate, eta (default: 0.10)", float),
    _o("--mirostat-ent", "mirostat_tau", "", "default Mirostat target entropy, tau (default: 5.00)", float),
    # --- embeddings and reranking (server.protocols.embedding_shapes) ---
    _o("--spm-infill", "spm_infill", "", "POST /infill: suffix/prefix/middle order instead of prefix/suffix/middle, for models trained so (default: off)", "bool"),
    _o("--embedding --embeddings", "embedding", "LLAMA_ARG_EMBEDDINGS", "serve POST /embedding(s) and /v1/embeddings (generation keeps working) (default: off)", "bool"),
    _o("--rerank --reranking", "reranking", "LLAMA_ARG_RERANKING", "serve POST /rerank (/v1/rerank): --embedding with --pooling rank, for reranker models (default: off)", "bool"),
    _o("--pooling", "pooling", "LLAMA_ARG_POOLING", "pooling for embeddings: none, mean, cls, last or rank (default: the model's own)", choices=("none", "mean", "cls", "last", "rank")),
    _o("--embd-normalize", "embd_normalize", "", "default embd_normalize of embedding requests: -1 none, 0 max absolute (int16 range), 1 taxicab, 2 Euclidean, >2 p-norm (default: 2)", int),
    _o("--keep", "keep", "LLAMA_ARG_KEEP", "default n_keep: prompt tokens kept by a context shift (default: 0, -1 = all)", int),
    # --- chat ---
    _o("-a --alias", "alias", "LLAMA_ARG_ALIAS", "model name(s) reported by the API, comma-separated: the first in sorted order is the id, all are listed as aliases"),
    _o("--tags", "tags", "LLAMA_ARG_TAGS", "comma-separated tags listed with the model by /v1/models (informational)"),
    _o("--jinja", "jinja", "LLAMA_ARG_JINJA", "render chat with the model's Jinja template (default: on); --no-jinja: the built-in template that matches it", "bool", neg="--no-jinja"),
    _o("--chat-template", "chat_template", "LLAMA_ARG_CHAT_TEMPLATE", "built-in chat template name (chatml, gemma, llama3, mistral, command-r) or a Jinja template"),
    _o("--chat-template-file", "chat_template_file", "LLAMA_ARG_CHAT_TEMPLATE_FILE", "file holding a Jinja chat template"),
    _o("--warmup", "warmup", "", "run an empty decode at start, so the first request does not pay for the first-use costs (default: on)", "bool", neg="--no-warmup"),
    _o("--chat-template-kwargs", "chat_template_kwargs", "LLAMA_ARG_CHAT_TEMPLATE_KWARGS", "JSON object of extra chat template variables, under each request's own (e.g. '{\"enable_thinking\": false}')", json_object),
    _o("--reasoning-format", "reasoning_format", "LLAMA_ARG_THINK", "split <think> reasoning into reasoning_content: none, deepseek, deepseek-legacy (= deepseek here) or auto (default: auto)", choices=("none", "deepseek", "deepseek-legacy", "auto")),
    _o("-rea --reasoning", "reasoning", "LLAMA_ARG_REASONING", "thinking in templates that have it: on, off or auto (default: auto, the template's own default)", choices=("on", "off", "auto")),
    _o("--prefill-assistant", "prefill_assistant", "LLAMA_ARG_PREFILL_ASSISTANT", "continue a final assistant message (prefill) instead of answering after it (default: on)", "bool", neg="--no-prefill-assistant"),
    _o("--reasoning-effort", "reasoning_effort", "LLAMA_ARG_REASONING_EFFORT", "default reasoning_effort passed to the template (default: none)"),
    _o("--reasoning-budget", "reasoning_budget", "LLAMA_ARG_THINK_BUDGET", "tokens the model may think before the end of its reasoning is forced: -1 unlimited, 0 ends it at once (default: -1)", int),
    _o("--reasoning-budget-message", "reasoning_budget_message", "LLAMA_ARG_THINK_BUDGET_MESSAGE", "text written before the forced end of reasoning (default: none)"),
    # --- HTTP ---
    _o("--host", "host", "LLAMA_ARG_HOST", "address(es) to listen on, comma-separated (default: 127.0.0.1)"),
    _o("--port", "port", "LLAMA_ARG_PORT", "port to listen on (default: 8080)", int),
    _o("--reuse-port", "reuse_port", "LLAMA_ARG_REUSE_PORT", "SO_REUSEPORT: several servers may bind the same port (default: off)", "bool"),
    _o("--api-prefix", "api_prefix", "LLAMA_ARG_API_PREFIX", "serve every route under this path prefix, e.g. /llm (default: none)"),
    _o("--sse-ping-interval", "sse_ping_interval", "LLAMA_ARG_SSE_PING_INTERVAL", "seconds of silence in a stream before an SSE comment ping (default: 30; <= 0 disables)", float),
    # resumable streams (X-Conversation-Id; llama-server's are constants: 300 s, 4 MiB)
    _o("--stream-ttl", "stream_ttl", "LLAMA_ARG_STREAM_TTL", "seconds a resumable stream (X-Conversation-Id) is kept with nobody reading it; one still generating is then stopped (default: 300)", float),
    _o("--stream-max-bytes", "stream_max_bytes", "LLAMA_ARG_STREAM_MAX_BYTES", "replay buffer of one resumable stream, bytes; the oldest events go first (default: 4194304)", int),
    _o("--stream-max-events", "stream_max_events", "LLAMA_ARG_STREAM_MAX_EVENTS", "replay buffer of one resumable stream, events (default: 32768)", int),
    _o("--streams-max", "streams_max", "LLAMA_ARG_STREAMS_MAX", "resumable streams kept in all; 0 turns them off (X-Conversation-Id ignored) (default: 64)", int),
    _o("--streams-per-key", "streams_per_key", "LLAMA_ARG_STREAMS_PER_KEY", "resumable streams kept per API key (default: 16)", int),
    _o("--slots", "slots", "LLAMA_ARG_ENDPOINT_SLOTS", "expose the /slots endpoint (default: on)", "bool", neg="--no-slots"),
    _o("--metrics", "metrics", "LLAMA_ARG_ENDPOINT_METRICS", "expose Prometheus metrics at /metrics (default: off)", "bool"),
    _o("--props", "props", "LLAMA_ARG_ENDPOINT_PROPS", "allow changing global properties with POST /props (default: off)", "bool"),
    _o("--api-key", "api_key", "LLAMA_API_KEY", "API key(s), comma-separated; every endpoint but /health then needs one (default: none)"),
    _o("--api-key-file", "api_key_file", "LLAMA_ARG_API_KEY_FILE", "file with API keys, one per line"),
    _o("--allowed-hosts", "allowed_hosts", "LLAMA_ARG_ALLOWED_HOSTS", "Host header names accepted, comma-separated (default: any)"),
    _o("--cors-origins", "cors_origins", "LLAMA_ARG_CORS_ORIGINS", "allowed CORS origins, comma-separated; 'localhost': any local page; a request from another Origin gets 403 (default: *, or localhost with --tools/--mcp-servers-*/--agent)"),
    _o("--cors-methods", "cors_methods", "LLAMA_ARG_CORS_METHODS", "Access-Control-Allow-Methods of preflight answers (default: GET, POST, DELETE, OPTIONS)"),
    _o("--cors-headers", "cors_headers", "LLAMA_ARG_CORS_HEADERS", "Access-Control-Allow-Headers of preflight answers (default: *)"),
    _o("--cors-credentials", "cors_credentials", "LLAMA_ARG_CORS_CREDENTIALS", "preflights allow credentials; with --cors-origins * the Origin is echoed back (default: on)", "bool", neg="--no-cors-credentials"),
    _o("--ui --webui", "webui", "LLAMA_ARG_UI", "serve the chat page at / (default: on)", "bool", neg="--no-ui --no-webui"),
    _o("--ui-mcp-proxy --webui-mcp-proxy", "ui_mcp_proxy", "LLAMA_ARG_UI_MCP_PROXY", "GET/POST /cors-proxy?url=...: forward a request to any http(s) URL, with only the x-llama-server-proxy-header-* headers; do not enable in untrusted environments (default: off)", "bool", neg="--no-ui-mcp-proxy --no-webui-mcp-proxy"),
    _o("--ui-mcp-proxy-timeout", "ui_mcp_proxy_timeout", "LLAMA_ARG_UI_MCP_PROXY_TIMEOUT", "seconds the CORS proxy waits to connect to its target and for each read from it; then 504 (default: 30)", float),
    _o("--ssl-key-file", "ssl_key_file", "LLAMA_ARG_SSL_KEY_FILE", "PEM private key: serve HTTPS (with --ssl-cert-file)"),
    _o("--ssl-cert-file", "ssl_cert_file", "LLAMA_ARG_SSL_CERT_FILE", "PEM certificate: serve HTTPS (with --ssl-key-file)"),
    _o("--max-body-mb", "max_body_mb", "LLAMA_ARG_MAX_BODY_MB", "largest request body in MiB; larger ones get 413 (default: 16)", float),
    _o("--max-queue", "max_queue", "LLAMA_ARG_MAX_QUEUE", "most requests waiting for a slot; beyond it 503 with Retry-After (default: 256)", int),
    _o("--constraint-max-bytes", "constraint_max_bytes", "LLAMA_ARG_CONSTRAINT_MAX_BYTES", "largest JSON schema or grammar a request may constrain its output with, bytes of its compact text; larger: 400 (default: 524288)", int),
    _o("--constraint-max-depth", "constraint_max_depth", "LLAMA_ARG_CONSTRAINT_MAX_DEPTH", "deepest schema (JSON nesting plus $ref hops on one path) or grammar (rule references on one chain, parenthesis nesting); deeper: 400 (default: 256)", int),
    _o("--constraint-max-enum", "constraint_max_enum", "LLAMA_ARG_CONSTRAINT_MAX_ENUM", "most enum entries in one schema; more: 400 (default: 4096)", int),
    _o("--constraint-max-tools", "constraint_max_tools", "LLAMA_ARG_CONSTRAINT_MAX_TOOLS", "most tools in one request; more: 400 (default: 128)", int),
    _o("--constraint-timeout", "constraint_timeout", "LLAMA_ARG_CONSTRAINT_TIMEOUT", "seconds compiling one schema or grammar may take (in a child process); longer: 400, remembered (default: 10)", float),
    _o("--constraint-workers", "constraint_workers", "LLAMA_ARG_CONSTRAINT_WORKERS", "child processes that compile schemas and grammars (default: 2)", int),
    _o("--request-prep-timeout", "request_prep_timeout", "LLAMA_ARG_REQUEST_PREP_TIMEOUT", "seconds a request's preparation (rendering, tokenizing, checking tools and schemas) may take, queueing included; longer: 408 (default: 60)", float),
    _o("-to --timeout", "timeout", "LLAMA_ARG_TIMEOUT", 'seconds a request may run before it is ended; in router mode also how long an instance may stay silent before its request gets a 504 (default: 600; per request: "timeout")', float),
    # --- logging ---
    _o("-v --verbose --log-verbose", "verbose", "LLAMA_ARG_VERBOSE", "debug logging", "bool"),
    _o("-lv --verbosity --log-verbosity", "log_verbosity", "LLAMA_ARG_LOG_VERBOSITY", "log threshold: 1 error, 2 warning, 3 info, 4+ debug (default: 3)", int),
    _o("--log-disable", "log_disable", "LLAMA_ARG_LOG_DISABLE", "no log output", "bool"),
    _o("--log-file", "log_file", "LLAMA_ARG_LOG_FILE", "also log to this file"),
]
# fmt: on


# ---- accepted and ignored -------------------------------------------------------------

SWITCH = "switch"  # a flag without a value
BOOL = "bool"  # a --x / --no-x pair (the negations after " | " in a row)
INT_PAIR = "int-pair"  # two integers (--control-vector-layer-range START END)
ANY = "any"  # ``ours`` for a flag that has no meaning in a server: never warned about


@dataclass(frozen=True)
class Compat:
    """A llama-server flag accepted and ignored. ``value`` checks its text: SWITCH, BOOL,
    INT_PAIR, a tuple of choices, or a converter (int, float, str, ...). ``ours`` is the value
    that describes what this server does anyway (no warning for it); None: always warned."""

    flags: tuple[str, ...]
    env: str
    value: FlagKind | tuple[str, ...]  # a tuple: the choices
    ours: object
    group: str
    neg: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The flag's name in warnings and ``Settings.compat``: its first ``--`` spelling."""
        return next((f for f in self.flags if f.startswith("--")), self.flags[0])


def _err(what: str, text: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"expected {what}, got {text!r}")


def _items(text: str, what: str) -> list[str]:
    items = [x.strip() for x in text.split(",")]
    if not all(items):
        raise _err(what, text)
    return items


def ints(text: str) -> list[int]:
    """``1024,512``: comma-separated integers."""
    try:
        return [int(x) for x in _items(text, "comma-separated integers")]
    except ValueError:
        raise _err("comma-separated integers", text) from None


def floats(text: str) -> list[float]:
    """``3,1``: comma-separated numbers."""
    try:
        return [float(x) for x in _items(text, "comma-separated numbers")]
    except ValueError:
        raise _err("comma-separated numbers", text) from None


def hex_mask(text: str) -> str:
    """A CPU mask: hexadecimal digits, optionally after 0x."""
    if not re.fullmatch(r"(0[xX])?[0-9a-fA-F]+", text.strip()):
        raise _err("a hexadecimal CPU mask", text)
    return text.strip()


def cpu_range(text: str) -> str:
    """``lo-hi``: a range of CPU numbers."""
    m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", text)
    if not m or int(m.group(1)) > int(m.group(2)):
        raise _err("a CPU range lo-hi", text)
    return text.strip()


def percent(text: str) -> int:
    """``--poll``: 0 ... 100."""
    try:
        v = int(text)
    except ValueError:
        raise _err("an integer 0...100", text) from None
    if not 0 <= v <= 100:
        raise _err("an integer 0...100", text)
    return v


def json_schema(text: str) -> JsonValue:
    """``-j``: a JSON schema (any JSON value)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise _err("a JSON schema", text) from None


def _pattern_list(rx: str, what: str) -> Callable[[str], list[str]]:
    def check(text: str) -> list[str]:
        items = _items(text, what)
        if not all(re.fullmatch(rx, x) for x in items):
            raise _err(what, text)
        return items

    check.__name__ = what.replace(" ", "_")
    return check


_NUM = r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?"
kv_overrides = _pattern_list(r"[^=]+=(int|float|bool|str):.*", "KEY=TYPE:VALUE items")
tensor_overrides = _pattern_list(r"[^=]+=[^=]+", "PATTERN=BUFFER_TYPE items")
scaled_files = _pattern_list(rf".+:{_NUM}", "FNAME:SCALE items")
lora_aliases = _pattern_list(r"[^=]+=.+", "NAME=FNAME items")


def lora_files(text: str) -> list[str]:
    """``a.gguf,b.gguf``: adapter files."""
    return _items(text, "file names")


def logit_bias(text: str) -> str:
    """``15043+1``, ``15043-inf``: a token id, a sign and a bias."""
    if not re.fullmatch(r"\d+[-+](inf|\d+(\.\d*)?|\.\d+)", text.strip()):
        raise _err("TOKEN_ID(+/-)BIAS", text)
    return text.strip()


def _words(text: str) -> list[str]:
    return text.split()


ON_OFF_AUTO = ("on", "off", "auto")
STRICT = ("0", "1")
SPLIT_MODES = ("none", "layer", "row", "tensor")
LOAD_MODES = ("auto", "none", "mmap", "mlock", "mmap+mlock", "dio")


def non_negative(text: str) -> int:
    """``--n-cpu-moe``, ``--n-cpu-ffn``: a layer count, 0 or more (llama-server refuses less)."""
    try:
        v = int(text)
    except ValueError:
        raise _err("an integer >= 0", text) from None
    if v < 0:
        raise _err("an integer >= 0", text)
    return v


# Implemented flags whose value checkers are defined above: KV cache types, context shift,
# model placement and loading (llama_context_params / llama_model_params, server.llama).
# fmt: off
OPTIONS += [
    _o("-ctk --cache-type-k", "cache_type_k", "LLAMA_ARG_CACHE_TYPE_K", "KV cache data type for K: " + ", ".join(CACHE_TYPES) + " (default: f16)", choices=CACHE_TYPES),
    _o("-ctv --cache-type-v", "cache_type_v", "LLAMA_ARG_CACHE_TYPE_V", "KV cache data type for V (default: f16); a quantized V needs flash attention (-fa auto turns it on, -fa off refuses it)", choices=CACHE_TYPES),
    _o("--spec-draft-type-k -ctkd --cache-type-k-draft", "cache_type_k_draft", "LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K", "KV cache data type for K of the draft model (default: f16)", choices=CACHE_TYPES),
    _o("--spec-draft-type-v -ctvd --cache-type-v-draft", "cache_type_v_draft", "LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V", "KV cache data type for V of the draft model (default: f16)", choices=CACHE_TYPES),
    _o("--cache-reuse", "cache_reuse", "LLAMA_ARG_CACHE_REUSE", "min chunk size (tokens) to reuse from the cache by shifting its KV when the prompt changed before it (default: 0 = off; needs a KV cache that can shift)", int),
    _o("--context-shift", "context_shift", "LLAMA_ARG_CONTEXT_SHIFT", "when a generating slot's context is full, drop half of the tokens after n_keep and go on, as llama-server does (default: off; needs a KV cache that can shift)", "bool", neg="--no-context-shift"),
    _o("-sm --split-mode", "split_mode", "LLAMA_ARG_SPLIT_MODE", "how to split the model across GPUs: none, layer, row or tensor (default: layer)", choices=SPLIT_MODES),
    _o("-ts --tensor-split", "tensor_split", "LLAMA_ARG_TENSOR_SPLIT", "fraction of the model to offload to each GPU, comma-separated proportions, e.g. 3,1 (default: none)", floats),
    _o("-mg --main-gpu", "main_gpu", "LLAMA_ARG_MAIN_GPU", "the GPU for the model (split-mode none), or for intermediate results and KV (split-mode row) (default: 0)", int),
    _o("-ot --override-tensor", "override_tensor", "LLAMA_ARG_OVERRIDE_TENSOR", "tensor buffer type overrides: <tensor name pattern>=<buffer type>,... (default: none)", tensor_overrides),
    _o("-cmoe --cpu-moe", "cpu_moe", "LLAMA_ARG_CPU_MOE", "keep all Mixture of Experts (MoE) weights in the CPU", "bool"),
    _o("-ncmoe --n-cpu-moe", "n_cpu_moe", "LLAMA_ARG_N_CPU_MOE", "keep the MoE weights of the first N layers in the CPU (default: 0)", non_negative),
    _o("--spec-draft-override-tensor -otd --override-tensor-draft", "override_tensor_draft", "", "draft model tensor buffer type overrides: <tensor name pattern>=<buffer type>,... (default: none)", tensor_overrides),
    _o("--spec-draft-n-cpu-moe --spec-draft-ncmoe -ncmoed --n-cpu-moe-draft", "n_cpu_moe_draft", "LLAMA_ARG_SPEC_DRAFT_N_CPU_MOE", "keep the MoE weights of the draft model's first N layers in the CPU (default: 0)", non_negative),
    _o("-ncffn --n-cpu-ffn", "n_cpu_ffn", "LLAMA_ARG_N_CPU_FFN", "keep the dense FFN weights of the first N layers in the CPU (default: 0)", non_negative),
    _o("-lm --load-mode", "load_mode", "LLAMA_ARG_LOAD_MODE", "model loading: auto, none, mmap, mlock, mmap+mlock or dio (default: auto)", choices=LOAD_MODES),
    _o("--no-mmap", "no_mmap", "LLAMA_ARG_NO_MMAP", "do not memory-map the model (read it into memory); --mmap: map it (llama-server's earlier flags; they win over -lm)", "bool", neg="--mmap"),
    _o("--mlock", "mlock", "LLAMA_ARG_MLOCK", "keep the model in RAM, never swapped out (llama-server's earlier flag; wins over -lm)", "bool"),
    # --- LoRA adapters (issue 32; server.service.adapters, server.llama.lora) ---
    _o("--lora", "lora", "", "LoRA adapter file, at scale 1 (comma-separated or repeated for several; ids in order)", lora_files, repeat=True),
    _o("--lora-scaled", "lora_scaled", "", "LoRA adapter with its scale: FNAME:SCALE,... (repeatable; ids after the --lora files)", scaled_files, repeat=True),
    _o("--lora-init-without-apply", "lora_init_without_apply", "", "load the adapters at global scale 0 (apply later with POST /lora-adapters)", "bool"),
    _o("--enable-lora-runtime", "enable_lora_runtime", "LLAMA_ARG_ENABLE_LORA_RUNTIME", "vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter: load adapters at run time, only files under --lora-runtime-dir (default: off)", "bool"),
    _o("--lora-runtime-dir", "lora_runtime_dir", "LLAMA_ARG_LORA_RUNTIME_DIR", "the directory run-time adapter paths must lie in (symlinks resolved; needed by --enable-lora-runtime)"),
    _o("--lora-runtime-max", "lora_runtime_max", "LLAMA_ARG_LORA_RUNTIME_MAX", "most distinct adapter files loaded at run time over the server's life; their memory stays with the model (default: 16)", int),
    _o("--lora-alias", "lora_alias", "", "NAME=FNAME,...: requests with model NAME run under that adapter (added at scale 0 if not loaded yet); /v1/models lists the names (repeatable)", lora_aliases, repeat=True),
    # --- images (issue 42; server.llama.mtmd, server.media.image_inputs) ---
    _o("-mm --mmproj", "mmproj", "LLAMA_ARG_MMPROJ", "multimodal projector file: images in chat messages (default: none)"),
    _o("--mmproj-offload", "mmproj_offload", "LLAMA_ARG_MMPROJ_OFFLOAD", "run the projector on the GPU when there is one (default: on)", "bool", neg="--no-mmproj-offload"),
    _o("--image-min-tokens", "image_min_tokens", "LLAMA_ARG_IMAGE_MIN_TOKENS", "least tokens an image takes, for dynamic-resolution projectors (default: the projector's)", int),
    _o("--image-max-tokens", "image_max_tokens", "LLAMA_ARG_IMAGE_MAX_TOKENS", "most tokens an image takes, for dynamic-resolution projectors (default: the projector's)", int),
    _o("--mtmd-batch-max-tokens", "mtmd_batch_max_tokens", "LLAMA_ARG_MTMD_BATCH_MAX_TOKENS", "most image tokens encoded in one pass: a prompt's uncached images go together up to it, where the projector batches (default: 1024)", int),
    _o("--media-path", "media_path", "", "file:// image inputs are read from under this directory only (default: none, file:// refused)"),
    _o("--image-cache-mib", "image_cache_mib", "", "RAM for image embeddings kept by image identity, so an image is encoded once (default: 256)", int),
    _o("--image-max-mib", "image_max_mib", "", "most bytes of one image (encoded), in MiB (default: 10)", int),
    _o("--image-max-pixels", "image_max_pixels", "", "most pixels of one image, read from its header before decoding (default: 33554432)", int),
    _o("--image-max-count", "image_max_count", "", "most images in one request (default: 16)", int),
    _o("--image-max-request-pixels", "image_max_request_pixels", "", "most pixels of one request's images together, read from their headers before any is decoded (default: 0 = 4 x --image-max-pixels)", int),
    _o("--image-max-key-pixels", "image_max_key_pixels", "", "most pixels the requests of one API key may hold while their images are prepared, queueing included; past it 429 (default: 0 = 2 x --image-max-request-pixels)", int),
    # --- router mode (server.router) and sleeping when idle (server.http.model_sleep) ---
    _o("--models-dir", "models_dir", "LLAMA_ARG_MODELS_DIR", "router mode (without -m): serve the GGUF files of this directory, one server process per model, named by file stem (a subfolder per multi-file model) (default: off)"),
    _o("--models-preset", "models_preset", "LLAMA_ARG_MODELS_PRESET", "router mode (without -m): INI file of model presets, [*] defaults and one section per model whose keys are flags (default: off)"),
    _o("--models-max", "models_max", "LLAMA_ARG_MODELS_MAX", "router mode: most model instances running at once; the least recently used idle one is stopped to make room (default: 4, 0 = unlimited)", int),
    _o("--models-autoload", "models_autoload", "LLAMA_ARG_MODELS_AUTOLOAD", "router mode: start a model's instance on its first request (default: on; per request: ?autoload=)", "bool", neg="--no-models-autoload"),
    _o("--sleep-idle-seconds", "sleep_idle_seconds", "", "free the model, context and KV cache after this many seconds without a task; the next task reloads it (default: -1 = never)", int),
]
# fmt: on


# a row of _group: (flags, env, value) or (flags, env, value, ours)
_Row = (
    tuple[str, str, FlagKind | tuple[str, ...]]
    | tuple[str, str, FlagKind | tuple[str, ...], object]
)


def _group(group: str, *rows: _Row) -> list[Compat]:
    """Rows of (flags, env, value[, ours]); ``"--x | --no-x"`` gives a BOOL's negations."""
    out = []
    for flags, env, value, *ours in rows:
        pos, _, neg = flags.partition(" | ")
        c = Compat(
            tuple(pos.split()), env, value, ours[0] if ours else None, group, tuple(neg.split())
        )
        out.append(c)
    return out


# fmt: off
COMPAT: list[Compat] = [
    *_group(
        "CPU placement",
        ("-C --cpu-mask", "", hex_mask),
        ("-Cr --cpu-range", "", cpu_range),
        ("--cpu-strict", "", STRICT, "0"),
        ("--prio", "", int, 0),
        ("--poll", "", percent, 50),
        ("-Cb --cpu-mask-batch", "", hex_mask),
        ("-Crb --cpu-range-batch", "", cpu_range),
        ("--cpu-strict-batch", "", STRICT, "0"),
        ("--prio-batch", "", int, 0),
        ("--poll-batch", "", STRICT),
        ("--numa", "LLAMA_ARG_NUMA", ("distribute", "isolate", "numactl")),
    ),
    *_group(
        "model loading and devices",
        ("--perf | --no-perf", "LLAMA_ARG_PERF", BOOL, False),
        ("-kvo --kv-offload | -nkvo --no-kv-offload", "LLAMA_ARG_KV_OFFLOAD", BOOL, True),
        ("--repack | -nr --no-repack", "LLAMA_ARG_REPACK", BOOL, True),
        ("--no-host", "LLAMA_ARG_NO_HOST", SWITCH),
        ("-lzm --lazy-mode", "LLAMA_ARG_LAZY_MODE", ("on", "auto", "off"), "auto"),
        ("--check-tensors", "", SWITCH),
        ("--override-kv", "", kv_overrides),
        ("--op-offload | --no-op-offload", "", BOOL, True),
        ("-dev --device", "LLAMA_ARG_DEVICE", str),
        ("-fit --fit", "LLAMA_ARG_FIT", ("on", "off"), "off"),
        ("-fitt --fit-target", "LLAMA_ARG_FIT_TARGET", ints),
        ("-fitc --fit-ctx", "LLAMA_ARG_FIT_CTX", int),
        ("--rpc", "LLAMA_ARG_RPC", str),
    ),
    *_group(
        "KV cache",
        ("-dt --defrag-thold", "LLAMA_ARG_DEFRAG_THOLD", float, ANY),  # deprecated there too
        ("--cache-prompt | --no-cache-prompt", "LLAMA_ARG_CACHE_PROMPT", BOOL, True),
        ("-cb --cont-batching | -nocb --no-cont-batching", "LLAMA_ARG_CONT_BATCHING", BOOL, True),
    ),
    *_group(
        "RoPE/YaRN",
        ("--rope-scaling", "LLAMA_ARG_ROPE_SCALING_TYPE", ("none", "linear", "yarn")),
        ("--rope-scale", "LLAMA_ARG_ROPE_SCALE", float),
        ("--rope-freq-base", "LLAMA_ARG_ROPE_FREQ_BASE", float),
        ("--rope-freq-scale", "LLAMA_ARG_ROPE_FREQ_SCALE", float),
        ("--yarn-orig-ctx", "LLAMA_ARG_YARN_ORIG_CTX", int, 0),
        ("--yarn-ext-factor", "LLAMA_ARG_YARN_EXT_FACTOR", float, -1.0),
        ("--yarn-attn-factor", "LLAMA_ARG_YARN_ATTN_FACTOR", float, -1.0),
        ("--yarn-beta-slow", "LLAMA_ARG_YARN_BETA_SLOW", float, -1.0),
        ("--yarn-beta-fast", "LLAMA_ARG_YARN_BETA_FAST", float, -1.0),
    ),
    *_group(
        "LoRA/control vectors",
        ("--control-vector", "", str),
        ("--control-vector-scaled", "", scaled_files),
        ("--control-vector-layer-range", "", INT_PAIR),
    ),
    *_group(
        "downloads",
        ("-mu --model-url", "LLAMA_ARG_MODEL_URL", str),
        ("-dr --docker-repo", "LLAMA_ARG_DOCKER_REPO", str),
        ("-hf -hfr --hf-repo", "LLAMA_ARG_HF_REPO", str),
        ("-hff --hf-file", "LLAMA_ARG_HF_FILE", str),
        ("-hft --hf-token", "HF_TOKEN", str, ANY),  # a token alone downloads nothing
        ("--offline", "LLAMA_ARG_OFFLINE", SWITCH, True),  # never online anyway
        *[
            (f"--{m}", "", SWITCH)
            for m in _words(
                "embd-gemma-default fim-qwen-1.5b-default fim-qwen-3b-default "
                "fim-qwen-7b-default fim-qwen-7b-spec fim-qwen-14b-spec fim-qwen-30b-default "
                "gpt-oss-20b-default gpt-oss-120b-default vision-gemma-4b-default "
                "vision-gemma-12b-default"
            )
        ],
    ),
    *_group(
        "log format",
        ("--log-jsonl | --no-log-jsonl", "LLAMA_ARG_LOG_JSONL", BOOL, False),
        ("--log-colors", "LLAMA_ARG_LOG_COLORS", ON_OFF_AUTO, ANY),  # cosmetic
        ("--log-prefix | --no-log-prefix", "LLAMA_ARG_LOG_PREFIX", BOOL, True),
        ("--log-timestamps | --no-log-timestamps", "LLAMA_ARG_LOG_TIMESTAMPS", BOOL, True),
        ("--log-prompts-dir", "", str),
    ),
    *_group(
        "samplers",
        ("--ignore-eos", "", SWITCH),
        ("-l --logit-bias", "", logit_bias),
        ("--grammar", "", str),
        ("--grammar-file", "", str),
        ("-j --json-schema", "", json_schema),
        ("-jf --json-schema-file", "", str),
        ("-r --reverse-prompt", "", str),
        ("-sp --special", "", SWITCH),
        ("-e --escape | --no-escape", "", BOOL, ANY),  # prompt escapes of the CLI tools
    ),
    *_group(
        "speculative decoding",
        ("-lcs --lookup-cache-static", "", str),
        ("-lcd --lookup-cache-dynamic", "", str),
        ("--spec-draft-hf -hfd -hfrd --hf-repo-draft", "LLAMA_ARG_SPEC_DRAFT_HF_REPO", str),
        ("--spec-draft-cpu-mask -Cd --cpu-mask-draft", "", hex_mask, ANY),
        ("--spec-draft-cpu-range -Crd --cpu-range-draft", "", cpu_range, ANY),
        ("--spec-draft-cpu-strict --cpu-strict-draft", "", STRICT, ANY),
        ("--spec-draft-prio --prio-draft", "", int, ANY),
        ("--spec-draft-poll --poll-draft", "", STRICT, ANY),
        ("--spec-draft-cpu-mask-batch -Cbd --cpu-mask-batch-draft", "", hex_mask, ANY),
        ("--spec-draft-cpu-strict-batch --cpu-strict-batch-draft", "", STRICT, ANY),
        ("--spec-draft-prio-batch --prio-batch-draft", "", int, ANY),
        ("--spec-draft-poll-batch --poll-batch-draft", "", STRICT, ANY),
        ("--spec-synth-len", "LLAMA_ARG_SPEC_SYNTH_LEN", float),
        ("--spec-synth-rates", "LLAMA_ARG_SPEC_SYNTH_RATES", floats),
        ("--spec-draft-p-split --draft-p-split", "LLAMA_ARG_SPEC_DRAFT_P_SPLIT", float, ANY),
        ("--spec-draft-backend-sampling | --no-spec-draft-backend-sampling", "LLAMA_ARG_SPEC_DRAFT_BACKEND_SAMPLING", BOOL, ANY),
        ("--spec-draft-device -devd --device-draft", "", str, ANY),
        *[
            (f"--spec-ngram-{k}", "", int, ANY)
            for k in _words(
                "mod-n-min mod-n-max mod-n-match "
                "map-k-size-n map-k-size-m map-k-min-hits map-k4v-size-n map-k4v-size-m "
                "map-k4v-min-hits size-n size-m min-hits"
            )
        ],
        ("--draft --draft-n --draft-max", "LLAMA_ARG_DRAFT_MAX", int),  # removed in llama-server
        ("--draft-min --draft-n-min", "LLAMA_ARG_DRAFT_MIN", int),
        ("--spec-default", "", SWITCH),
    ),
    *_group(
        "multimodal",
        ("-mmu --mmproj-url", "LLAMA_ARG_MMPROJ_URL", str),
        ("--mmproj-auto | --no-mmproj --no-mmproj-auto", "LLAMA_ARG_MMPROJ_AUTO", BOOL, False),
        ("-mmdev --mmproj-device", "MTMD_BACKEND_DEVICE", str, ANY),
        ("--video-fps", "LLAMA_ARG_VIDEO_FPS", float, ANY),
        ("--video-timestamp-interval", "LLAMA_ARG_VIDEO_TIMESTAMP_INTERVAL", int, ANY),
        ("--video-ffmpeg-dir", "LLAMA_ARG_VIDEO_FFMPEG_DIR", str, ANY),
    ),
    *_group(
        "reasoning/chat parsing",
        ("--reasoning-preserve | --no-reasoning-preserve", "LLAMA_ARG_REASONING_PRESERVE", BOOL, ANY),
        ("--skip-chat-parsing | --no-skip-chat-parsing", "LLAMA_ARG_SKIP_CHAT_PARSING", BOOL, True),
    ),
    *_group(
        "web UI/tools/router",
        ("--path", "LLAMA_ARG_STATIC_PATH", str, ""),
        ("--ui-config --webui-config", "LLAMA_ARG_UI_CONFIG", json_object, ANY),
        ("--ui-config-file --webui-config-file", "LLAMA_ARG_UI_CONFIG_FILE", str, ANY),
        ("--tools", "LLAMA_ARG_TOOLS", str),
        ("--tools-runtime", "LLAMA_ARG_TOOLS_RUNTIME", str),
        ("--mcp-servers-config", "LLAMA_ARG_MCP_SERVERS_CONFIG", str),
        ("--mcp-servers-json", "LLAMA_ARG_MCP_SERVERS_JSON", json_object),
        ("-ag --agent | -no-ag --no-agent", "LLAMA_ARG_AGENT", BOOL, False),
    ),
    *_group(
        "HTTP extras",
        ("--threads-http", "LLAMA_ARG_THREADS_HTTP", int, ANY),  # asyncio: no HTTP threads
    ),
]
# fmt: on

COMPAT_GROUPS: list[str] = list(dict.fromkeys(c.group for c in COMPAT))
