"""``update``: a step's accounting, from what ``execute`` reported; and the end of runs.

Nothing here touches llama.cpp memory: prompt progress, the sampled tokens taken (stop
strings, end of generation, constraints, limits), text streamed to the tasks, and runs
finished with their token accounting, which ``timings``, ``usage`` and the metrics read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..slot.backend_api import Backend
from ..slot.slot import Slot, SlotRun, SlotState
from ..slot.stats import EngineStats
from ..task import (
    Event,
    FinishReason,
    PromptProgress,
    Task,
    TaskError,
    TaskResult,
    TextChunk,
    Timings,
    TokenLogprob,
)
from .step_plan import SlotOutput, StepOutputs

log = logging.getLogger("server.engine.engine")


class Updater:
    def __init__(
        self,
        backend: Backend,
        stats: EngineStats,
        send: Callable[[Task, Event], None],
        shifts: Callable[[], bool],
    ) -> None:
        """``send(task, event)`` queues an event; ``shifts()``: --context-shift applies.
        ``ended`` collects the slots whose runs ended: the runner settles their drafts at
        the start of the next step (``Runner.settle_ended``)."""
        self.b = backend
        self.stats = stats
        self.send = send
        self.shifts = shifts
        self.ended: list[Slot] = []

    def update(self, out: StepOutputs) -> None:
        """Account for one executed step: every decoded slot in plan order, then the runs
        ``execute`` ended."""
        now = time.perf_counter()
        idle = SlotState.IDLE
        for o in out.outputs:
            s = o.work.slot
            if s.run is not None and s.state is not idle:
                self._account(o, now)
        for e in out.ended:
            if not e.slot.idle:
                self.finish(e.slot, e.reason, error=e.error, status=e.status)

    def _account(self, o: SlotOutput, now: float) -> None:
        s = o.work.slot
        run = s.run
        assert run is not None  # checked by ``update`` (per token: no ``live`` call)
        if not o.work.generating:
            if run.refill is not None:
                self._refilled(s, run, len(o.work.tokens))
                return
            run.seq.n_computed += len(o.work.tokens)
            if run.task.return_progress:
                self.progress(s)
            if not o.work.logits:
                return
            s.state = SlotState.GENERATE
            run.t_first = now
            self.stats.on_first_token((now - run.task.t_enqueued) * 1e3)
            if run.task.gen.max_tokens == 0:  # prompt only (n_predict 0): nothing sampled
                self.finish(s, FinishReason.LENGTH)
                return
        if o.n_drafted:
            run.n_drafted += o.n_drafted
            run.n_draft_accepted += o.n_accepted
            self.stats.on_draft(o.n_drafted, o.n_accepted)
        if run.closing:  # the answer's last forced tokens are in the KV now
            self.finish(s, FinishReason.STOP)
            return
        lps = o.logprobs
        # the next step decodes the forced tokens with the last sampled one
        run.seq.n_forced = o.n_forced
        toks = o.tokens
        if len(toks) == 1 and lps is None:  # most slots, every step
            self.take(s, toks[0])
            return
        last = len(toks) - 1
        for i, tok in enumerate(toks):
            if not self.take(s, tok, lps[i] if lps is not None else None, i == last):
                return

    def _refilled(self, s: Slot, run: SlotRun, n: int) -> None:
        """A resumed run recomputed ``n`` tokens the RAM cache had lost (engine/preempt.py):
        those of its prompt count as computed prompt tokens; once its KV holds its answer so
        far again it generates on from the token it had sampled."""
        refill = run.refill
        assert refill is not None  # checked by ``_account``
        end = len(s.tokens)
        run.seq.n_computed += max(0, min(end, run.n_prompt) - (end - n))
        if end >= len(refill):
            run.refill = None
            s.state = SlotState.GENERATE

    def take(
        self, s: Slot, tok: int, logprob: TokenLogprob | None = None, last: bool = True
    ) -> bool:
        """Account for the sampled token (and its log-probs, when asked for) and emit its
        text; False when this ended the run. ``last``: the step's last token (the matcher
        has accepted the step's tokens already: whether it is done is asked there only)."""
        run = s.run
        assert run is not None  # a slot being updated holds a run
        seq = run.seq
        gen = run.task.gen
        seq.n_sampled += 1
        if self.b.is_eog(tok) and not gen.ignore_eos:
            self.finish(s, FinishReason.STOP)
            return False
        seq.generated.append(tok)
        stream = run.stream
        piece = self.b.token_to_piece(tok, tok in gen.preserved)
        if run.skip:  # the prompt's bytes the healed first token carries
            piece, run.skip = piece[run.skip :], 0
        if stream.stops:
            text, stop = stream.push(piece)
        else:  # no Release to build: the usual run, every token
            text, stop = stream.feed(piece), ""
        if logprob is not None:
            run.logprobs.append(logprob)
        if text or stop:
            self.emit_text(run, text)
        if stop:
            self.finish(s, FinishReason.STOP, stop_word=stop)
            return False
        if last and run.matcher is not None and run.matcher.is_done():
            # the constraint is complete: nothing may follow. Forced tokens that end it are
            # decoded first (one step, nothing sampled): the KV holds the answer but its last
            # token, as when every token is sampled, for the next turn to find in the cache
            if seq.n_forced:
                run.closing = True
                return True
            self.finish(s, FinishReason.STOP)
            return False
        limit = gen.max_tokens
        if (limit >= 0 and seq.n_sampled >= limit) or (
            len(s.seq.tokens) + 1 >= s.n_ctx and self._context_full(s)
        ):
            self.finish(s, FinishReason.LENGTH)
            return False
        seq.next_token = tok
        return True

    def _context_full(self, s: Slot) -> bool:
        """Whether the slot has no room for its next token. With --context-shift the next
        step shifts it (``execute``) and the run goes on; it is ``truncated`` either way."""
        if len(s.tokens) + 1 + s.seq.n_forced < s.n_ctx:
            return False
        run = s.live
        run.truncated = True
        if not self.shifts():
            return True
        run.shift_due = True
        return False

    def progress(self, s: Slot) -> None:
        """Send the slot's prompt progress (tasks with ``return_progress``, streamed only):
        ``processed`` is what the slot holds of the prompt, cached tokens included."""
        run = s.live
        if run.task.stream:
            t_ms = (time.perf_counter() - run.t_start) * 1e3
            ev = PromptProgress(run.n_prompt, run.n_cached, len(s.tokens), int(t_ms))
            if run.task.timings_per_token:  # llama-server's: 0 ms until a prompt token is in
                ms = t_ms if run.n_processed else 0.0
                ev.timings = Timings(cache_n=run.n_cached, prompt_n=run.n_processed, prompt_ms=ms)
            self.send(run.task, ev)

    def emit_text(self, run: SlotRun, text: str) -> None:
        """Release text; it carries the tokens (and log-probs) not sent yet, which includes
        those whose text was held back as a possible stop-string prefix."""
        seq = run.seq
        task = run.task
        if task.stream:
            n = seq.n_emitted
            chunk = TextChunk(text, seq.generated[n:], run.logprobs[n:])
            if task.timings_per_token:  # llama-server's timings on every chunk
                chunk.timings = timings_of(run, time.perf_counter())
            self.send(task, chunk)
            seq.n_emitted = len(seq.generated)
        run.out_text.append(text)

    def finish(
        self,
        s: Slot,
        reason: FinishReason,
        *,
        stop_word: str = "",
        error: str = "",
        status: int = 500,
    ) -> None:
        """End the slot's run: flush its text, send its result (or its error, with
        ``status``), free its sampler, count it, and make the slot idle."""
        run = s.run
        assert run is not None  # only a slot holding a run finishes one
        task = run.task
        now = time.perf_counter()
        if reason is not FinishReason.STOP or not stop_word:
            rest = run.stream.flush()
            if rest and reason is not FinishReason.CANCELLED:
                self.emit_text(run, rest)
        result = result_of(s.id, run, reason, stop_word, error, now)
        if run.sampler is not None:
            run.sampler.free()
            run.sampler = None
        self.stats.on_finish(result, (now - task.t_enqueued) * 1e3)
        if reason is FinishReason.ERROR:
            kind = "invalid_request_error" if status < 500 else "server_error"
            self.send(task, TaskError(status, error or "generation failed", kind))
        else:
            self.send(task, result)
        _log_finish(s.id, task.id, reason, result.timings)
        if reason is not FinishReason.ERROR:
            self.ended.append(s)  # the idle slot's snapshots carry the draft's state too
        s.release()


