"""Slot files (ARCHITECTURE §8): a slot's state saved to a file, restored from one, or
erased, for POST /slots/{id}. The file work (writing, fsync and rename; reading, the
tenant's check, the proof of the state's cells, the appendices) runs on worker threads;
the engine thread only copies the state out and loads what was proven, through typed
commands (engine/commands.py). Each operation is counted in the engine's statistics (a
failure too); a typed failure is the HTTP error it names (``APIError``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from ..engine.commands import (
    AttachAppendices,
    Caller,
    Command,
    CountSlotFile,
    EraseSlot,
    Failed,
    GiveCheckpoint,
    Refused,
    RestoreSlot,
    SaveSlot,
    SlotRestored,
    SlotSaved,
    StateLoaded,
)
from ..engine.engine import Engine, EngineDead
from ..engine.model_api import ModelBackend
from ..json_value import JsonObject
from ..kv.file_plan import (
    RestorePlan,
    parse_after_state,
    plan_restore,
    window_checkpoint,
    window_of,
)
from ..llama.state_bytes import WindowShape
from ..schemas.errors import APIError
from ..tiers import file_io, slot_file, tenancy
from ..tiers.saved import InBuffer
from .state import ServerState

log = logging.getLogger("server.slots")
R = TypeVar("R")


def caller(st: ServerState, tenant: str) -> Caller:
    """Who acts on a slot: ``tenant`` under the global LoRA adapter set (POST
    /lora-adapters), checked against the slot's and the file's under --cache-isolation."""
    tenant = tenancy.with_adapters(tenant, st.adapters.resolve(None, None).key)
    return Caller(tenant, st.settings.cache_isolation != "none")


async def erase(engine: Engine, sid: int, who: Caller) -> JsonObject:
    """Empty slot ``sid`` (EraseSlot); another tenant's slot is a 403."""
    with _counted(engine):
        erased = _unwrap(engine, await _run(engine, EraseSlot(sid, who)))
    return {"id_slot": sid, "n_erased": erased.n_erased}


@contextmanager
def _counted(engine: Engine) -> Iterator[None]:
    """A slot file's or the I/O's failure as its HTTP error, counted as a failed operation."""
    try:
        yield
    except slot_file.SlotFileError as e:
        _record(engine, failures=1)
        raise APIError(e.status, str(e)) from None
    except MemoryError:
        _record(engine, failures=1)
        raise APIError(400, "slot file is too large to load") from None
    except OSError as e:
        _record(engine, failures=1)
        raise APIError(500, f"slot file I/O failed: {e.strerror or e}") from None


async def save_or_restore(
    st: ServerState, engine: Engine, sid: int, action: str, name: str, who: Caller
) -> JsonObject:
    """``action`` ("save" or "restore") slot ``sid`` to or from the file ``name`` under
    --slot-save-path (set: the route answers 501 without it); a bad name, file or state is
    an APIError, counted as a failure."""
    root = st.settings.slot_save_path
    assert root
    with _counted(engine):
        path = slot_file.resolve(root, name)
        if action == "save":
            b = st.require_backend()
            file = _FileSpec(b.state_file_version, projector_key(st), window_of(b))
            return await _save(engine, sid, path, name, who, file)
        return await _restore(st, engine, sid, path, name, who)


def _unwrap(engine: Engine, result: R | Refused | Failed) -> R:
    """A command's result, or its typed failure as the HTTP error: a refusal is a 403 (not
    counted), any other failure is counted and answered with its status."""
    if isinstance(result, Refused):
        raise APIError(403, result.message)
    if isinstance(result, Failed):
        _record(engine, failures=1)
        raise APIError(result.status, result.message)
    return result


async def _run(engine: Engine, cmd: Command[R]) -> R:
    """Submit ``cmd`` and wait for its result, off the event loop's thread."""
    return await asyncio.wrap_future(engine.submit_command(cmd))


