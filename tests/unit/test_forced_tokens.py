"""A constraint's forced tokens on the fake backend (engine/executor.py ``_forced``): where
the constraint leaves no choice (a call frame's literal parts) the engine takes the tokens
it forces without sampling them, and the next step decodes them in one batch behind the
last sampled token. Exact token accounting: every forced token is an answer token
(``predicted_n``), the sampler chain sees it, its log-probability is 0."""

from __future__ import annotations

from dataclasses import dataclass, field

from server.engine.engine import Engine, EngineOptions
from server.task import FinishReason, SamplingParams

from .helpers import run, task
from .test_constrained_engine import ConstrainedFake, SeqMatcher

PROMPT = list(range(10))
# positions 0-2 and 4-7 are literal (forced), 3 and 8 the model's choice
SEQ = [100, 101, 102, 5, 103, 104, 105, 106, 7]
LITERAL = {0, 1, 2, 4, 5, 6, 7}


@dataclass
class ForcingMatcher(SeqMatcher):
    """``SeqMatcher`` that forces the runs of ``literal`` positions (llguidance's
    fast-forward tokens, at most ``limit``)."""

    literal: set[int] = field(default_factory=set)

    def forced(self, limit: int) -> list[int]:
        out: list[int] = []
        i = self.pos
        while i < len(self.seq) and i in self.literal and len(out) < limit:
            out.append(self.seq[i])
            i += 1
        return out


@dataclass
class ForcingConstraint:
    seq: list[int]
    literal: set[int]
    made: list[ForcingMatcher] = field(default_factory=list)

    def matcher(self) -> ForcingMatcher:
        self.made.append(ForcingMatcher(list(self.seq), literal=set(self.literal)))
        return self.made[-1]


def _forced_task(max_tokens=50, logprobs=False, seq=SEQ, literal=LITERAL):
    t, c = task(PROMPT, max_tokens=max_tokens)
    t.sampling = SamplingParams(temperature=0.0, constraint=ForcingConstraint(seq, literal))
    t.gen.logprobs = logprobs
    return t, c


def _gen_decodes(b: ConstrainedFake) -> list[list[int]]:
    """The tokens of each decode after the prompt's."""
    return [[t for _, _, t in rows] for rows in b.decodes[1:]]


def test_forced_runs_are_decoded_in_one_batch_each():
    b = ConstrainedFake()
    e = Engine(b, EngineOptions())
    t, c = _forced_task(logprobs=True)
    run(e, t)
    r = c.result
    assert r.finish is FinishReason.STOP and r.tokens == SEQ
    assert r.timings.predicted_n == len(SEQ)
    # the first three forced at the prompt's row (nothing sampled), then decoded together
    # with the row that samples 5; 5 and the four forced after it in one more decode; 7
    # completes the constraint (never decoded)
    assert _gen_decodes(b) == [[100, 101, 102], [5, 103, 104, 105, 106]]
    assert e.slots[0].tokens == PROMPT + SEQ[:-1]
    assert b.samplers[0].forced == [SEQ[i] for i in sorted(LITERAL)]
    assert b.refused == 2  # only the two free tokens went through the sampler
    assert [lp.token for lp in r.logprobs] == SEQ
    assert [lp.logprob for lp in r.logprobs] == [0, 0, 0, -0.5, 0, 0, 0, 0, -0.5]


def test_max_tokens_cuts_inside_a_forced_run():
    b = ConstrainedFake()
    e = Engine(b, EngineOptions())
    t, c = _forced_task(max_tokens=5)
    run(e, t)
    r = c.result
    assert r.finish is FinishReason.LENGTH and r.tokens == SEQ[:5]
    assert r.timings.predicted_n == 5


def test_a_run_without_literals_samples_every_token():
    b = ConstrainedFake()
    e = Engine(b, EngineOptions())
    t, c = _forced_task(literal=set())
    run(e, t)
    assert c.result.tokens == SEQ and b.refused == len(SEQ)
    assert all(len(d) == 1 for d in _gen_decodes(b))


def test_forced_tokens_beside_a_free_slot_and_a_second_turn():
    """A constrained slot feeding forced tokens shares its batches with a free slot; the
    next request on the answer reuses every decoded token from the cache."""
    b = ConstrainedFake()
    e = Engine(b, EngineOptions())
    t1, c1 = _forced_task()
    t2, c2 = task(range(20, 40), max_tokens=6)
    run(e, t1, t2)
    assert c1.result.tokens == SEQ and len(c2.result.tokens) == 6
    slot = next(s for s in e.slots if s.tokens[: len(PROMPT)] == PROMPT)
    t3, c3 = task([*PROMPT, *SEQ, 300, 301], max_tokens=1, id_slot=slot.id)
    run(e, t3)
    # the KV holds the prompt and every answer token but the last: those are cached
    assert c3.result.timings.cache_n == len(PROMPT) + len(SEQ) - 1
    assert c3.result.timings.prompt_n == 3


def test_forced_tokens_that_complete_the_constraint_are_decoded_before_the_end():
    """The call's closing markup is forced: the run decodes it (one step, nothing sampled)
    before it finishes, so the KV holds the whole answer for the next turn."""
    b = ConstrainedFake()
    e = Engine(b, EngineOptions())
    seq = [100, 5, 101, 102]
    t, c = _forced_task(seq=seq, literal={0, 2, 3}, logprobs=True)
    run(e, t)
    r = c.result
    assert r.finish is FinishReason.STOP and r.tokens == seq
    assert r.timings.predicted_n == 4 and len(r.logprobs) == 4
    assert _gen_decodes(b) == [[100], [5, 101, 102]]
    assert e.slots[0].tokens == PROMPT + seq
    assert b.refused == 1


class HealFake(ConstrainedFake):
    """A vocabulary where the prompt's last token (9, "j") and the answer's first forced
    token (100, "w") merge: "jw" is token 500 (as ``>`` and ``<`` make ``><``)."""

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        return b"jw" if token == 500 else super().token_to_piece(token, special)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True):
        if text.startswith("jw"):
            return [500, *super().tokenize(text[2:])]
        return super().tokenize(text)


def test_the_prompts_last_token_heals_into_the_forced_answer():
    """The KV holds the prompt and answer as their joined text tokenizes (the next turn's
    prompt), the answer's text leaves the prompt's bytes out."""
    b = HealFake()
    e = Engine(b, EngineOptions())
    t, c = _forced_task(seq=[100, 5, 7], literal={0})
    run(e, t)
    r = c.result
    assert r.finish is FinishReason.STOP and r.tokens == [500, 5, 7]
    assert r.text == "wfh" and r.timings.predicted_n == 3
    assert e.slots[0].tokens == PROMPT[:-1] + [500, 5]
    assert r.timings.prompt_n == len(PROMPT)
