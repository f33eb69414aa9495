"""When waiting for an in-flight prefix pays (engine/sharing.py).

A waiter saves the tokens its source computes for it, but gets them one step late (it copies
in the step after the source reached the target), and the source ends a chunk at the target.
Where a step costs mostly a fixed overhead (a GPU, a batch budget larger than the prompts)
computing the whole prompt alongside the source can finish sooner. Both are estimated from the
measured step time, modelled as ``per_step + per_token * tokens``, and the prefill queue:
prompts are scheduled oldest first, with ``n_batch`` minus one token per generating slot of
room per step.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..slot.slot import Slot, SlotState


@dataclass
class StepSpeed:
    """One engine step's time fitted as ``per_step + per_token * n_tokens`` by exponentially
    weighted least squares over the steps seen (decoding steps pin the fixed cost, prefill
    chunks the slope). ``alpha`` 0 keeps given estimates fixed (tests inject them so)."""

    alpha: float = 0.05
    per_step: float | None = None
    per_token: float | None = None  # None until steps of different sizes were seen
    _n: int = 0
    _m: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)  # E[n], E[t], E[n²], E[nt]

    def observe(self, n_tokens: int, seconds: float) -> None:
        if n_tokens <= 0 or not self.alpha:
            return
        self._n += 1
        w = max(self.alpha, 1.0 / self._n)  # a plain mean until the window fills
        x, y = float(n_tokens), seconds
        self._m = tuple(m + w * (v - m) for m, v in zip(self._m, (x, y, x * x, x * y), strict=True))
        mx, my, mxx, mxy = self._m
        var = mxx - mx * mx
        if var < 1.0:  # all steps about the same size: the slope is unknown
            return
        b = (mxy - mx * my) / var
        if b > 0:
            self.per_token, self.per_step = b, max(0.0, my - b * mx)

    def seconds(self, n_steps: int, n_tokens: int) -> float | None:
        """Estimated time of ``n_steps`` steps decoding ``n_tokens`` in all; None until
        there is an estimate."""
        if self.per_token is None:
            return None
        return n_steps * (self.per_step or 0.0) + n_tokens * self.per_token


@dataclass
class PrefillQueue:
    """The prompt work queued this step, oldest first (the order ``_build_batch`` fills)."""

    budget: int  # prompt tokens per step: n_batch less the generating slots' tokens
    n_gen: int  # generating slots: one token each per step
    starts: list[float] = field(default_factory=list)  # t_start of each queued run
    cum: list[int] = field(default_factory=lambda: [0])  # cum[i]: tokens left in runs < i

    def ahead(self, t_start: float) -> int:
        """Prompt tokens left in runs started before ``t_start``."""
        return self.cum[bisect.bisect_left(self.starts, t_start)]


def queue_of(slots: Sequence[Slot], n_batch: int, n_ubatch: int = 0) -> PrefillQueue:
    """Snapshot of the prompt work: prefilling slots' remaining tokens, and waiting slots'
    tokens past their target (what they compute once they copied). A step's prompt room is
    what generating slots leave of ``n_batch``, and at most ``n_ubatch`` (when given) while
    any slot generates, as the scheduler plans it."""
    work: list[tuple[float, int]] = []
    n_gen = 0
    for s in slots:
        if s.state is SlotState.GENERATE:
            n_gen += 1
        elif s.state in (SlotState.PREFILL, SlotState.WAIT) and s.run is not None:
            done = len(s.tokens)
            if s.state is SlotState.WAIT and s.run.wait is not None:
                done = max(done, s.run.wait.target)
            work.append((s.run.t_start, len(s.run.task.prompt) - done))
    work.sort()
    room = n_batch - n_gen
    if n_gen and n_ubatch > 0:
        room = min(room, n_ubatch)
    q = PrefillQueue(max(1, room), n_gen)
    for t, n in work:
        q.starts.append(t)
        q.cum.append(q.cum[-1] + n)
    return q


def wait_pays(
    speed: StepSpeed, q: PrefillQueue, src: Slot, dst: Slot, target: int, sole: bool
) -> bool:
    """Whether waiting for ``src`` (computing) to reach ``target`` tokens gets ``dst`` its
    prompt done no later than computing it itself. True before any measurement.

    ``dst`` started after ``src``: in both cases everything queued before ``dst`` goes first.
    Giving up, it would copy what ``src`` holds now (up to the target). With ``sole`` (no
    other waiter needs the source to stop at ``target``), the wait also counts the step by
    which that stop delays the source's own prompt, when it does.
    """
    b = q.budget
    dst_run, src_run = dst.live, src.live
    n_w = len(dst_run.task.prompt)
    before_dst = q.ahead(dst_run.t_start)  # ``src`` included
    before_src = q.ahead(src_run.t_start)
    src_left = len(src_run.task.prompt) - len(src.tokens)
    to_target = before_src + target - len(src.tokens)
    k1 = max(1, math.ceil(to_target / b))
    # after the source reached the target: runs between it and dst not done in those k1
    # steps, the source's tokens past the target, then dst's own suffix
    between = max(0, before_dst - before_src - src_left - (k1 * b - to_target))
    rest = between + len(src_run.task.prompt) - target + n_w - target
    k_wait = k1 + max(1, math.ceil(rest / b))
    # the source would have finished in step k1 had it not stopped at the target
    src_delay = int(sole and before_src + src_left <= k1 * b)
    t_wait = _time(speed, q, k_wait + src_delay, before_dst + n_w - target)
    own = before_dst + n_w - max(len(dst.tokens), min(len(src.tokens), target))
    t_self = _time(speed, q, max(1, math.ceil(own / b)), own)
    if t_wait is None or t_self is None:
        return True
    return t_wait <= t_self


def _time(speed: StepSpeed, q: PrefillQueue, n_steps: int, n_prompt: int) -> float | None:
    """``n_steps`` steps carrying ``n_prompt`` prompt tokens and the generating slots' tokens."""
    return speed.seconds(n_steps, n_prompt + n_steps * q.n_gen)
