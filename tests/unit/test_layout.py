"""The package's shape: no import circles, no lower layer importing a higher one, and no
function longer than 60 lines. Imports under TYPE_CHECKING count too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "server"

# module prefix -> prefixes it must never import (higher layers, or siblings kept apart)
FORBIDDEN = {
    "server.types": ("server.",),
    "server.llama": (
        "server.slots",
        "server.cache",
        "server.routes",
        "server.app",
        "server.service",
    ),
    "server.cache": (
        "server.slots",
        "server.routes",
        "server.app",
        "server.service",
        "server.llama",
    ),
    "server.slots": ("server.routes", "server.app", "server.service", "server.llama"),
    "server.middleware": ("server.routes", "server.app"),
    "server.metrics": ("server.routes", "server.app"),
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Modules of the package that ``path`` imports (relative imports resolved)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("server"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("server"):
                continue
            out.add(mod)
            # "from . import ram" names a module, not an attribute
            for a in node.names:
                if (ROOT / (mod.replace(".", "/") + "/" + a.name + ".py")).exists():
                    out.add(f"{mod}.{a.name}")
    return out


def _graph() -> dict[str, set[str]]:
    mods = {_module_name(p): p for p in PKG.rglob("*.py")}
    return {m: {i for i in _imports(p) if i in mods and i != m} for m, p in mods.items()}


def test_graph_sees_the_packages_imports():
    g = _graph()
    assert "server.types" in g["server.slots.engine"]
    assert "server.slots.ram" in g["server.slots.engine"]


def test_no_import_circles():
    g = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(g[m]):
            if state.get(n) == 1:
                # a package __init__ importing its own modules is not a circle
                cycle = stack[stack.index(n) :] + [n]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)


def test_no_lower_layer_imports_a_higher_one():
    bad = []
    for m, deps in _graph().items():
        for low, banned in FORBIDDEN.items():
            if m == low or m.startswith(low + "."):
                bad += [f"{m} imports {d}" for d in deps if d.startswith(banned)]
    assert bad == []


def test_functions_are_at_most_60_lines():
    long = []
    for p in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > 60:
                    long.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert long == []
