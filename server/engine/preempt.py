"""Preemption under --scheduling-policy priority: a run gives its slot up to a waiting task
of a better priority and comes back later where it stopped (engine/priority.py decides who).

A preempted run's KV goes to the RAM prompt cache (``SaveRun``, the runner's) and its run
(sampler, text stream, answer so far, log-probs) waits here, keyed by its task, while the
task waits in the queue again. When admission places the task, ``Placer`` restores the
cached state into the slot it got (``resume_probe``: the tokens the run's KV held, plus its
next token, so the whole state is a usable prefix) and ``reattach`` gives the run back: it
generates on from its next token, or, when the cache lost part of the state, first
recomputes the missing tokens (``SlotRun.refill``). The stream goes on; nothing already
sent is sent again.

Invariant: ``held`` has a record exactly for the tasks preempted and not yet resumed,
cancelled or failed; each record owns its run's sampler until then (``drop`` frees it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..slot.sequence import RunCounts
from ..slot.slot import Slot, SlotRun, SlotState
from ..task import Task
from .priority import PriorityRule, RunView, victims
from .step_plan import Ops, SaveRun


@dataclass
class Preempted:
    """A preempted run: its run, its counts and answer, and the tokens its KV held."""

    run: SlotRun
    counts: RunCounts
    kv: list[int]
    generating: bool


class Preemption:
    def __init__(self) -> None:
        self.held: dict[int, Preempted] = {}
        self.count = 0  # preemptions done

    def views(
        self, rule: PriorityRule, slots: Sequence[Slot], can_save: bool, by_model: bool, now: float
    ) -> list[RunView]:
        """The busy slots as ``victims`` sees them at ``now``, each run ranked by its effective
        priority (``rule``). A run is movable when its whole state is its slot's KV and its
        run and it was preempted fewer than ``rule.max_preemptions`` times: no RAM cache
        (``can_save``), a sampler placed in the decode graph of its slot (-bs), a draft
        model's sequences (``by_model``), parked --cache-reuse chunks, or waiters on its
        prefix (prefix sharing) keep it in place."""
        out = []
        for s in slots:
            run = s.run
            if run is None or s.state not in (SlotState.PREFILL, SlotState.GENERATE):
                continue
            movable = (
                can_save
                and not run.backend_sampled
                and not by_model
                and not run.reuse
                and not run.share_marks
                and run.refill is None
                # bounded: a run preempted this often keeps its slot (no livelock)
                and run.preempted < rule.max_preemptions
            )
            out.append(RunView(s.id, rule.effective(run.task, now), run.task.t_enqueued, movable))
        return out

    def make_room(
        self,
        rule: PriorityRule,
        waiting: Sequence[Task],
        slots: Sequence[Slot],
        runs: list[RunView],
        now: float,
    ) -> Ops[list[Task]]:
        """Preempt the runs ``victims`` names under ``rule`` for ``waiting`` (in admission
        order): each one's state to the RAM cache, then its slot idle. Returns the preempted
        tasks (to wait again; they keep their age). A run whose save fails keeps its slot."""
        n_idle = sum(1 for s in slots if s.idle)
        out: list[Task] = []
        for _, sid in victims(rule, waiting, n_idle, runs, now):
            slot = slots[sid]
            if not (yield SaveRun(slot)):
                continue
            out.append(self._detach(slot, now))
        return out

    def _detach(self, slot: Slot, now: float) -> Task:
        run = slot.run
        assert run is not None  # a victim is a busy slot
        generating = slot.state is SlotState.GENERATE
        self.held[run.task.id] = Preempted(run, run.seq.counts(), list(slot.tokens), generating)
        run.preempted += 1
        self.count += 1
        slot.release()
        slot.run = None  # the run lives on in ``held``, not as this slot's last run
        run.task.t_waiting = now  # its queue time starts again (metrics); its age does not
        return run.task

    def resume_probe(self, task: Task) -> list[int] | None:
        """The tokens to look the preempted ``task``'s state up by (None: not preempted):
        what its KV held, and its next token when it was generating (so that the whole
        saved state is a prefix that plan_reuse keeps), after its forced tokens if any."""
        rec = self.held.get(task.id)
        if rec is None:
            return None
        if not rec.generating:
            return list(task.prompt)
        c = rec.counts  # the sampled token, after the forced ones not decoded yet
        return rec.kv + (c.generated[-1 - c.n_forced :] if c.n_forced else [c.next_token])

    def reattach(self, slot: Slot, task: Task, n_past: int) -> SlotRun:
        """Give the preempted ``task``'s run to ``slot``, which holds ``n_past`` tokens of
        its state: it generates on at once when the slot holds all of it, else it computes
        the rest first (a prompt chunk's work, or ``refill``'s for the answer's tokens)."""
        rec = self.held.pop(task.id)
        run = rec.run
        slot.tenant = task.tenant
        slot.seq.resume(rec.counts, n_past)
        run.seq = slot.seq
        run.resumed_n = n_past
        slot.run = run
        if not rec.generating:
            slot.state = SlotState.PREFILL
        elif n_past >= len(rec.kv):
            slot.state = SlotState.GENERATE
        else:
            run.refill = rec.kv
            slot.state = SlotState.PREFILL
        return run

    def drop(self, task: Task) -> None:
        """A preempted task left the queue without resuming (cancelled, failed): free its
        run's sampler (its cache entry stays, an ordinary entry)."""
        rec = self.held.pop(task.id, None)
        if rec is not None and rec.run.sampler is not None:
            rec.run.sampler.free()
            rec.run.sampler = None
