"""One phase touches memory (issue 41): every call that changes llama.cpp memory or decodes
(``MEMORY_CALLS``: decode, seq_rm, seq_cp, seq_add, seq_clear, state_set), on the target and
on a draft model's context, runs inside the runner (server/engine/runner.py). The fake backend
records the phase of each call from the stack; these tests drive the engine through every
path that changes memory (cache restores, cuts, checkpoint resumes, prefix sharing and
waiting, --cache-reuse, context shifts, checkpoints, draft models, ended runs' draft
catch-up, embeddings, cancelled runs, slot commands) and assert none ran elsewhere."""

from __future__ import annotations

import ast
from pathlib import Path

from server.engine.commands import Caller, EraseSlot
from server.engine.embed import EmbedTask
from server.engine.engine import Engine, EngineOptions
from server.slot.speculative import SPEC_DRAFT, SpecConfig
from server.tiers.prompt_cache import PromptCache
from tests.fake_backend import RUNNER, FakeBackend, FakeDraft
from tests.unit.helpers import Collector, make_engine, run, task


def outside(*backends: FakeBackend) -> list[tuple[str, str]]:
    """The memory calls made outside the runner (none, when the rule holds)."""
    return [c for b in backends for c in b.memory_calls if c[1] != RUNNER]


def kinds(b: FakeBackend) -> set[str]:
    return {name for name, _ in b.memory_calls}


def test_cache_restores_cuts_and_idle_slots_run_in_the_runner():
    e, b = make_engine(n_seq=2)
    e.cache = PromptCache(-1, 0)
    a = list(range(1, 200))
    run(e, task(a, max_tokens=3, id_slot=0)[0])
    run(e, task(list(range(300, 500)), max_tokens=3, id_slot=0)[0])  # a to the RAM cache
    t, c = task(a + [7, 8], max_tokens=3, id_slot=0)  # restored from the cache, then cut
    run(e, t)
    assert c.result.timings.cache_n > 0 and e.cache.counters.loads >= 1
    assert {"decode", "seq_rm", "state_set", "seq_clear"} <= kinds(b)
    assert outside(b) == []


def test_checkpoint_resumes_run_in_the_runner():
    e, b = make_engine(n_seq=1, n_swa=100, n_ubatch=128, n_batch=512)
    prompt = list(range(1, 1001))
    t, c = task(prompt, max_tokens=8, user_start=600)
    run(e, t)
    held = list(e.slots[0].tokens)
    t2, c2 = task(held[:700] + [5, 6, 7], max_tokens=2)  # behind the window
    run(e, t2)
    assert e.stats.checkpoints_restored == 1 and e.stats.checkpoints_created > 0
    assert outside(b) == []


def test_prefix_sharing_copies_and_waits_run_in_the_runner():
    e, b = make_engine(n_seq=4, n_batch=1024)
    e.sharing.speed.observe(1000, 1.0)
    common = list(range(1, 1500))
    tasks = [task(common + [900 + i], max_tokens=3) for i in range(3)]
    run(e, *(t for t, _ in tasks))
    held = task(common + [5], max_tokens=2)  # a held prefix, copied at placement
    run(e, held[0])
    assert e.stats.prefix_shared_tokens > 0
    assert "seq_cp" in kinds(b)
    assert outside(b) == []


def test_cache_reuse_moves_run_in_the_runner():
    b = FakeBackend(n_seq=2, scratch=True)
    e = Engine(b, EngineOptions(cache_reuse=8))
    head, mid, tail = list(range(1, 31)), list(range(400, 440)), list(range(500, 560))
    run(e, task(head + mid + tail, max_tokens=1, id_slot=0)[0])
    t, c = task(head + tail, max_tokens=1, id_slot=0)
    run(e, t)
    assert c.result.timings.cache_reuse_n > 0
    assert {"seq_cp", "seq_add"} <= kinds(b)
    assert outside(b) == []


def test_context_shifts_drafts_and_catch_ups_run_in_the_runner():
    b = FakeBackend(n_ctx=64, n_seq=1)
    d = FakeDraft(n_ctx=64, n_seq=1)
    spec = SpecConfig(kind=SPEC_DRAFT, n_max=4)
    e = Engine(b, EngineOptions(context_shift=True, spec=spec), draft=d)
    run(e, task(list(range(1, 21)), max_tokens=150)[0])
    run(e, task(list(range(30, 40)), max_tokens=5)[0])  # settles the first run's draft
    assert e.stats.context_shifts >= 3
    assert "seq_add" in kinds(b) and "decode" in kinds(d)
    assert outside(b, d) == []


