"""--scheduling-policy priority: the order waiting tasks are admitted in, and which running
run gives its slot up. Pure decisions; the engine carries them out (slots/preempt.py).

vLLM's semantics: a task's ``priority`` is an integer, lower is served first, ties by
arrival. Under ``fcfs`` (the default) every task is FIFO and nothing is preempted.

Aging (starvation bound): a waiting task's effective priority improves by one for every
``aging_s`` seconds it has waited since it (last) entered the queue::

    effective = priority - floor(waited / aging_s)

so a task of priority p behind a steady stream of priority q < p is admitted after at most
(p - q + 1) * aging_s seconds plus one step: by then it outranks every newcomer, and, once
it outranks a running run's admission rank, it preempts it too. A running run keeps the
effective priority it was admitted with (its ``rank``): a preempted run that waits again
starts aging from its preemption, and never outranks the run that displaced it with the
same priority it lost to (no ping-pong: preemption needs a strictly better rank).

Preemption: while a waiting task finds no idle slot, the running run of the worst rank
(largest; latest arrival among equals) that ranks strictly worse than the waiter gives its
slot up, one run per such waiter. Only runs whose state can be saved whole and resumed
elsewhere are candidates (``RunView.movable``).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..types import Task

POLICIES = ("fcfs", "priority")
# the default aging step: one priority level per this many seconds waited
DEFAULT_AGING_S = 10.0


@dataclass(frozen=True)
class PriorityRule:
    """The policy (``fcfs`` or ``priority``) and its aging step in seconds (<= 0: no aging)."""

    policy: str = "fcfs"
    aging_s: float = DEFAULT_AGING_S

    @property
    def on(self) -> bool:
        return self.policy == "priority"

    def effective(self, task: Task, now: float) -> int:
        """The task's effective priority after waiting until ``now`` (lower is better)."""
        if self.aging_s <= 0:
            return task.priority
        since = task.t_waiting or task.t_enqueued
        return task.priority - math.floor(max(0.0, now - since) / self.aging_s)

    def order(self, waiting: Iterable[Task], now: float) -> collections.deque[Task]:
        """The waiting tasks in admission order: effective priority, then arrival (a stable
        sort keeps the queue's order among exact ties)."""
        return collections.deque(
            sorted(waiting, key=lambda t: (self.effective(t, now), t.t_enqueued))
        )


class RunView(NamedTuple):
    """A busy slot as preemption sees it: the rank its run was admitted with, when its task
    arrived, and whether its run can be saved and resumed elsewhere."""

    slot: int
    rank: int
    arrival: float
    movable: bool


def pick_victim(rank: int, runs: Sequence[RunView], taken: set[int]) -> int | None:
    """The slot whose run gives way to a waiter of effective priority ``rank``: among the
    movable runs ranked strictly worse (larger) and not in ``taken``, the worst rank, the
    latest arrival among equals. None when no run ranks worse."""
    best: RunView | None = None
    for r in runs:
        if not r.movable or r.slot in taken or r.rank <= rank:
            continue
        if best is None or (r.rank, r.arrival) > (best.rank, best.arrival):
            best = r
    return None if best is None else best.slot


def victims(
    rule: PriorityRule,
    waiting: Sequence[Task],
    n_idle: int,
    runs: Sequence[RunView],
    now: float,
) -> list[tuple[Task, int]]:
    """For ``waiting`` (in admission order), the runs to preempt: each waiter without an
    idle slot left for it (``id_slot`` tasks wait for their own slot instead) takes the
    victim ``pick_victim`` names; the first waiter that finds none ends the pass (those
    after it rank no better)."""
    out: list[tuple[Task, int]] = []
    taken: set[int] = set()
    for t in waiting:
        if t.id_slot >= 0:
            continue
        if n_idle > 0:
            n_idle -= 1
            continue
        slot = pick_victim(rule.effective(t, now), runs, taken)
        if slot is None:
            break
        taken.add(slot)
        out.append((t, slot))
    return out
