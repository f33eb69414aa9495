"""``admit`` and ``schedule``: a step's decisions, made from the slots' states without
touching memory. ``admit`` places waiting tasks on idle slots; ``schedule`` plans the batch.

Generating slots come first, each with its sampled token (and its draft when it speculates:
an n-gram draft is read off its tokens here; a draft model's proposal is only given room,
``execute`` runs it); then the prefilling slots, oldest first, take what is left of the
budget (while a slot generates, at most one ubatch and what fits in ``--step-target-ms`` by
the measured step speed: its next token waits for no more) in
chunks that end where a sharing waiter, a checkpoint or a parked --cache-reuse chunk needs
the slot to stop (the chunk moves in at the start of the slot's next work).
"""

from __future__ import annotations

import collections

from ..kv import images
from ..kv.checkpoints import CheckpointPolicy
from ..kv.locator import Locator
from ..kv.policy import SlotView, choose_slot, match_views
from ..kv.share_cost import StepSpeed
from ..kv.store import shift_span
from ..prefix.reuse import due_chunks
from ..slot.backend_api import Backend
from ..slot.slot import Slot, SlotState
from ..speculative.spec_step import Speculation
from ..task import Task
from .adapter_turns import AdapterTurns
from .options import EngineOptions
from .step_plan import Admission, Placement, SlotWork, StepPlan

# The least prompt chunk a step takes while slots generate, whatever the step-time target.
MIN_PROMPT_CHUNK = 32


