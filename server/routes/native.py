"""llama-server's native endpoints: /health, /props, /completion, /tokenize, /detokenize."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..schemas import DetokenizeRequest, NativeCompletionRequest, TokenizeRequest
from ..service import TaskGroup, check_fits, check_tokens, sampling_from, stops_from
from ..types import (
    FinishReason,
    GenParams,
    SamplingParams,
    Task,
    TaskError,
    TaskResult,
    TextChunk,
)
from .openai import SSE_HEADERS, sse, state_of, token_logprobs

router = APIRouter()


@router.get("/health")
@router.get("/v1/health")
async def health(request: Request) -> dict[str, str]:
    """200 once the model is loaded and the engine runs; otherwise a 503 error saying why."""
    state_of(request).require_engine()
    return {"status": "ok"}


def generation_settings(st: Any, task: Task | None = None) -> dict[str, Any]:
    """The settings a task runs with (a running task's own, else the server defaults)."""
    p = task.sampling if task is not None else SamplingParams()
    out = {
        "n_ctx": st.backend.n_ctx_slot,
        "n_predict": task.gen.max_tokens if task is not None else st.settings.n_predict,
        "temperature": p.temperature,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "min_p": p.min_p,
        "repeat_penalty": p.repeat_penalty,
        "repeat_last_n": p.repeat_last_n,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "seed": p.seed if task is not None else st.settings.seed,
    }
    if task is not None:
        out.update(
            stop=list(task.gen.stop),
            ignore_eos=task.gen.ignore_eos,
            n_probs=task.gen.n_probs,
            cache_prompt=task.cache_prompt,
            stream=task.stream,
            logit_bias=[[t, b] for t, b in task.sampling.logit_bias.items()],
        )
    return out


@router.get("/props")
async def props(request: Request) -> dict[str, Any]:
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
        },
    }


def _llama_version() -> str:
    try:
        import importlib.metadata as md

        return md.version("llama_cpp_python")
    except Exception:
        return "unknown"


def _stop_type(r: TaskResult) -> str:
    if r.finish is FinishReason.STOP:
        return "word" if r.stop_word else "eos"
    if r.finish is FinishReason.LENGTH:
        return "limit"
    return "none"


def _final(
    st: Any, r: TaskResult, content: str, prompt: Any, probs: bool = False
) -> dict[str, Any]:
    out = {
        "content": content,
        "id_slot": r.id_slot,
        "stop": True,
        "model": st.model_name,
        "tokens_predicted": r.timings.predicted_n,
        "tokens_evaluated": r.n_prompt,
        "tokens_cached": r.timings.cache_n,
        "generation_settings": generation_settings(st),
        "prompt": prompt,
        "has_new_line": "\n" in content,
        "truncated": False,
        "stop_type": _stop_type(r),
        "stopping_word": r.stop_word,
        "timings": r.timings.as_dict(),
    }
    if probs:
        out["completion_probabilities"] = token_logprobs(st.backend, r.logprobs, with_id=True)
    return out


@router.post("/completion")
async def completion(body: NativeCompletionRequest, request: Request):
    st = state_of(request)
    engine = st.require_engine()
    b = st.backend
    if isinstance(body.prompt, str):
        prompt = await asyncio.to_thread(b.tokenize, body.prompt, True, True)
    else:
        prompt = list(body.prompt)
        check_tokens(prompt, b)
    check_fits(prompt, b)
    gen = GenParams(
        max_tokens=body.max_tokens if body.max_tokens is not None else body.n_predict,
        stop=stops_from(body),
        ignore_eos=body.ignore_eos,
        n_probs=body.n_probs,
        logprobs=body.n_probs > 0,
    )
    group = TaskGroup(
        engine, timeout=body.timeout or st.settings.timeout, max_queue=st.settings.max_queue
    )
    group.add(
        prompt,
        sampling_from(body, b),
        gen,
        id_slot=body.id_slot,
        cache_prompt=body.cache_prompt,
        stream=body.stream,
    )
    group.submit()
    prompt_echo = body.prompt if isinstance(body.prompt, str) else ""

    if not body.stream:
        (r,) = await group.results(request)
        return JSONResponse(_final(st, r, r.text, prompt_echo, probs=gen.n_probs > 0))

    async def gen_events() -> AsyncIterator[str]:
        async for _, ev in group.events():
            if isinstance(ev, TextChunk):
                chunk = {"content": ev.text, "stop": False, "id_slot": -1, "tokens": ev.tokens}
                if gen.n_probs:
                    chunk["completion_probabilities"] = token_logprobs(b, ev.logprobs, with_id=True)
                yield sse(chunk)
            elif isinstance(ev, TaskResult):
                yield sse(_final(st, ev, "", prompt_echo))
            elif isinstance(ev, TaskError):
                yield sse({"error": {"code": ev.status, "message": ev.message, "type": ev.type}})

    return StreamingResponse(gen_events(), media_type="text/event-stream", headers=SSE_HEADERS)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
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
    st = state_of(request)
    st.require_engine()
    check_tokens(body.tokens, st.backend)
    return {"content": st.backend.detokenize(body.tokens)}
