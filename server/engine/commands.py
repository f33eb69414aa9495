"""Engine commands: the slot and cache operations the HTTP side asks of the engine thread.

A command is a small frozen dataclass. ``Engine.submit_command(cmd)`` queues it with the
engine's ops; the engine thread runs ``cmd.run(engine)`` between two steps, once the slot
named by ``cmd.slot`` (when >= 0) is idle, and the returned Future holds its typed result.
A command that cannot be done returns a typed failure instead of raising: ``Refused``
(another tenant's slot or file under --cache-isolation: a 403, never counted as a failed
slot-file operation) or ``Failed`` (the state was refused, llama.cpp could not write:
counted, answered with ``status``). Only what is unexpected (an OSError, a MemoryError)
is raised, into the Future.

``run`` is engine-thread only and does no slow work: reading, checking and parsing slot
files happen on worker threads before a command is built (``file_plan``), and writing a
saved file, fsync and rename after its result came back. The commands touch
slots only through ``SlotStore``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

from ..engine_api import CacheView, IntegrityReport, SlotSnapshot
from ..json_value import JsonObject
from ..kv.file_plan import RestorePlan, saved_state
from ..kv.store import SlotStore
from ..slot.slot import Slot
from ..slot.stats import EngineStats
from ..tiers import file_io, slot_file, tenancy
from ..tiers.saved import Extras, InSlot, SavedState
from ..types import AdapterHandle, Checkpoint
from . import disk_glue, ram

if TYPE_CHECKING:
    from ..tiers.disk import DiskTier
    from ..tiers.prompt_cache import PromptCache

R_co = TypeVar("R_co", covariant=True)

REFUSED_STATE = (
    "the slot file's state does not fit this model or context (another model, a "
    "truncated or corrupt file, or a token list that does not match the state)"
)
DROPPED_APPENDICES = "the slot was used before its appendices were read; dropped"


class Host(Protocol):
    """What a command may use of the engine (the Engine is one): engine thread only."""

    @property
    def store(self) -> SlotStore: ...
    @property
    def stats(self) -> EngineStats: ...
    @property
    def cache(self) -> PromptCache | None: ...
    @property
    def disk(self) -> DiskTier | None: ...
    def check_integrity(self) -> list[str]: ...
    def draft_shared(self, slot: Slot) -> int: ...


class Command(Protocol[R_co]):
    """A typed operation run on the engine thread; ``slot`` >= 0: it waits until that slot
    is idle (never touches a running task), -1: it runs between any two steps."""

    @property
    def slot(self) -> int: ...
    def run(self, host: Host) -> R_co: ...


# ---- failures -------------------------------------------------------------------------


@dataclass(frozen=True)
class Refused:
    """Under --cache-isolation the slot or file is another tenant's (HTTP 403)."""

    message: str
    status: int = 403


@dataclass(frozen=True)
class Failed:
    """The operation could not be done; ``status`` is the HTTP status to answer."""

    message: str
    status: int = 400


@dataclass(frozen=True)
class Caller:
    """Who asks for a slot action: its cache key (its tenant with the adapter set it acts
    under, tiers/tenancy.py), and whether tenants are kept apart."""

    tenant: str
    isolated: bool

    def slot_refusal(self, s: Slot, what: str) -> Refused | None:
        """Under isolation, a slot holding another tenant's prompt is not the caller's to
        ``what`` (save, erase, restore into). Checked on the engine thread, in the command
        that acts, so the check and the action see the same slot."""
        if self.isolated and s.tokens and tenancy.owner(s.tenant) != tenancy.owner(self.tenant):
            return Refused(f"slot {s.id} holds another tenant's prompt: cannot {what} it")
        return None

    def file_refusal(self, parsed: slot_file.ParsedFile, name: str) -> Refused | None:
        """Under isolation, only the tenant that saved a file may restore it; a file that
        names no tenant (llama-server's, or saved before tenants were recorded) is nobody's
        to restore. A state computed under another LoRA adapter set than the caller's (a
        file without a record: none) is a 400, never loaded. Any thread."""
        theirs = parsed.tenant
        if self.isolated and (
            theirs is None or tenancy.owner(theirs) != tenancy.owner(self.tenant)
        ):
            whose = "another tenant" if theirs is not None else "no recorded tenant"
            return Refused(f"slot file {name!r} was saved by {whose}: cannot restore it")
        if tenancy.adapters_of(theirs or "") != tenancy.adapters_of(self.tenant):
            return Refused(
                f"slot file {name!r} was computed under another LoRA adapter set than the "
                "current one (set it with POST /lora-adapters first)",
                400,
            )
        return None


