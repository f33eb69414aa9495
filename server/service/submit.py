"""The one path from a generating request to running tasks (``submit``): the front end
(server.prompts) turns each API body into one ``Submission``, the typed engine request,
whose ``source`` (a ``PromptSource``) does the body's tokenizer work."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from starlette.requests import Request

from ..constrained import Constraint
from ..engine.engine import Engine
from ..engine.model_api import ModelBackend
from ..image_types import PromptImage
from ..schemas.bodies import SamplingFields
from ..schemas.errors import APIError
from ..task import GenParams, ReasoningBudget
from ..tiers import tenancy
from .adapters import AdapterChoice
from .budget import BudgetAsk
from .pools import prepare_in
from .sampling import sampling_from, stops_from
from .state import ServerState, media_scope_of
from .stream_buffers import requested_name
from .tasks import TaskGroup
from .validation import bind_constraint, check_fits, check_tokens


class Prompt(NamedTuple):
    """One prompt's tokens; for chat, also where its last user turn starts."""

    tokens: list[int]
    user_start: int = -1  # token index of the last user turn (-1: unknown, or not chat)
    # the images among ``tokens`` (their placeholders there; server.image_types.PromptImage)
    images: tuple[PromptImage, ...] = ()


class PromptSource(Protocol):
    """What an API body asks the engine to run, as tokens: the front end implements it
    (server.prompts.sources), one class per kind of body.

    ``prompts()`` does the tokenizer work (it may render a chat template first) and runs in
    a worker thread; it may raise APIError. ``constraint()`` is the structured output /
    forced format (server.constrained): checking it compiles the client's schema (in a
    compile child), so it too runs in a worker thread. ``check()`` holds the endpoint's own
    body checks; it runs after the shared prompt and sampler checks and before submitting,
    which is where each endpoint made them before they shared this path (a request with
    several faults still reports the same one)."""

    def prompts(self) -> list[Prompt]: ...

    def constraint(self) -> Constraint | None: ...

    def check(self) -> None: ...


@dataclass(frozen=True)
class Submission:
    """The typed engine request of one API body, beyond the SamplingFields of its body:
    its prompts' ``source`` and how its tasks run. Each prompt runs ``n`` times (``n``
    choices)."""

    source: PromptSource
    max_tokens: int
    stream: bool
    n_probs: int = 0
    logprobs: bool = False
    n: int = 1
    return_progress: bool = False  # PromptProgress events while the prompt is processed
    timings_per_token: bool = False  # streamed text chunks carry timings
    # llama-server's post_sampling_probs: the n_probs reported are the sampler chain's
    # final distribution (SamplingParams.post_probs), not the model's
    post_sampling: bool = False
    # the reasoning budget (server.service.budget); a constrained request runs without it
    budget: BudgetAsk | None = None
    # control tokens the answer renders as text (a chat plan's markers: templates.control_tokens)
    preserved: frozenset[int] = frozenset()


def _checked_prompts(job: Submission, backend: ModelBackend) -> list[Prompt]:
    """``job.source.prompts()`` with every token id and every prompt's length checked."""
    prompts = job.source.prompts()
    for p in prompts:
        if not p.images:  # an image's placeholders are no token ids (the projector's own)
            check_tokens(p.tokens, backend)
        check_fits(p.tokens, backend)
    return prompts


class _Prepared(NamedTuple):
    engine: Engine
    adapters: AdapterChoice
    prompts: list[Prompt]
    constraint: Constraint | None
    budget: ReasoningBudget | None


def _prepare(st: ServerState, body: SamplingFields, job: Submission) -> _Prepared:
    """The slow checks of ``submit``, in one worker thread (one hand-off per request), in
    the order they always ran (a request with several faults reports the same one): the
    constraint (checking a schema or grammar may take a compile child
    --constraint-timeout seconds), the engine, the adapters, then the prompts (tokenizing a
    long prompt takes a while: off the event loop, so other streams keep flowing)."""
    constraint = job.source.constraint()
    engine = st.require_engine()
    adapters = st.adapters.resolve(body.lora, getattr(body, "model", None))
    b = st.require_backend()
    prompts = _checked_prompts(job, b)
    # after rendering: whether the prompt opened the reasoning is known then
    budget = job.budget.resolve(b) if job.budget and constraint is None else None
    return _Prepared(engine, adapters, prompts, constraint, budget)


