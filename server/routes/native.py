"""llama-server's native endpoints: /health, /props, /completion, /tokenize, /detokenize."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..errors import APIError
from ..schemas import DetokenizeRequest, NativeCompletionRequest, TokenizeRequest
from ..service import (
    Prompt,
    ServerState,
    Submission,
    TaskGroup,
    check_tokens,
    constraint_of,
    submit,
    tenant_of,
)
from ..types import FinishReason, PromptProgress, Task, TaskError, TaskResult, TextChunk
from .common import SSE_HEADERS, generation_settings, sse, sse_error, state_of, token_logprobs

router = APIRouter()


@router.get("/health")
@router.get("/v1/health")
async def health(request: Request) -> dict[str, str]:
    """200 once the model is loaded and the engine runs; otherwise a 503 error saying why."""
    state_of(request).require_engine()
    return {"status": "ok"}


@router.get("/props")
async def props(request: Request) -> dict[str, Any]:
    """llama-server's /props: default settings, model and context facts, engine counters."""
    st = state_of(request)
    engine = st.require_engine()
    b = st.backend
    return {
        "default_generation_settings": {
            **generation_settings(st),
            "params": generation_settings(st),
        },
        "total_slots": len(engine.slots),
        "n_ctx": b.n_ctx,
        "n_ctx_slot": b.n_ctx_slot,
        "n_ctx_train": b.n_ctx_train,
        "n_swa": b.n_swa,
        "kv_unified": b.kv_unified,
        "model_path": st.model_path,
        "model_alias": st.model_name,
        "chat_template": st.template.source if st.template else "",
        "chat_template_name": st.template.name if st.template else "",
        "bos_token": b.bos_text,
        "eos_token": b.eos_text,
        "build_info": f"llama-cpp-python {_llama_version()}",
        "ctx_checkpoints": engine.opts.ctx_checkpoints if engine.ckpt.enabled else 0,
        # Scheduler overhead = step time outside llama_decode (bench workload 6).
        "engine": {
            "n_steps": engine.stats.n_steps,
            "step_seconds_total": engine.stats.step_seconds_total,
            "decode_seconds_total": engine.stats.decode_seconds_total,
            "n_decode_total": engine.stats.n_decode_total,
            # -bs: requests whose sampler ran on the backend, and CPU fallbacks by reason
            "backend_sampled": engine.stats.backend_sampled,
            "backend_sampling_fallbacks": dict(engine.stats.sampling_fallbacks),
            # in-flight prefix sharing: waits skipped or given up because computing was
            # estimated faster, and the step-cost estimate behind that (null: none yet)
            "prefix_shared_tokens": engine.stats.prefix_shared_tokens,
            "prefix_waits_skipped": engine.stats.prefix_waits_skipped,
            "prefix_waits_abandoned": engine.stats.prefix_waits_abandoned,
            "step_seconds_fixed": engine.sharing.speed.per_step,
            "step_seconds_per_token": engine.sharing.speed.per_token,
        },
        "endpoint_slots": st.settings.slots,
        "endpoint_props": st.settings.props,
        "endpoint_metrics": st.settings.metrics,
    }


@router.post("/props")
async def change_props(request: Request) -> dict[str, Any]:
    """llama-server's POST /props: 501 unless started with --props; with it, accepted and (as
    there) nothing is changed yet."""
    if not state_of(request).settings.props:
        raise APIError(
            501,
            "This server does not support changing global properties. Start it with `--props`",
        )
    return {"success": True}


def _llama_version() -> str:
    """The installed llama-cpp-python's version (``unknown`` where metadata is missing)."""
    try:
        import importlib.metadata as md

        return md.version("llama_cpp_python")
    except Exception:  # a vendored or source build has no metadata: not worth failing /props
        return "unknown"


def _stop_type(r: TaskResult) -> str:
    """llama-server's ``stop_type``: "eos", "word" (a stop string), "limit" or "none"."""
    if r.finish is FinishReason.STOP:
        return "word" if r.stop_word else "eos"
    if r.finish is FinishReason.LENGTH:
        return "limit"
    return "none"


def _final(
    st: ServerState, task: Task, r: TaskResult, content: str, prompt: str, probs: bool = False
) -> dict[str, Any]:
    """The last (or only) /completion object of ``task``: its content (empty when streamed),
    counts, timings and the settings it ran with; ``probs`` adds the per-token probabilities
    (streams sent them with each chunk)."""
    out = {
        "content": content,
        "id_slot": r.id_slot,
        "stop": True,
        "model": st.model_name,
        "tokens_predicted": r.timings.predicted_n,
        "tokens_evaluated": r.n_prompt,
        "tokens_cached": r.timings.cache_n,
        "generation_settings": generation_settings(st, task),
        "prompt": prompt,
        "has_new_line": "\n" in content,
        "truncated": r.truncated,
        "stop_type": _stop_type(r),
        "stopping_word": r.stop_word,
        "timings": r.timings.as_dict(),
    }
    if probs:
        out["completion_probabilities"] = token_logprobs(st.backend, r.logprobs, with_id=True)
    return out