# ---- save, restore, erase -------------------------------------------------------------


@dataclass(frozen=True)
class SlotSaved:
    """The slot's state is copied into a reused buffer (``state.data``, an ``InBuffer``
    of file_io.BUFFERS); its extras (checkpoints, draft state, KV types) and ``owner`` (the
    tenant the file records: None for a private tenant, never persisted) are for
    ``slot_file.write_file`` to write, off the engine thread, which then gives the buffer
    back; ``state_ms``: how long llama.cpp took to copy the state."""

    n_saved: int
    state: SavedState
    owner: str | None
    state_ms: float = 0.0


@dataclass(frozen=True)
class SaveSlot:
    """Copy the slot's state into a reused buffer (llama_state_seq_get_data: one copy
    from the KV cache, no page faults); the file is written off the engine thread."""

    slot: int
    caller: Caller

    def run(self, host: Host) -> SlotSaved | Refused | Failed:
        s = host.store.slots[self.slot]
        refusal = self.caller.slot_refusal(s, "save")
        if refusal is not None:
            return refusal
        owner = s.tenant if s.tokens else self.caller.tenant
        t0 = time.perf_counter()
        state = host.store.save_state(s, file_io.BUFFERS)
        if state is None:
            return Failed("llama.cpp could not copy the slot state", 500)
        ms = (time.perf_counter() - t0) * 1e3
        return SlotSaved(len(s.tokens), state, owner if tenancy.persistable(owner) else None, ms)


@dataclass(frozen=True)
class SlotRestored:
    """The slot holds the file's ``n_restored`` tokens, its state and its appendices;
    ``warnings``: what was dropped or ignored on the way (the state is kept)."""

    n_restored: int
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class StateLoaded:
    """The slot holds the file's tokens and state, without checkpoints or draft state: the
    state's end was not known before loading, so its appendices start at
    ``state_off + consumed`` and are to be parsed off the engine thread and given to the
    slot with ``AttachAppendices``."""

    consumed: int


@dataclass(frozen=True)
class RestoreSlot:
    """Load a slot file (read and proven by ``plan``, off the engine thread) into the slot,
    which the caller then holds (its tenant, most recently used). With a known layout the
    appendices come with the plan and everything is done here (SlotRestored); else only
    the state is loaded (StateLoaded)."""

    slot: int
    parsed: slot_file.ParsedFile
    plan: RestorePlan
    caller: Caller

    def run(self, host: Host) -> SlotRestored | StateLoaded | Refused | Failed:
        s = host.store.slots[self.slot]
        refusal = self.caller.slot_refusal(s, "restore into")
        if refusal is not None:
            return refusal
        # the plan proved these bytes off this thread, in the private buffer the store loads
        # (InBuffer.proven: not proven twice); the restoring request's tenant (under
        # isolation: the file's)
        state = saved_state(self.parsed, self.plan, self.caller.tenant)
        got = host.store.restore(s, state, trusted=False)
        if not got.ok:
            return Failed(REFUSED_STATE)
        self._claim(s)
        if state.extras is Extras.LATER:
            return StateLoaded(got.consumed)
        return SlotRestored(len(state.tokens), state.warnings)

    def _claim(self, s: Slot) -> None:
        s.tenant = self.caller.tenant  # the restoring request's (under isolation: the file's)
        s.last_used = time.perf_counter()  # most recently used: kept by the LRU choice


