"""llama-server's whole command line: every flag of the vendored llama-server README's table
parses (each alias, the negations, with a well-formed value), its LLAMA_ARG_* variable is ours
and is honoured; malformed values fail; ignored flags give one warning; the sampling defaults
reach requests; --no-jinja picks the built-in template."""

from __future__ import annotations

import functools
import logging
import re
import subprocess
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

import server.cli.main as cli
from server.protocols.common import generation_settings
from server.schemas.bodies import ChatRequest, CompletionRequest
from server.service.sampling import sampling_from
from server.service.state import ServerState
from server.settings.config import (
    COMPAT,
    OPTIONS,
    Settings,
    build_parser,
    ignored_flags,
    parse_settings,
    warn_ignored,
)
from server.templates.chat_template import BUILTIN_TEMPLATES, pick_template
from tests.llama_sdist import vendored

# Flags that print something and exit 0.
EXITS = {"-h", "--help", "--usage", "--version", "-cl", "--cache-list", "--completion-bash"}
EXITS |= {"--list-devices"}

# A well-formed value per metavar of the README ("N" and the like: SAMPLE_NUMBER) ...
SAMPLES = {
    "[on|off|auto]": "on",
    "[on|off]": "off",
    "<0|1>": "1",
    "<0...100>": "10",
    "TYPE": "q8_0",
    "M": "ff",
    "lo-hi": "0-3",
    "N0,N1,N2,...": "3,1",
    "MiB0,MiB1,MiB2,...": "1024,512",
    "P0,P1,...": "0.5,0.25",
    "SERVERS": "localhost:50052",
    "KEY=TYPE:VALUE,...": "tokenizer.ggml.add_bos_token=bool:false",
    "FNAME:SCALE,...": "/tmp/adapter.gguf:0.5",
    "START END": "0 3",
    "<tensor name pattern>=<buffer type>,...": "exps=CPU",
    "<dev1,dev2,..>": "none",
    "<user>/<model>[:quant]": "ggml-org/some-model-GGUF:Q4_K_M",
    "[<repo>/]<model>[:quant]": "ai/gemma3",
    "TOKEN_ID(+/-)BIAS": "15043+1",
    "SAMPLERS": "top_k;temperature",
    "SEQUENCE": "kt",
    "JSON": '{"a": 1}',
    "SCHEMA": '{"type": "object"}',
    "STRING": "x",
    "FORMAT": "deepseek",
    "MODE": "mmap",
    "SIMILARITY": "0.5",
    "JINJA_TEMPLATE": "chatml",
    "HOST": "0.0.0.0",
    "TOOL1,TOOL2,...": "read_file",
}
SAMPLE_NUMBER = "2"
NUMERIC = {"N", "SEED", "INDEX", "PORT", "SECONDS", "L", "P"}
TEXT = {"FNAME", "FILE", "PATH", "DIR", "JINJA_TEMPLATE_FILE", "MODEL_URL", "URL", "DEVICE"}
TEXT |= {"KEY", "ORIGINS", "METHODS", "HEADERS", "PREFIX", "MESSAGE", "OPTION", "TOKEN"}
TEXT |= {"PROMPT", "GRAMMAR", "LEVEL"}
# ... and where the metavar alone says too little.
BY_FLAG = {
    "--top-p": "0.5",
    "--min-p": "0.5",
    "--numa": "distribute",
    "--load-mode": "mmap",
    "--lazy-mode": "on",
    "--chat-template-kwargs": '{"enable_thinking": false}',
    "--tools-runtime": "docker:alpine",
    "--spec-type": "ngram-simple,ngram-mod",
    "--rope-scaling": "yarn",
    "--split-mode": "row",
    "--pooling": "mean",
    "--xtc-probability": "0.5",
    "--xtc-threshold": "0.5",
    "--typical": "0.5",
    "--adaptive-target": "0.5",
    "--adaptive-decay": "0.5",
}


@dataclass
class Row:
    flags: list[str]
    metavar: str
    env: str

    @property
    def pair(self) -> bool:
        """A --x / --no-x pair (the negations come last)."""
        return not self.metavar and any(f.startswith("--no-") for f in self.flags[1:])