def _native_prompt(st: ServerState, prompt: str | list[int]) -> list[Prompt]:
    """Text is tokenized with BOS and special tokens parsed; token lists are taken as they are."""
    if isinstance(prompt, str):
        return [Prompt(st.backend.tokenize(prompt, True, True))]
    return [Prompt(list(prompt))]


@router.post("/completion")
async def completion(body: NativeCompletionRequest, request: Request) -> Response:
    """llama-server's completion: one prompt, one result object (or a stream of chunks)."""
    st = state_of(request)
    return await run_native(st, request, body, lambda: _native_prompt(st, body.prompt))


async def run_native(
    st: ServerState, request: Request, body: Any, prompts: Callable[[], list[Prompt]]
) -> Response:
    """Run one native-completion request (/completion, /infill) on ``prompts()``: the final
    object, or the stream of chunks. llama-server echoes a text ``prompt`` only."""
    job = Submission(
        prompts=prompts,
        max_tokens=body.max_tokens if body.max_tokens is not None else body.n_predict,
        stream=body.stream,
        n_probs=body.n_probs,
        logprobs=body.n_probs > 0,
        constraint=constraint_of(json_schema=body.json_schema, grammar=body.grammar),
        return_progress=body.return_progress,
        timings_per_token=body.timings_per_token,
    )
    group = await submit(st, body, job, tenant_of(st, request, body.cache_salt))
    prompt_echo = body.prompt if isinstance(body.prompt, str) else ""
    if not body.stream:
        (r,) = await group.results(request)
        return JSONResponse(
            _final(st, group.tasks[0], r, r.text, prompt_echo, probs=body.n_probs > 0)
        )
    return StreamingResponse(
        _stream(st, group, prompt_echo), media_type="text/event-stream", headers=SSE_HEADERS
    )


async def _stream(st: ServerState, group: TaskGroup, prompt_echo: str) -> AsyncIterator[str]:
    """The SSE events of a streamed /completion: text chunks, then the final object or an
    error event. Unlike the OpenAI streams there is no [DONE] (llama-server sends none)."""
    (task,) = group.tasks
    async for _, ev in group.events():
        if isinstance(ev, TextChunk):
            chunk: dict[str, Any] = {
                "content": ev.text,
                "stop": False,
                "id_slot": -1,
                "tokens": ev.tokens,
            }
            if task.gen.n_probs:
                chunk["completion_probabilities"] = token_logprobs(
                    st.backend, ev.logprobs, with_id=True
                )
            if ev.timings is not None:
                chunk["timings"] = ev.timings.as_dict()
            yield sse(chunk)
        elif isinstance(ev, PromptProgress):
            yield sse(progress_chunk(ev))
        elif isinstance(ev, TaskResult):
            yield sse(_final(st, task, ev, "", prompt_echo))
        elif isinstance(ev, TaskError):
            yield sse_error(ev)


def progress_chunk(ev: PromptProgress) -> dict[str, Any]:
    """llama-server's /completion (and /infill) progress chunk: no text, ``prompt_progress``."""
    return {
        "index": 0,
        "content": "",
        "tokens": [],
        "stop": False,
        "id_slot": -1,
        "tokens_predicted": 0,
        "tokens_evaluated": ev.total,
        "prompt_progress": ev.as_dict(),
        **({"timings": ev.timings.as_dict()} if ev.timings is not None else {}),
    }


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    """Token ids of ``content``; ``with_pieces`` pairs each with its text (its bytes as a
    list where they are not valid UTF-8 alone, e.g. part of a multi-byte character)."""
    st = state_of(request)
    st.require_engine()
    b = st.backend
    toks = await asyncio.to_thread(b.tokenize, body.content, body.add_special, body.parse_special)
    if not body.with_pieces:
        return {"tokens": toks}
    out = []
    for t in toks:
        raw = b.token_to_piece(t, special=True)
        try:
            piece: str | list[int] = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        out.append({"id": t, "piece": piece})
    return {"tokens": out}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    """The text of ``tokens``; APIError 400 for an id outside the vocabulary."""
    st = state_of(request)
    st.require_engine()
    check_tokens(body.tokens, st.backend)
    return {"content": st.backend.detokenize(body.tokens)}