@dataclass(frozen=True)
class AttachAppendices:
    """Give a slot loaded by ``RestoreSlot`` (StateLoaded) its file's appendices, parsed off
    the engine thread, if it still holds just that state: a request may have used it
    meanwhile, and then they are dropped, with a warning (SlotRestored either way)."""

    slot: int
    tokens: list[int]
    appendices: SavedState  # the extras alone (slot_file.parse_appendices)
    caller: Caller

    def run(self, host: Host) -> SlotRestored | Failed:
        s = host.store.slots[self.slot]
        app = self.appendices
        if s.tenant != self.caller.tenant or s.tokens != self.tokens:
            app.warnings.append(DROPPED_APPENDICES)
            return SlotRestored(len(self.tokens), app.warnings)
        # the state is loaded already (StateLoaded): the restore gives the slot its extras
        state = slot_file.give_appendices(SavedState(list(self.tokens), InSlot(s.id)), app)
        if not host.store.restore(s, state, trusted=False).ok:
            return Failed(REFUSED_STATE)
        return SlotRestored(len(self.tokens), state.warnings)


@dataclass(frozen=True)
class GiveCheckpoint:
    """Give a restored slot the checkpoint its widened window serves
    (``file_plan.window_checkpoint``, cut out off the engine thread), if it still holds the
    file's tokens up to it; a request using the slot meanwhile is not waited for (it
    reads its window, not this). True when given."""

    target: int
    tokens: list[int]
    checkpoint: Checkpoint
    caller: Caller

    @property
    def slot(self) -> int:
        return -1  # between any two steps: never waits for a request on the slot

    def run(self, host: Host) -> bool:
        s = host.store.slots[self.target]
        n = self.checkpoint.n_tokens
        if s.tenant != self.caller.tenant or len(s.tokens) < n or s.tokens[:n] != self.tokens[:n]:
            return False
        host.store.give_checkpoint(s, self.checkpoint)
        return True


@dataclass(frozen=True)
class SlotErased:
    n_erased: int


@dataclass(frozen=True)
class EraseSlot:
    """Clear the slot: its tokens, KV sequence and checkpoints."""

    slot: int
    caller: Caller

    def run(self, host: Host) -> SlotErased | Refused:
        s = host.store.slots[self.slot]
        refusal = self.caller.slot_refusal(s, "erase")
        if refusal is not None:
            return refusal
        return SlotErased(host.store.clear(s))


@dataclass(frozen=True)
class CountSlotFile:
    """Count a slot-file operation in the engine statistics (written on the engine thread
    only)."""

    saves: int = 0
    restores: int = 0
    failures: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    slot: int = field(default=-1, init=False)

    def run(self, host: Host) -> None:
        host.stats.on_slot_file(
            saves=self.saves,
            restores=self.restores,
            failures=self.failures,
            bytes_written=self.bytes_written,
            bytes_read=self.bytes_read,
        )


# ---- cache operations -----------------------------------------------------------------


@dataclass(frozen=True)
class DescribeSlots:
    """Every slot as one snapshot made between two steps (GET /slots): read from the event
    loop instead, one slot's fields could straddle a step. Cheap: counts and references,
    no token lists copied."""

    slot: int = field(default=-1, init=False)

    def run(self, host: Host) -> list[SlotSnapshot]:
        return [_snapshot(s, host.draft_shared(s)) for s in host.store.slots]


