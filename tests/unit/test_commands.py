"""Engine commands (server/engine/commands.py) against the fake backend, on a real Engine and
SlotStore driven step by step on this thread: each result is typed and exact, commands on a
busy slot wait for it, tenancy refusals and failures are values, never exceptions."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from server.engine.commands import (
    DROPPED_APPENDICES,
    REFUSED_STATE,
    AttachAppendices,
    Caller,
    CheckIntegrity,
    CountSlotFile,
    DescribeCache,
    DescribeSlots,
    EraseSlot,
    Failed,
    Refused,
    RestoreSlot,
    SaveSlot,
    SlotErased,
    SlotRestored,
    SlotSaved,
    Spilled,
    SpillToDisk,
    StateLoaded,
)
from server.engine.engine import Engine, EngineDead, EngineOptions
from server.engine_api import IntegrityReport
from server.kv.file_plan import parse_after_state, plan_restore
from server.protocols import slots as slots_route
from server.settings.config import Settings
from server.task import FinishReason
from server.tiers import slot_file as sf
from server.tiers import tenancy
from server.tiers.disk import DiskTier
from server.tiers.prompt_cache import PromptCache
from server.tiers.saved import InBuffer, InSlot, SavedState

from .helpers import route_client, run, task
from .test_disk_cache import CHECK
from .test_slot_tenancy import FileBackend

ANYONE = Caller("", isolated=False)
A = tenancy.salt_tenant("a")
B = tenancy.salt_tenant("b")
PROMPT = list(range(10, 110))  # 100 tokens: several windows of n_swa 16


@pytest.fixture
def alive(monkeypatch):
    """Commands are refused by an engine whose thread is not running; these tests run its
    steps themselves, on this thread, so it is declared alive."""
    monkeypatch.setattr(Engine, "alive", property(lambda self: True))


def engine_of(known: bool = True, **kw) -> tuple[Engine, FileBackend]:
    b = FileBackend(known, n_seq=kw.pop("n_seq", 2), n_swa=kw.pop("n_swa", 16))
    return Engine(b, EngineOptions(), **kw), b


def drive(engine: Engine, fut, max_steps: int = 50):
    """Step the engine until ``fut`` is done; its result (its exception raised)."""
    for _ in range(max_steps):
        if fut.done():
            break
        engine.step()
    return fut.result(0)


def do(engine: Engine, cmd):
    return drive(engine, engine.submit_command(cmd))


def fill(engine: Engine, slot: int, prompt=PROMPT, tenant: str = "") -> None:
    t, c = task(prompt, max_tokens=1, id_slot=slot, tenant=tenant)
    run(engine, t)
    assert c.result is not None and engine.slots[slot].tokens


def save(engine: Engine, tmp_path: Path, slot: int, who: Caller = ANYONE, name="f.bin") -> Path:
    """The route's save: the command copies the state, the file is written here."""
    path = tmp_path / name
    saved = do(engine, SaveSlot(slot, who))
    assert isinstance(saved, SlotSaved), saved
    st = saved.state
    assert isinstance(st.data, InBuffer)
    sf.write_file(
        path,
        st.tokens,
        st.data.buf,
        1,
        st.checkpoints,
        st.data_dft,
        st.kv_types,
        saved.owner,
        nbytes=st.data.end,
    )
    return path


def read(engine: Engine, b: FileBackend, path: Path, slot: int) -> sf.ParsedFile:
    return sf.read_file(path, engine.slots[slot].n_ctx, b.n_vocab, slot, b.state_file_version)


def test_a_dead_engine_refuses_commands():
    e, _ = engine_of()
    with pytest.raises(EngineDead):
        e.submit_command(CheckIntegrity())


