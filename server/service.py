"""Glue between HTTP handlers and the engine: state, task submission, event streams.

Every generating endpoint goes through ``submit``: it tokenizes off the event loop, checks the
prompts, builds the sampler and generation settings and hands the tasks to the engine. An
endpoint describes only what is its own in a ``Submission``."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .api.chat import ChatTemplate
from .api.errors import APIError
from .api.schemas import SamplingFields
from .cache import tenancy
from .cli.config import Settings
from .constrained import CompiledConstraint, Constraint, ConstraintError, request_constraint
from .constrained.matcher import compile_executor
from .slots.engine import Engine, EngineDead
from .types import (
    Event,
    FinishReason,
    GenParams,
    SamplingParams,
    Task,
    TaskError,
    TaskResult,
    Timings,
)

log = logging.getLogger("server.service")


@dataclass
class ServerState:
    """What the routes share: settings, and once loaded the model, engine and chat template.

    ``loading`` is true until the loader thread finished, successfully or not; on failure
    ``load_error`` says why and ``engine`` stays None."""

    settings: Settings
    backend: Any = None
    draft: Any = None  # the draft model's context (draft-simple), owned like ``backend``
    engine: Engine | None = None
    template: ChatTemplate | None = None
    model_name: str = ""
    model_aliases: list[str] = field(default_factory=list)  # --alias a,b,c (sorted)
    model_path: str = ""
    loading: bool = True
    load_error: str = ""
    on_load_failed: Callable[[], None] | None = None  # set by the CLI: stop serving
    metrics: Any = None
    started: float = field(default_factory=time.time)
    # Set on SIGTERM (time.monotonic): running requests may finish until then; the rest end
    # with an error event (streams) or a 503.
    drain_deadline: float | None = None

    def require_engine(self) -> Engine:
        """The running engine, or an APIError 503 saying why there is none."""
        if self.loading:
            raise APIError(503, "Loading model", "unavailable_error")
        if self.engine is None or not self.engine.alive:
            raise APIError(
                503,
                "the engine is not running: " + (self.load_error or "it stopped"),
                "unavailable_error",
            )
        return self.engine


def tenant_of(st: ServerState, request: Any, cache_salt: str | None = None) -> str:
    """Whose cached prefixes a request may reuse (--cache-isolation; names: cache/tenancy.py):

    - ``none``: everyone's, except that a ``cache_salt`` keeps a request to its salt's;
    - ``key``: its API key's (and, within it, its salt's);
    - ``salt``: its salt's; a request without one shares with nobody, ever: it gets a fresh
      random tenant that no other request, process or replica can hold, and that is never
      written to disk.

    Key and salt tenants are digests, the same in every process (restarts, replicas).
    """
    mode = st.settings.cache_isolation
    salt = tenancy.salt_tenant(cache_salt) if cache_salt else ""
    if mode == "key":
        key = getattr(getattr(request, "state", None), "api_key_id", "")
        return f"key:{key}" + (f"/{salt}" if salt else "")
    if mode == "salt" and not salt:
        return tenancy.private_tenant()
    return salt


SAMPLING_FIELDS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "repeat_penalty",
    "repeat_last_n",
    "presence_penalty",
    "frequency_penalty",
)


def default_sampling(s: Settings | None) -> SamplingParams:
    """The server's default sampler settings: llama-server's, or those of the flags
    (--temp, --top-k, ..., -s) when ``s`` is given."""
    if s is None:
        return SamplingParams()
    return SamplingParams(**{name: getattr(s, name) for name in SAMPLING_FIELDS})


def sampling_from(
    req: SamplingFields, backend: Any, settings: Settings | None = None
) -> SamplingParams:
    """The request's sampler settings over the server defaults (``default_sampling``): a field
    the request leaves out (or sets to null) gets the default. APIError 400 for a top_k above
    the vocabulary or a bad logit_bias."""
    p = default_sampling(settings)
    for name in SAMPLING_FIELDS:
        v = getattr(req, name)
        if v is not None:
            setattr(p, name, v)
    if p.top_k > backend.n_vocab:
        raise APIError(400, f"top_k must be at most the vocabulary size ({backend.n_vocab})")
    if req.logit_bias:
        p.logit_bias = _logit_bias(req.logit_bias, backend)
    return p


def _logit_bias(raw: dict[str, Any] | list[list[Any]], backend: Any) -> dict[int, float]:
    """llama-server's logit_bias forms as token -> bias: ``[[tok, bias], ...]`` or
    ``{"tok": bias}``, where ``tok`` is a token id or a text whose every token (tokenized
    without BOS) gets the bias, and ``false`` as the bias bans the token. Unlike there, an
    entry that is not a pair, a bias that is neither a number nor false, an id outside the
    vocabulary or a bias outside [-100, 100] is a 400, never silently skipped."""
    if isinstance(raw, dict):
        items: list[tuple[Any, Any]] = list(raw.items())
    else:
        if not all(isinstance(x, list) and len(x) == 2 for x in raw):
            raise APIError(400, "logit_bias entries must be [token, bias] pairs")
        items = [(x[0], x[1]) for x in raw]
    out: dict[int, float] = {}
    for k, v in items:
        bias = _bias_value(v)
        if bias is None:
            raise APIError(400, f"logit_bias value for {k!r} must be a number or false")
        if bias != bias or (abs(bias) > 100 and bias != float("-inf")):
            raise APIError(400, f"logit_bias value for {k!r} must be within [-100, 100]")
        for tok in _bias_tokens(k, backend, isinstance(raw, dict)):
            out[tok] = bias
    return out


def _bias_value(v: Any) -> float | None:
    """A logit_bias value as a float (``false``: -inf), None when it is neither."""
    if v is False:
        return float("-inf")
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v)


def _bias_tokens(key: Any, backend: Any, from_dict: bool) -> list[int]:
    """The tokens one logit_bias key names: an id (a whole decimal string in the object
    form), or the tokens of a text. APIError 400 for an id outside the vocabulary."""
    tok: int | None = None
    if isinstance(key, int) and not isinstance(key, bool):
        tok = key
    elif isinstance(key, str) and from_dict:
        try:
            tok = int(key)
        except ValueError:
            tok = None
    if tok is None:
        if not isinstance(key, str):
            return []
        return backend.tokenize(key, False, False)
    if not 0 <= tok < backend.n_vocab:
        raise APIError(
            400, f"logit_bias token {tok} is outside the vocabulary (0..{backend.n_vocab - 1})"
        )
    return [tok]


def constraint_of(
    *, response_format: Any = None, json_schema: Any = None, grammar: Any = None
) -> Constraint | None:
    """The constraint a request's fields ask for (``constrained.request_constraint``);
    APIError 400 naming the field and the offending part of its schema or grammar."""
    try:
        return request_constraint(
            response_format=response_format, json_schema=json_schema, grammar=grammar
        )
    except ConstraintError as e:
        raise APIError(400, f"cannot constrain the output: {e}") from None


def compile_constraint(backend: Any, c: Constraint) -> CompiledConstraint:
    """``c`` bound to the model's vocabulary (cached per constraint); APIError 400 naming the
    offending part when it cannot be compiled: never unconstrained decoding instead."""
    try:
        return backend.constraint_compiler().compile(c)
    except ConstraintError as e:
        raise APIError(400, f"cannot constrain the output: {e}") from None


async def _bound(backend: Any, c: Constraint) -> CompiledConstraint:
    """``compile_constraint`` off the event loop, on the compile thread: binding takes
    milliseconds to tens of them, and its stack is large enough for whatever a compile child
    passed."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(compile_executor(), compile_constraint, backend, c)