def _gen_params(st: ServerState, body: SamplingFields, job: Submission) -> GenParams:
    """The generation settings of every task of ``job``."""
    return GenParams(
        # llama-server: a request without a limit (-1) gets --n-predict's; one with a limit
        # keeps it, above --n-predict too
        max_tokens=job.max_tokens if job.max_tokens >= 0 else st.settings.n_predict,
        stop=stops_from(body),
        ignore_eos=body.ignore_eos,
        n_probs=job.n_probs,
        logprobs=job.logprobs,
        spec_n_max=-1 if body.spec_n_max is None else body.spec_n_max,
        spec_n_min=-1 if body.spec_n_min is None else body.spec_n_min,
        spec_p_min=-1.0 if body.spec_p_min is None else body.spec_p_min,
        n_keep=st.settings.keep if body.n_keep is None else body.n_keep,
        n_discard=body.n_discard,
        n_cache_reuse=-1 if body.n_cache_reuse is None else body.n_cache_reuse,
        preserved=job.preserved,
    )


def _ping_interval(st: ServerState, body: SamplingFields) -> float:
    """Seconds a stream may stay silent before a ping (<= 0: never): the request's
    ``sse_ping_interval``, else --sse-ping-interval (llama-server's rule)."""
    given = body.sse_ping_interval
    return st.settings.sse_ping_interval if given is None else given


def _check_priority(st: ServerState, priority: int) -> None:
    """A non-zero ``priority`` needs --scheduling-policy priority: vLLM refuses a priority
    it would not honour too (400)."""
    if priority and st.settings.scheduling_policy != "priority":
        raise APIError(
            400,
            f"priority {priority} needs --scheduling-policy priority "
            f"(this server schedules {st.settings.scheduling_policy})",
        )


async def submit(
    st: ServerState,
    body: SamplingFields,
    job: Submission,
    tenant: str = "",
    request: Request | None = None,
) -> TaskGroup:
    """The one path from a generating request to running tasks.

    Requires the engine, tokenizes and checks the prompts, builds the sampler and generation
    settings, and submits ``len(prompts) * job.n`` tasks, prompt-major (choice ``i`` runs
    prompt ``i // job.n``). Raises APIError before anything runs: nothing to cancel then.
    The slow checks run on the request's preparation pool (``service.pools.prepare``):
    with ``request``, abandoned when its client leaves; 408 after --request-prep-timeout.
    A streamed request's ``X-Conversation-Id`` is checked first (service.stream_buffers).
    From its start until its tasks are handed over, the request counts as arriving on the
    engine (``Engine.arrival``), which coalesces a burst of arrivals only while one is on
    its way."""
    engine = st.engine
    if engine is None:
        return await _submit(st, body, job, tenant, request, lambda: None)
    engine.arrival(1)
    arrived = False

    def arrive() -> None:
        nonlocal arrived
        if not arrived:
            arrived = True
            engine.arrival(-1)

    try:
        return await _submit(st, body, job, tenant, request, arrive)
    finally:
        arrive()


async def _submit(
    st: ServerState,
    body: SamplingFields,
    job: Submission,
    tenant: str,
    request: Request | None,
    arrive: Callable[[], None],
) -> TaskGroup:
    """``submit``'s work; ``arrive()`` right before the tasks reach the engine (no await
    between them: the engine never counts a request that is already in its inbox)."""
    if job.stream and request is not None:
        requested_name(st.streams, request)
    _check_priority(st, body.priority)
    scope = media_scope_of(st, request, tenant)  # images: the tenant's caches, their lane
    timeout = st.settings.request_prep_timeout
    ready = await prepare_in(scope, request, timeout, _prepare, st, body, job)
    engine, adapters, prompts, constraint, budget = ready
    tenant = tenancy.with_adapters(tenant, adapters.key)  # the set joins the cache key
    b = st.require_backend()
    sampling = sampling_from(body, b, st.settings)
    if body.ignore_eos:  # as llama-server: every end-of-generation token banned
        sampling.logit_bias = {**sampling.logit_bias, **dict.fromkeys(b.eog_tokens(), -math.inf)}
    if job.post_sampling:
        sampling.post_probs = job.n_probs
    job.source.check()
    if constraint is not None:
        sampling.constraint = await bind_constraint(b, constraint)
    gen = _gen_params(st, body, job)
    gen.reasoning_budget = budget
    group = TaskGroup(
        engine,
        timeout=body.timeout or st.settings.timeout,
        max_queue=st.settings.max_queue,
        drain_deadline=lambda: st.drain_deadline,
        ping=_ping_interval(st, body) if job.stream else 0.0,
    )
    for p in prompts:
        for _ in range(job.n):
            group.add(
                p.tokens,
                sampling,
                gen,
                id_slot=body.id_slot,
                cache_prompt=body.cache_prompt,
                stream=job.stream,
                user_start=p.user_start,
                tenant=tenant,
                lora=adapters.scales,
                return_progress=job.return_progress,
                timings_per_token=job.timings_per_token,
                images=p.images,
                priority=body.priority,
            )
    arrive()
    group.submit()
    return group