@pytest.mark.parametrize("known", [True, False], ids=["kv-layout", "unknown-layout"])
def test_save_then_restore_gives_the_same_tokens_state_and_checkpoints(alive, tmp_path, known):
    e, b = engine_of(known)
    fill(e, 0, tenant=A)
    e.store.take_checkpoint(e.slots[0])
    fill(e, 0, PROMPT + list(range(200, 210)), tenant=A)  # the slot grows past the checkpoint
    src = e.slots[0]
    tokens, kv = list(src.tokens), dict(b.kv[0])
    assert 100 in [c.n_tokens for c in src.checkpoints] and len(tokens) == 110
    path = save(e, tmp_path, 0, Caller(A, isolated=True))
    parsed = read(e, b, path, 1)
    assert parsed.tenant == A  # the slot's tenant, recorded in the file
    plan = plan_restore(b, parsed, e.store.ckpt.max_per_slot)
    got = do(e, RestoreSlot(1, parsed, plan, Caller(A, isolated=True)))
    if not known:  # the state alone; the appendices are parsed after it and attached
        assert isinstance(got, StateLoaded) and e.slots[1].checkpoints == []
        app = parse_after_state(parsed, parsed.state_off + got.consumed, None)
        got = do(e, AttachAppendices(1, list(parsed.tokens), app, Caller(A, isolated=True)))
    assert got == SlotRestored(110, [])
    dst = e.slots[1]
    # a state holds the last window's cells (n_swa 16), as llama.cpp writes it
    assert dst.tokens == tokens and b.kv[1] == {p: t for p, t in kv.items() if p >= 94}
    assert dst.tenant == A
    # the file carries one checkpoint (checkpoints.file_checkpoints): the oldest within
    # SHORT_TAIL tokens of the newest below the state's length, which the state cannot serve
    assert [c.n_tokens for c in dst.checkpoints] == [100]
    assert dst.last_used > src.last_used  # the restored slot is the most recently used
    assert do(e, CheckIntegrity()) == IntegrityReport([])


def test_erase_empties_the_slot_and_says_how_many_tokens_it_held(alive):
    e, b = engine_of()
    fill(e, 0)
    n = len(e.slots[0].tokens)
    assert do(e, EraseSlot(0, ANYONE)) == SlotErased(n)
    assert e.slots[0].tokens == [] and e.slots[0].checkpoints == [] and b.kv[0] == {}
    assert do(e, EraseSlot(0, ANYONE)) == SlotErased(0)


def test_a_command_on_a_busy_slot_waits_for_it_and_lets_others_pass(alive):
    e, b = engine_of()
    t, c = task(PROMPT, max_tokens=20, id_slot=0)
    e.submit(t)
    e.step()  # the task runs on slot 0
    assert not e.slots[0].idle
    erase = e.submit_command(EraseSlot(0, ANYONE))
    check = e.submit_command(CheckIntegrity())
    e.step()
    assert check.done() and not erase.done()  # the slot-less command did not wait
    steps = 0
    while c.result is None:
        assert not erase.done() and not e.slots[0].idle  # never touches a running task
        e.step()
        steps += 1
    assert steps > 5
    drive(e, erase)
    r = c.result
    assert r is not None and r.finish is FinishReason.LENGTH and r.timings.predicted_n == 20
    assert erase.result(0) == SlotErased(100 + 19)  # the prompt and the decoded tokens
    assert e.slots[0].tokens == []


def test_a_waiting_command_fails_with_engine_dead_when_the_engine_stops(alive):
    e, _ = engine_of()
    t, _ = task(PROMPT, max_tokens=50, id_slot=0)
    e.submit(t)
    e.step()
    fut = e.submit_command(EraseSlot(0, ANYONE))
    e.step()
    e._fail_everything("stopping")
    with pytest.raises(EngineDead, match="stopping"):
        fut.result(0)


def test_another_tenants_slot_is_refused_and_left_as_it_was(alive, tmp_path):
    e, b = engine_of()
    fill(e, 0, tenant=A)
    path = save(e, tmp_path, 0)
    parsed = read(e, b, path, 0)
    plan = plan_restore(b, parsed)
    tokens, kv = list(e.slots[0].tokens), dict(b.kv[0])
    them = Caller(B, isolated=True)
    msg = "slot 0 holds another tenant's prompt: cannot {} it"
    assert do(e, SaveSlot(0, them)) == Refused(msg.format("save"))
    assert do(e, EraseSlot(0, them)) == Refused(msg.format("erase"))
    assert do(e, RestoreSlot(0, parsed, plan, them)) == Refused(msg.format("restore into"))
    assert e.slots[0].tokens == tokens and b.kv[0] == kv and e.slots[0].tenant == A
    assert Refused("x").status == 403 and not (tmp_path / "x").exists()
    # without isolation, or into an empty slot, nobody is refused
    assert do(e, EraseSlot(0, Caller(B, isolated=False))) == SlotErased(len(tokens))
    got = do(e, RestoreSlot(0, parsed, plan, them))
    assert got == SlotRestored(len(tokens), []) and e.slots[0].tenant == B


def test_a_file_is_only_its_saving_tenants_to_restore(tmp_path):
    def parsed(tenant):
        return sf.ParsedFile([1], bytearray(16), 0, 16, tenant=tenant)

    me = Caller(A, isolated=True)
    assert me.file_refusal(parsed(A), "f") is None
    assert Caller(A, isolated=False).file_refusal(parsed(B), "f") is None
    assert me.file_refusal(parsed(B), "f") == Refused(
        "slot file 'f' was saved by another tenant: cannot restore it"
    )
    assert me.file_refusal(parsed(None), "f") == Refused(
        "slot file 'f' was saved by no recorded tenant: cannot restore it"
    )


