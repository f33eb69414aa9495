"""``execute``: the runner's batch (engine/runner.py calls it; only the runner changes
llama.cpp memory).

It runs the plan's memory operations (parked --cache-reuse chunks moved in, context shifts,
checkpoints, draft-model proposals), fills the batch, decodes it (a decode without KV room
frees idle slots' KV, then retries with a smaller plan, then ends the longest run),
commits what was decoded to the slot store (so its invariant holds again before anything
else runs) and samples every row with logits: CPU-sampled slots together (concurrently
when the pool pays), constrained and backend-sampled ones alone, drafting ones by
verification. ``update`` then does the accounting from the ``StepOutputs``.
"""

from __future__ import annotations

import logging
import time

from ..image_types import PromptImage
from ..kv.store import SlotStore
from ..slot.backend_api import Backend
from ..slot.slot import Slot, SlotRun
from ..slot.stats import EngineStats
from ..speculative.spec_step import DraftDropError, Speculation
from ..task import FinishReason, TokenLogprob
from ..tiers.prompt_cache import PromptCache
from ..types import TokenMatcher
from . import ram
from .cache_reuse import CacheReuse
from .sampling_paths import ConstraintDeadEnd, ParallelSampling
from .step_plan import Ended, SlotOutput, SlotWork, StepOutputs, StepPlan

log = logging.getLogger("server.engine.executor")

# the most forced tokens one step feeds (a frame's literal parts are tens of tokens)
MAX_FORCED = 64
KV_FULL = "Context size has been exceeded: the KV cache has no room left"