def stops_from(req: SamplingFields) -> list[str]:
    """``stop`` as a list (a single string is one stop string)."""
    if req.stop is None:
        return []
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)


def check_tokens(tokens: list[int], backend: Any) -> None:
    """APIError 400 unless every token id is in the vocabulary (llama.cpp does not check)."""
    n = backend.n_vocab
    for t in tokens:
        if not 0 <= t < n:
            raise APIError(400, f"token id {t} is outside the vocabulary (0..{n - 1})")


def check_fits(prompt: list[int], backend: Any) -> None:
    """APIError 400 for an empty prompt or one that leaves no room in a slot's context."""
    if not prompt:
        raise APIError(400, "the prompt is empty")
    if len(prompt) >= backend.n_ctx_slot:
        raise APIError(
            400,
            f"the request ({len(prompt)} prompt tokens) exceeds the available context size "
            f"({backend.n_ctx_slot} tokens), try increasing it",
            "exceed_context_size_error",
            n_prompt_tokens=len(prompt),
            n_ctx=backend.n_ctx_slot,
        )


# Events a streaming reader may lag behind before its tasks stop generating (each is about
# one token's text): a client that reads nothing holds its slot, not unbounded memory.
MAX_BACKLOG = 256


class TaskGroup:
    """Runs tasks on the engine and yields ``(index, event)`` as they come.

    Leaving the iteration early (client gone) cancels every task still running.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        timeout: float = 600.0,
        max_queue: int = 256,
        drain_deadline: Callable[[], float | None] = lambda: None,
    ) -> None:
        self.engine = engine
        self.drain_deadline = drain_deadline
        self.timeout = timeout
        self.max_queue = max_queue
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self.tasks: list[Task] = []
        self.n_read: list[int] = []  # events of each task read so far (by ``events``)

    def _lagging(self, index: int) -> Callable[[], bool]:
        """Whether the reader is more than MAX_BACKLOG of task ``index``'s events behind
        (called on the engine thread; each counter has one writer)."""

        def lagging() -> bool:
            return self.tasks[index].n_sent - self.n_read[index] > MAX_BACKLOG

        return lagging

    def _emitter(self, index: int) -> Callable[[Event], None]:
        """The ``emit`` of the task at ``index``: thread-safe, never blocks."""
        loop, q = self.loop, self.queue

        def emit(ev: Event) -> None:
            try:
                loop.call_soon_threadsafe(q.put_nowait, (index, ev))
            except RuntimeError:  # loop closed: the client is long gone
                pass

        # The engine batches a step's events per loop: one wake-up, then deliver() on the loop.
        emit.loop = loop  # type: ignore[attr-defined]
        emit.deliver = lambda ev: q.put_nowait((index, ev))  # type: ignore[attr-defined]
        return emit

    def add(
        self,
        prompt: list[int],
        sampling: SamplingParams,
        gen: GenParams,
        *,
        id_slot: int = -1,
        cache_prompt: bool = True,
        stream: bool = True,
        user_start: int = -1,
        tenant: str = "",
        return_progress: bool = False,
        timings_per_token: bool = False,
    ) -> Task:
        """Add a task (not yet running: ``submit`` starts them all)."""
        task = Task(
            prompt=prompt,
            sampling=sampling,
            gen=gen,
            emit=self._emitter(len(self.tasks)),
            id_slot=id_slot,
            cache_prompt=cache_prompt,
            stream=stream,
            user_start=user_start,
            tenant=tenant,
            return_progress=return_progress and stream,
            timings_per_token=timings_per_token and stream,
            lagging=self._lagging(len(self.tasks)) if stream else None,
        )
        self.tasks.append(task)
        self.n_read.append(0)
        return task

    def submit(self) -> None:
        """Hand every task to the engine, or none: APIError 400 for an id_slot out of range,
        503 when the queue is full or the engine stopped."""
        if any(t.id_slot >= len(self.engine.slots) for t in self.tasks):
            raise APIError(
                400, f"id_slot must be below the number of slots ({len(self.engine.slots)})"
            )
        if (
            self.engine.queue_depth() + len(self.tasks)
            > self.max_queue + self.engine.n_idle_slots()
        ):
            raise APIError(
                503,
                f"the server is busy: more than {self.max_queue} requests are waiting",
                "unavailable_error",
                headers={"Retry-After": "1"},
            )
        try:
            for t in self.tasks:
                self.engine.submit(t)
        except EngineDead as e:
            self.cancel()
            raise APIError(503, str(e), "unavailable_error") from e

    def cancel(self) -> None:
        """Cancel every task (finished ones ignore it); safe to call more than once."""
        for t in self.tasks:
            t.cancel()

    def _ended(self, deadline: float) -> TaskError | None:
        """Why the unfinished tasks must end now, if they must: the server drains for a
        shutdown and its grace time is over, or the request ran out of time."""
        drain = self.drain_deadline()
        now = time.monotonic()
        if drain is not None and now >= drain:
            return TaskError(503, "the server is shutting down", "unavailable_error")
        if now >= deadline:
            return TaskError(
                408, f"the request timed out after {self.timeout:g} s", "timeout_error"
            )
        return None

    async def events(self) -> AsyncIterator[tuple[int, Event]]:
        """Events until every task ended. A timeout, a shutdown's end of grace or a dead
        engine ends the unfinished tasks with a TaskError each (so streams can report it)."""
        open_ = set(range(len(self.tasks)))
        deadline = time.monotonic() + self.timeout
        try:
            while open_:
                failure = self._ended(deadline)
                if failure is None:
                    try:
                        wait = max(0.0, min(1.0, deadline - time.monotonic()))
                        index, ev = await asyncio.wait_for(self.queue.get(), timeout=wait)
                    except asyncio.TimeoutError:
                        failure = self._ended(deadline)
                        if failure is None and not self.engine.alive:
                            failure = TaskError(500, "the engine stopped", "server_error")
                        if failure is None:
                            continue
                if failure is not None:
                    self.cancel()
                    for i in sorted(open_):
                        yield i, failure
                    open_.clear()
                    return
                if isinstance(ev, TaskResult | TaskError):
                    open_.discard(index)
                self.n_read[index] += 1
                yield index, ev
        finally:
            if open_:
                self.cancel()

    async def results(self, request: Any = None) -> list[TaskResult]:
        """Wait for every task; the first error becomes an APIError.

        With ``request``, a client that disconnects cancels the tasks (within ~0.25 s).
        """
        watcher = asyncio.create_task(self._watch(request)) if request is not None else None
        out: list[TaskResult | None] = [None] * len(self.tasks)
        try:
            async for index, ev in self.events():
                if isinstance(ev, TaskError):
                    raise APIError(ev.status, ev.message, ev.type, **ev.extra)
                if isinstance(ev, TaskResult):
                    out[index] = ev
        finally:
            if watcher is not None:
                watcher.cancel()
        return [r for r in out if r is not None]

    async def _watch(self, request: Any) -> None:
        await until_disconnected(request)
        log.info("client disconnected; cancelling %d task(s)", len(self.tasks))
        self.cancel()


async def until_disconnected(request: Any, period: float = 0.25) -> None:
    """Returns once the client of ``request`` has gone. Polled: Starlette tells a
    non-streaming handler of a disconnect only when asked."""
    while True:
        await asyncio.sleep(period)
        if await request.is_disconnected():
            return


class Prompt(NamedTuple):
    """One prompt's tokens; for chat, also where its last user turn starts."""

    tokens: list[int]
    user_start: int = -1  # token index of the last user turn (-1: unknown, or not chat)


