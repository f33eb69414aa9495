"""A chat body's path from the route to the decode visits no module twice (issue 57): at each
point where the request's work is done (the template rendered, the prompt tokenized, the
tasks handed to the engine, the batch decoded, a token sampled), the call stack's modules
of ``server/``, consecutive frames of one module taken as one visit, name no module twice.
A module that calls a higher one which calls it back (a route helper the service reaches
for, a service function a template calls) shows here as a repeat.

The request runs for real over the engine on the fake backend (one token per character);
the probes wrap the fake's decode and sample, the tokenizer, the template's render and
``Engine.submit``, and record the stack the first time each is called."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from starlette.testclient import TestClient

from server.engine.engine import Engine
from server.settings.config import Settings
from server.templates.chat_template import ChatTemplate
from tests.unit.test_chat_route import TextBackend, _app

SERVER = Path(__file__).resolve().parents[2] / "server"
Probe = tuple[type, str]
PROBES: dict[str, Probe] = {
    "render": (ChatTemplate, "render"),
    "tokenize": (TextBackend, "tokenize"),
    "submit": (Engine, "submit"),
    "decode": (TextBackend, "decode"),
    "sample": (TextBackend, "sample"),
}


def stack_modules(frame: FrameType | None) -> list[str]:
    """The modules of ``server/`` on the stack from ``frame`` outwards, outermost first,
    each run of consecutive frames of one module as one entry."""
    mods: list[str] = []
    while frame is not None:
        f = Path(frame.f_code.co_filename).resolve()
        if SERVER in f.parents:
            mods.append(".".join(f.relative_to(SERVER.parent).with_suffix("").parts))
        frame = frame.f_back
    mods.reverse()
    return [m for i, m in enumerate(mods) if i == 0 or mods[i - 1] != m]


def repeats(path: list[str]) -> list[str]:
    return sorted({m for m in path if path.count(m) > 1})


def _recording(name: str, fn: Callable[..., Any], seen: dict[str, list[str]]) -> Any:
    def probe(*args: Any, **kw: Any) -> Any:
        seen.setdefault(name, stack_modules(sys._getframe(1)))
        return fn(*args, **kw)

    return probe


@pytest.fixture
def stacks(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    seen: dict[str, list[str]] = {}
    for name, (cls, attr) in PROBES.items():
        monkeypatch.setattr(cls, attr, _recording(name, getattr(cls, attr), seen))
    return seen


@pytest.fixture
def client() -> Iterator[TestClient]:
    yield from _app(Settings())


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "extra",
    [{}, {"stream": True}, {"tools": [TOOL], "stream": True}],
    ids=["plain", "stream", "tools"],
)
def test_a_chat_body_visits_no_module_twice(
    client: TestClient, stacks: dict[str, list[str]], extra: dict[str, Any]
) -> None:
    body = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert set(stacks) == set(PROBES)  # every probe saw the request
    assert stacks["submit"][0] == "server.protocols.openai"  # the route hands it on
    assert stacks["decode"][-1] == "server.engine.executor"  # the runner's executor decodes
    assert {k: repeats(v) for k, v in stacks.items() if repeats(v)} == {}, stacks


def _defined_in(path: Path, src: str) -> dict[str, Any]:
    """``src``'s functions as if written in ``path`` (their frames name that file)."""
    scope: dict[str, Any] = {"sys": sys, "stack_modules": stack_modules}
    exec(compile(src, str(path), "exec"), scope)
    return scope


def test_the_check_sees_a_module_visited_twice() -> None:
    route = _defined_in(
        SERVER / "protocols/openai.py",
        "def h(): return stack_modules(sys._getframe())\ndef f(g): return g()",
    )
    service = _defined_in(SERVER / "service/submit.py", "def g(h): return h()")
    back = route["f"](lambda: service["g"](route["h"]))  # route -> service -> route
    assert back == ["server.protocols.openai", "server.service.submit", "server.protocols.openai"]
    assert repeats(back) == ["server.protocols.openai"]
    assert route["f"](route["h"]) == ["server.protocols.openai"]  # one module, one visit
    assert stack_modules(sys._getframe()) == []  # a test's own frames are not server/'s