def _record(engine: Engine, **counts: int) -> None:
    """Count a slot-file operation in the engine statistics, on the engine thread (they are
    written there only). Fire and forget: a stopped engine has nothing left to count."""
    try:
        engine.submit_command(CountSlotFile(**counts))
    except EngineDead:
        pass


@dataclass(frozen=True)
class _FileSpec:
    """How this server writes a slot file: llama.cpp's state-file version, the loaded
    projector's key (its images name it), the window shape a checkpoint widens."""

    version: int
    key: bytes | None
    window: WindowShape | None


async def _save(
    engine: Engine, sid: int, path: Path, name: str, who: Caller, file: _FileSpec
) -> JsonObject:
    """The engine copies the state into a reused buffer (SaveSlot); the file is written,
    made durable and renamed off the engine thread, then the buffer is given back."""
    t0 = time.perf_counter()
    saved = _unwrap(engine, await _run(engine, SaveSlot(sid, who)))
    # llama.cpp's copy of the state, and the wait for the engine (queue and thread hops)
    parts: dict[str, float] = {"state": saved.state_ms}
    parts["engine_wait"] = (time.perf_counter() - t0) * 1e3 - saved.state_ms
    written = await asyncio.to_thread(_write, path, saved, file, parts, time.perf_counter())
    _record(engine, saves=1, bytes_written=written)
    return {
        "id_slot": sid,
        "filename": name,
        "n_saved": saved.n_saved,
        "n_written": written,
        "timings": {"save_ms": (time.perf_counter() - t0) * 1e3, "save_parts_ms": _ms(parts)},
    }


def _write(
    path: Path, saved: SlotSaved, file: _FileSpec, parts: dict[str, float], sent: float
) -> int:
    """The slot file: body, appendices, SIMG block naming its images, STNT footer, then
    fdatasync and rename (slot_file.write_file), in one worker trip; the file's size. The
    state's buffer is given back once written (dropped on failure: never reused while a
    write may still read it). ``sent``: when the trip was asked for (``parts["hop"]``)."""
    parts["hop"] = (time.perf_counter() - sent) * 1e3
    s = saved.state
    where = s.data
    assert isinstance(where, InBuffer)
    images = slot_file.image_block(s.tokens, file.key)
    n = slot_file.write_file(
        path,
        s.tokens,
        where.buf,
        file.version,
        s.checkpoints,
        s.data_dft,
        s.kv_types,
        saved.owner,
        images,
        nbytes=where.end,
        parts=parts,
        window=file.window,
    )
    file_io.BUFFERS.give(where.buf)
    return n


def _ms(parts: dict[str, float]) -> JsonObject:
    """The parts' milliseconds as the answer's JSON."""
    return {k: v for k, v in parts.items()}


def projector_key(st: ServerState) -> bytes | None:
    """The loaded projector's key (--mmproj), which a slot file's images must name."""
    return st.projector.key if st.projector is not None else None


# tasks run after their request's answer, referenced until done (the loop keeps only weak ones)
_AFTER_ANSWER: set[asyncio.Task] = set()


def _background(work: Coroutine[object, object, None]) -> None:
    task = asyncio.ensure_future(work)
    _AFTER_ANSWER.add(task)
    task.add_done_callback(_AFTER_ANSWER.discard)


async def _give_window_checkpoint(
    engine: Engine,
    sid: int,
    parsed: slot_file.ParsedFile,
    plan: RestorePlan,
    shape: WindowShape,
    who: Caller,
) -> None:
    """Cut a widened window's checkpoint out of the restored file's buffer (a worker
    thread) and give it to the slot (GiveCheckpoint), so a later snapshot of the slot, or
    a cut once its window has moved on, has it as a file's SCKP checkpoint gave it; then
    give the buffer back. Failures only lose the checkpoint (logged)."""
    try:
        ckpt = await asyncio.to_thread(window_checkpoint, parsed, plan, shape)
        slot_file.release(parsed)
        if ckpt is not None:
            await _run(engine, GiveCheckpoint(sid, list(parsed.tokens), ckpt, who))
    except Exception as e:  # noqa: BLE001 - after the answer: nobody to tell but the log
        log.warning("slot %d: the restored window's checkpoint was not kept: %s", sid, e)


