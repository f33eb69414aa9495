"""Structure rule of issue 41's "one lookup" (tests/unit/test_layout.py style): the locator
(server/kv/locator.py) is the only module that computes what a slot, an in-flight
prefill or a cached entry shares with a prompt. Slot choice, sharing and the tier loads
read its match.

A prefix computation is a call of one of the matchers (``lcp``, ``shared_prefix``,
``common_prefix``) or a walk of the prefix index (``<index>.match(...)``). The modules
allowed to make one, each for its stated reason, are listed below; a new caller fails
this test until it reads the locator's match instead (or is listed here, with its reason).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "server"
MATCHERS = {"lcp", "shared_prefix", "common_prefix"}

# module -> why it may compute a prefix itself
ALLOWED = {
    "server/kv/locator.py": "the locator: every holder's match",
    "server/prefix/prefix_index.py": "the index: walks its own tree (the entries' matcher)",
    "server/prefix/items.py": "defines the item matcher",
    # the tiers read the locator's Match (the slot's own state as Match.held, the entries
    # as Match.tiers()); the disk tier walks its own tree again after a rescan changed it,
    # or when its index is not the one the match walked (a tier of its own)
    "server/tiers/disk.py": "disk tier: walks its own tree after a rescan",
    # not prompt lookups: the draft model's KV against the target's tokens
    "server/kv/draft_kv.py": "draft KV bookkeeping",
    # the cells a slot may share with another in unified KV (shared_until), which a
    # context shift and --cache-reuse's chunk moves must leave in place
    "server/kv/store.py": "the slots' shared cells (shared_until)",
}


def _prefix_calls(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        if name in MATCHERS:
            out.append(f"{name}() line {node.lineno}")
        # <something>.index.match(...) / .tree.match(...): a walk of the prefix index
        if (
            name == "match"
            and isinstance(f, ast.Attribute)
            and isinstance(f.value, ast.Attribute)
            and f.value.attr in {"index", "tree"}
        ):
            out.append(f"index walk line {node.lineno}")
    return out


def _callers() -> dict[str, list[str]]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        calls = _prefix_calls(ast.parse(path.read_text(), str(path)))
        if calls:
            found[str(path.relative_to(ROOT.parent))] = calls
    return found


def test_only_the_locator_computes_prefixes_against_holders():
    stray = {m: c for m, c in _callers().items() if m not in ALLOWED}
    assert stray == {}, f"compute prefixes outside the locator (read its Match): {stray}"


def test_every_allowed_module_computes_a_prefix():
    # an entry whose module no longer computes one goes: the list only shrinks
    assert sorted(set(ALLOWED) - set(_callers())) == []


def test_the_consumers_read_the_match():
    callers = _callers()
    for m in ("kv/policy.py", "engine/sharing.py", "engine/scheduler.py", "engine/placement.py"):
        assert f"server/{m}" not in callers
    assert "server/engine/ram.py" not in callers
    assert "server/kv/locator.py" in callers


def test_the_rule_catches_a_scan():
    src = "def f(s, p):\n    return shared_prefix(s.tenant, s.tokens, '', p)\n"
    assert _prefix_calls(ast.parse(src)) == ["shared_prefix() line 2"]
    src = "def g(self, t):\n    return self.cache.index.match(t.tenant, t.prompt)\n"
    assert _prefix_calls(ast.parse(src)) == ["index walk line 2"]
