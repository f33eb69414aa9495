"""The engine's constrained sampling step on the fake backend: a constrained slot finishes
with "stop" when its constraint is complete, runs beside free slots in one batch, asks for the
full mask when log-probs are wanted, and fails alone when its constraint admits nothing."""

from __future__ import annotations

from dataclasses import dataclass, field

from server.engine.engine import Engine, EngineOptions
from server.task import FinishReason, SamplingParams
from tests.fake_backend import FakeBackend

from .helpers import run, task


@dataclass
class SeqMatcher:
    """Allows exactly ``seq``, token by token (a stand-in for server.constrained.Matcher)."""

    seq: list[int]
    pos: int = 0
    err: str = ""

    def allows(self, token: int) -> bool:
        return self.pos < len(self.seq) and self.seq[self.pos] == token

    def accept(self, token: int) -> bool:
        if not self.allows(token):
            self.err = f"token {token} refused"
            return False
        self.pos += 1
        return True

    def forced(self, limit: int) -> list[int]:
        return []  # every token sampled (test_forced_tokens.py forces them)

    def mask_logits(self, logits) -> int:
        return int(self.pos < len(self.seq))

    def is_done(self) -> bool:
        return self.pos == len(self.seq)

    def is_error(self) -> bool:
        return bool(self.err)

    def error(self) -> str:
        return self.err


@dataclass
class SeqConstraint:
    seq: list[int]
    made: list[SeqMatcher] = field(default_factory=list)

    def matcher(self) -> SeqMatcher:
        self.made.append(SeqMatcher(list(self.seq)))
        return self.made[-1]


class ConstrainedFake(FakeBackend):
    """The fake backend with llama.cpp's sample-then-check step: the free pick when the
    matcher allows it, else the one token the (sequence) matcher allows."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.full_masks = 0
        self.refused = 0

    def sample_constrained(self, sampler, idx: int, matcher, full_mask: bool = False) -> int:
        self.full_masks += full_mask
        tok = self.sample(sampler, idx)
        if not full_mask and matcher.allows(tok):
            return tok
        self.refused += 1
        if matcher.mask_logits(None) == 0:
            return -1
        return matcher.seq[matcher.pos]


def _engine() -> tuple[Engine, ConstrainedFake]:
    b = ConstrainedFake()
    return Engine(b, EngineOptions()), b


def _constrained(prompt, seq, max_tokens=50, logprobs=False):
    t, c = task(prompt, max_tokens=max_tokens)
    t.sampling = SamplingParams(temperature=0.0, constraint=SeqConstraint(seq))
    t.gen.logprobs = logprobs
    return t, c


def test_constrained_slot_stops_when_complete_beside_a_free_one():
    e, b = _engine()
    t1, c1 = _constrained(range(10), [5, 6, 7])
    t2, c2 = task(range(20, 40), max_tokens=6)
    run(e, t1, t2)
    assert c1.result.finish is FinishReason.STOP and c1.result.tokens == [5, 6, 7]
    assert c1.result.timings.predicted_n == 3
    assert c2.result.finish is FinishReason.LENGTH and len(c2.result.tokens) == 6
    assert b.refused == 3 and b.full_masks == 0  # the fake's free picks are never 5, 6, 7


def test_logprobs_ask_for_the_full_mask():
    e, b = _engine()
    t, c = _constrained(range(10), [1, 2], logprobs=True)
    run(e, t)
    assert c.result.tokens == [1, 2] and b.full_masks == 2
    assert [lp.token for lp in c.result.logprobs] == [1, 2]


def test_max_tokens_cuts_a_constrained_answer():
    e, _ = _engine()
    t, c = _constrained(range(10), [1, 2, 3, 4], max_tokens=2)
    run(e, t)
    assert c.result.finish is FinishReason.LENGTH and c.result.tokens == [1, 2]


def test_a_constraint_that_admits_nothing_fails_its_task_only():
    e, _ = _engine()
    t1, c1 = _constrained(range(10), [])  # complete before the first token: nothing allowed
    t2, c2 = task(range(50, 60), max_tokens=3)
    run(e, t1, t2)
    # the request's own constraint: a client error (issue 40), not a 500
    assert c1.error is not None and c1.error.status == 400
    assert c1.error.type == "invalid_request_error"
    assert "admits no token" in c1.error.message
    assert c2.result.finish is FinishReason.LENGTH