def _log_finish(slot: int, task: int, reason: FinishReason, t: Timings) -> None:
    log.info(
        "slot %d task %d: %s cache_n=%d prompt_n=%d predicted_n=%d prompt_ms=%.1f predicted_ms=%.1f",
        slot,
        task,
        reason.value,
        t.cache_n,
        t.prompt_n,
        t.predicted_n,
        t.prompt_ms,
        t.predicted_ms,
    )


def timings_of(run: SlotRun, now: float) -> Timings:
    """The run's token accounting and times so far (all of them when it ends now)."""
    t_first = run.t_first or now
    u = run.seq.usage
    return Timings(
        cache_n=u.cache_n,
        prompt_n=u.prompt_n,
        prompt_ms=(t_first - run.t_start) * 1e3,
        predicted_n=u.predicted_n,
        predicted_ms=(now - t_first) * 1e3 if run.t_first else 0.0,
        draft_n=run.n_drafted,
        draft_n_accepted=run.n_draft_accepted,
        cache_reuse_n=run.seq.n_reused,
        cache_reuse_chunks=run.seq.n_reuse_chunks,
        preempted=run.preempted,
        resumed_n=run.resumed_n,
    )


def result_of(
    slot_id: int, run: SlotRun, reason: FinishReason, stop_word: str, error: str, now: float
) -> TaskResult:
    """The TaskResult of a run ending now: its text, tokens and token accounting."""
    return TaskResult(
        id_slot=slot_id,
        finish=reason,
        text="".join(run.out_text),
        tokens=list(run.seq.generated),
        n_prompt=run.n_prompt,
        timings=timings_of(run, now),
        stop_word=stop_word,
        error=error,
        t_queue_ms=(run.t_start - run.task.t_enqueued) * 1e3,
        logprobs=run.logprobs,
        truncated=run.truncated,
    )
