"""llama-server's native endpoints: /health, /props, /completion, /tokenize, /detokenize."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..cancel import checkpoint
from ..engine_api import Tokenizer
from ..prompts.completion_forms import prompt_echo, split_prompts
from ..prompts.sources import NativeSource
from ..prompts.submissions import native_request
from ..schemas.bodies import (
    DetokenizeRequest,
    InfillRequest,
    NativeCompletionRequest,
    TokenizeRequest,
)
from ..schemas.errors import APIError
from ..service.state import ServerState, tenant_of
from ..service.submit import PromptSource, submit
from ..service.tasks import TaskGroup
from ..service.tokenizer import tokenize as tokenize_text
from ..service.validation import check_tokens
from ..task import (
    Event,
    FinishReason,
    PromptProgress,
    Task,
    TaskError,
    TaskResult,
    TextChunk,
    TokenLogprob,
)
from .common import (
    Frame,
    TokenProb,
    generation_settings,
    json_ints,
    json_str,
    llama_version,
    prep,
    sse,
    sse_batches,
    sse_error,
    state_of,
    token_logprobs,
)
from .streams import sse_response

router = APIRouter()


@router.get("/health")
@router.get("/v1/health")
async def health(request: Request) -> dict[str, str]:
    """200 once the model is loaded and the engine runs (or sleeps: the next task reloads
    it); otherwise a 503 error saying why."""
    st = state_of(request)
    if not st.sleeping:
        st.require_engine()
    return {"status": "ok"}


@router.get("/props")
async def props(request: Request) -> dict[str, object]:
    """llama-server's /props: default settings, model and context facts, engine counters;
    while sleeping, what it said just before (``is_sleeping`` true)."""
    st = state_of(request)
    if st.sleeping:  # asleep once the model is freed (its engine gone)
        return {**st.sleep_props, "is_sleeping": st.engine is None}
    return props_of(st)


def props_of(st: ServerState) -> dict[str, object]:
    """The /props object of a loaded server (a 503 APIError while loading)."""
    engine = st.require_engine()
    b = st.require_backend()
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
        # what a request may carry (llama-server's field; both false without a projector):
        # images where the projector reads them; audio never yet, whatever the projector
        # reads (audio inputs are refused: a client that believed the flag would fail)
        "modalities": {
            "vision": bool(st.projector and st.projector.vision),
            "audio": False,
        },
        # what stands for an image in a /completion prompt_string (multimodal_data), random
        # per process unless LLAMA_MEDIA_MARKER is set, as llama-server's (null: no projector)
        "media_marker": st.projector.marker if st.projector else None,
        "model_path": st.model_path,
        "model_alias": st.model_name,
        "chat_template": st.template.source if st.template else "",
        "chat_template_name": st.template.name if st.template else "",
        # a built-in template picked by architecture: the model has none (a base model)
        "chat_template_fallback": not (
            b.chat_template or st.settings.chat_template or st.settings.chat_template_file
        ),
        "bos_token": b.bos_text,
        "eos_token": b.eos_text,
        "build_info": f"llama-cpp-python {llama_version()}",
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
            "step_seconds_fixed": engine.step_speed[0],
            "step_seconds_per_token": engine.step_speed[1],
        },
        "endpoint_slots": st.settings.slots,
        "endpoint_props": st.settings.props,
        "endpoint_metrics": st.settings.metrics,
        "is_sleeping": False,
    }


@router.post("/props")
async def change_props(request: Request) -> dict[str, object]:
    """llama-server's POST /props: 501 unless started with --props; with it, accepted and (as
    there) nothing is changed yet."""
    if not state_of(request).settings.props:
        raise APIError(
            501,
            "This server does not support changing global properties. Start it with `--props`",
        )
    return {"success": True}


def _stop_type(r: TaskResult) -> str:
    """llama-server's ``stop_type``: "eos", "word" (a stop string), "limit" or "none"."""
    if r.finish is FinishReason.STOP:
        return "word" if r.stop_word else "eos"
    if r.finish is FinishReason.LENGTH:
        return "limit"
    return "none"