def test_a_saved_file_records_the_slots_tenant_never_a_private_one(alive, tmp_path):
    e, b = engine_of()
    secret = tenancy.private_tenant()
    fill(e, 0, tenant=secret)
    saved = do(e, SaveSlot(0, Caller(secret, isolated=True)))
    assert isinstance(saved, SlotSaved) and saved.owner is None and saved.n_saved == 100
    # an empty slot's file is the caller's
    saved = do(e, SaveSlot(1, Caller(A, isolated=True)))
    assert isinstance(saved, SlotSaved) and (saved.n_saved, saved.owner) == (0, A)


def test_failures_are_typed_results(alive, tmp_path, monkeypatch):
    e, b = engine_of()
    fill(e, 0)
    with pytest.raises(ValueError, match="no slot 2: this engine has 2 slots"):
        e.submit_command(EraseSlot(2, ANYONE))  # refused before the engine thread sees it
    with monkeypatch.context() as m:
        m.setattr(b, "state_get_into", lambda *a: 0)
        got = do(e, SaveSlot(0, ANYONE))
    assert got == Failed("llama.cpp could not copy the slot state", 500)
    parsed = read(e, b, save(e, tmp_path, 0), 1)
    plan = plan_restore(b, parsed)
    good = bytes(parsed.buf)
    parsed.buf[parsed.state_off + 9 : parsed.state_off + 13] = b"\xff\xff\x00\x00"  # n cells
    with pytest.raises(sf.SlotFileError):  # proven off the engine thread: refused there
        plan_restore(b, parsed)
    # a plan that proved nothing (a layout it cannot read) leaves the proof to the store
    unproven = dataclasses.replace(plan, known=False, appendices=None)
    assert do(e, RestoreSlot(1, parsed, unproven, ANYONE)) == Failed(REFUSED_STATE)
    assert e.slots[1].tokens == [] and b.kv[1] == {}  # a refused state leaves the slot empty
    parsed.buf[:] = good
    proofs = []
    real = e.store._state_problem
    monkeypatch.setattr(e.store, "_state_problem", lambda *a: proofs.append(1) or real(*a))
    assert do(e, RestoreSlot(1, parsed, plan, ANYONE)) == SlotRestored(100, [])
    assert proofs == []  # proven once, by the plan, in the buffer the store loads
    # the file's KV types contradict the state's (proven ours): cleared, refused
    monkeypatch.setattr(b, "kv_type_ids", (1, 1), raising=False)
    app = SavedState([], InSlot(), kv_types=(8, 8))  # a file's extras alone
    assert do(e, AttachAppendices(1, list(parsed.tokens), app, ANYONE)) == Failed(REFUSED_STATE)
    assert e.slots[1].tokens == []


def test_appendices_of_a_slot_used_meanwhile_are_dropped_with_a_warning(alive, tmp_path):
    e, b = engine_of(known=False)
    fill(e, 0)
    parsed = read(e, b, save(e, tmp_path, 0), 1)
    got = do(e, RestoreSlot(1, parsed, plan_restore(b, parsed), ANYONE))
    assert isinstance(got, StateLoaded)
    fill(e, 1, prompt=PROMPT + [7, 7, 7])  # a request used the slot before the attach
    app = parse_after_state(parsed, parsed.state_off + got.consumed, None)
    got = do(e, AttachAppendices(1, list(parsed.tokens), app, ANYONE))
    assert got == SlotRestored(100, [DROPPED_APPENDICES])


def test_counts_integrity_and_spill(alive, tmp_path):
    e, b = engine_of()
    assert do(e, CountSlotFile(saves=1, failures=2, bytes_written=30, bytes_read=4)) is None
    st = e.stats
    assert (st.slot_saves, st.slot_restores, st.slot_file_failures) == (1, 0, 2)
    assert (st.slot_bytes_written, st.slot_bytes_read) == (30, 4)
    fill(e, 0)
    assert do(e, CheckIntegrity()).ok
    b.stray_cells.append((1, 0))  # a cell no slot accounts for
    report = do(e, CheckIntegrity())
    assert not report.ok and report.problems
    assert do(e, SpillToDisk()) == Spilled(0)  # no disk tier
    disk = DiskTier(tmp_path, 1 << 30, CHECK)  # not started: its queue is visible
    e2, _ = engine_of(disk=disk)
    fill(e2, 1)
    assert do(e2, SpillToDisk()) == Spilled(1)
    assert [len(x.tokens) for x in disk._q.items] == [100]