def readme_rows() -> list[Row]:
    text = vendored("tools/server/README.md").read_text(encoding="utf-8")
    m = re.search(r"<!-- HELP_START -->(.*)<!-- HELP_END -->", text, re.S)
    assert m, "the llama-server README has no HELP_START/HELP_END section"
    rows = []
    for line in m.group(1).splitlines():
        cell = re.match(r"^\| `([^`]+)` \| (.*) \|$", line)
        if not cell:
            continue
        spec = cell.group(1).replace("\\|", "|")
        env = re.search(r"\(env: ([A-Z_]+)\)", cell.group(2))
        *flags, last = spec.split(", ")
        first, _, metavar = last.partition(" ")
        rows.append(Row([*flags, first], metavar, env.group(1) if env else ""))
    return rows


@functools.cache
def _rows_or_error() -> list[Row] | str:
    try:
        return readme_rows()
    except AssertionError as e:  # tried once per run, reported by every test that needs it
        return str(e)


def readme_rows_or_fail() -> list[Row]:
    """The README's rows; the calling test fails (never skips) with the reason when it is
    missing (called in the test, not a fixture: a FAIL, not a setup ERROR)."""
    got = _rows_or_error()
    if isinstance(got, str):
        pytest.fail(f"llama-server's README is needed: {got}")
    return got


def value_of(row: Row) -> list[str]:
    """A well-formed value for the row's flag, as argv words."""
    name = next((f for f in row.flags if f.startswith("--")), row.flags[0])
    if name in BY_FLAG:
        return [BY_FLAG[name]]
    if row.metavar in SAMPLES:
        two = row.metavar == "START END"
        return SAMPLES[row.metavar].split(" ") if two else [SAMPLES[row.metavar]]
    if row.metavar in NUMERIC:
        return [SAMPLE_NUMBER]
    if row.metavar in TEXT:
        return ["/tmp/llama-flag-test"]
    if row.metavar.startswith("{"):
        return [row.metavar.strip("{}").split(",")[-1]]
    raise AssertionError(f"no sample value for {row.flags} {row.metavar!r}: add one to the test")


def test_readme_table_is_read():
    rows = readme_rows_or_fail()
    assert len(rows) > 200, len(rows)
    names = {f for r in rows for f in r.flags}
    assert {"--temp", "--no-jinja", "-cb", "-nocb", "--no-webui", "--keep", "-hf"} <= names


def test_every_flag_and_alias_parses():
    rows = readme_rows_or_fail()
    failures = []
    for row in rows:
        if set(row.flags) & EXITS:
            continue
        argv_value = value_of(row) if row.metavar else []
        for flag in row.flags:
            # a pair's negation takes no value; a valued flag takes one under every alias
            try:
                parse_settings([flag, *argv_value], env={})
            except SystemExit as e:
                failures.append(f"{flag} {' '.join(argv_value)} -> exit {e.code}")
    assert failures == []


def test_print_and_exit_flags(capsys):
    rows = readme_rows_or_fail()
    exits = [f for r in rows for f in r.flags if f in EXITS]
    assert sorted(exits) == sorted(EXITS)
    for flag in exits:
        with pytest.raises(SystemExit) as e:
            parse_settings([flag], env={})
        assert e.value.code == 0, flag
        assert capsys.readouterr().out.strip(), flag


def _entry_env(flag: str) -> str | None:
    for o in OPTIONS:
        if flag in o.flags or flag in o.neg:
            return o.env
    for c in COMPAT:
        if flag in c.flags or flag in c.neg:
            return c.env
    return None


def test_readme_environment_variables_are_ours_and_honoured():
    rows = readme_rows_or_fail()
    default = parse_settings([], env={})
    failures = []
    for row in (r for r in rows if r.env):
        if _entry_env(row.flags[0]) != row.env:
            failures.append(f"{row.flags[0]}: env {_entry_env(row.flags[0])} != {row.env}")
            continue
        words = value_of(row) if row.metavar else []
        env_text = " ".join(words) if words else "true"
        by_env = parse_settings([], env={row.env: env_text})
        by_flag = parse_settings([row.flags[0], *words], env={})
        if by_env != by_flag:
            failures.append(f"{row.env}={env_text!r} is not {row.flags[0]} {' '.join(words)}")
        off = parse_settings([], env={row.env: "false"}) if row.pair else default
        if row.pair and off != parse_settings([row.flags[-1]], env={}):
            failures.append(f"{row.env}=false is not {row.flags[-1]}")
        if by_flag == default and off == default:  # the variable changed nothing
            failures.append(f"{row.env} is not honoured")
    assert failures == []


