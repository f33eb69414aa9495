"""draft-simple: the draft model's greedy continuation of each drafting slot, batched.

Per step, for every drafting slot at once: one draft decode catches the draft sequence up
with the slot's tokens and the token about to be verified (``next_token``), then one decode
per further draft position. Drafting stops for a slot at its room, or when the draft
model's top token is less likely than ``p_min``. The drafted tokens are then removed from
the draft sequence: it holds a prefix of the slot's tokens again (what the target accepts
is re-decoded by the next catch-up, as llama-server does). Each catch-up starts by
reconciling the draft with its slot by common prefix (draft_kv.py), so nothing has to keep
the two in step meanwhile. A catch-up longer than the draft batch (a long prompt) is spread
over steps; the slot verifies without a draft meanwhile.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..kv.draft_kv import DraftKV
from ..slot.slot import Slot
from ..slot.stats import EngineStats

log = logging.getLogger("server.speculative.drafter")


@dataclass
class Want:
    """A slot that may draft this step: at most ``room`` tokens, stopping below ``p_min``."""

    slot: Slot
    room: int
    p_min: float


class ModelDrafter:
    def __init__(self, kv: DraftKV, stats: EngineStats) -> None:
        self.kv = kv
        self.d = kv.d
        self.stats = stats

    def propose(self, wants: list[Want]) -> dict[int, list[int]]:
        """Drafts by slot id (slots without one are absent)."""
        rows = self._catch_up(wants)
        if not rows:
            return {}
        drafts: dict[int, list[int]] = {w.slot.id: [] for w, _ in rows}
        try:
            self._extend(rows, drafts)
        finally:
            for w, _ in rows:  # back to a prefix of the slot: the drafted tokens leave
                s = w.slot
                if not self.d.seq_rm(s.id, len(s.tokens), -1):
                    self.kv.clear(s.id)
        return {k: v for k, v in drafts.items() if v}

    def sync(self, s: Slot, whole: bool = False) -> None:
        """Catch the draft sequence up with all the slot's tokens, so that what is taken of
        the slot next carries the draft state too: a snapshot or slot file of the idle slot
        once a run that drafted has ended (a short lag), or a checkpoint (``whole``: the
        prompt so far, in batches; the draft needs it for its first draft anyway)."""
        n = self.kv.reconcile(s)
        if n == 0 and not whole:
            return
        while n < len(s.tokens):
            lag = s.tokens[n : n + self.d.n_batch]
            b = self.d.batch
            b.clear()
            b.add_span(lag, n, s.id, False)
            if self.d.decode() != 0:
                log.warning("draft decode failed; slot %d's draft recomputes later", s.id)
                self.kv.clear(s.id)
                return
            self.kv.caught_up(s, lag)
            n += len(lag)
            self.stats.draft_catchup_tokens += len(lag)

    def _catch_up(self, wants: list[Want]) -> list[tuple[Want, int]]:
        """Decode what each draft sequence lacks, plus ``next_token`` for the slots whose
        whole catch-up fits; returns those slots with their logits row."""
        b = self.d.batch
        b.clear()
        rows: list[tuple[Want, int]] = []
        spans: list[tuple[Slot, list[int]]] = []
        for w in wants:
            s = w.slot
            room = self.d.n_batch - b.n
            if room <= 0:
                break
            n = self.kv.reconcile(s)
            lag = s.tokens[n:]
            if len(lag) + 1 <= room:
                rows.append((w, b.add_span([*lag, s.live.next_token], n, s.id, True)))
            else:  # the rest next step
                lag = lag[:room]
                b.add_span(lag, n, s.id, False)
            spans.append((s, lag))
        if b.n == 0:
            return []
        if self.d.decode() != 0:
            log.warning("draft decode failed; the drafting slots recompute their drafts")
            for s, _ in spans:
                self.kv.clear(s.id)
            return []
        for s, lag in spans:
            self.kv.caught_up(s, lag)  # the next_token row is beyond them: removed later
            self.stats.draft_catchup_tokens += len(lag)
        return rows

    def _extend(self, rows: list[tuple[Want, int]], drafts: dict[int, list[int]]) -> None:
        """Greedy draft tokens, one decode per position, while any slot is still drafting."""
        live = rows
        while live:
            nxt: list[tuple[Want, int]] = []
            toks: list[tuple[Want, int]] = []
            for w, row in live:
                tok, p = self.d.greedy(row, w.p_min > 0)
                d = drafts[w.slot.id]
                if p < w.p_min:
                    continue
                d.append(tok)
                if len(d) < w.room:
                    toks.append((w, tok))
            if not toks:
                return
            b = self.d.batch
            b.clear()
            for w, tok in toks:
                s = w.slot
                nxt.append((w, b.add_span([tok], len(s.tokens) + len(drafts[s.id]), s.id, True)))
            if self.d.decode() != 0:
                log.warning("draft decode failed; drafts end here")
                return
            live = nxt