def test_embeddings_cancellations_and_commands_run_in_the_runner():
    e, b = make_engine(n_seq=2)
    run(e, task(list(range(1, 50)), max_tokens=2, id_slot=1)[0])
    c = Collector()
    e._inbox.put(EmbedTask([1, 2, 3], c))
    t, _ = task(list(range(1, 80)), max_tokens=50)
    e.waiting.append(t)
    e.step()
    t.cancel()
    e.step()
    assert c.events  # the embedding (an error on the plain fake) was decoded
    e._ops.append(_op(e, EraseSlot(1, Caller("", False))))
    e.step()
    assert e.slots[1].tokens == []
    assert outside(b) == []


def _op(e: Engine, cmd):
    from concurrent.futures import Future

    from server.engine.engine import _Op

    return _Op(cmd.run, cmd.slot, Future())


# ---- the rule in the source: which modules may call memory operations ------------------

SERVER = Path(__file__).resolve().parents[2] / "server"
# the engine's side, where the slots' code lives
ENGINE_SIDE = ("engine", "slot", "kv", "speculative", "kv_events", "prefix")
MEMORY_ATTRS = {"decode", "seq_rm", "seq_cp", "seq_add", "seq_clear", "state_set"}
# the runner, and the helpers only it calls: the executor (the batch), the slot store, the
# draft model's memory and drafter, --cache-reuse's scratch sequence
MAY_TOUCH = {"runner", "executor", "store", "draft_kv", "drafter", "cache_reuse"}
# the decisions: they yield operations (engine/step_plan.py) and never call one
DECIDE = {"placement", "sharing", "embed", "scheduler", "policy", "update", "engine", "step_plan"}


def _memory_callers(path: Path) -> set[str]:
    """The memory attributes ``path`` calls on anything (``x.seq_rm(...)``, ...)."""
    tree = ast.parse(path.read_text())
    return {
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in MEMORY_ATTRS
        # bytes.decode("utf-8") is not llama_decode
        and not (
            node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        )
    }


def test_only_the_runner_and_its_helpers_call_memory_operations():
    # text.py's ``decode`` is an incremental UTF-8 decoder's, not llama_decode
    files = [p for d in ENGINE_SIDE for p in (SERVER / d).glob("*.py")]
    calls = {p.stem: _memory_callers(p) for p in files if p.stem != "text"}
    assert {m for m, c in calls.items() if c} <= MAY_TOUCH, calls
    assert all(not calls[m] for m in DECIDE)
    assert "decode" in calls["runner"] and "decode" in calls["executor"]


def test_the_engine_drives_decisions_through_the_runner():
    src = (SERVER / "engine" / "engine.py").read_text()
    for decision in ("self.placer.place(", "self.sharing.resolve_waiters()", "self.embed.step()"):
        assert f"self.runner.drive({decision}" in src, decision
    assert "self.executor.execute(" not in src and "self.executor.settle_ended(" not in src


# the glue that writes the RAM cache and the disk tier (saves, takes, evictions, spills)
TIER_GLUE = {"ram", "disk_glue"}
TIER_WRITES = {"put", "take", "update", "save", "save_run", "evict_idle", "spill"}


def _tier_writes(path: Path) -> list[str]:
    """The tier glue ``path`` imports and the cache writes it calls (``x.cache.put(...)``)."""
    tree = ast.parse(path.read_text())
    found = [
        f"imports {a.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for a in node.names
        if a.name in TIER_GLUE
    ]
    for node in ast.walk(tree):
        f = node.func if isinstance(node, ast.Call) else None
        if (
            isinstance(f, ast.Attribute)
            and f.attr in TIER_WRITES
            and isinstance(f.value, ast.Attribute)
            and f.value.attr in {"cache", "disk"}
        ):
            found.append(f"{f.value.attr}.{f.attr}() line {node.lineno}")
    return found


def test_the_decisions_write_no_tier():
    # a save before a slot is overwritten, the evictions after a restore: runner operations
    files = {p.stem: p for d in ENGINE_SIDE for p in (SERVER / d).glob("*.py")}
    writes = {m: _tier_writes(files[m]) for m in DECIDE}
    assert writes == {m: [] for m in DECIDE}
    assert _tier_writes(files["runner"])  # the rule sees the runner's


def test_the_http_side_asks_the_engine_through_typed_commands():
    # Engine.call runs any function on the engine thread: the commands' mechanism and the
    # tests', never a route's or a service's (a lambda there could touch memory unseen)
    callers = [
        f"{p.relative_to(SERVER)}:{node.lineno}"
        for p in SERVER.rglob("*.py")
        if p != SERVER / "engine" / "engine.py"
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "call"
        and isinstance(node.func.value, ast.Name | ast.Attribute)
        and "engine" in ast.unparse(node.func.value)
    ]
    assert callers == []
