"""Settings: one field per implemented llama-server flag, with its default; also read from
LLAMA_ARG_* variables. The flag tables are in ``server.settings.flags``; the rest of llama-server's
flags are accepted, checked and ignored (``Settings.compat``, one warning: ``warn_ignored``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Mapping
from importlib import metadata
from typing import TypedDict

from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ..task import sampler_order
from .flags import (
    ANY,
    BOOL,
    COMPAT,
    COMPAT_GROUPS,
    INT_PAIR,
    OPTIONS,
    SWITCH,
    Compat,
    FlagKind,
    Opt,
)

__all__ = [
    "OPTIONS",
    "COMPAT",
    "Opt",
    "Compat",
    "Settings",
    "build_parser",
    "parse_settings",
    "ignored_flags",
    "warn_ignored",
    "load_api_keys",
    "csv_list",
]

# llama-server's "auto" slot count (-np -1) in unified-KV mode.
AUTO_PARALLEL = 4


class GcpCompat(BaseModel):
    """Vertex AI prediction (llama-server's, read from the same variables): ``POST
    predict_route`` answers ``instances`` by the routes their ``@requestFormat`` names,
    ``health_route`` (when set) is another ``/health``, and the server listens on
    ``port`` (AIP_HTTP_PORT, which wins over --port there too)."""

    predict_route: str = "/predict"
    health_route: str = ""
    port: int = Field(8080, ge=0, le=65535)


def _route(value: str | None, default: str) -> str:
    """A route from a variable: a leading ``/`` added, as llama-server does."""
    if not value:
        return default
    return value if value.startswith("/") else "/" + value


def gcp_compat(env: Mapping[str, str]) -> GcpCompat | None:
    """The Vertex AI settings when ``AIP_MODE`` is ``PREDICTION``, else None."""
    if env.get("AIP_MODE", "") != "PREDICTION":
        return None
    return GcpCompat(
        predict_route=_route(env.get("AIP_PREDICT_ROUTE"), "/predict"),
        health_route=_route(env.get("AIP_HEALTH_ROUTE"), ""),
        port=int(env.get("AIP_HTTP_PORT") or 8080),
    )


class Settings(BaseModel):
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    reuse_port: bool = False  # SO_REUSEPORT on the listening sockets (server.cli.main.bind)
    # every route under this prefix ("" none): server.http.middleware.ApiPrefix
    api_prefix: str = ""
    # seconds a stream may stay silent before an SSE comment ping (<= 0: never), llama-server's
    # default; a request's ``sse_ping_interval`` overrides it (server.protocols.common)
    sse_ping_interval: float = 30.0
    ctx_size: int = Field(8192, ge=0)
    parallel: int = Field(AUTO_PARALLEL, ge=1, le=256)
    batch_size: int = Field(2048, ge=1)
    ubatch_size: int = Field(512, ge=1)
    threads: int = -1
    threads_batch: int = -1
    n_gpu_layers: int = -1
    # llama-server's per-slot context cap; without -c it also sizes the pool (parallel * N)
    kv_unified_per_slot: int = Field(0, ge=0)
    kv_unified: bool = True
    swa_full: bool = False
    flash_attn: str = "auto"
    # KV cache data types (ggml type names), the target's and the draft model's
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    cache_type_k_draft: str = "f16"
    cache_type_v_draft: str = "f16"
    context_shift: bool = False  # a full generating slot drops half after n_keep, goes on
    # --cache-reuse N: reuse cached chunks of >= N tokens found later in a prompt (0: off)
    cache_reuse: int = Field(0, ge=0, le=1_000_000)
    # model placement and loading (llama_model_params)
    split_mode: str = "layer"
    tensor_split: list[float] | None = None
    main_gpu: int = 0
    override_tensor: list[str] | None = None  # PATTERN=BUFFER_TYPE items
    cpu_moe: bool = False
    n_cpu_moe: int = Field(0, ge=0)
    n_cpu_ffn: int = Field(0, ge=0)
    load_mode: str = "auto"
    no_mmap: bool | None = None  # None: not given (-lm decides)
    mlock: bool | None = None
    backend_sampling: bool = False  # -bs: sampler chains in the decode graph when they can
    sample_threads: int = Field(-1, ge=-1)  # CPU sampling workers (-1: auto, 0: off)
    slot_prompt_similarity: float = Field(0.10, ge=0.0, le=1.0)
    step_target_ms: float = Field(500.0, ge=0.0)
    scheduling_policy: str = "fcfs"  # server.engine.priority
    priority_aging_seconds: float = Field(10.0, ge=0.0)
    n_predict: int = -1
    alias: str | None = None
    tags: str | None = None
    jinja: bool = True
    chat_template: str | None = None
    chat_template_file: str | None = None
    chat_template_kwargs: dict[str, object] | None = None
    warmup: bool = True
    reasoning_format: str = "auto"
    reasoning: str = "auto"
    reasoning_effort: str | None = None
    reasoning_budget: int = Field(-1, ge=-1, le=1_000_000)  # server.service.budget
    reasoning_budget_message: str | None = Field(None, max_length=4096)
    # Default sampling: a request gets these for the fields it leaves out (the ranges are the
    # request fields' own, server.schemas.bodies.SamplingFields).
    seed: int = -1
    temperature: float = Field(0.8, ge=0.0, le=100.0)
    top_k: int = Field(40, ge=0, le=1_000_000)
    top_p: float = Field(0.95, ge=0.0, le=1.0)
    min_p: float = Field(0.05, ge=0.0, le=1.0)
    repeat_last_n: int = Field(64, ge=-1, le=1_000_000)
    repeat_penalty: float = Field(1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # llama-server's other samplers (server.schemas.sampler_fields has the request fields)
    samplers: str | None = None  # names separated by ';'
    sampler_seq: str | None = None  # letters; over ``samplers``
    top_n_sigma: float = Field(-1.0, ge=-1.0, le=100.0)
    xtc_probability: float = Field(0.0, ge=0.0, le=1.0)
    xtc_threshold: float = Field(0.1, ge=0.0, le=1.0)
    typical_p: float = Field(1.0, ge=0.0, le=1.0)
    dry_multiplier: float = Field(0.0, ge=0.0, le=100.0)
    dry_base: float = Field(1.75, ge=1.0, le=100.0)
    dry_allowed_length: int = Field(2, ge=0, le=1_000_000)
    dry_penalty_last_n: int = Field(64, ge=-1, le=1_000_000)
    dry_sequence_breakers: list[str] | None = None  # None: the defaults; ["none"]: none
    adaptive_target: float = Field(-1.0, ge=-1.0, le=1.0)
    adaptive_decay: float = Field(0.9, ge=0.0, le=0.99)
    dynatemp_range: float = Field(0.0, ge=0.0, le=100.0)
    dynatemp_exponent: float = Field(1.0, ge=0.0, le=100.0)
    mirostat: int = Field(0, ge=0, le=2)
    mirostat_tau: float = Field(5.0, ge=0.0, le=100.0)
    mirostat_eta: float = Field(0.1, ge=0.0, le=10.0)
    keep: int = Field(0, ge=-1)  # a request's n_keep default (context shift)
    # embeddings and reranking (server.protocols.embedding_shapes): --reranking implies --embedding with
    # pooling rank, as in llama-server; pooling None is the model's own
    embedding: bool = False
    spm_infill: bool = False  # /infill builds suffix/prefix/middle (server.prompts.infill_prompt)
    reranking: bool = False
    pooling: str | None = None
    embd_normalize: int = 2
    # speculative decoding (server.slot.speculative)
    spec_type: list[str] = Field(default_factory=lambda: ["none"])
    spec_draft_model: str | None = None
    # the draft model's placement and threads (server.llama.draft.DraftOptions)
    threads_draft: int = -1
    threads_batch_draft: int = -1
    override_tensor_draft: list[str] | None = None
    cpu_moe_draft: bool = False
    n_cpu_moe_draft: int = Field(0, ge=0)
    spec_draft_n_max: int = Field(3, ge=0, le=256)
    spec_draft_n_min: int = Field(0, ge=0, le=256)
    spec_draft_p_min: float = Field(0.0, ge=0.0)  # above 1: the draft model never drafts
    n_gpu_layers_draft: int = -1
    spec_ngram_simple_size_n: int = Field(12, ge=1, le=1024)
    spec_ngram_simple_size_m: int = Field(48, ge=1, le=1024)
    spec_ngram_simple_min_hits: int = Field(1, ge=1)
    slots: bool = True
    props: bool = False
    # LoRA adapters (server.service.adapters): files, FILE:SCALE items, NAME=FILE aliases
    lora: list[str] = Field(default_factory=list)
    lora_scaled: list[str] = Field(default_factory=list)
    lora_init_without_apply: bool = False
    lora_alias: list[str] = Field(default_factory=list)
    # images (issue 42): the projector, its token limits, file:// root, embedding cache, bounds
    mmproj: str | None = None
    mmproj_offload: bool = True
    image_min_tokens: int = Field(-1, ge=-1)
    image_max_tokens: int = Field(-1, ge=-1)
    mtmd_batch_max_tokens: int = Field(1024, ge=1)
    media_path: str | None = None
    image_cache_mib: int = Field(256, ge=0)
    image_max_mib: int = Field(10, ge=1, le=1024)
    image_max_pixels: int = Field(33554432, ge=1)
    image_max_count: int = Field(16, ge=1, le=256)
    image_max_request_pixels: int = Field(0, ge=0)  # 0: 4 x image_max_pixels (media_scope)
    image_max_key_pixels: int = Field(0, ge=0)  # 0: 2 x the request's (in flight per API key)
    # run-time adapters (server.service.lora_runtime)
    enable_lora_runtime: bool = False
    lora_runtime_dir: str | None = None
    lora_runtime_max: int = Field(16, ge=0, le=1024)
    cache_ram: int = Field(8192, ge=-1)
    cache_ram_tokens: int = Field(0, ge=0)
    cache_idle_slots: bool = True
    cache_disk: str | None = None
    cache_disk_mib: int = Field(16384, ge=0)
    cache_isolation: str = "none"
    kv_events_endpoint: str | None = None  # ZMQ XPUB bind address (server.kv_events.kv_publisher)
    kv_events_topic: str | None = None  # None: kv@<hostname>@<model alias>
    kv_events_allow_remote: bool = False  # bind beyond the loopback (server.http.kv_setup)
    kv_events_token_ids: bool = False  # token ids also under --api-key / --cache-isolation
    kv_block_size: int = Field(16, ge=1, le=4096)
    ctx_checkpoints: int = Field(32, ge=0)
    checkpoint_min_step: int = Field(8192, ge=0)
    metrics: bool = False
    prefix_share: bool = True
    prefix_share_min: int = Field(128, ge=0)
    api_key: str | None = None
    api_key_file: str | None = None
    allowed_hosts: str | None = None
    cors_origins: str | None = None  # None: "*", or "localhost" with tools (cors.effective_origins)
    cors_methods: str = "GET, POST, DELETE, OPTIONS"
    cors_headers: str = "*"
    cors_credentials: bool = True
    webui: bool = True  # the chat page at / (--ui/--webui, --no-ui/--no-webui)
    ui_mcp_proxy: bool = False
    ui_mcp_proxy_timeout: float = Field(30, gt=0)
    ssl_key_file: str | None = None
    ssl_cert_file: str | None = None
    max_body_mb: float = Field(16, gt=0)
    max_queue: int = Field(256, ge=0)
    # Bounds on clients' schemas and grammars (server.constrained.limits.ConstraintLimits)
    constraint_max_bytes: int = Field(512 * 1024, gt=0)
    constraint_max_depth: int = Field(256, gt=0)
    constraint_max_enum: int = Field(4096, ge=0)
    constraint_max_tools: int = Field(128, ge=0)
    constraint_timeout: float = Field(10, gt=0)
    constraint_workers: int = Field(2, gt=0)
    timeout: float = Field(600, gt=0)
    request_prep_timeout: float = Field(60, gt=0)  # server.service.pools.prepare
    # resumable streams (server.service.stream_buffers): expiry, per-stream buffer, how many
    stream_ttl: float = Field(300.0, gt=0, le=86400)
    stream_max_bytes: int = Field(4 * 1024 * 1024, ge=1024, le=1 << 30)
    stream_max_events: int = Field(32768, ge=16, le=1 << 24)
    streams_max: int = Field(64, ge=0, le=65536)
    streams_per_key: int = Field(16, ge=1, le=65536)
    slot_save_path: str | None = None
    verbose: bool = False
    log_verbosity: int = 3
    prefill_assistant: bool = True
    log_disable: bool = False
    log_file: str | None = None
    # router mode (server.router) and sleep (server.http.model_sleep)
    models_dir: str | None = None
    models_preset: str | None = None
    models_max: int = Field(4, ge=0)
    models_autoload: bool = True
    sleep_idle_seconds: int = Field(-1, ge=-1)
    # Accepted-and-ignored llama-server flags that were given: Compat.name -> value.
    compat: dict[str, object] = Field(default_factory=dict)
    # Vertex AI's custom-container contract (AIP_MODE=PREDICTION): None when off
    gcp: GcpCompat | None = None

    @field_validator("lora", "lora_scaled", "lora_alias", mode="before")
    @classmethod
    def _flat(cls, v: object) -> object:
        """A repeated flag's values (each a list of comma-separated items), in order."""
        if isinstance(v, list) and any(isinstance(x, list) for x in v):
            return [y for x in v for y in (x if isinstance(x, list) else [x])]
        return v

    @field_validator("samplers", "sampler_seq")
    @classmethod
    def _order(cls, v: str | None, info: ValidationInfo) -> str | None:
        """A sampler order llama-server takes (``server.task.sampler_order``)."""
        if v is not None:
            sampler_order(v.split(";") if info.field_name == "samplers" else v)
        return v

    @field_validator("api_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        """llama-server's form: a path without the trailing slash ("/" alone: no prefix)."""
        v = v.rstrip("/")
        segments = v.split("/")[1:]
        plain = all(s and s not in (".", "..") for s in segments)
        if v and (not v.startswith("/") or not plain or any(c in v for c in "\\%?#")):
            raise ValueError(f"expected a path such as /llm, got {v!r}")
        return v

    @model_validator(mode="after")
    def _per_slot_pool(self) -> Settings:
        """--kv-unified-per-slot N without -c sizes the KV pool to --parallel * N, as
        llama-server does (-c given, even 0, keeps the pool; N then only caps a slot)."""
        if self.kv_unified_per_slot > 0 and "ctx_size" not in self.model_fields_set:
            self.ctx_size = self.parallel * self.kv_unified_per_slot
        return self

    @model_validator(mode="after")
    def _lora_runtime(self) -> Settings:
        """--enable-lora-runtime loads files only from --lora-runtime-dir: both or neither
        make sense, and the directory must exist."""
        d = self.lora_runtime_dir
        if self.enable_lora_runtime and not d:
            raise ValueError("--enable-lora-runtime needs --lora-runtime-dir DIR")
        if self.enable_lora_runtime and d and not os.path.isdir(d):
            raise ValueError(f"--lora-runtime-dir {d!r} is not a directory")
        return self

    @field_validator("parallel", mode="before")
    @classmethod
    def _auto_parallel(cls, v: object) -> object:
        return AUTO_PARALLEL if v == -1 else v


def csv_list(v: str | None) -> list[str]:
    """A comma-separated flag value as its items (empty ones dropped)."""
    return [x.strip() for x in (v or "").split(",") if x.strip()]


_TRUE = {"1", "true", "yes", "on", "enabled"}
_FALSE = {"0", "false", "no", "off", "disabled"}

EPILOG = (
    "The groups 'accepted and ignored' hold the rest of llama-server's flags ("
    + ", ".join(COMPAT_GROUPS)
    + "): they are accepted, so a llama-server command line starts this server unchanged, and "
    "their values are checked, but they change nothing; one warning at start-up names those "
    "given that would have changed what llama-server does."
)


# ---- print-and-exit flags ---------------------------------------------------------------


def _version(_: argparse.ArgumentParser) -> str:
    def ver(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "unknown"

    return (
        f"version: llama-slot-server {ver('llama-slot-server')}\n"
        f"built with llama.cpp from llama-cpp-python {ver('llama-cpp-python')}\n"
    )


def _completion_bash(parser: argparse.ArgumentParser) -> str:
    words = " ".join(sorted(parser._option_string_actions))
    return (
        "_llama_slot_server_completions() {\n"
        f'    COMPREPLY=( $(compgen -W "{words}" -- "${{COMP_WORDS[COMP_CWORD]}}") )\n'
        "}\n"
        "complete -F _llama_slot_server_completions llama-slot-server llama-server\n"
    )


def _cache_list(_: argparse.ArgumentParser) -> str:
    # llama-server lists the models it downloaded; this server downloads none.
    return "number of models in cache: 0\n"


def _list_devices(_: argparse.ArgumentParser) -> str:
    lines = ["Available devices:"]
    try:
        import llama_cpp

        gpu = bool(llama_cpp.llama_supports_gpu_offload())
        lines.append("  GPU offload supported" if gpu else "  (CPU only: no GPU offload)")
    except Exception as e:  # a broken install still answers
        lines.append(f"  (llama.cpp not loadable: {e})")
    return "\n".join(lines) + "\n"


class _PrintAndExit(argparse.Action):
    def __init__(
        self,
        option_strings: list[str],
        dest: str,
        text: Callable[[argparse.ArgumentParser], str],
        help: str | None = None,
    ) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)
        self.text = text

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(self.text(parser), end="")
        parser.exit(0)


# ---- the parser -------------------------------------------------------------------------


def _add_opt(g: argparse._ArgumentGroup, o: Opt) -> None:
    help = f"{o.help} [env {o.env}]" if o.env else o.help
    if o.kind == "bool":
        g.add_argument(*o.flags, dest=o.dest, action="store_true", default=None, help=help)
        if o.neg:
            g.add_argument(
                *o.neg, dest=o.dest, action="store_false", default=None, help=f"off: {o.flags[-1]}"
            )
        return
    action = "append" if o.repeat else "store"
    g.add_argument(
        *o.flags,
        dest=o.dest,
        type=o.kind,
        default=None,
        choices=o.choices,
        help=help,
        action=action,
    )


def _compat_dest(c: Compat) -> str:
    return f"compat:{c.name}"


class _CompatArgs(TypedDict):
    dest: str
    default: None
    help: str | None


def _add_compat(g: argparse._ArgumentGroup, c: Compat) -> None:
    kw: _CompatArgs = {"dest": _compat_dest(c), "default": None, "help": None}
    kw["help"] = f"[env {c.env}]" if c.env else None
    if c.value in (SWITCH, BOOL):
        g.add_argument(*c.flags, action="store_true", **kw)
        if c.neg:
            g.add_argument(*c.neg, action="store_false", dest=kw["dest"], default=None)
    elif c.value == INT_PAIR:
        g.add_argument(*c.flags, type=int, nargs=2, metavar=("START", "END"), **kw)
    elif isinstance(c.value, tuple):
        g.add_argument(*c.flags, choices=c.value, **kw)
    else:
        g.add_argument(*c.flags, type=c.value, metavar="VALUE", **kw)


def build_parser() -> argparse.ArgumentParser:
    """Every flag: the implemented ones, the print-and-exit ones, then the ignored groups.
    Names must match exactly (no abbreviations); for a flag given twice the last one wins."""
    p = argparse.ArgumentParser(
        prog="python -m server",
        usage="%(prog)s [flags]  (llama-server's flags; see below)",
        description="OpenAI-compatible llama.cpp server with slot-level KV reuse, started with "
        "llama-server's command line. Every flag can also be set with the environment "
        "variable shown.",
        epilog=EPILOG,
        add_help=False,
        allow_abbrev=False,
    )
    info = p.add_argument_group("information (print and exit)")
    info.add_argument("-h", "--help", "--usage", action="help", help="this help")
    for flags, text, what in (
        (("--version",), _version, "version and build"),
        (("--completion-bash",), _completion_bash, "a bash completion script"),
        (("-cl", "--cache-list"), _cache_list, "downloaded models (none: no downloads here)"),
        (("--list-devices",), _list_devices, "devices llama.cpp can offload to"),
    ):
        info.add_argument(*flags, action=_PrintAndExit, text=text, help=what)
    impl = p.add_argument_group("server")
    for o in OPTIONS:
        _add_opt(impl, o)
    groups = {name: p.add_argument_group(f"accepted and ignored: {name}") for name in COMPAT_GROUPS}
    for c in COMPAT:
        _add_compat(groups[c.group], c)
    return p


# ---- environment variables ----------------------------------------------------------------


def _bool(env: str, raw: str) -> bool:
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{env}: expected a boolean, got {raw!r}")


def _env_value(
    env: str, raw: str, kind: FlagKind | tuple[str, ...], choices: tuple[str, ...] | None
) -> object:
    """An environment variable's text as the flag's value; ValueError naming the variable."""
    if kind in ("bool", SWITCH, BOOL):
        return _bool(env, raw)
    if choices is not None:
        if raw not in choices:
            raise ValueError(f"{env}: expected one of {', '.join(choices)}, got {raw!r}")
        return raw
    try:
        if callable(kind):  # the rest: INT_PAIR
            return kind(raw)
        pair = [int(x) for x in raw.split()]
        if len(pair) != 2:
            raise ValueError("expected two integers")
        return pair
    except (ValueError, argparse.ArgumentTypeError) as e:
        raise ValueError(f"{env}: invalid value {raw!r} ({e})") from None


def _set(env: Mapping[str, str], name: str) -> str | None:
    raw = env.get(name) if name else None
    return raw if raw else None


def _option_values(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, object]:
    values: dict[str, object] = {}
    for o in OPTIONS:
        raw = _set(env, o.env)
        if raw is not None:
            values[o.dest] = _env_value(o.env, raw, o.kind, o.choices)
        cli = getattr(args, o.dest)
        if cli is not None:
            values[o.dest] = cli
    return values


def _compat_values(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for c in COMPAT:
        raw = _set(env, c.env)
        if raw is not None:
            choices = c.value if isinstance(c.value, tuple) else None
            v = _env_value(c.env, raw, c.value, choices)
            # a switch's variable set to false is the switch not given
            if not (c.value == SWITCH and v is False):
                out[c.name] = v
        cli = getattr(args, _compat_dest(c))
        if cli is not None:
            out[c.name] = cli
    return out


def _flag_of(field: str) -> str:
    return next(("/".join(o.flags) for o in OPTIONS if o.dest == field), field)


def parse_settings(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Flags win over environment variables, which win over defaults. A malformed value, on
    the command line or in a variable, exits with status 2 and a message, as argparse does."""
    env = os.environ if env is None else env
    parser = build_parser()
    args = parser.parse_args(_dashed(sys.argv[1:] if argv is None else argv))
    try:
        values = _option_values(args, env)
        values["compat"] = _compat_values(args, env)
        gcp = gcp_compat(env)
        if gcp is not None:  # Vertex AI says where to listen
            values.update(gcp=gcp, port=gcp.port)
        return Settings.model_validate(values)
    except ValidationError as e:
        msgs = [f"{_flag_of(str(err['loc'][0]))}: {err['msg']}" for err in e.errors()]
        parser.error("; ".join(msgs))
    except ValueError as e:
        parser.error(str(e))
    raise AssertionError("unreachable")  # parser.error exits


def _dashed(argv: list[str]) -> list[str]:
    """llama-server's spelling rule: in a ``--long`` flag, ``_`` means ``-``
    (``--backend_sampling`` is ``--backend-sampling``); a ``--flag=value``'s value is kept."""
    out = []
    for a in argv:
        if a.startswith("--"):
            name, eq, value = a.partition("=")
            a = name.replace("_", "-") + eq + value
        out.append(a)
    return out


def ignored_flags(s: Settings) -> list[str]:
    """The accepted-and-ignored flags given whose value would change what llama-server does
    (a value equal to this server's own behaviour is not ignored, it is what happens)."""
    by_name = {c.name: c for c in COMPAT}
    out = []
    for name, value in s.compat.items():
        ours = by_name[name].ours
        if ours != ANY and value != ours:
            out.append(name)
    return out


def warn_ignored(s: Settings, log: logging.Logger | None = None) -> str | None:
    """Log one warning naming the ignored flags (by group); the message, or None if none."""
    names = ignored_flags(s)
    if not names:
        return None
    by_name = {c.name: c for c in COMPAT}
    spelled = ["/".join(f for f in by_name[n].flags if f.startswith("--")) for n in names]
    groups = sorted({by_name[n].group for n in names}, key=COMPAT_GROUPS.index)
    msg = (
        f"ignoring llama-server flags this server does not implement: {' '.join(spelled)} "
        f"({'; '.join(groups)})"
    )
    (log or logging.getLogger("server")).warning(msg)
    return msg


def load_api_keys(s: Settings) -> list[str]:
    keys = [k.strip() for k in (s.api_key or "").split(",") if k.strip()]
    if s.api_key_file:
        with open(s.api_key_file, encoding="utf-8") as f:
            keys += [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    return keys