class Executor:
    def __init__(
        self,
        backend: Backend,
        store: SlotStore,
        spec: Speculation,
        stats: EngineStats,
        par: ParallelSampling,
        cache: PromptCache | None,
        reuse: CacheReuse | None = None,
    ) -> None:
        """``cache``: where idle slots' KV goes before it is freed for room (None: dropped).
        ``reuse``: moves parked --cache-reuse chunks in (a plan with ``SlotWork.reuse``)."""
        self.b = backend
        self.reuse = reuse
        self.store = store
        self.spec = spec
        self.stats = stats
        self.par = par
        self.cache = cache

    def free_idle_kv(self) -> bool:
        """Clear idle slots' sequences to make KV room (unified mode), saving them to the RAM
        cache first when there is one. True if any was freed."""
        freed = False
        for s in self.store.slots:
            if s.idle and s.tokens:
                ram.evict_idle(self.store, self.cache, s)
                freed = True
        return freed

    def execute(self, plan: StepPlan) -> StepOutputs:
        """Carry out ``plan``; see the module docstring. The plan may shrink on a retry."""
        out = StepOutputs()
        self.prepare(plan, out)
        if not plan.work or not self._decode(plan, out):
            return out
        self.store.commit_all(plan.work)
        out.outputs += [SlotOutput(w) for w in plan.work]
        self._sample_all(out)
        return out

    # ---- before the decode ---------------------------------------------------------

    def prepare(self, plan: StepPlan, out: StepOutputs) -> None:
        """The plan's memory operations: parked chunks moved in, shifts, checkpoints, then
        draft-model proposals (for the works still in the plan, with the room it reserved)."""
        if not any(_has_ops(w) for w in plan.work):
            return  # most steps: one pass over the works, no per-work passes below
        for w in list(plan.work):
            if w.reuse:
                self._move_in(w)
            if w.shift is not None and not self._shift(w.slot, *w.shift):
                plan.drop(w.slot)
                out.ended.append(Ended(w.slot, FinishReason.LENGTH))
            elif w.checkpoint:
                self.spec.sync(w.slot, whole=True)  # the checkpoint carries the draft too
                c = self.store.take_checkpoint(w.slot)
                c.data_dft = self.spec.checkpoint_data(w.slot)
                self.stats.checkpoints_created += 1
                log.debug("slot %d: checkpoint at %d tokens", w.slot.id, c.n_tokens)
        for w in [w for w in plan.work if w.image is not None]:  # a copy: plan.drop edits it
            self._decode_image(w, plan, out)
        wants = [(w.slot, w.model_room) for w in plan.work if w.model_room > 0]
        drafted = self.spec.model_drafts(wants)
        for w in plan.work:
            if w.model_room > 0:
                w.tokens += drafted.get(w.slot.id, [])[: w.model_room]

    def _decode_image(self, w: SlotWork, plan: StepPlan, out: StepOutputs) -> None:
        """An image's embeddings, decoded alone at the slot's next positions and committed
        (its placeholders): the work leaves the batch, its output stays for the accounting.
        A failed decode ends the run (an error: the image did not fit, or llama.cpp failed)."""
        image = w.image
        assert image is not None
        s = w.slot
        plan.drop(s)
        self.b.set_adapters(plan.adapters)  # the step's adapter set, as its batch's
        ret = self._image_decode(s, image)
        if ret == 1 and self.free_idle_kv():  # no KV room: idle slots' KV freed, once more
            self.store.rollback(s)
            ret = self._image_decode(s, image)
        if ret != 0:
            self.store.rollback(s)
            why = KV_FULL if ret == 1 else f"llama_decode failed on an image ({ret})"
            out.ended.append(Ended(s, FinishReason.ERROR, why))
            return
        self.store.commit(s, w.tokens)
        self.stats.on_image(image.n_tokens)
        out.outputs.append(SlotOutput(w))

    def _image_decode(self, s: Slot, image: PromptImage) -> int:
        try:
            e = image.image
            return self.b.decode_image(s.id, len(s.tokens), e.embd, e.non_causal)
        except Exception:
            log.exception("decoding an image failed on slot %d", s.id)
            return -100

    def _move_in(self, w: SlotWork) -> None:
        """--cache-reuse: the work's parked chunks join the slot before its tokens. When a
        move failed, the work computes the prompt from where the slot ends instead (as many
        tokens as planned; logits only if they still end the prompt)."""
        moved = self.reuse is not None and self.reuse.place_due(w.slot, w.reuse)
        if moved:
            return
        prompt = w.slot.live.task.prompt
        cur = len(w.slot.tokens)
        end = min(len(prompt), cur + len(w.tokens))
        w.tokens, w.logits = prompt[cur:end], end == len(prompt)

    def _shift(self, s: Slot, n_keep: int, n_discard: int) -> bool:
        """--context-shift: drop half of what follows n_keep and go on; False: the run
        ends (``length``)."""
        s.live.shift_due = False
        if s.live.task.images:
            return False  # a shift could cut an image: a run with images ends at the context
        # cells another slot shares are dropped, never moved (store.owned_discard)
        n_discard = self.store.owned_discard(s, n_keep, n_discard)
        self.spec.before_shift(s, n_keep, n_discard)
        if not self.store.shift(s, n_keep, n_discard):
            return False
        self.stats.context_shifts += 1
        log.info("slot %d: context shift, n_keep = %d, n_discard = %d", s.id, n_keep, n_discard)
        return True

    def _fill(self, plan: StepPlan) -> int:
        """Put the plan into the batch: generating slots' rows in one call (no per-token
        batch writes from Python), then prompt chunks. Sets each work's ``row``."""
        batch = self.b.batch
        batch.clear()
        toks: list[int] = []
        pos: list[int] = []
        seqs: list[int] = []
        for w in plan.work:
            if not w.generating:
                continue
            n = len(w.slot.seq.tokens)
            w.row = len(toks)
            if len(w.tokens) == 1:  # most rows: a sampled token without a draft
                toks.append(w.tokens[0])
                pos.append(n)
                seqs.append(w.slot.id)
            else:
                toks.extend(w.tokens)
                pos.extend(range(n, n + len(w.tokens)))
                seqs.extend([w.slot.id] * len(w.tokens))
        if toks:
            batch.add_tokens(toks, pos, seqs)
        for w in plan.work:
            if not w.generating:
                w.row = batch.add_span(w.tokens, len(w.slot.tokens), w.slot.id, w.logits)
        return batch.n

    # ---- the decode ----------------------------------------------------------------

    def _decode(self, plan: StepPlan, out: StepOutputs) -> bool:
        """Decode the plan, retrying as ``_recover`` says; whether a batch was decoded."""
        self.b.set_adapters(plan.adapters)  # one adapter set per decode (adapter_turns)
        while plan.work:
            n = self._fill(plan)
            t0 = time.perf_counter()
            try:
                ret = self.b.decode(0, n)
            except Exception:
                log.exception("llama_decode raised")
                ret = -100
            dt = time.perf_counter() - t0
            if ret == 0:
                out.n_tokens = n
                self.stats.on_decode(len(plan.work), dt)
                return True
            for w in plan.work:
                self.store.rollback(w.slot)
            self._recover(ret, plan, out)
        return False

    def _recover(self, ret: int, plan: StepPlan, out: StepOutputs) -> None:
        """After a failed decode: free idle KV, else halve the batch, else end the longest
        run (an error, as llama-server sends one, never a quiet "length" with no text)."""
        if ret == 1 and self.free_idle_kv():
            return
        if ret == 1 and plan.budget > 1:
            plan.shrink(max(1, plan.budget // 2))
            log.warning("llama_decode found no KV room; retrying with n_batch=%d", plan.budget)
            return
        victim = max(plan.work, key=lambda w: len(w.slot.tokens)).slot
        log.error("llama_decode failed (%d); ending task on slot %d", ret, victim.id)
        if ret == 1:
            self.stats.kv_exhausted += 1
            error = KV_FULL
        else:
            error = f"llama_decode failed ({ret})"
        plan.drop(victim)
        out.ended.append(Ended(victim, FinishReason.ERROR, error))

    # ---- sampling --------------------------------------------------------------------

    def _sample_all(self, out: StepOutputs) -> None:
        """Sample every work with logits. CPU-sampled slots without a constraint or a
        draft are sampled together first (concurrently when the pool is worth it), then
        each slot takes its token(s) in turn; a failure ends that slot's run only."""
        todo = [o for o in out.outputs if _wants_sample(o.work)]
        cpu = [o for o in todo if _plain(o.work)]
        picked: dict[int, int] = {}
        if len(cpu) > 1:
            pool = self.par.pool_for(len(cpu))
            try:
                items = []
                for o in cpu:
                    run = o.work.slot.run
                    assert run is not None  # per token: no ``live`` call
                    items.append((run.sampler, o.work.row))
                toks = self.b.sample_many(items, pool)
                if len(toks) != len(cpu):
                    raise ValueError(f"sample_many gave {len(toks)} tokens for {len(cpu)} rows")
                todo = self._take_picked(cpu, toks, todo, picked)
            except Exception:  # sampled one by one below, where a failure ends its slot only
                log.exception("batched sampling failed")
        for o in todo:
            s = o.work.slot
            try:
                self._sample(o, picked.get(s.id, -1))
            except Exception as e:
                # a fault of the request's own (non-finite logits, a dead-end constraint)
                # carries a 4xx ``status``: issue 40
                status = getattr(e, "status", 500)
                if status < 500:
                    log.warning("slot %d: %s", s.id, e)
                else:
                    log.exception("sampling failed on slot %d", s.id)
                o.tokens, o.logprobs = [], None
                plain = isinstance(e, DraftDropError) or status < 500
                why = str(e) if plain else f"sampling failed: {e}"
                out.ended.append(Ended(s, FinishReason.ERROR, why, status))

    @staticmethod
    def _take_picked(
        cpu: list[SlotOutput], toks: list[int], todo: list[SlotOutput], picked: dict[int, int]
    ) -> list[SlotOutput]:
        """The batched picks of ``cpu``: a row without log-probs takes its token here (most
        rows, every step); the others go into ``picked`` for ``_sample``. Returns what of
        ``todo`` is left to ``_sample``, in order."""
        done: set[int] = set()
        for o, t in zip(cpu, toks, strict=True):
            run = o.work.slot.run
            assert run is not None  # per token: no ``live`` call
            gen = run.task.gen
            if gen.logprobs or gen.n_probs > 0:
                picked[o.work.slot.id] = t
            else:
                o.tokens = [t]
                done.add(o.work.slot.id)
        if len(done) == len(todo):
            return []
        return [o for o in todo if o.work.slot.id not in done] if done else todo

    def _sample(self, o: SlotOutput, tok: int) -> None:
        w = o.work
        run = w.slot.run
        assert run is not None  # a slot in the plan holds a run
        m = run.matcher
        if m is not None and not w.generating and self._force_first(o, run, m):
            return
        row = w.row + w.n_forced  # the row after the sampled token and the forced ones
        draft = w.draft
        if not draft:  # one row to sample: most slots, every step
            o.tokens = [tok if tok >= 0 else self.pick(run, row)]
        else:
            o.tokens = self.spec.verify(w.slot, row, draft, lambda i: self.pick(run, i))
            o.n_drafted, o.n_accepted = len(draft), len(o.tokens) - 1
        n = len(o.tokens)
        if m is not None:  # the tokens the constraint forces after the last one sampled
            o.tokens += self._forced(run, m, w.slot.n_ctx - len(w.slot.tokens) - 2)
            o.n_forced = len(o.tokens) - n
        gen = run.task.gen
        if gen.logprobs or gen.n_probs > 0:
            o.logprobs = [
                self.b.sampled_logprobs(run.sampler, row + i, t, gen.n_probs)
                for i, t in enumerate(o.tokens[:n])
            ] + [_forced_logprob(t, gen.n_probs) for t in o.tokens[n:]]

    def _force_first(self, o: SlotOutput, run: SlotRun, m: TokenMatcher) -> bool:
        """The prompt's last row, where the constraint forces the answer's first tokens:
        they are taken as they are (nothing sampled); False when it forces none."""
        s = o.work.slot
        forced = self._forced(run, m, s.n_ctx - len(s.tokens) - 1)
        if not forced:
            return False
        o.tokens = self._heal(s, run, forced)
        o.n_forced = len(o.tokens) - 1
        gen = run.task.gen
        if gen.logprobs or gen.n_probs > 0:
            o.logprobs = [_forced_logprob(t, gen.n_probs) for t in o.tokens]
        return True

    def _heal(self, s: Slot, run: SlotRun, forced: list[int]) -> list[int]:
        """The answer's forced first tokens as the same text tokenizes after the prompt: where
        the prompt's last token merges with them (``>`` then ``<`` is ``><`` in a vocabulary
        that splits markup), that token leaves the KV and the merged tokens are decoded in
        its place, so the next turn's prompt (prompt and call as one text) matches the KV.
        The first token then carries the prompt's last bytes: ``run.skip`` keeps them out of
        the answer's text. ``forced`` unchanged where nothing merges."""
        n = len(s.tokens)
        if n < 2 or n != run.n_prompt or self.b.is_recurrent:
            return forced
        last = s.tokens[-1]
        head = self.b.token_to_piece(last)
        pieces = [self.b.token_to_piece(t) for t in forced]
        if head != self.b.token_to_piece(last, True) or any(
            p != self.b.token_to_piece(t, True) for p, t in zip(pieces, forced, strict=True)
        ):
            return forced  # a control token (a marker): its text is not its piece, no merge
        body = b"".join(pieces)
        try:
            text = (head + body).decode()
        except UnicodeDecodeError:
            return forced
        toks = self.b.tokenize(text, add_special=False, parse_special=True)
        if not toks or toks[0] == last or len(toks) > len(forced) + 2:
            return forced
        if b"".join(self.b.token_to_piece(t) for t in toks) != head + body:
            return forced  # (a special token's text: left as the constraint wrote it)
        if self.store.cut(s, n - 1) != n - 1:
            raise DraftDropError("could not drop the prompt's last token to heal it")
        run.skip = len(head)
        return toks

    def _forced(self, run: SlotRun, m: TokenMatcher, room: int) -> list[int]:
        """The constraint's forced tokens from here (at most ``room`` and ``MAX_FORCED``),
        accepted by the matcher and the sampler chain: the next step decodes them in one
        batch behind the last sampled token, as a draft's accepted tokens are, instead of
        sampling them one step each. They are the canonical tokenization of the literal
        text, so the next turn's prompt (which tokenizes that text) matches them."""
        forced = m.forced(min(MAX_FORCED, room))
        for t in forced:
            if not m.accept(t):
                raise ConstraintDeadEnd(f"the constraint refused its own token: {m.error()}")
            self.b.accept_forced(run.sampler, t)
        return forced

    def pick(self, run: SlotRun, idx: int) -> int:
        """The run's next token: sampled (or forced by its reasoning budget), and for a
        constrained run one its matcher allows (the matcher is advanced over it). Costs a
        constrained slot about 0.2 ms per token, 1-2 ms when the sampled token is refused
        (full-vocabulary mask): it never holds up the batch for long. Raises ConstraintDeadEnd (a 400) when the constraint admits no
        token."""
        m = run.matcher
        if m is None:
            tok = self.b.sample(run.sampler, idx)
            budget = run.budget
            return tok if budget is None or budget.done else budget.next(tok)
        gen = run.task.gen
        # with log-probs wanted, always mask: they report the constrained distribution
        tok = self.b.sample_constrained(run.sampler, idx, m, gen.logprobs or gen.n_probs > 0)
        if tok < 0 or not m.accept(tok):
            raise ConstraintDeadEnd(f"the constraint admits no token: {m.error() or 'dead end'}")
        return tok


def _has_ops(w: SlotWork) -> bool:
    """The work runs memory operations or a proposal before the batch (``prepare``)."""
    return bool(
        w.reuse or w.checkpoint or w.shift is not None or w.image is not None or w.model_room
    )


def _forced_logprob(tok: int, n_probs: int) -> TokenLogprob:
    """A forced token's log-probability: 0 (the constraint left no choice; no logits row
    was read for it), itself its only alternative."""
    return TokenLogprob(tok, 0.0, [(tok, 0.0)][:n_probs])


def _wants_sample(w: SlotWork) -> bool:
    """Rows with logits are sampled, but a prompt-only run (n_predict 0) samples nothing."""
    if not w.logits:
        return False
    if w.generating:
        run = w.slot.run
        return run is None or not run.closing  # a closing run's forced tokens: no sample
    return w.slot.live.task.gen.max_tokens != 0


def _plain(w: SlotWork) -> bool:
    run = w.slot.run
    assert run is not None  # a slot in the plan holds a run (per token: no ``live`` call)
    draftless = len(w.tokens) == 1 or not w.generating
    unbudgeted = run.budget is None or run.budget.done  # ``pick`` applies a budget
    return run.matcher is None and not run.backend_sampled and draftless and unbudgeted