def _no_constraint() -> Constraint | None:
    return None


def _no_check() -> None:
    return None


@dataclass(frozen=True)
class Submission:
    """What one endpoint asks of the engine, beyond the SamplingFields of its body.

    ``prompts`` does the tokenizer work (it may render a chat template first) and runs in a
    worker thread; it may raise APIError. ``check`` holds the endpoint's own body checks; it
    runs after the shared prompt and sampler checks and before submitting, which is where
    each endpoint made them before they shared this path (a request with several faults
    still reports the same one). Each prompt runs ``n`` times (``n`` choices)."""

    prompts: Callable[[], list[Prompt]]
    max_tokens: int
    stream: bool
    n_probs: int = 0
    logprobs: bool = False
    n: int = 1
    check: Callable[[], None] = _no_check
    # structured output / forced format (server.constrained): checking it compiles the
    # client's schema (in a compile child), so it is called from a worker thread
    constraint: Callable[[], Constraint | None] = _no_constraint
    return_progress: bool = False  # PromptProgress events while the prompt is processed
    timings_per_token: bool = False  # streamed text chunks carry timings
    # llama-server's post_sampling_probs: the n_probs reported are the sampler chain's
    # final distribution (SamplingParams.post_probs), not the model's
    post_sampling: bool = False


def _checked_prompts(job: Submission, backend: Any) -> list[Prompt]:
    """``job.prompts()`` with every token id and every prompt's length checked."""
    prompts = job.prompts()
    for p in prompts:
        check_tokens(p.tokens, backend)
        check_fits(p.tokens, backend)
    return prompts


