"""The engine's Backend protocol (server.slot.backend_api) and the draft's DraftMemory
(server.kv.draft_kv) against their implementations: the real ones in server.llama and
the fakes of the unit tests. Every protocol member must exist on each, and every method
must take the protocol's parameters (by name, in order). The type checker of ./test.sh
checks the same statically (the ``TYPE_CHECKING`` block below, and server.http.app's)."""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import TYPE_CHECKING, Protocol

import pytest

from server.kv.draft_kv import DraftMemory
from server.llama.backend import LlamaBackend
from server.llama.draft import DraftContext
from server.slot.backend_api import Backend
from tests.fake_backend import FakeBackend, FakeDraft

if TYPE_CHECKING:

    def _conforms(b: FakeBackend, d: FakeDraft) -> tuple[Backend, DraftMemory]:
        return b, d


def _members(proto: type) -> dict[str, object]:
    """A protocol's own members and those of the protocols it extends: attributes (their
    annotation) and methods or properties (the function object)."""
    out: dict[str, object] = {}
    for cls in reversed(proto.__mro__):
        if cls in (object, Protocol) or not getattr(cls, "_is_protocol", False):
            continue
        out.update(getattr(cls, "__annotations__", {}))
        out.update(
            (k, v)
            for k, v in vars(cls).items()
            if not k.startswith("_") and (callable(v) or isinstance(v, property))
        )
    return out


def _instance_attrs(cls: type) -> set[str]:
    """Names a class and its bases assign as ``self.name = ...`` (read from the source, so
    the real backend needs no model to be checked)."""
    names: set[str] = set()
    for c in cls.__mro__:
        if c is object:
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(c)))
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, ast.AnnAssign | ast.AugAssign):
                targets = [node.target]
            for t in targets:
                for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if isinstance(e, ast.Attribute) and ast.unparse(e.value) == "self":
                        names.add(e.attr)
    return names


def _problems(proto: type, cls: type, attrs: set[str]) -> list[str]:
    out = []
    for name, member in _members(proto).items():
        have = getattr(cls, name, None)
        if not hasattr(cls, name) and name not in attrs:
            out.append(f"{cls.__name__} lacks {name}")
        elif inspect.isfunction(member) and not isinstance(have, property):
            if not callable(have):
                out.append(f"{cls.__name__}.{name} is not a method")
                continue
            want = list(inspect.signature(member).parameters)
            got = list(inspect.signature(have).parameters)
            if got[: len(want)] != want:
                out.append(f"{cls.__name__}.{name}{tuple(got)}: the protocol has {tuple(want)}")
    return out


IMPLEMENTATIONS = [
    (Backend, LlamaBackend),
    (Backend, FakeBackend),
    (DraftMemory, DraftContext),
    (DraftMemory, FakeDraft),
]


@pytest.mark.parametrize(("proto", "cls"), IMPLEMENTATIONS, ids=lambda x: x.__name__)
def test_implementations_have_every_protocol_member(proto: type, cls: type) -> None:
    attrs = _instance_attrs(cls)
    if cls in (FakeBackend, FakeDraft):
        attrs |= set(vars(cls()))  # the fakes: what an instance really holds
    assert _problems(proto, cls, attrs) == []


def test_the_check_sees_members_and_misses() -> None:
    members = _members(Backend)
    # from Backend itself, from SeqMemory, attributes, properties
    assert {"decode", "seq_rm", "n_swa", "add_bos", "can_shift", "kv_type_ids"} <= set(members)

    class Partial:
        n_swa = 0

        def decode(self, start: int) -> int:
            return 0

    problems = _problems(Backend, Partial, set())
    assert "Partial lacks seq_rm" in problems and "Partial lacks add_bos" in problems
    assert any(p.startswith("Partial.decode") for p in problems)
    assert not any("n_swa" in p for p in problems)


def test_engine_code_does_not_probe_the_backend() -> None:
    """No ``getattr(self.b, ...)`` / ``hasattr(backend, ...)``: the protocol says what exists."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "server"
    probes = []
    engine_side = ("engine", "slot", "kv", "speculative", "kv_events", "prefix", "tiers")
    for p in [q for d in engine_side for q in root.glob(f"{d}/*.py")]:
        for node in ast.walk(ast.parse(p.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and node.args
            ):
                target = ast.unparse(node.args[0])
                if target in ("self.b", "self.d", "backend", "self.backend", "self.store.b"):
                    probes.append(f"{p.name}:{node.lineno} {ast.unparse(node)}")
    assert probes == []