def test_tables_do_not_overlap_and_help_lists_everything():
    rows = readme_rows_or_fail()
    ours = [f for o in OPTIONS for f in (*o.flags, *o.neg)]
    compat = [f for c in COMPAT for f in (*c.flags, *c.neg)]
    assert len(set(ours + compat)) == len(ours) + len(compat)
    help_text = build_parser().format_help()
    missing = [
        f for r in rows for f in r.flags if not re.search(rf"(^|\s){re.escape(f)}\b", help_text)
    ]
    assert missing == []
    assert "accepted and ignored" in help_text
    r = subprocess.run(
        [sys.executable, "-m", "server", "--help"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and "--no-webui" in r.stdout and "--temp" in r.stdout


@pytest.mark.parametrize(
    "argv, env, named",
    [
        (["--temp", "warm"], {}, "--temp"),
        (["--top-k", "1.5"], {}, "--top-k"),
        (["--top-p", "1.5"], {}, "--top-p"),
        (["-ngl", "many"], {}, "-ngl"),
        (["-ctk", "q3"], {}, "-ctk"),
        (["--fit", "maybe"], {}, "--fit"),
        (["-ts", "3,x"], {}, "-ts"),
        (["-C", "xyz"], {}, "-C"),
        (["-Cr", "5-1"], {}, "-Cr"),
        (["--poll", "101"], {}, "--poll"),
        (["--chat-template-kwargs", "[1]"], {}, "--chat-template-kwargs"),
        (["--spec-type", "magic"], {}, "--spec-type"),
        (["--override-kv", "nope"], {}, "--override-kv"),
        (["--control-vector-layer-range", "1"], {}, "--control-vector-layer-range"),
        (["-l", "15043"], {}, "-l"),
        (["--cache-isolation", "user"], {}, "--cache-isolation"),
        (["--mirostat"], {}, "--mirostat"),
        (["--tmp", "0.5"], {}, "--tmp"),  # no abbreviations, no typos
        ([], {"LLAMA_ARG_CACHE_TYPE_K": "q3"}, "LLAMA_ARG_CACHE_TYPE_K"),
        ([], {"LLAMA_ARG_TOP_K": "x"}, "LLAMA_ARG_TOP_K"),
        ([], {"LLAMA_ARG_UI": "maybe"}, "LLAMA_ARG_UI"),
        ([], {"LLAMA_ARG_TENSOR_SPLIT": "a,b"}, "LLAMA_ARG_TENSOR_SPLIT"),
        ([], {"LLAMA_ARG_TEMPERATURE": "-1"}, "--temp"),
    ],
)
def test_malformed_values_fail(argv, env, named, capsys):
    with pytest.raises(SystemExit) as e:
        parse_settings(argv, env=env)
    assert e.value.code == 2
    assert named in capsys.readouterr().err


def test_ignored_flags_give_one_warning_naming_them(caplog):
    argv = ["--path", "/srv/ui", "--yarn-orig-ctx", "5", "-hf", "a/b", "--rope-scale", "2"]
    # These match what this server does anyway: accepted silently.
    argv += ["--no-mmproj", "-cb", "--no-context-shift", "--offline", "--log-colors", "off"]
    argv += ["--mirostat-lr", "0.10", "--no-webui-mcp-proxy", "--threads-http", "8"]
    s = parse_settings([*argv, "--temp", "0.5"], env={"LLAMA_ARG_REPACK": "0"})
    assert set(ignored_flags(s)) == {
        "--repack",
        "--path",
        "--yarn-orig-ctx",
        "--hf-repo",
        "--rope-scale",
    }
    with caplog.at_level(logging.WARNING):
        msg = warn_ignored(s)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].getMessage() == msg
    for name in ("--path", "--yarn-orig-ctx", "--hf-repo", "--rope-scale", "--repack"):
        assert name in msg
    for name in ("--mmproj", "--cont-batching", "--context-shift", "--offline", "--temp"):
        assert name not in msg
    caplog.clear()
    assert warn_ignored(parse_settings(["--no-webui", "-cb"], env={})) is None
    assert caplog.records == []


def test_server_starts_anyway_with_one_warning(monkeypatch, caplog):
    started = []
    app = SimpleNamespace(state=SimpleNamespace(server=SimpleNamespace(load_error="")))
    monkeypatch.setattr(cli, "create_app", lambda s: app.__dict__.update(settings=s) or app)
    monkeypatch.setattr(
        cli.DrainingServer, "run", lambda self, sockets=None: started.append(self.config)
    )
    monkeypatch.setattr(cli.signal, "signal", lambda *a: None)
    with caplog.at_level(logging.WARNING):
        cli.main(["--temp", "0.8", "--seed", "42", "--no-jinja", "--path", "ui", "--rpc", "h:1"])
    (config,) = started
    settings = config.app.settings
    assert (settings.temperature, settings.seed, settings.jinja) == (0.8, 42, False)
    assert config.host == "127.0.0.1" and config.ssl_keyfile is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "--path" in warnings[0] and "--rpc" in warnings[0]


def test_sampling_defaults_reach_requests():
    s = parse_settings(
        ["--temp", "0.3", "--top-k", "7", "--top-p", "0.5", "--min-p", "0.1", "-s", "42"]
        + ["--repeat-penalty", "1.2", "--repeat-last-n", "32", "--presence-penalty", "0.5"],
        env={"LLAMA_ARG_FREQUENCY_PENALTY": "0.25"},
    )
    backend = SimpleNamespace(n_vocab=1000)
    p = sampling_from(CompletionRequest(prompt="x", top_k=3, temperature=0.8), backend, s)
    # the request's own fields win, also when equal to llama-server's defaults
    assert (p.top_k, p.temperature) == (3, 0.8)
    assert (p.top_p, p.min_p, p.seed) == (0.5, 0.1, 42)
    assert (p.repeat_penalty, p.repeat_last_n) == (1.2, 32)
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, 0.25)
    # an explicit null is a field left out
    chat = ChatRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "top_p": None}
    )
    assert sampling_from(chat, backend, s).top_p == 0.5
    # without settings: llama-server's defaults
    p0 = sampling_from(CompletionRequest(prompt="x"), backend)
    assert (p0.temperature, p0.top_k, p0.top_p, p0.min_p) == (0.8, 40, 0.95, 0.05)
    # /props and /slots report the server defaults
    st = ServerState(settings=s, backend=SimpleNamespace(n_ctx_slot=512))
    gs = generation_settings(st)
    assert (gs["temperature"], gs["top_k"], gs["seed"]) == (0.3, 7, 42)


