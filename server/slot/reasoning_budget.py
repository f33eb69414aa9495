"""The reasoning budget of one run (``types.ReasoningBudget``), as llama.cpp's
``common_reasoning_budget`` sampler enforces it: count the tokens the model writes inside
its reasoning; once the budget is spent, the budget message and the end tag are forced,
one token a step in place of the sampled one (they are then decoded as any sampled token:
the runner's decode is unchanged), and the model answers after them.

The tags are matched on the sampled tokens' text (a tag the model writes in pieces still
counts). Per token: one piece lookup and a short tail compare, only for runs with a budget
that is not spent yet (``done`` runs skip it)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from ..task import ReasoningBudget


class BudgetTracker:
    """Where one run stands against its reasoning budget: waiting for the start tag,
    inside the reasoning (``count`` tokens written), forcing the end, or ``done``."""

    def __init__(self, spec: ReasoningBudget, piece: Callable[[int], bytes]) -> None:
        self.spec = spec
        self.piece = piece
        self.open = spec.open
        self.done = False
        self.count = 0  # tokens written inside the reasoning, the model's own
        self.forced_n = 0  # tokens forced so far (the message and the end tag)
        self.tail = b""
        self.keep = max(len(spec.start), len(spec.end))
        self.forced: deque[int] = deque()

    def next(self, sampled: int) -> int:
        """The token the run emits in place of ``sampled``: ``sampled`` itself, or the
        next forced token once the budget is spent."""
        if not self.forced and self.open and not self.done and self.count >= self.spec.tokens:
            self.forced.extend(self.spec.forced)
        if self.forced:
            self.forced_n += 1
            tok = self.forced.popleft()
            self.done = not self.forced
            return tok
        if self.done:
            return sampled
        self.tail = (self.tail + self.piece(sampled))[-self.keep :]
        if not self.open:
            if self.tail.endswith(self.spec.start):
                self.open, self.tail = True, b""
        else:
            self.count += 1
            self.done = self.tail.endswith(self.spec.end)
        return sampled
