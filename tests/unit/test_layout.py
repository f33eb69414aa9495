"""The package's shape: no import circles, no lower layer importing a higher one, only
``server.llama`` loading llama.cpp, and no function longer than 60 lines. Imports under
TYPE_CHECKING and inside functions count too.

Layers, bottom to top (``LAYERS``): a module may import modules of its own package and of
lower layers, never of a higher layer or of a sibling on its own level; ``KEPT_APART``
names the lower packages a layer still must not import. Every module of the package must
fall in a layer, so a new package has to be placed here before its first commit passes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "server"

LAYERS: tuple[tuple[str, ...], ...] = (
    # leaves: typed values and protocols; the ggml type table and the sequence-state byte
    # layout (pure data and numpy, no llama.cpp), which the caches, slot files and restore
    # plans read without loading llama.cpp; the byte-bounded LRU map (no server imports); the
    # bounded GGUF header reader (pure Python: the router reads projector headers with it);
    # a request preparation's cooperative cancellation (the templates, libmtmd's image
    # decoding and the preparation pools all check it); the JSON value types
    (
        "server.types",
        "server.image_types",
        "server.lru",
        "server.cancel",
        "server.json_value",
        "server.llama.ggml_types",
        "server.llama.state_bytes",
        "server.llama.gguf_header",
    ),
    # one request as the engine runs it: Task, its sampling and generation settings, the
    # events it gets back (its images are the leaves' image_types)
    ("server.task",),
    # what the HTTP side knows of the engine: the tokenizer protocol, the snapshots the
    # engine thread makes (slots, caches, integrity) and an embedding's result
    ("server.engine_api",),
    # the flag table, and the Settings it fills: plain data every layer above may read
    ("server.settings.flags",),
    ("server.settings.config", "server.settings"),
    # siblings: llama.cpp itself (the only user of llama_cpp), grammar/schema compiling,
    # and the prefix index structures (prompt items, the tiers' radix tree, the slots'
    # block trie, the --cache-reuse chunk matcher)
    ("server.llama", "server.constrained", "server.prefix"),
    # where saved states live: SavedState, the RAM prompt cache, the disk tier, slot files
    ("server.tiers",),
    # one slot and what the engine's parts share about it: Slot, its token record, its
    # run's text and reasoning budget, speculative settings, the Backend protocol, counters
    ("server.slot",),
    # the slots' KV state: the slot store, checkpoints, audits, the draft model's KV, the
    # locator and the reuse policy over it
    ("server.kv",),
    # siblings over the KV state: speculative decoding's step, and llm-d's KV events
    ("server.speculative", "server.kv_events"),
    # the engine: the step and its parts (llama.cpp behind Backend)
    ("server.engine",),
    # what clients send: request bodies, sampler fields, errors, bounded JSON, stream names
    ("server.schemas",),
    # siblings over the bodies: chat templates with tool-call and reasoning parsing, and
    # image inputs with their bounds and scope
    ("server.templates", "server.media"),
    # server state, tenancy, submission of tasks
    ("server.service",),
    # each API body's prompt and the one typed engine request it becomes
    # (service.submit.Submission): the chat pipeline (render, plan, constraint), the
    # completion prompts and fill-in-the-middle
    ("server.prompts",),
    # the HTTP endpoints, one module per API (FastAPI routers, with an API's mapping onto
    # chat beside its routes)
    ("server.protocols",),
    # the app (the one place that builds the llama backend and wires everything),
    # middleware, CORS, metrics
    ("server.http",),
    # router mode: model instances as child processes, requests passed on to them; it
    # reuses the HTTP rules (middleware, CORS), never the app or the engine
    ("server.router",),
    # the CLI's entry point, the router's template process (it runs the entry point in each
    # instance it forks), then ``python -m server`` and the package root
    ("server.cli.main", "server.cli"),
    ("server.cli.zygote",),
    ("server.__main__", "server"),
)

# lower packages a layer still must not import: the engine reaches llama.cpp through its
# Backend protocol (server.slot.backend_api) and constraints through server.types'
# protocols; above it, only server.http.app builds llama objects. That holds for every
# folder of the engine's side above llama's layer (the llama leaves stay open to them)
ENGINE_SIDE = ("server.tiers", "server.slot", "server.kv", "server.speculative")
ENGINE_SIDE += ("server.kv_events", "server.engine")
KEPT_APART: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(ENGINE_SIDE, ("server.llama", "server.constrained")),
    "server.schemas": ("server.llama",),
    "server.templates": ("server.llama",),
    "server.media": ("server.llama",),
    "server.service": ("server.llama",),
    "server.prompts": ("server.llama",),
    "server.protocols": ("server.llama",),
    # the HTTP plumbing beside the app serves it; it never reaches for the app's parts
    "server.http.middleware": ("server.protocols", "server.service", "server.http.app"),
    "server.http.cors": ("server.protocols", "server.service", "server.http.app"),
    "server.http.metrics": ("server.protocols", "server.service", "server.http.app"),
    "server.router": ("server.llama", *ENGINE_SIDE, "server.service", "server.http.app"),
}

# modules outside server.llama that import llama_cpp, each inside one function, and why
LLAMA_CPP_OUTSIDE_LLAMA = {
    # llguidance's llama.cpp tokenizer wants the vocabulary pointer and llama_tokenize's
    # address (ConstraintVocab.from_llama; the app passes it to the backend as a factory)
    "server.constrained.matcher",
    # --list-devices asks whether the build offloads to a GPU, without loading a model
    "server.settings.config",
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


def _part(module: str) -> tuple[int, str] | None:
    """(level, entry) of the most specific LAYERS entry holding ``module``; the package
    root ``server`` holds only itself."""
    best: tuple[int, str] | None = None
    for level, entries in enumerate(LAYERS):
        for e in entries:
            inside = module == e or (e != "server" and module.startswith(e + "."))
            if inside and (best is None or len(e) > len(best[1])):
                best = (level, e)
    return best


def _banned(module: str, dep: str) -> bool:
    """Whether ``module`` may not import ``dep``: a higher layer, a sibling on its own level,
    or a package its layer keeps apart."""
    (lm, em), (ld, ed) = _part(module), _part(dep)  # type: ignore[misc]
    if em == ed:
        return False
    if ld >= lm:  # higher, or a sibling on the same level
        return True
    # a ban covers what lies under its name in the same entry (server.llama bans
    # server.llama.backend, not the leaf server.llama.ggml_types)
    return any(
        _inside(module, k) and _inside(dep, b) and _part(b)[1] == ed  # type: ignore[index]
        for k, bans in KEPT_APART.items()
        for b in bans
    )


def _inside(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _upward(g: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} imports {d}" for m, deps in g.items() for d in deps if _banned(m, d))


def test_graph_sees_the_packages_imports():
    g = _graph()
    assert "server.task" in g["server.engine.engine"]
    assert "server.engine.ram" in g["server.engine.runner"]  # from . import disk_glue, ram
    assert "server.templates.output_parse" in g["server.protocols.responses_mapping"]
    assert "server.schemas.errors" in g["server.http.app"]  # from ..schemas import errors
    assert "server.http.app" in g["server.cli.main"]
    assert "server.cli.main" in g["server.__main__"]
    assert "server.llama.ggml_types" in g["server.tiers.slot_file"]
    assert "server.llama.backend" in g["server.http.app"]  # inside a function


def test_every_module_has_a_layer():
    assert [m for m in _graph() if _part(m) is None] == []


def test_the_rules_catch_upward_and_sideways_imports():
    """The checker itself: each kind of bad edge is reported, the allowed ones are not."""
    bad = {
        "server.types": {"server.engine.engine"},  # a leaf importing the engine
        "server.kv.store": {"server.llama.backend"},  # kept apart
        "server.prefix.prefix_index": {"server.llama.params"},  # a sibling
        "server.tiers.disk": {"server.llama.params"},  # kept apart
        "server.templates.chat_template": {"server.service"},  # upward
        "server.llama.ggml_types": {"server.types"},  # sideways among the leaves
        "server.settings.config": {"server.http.app"},  # settings importing the app
        "server.http.metrics": {"server.protocols.prometheus"},  # kept apart
    }
    assert len(_upward(bad)) == sum(len(v) for v in bad.values())
    good = {
        "server.tiers.slot_file": {"server.llama.ggml_types", "server.types"},
        "server.engine.engine": {"server.tiers.disk", "server.engine.ram"},
        "server.http.app": {"server.llama.backend", "server.protocols.openai"},
        "server.protocols.openai": {
            "server.service",
            "server.templates.chat_template",
            "server.settings.config",
        },
        "server.__main__": {"server.cli.main"},
    }
    assert _upward(good) == []


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
    assert _upward(_graph()) == []


def _imports_llama_cpp(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(
            a.name.split(".")[0] == "llama_cpp" for a in node.names
        ):
            return True
        module = node.module if isinstance(node, ast.ImportFrom) and not node.level else None
        if module and module.split(".")[0] == "llama_cpp":
            return True
    return False


def test_only_the_llama_package_loads_llama_cpp():
    users = {_module_name(p) for p in PKG.rglob("*.py") if _imports_llama_cpp(p)}
    assert "server.llama.backend" in users  # the check sees them
    outside = {m for m in users if not m.startswith("server.llama.")}
    assert outside == LLAMA_CPP_OUTSIDE_LLAMA
    # the ggml table and the package's __init__ stay pure: tiers/ and kv/ import them
    assert "server.llama.ggml_types" not in users
    assert not _graph()["server.llama"] and "server.llama" not in users


def test_functions_are_at_most_60_lines():
    long = []
    for p in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > 60:
                    long.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert long == []


def _private_imports(path: Path) -> list[str]:
    """``from X import _name`` in ``path``: a private name taken from another module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.module}.{a.name}")
    return out


