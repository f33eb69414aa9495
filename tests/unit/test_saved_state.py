"""One saved state and one restore path (issue 41): the RAM cache, the disk tier and slot
files all hand a ``SavedState`` (server/tiers/saved.py) to ``SlotStore.restore(slot, state,
trusted)``, the one way a state comes back into a slot; the removed shapes and restore
paths stay removed (AST checks, tests/unit/test_layout.py style)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from server.engine import disk_glue
from server.engine.commands import AttachAppendices, RestoreSlot, SlotRestored, StateLoaded
from server.kv.checkpoints import CheckpointPolicy
from server.kv.file_plan import parse_after_state, plan_restore
from server.kv.store import SlotStore
from server.tiers import slot_file
from server.tiers.disk import DiskTier
from server.tiers.disk_files import DiskEntry, FileCheck
from server.tiers.prompt_cache import PromptCache
from server.tiers.saved import InBuffer, InSlot, OnDisk, SavedState
from tests.fake_backend import FakeBackend

from .helpers import run, task
from .test_commands import ANYONE, PROMPT, alive, do, engine_of, fill, read, save  # noqa: F401

PKG = Path(__file__).resolve().parents[2] / "server"
# the shapes and restore paths one SavedState and SlotStore.restore replaced
GONE_TYPES = {"CacheEntry", "Snapshot", "FileAppendix"}
GONE_CALLS = {"restore_file", "load_file_state", "apply_appendices", "_restore_file"}


def _trees() -> list[tuple[str, ast.Module]]:
    return [(str(p.relative_to(PKG)), ast.parse(p.read_text())) for p in PKG.rglob("*.py")]


def _called(node: ast.Call) -> str | None:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def test_one_restore_entry_point_and_no_removed_shape_or_path():
    found = []
    for name, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name in GONE_TYPES:
                found.append(f"{name}: class {node.name}")
            is_def = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            if is_def and node.name in GONE_CALLS:
                found.append(f"{name}: def {node.name}")
            if isinstance(node, ast.Call) and _called(node) in GONE_CALLS:
                found.append(f"{name}:{node.lineno} calls {_called(node)}")
            if isinstance(node, ast.ImportFrom):
                found += [f"{name}: imports {a.name}" for a in node.names if a.name in GONE_TYPES]
    assert found == []
    public = [m for m in vars(SlotStore) if m.startswith("restore") or m.startswith("load")]
    assert public == ["restore"]


def test_states_reach_llama_cpp_only_through_the_store():
    """Loading a whole sequence state (``state_set``) happens in SlotStore._load alone (and
    a checkpoint's partial state in resume_at_checkpoint; the draft's in draft_kv.py). The
    private copies (``_own_copy``: a context shift's, a shared prefix's window) set back the
    slot's own live state, never a saved one."""
    where = []
    for name, tree in _trees():
        if not name.startswith(
            ("engine/", "slot/", "kv/", "speculative/", "kv_events/", "prefix/")
        ):
            continue
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and _called(node) == "state_set":
                    where.append((name, fn.name))
    mine = sorted({w for w in where if w[0] == "kv/store.py"})
    assert mine == [
        ("kv/store.py", "_load"),
        ("kv/store.py", "_own_copy"),
        ("kv/store.py", "resume_at_checkpoint"),
    ]
    assert {w[0] for w in where} <= {"kv/store.py", "kv/draft_kv.py"}


def test_every_store_restore_call_says_whether_it_trusts_the_state():
    calls = []
    for name, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                is_store = isinstance(owner, ast.Name) and owner.id == "store"
                is_store |= isinstance(owner, ast.Attribute) and owner.attr == "store"
                if node.func.attr == "restore" and is_store:
                    calls.append((name, [k.arg for k in node.keywords]))
    assert {n for n, _ in calls} == {"engine/ram.py", "engine/disk_glue.py", "engine/commands.py"}
    assert all("trusted" in kws for _, kws in calls), calls


@pytest.fixture
def handed(monkeypatch):
    """Every (state, trusted, its tokens then) handed to SlotStore.restore."""
    got: list[tuple[SavedState, bool, list[int]]] = []
    real = SlotStore.restore

    def record(self, slot, state, trusted):
        got.append((state, trusted, list(state.tokens)))
        return real(self, slot, state, trusted)

    monkeypatch.setattr(SlotStore, "restore", record)
    return got


def test_the_ram_cache_hands_its_entry_trusted(handed):
    e, _ = engine_of(n_seq=1)
    e.cache = PromptCache(-1, 0)
    e.opts.cache_idle_slots = False
    run(e, task(PROMPT, max_tokens=2)[0])
    first = list(e.slots[0].tokens)
    run(e, task([900 + i % 50 for i in range(60)], max_tokens=2)[0])  # takes the only slot
    t, c = task(first + [5], max_tokens=2)
    run(e, t)
    assert c.result.timings.cache_n == len(first)
    ((state, trusted, tokens),) = handed
    assert type(state) is SavedState and trusted and isinstance(state.data, bytearray)
    assert tokens == first