def test_the_cache_view_is_made_on_the_engine_thread_and_cut_to_its_owner(alive, tmp_path):
    """GET /cache's snapshot (issue 57: routes never walk the engine's caches): made by the
    engine's step, not when asked; an owner sees its own entries and totals only."""
    e, _ = engine_of(cache=PromptCache(-1, 0), disk=DiskTier(tmp_path, 1 << 30, CHECK))
    fill(e, 0, tenant=A)
    fill(e, 1, prompt=[5, *PROMPT[:50]], tenant=B)
    fill(e, 0, prompt=[7, *PROMPT[:30]], tenant=B)  # slot 0's A prompt goes to RAM
    assert e.cache is not None and len(e.cache.entries) == 2
    asked = e.submit_command(DescribeCache())
    assert not asked.done()  # nothing is read until the engine thread's next step
    every = drive(e, asked)
    assert [x["n_tokens"] for x in every.ram["entries"]] == [100, 51]
    assert (every.ram["n_entries"], every.ram["n_tokens"]) == (2, 151)
    assert "n_pending" in every.disk
    a, b = do(e, DescribeCache(A)), do(e, DescribeCache(B, idle_slots=True))
    assert ([x["n_tokens"] for x in a.ram["entries"]], a.ram["n_tokens"]) == ([100], 100)
    assert ([x["n_tokens"] for x in b.ram["entries"]], b.ram["n_tokens"]) == ([51], 51)
    assert b.ram["n_bytes"] == e.cache.entries[1].nbytes and b.idle_slots
    assert "n_pending" not in a.disk  # another tenant's saves would show in the queue
    e2, _ = engine_of()
    assert do(e2, DescribeCache()) is None  # no RAM cache: {"enabled": false}


def test_the_slots_snapshot_is_made_between_steps_with_exact_counts(alive):
    """GET /slots' snapshot (issue 57: routes never read the engine's slots): made by the
    engine's step, one consistent moment; each slot's counts are its last run's."""
    e, _ = engine_of()
    fill(e, 0, tenant=A)
    asked = e.submit_command(DescribeSlots())
    assert not asked.done()  # nothing is read until the engine thread's next step
    zero, one = drive(e, asked)
    assert (zero.id, zero.state, zero.task, zero.owner) == (0, "idle", None, A)
    assert (zero.n_prompt, zero.n_cached, zero.n_processed, zero.n_decoded) == (100, 0, 100, 1)
    assert zero.n_tokens == len(e.slots[0].tokens) and zero.idle
    assert zero.checkpoint_tokens == tuple(c.n_tokens for c in e.slots[0].checkpoints)
    assert (one.n_tokens, one.n_prompt, one.owner) == (0, 0, "")  # never ran
    fill(e, 0, prompt=PROMPT[:60], tenant=A)  # a prefix of what slot 0 holds: reused
    again, run = do(e, DescribeSlots())[0], e.slots[0].live
    assert (again.n_prompt, again.n_cached + again.n_processed) == (60, 60)
    assert (again.n_cached, again.n_processed) == (run.n_cached, run.n_processed)
    assert again.n_cached > 0


def _wait(engine: Engine) -> None:
    """Every command submitted before this one has run (fire-and-forget counts too)."""
    engine.submit_command(CheckIntegrity()).result(10)


def test_the_route_answers_refusals_403_uncounted_and_failures_with_their_status(tmp_path):
    settings = Settings(slot_save_path=str(tmp_path), cache_isolation="salt")
    b = FileBackend(True, n_seq=2)
    with route_client(b, settings, [slots_route.router]) as c:
        engine = c.app.state.server.engine
        t, done = task(PROMPT, max_tokens=1, id_slot=0, tenant=A)
        engine.submit(t)
        for _ in range(1000):
            if done.result is not None:
                break
            _wait(engine)
        assert done.result is not None
        r = c.post("/slots/0?action=erase&cache_salt=b")
        assert r.status_code == 403 and "another tenant" in r.text
        _wait(engine)
        assert engine.stats.slot_file_failures == 0
        b.state_get_into = lambda *a: 0
        r = c.post("/slots/0?action=save&cache_salt=a", json={"filename": "f.bin"})
        assert r.status_code == 500 and "could not copy" in r.text
        _wait(engine)
        assert engine.stats.slot_file_failures == 1
        assert not list(tmp_path.iterdir())  # no file, no temporary file
