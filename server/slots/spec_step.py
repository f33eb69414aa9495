"""The engine's speculative decoding, step by step: which runs draft, what each drafts this
step (an n-gram of its context, or the draft model's batched proposal), and keeping what
verification accepted. The engine samples the verification rows (``Engine._verify``);
policy lives in ``speculative.py``, the draft model's decoding in ``drafter.py``."""

from __future__ import annotations

from collections.abc import Callable

from .drafter import ModelDrafter, Want
from .slot import Slot, SlotRun
from .speculative import SpecConfig, TokenHistory, draft_room, ngram_draft, request_limits
from .stats import EngineStats
from .store import SlotStore


class Speculation:
    def __init__(
        self,
        cfg: SpecConfig,
        store: SlotStore,
        stats: EngineStats,
        recurrent: bool,
        remaining: Callable[[SlotRun], int],
    ) -> None:
        """``remaining(run)``: tokens the run may still generate (-1: no limit)."""
        self.cfg = cfg
        self.store = store
        self.stats = stats
        self.recurrent = recurrent
        self.remaining = remaining
        self.drafter = ModelDrafter(store.dft, stats) if store.dft is not None else None

    def plan(self, run: SlotRun) -> None:
        """Whether the run drafts: the server speculates, the request did not turn it off,
        its tokens are sampled on the CPU (a backend chain yields one token per sequence) and
        the memory can drop rejected tokens (recurrent state cannot)."""
        gen = run.task.gen
        limits = request_limits(self.cfg, gen.spec_n_max, gen.spec_n_min, gen.spec_p_min)
        if limits is None or run.backend_sampled or self.recurrent:
            return
        run.spec = limits
        run.history = TokenHistory()

    def room(self, s: Slot) -> int:
        run = s.run
        # mypy: Slot.run and run.spec are Optional (the Sequence rewrite fixes it)
        return draft_room(len(s.tokens), s.n_ctx, self.remaining(run), run.spec)  # type: ignore[arg-type]

    def model_drafts(self, gen: list[Slot]) -> dict[int, list[int]]:
        """draft-simple: the draft model's proposals for this step's drafting slots."""
        if self.drafter is None:
            return {}
        wants = []
        for s in gen:
            if s.run.spec is not None and (room := self.room(s)) > 0:
                wants.append(Want(s, room, s.run.spec.p_min))
        return self.drafter.propose(wants) if wants else {}

    def draft(self, s: Slot, room: int, drafted: dict[int, list[int]]) -> list[int]:
        """The draft the slot tries this step (at most ``room`` tokens; may be empty):
        the draft model's (``drafted``), or an n-gram of its context."""
        run = s.run
        room = min(room, self.room(s))
        if room < max(1, run.spec.n_min):
            return []
        if self.drafter is not None:
            return drafted.get(s.id, [])[:room]
        hist = run.history.sync(s.tokens)
        return ngram_draft(hist, run.next_token, self.cfg.ngram_n, self.cfg.ngram_m)[:room]

    def accept(self, s: Slot, draft: list[int], n_accepted: int) -> bool:
        """Verification kept ``n_accepted`` of ``draft``: drop the rejected rows from the KV
        cache (the slot holds the decoded sampled token and the accepted drafts); False
        when they could not be dropped."""
        n_keep = len(s.tokens) - len(draft) + n_accepted
        if self.store.cut(s, n_keep) != n_keep:
            return False
        run = s.run
        run.history.truncate(n_keep)
        run.n_drafted += len(draft)
        run.n_draft_accepted += n_accepted
        self.stats.on_draft(len(draft), n_accepted)
        return True

    def sync(self, s: Slot, whole: bool = False) -> None:
        """Catch the slot's draft sequence up (see ModelDrafter.sync); only for a run that
        speculates with a draft model."""
        if self.drafter is not None and s.run is not None and s.run.spec is not None:
            self.drafter.sync(s, whole)
