"""A deterministic stand-in for llama.cpp, for unit tests of the scheduler and caches only.

KV memory is simulated per sequence as {position: token}; a sliding window prunes cells like
llama.cpp's SWA cache; state bytes are a real serialization of the cells (so restores are real
restores of the simulated memory). The "model" predicts next = f(token, position).
"""

from __future__ import annotations

import functools
import struct
import sys
from dataclasses import dataclass, field
from types import FrameType

from server.task import SamplingParams, TokenLogprob
from server.types import CacheCells

EOG = 999

# the calls that change a llama context's memory (or decode into it): the fake records the
# phase each one ran in (``FakeBackend.memory_calls``)
MEMORY_CALLS = (
    "decode",
    "decode_image",
    "seq_rm",
    "seq_cp",
    "seq_add",
    "seq_clear",
    "state_set",
)
RUNNER = "runner"  # the phase of a call made inside server/engine/runner.py
# the engine side's folders (where the slots' code lives)
ENGINE_SIDE = ("engine", "slot", "kv", "speculative", "kv_events", "prefix")
# the modules of the engine side that make a step's decisions or drive it: the innermost of
# them on the stack is a memory call's phase (helpers such as the store, the executor or
# the caches run in the phase of whoever called them)
PHASES = ("runner", "engine", "placement", "sharing", "embed", "scheduler", "update", "policy")


def call_phase() -> str:
    """The phase a memory call runs in, read off the stack: the innermost frame of a
    server/<engine-side folder> module in ``PHASES`` (``RUNNER`` for server/engine/runner.py), as
    ``module.function`` for any other; "test" when none is on the stack (a test's own)."""
    f: FrameType | None = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename.replace("\\", "/")
        if any(f"/server/{d}/" in name for d in ENGINE_SIDE):
            mod = name.rsplit("/", 1)[-1].removesuffix(".py")
            if mod == RUNNER:
                return RUNNER
            if mod in PHASES:
                return f"{mod}.{f.f_code.co_name}"
        f = f.f_back
    return "test"


def _recorded(cls: type) -> type:
    """Wrap ``cls``'s memory calls so that each appends (name, phase) to ``memory_calls``
    and (name, arguments) to ``memory_args``."""
    for name in MEMORY_CALLS:
        fn = cls.__dict__.get(name)
        if fn is None:
            continue

        @functools.wraps(fn)
        def wrapper(self, *a, __fn=fn, __name=name, **kw):
            self.memory_calls.append((__name, call_phase()))
            self.memory_args.append((__name, a))
            return __fn(self, *a, **kw)

        setattr(cls, name, wrapper)
    return cls


@dataclass
class FakeBatch:
    capacity: int
    tokens: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    seq: list[int] = field(default_factory=list)
    logits: list[bool] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.tokens)

    def clear(self) -> None:
        self.tokens, self.pos, self.seq, self.logits = [], [], [], []

    def add_span(self, tokens: list[int], pos0: int, seq: int, logits_last: bool) -> int:
        if self.n + len(tokens) > self.capacity:
            raise ValueError("batch overflow")
        for i, t in enumerate(tokens):
            self.tokens.append(t)
            self.pos.append(pos0 + i)
            self.seq.append(seq)
            self.logits.append(logits_last and i == len(tokens) - 1)
        return self.n - 1

    def outputs_all(self) -> None:
        self.logits = [True] * self.n

    def add_tokens(self, tokens: list[int], pos: list[int], seqs: list[int]) -> int:
        i0 = self.n
        if i0 + len(tokens) > self.capacity:
            raise ValueError("batch overflow")
        self.tokens += tokens
        self.pos += pos
        self.seq += seqs
        self.logits += [True] * len(tokens)
        return i0


class FakeSampler:
    def __init__(self, p: SamplingParams, script: list[int] | None) -> None:
        self.p = p
        self.script = list(script or [])
        self.freed = False
        self.forced: list[int] = []  # tokens accepted without sampling (accept_forced)

    def free(self) -> None:
        self.freed = True


def next_token(tok: int, pos: int) -> int:
    return (tok * 7 + pos * 3 + 1) % 900  # never EOG unless scripted