def _snapshot(s: Slot, draft_tokens: int) -> SlotSnapshot:
    run = s.run  # the running task's, or the last one's when idle
    ckpts = tuple(s.checkpoints)
    return SlotSnapshot(
        id=s.id,
        n_ctx=s.n_ctx,
        state=s.state.value,
        task=s.task,
        owner=tenancy.owner(s.tenant),
        n_tokens=len(s.tokens),
        n_prompt=run.n_prompt if run is not None else 0,
        n_cached=run.n_cached if run is not None else 0,
        n_processed=run.n_processed if run is not None else 0,
        n_decoded=run.n_decoded if run is not None else 0,
        checkpoint_tokens=tuple(c.n_tokens for c in ckpts),
        checkpoint_bytes=sum(c.nbytes for c in ckpts),
        draft_tokens=draft_tokens,
    )


@dataclass(frozen=True)
class DescribeCache:
    """The caches as one snapshot made between two steps: the RAM cache belongs to the
    engine thread, and read from another its entries and totals could disagree. ``owner``:
    only that tenant's entries and totals (--cache-isolation), and no disk write queue
    (whose size would tell of other tenants' saves). None without a RAM cache."""

    owner: str | None = None
    idle_slots: bool = False
    slot: int = field(default=-1, init=False)

    def run(self, host: Host) -> CacheView | None:
        if host.cache is None:
            return None
        disk: JsonObject = {"enabled": False}
        if host.disk is not None:
            disk = host.disk.describe(self.owner)
            if self.owner is not None:
                disk = {k: v for k, v in disk.items() if k not in ("n_pending", "pending_bytes")}
        return CacheView(host.cache.describe(self.owner), disk, self.idle_slots)


@dataclass(frozen=True)
class CheckIntegrity:
    """The engine's, the RAM cache's and the disk tier's integrity checks, between two
    steps (nothing in the engine moves meanwhile): every slot's tokens match its KV
    positions, checkpoints lie within them, cache bytes equal the sum of its entries, no
    entry is a prefix of another, and the prefix index holds exactly the entries."""

    slot: int = field(default=-1, init=False)

    def run(self, host: Host) -> IntegrityReport:
        problems = host.check_integrity()  # the slots and the RAM cache (Engine's)
        disk = host.disk
        if disk is not None:
            problems += [f"disk tier: {p}" for p in disk.check_integrity()]
        return IntegrityReport(problems)


@dataclass(frozen=True)
class Spilled:
    n_queued: int


@dataclass(frozen=True)
class SpillToDisk:
    """Queue the RAM cache's entries and every idle slot's state for the disk tier (a warm
    restart, before the engine stops); nothing without a disk tier. The writes themselves
    happen on the tier's writer thread (``DiskTier.flush`` waits for them)."""

    slot: int = field(default=-1, init=False)

    def run(self, host: Host) -> Spilled:
        if host.disk is None:
            return Spilled(0)
        return Spilled(disk_glue.spill(host.store, host.cache, host.disk))


@dataclass(frozen=True)
class SlotsCached:
    n_saved: int


@dataclass(frozen=True)
class SaveIdleSlots:
    """Copy every idle slot's state into the RAM cache (POST /sleep without a disk tier:
    the RAM cache outlives the engine, the slots do not); nothing without a RAM cache."""

    slot: int = field(default=-1, init=False)

    def run(self, host: Host) -> SlotsCached:
        cache = host.cache
        if cache is None:
            return SlotsCached(0)
        n = sum(ram.save(host.store, cache, s) for s in host.store.slots if s.idle)
        cache.update()
        return SlotsCached(n)


# ---- adapters ---------------------------------------------------------------------------


class AdapterAttacher(Protocol):
    """The model's side of attaching a run-time LoRA adapter (LlamaBackend)."""

    def attach_adapter(self, handle: AdapterHandle) -> int: ...


@dataclass(frozen=True)
class AttachAdapter:
    """Give an adapter loaded off the engine thread (``handle``) its id, between two steps:
    the decodes' adapter scales index the ids, so the list changes under no decode. The
    file was checked and loaded before (service/lora_runtime.py). Result: the new id."""

    backend: AdapterAttacher
    handle: AdapterHandle
    slot: int = field(default=-1, init=False)

    def run(self, host: Host) -> int:
        return self.backend.attach_adapter(self.handle)
