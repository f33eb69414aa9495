"""Helpers shared by the route modules: the server state of a request, SSE framing, token
log-probabilities and the generation settings that /props, /slots and /completion report."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from json.encoder import encode_basestring
from typing import ParamSpec, TypedDict, TypeVar

from fastapi import Request
from typing_extensions import NotRequired

from ..engine_api import Tokenizer
from ..json_value import JsonObject
from ..schemas.errors import error_body
from ..service.pools import prepare_in
from ..service.sampling import default_sampling
from ..service.state import ServerState, media_scope_of, tenant_of
from ..service.tasks import TaskGroup
from ..task import Event, SamplingParams, Task, TaskError, TokenLogprob

# Proxies (nginx) buffer responses unless told not to; a buffered stream arrives all at once.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DONE = "data: [DONE]\n\n"


def state_of(request: Request) -> ServerState:
    """The ServerState that ``create_app`` attached to the application."""
    return request.app.state.server


T = TypeVar("T")
P = ParamSpec("P")


def _salt_of(args: tuple[object, ...]) -> str | None:
    """The ``cache_salt`` of the body among a hand-off's arguments (None: none given)."""
    for a in args:
        salt = getattr(a, "cache_salt", None)
        if isinstance(salt, str):
            return salt
    return None


async def prep(request: Request, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args)`` off the event loop, on the request's own preparation pool
    (server.service.pools): abandoned when the client leaves, 408 once the request's
    preparation has taken --request-prep-timeout seconds. Images (the token counts and
    renders of bodies with images) decode as a generation's would: on the media lane, in
    the request's tenant's caches (its body's ``cache_salt`` included)."""
    st = state_of(request)
    scope = media_scope_of(st, request, tenant_of(st, request, _salt_of(args)))
    return await prepare_in(scope, request, st.settings.request_prep_timeout, fn, *args, **kwargs)


def sse(obj: object) -> str:
    """One server-sent event carrying ``obj`` as JSON (non-ASCII text kept as is)."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_named(events: Sequence[tuple[str, object]]) -> str:
    """Named server-sent events, as Anthropic and llama-server's Responses stream frame
    them: per ``(name, data)`` an ``event:`` line (Anthropic's SDK reads only named
    events), then ``data:`` with ``data`` as JSON (non-ASCII text kept as is)."""
    return "".join(
        f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n" for name, data in events
    )


# How a stream renders one engine event: ``add(out, index, event)`` appends the SSE text of
# task ``index``'s ``event`` to ``out`` (nothing where the event shows nothing).
AddEvent = Callable[[list[str], int, Event], None]


# llama-server's keep-alive while a stream is silent (--sse-ping-interval): an SSE comment
# line, which every SSE client skips (some, e.g. undici, time out after a silence).
SSE_PING = ":\n\n"


async def sse_batches(group: TaskGroup, add: AddEvent, coalesce: bool) -> AsyncIterator[str]:
    """The SSE text of ``group``'s events, one string per batch (``TaskGroup.batches``):
    the events delivered together go out in one write, each rendered by ``add`` in order,
    so the bytes are those of rendering them one at a time (a batch that renders to
    nothing is not written). ``coalesce``: a reader far behind gets its text merged
    (only for a stream whose text events are valid for any run of text). Leaving the
    iteration early closes the batches at once, which cancels the unfinished tasks. An empty
    batch (the group's ping interval passed in silence) is written as ``SSE_PING``."""
    async with contextlib.aclosing(group.batches(coalesce=coalesce)) as batches:
        async for batch in batches:
            if not batch:  # silent for the group's ping interval: llama-server's ping
                yield SSE_PING
                continue
            out: list[str] = []
            for index, ev in batch:
                add(out, index, ev)
            text = "".join(out)
            if text:
                yield text


# json.dumps(s, ensure_ascii=False) of a str, without the encoder's set-up: the function
# json.dumps itself uses for every string (so a frame built with it is byte-identical).
json_str = encode_basestring


def json_ints(values: list[int]) -> str:
    """``json.dumps(values)`` of a list of ints, byte-identical."""
    return "[" + ", ".join(map(str, values)) + "]" if values else "[]"


class Frame:
    """A prebuilt SSE frame with holes: ``sse(obj)`` where ``obj`` holds ``Frame.hole(k)``
    strings, cut at them, so ``fill(*fragments)`` gives ``sse(obj)`` with hole k replaced by
    the JSON text ``fragments[k]`` (``json_str(text)``, ``json_ints(tokens)``): the bytes of
    ``sse`` on the same object, without building or encoding it per token. ``None`` from
    ``of`` when a hole is not found exactly once (the caller takes the slow path)."""

    _MARK = f"\x00hole-{uuid.uuid4().hex}-"  # random: no client text can hold it

    def __init__(self, parts: list[str]) -> None:
        self.parts = parts

    @staticmethod
    def hole(k: int) -> str:
        return f"{Frame._MARK}{k}\x00"

    @classmethod
    def of(cls, obj: object, holes: int) -> Frame | None:
        text = sse(obj)
        parts: list[str] = []
        for k in range(holes):
            head, *rest = text.split(json_str(cls.hole(k)))
            if len(rest) != 1:
                return None
            parts.append(head)
            text = rest[0]
        parts.append(text)
        return cls(parts)

    @classmethod
    def named(cls, name: str, obj: object, holes: int) -> Frame | None:
        """``of`` for a named event: the bytes of ``sse_named([(name, obj)])``."""
        frame = cls.of(obj, holes)
        if frame is not None:
            frame.parts[0] = f"event: {name}\n{frame.parts[0]}"
        return frame

    def fill(self, *fragments: str) -> str:
        if len(fragments) == 1:
            return self.parts[0] + fragments[0] + self.parts[1]
        out = [self.parts[0]]
        for frag, part in zip(fragments, self.parts[1:], strict=True):
            out += (frag, part)
        return "".join(out)


def sse_error(err: TaskError) -> str:
    """A task's error as an SSE event: the same body a non-streaming request gets with its
    status (a stream has already sent 200, so the error travels in the stream)."""
    return sse(error_body(err.status, err.message, err.type, **err.extra))


class TokenProb(TypedDict):
    """A token's entry in OpenAI's chat ``logprobs.content`` and llama-server's
    ``completion_probabilities`` (``id`` with ``with_id``)."""

    token: str
    logprob: float
    bytes: list[int]
    id: NotRequired[int]
    top_logprobs: NotRequired[list[TokenProb]]


def token_logprobs(
    backend: Tokenizer, lps: list[TokenLogprob], with_id: bool = False
) -> list[TokenProb]:
    """Per token: text, log-probability, bytes (and id), with the top alternatives alike.
    The shape of OpenAI's chat ``logprobs.content`` and llama-server's ``completion_probabilities``."""

    def entry(tok: int, lp: float) -> TokenProb:
        raw = backend.token_to_piece(tok)
        e: TokenProb = {"token": raw.decode("utf-8", "replace"), "logprob": lp, "bytes": list(raw)}
        return {"id": tok, **e} if with_id else e

    return [
        {**entry(lp.token, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
        for lp in lps
    ]


def generation_settings(st: ServerState, task: Task | None = None) -> JsonObject:
    """The settings a task runs with: ``task``'s own, or without one the server defaults.
    Only a task adds the per-request fields (stop strings, logit bias, streaming, ...)."""
    p = task.sampling if task is not None else default_sampling(st.settings)
    out: JsonObject = {
        "n_ctx": st.require_backend().n_ctx_slot,
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
        "n_keep": task.gen.n_keep if task is not None else st.settings.keep,
        **sampler_settings(p),
    }
    if task is not None:
        out.update(
            stop=list(task.gen.stop),
            ignore_eos=task.gen.ignore_eos,
            n_probs=task.gen.n_probs,
            cache_prompt=task.cache_prompt,
            stream=task.stream,
            # llama-server's objects; a banned token's -inf is null, as its JSON writes it
            logit_bias=[
                {"bias": b if math.isfinite(b) else None, "token": t}
                for t, b in task.sampling.logit_bias.items()
            ],
            n_discard=task.gen.n_discard,
        )
    return out


def sampler_settings(p: SamplingParams) -> JsonObject:
    """The rest of llama-server's sampler settings, under its names."""
    return {
        "dynatemp_range": p.dynatemp_range,
        "dynatemp_exponent": p.dynatemp_exponent,
        "top_n_sigma": p.top_n_sigma,
        "xtc_probability": p.xtc_probability,
        "xtc_threshold": p.xtc_threshold,
        "typical_p": p.typical_p,
        "dry_multiplier": p.dry_multiplier,
        "dry_base": p.dry_base,
        "dry_allowed_length": p.dry_allowed_length,
        "dry_penalty_last_n": p.dry_penalty_last_n,
        "dry_sequence_breakers": list(p.dry_sequence_breakers),
        "mirostat": p.mirostat,
        "mirostat_tau": p.mirostat_tau,
        "mirostat_eta": p.mirostat_eta,
        "adaptive_target": p.adaptive_target,
        "adaptive_decay": p.adaptive_decay,
        "min_keep": p.min_keep,
        "samplers": list(p.samplers),
        "post_sampling_probs": p.post_probs > 0,
    }


@functools.cache
def llama_version() -> str:
    """The installed llama-cpp-python's version (``unknown`` where metadata is missing)."""
    try:
        import importlib.metadata as md

        return md.version("llama_cpp_python")
    except Exception:  # a vendored or source build has no metadata: not worth failing /props
        return "unknown"


def system_fingerprint() -> str:
    """OpenAI's ``system_fingerprint``: the build that answered. llama-server sends its
    build tag (``b<number>-<commit>``); ours is ``b<llama-cpp-python version>-slot``."""
    return f"b{llama_version()}-slot"
