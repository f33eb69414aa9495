"""The engine's speculative decoding, step by step: which runs draft, what each drafts this
step (an n-gram of its context, read by ``schedule``; or the draft model's batched proposal,
run by ``execute``), and verification: sampling the drafted rows and dropping the rejected
ones. Policy lives in ``speculative.py``, the draft model's decoding in ``drafter.py``."""

from __future__ import annotations

from collections.abc import Callable

from ..kv.store import SlotStore
from ..slot.slot import Slot, SlotRun
from ..slot.speculative import SpecConfig, draft_room, ngram_draft, request_limits
from ..slot.stats import EngineStats
from ..types import Checkpoint
from .drafter import ModelDrafter, Want


class DraftDropError(RuntimeError):
    """The rejected draft rows could not be removed from the KV cache."""


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

    @property
    def by_model(self) -> bool:
        """draft-simple: drafts come from the draft model (``execute`` runs it)."""
        return self.drafter is not None

    def draft_room(self, s: Slot, room: int) -> int:
        """Most draft tokens the slot tries this step, within ``room`` batch rows: 0 when
        that is below the run's n_min."""
        run = s.run
        assert run is not None and run.spec is not None  # a speculating run
        n = min(room, draft_room(len(s.tokens), s.n_ctx, self.remaining(run), run.spec))
        return n if n >= max(1, run.spec.n_min) else 0

    def ngram(self, s: Slot, room: int) -> list[int]:
        """ngram-simple: the draft read off the slot's own tokens (at most ``room``)."""
        hist = s.seq.array()
        return ngram_draft(hist, s.live.next_token, self.cfg.ngram_n, self.cfg.ngram_m)[:room]

    def model_drafts(self, wants: list[tuple[Slot, int]]) -> dict[int, list[int]]:
        """draft-simple: the draft model's proposals for (slot, room) pairs, by slot id."""
        if self.drafter is None or not wants:
            return {}
        asks: list[Want] = []
        for s, room in wants:
            spec = s.live.spec
            assert spec is not None  # only a speculating run is given draft room
            asks.append(Want(s, room, spec.p_min))
        return self.drafter.propose(asks)

    def verify(self, s: Slot, row: int, draft: list[int], pick: Callable[[int], int]) -> list[int]:
        """A drafting slot's rows ``row..row+len(draft)`` were decoded: sample them in
        order (``pick(row)``) while the sampled token equals the draft (llama.cpp's
        ``common_sampler_sample_and_accept_n``), then drop the rejected rows from the KV
        cache. Returns the sampled tokens: the accepted drafts and the token after them
        (the next to decode). Raises DraftDropError when the rows could not be dropped; a
        sampling failure propagates."""
        picked: list[int] = []
        for i in range(len(draft) + 1):
            picked.append(pick(row + i))
            if i == len(draft) or picked[-1] != draft[i]:
                break
        n_keep = len(s.tokens) - len(draft) + len(picked) - 1
        if self.store.cut(s, n_keep) != n_keep:
            raise DraftDropError("could not drop rejected draft tokens")
        return picked

    def checkpoint_data(self, s: Slot) -> bytes:
        """The draft's part of a checkpoint being taken of ``s`` (empty without a draft
        model, or when the draft lags: a resume there then recomputes it)."""
        return self.store.dft.checkpoint_data(s) if self.store.dft is not None else b""

    def resumed(self, s: Slot, c: Checkpoint) -> None:
        """``s`` resumed at checkpoint ``c``: its draft follows with the checkpoint's data."""
        if self.store.dft is not None:
            self.store.dft.resume(s, c)

    def before_shift(self, s: Slot, n_keep: int, n_discard: int) -> None:
        """``s`` is about to shift its context: the draft shifts along (or is cut)."""
        if self.store.dft is not None:
            self.store.dft.shift(s, n_keep, n_discard)

    def sync(self, s: Slot, whole: bool = False) -> None:
        """Catch the slot's draft sequence up (see ModelDrafter.sync); only for a run that
        speculates with a draft model."""
        if self.drafter is not None and s.run is not None and s.run.spec is not None:
            self.drafter.sync(s, whole)
