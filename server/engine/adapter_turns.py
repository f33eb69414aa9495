"""Which LoRA adapter set a step decodes (issue 32).

llama.cpp applies a context's adapters to every token of a decode, so one step may only
carry slots whose tasks run under the same adapter set (``Task.lora``: one scale per loaded
adapter). When the active slots hold several sets, the sets take turns: each step goes to
the set served longest ago (a set never served first; ties to the set holding the oldest
run), so every set with work gets a step at least once every ``len(sets)`` steps and
none starves, whatever the others' load. With a single set (the usual case: no adapters,
or all tasks under the same ones) nothing changes: every active slot is in the step.

Pure decisions plus the turn record; the executor applies the chosen scales
(``Backend.set_adapters``) right before it decodes.
"""

from __future__ import annotations

from ..slot.slot import Slot


def adapters_of(s: Slot) -> tuple[float, ...]:
    """The adapter scales of the run on ``s`` (canonical: trailing zeros dropped, so that
    ``()`` and ``(0.0,)`` are the same set, no adapter)."""
    run = s.run
    assert run is not None  # an active slot holds its run
    return canonical(run.task.lora)


def canonical(scales: tuple[float, ...]) -> tuple[float, ...]:
    """``scales`` without trailing zeros: equal sets compare equal."""
    n = len(scales)
    while n and scales[n - 1] == 0.0:
        n -= 1
    return tuple(scales[:n])


class AdapterTurns:
    """The turn record: the step at which each adapter set was last decoded."""

    def __init__(self) -> None:
        self._step = 0
        self._last: dict[tuple[float, ...], int] = {}
        self.switches = 0  # steps whose set differed from the previous step's
        self._prev: tuple[float, ...] | None = None

    def pick(self, active: list[Slot]) -> tuple[list[Slot], tuple[float, ...]]:
        """The slots of ``active`` that decode this step (order kept) and their adapter
        set; records the turn (none for an empty ``active``)."""
        if not active:
            return [], ()
        for s in active:  # per slot and step: the usual case, no adapters at all, first
            run = s.run
            assert run is not None  # an active slot holds its run
            if run.task.lora:
                break
        else:
            return active, self._turn(())
        groups: dict[tuple[float, ...], list[Slot]] = {}
        for s in active:
            run = s.run
            assert run is not None  # an active slot holds its run
            lora = run.task.lora  # per slot and step: no call for the usual empty set
            groups.setdefault(canonical(lora) if lora else (), []).append(s)
        if len(groups) == 1:
            (key,) = groups
        else:
            key = min(groups, key=lambda k: (self._last.get(k, -1), _oldest(groups[k])))
        return groups[key], self._turn(key)

    def _turn(self, key: tuple[float, ...]) -> tuple[float, ...]:
        """Record that ``key``'s set decodes this step; returns it."""
        self._step += 1
        self._last[key] = self._step
        if len(self._last) > 64:  # forget sets long gone (bounded record)
            for k in sorted(self._last, key=self._last.__getitem__)[: len(self._last) - 64]:
                del self._last[k]
        if key != self._prev:
            self.switches += self._prev is not None
            self._prev = key
        return key


def _oldest(slots: list[Slot]) -> float:
    """When the oldest run of ``slots`` started."""
    return min(s.live.t_start for s in slots)