def completion_object(
    st: ServerState,
    task: Task,
    r: TaskResult,
    content: str,
    prompt: str,
    probs: bool = False,
    index: int = 0,
    tokens: bool = False,
) -> dict[str, object]:
    """The last (or only) /completion object of ``task`` (prompt ``index`` of the request):
    its content (empty when streamed), counts, timings and the settings it ran with;
    ``probs`` adds the per-token probabilities (streams sent them with each chunk), and
    ``tokens`` (return_tokens) the generated ids (llama-server sends ``tokens`` empty else)."""
    out = {
        "index": index,
        "content": content,
        "tokens": list(r.tokens) if tokens else [],
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
        out["completion_probabilities"] = completion_probs(st, task, r.logprobs)
    return out


def completion_probs(
    st: ServerState, task: Task, lps: list[TokenLogprob]
) -> list[TokenProb] | list[dict[str, object]]:
    """llama-server's ``completion_probabilities``: log-probabilities (``logprob``,
    ``top_logprobs``), or with post_sampling_probs the probabilities the sampler chain left
    (``prob``, ``top_probs``)."""
    out = token_logprobs(st.require_backend(), lps, with_id=True)
    if not task.sampling.post_probs:
        return out

    def prob(e: TokenProb) -> dict[str, object]:
        return {
            "id": e["id"],
            "token": e["token"],
            "bytes": e["bytes"],
            "prob": math.exp(e["logprob"]),
        }

    # n_probs entries per token: no loop over the vocabulary
    return [{**prob(e), "top_probs": [prob(x) for x in e["top_logprobs"]]} for e in out]


@router.post("/completion")
@router.post("/completions")  # llama-server: the native route, not OpenAI's
async def completion(body: NativeCompletionRequest, request: Request) -> Response:
    """llama-server's completion: one prompt, one result object (or a stream of chunks)."""
    st = state_of(request)
    raw = split_prompts(body.prompt)
    echoes = [prompt_echo(p) for p in raw]
    return await run_native(st, request, body, NativeSource(st, body, raw), echoes)


async def run_native(
    st: ServerState,
    request: Request,
    body: NativeCompletionRequest | InfillRequest,
    source: PromptSource,
    echoes: list[str] | None = None,
) -> Response:
    """Run one native-completion request (/completion, /infill) on ``source``: the final
    object (a list of them, by prompt, for several prompts), or the stream of chunks (each
    with its prompt's ``index``). ``echoes``: the ``prompt`` each result echoes (by default
    a text ``prompt`` of the body: llama-server echoes text only)."""
    job = native_request(st, body, source)
    group = await submit(st, body, job, tenant_of(st, request, body.cache_salt), request)
    if echoes is None:
        echoes = [body.prompt if isinstance(body.prompt, str) else ""] * len(group.tasks)
    if not body.stream:
        results = await group.results(request)
        fields = body.response_fields
        out = [
            pick_fields(
                completion_object(
                    st,
                    t,
                    r,
                    r.text,
                    echoes[i],
                    probs=body.n_probs > 0,
                    index=i,
                    tokens=body.return_tokens,
                ),
                fields,
            )
            for i, (t, r) in enumerate(zip(group.tasks, results, strict=True))
        ]
        # llama-server: one prompt, one object; several, a list
        return JSONResponse(out[0] if len(out) == 1 else out)
    return sse_response(request, group, _stream(st, group, echoes, body.response_fields))


def pick_fields(obj: dict[str, object], fields: list[str] | None) -> dict[str, object]:
    """llama-server's ``response_fields``: only the named fields of a final object, a path
    ``a/b`` naming ``obj["a"]["b"]`` (kept under the name ``a/b``); missing ones are left out.
    None or empty: the whole object."""
    if not fields:
        return obj
    out: dict[str, object] = {}
    for path in fields:
        cur: object = obj
        for key in path.split("/"):
            if not isinstance(cur, dict) or key not in cur:
                break
            cur = cur[key]
        else:
            out[path] = cur
    return out


def _stream(
    st: ServerState, group: TaskGroup, echoes: list[str], fields: list[str] | None = None
) -> AsyncIterator[str]:
    """The SSE events of a streamed /completion: text chunks, then the final object or an
    error event, each with its prompt's ``index`` (the prompts run interleaved). Unlike the
    OpenAI streams there is no [DONE] (llama-server sends none). The events delivered
    together go out in one write; a reader far behind gets its text coalesced
    (``TaskGroup.batches``)."""
    plain: dict[int, Frame | None] = {}

    def add(out: list[str], i: int, ev: Event) -> None:
        task = group.tasks[i]
        if isinstance(ev, TextChunk):
            if ev.timings is None and not task.gen.n_probs:
                if i not in plain:
                    plain[i] = Frame.of(_text_chunk(i, Frame.hole(0), Frame.hole(1)), 2)
                frame = plain[i]
                if frame is not None:
                    out.append(frame.fill(json_str(ev.text), json_ints(ev.tokens)))
                    return
            chunk = _text_chunk(i, ev.text, ev.tokens)
            if task.gen.n_probs:
                chunk["completion_probabilities"] = completion_probs(st, task, ev.logprobs)
            if ev.timings is not None:
                chunk["timings"] = ev.timings.as_dict()
            out.append(sse(chunk))
        elif isinstance(ev, PromptProgress):
            out.append(sse({**progress_chunk(ev), "index": i}))
        elif isinstance(ev, TaskResult):
            obj = completion_object(st, task, ev, "", echoes[i], index=i)
            out.append(sse(pick_fields(obj, fields)))
        elif isinstance(ev, TaskError):
            out.append(sse_error(ev))

    return sse_batches(group, add, coalesce=True)


def _text_chunk(index: int, text: str, tokens: list[int] | str) -> dict[str, object]:
    """A streamed /completion text chunk (before its optional probabilities and timings)."""
    return {"index": index, "content": text, "stop": False, "id_slot": -1, "tokens": tokens}


def progress_chunk(ev: PromptProgress) -> dict[str, object]:
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
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, object]:
    """Token ids of ``content``; ``with_pieces`` pairs each with its text (its bytes as a
    list where they are not valid UTF-8 alone, e.g. part of a multi-byte character)."""
    st = state_of(request)
    st.require_engine()
    return await prep(request, _tokenized, st.require_backend(), body)


def _tokenized(b: Tokenizer, body: TokenizeRequest) -> dict[str, object]:
    """/tokenize's answer (worker thread: a long text takes a while)."""
    toks = tokenize_text(b, body.content, body.add_special, body.parse_special)
    if not body.with_pieces:
        return {"tokens": toks}
    out = []
    for i, t in enumerate(toks):
        if i % 4096 == 0:
            checkpoint()  # the client may have left
        raw = b.token_to_piece(t, special=True)
        try:
            piece: str | list[int] = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        out.append({"id": t, "piece": piece})
    return {"tokens": out}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, object]:
    """The text of ``tokens``; APIError 400 for an id outside the vocabulary."""
    st = state_of(request)
    st.require_engine()
    return await prep(request, _detokenized, st.require_backend(), body.tokens)


def _detokenized(b: Tokenizer, tokens: list[int]) -> dict[str, object]:
    """/detokenize's answer (worker thread: a long list takes a while)."""
    check_tokens(tokens, b)
    return {"content": b.detokenize(tokens)}
