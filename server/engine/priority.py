"""--scheduling-policy priority: the order waiting tasks are admitted in, and which running
run gives its slot up. Pure decisions; the engine carries them out (engine/preempt.py).

vLLM's semantics: a task's ``priority`` is an integer, lower is served first, ties by
arrival. Under ``fcfs`` (the default) every task is FIFO and nothing is preempted.

Aging (starvation bound): a task's effective priority improves by one for every ``aging_s``
seconds since it arrived, waiting or running::

    effective = priority - floor((now - arrival) / aging_s)

A preempted task keeps its age (its arrival, not its preemption, is where aging counts
from), so a task of priority p behind a steady stream of priority q < p outranks every
newcomer after at most (p - q + 1) * aging_s seconds from its arrival: from then on it is
admitted before them and none of them can preempt it. A running run is weighed by its
effective priority now (it ages as it runs), and preemption needs a strictly better one;
two tasks age at the same rate, so a preempted run never outranks the run that displaced
it (no ping-pong).

Preemption: while a waiting task finds no idle slot, the running run of the worst rank
(largest; latest arrival among equals) that ranks strictly worse than the waiter gives its
slot up, one run per such waiter. Only runs whose state can be saved whole and resumed
elsewhere, and that were preempted fewer than ``max_preemptions`` times, are candidates
(``RunView.movable``): a run loses its slot only so often, so a long run behind a stream of
short better ones still finishes.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..task import Task

POLICIES = ("fcfs", "priority")
# the default aging step: one priority level per this many seconds waited
DEFAULT_AGING_S = 10.0
# a run preempted this many times keeps its slot until it ends (issue 56: a long run was
# preempted 115 times in 6 minutes by a stream of short requests and never finished)
MAX_PREEMPTIONS = 3


@dataclass(frozen=True)
class PriorityRule:
    """The policy (``fcfs`` or ``priority``), its aging step in seconds (<= 0: no aging) and
    how often one run may be preempted (then it keeps its slot until it ends)."""

    policy: str = "fcfs"
    aging_s: float = DEFAULT_AGING_S
    max_preemptions: int = MAX_PREEMPTIONS

    @property
    def on(self) -> bool:
        return self.policy == "priority"

    def effective(self, task: Task, now: float) -> int:
        """The task's effective priority at ``now`` (lower is better): aged from its arrival,
        whether it waited, ran or was preempted meanwhile."""
        if self.aging_s <= 0:
            return task.priority
        return task.priority - math.floor(max(0.0, now - task.t_enqueued) / self.aging_s)

    def order(self, waiting: Iterable[Task], now: float) -> collections.deque[Task]:
        """The waiting tasks in admission order: effective priority, then arrival (a stable
        sort keeps the queue's order among exact ties)."""
        return collections.deque(
            sorted(waiting, key=lambda t: (self.effective(t, now), t.t_enqueued))
        )


class RunView(NamedTuple):
    """A busy slot as preemption sees it: its run's effective priority now (``rank``), when
    its task arrived, and whether its run may be preempted (saved and resumed elsewhere)."""

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