GEMMA_JINJA = "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}{% endfor %}"


def _pick(**kw):
    args = {"name": None, "file": None, "model_template": GEMMA_JINJA, "architecture": "gemma3"}
    return pick_template(**{**args, **kw}, bos_token="<bos>", eos_token="")


def test_no_jinja_picks_the_builtin_template(tmp_path):
    assert parse_settings(["--no-jinja"], env={}).jinja is False
    assert parse_settings([], env={"LLAMA_ARG_JINJA": "0"}).jinja is False
    assert parse_settings(["--no-jinja", "--jinja"], env={}).jinja is True  # the last one wins
    assert _pick().name == "model"
    t = _pick(jinja=False)
    assert t.name == "gemma" and t.source == BUILTIN_TEMPLATES["gemma"]
    # recognised by its markers, as llama.cpp does; else by architecture
    assert _pick(model_template="<|im_start|>{{ x }}", jinja=False).name == "chatml"
    assert _pick(model_template="{{ x }}", architecture="llama", jinja=False).name == "llama3"
    assert _pick(model_template=None, architecture="qwen2", jinja=False).name == "chatml"
    assert _pick(name="llama3", jinja=False).name == "llama3"
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[INST] {{ m.content }}{% endfor %}")
    assert _pick(file=str(f), jinja=False).name == "mistral"
    with pytest.raises(ValueError):
        _pick(name="{{ messages }}", jinja=False)