class Scheduler:
    def __init__(
        self, ckpt: CheckpointPolicy, spec: Speculation, backend: Backend, opts: EngineOptions
    ) -> None:
        """``opts.slot_prompt_similarity`` is read at each admission (ARCHITECTURE §5)."""
        self.ckpt = ckpt
        self.spec = spec
        self.opts = opts
        self.n_batch = backend.n_batch
        self.n_ubatch = backend.n_ubatch
        self.n_swa = backend.n_swa
        self.recurrent = backend.is_recurrent
        self.add_bos = backend.add_bos
        self.turns = AdapterTurns()
        # the measured step speed (the engine hands sharing's estimate over): what a step of
        # n tokens costs, for the step-time target; None until set
        self.speed: StepSpeed | None = None

    def _prompt_limit(self, plan: StepPlan, used: int) -> int:
        """The step's token limit once the generating slots' ``used`` tokens are in. While
        slots generate, prompt tokens take one ubatch at most, and no more than fit in the
        step-time target by the measured speed (at least ``MIN_PROMPT_CHUNK``, so prompts
        always progress): a long prompt then holds each of their tokens back about the
        target, not n_batch's time."""
        if not plan.work:
            return plan.budget
        room = self.n_ubatch
        target = self.opts.step_target_ms / 1000.0
        speed = self.speed
        if target > 0 and speed is not None and speed.per_token:
            fit = int((target - (speed.per_step or 0.0)) / speed.per_token) - used
            room = min(room, max(MIN_PROMPT_CHUNK, fit))
        return min(plan.budget, used + room)

    def admit(
        self, waiting: collections.deque[Task], slots: list[Slot], locator: Locator | None = None
    ) -> Admission:
        """Which idle slot each waiting task takes, in queue order (FIFO, or the priority
        order engine/priority.py sorted the queue in; ARCHITECTURE §5). A task whose
        slot (``id_slot``) is busy waits and the next ones go on; a task that finds no idle
        slot at all stops admission (the rest keep their order). Pure: the slots a pass
        places are only marked taken in its own views. What the slots hold of each prompt
        is ``locator``'s match (the engine's, over ``slots``; one over the views when
        None)."""
        out = Admission()
        views = [SlotView(s.id, s.idle, s.tokens, s.last_used, s.tenant) for s in slots]
        pending = iter(waiting)
        for task in pending:
            sim = self.opts.slot_prompt_similarity
            if locator is not None:  # the locator's, once
                match = locator.match_slots(task.tenant, task.prompt)
            else:
                match = match_views(views, task.prompt, task.tenant)
            choice = choose_slot(views, task.prompt, task.id_slot, sim, task.tenant, match)
            if choice is None:
                out.deferred.append(task)
                if task.id_slot < 0:
                    out.deferred.extend(pending)
                    break
                continue
            views[choice.slot] = views[choice.slot]._replace(idle=False)
            out.placements.append(Placement(slots[choice.slot], task, choice))
        return out

    def schedule(self, active: list[Slot], budget: int | None = None) -> StepPlan:
        """The plan for ``active`` (the slots prefilling or generating that may decode),
        within ``budget`` tokens (n_batch by default), prompt chunks within n_ubatch while
        any slot generates; of one LoRA adapter set, the sets taking turns
        (engine/adapter_turns.py). Pure but for the turn record."""
        plan = StepPlan(self.n_batch if budget is None else budget)
        active, plan.adapters = self.turns.pick(active)
        used = 0
        cap = plan.budget
        work = plan.work
        generate = SlotState.GENERATE
        pre: list[Slot] = []
        for s in active:
            if s.state is not generate:
                if s.state is SlotState.PREFILL:
                    pre.append(s)
                continue
            if used >= cap:
                continue
            run = s.run
            assert run is not None  # an active slot holds its run (per token: no ``live`` call)
            seq = run.seq
            if run.spec is None and not run.shift_due and seq.n_sampled != 1 and not seq.n_forced:
                # the usual row: its sampled token alone (see ``_generate``)
                work.append(SlotWork(s, [seq.next_token], True, True))
                used += 1
                continue
            w = self._generate(s, cap - used)
            work.append(w)
            used += len(w.tokens) + w.model_room
        if len(pre) > 1:
            pre.sort(key=lambda s: s.live.t_start)
        limit = self._prompt_limit(plan, used)
        for s in pre:
            if used >= limit:
                break
            w = self._prompt_chunk(s, limit - used)
            plan.work.append(w)
            used += len(w.tokens)
        return plan

    def _generate(self, s: Slot, room: int) -> SlotWork:
        """A generating slot's work: its sampled token, and a draft within ``room``."""
        run = s.run
        assert run is not None  # an active slot holds its run (per token: no ``live`` call)
        seq = run.seq
        if seq.n_forced:  # a constraint's forced tokens ride along, without a draft
            w = SlotWork(s, seq.pending(), generating=True, logits=True, n_forced=seq.n_forced)
        else:
            w = SlotWork(s, [seq.next_token], generating=True, logits=True)
        if run.shift_due:
            w.shift = self.shift_of(s)
        if run.n_decoded == 1 and self._wants_prompt_end_checkpoint(s):
            w.checkpoint = True
        if run.spec is not None and w.shift is None and not w.n_forced:
            n = self.spec.draft_room(s, room - 1)
            if n > 0 and self.spec.by_model:
                w.model_room = n
            elif n > 0:
                w.tokens += self.spec.ngram(s, n)
        return w

    def shift_of(self, s: Slot) -> tuple[int, int]:
        """llama-server's context shift for a full slot: (n_keep, n_discard)."""
        run = s.live
        gen = run.task.gen
        return shift_span(
            len(s.tokens), s.n_ctx, run.n_prompt, gen.n_keep, gen.n_discard, self.add_bos
        )

    def _prompt_chunk(self, s: Slot, room: int) -> SlotWork:
        """The slot's next prompt chunk (at most ``room`` tokens). A chunk ends where a
        sharing waiter, a checkpoint or a parked --cache-reuse chunk needs the slot to stop;
        a checkpoint of the state the chunk starts from is taken first when the policy wants
        one there, and parked chunks that start where the slot ends move in first."""
        cur = len(s.tokens)
        run = s.live
        task = run.task
        # a resumed run recomputing what the RAM cache lost of it (engine/preempt.py) fills
        # its KV back up to its answer so far; no logits: its next token is sampled already
        refill = run.refill
        prompt = task.prompt if refill is None else refill
        n_reuse, nxt = 0, -1
        if run.reuse:
            n_reuse, cur, nxt = due_chunks(run.reuse, cur)
        if task.images and not run.reuse:
            image = images.at(task.images, cur)
            if image is not None:  # one work, whatever the room: an image is never split
                return SlotWork(
                    s, prompt[cur : image.end], generating=False, logits=False, image=image
                )
        end = min(len(prompt), cur + room)
        if task.images:
            end = images.next_start(task.images, cur, end)
        if nxt >= 0:
            end = min(end, nxt)  # the gap up to the next parked chunk, no further
        marks = run.share_marks
        if marks:
            end = min(end, min((m for m in marks if m > cur), default=end))
        checkpoint = False
        if self.ckpt.enabled and refill is None:
            n_start = run.n_cached
            end = min(end, self.ckpt.chunk_end(cur, len(prompt), task.user_start, n_start))
            have = s.checkpoints
            checkpoint = self.ckpt.wants(cur, len(prompt), task.user_start, have, n_start, marks)
        return SlotWork(
            s,
            prompt[cur:end],
            generating=False,
            logits=end == len(prompt) and refill is None,
            checkpoint=checkpoint,
            reuse=n_reuse,
        )

    def _wants_prompt_end_checkpoint(self, s: Slot) -> bool:
        """The slot holds exactly its prompt and its first sampled token is about to be
        decoded. Skipped when prompt plus answer stay inside one window: a restored state of
        at most n_swa tokens serves every cut."""
        n_prompt = len(s.tokens)
        if not self.ckpt.wants_at_prompt_end(n_prompt, s.checkpoints):
            return False
        limit = s.live.task.gen.max_tokens
        return self.recurrent or limit < 0 or n_prompt + limit > self.n_swa