def test_the_disk_tier_hands_its_file_untrusted(handed, alive, tmp_path):  # noqa: F811
    e, b = engine_of(n_seq=1)  # FileBackend: its states start with llama.cpp's 8-byte header
    check = FileCheck(b.state_file_version, 4096, b.n_vocab, "m")
    disk = DiskTier(tmp_path, 1 << 30, check, sync_scan_s=10.0)
    disk.start()
    try:
        fill(e, 0)
        first = list(e.slots[0].tokens)
        assert disk_glue.spill(e.store, None, disk) == 1 and disk.flush(10)
        e.store.clear(e.slots[0])
        assert disk_glue.load(e.store, disk, e.slots[0], first + [5], "")
    finally:
        disk.close()
    ((state, trusted, tokens),) = handed
    assert type(state) is SavedState and not trusted and isinstance(state.data, InBuffer)
    assert e.slots[0].tokens == first == tokens


def test_a_longer_match_on_disk_beats_a_weaker_ram_entry(alive, tmp_path):  # noqa: F811
    """Agents sharing a system prompt: the RAM cache holds another conversation (it shares
    only the system prompt), the disk this conversation's own state. Both tiers are looked
    at, and the disk's longer match is restored."""
    from server.engine import ram

    check = FileCheck(0, 4096, 1000, "m")
    disk = DiskTier(tmp_path, 1 << 30, check, sync_scan_s=10.0)
    e, b = engine_of(n_seq=1, cache=PromptCache(-1, 0), disk=disk)
    disk.check = FileCheck(b.state_file_version, 4096, b.n_vocab, "m")
    e.opts.cache_idle_slots = False
    disk.start()
    try:
        system = list(range(1, 61))
        fill(e, 0, prompt=system + list(range(200, 240)))
        mine = list(e.slots[0].tokens)
        assert disk_glue.spill(e.store, None, disk) == 1 and disk.flush(10)
        e.store.clear(e.slots[0])
        fill(e, 0, prompt=system + list(range(300, 340)))
        assert ram.save(e.store, e.cache, e.slots[0])
        e.store.clear(e.slots[0])
        t, c = task(mine + [5], max_tokens=1, id_slot=0)
        run(e, t)
    finally:
        disk.close()
    assert c.result.timings.cache_n == len(mine)
    assert e.cache.counters.loads == 0  # the RAM entry stayed where it was


@pytest.mark.parametrize("known", [True, False], ids=["kv-layout", "unknown-layout"])
def test_a_slot_file_is_handed_untrusted(handed, alive, tmp_path, known):  # noqa: F811
    e, b = engine_of(known)
    fill(e, 0)
    e.store.take_checkpoint(e.slots[0])
    parsed = read(e, b, save(e, tmp_path, 0), 1)
    plan = plan_restore(b, parsed)
    got = do(e, RestoreSlot(1, parsed, plan, ANYONE))
    carried = plan.appendices
    if not known:  # the state first, then its appendices: a state already in the slot
        assert isinstance(got, StateLoaded)
        carried = parse_after_state(parsed, parsed.state_off + got.consumed, None)
        got = do(e, AttachAppendices(1, list(parsed.tokens), carried, ANYONE))
    assert got == SlotRestored(100, [])
    kinds = [(type(s), type(s.data), t) for s, t, _ in handed]
    want = [(SavedState, InBuffer, False)] + ([] if known else [(SavedState, InSlot, False)])
    assert kinds == want
    # the slot holds the file's checkpoints (those a restore needs: checkpoints.file_checkpoints)
    assert carried is not None
    got_pos = [c.pos for c in e.slots[1].checkpoints]
    assert got_pos == [c.pos for c in carried.checkpoints]
    assert e.slots[1].tokens == e.slots[0].tokens


def test_appendices_and_disk_entries_are_saved_states(tmp_path):
    """A slot file's appendices are read as a SavedState of its extras, and the disk
    index's entries are SavedStates whose bytes are still in their file (OnDisk): no other
    shape of saved state is left."""
    classes = [
        f"{name}: {node.name}"
        for name, tree in _trees()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and node.name == "Appendices"
    ]
    assert classes == []
    ck = slot_file.encode_checkpoints([])
    app = slot_file.parse_appendices(bytearray(ck + b"ZZZZ"), 0, 10)
    assert isinstance(app, SavedState) and app.tokens == [] and app.checkpoints == []
    e = DiskEntry("f.lsc", [1, 2, 3], "t", 1000, 900, 7)
    assert isinstance(e, SavedState) and e.data == OnDisk("f.lsc", 1000, 900, 7)
    assert (e.nbytes, e.key, e.tenant, e.tokens) == (1000, (7, "f.lsc"), "t", [1, 2, 3])
    store = SlotStore(FakeBackend(n_seq=1), CheckpointPolicy(False))
    with pytest.raises(TypeError):  # not read yet: DiskTier.read makes it an InBuffer
        store.restore(store.slots[0], e, trusted=False)