def test_other_implemented_flags():
    s = parse_settings(
        ["--keep", "128", "--props", "-np", "-1", "-ngl", "auto", "--log-disable", "-lv", "4"]
        + ["--cache-isolation", "salt", "--allowed-hosts", "a.example,b.example"],
        env={},
    )
    assert (s.keep, s.props, s.parallel, s.n_gpu_layers) == (128, True, 4, -1)
    assert (s.log_disable, s.log_verbosity) == (True, 4)
    assert (s.cache_isolation, s.allowed_hosts) == ("salt", "a.example,b.example")
    env = {
        "LLAMA_ARG_CACHE_ISOLATION": "key",
        "LLAMA_ARG_ALLOWED_HOSTS": "h",
        "LLAMA_ARG_KEEP": "-1",
    }
    s = parse_settings([], env=env)
    assert (s.cache_isolation, s.allowed_hosts, s.keep) == ("key", "h", -1)
    d = Settings()
    assert (d.cache_isolation, d.allowed_hosts, d.keep, d.props, d.jinja) == (
        "none",
        None,
        0,
        False,
        True,
    )
    assert parse_settings(["-ngl", "12"], env={}).n_gpu_layers == 12


def test_post_props_needs_the_flag():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from server.protocols import native
    from server.schemas import errors

    for argv, status in (([], 501), (["--props"], 200)):
        app = FastAPI()
        errors.install(app)
        app.include_router(native.router)
        app.state.server = ServerState(settings=parse_settings(argv, env={}))
        r = TestClient(app).post("/props", json={})
        assert r.status_code == status, r.text
        if status == 501:
            assert r.json()["error"]["type"] == "not_supported_error"
            assert "--props" in r.json()["error"]["message"]
        else:
            assert r.json() == {"success": True}


def test_spm_infill_reaches_the_settings_and_is_not_ignored():
    s = parse_settings(["--spm-infill"], env={})
    assert s.spm_infill and not parse_settings([], env={}).spm_infill
    assert "--spm-infill" not in ignored_flags(s)


def test_underscores_in_long_flags_are_dashes_as_in_llama_server():
    s = parse_settings(["--backend_sampling", "--ctx_size", "1024", "--alias=a_b"], env={})
    assert s.backend_sampling and s.ctx_size == 1024 and s.alias == "a_b"


def test_flags_once_ignored_now_set_settings():
    """--api-prefix, --reuse-port, --sse-ping-interval and --kv-unified-per-slot were accepted
    and ignored; now each is a setting (and no longer in the ignored warning)."""
    argv = ["--api-prefix", "/llm/", "--reuse-port", "--sse-ping-interval", "5"]
    s = parse_settings([*argv, "--kv-unified-per-slot", "1000", "-np", "3"], env={})
    assert (s.api_prefix, s.reuse_port, s.sse_ping_interval) == ("/llm", True, 5.0)
    assert (s.kv_unified_per_slot, s.ctx_size) == (1000, 3000)  # no -c: pool = np * N
    assert ignored_flags(s) == []
    d = Settings()
    assert (d.api_prefix, d.reuse_port, d.sse_ping_interval, d.kv_unified_per_slot) == (
        "",
        False,
        30.0,  # llama-server's default
        0,
    )
    # -c given (even 0, the training context) keeps the pool, as llama-server does
    for ctx in ("0", "4096"):
        s = parse_settings(["--kv-unified-per-slot", "1000", "-c", ctx], env={})
        assert s.ctx_size == int(ctx)
    env = {"LLAMA_ARG_KV_UNIFIED_PER_SLOT": "256", "LLAMA_ARG_API_PREFIX": "/a/b"}
    s = parse_settings([], env=env)
    assert (s.ctx_size, s.api_prefix) == (4 * 256, "/a/b")


@pytest.mark.parametrize("prefix", ["llm", "/a/../b", "/a//b", "/a%2fb", "/a?b"])
def test_a_malformed_api_prefix_fails(prefix, capsys):
    with pytest.raises(SystemExit) as e:
        parse_settings(["--api-prefix", prefix], env={})
    assert e.value.code == 2
    assert "--api-prefix" in capsys.readouterr().err