async def submit(
    st: ServerState, body: SamplingFields, job: Submission, tenant: str = ""
) -> TaskGroup:
    """The one path from a generating request to running tasks.

    Requires the engine, tokenizes and checks the prompts, builds the sampler and generation
    settings, and submits ``len(prompts) * job.n`` tasks, prompt-major (choice ``i`` runs
    prompt ``i // job.n``). Raises APIError before anything runs: nothing to cancel then."""
    # Checking a schema or grammar may take a compile child --constraint-timeout seconds:
    # off the event loop. First: a request with several faults reports the same one.
    constraint = await asyncio.to_thread(job.constraint)
    engine = st.require_engine()
    b = st.backend
    # Tokenizing (and checking) a long prompt takes a while: off the event loop, so the
    # streams of other requests keep flowing meanwhile.
    prompts = await asyncio.to_thread(_checked_prompts, job, b)
    sampling = sampling_from(body, b, st.settings)
    if body.ignore_eos:  # as llama-server: every end-of-generation token banned
        sampling.logit_bias = {**sampling.logit_bias, **dict.fromkeys(b.eog_tokens(), -math.inf)}
    if job.post_sampling:
        sampling.post_probs = job.n_probs
    job.check()
    if constraint is not None:
        sampling.constraint = await _bound(b, constraint)
    gen = GenParams(
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
    )
    group = TaskGroup(
        engine,
        timeout=body.timeout or st.settings.timeout,
        max_queue=st.settings.max_queue,
        drain_deadline=lambda: st.drain_deadline,
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
                return_progress=job.return_progress,
                timings_per_token=job.timings_per_token,
            )
    group.submit()
    return group


def merged_timings(results: list[TaskResult]) -> Timings:
    """One Timings for several choices: token counts add up; the choices ran in parallel, so
    the times are the longest one's."""
    t = Timings()
    for r in results:
        t.cache_n += r.timings.cache_n
        t.prompt_n += r.timings.prompt_n
        t.predicted_n += r.timings.predicted_n
        t.draft_n += r.timings.draft_n
        t.draft_n_accepted += r.timings.draft_n_accepted
        t.prompt_ms = max(t.prompt_ms, r.timings.prompt_ms)
        t.predicted_ms = max(t.predicted_ms, r.timings.predicted_ms)
    return t


def usage_of(results: list[TaskResult]) -> dict[str, Any]:
    """OpenAI's ``usage`` object over every choice."""
    prompt = sum(r.n_prompt for r in results)
    completion = sum(r.timings.predicted_n for r in results)
    cached = sum(r.timings.cache_n for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def finish_reason(r: TaskResult) -> str:
    """OpenAI's finish_reason: "length" for a token limit or a full context, else "stop"."""
    return "length" if r.finish is FinishReason.LENGTH else "stop"