@_recorded
class FakeBackend:
    # class attributes, so that a test's subclass may set them in its body
    add_bos = False  # the vocabulary does not start texts with BOS
    # the KV cache's ggml types: None, unknown (states' types are not checked)
    kv_type_ids: tuple[int, int] | None = None
    pooling = -1  # embeddings off (EmbedBackend in test_embeddings has them)
    # the caches a state holds; ("full", "swa") acts as --swa-full (a window cache, n_swa 0)
    kv_kinds: tuple[str, ...] | None = ("full",)

    def __init__(
        self,
        *,
        n_seq: int = 4,
        n_ctx: int = 4096,
        n_batch: int = 512,
        n_ubatch: int = 128,
        n_swa: int = 0,
        swa_slack: int = 16,
        kv_unified: bool = True,
        n_vocab: int = 1000,
        scratch: bool = False,
    ) -> None:
        self.n_seq = n_seq
        # --cache-reuse's extra sequence (server.engine.cache_reuse; -1: none)
        self.scratch_seq = n_seq if scratch else -1
        self.n_ctx = n_ctx
        self.kv_unified = kv_unified
        self.n_ctx_slot = n_ctx if kv_unified else n_ctx // n_seq
        self.n_batch = n_batch
        self.n_ubatch = n_ubatch
        self.n_swa = n_swa
        # window cells kept beyond what the next token sees: llama.cpp reuses masked cells
        # only when it needs room, so a live sequence holds anywhere from none (-1 here) to
        # many more
        self.swa_slack = swa_slack
        self.n_vocab = n_vocab
        self.is_recurrent = False
        self.window_cache_slides = False  # the fake's window holds no shared cells anyway
        self.batch = FakeBatch(n_batch)
        self.kv: dict[int, dict[int, int]] = {s: {} for s in range(n_seq + (1 if scratch else 0))}
        self.decodes: list[list[tuple[int, int, int]]] = []  # per call: (seq, pos, token)
        self.outputs: dict[int, tuple[int, int, int]] = {}
        self.scripts: dict[int, list[int]] = {}  # prompt length -> scripted tokens (by first task)
        self.fail_next: list[int] = []  # decode return codes to inject
        self.samplers: list[FakeSampler] = []
        self.backend_sampling = False  # -bs: attach_sampler accepts chains
        self.attached: dict[int, FakeSampler] = {}  # seq -> chain sampling "on the backend"
        self.oom_on_state_get = False
        # what the "model" predicts after token ``tok`` at ``pos`` (tests may swap it)
        self.model = next_token
        # cells the KV holds that no slot accounts for (seq, pos): a leak, for integrity tests
        self.stray_cells: list[tuple[int, int]] = []
        self.can_shift = True  # llama_memory_can_shift: seq_add may move positions
        self.embeddings_on = False
        self.adapters: tuple[float, ...] = ()  # set_adapters' scales, for the next decodes
        self.decode_adapters: list[tuple[float, ...]] = []  # per decode call: its scales
        # every memory call (MEMORY_CALLS) with the phase it ran in (call_phase)
        self.memory_calls: list[tuple[str, str]] = []
        self.images: list[tuple[int, int, int, bool]] = []  # decode_image calls
        self.memory_args: list[tuple[str, tuple]] = []  # and its arguments
        # cells seq_cp made shared (unified KV): (seq, pos) -> cell id; seq_add moves a
        # shared cell for every sequence holding it, as llama.cpp does
        self.cell_ids: dict[tuple[int, int], int] = {}
        self._next_cell = 0

    # ---- tokenizer ----
    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        return chr(ord("a") + token % 26).encode()

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True):
        return [ord(c) - ord("a") for c in text]  # one letter a token (token_to_piece's)

    def eog_tokens(self) -> tuple[int, ...]:
        return (EOG,)

    def is_eog(self, token: int) -> bool:
        return token == EOG

    # ---- decode / sample ----
    def used_cells(self) -> int:
        if self.kv_unified:
            cells: set[tuple[int, int]] = set()
            for m in self.kv.values():
                cells.update(m.items())
            return len(cells)
        return max((len(m) for m in self.kv.values()), default=0)

    def decode(self, start: int, count: int) -> int:
        if self.fail_next:
            return self.fail_next.pop(0)
        b = self.batch
        rows = list(
            zip(
                b.seq[start : start + count],
                b.pos[start : start + count],
                b.tokens[start : start + count],
                strict=True,
            )
        )
        need = sum(1 for s, p, _ in rows if p not in self.kv[s])
        if self.used_cells() + need > self.n_ctx:
            return 1
        for s, p, t in rows:
            if self.kv[s] and p != max(self.kv[s]) + 1:
                raise AssertionError(f"seq {s}: position {p} does not follow {max(self.kv[s])}")
            if not self.kv[s] and p != 0:
                raise AssertionError(f"seq {s}: first position {p} != 0")
            self.kv[s][p] = t
            self.cell_ids.pop((s, p), None)  # a new cell, this sequence's alone
        self.outputs = {i: rows[i - start] for i in range(start, start + count) if b.logits[i]}
        self.decodes.append(rows)
        self.decode_adapters.append(self.adapters)
        if self.n_swa:
            for s in {r[0] for r in rows}:
                # like llama.cpp's SWA cache: cells further back than the window are pruned,
                # the window measured from the end of the sequence before this batch (cells
                # are reused when a batch is placed, masked against what was there)
                top = min(p for q, p, _ in rows if q == s) - 1
                for p in [p for p in self.kv[s] if p <= top - self.n_swa - self.swa_slack]:
                    del self.kv[s][p]
                    self.cell_ids.pop((s, p), None)
        return 0

    def decode_image(self, seq: int, pos0: int, embd, non_causal: bool) -> int:
        """An image's embeddings at pos0..: cells holding ``-1 - row`` (no token id)."""
        if self.fail_next:
            return self.fail_next.pop(0)
        n = len(embd)
        if self.used_cells() + n > self.n_ctx:
            return 1
        if (max(self.kv[seq]) + 1 if self.kv[seq] else 0) != pos0:
            raise AssertionError(f"seq {seq}: image at {pos0} does not follow its positions")
        for i in range(n):
            self.kv[seq][pos0 + i] = -1 - i
            self.cell_ids.pop((seq, pos0 + i), None)
        self.images.append((seq, pos0, n, non_causal))
        return 0

    def set_adapters(self, scales: tuple[float, ...]) -> None:
        self.adapters = tuple(scales)

    def new_sampler(self, p: SamplingParams, history: list[int]) -> FakeSampler:
        smp = FakeSampler(p, self.scripts.get(len(history)))
        self.samplers.append(smp)
        return smp

    def sample(self, sampler: FakeSampler, idx: int) -> int:
        seq, pos, tok = self.outputs[idx]
        if sampler.script:
            return sampler.script.pop(0)
        return self.model(tok, pos)

    def attach_sampler(self, sampler: FakeSampler, seq: int) -> bool:
        if not self.backend_sampling:
            return False
        self.attached[seq] = sampler
        return True

    def sample_many(self, items: list[tuple[FakeSampler, int]], pool) -> list[int]:
        if pool is None:
            return [self.sample(s, i) for s, i in items]
        return list(pool.map(lambda it: self.sample(*it), items))

    def sample_constrained(self, sampler, idx: int, matcher, full_mask: bool = False) -> int:
        """Not simulated here: test_constrained_engine's backend implements it."""
        raise NotImplementedError("constrained sampling on the plain fake backend")

    def accept_forced(self, sampler: FakeSampler, token: int) -> None:
        sampler.forced.append(token)

    def top_logprobs(self, idx: int, token: int, n: int) -> TokenLogprob:
        return TokenLogprob(token, -0.5, [(token, -0.5)][:n])

    def sampled_logprobs(self, sampler: FakeSampler, idx: int, token: int, n: int) -> TokenLogprob:
        if sampler.p.post_probs:  # as if the chain left only the sampled token
            return TokenLogprob(token, 0.0, [(token, 0.0)][:n])
        return self.top_logprobs(idx, token, n)

    # ---- memory ----
    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> bool:
        m = self.kv[seq]
        if p0 < 0:
            p0 = 0
        hi = p1 if p1 >= 0 else 1 << 30
        if self.n_swa and m and p0 > 0 and p0 <= max(m) and min(m) > 0 and p0 < min(m):
            self._forget(seq, list(m))
            m.clear()  # like SWA memory: removal behind the window empties the sequence
            return True
        gone = [p for p in m if p0 <= p < hi]
        for p in gone:
            del m[p]
        self._forget(seq, gone)
        return True

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        hi = p1 if p1 >= 0 else 1 << 30
        for p, t in self.kv[src].items():
            if p0 <= p < hi:
                self.kv[dst][p] = t
                if self.kv_unified:  # the cell is shared, not copied
                    cid = self.cell_ids.get((src, p))
                    if cid is None:
                        cid = self.cell_ids[(src, p)] = self._next_cell
                        self._next_cell += 1
                    self.cell_ids[(dst, p)] = cid

    def _forget(self, seq: int, positions) -> None:
        for p in positions:
            self.cell_ids.pop((seq, p), None)

    def sharers(self, seq: int, p: int) -> list[int]:
        """The other sequences holding ``seq``'s cell at ``p`` (shared by seq_cp)."""
        cid = self.cell_ids.get((seq, p))
        if cid is None:
            return []
        return [
            o for o in self.kv if o != seq and self.cell_ids.get((o, p)) == cid and p in self.kv[o]
        ]

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        """Move the cells at [p0, p1) by ``delta``, as llama.cpp's seq_add (a cell moved
        below 0 is removed); only where the memory can shift."""
        assert self.can_shift, "seq_add on a memory that cannot shift (llama.cpp aborts)"
        hi = p1 if p1 >= 0 else 1 << 30
        # a shared cell moves for every sequence holding it (llama.cpp's unified KV)
        cells = [(seq, p) for p in self.kv[seq] if p0 <= p < hi]
        cells += [(o, p) for _, p in list(cells) for o in self.sharers(seq, p)]
        moved = {(q, p): (self.kv[q].pop(p), self.cell_ids.pop((q, p), None)) for q, p in cells}
        for (q, p), (t, cid) in moved.items():
            if p + delta >= 0:
                assert p + delta not in self.kv[q], f"seq {q}: two cells at position {p + delta}"
                self.kv[q][p + delta] = t
                if cid is not None:
                    self.cell_ids[(q, p + delta)] = cid

    def seq_pos_min(self, seq: int) -> int:
        return min(self.kv[seq]) if self.kv[seq] else -1

    def seq_pos_max(self, seq: int) -> int:
        return max(self.kv[seq]) if self.kv[seq] else -1

    def seq_clear(self, seq: int) -> None:
        self._forget(seq, list(self.kv[seq]))
        self.kv[seq].clear()

    # ---- state ----
    def state_size(self, seq: int, partial: bool = False) -> int:
        return len(self.state_get(seq, partial))

    def state_get(self, seq: int, partial: bool = False, size: int | None = None) -> bytearray:
        if self.oom_on_state_get:
            raise MemoryError
        m = self.kv[seq]
        items = sorted(m.items())
        if self.n_swa and items:
            # like llama_kv_cache::state_write: window cells masked for the last position are
            # not written, whole state or partial, so a restore holds only the last n_swa
            top = items[-1][0]
            items = [(p, t) for p, t in items if top - p < self.n_swa]
        out = bytearray(struct.pack("<BI", 1 if partial else 0, len(items)))
        for p, t in items:
            out += struct.pack("<ii", p, t)
        return out

    def state_set(self, seq: int, data, partial: bool = False, nbytes: int | None = None) -> int:
        raw = bytes(data[: nbytes if nbytes is not None else len(data)])
        if len(raw) < 5:
            return 0
        kind, n = struct.unpack_from("<BI", raw, 0)
        if kind != (1 if partial else 0) or len(raw) < 5 + 8 * n:
            return 0
        cells = dict(struct.unpack_from("<ii", raw, 5 + 8 * i) for i in range(n))
        self._forget(seq, list(self.kv[seq]) if not partial else list(cells))
        if partial:  # new cells: this sequence's alone
            self.kv[seq].update(cells)
        else:
            self.kv[seq] = cells
        return 5 + 8 * n

    def state_cells(self, data, nbytes: int, start: int = 0):
        raw = bytes(data[start:nbytes])
        if len(raw) < 5:
            raise ValueError("truncated state")
        _kind, n = struct.unpack_from("<BI", raw, 0)
        if len(raw) < 5 + 8 * n:
            raise ValueError("truncated state")
        cells = CacheCells("swa" if self.n_swa else "full")
        for i in range(n):
            p, _t = struct.unpack_from("<ii", raw, 5 + 8 * i)
            cells.pos.append(p)
            cells.seqs.append((0,))
        return [cells], start + 5 + 8 * n

    def state_get_into(self, seq: int, buf, size: int) -> int:
        """``state_get`` copied into ``buf`` (llama.cpp's llama_state_seq_get_data_ext)."""
        data = self.state_get(seq)
        if len(data) != size or len(buf) < size:
            return 0
        buf[:size] = data
        return size

    # ---- embeddings (none here: test_embeddings' EmbedBackend computes them) ----
    def set_embeddings(self, on: bool) -> None:
        self.embeddings_on = on

    def embedding_of_seq(self, seq: int):
        return None

    def embedding_rows(self, start: int, count: int):
        return None

    def kv_cells(self):
        cells = CacheCells("swa" if self.n_swa else "full")
        for s, m in self.kv.items():
            for p in m:
                cells.pos.append(p)
                cells.seqs.append((s,))
        for s, p in self.stray_cells:
            cells.pos.append(p)
            cells.seqs.append((s,))
        return [cells]


@_recorded
class FakeDraft(FakeBackend):
    """A draft model's context over the fake memory (server.kv.draft_kv.DraftMemory):
    its greedy token is its own ``model``'s prediction."""

    def decode(self, start: int = 0, count: int = -1) -> int:
        return super().decode(start, self.batch.n if count < 0 else count)

    def greedy(self, idx: int, want_p: bool) -> tuple[int, float]:
        _seq, pos, tok = self.outputs[idx]
        return self.model(tok, pos), 1.0