async def _load(
    engine: Engine,
    sid: int,
    parsed: slot_file.ParsedFile,
    plan: RestorePlan,
    who: Caller,
    keep: int,
    parts: dict[str, float],
) -> SlotRestored | Refused | Failed:
    """The engine loads the proven state (RestoreSlot), then, when its end was known only
    once loaded, the appendices parsed off the engine thread (AttachAppendices)."""
    t = time.perf_counter()
    loaded = await _run(engine, RestoreSlot(sid, parsed, plan, who))
    parts["load"] = (time.perf_counter() - t) * 1e3
    if not isinstance(loaded, StateLoaded):
        return loaded
    t = time.perf_counter()
    pos = parsed.state_off + loaded.consumed
    app = await asyncio.to_thread(parse_after_state, parsed, pos, keep)
    got = await _run(engine, AttachAppendices(sid, list(parsed.tokens), app, who))
    parts["appendices"] = (time.perf_counter() - t) * 1e3
    return got


def _read_and_plan(
    b: ModelBackend,
    path: Path,
    n_ctx: int,
    sid: int,
    who: Caller,
    name: str,
    keep: int,
    projector: bytes | None,
    parts: dict[str, float],
) -> tuple[slot_file.ParsedFile, RestorePlan]:
    """Read the file, check its tenant, prove its state and parse its appendices, in one
    trip to a worker thread; ``parts`` gets the read's and the proof's milliseconds."""
    t0 = time.perf_counter()
    parsed = slot_file.read_file(path, n_ctx, b.n_vocab, sid, b.state_file_version, projector)
    t1 = time.perf_counter()
    parts["read"] = (t1 - t0) * 1e3
    try:
        refusal = who.file_refusal(parsed, name)
        if refusal is not None:
            raise APIError(refusal.status, refusal.message)
        plan = plan_restore(b, parsed, keep)
    except BaseException:
        slot_file.release(parsed)  # nothing else holds its buffer yet
        raise
    parts["proof"] = (time.perf_counter() - t1) * 1e3
    return parsed, plan


async def _restore(
    st: ServerState, engine: Engine, sid: int, path: Path, name: str, who: Caller
) -> JsonObject:
    """Read, check and parse the file off the engine thread (tenant, state cells,
    appendices); the engine thread only loads what was proven (RestoreSlot, and
    AttachAppendices when the state's end was known only once loaded)."""
    t0 = time.perf_counter()
    b = st.require_backend()
    keep = engine.checkpoints_per_slot
    parts: dict[str, float] = {}
    parsed, plan = await asyncio.to_thread(
        _read_and_plan,
        b,
        path,
        engine.slots[sid].n_ctx,
        sid,
        who,
        name,
        keep,
        projector_key(st),
        parts,
    )
    loaded = await _load(engine, sid, parsed, plan, who, keep, parts)
    shape = window_of(b)
    if plan.window_checkpoint and shape is not None and isinstance(loaded, SlotRestored):
        # after the answer: the slot serves the cut from its widened window already
        _background(_give_window_checkpoint(engine, sid, parsed, plan, shape, who))
    else:
        # the engine has loaded the state and the checkpoints are copied out: the buffer
        # is free for the next save or restore (a cancelled request drops it instead)
        slot_file.release(parsed)
    got = _unwrap(engine, loaded)
    for w in got.warnings:
        log.warning("slot %d restore from %s: %s", sid, name, w)
    _record(engine, restores=1, bytes_read=parsed.n_read)
    out: JsonObject = {
        "id_slot": sid,
        "filename": name,
        "n_restored": got.n_restored,
        "n_read": parsed.n_read,
        "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3, "restore_parts_ms": _ms(parts)},
    }
    if got.warnings:
        out["warnings"] = [w for w in got.warnings]
    return out