def test_no_module_imports_another_modules_private_names():
    assert _private_imports(ROOT / "tests" / "unit" / "test_layout.py") == []
    bad = ast.parse("from .openai import _plan, render_chat\nfrom . import _x\n")
    names = [a.name for n in ast.walk(bad) if isinstance(n, ast.ImportFrom) for a in n.names]
    assert [n for n in names if n.startswith("_")] == ["_plan", "_x"]  # what the rule sees
    found = [x for p in PKG.rglob("*.py") for x in _private_imports(p)]
    assert found == []


# what the prompts' chat pipeline owns: no route module defines them (server.prompts.chat)
FRONT_END_NAMES = {"render_chat", "render_prompt", "plan_chat", "chat_constraint", "chat_messages"}


def test_the_chat_pipeline_lives_in_the_prompts_chat_module():
    defined: dict[str, set[str]] = {}
    for p in [*(PKG / "protocols").rglob("*.py"), PKG / "prompts" / "chat.py"]:
        for node in ast.parse(p.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name in FRONT_END_NAMES:
                defined.setdefault(node.name, set()).add(_module_name(p))
    assert defined == dict.fromkeys(FRONT_END_NAMES, {"server.prompts.chat"})


def test_submit_takes_typed_inputs_not_callbacks():
    """``service.submit.Submission`` (the typed engine request) holds values and a
    PromptSource, no callables into the routes."""
    import dataclasses
    import typing

    from server.service.submit import PromptSource, Submission

    hints = typing.get_type_hints(Submission)
    fields = {f.name: hints[f.name] for f in dataclasses.fields(Submission)}
    assert fields["source"] is PromptSource
    assert not [n for n, t in fields.items() if "Callable" in repr(t)]


def _folder(module: str) -> str:
    """The folder (top-level package) holding ``module``; a module at the root is its own."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or (PKG / parts[-1]).is_dir() else module


def _folder_graph() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for m, deps in _graph().items():
        out.setdefault(_folder(m), set()).update(f for d in deps if (f := _folder(d)) != _folder(m))
    return out


def test_no_folder_imports_a_folder_that_imports_it_back():
    """Folders, not just modules: no circle among ``server``'s packages (Settings in
    ``server/cli`` once made one through the HTTP side's folders and the router)."""
    g = _folder_graph()

    def reachable(f: str) -> set[str]:
        seen: set[str] = set()
        todo = list(g.get(f, ()))
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo.extend(g.get(n, ()))
        return seen

    circles = sorted(f"{a} <-> {b}" for a in g for b in g[a] if a in reachable(b))
    assert circles == []


def test_settings_and_the_entry_point_sit_at_the_ends():
    """``server.settings`` (every layer reads it) imports only the leaves (and a request's
    types, for the sampler order); only the entry point ``python -m server`` imports
    ``server.cli``."""
    g = _folder_graph()
    leaves = {
        "server.types",
        "server.image_types",
        "server.task",
        "server.lru",
        "server.json_value",
        "server.llama",
    }  # server.llama: ggml_types only
    assert g["server.settings"] <= leaves, g["server.settings"]
    flags = _graph()["server.settings.flags"] | _graph()["server.settings.config"]
    assert {d for d in flags if d.startswith("server.llama")} <= {"server.llama.ggml_types"}
    assert sorted(f for f, deps in g.items() if "server.cli" in deps) == ["server.__main__"]


def test_no_two_modules_share_a_file_name():
    """A file name says which module it is: no two modules of ``server/`` (packages'
    ``__init__`` aside) share one (16 did: ``streams.py`` three times, ``anthropic.py`` in
    the bodies and the routes, ...)."""
    seen: dict[str, list[str]] = {}
    for p in PKG.rglob("*.py"):
        if p.name != "__init__.py":
            seen.setdefault(p.name, []).append(str(p.relative_to(ROOT)))
    assert {n: ps for n, ps in seen.items() if len(ps) > 1} == {}


# The routes (server/protocols/) reach the engine through the service layer, and read what
# it hands back in the leaf server/engine_api.py (the tokenizer protocol, the snapshots, an
# embedding's result): they import nothing of the engine's folders, the caches or llama.
ROUTE_BANNED = ("engine", "kv", "slot", "prefix", "tiers", "llama", "speculative", "kv_events")


def test_the_routes_import_nothing_of_the_engine_the_caches_or_llama():
    g = _graph()
    found = {
        m: {d for d in deps if d.split(".")[1] in ROUTE_BANNED}
        for m, deps in g.items()
        if m.startswith("server.protocols.")
    }
    assert {m: d for m, d in found.items() if d} == {}
