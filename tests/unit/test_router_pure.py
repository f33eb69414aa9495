"""Router mode's pure parts: flag round trips, preset parsing and precedence, the models
directory, the choice of the instance to stop, the sleep gate's notion of a task."""

from __future__ import annotations

import asyncio

import pytest

from server.http.model_sleep import SleepController, is_task
from server.router.instances import (
    LOADED,
    LOADING,
    SLEEPING,
    UNLOADED,
    Instance,
    has_room,
    pick_victim,
)
from server.router.mmproj import Caps, input_modalities, projector_caps
from server.router.presets import (
    ModelSpec,
    PresetError,
    build_specs,
    flag_table,
    parse_argv,
    preset_entry,
    read_ini,
    scan_models_dir,
    to_argv,
)
from tests.mmproj_gen import write_gemma3_mmproj

T = flag_table()


def test_argv_round_trip_keeps_values_and_switches():
    argv = ["-c", "1024", "--no-jinja", "--metrics", "--ctx_size=2048", "-ngl", "all"]
    args = parse_argv(argv, T)
    assert args == {"ctx_size": "2048", "jinja": "false", "metrics": "true", "n_gpu_layers": "all"}
    assert parse_argv(to_argv(args, T), T) == args


def test_preset_keys_by_name_short_name_and_variable():
    assert preset_entry("ctx-size", "4096", T, "x") == ("ctx_size", "4096")
    assert preset_entry("c", "4096", T, "x") == ("ctx_size", "4096")
    assert preset_entry("LLAMA_ARG_CTX_SIZE", "4096", T, "x") == ("ctx_size", "4096")
    assert preset_entry("jinja", "false", T, "x") == ("jinja", "false")
    assert preset_entry("no-jinja", "true", T, "x") == ("jinja", "false")
    with pytest.raises(PresetError, match="unknown key"):
        preset_entry("no-such-flag", "1", T, "x")
    with pytest.raises(PresetError, match="boolean"):
        preset_entry("metrics", "maybe", T, "x")


def test_read_ini_sections_comments_and_top_level_keys():
    text = "version = 1\n; comment\n[*]\nc = 8192\n# other\n[org/m:Q8_0]\nmodel = '/m.gguf'\n"
    assert read_ini(text) == {
        "": {"version": "1"},
        "*": {"c": "8192"},
        "org/m:Q8_0": {"model": "/m.gguf"},
    }
    with pytest.raises(PresetError):
        read_ini("[a]\nnot a pair\n")


def test_precedence_command_line_over_section_over_star(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"")
    preset = "[*]\nc = 8192\nn-predict = 5\ntemp = 0.5\n[a]\nc = 4096\ntemp = 0.1\nload-on-startup = true\n"
    cli = parse_argv(["--temp", "0.9", "--port", "9000", "--api-key", "k"], T)
    specs = build_specs(cli, T, models_dir=str(tmp_path), preset_text=preset)
    a = specs["a"]
    assert a.args["ctx_size"] == "4096"  # section over [*]
    assert a.args["n_predict"] == "5"  # [*] alone
    assert a.args["temperature"] == "0.9"  # command line over both
    assert a.path == str(tmp_path / "a.gguf")
    assert "port" not in a.args and "api_key" not in a.args  # the router's own
    assert a.load_on_startup and a.source == "dir"


def test_preset_only_model_and_stop_timeout():
    specs = build_specs({}, T, preset_text="[x]\nmodel = /x.gguf\nstop-timeout = 3\n[y]\nc = 1\n")
    assert specs["x"].path == "/x.gguf" and specs["x"].stop_timeout == 3.0
    assert specs["x"].source == "preset" and not specs["x"].load_on_startup
    assert specs["y"].path == ""  # listed; its start fails (no file)


def test_models_dir_files_folders_and_projectors(tmp_path):
    (tmp_path / "one.gguf").write_bytes(b"")
    (tmp_path / "mmproj-x.gguf").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("")
    multi = tmp_path / "big"
    multi.mkdir()
    for f in ("big-00002-of-00002.gguf", "big-00001-of-00002.gguf", "mmproj-F16.gguf"):
        (multi / f).write_bytes(b"")
    (tmp_path / "empty").mkdir()
    vl = tmp_path / "gemma-vl"  # llama-server's rule: "mmproj" anywhere in the name
    vl.mkdir()
    for f in ("gemma-3-4b-it-Q4_K_M.gguf", "gemma-3-4b-it-mmproj-f16.gguf"):
        (vl / f).write_bytes(b"")
    (tmp_path / "x-mmproj.gguf").write_bytes(b"")  # a projector alone: no model
    found = scan_models_dir(str(tmp_path))
    assert found == {
        "big": {
            "model": str(multi / "big-00001-of-00002.gguf"),
            "mmproj": str(multi / "mmproj-F16.gguf"),
        },
        "gemma-vl": {
            "model": str(vl / "gemma-3-4b-it-Q4_K_M.gguf"),
            "mmproj": str(vl / "gemma-3-4b-it-mmproj-f16.gguf"),
        },
        "one": {"model": str(tmp_path / "one.gguf")},
    }
    specs = build_specs({}, T, models_dir=str(tmp_path))
    assert to_argv(specs["gemma-vl"].args, T) == [
        "--mmproj", str(vl / "gemma-3-4b-it-mmproj-f16.gguf"),
        "--model", str(vl / "gemma-3-4b-it-Q4_K_M.gguf"),
    ]  # fmt: skip
    no = build_specs(parse_argv(["--no-mmproj"], T), T, models_dir=str(tmp_path))
    assert "mmproj" not in no["gemma-vl"].args  # llama-server's --no-mmproj


def test_projector_caps_from_the_header(tmp_path):
    mm = write_gemma3_mmproj(tmp_path / "mmproj.gguf")
    assert projector_caps(str(mm)) == Caps(vision=True, audio=False)
    assert input_modalities(str(mm)) == ["text", "image"]
    (tmp_path / "junk.gguf").write_bytes(b"GGUF\x03\0\0\0" + b"\xff" * 40)
    assert projector_caps(str(tmp_path / "junk.gguf")) == Caps()
    assert input_modalities(str(tmp_path / "none.gguf")) == ["text"]
    assert input_modalities(None) == ["text"]


def _inst(name: str, status: str, pins: int = 0, used: float = 0.0) -> Instance:
    return Instance(ModelSpec(name, {}, "dir"), status=status, pins=pins, last_used=used)


def test_victim_is_least_recently_used_idle_ready_instance():
    a, b, c = _inst("a", LOADED, used=3), _inst("b", SLEEPING, used=1), _inst("c", LOADED, used=2)
    assert pick_victim([a, b, c]) is b
    b.pins = 1  # serving (or waited for): never stopped
    assert pick_victim([a, b, c]) is c
    assert pick_victim([_inst("l", LOADING), _inst("u", UNLOADED)]) is None
    c.stopping = True
    assert pick_victim([a, c]) is a


def test_room_counts_processes_including_stopping_ones():
    insts = [_inst("a", LOADED), _inst("b", UNLOADED)]
    assert not has_room(insts, 1) and has_room(insts, 2) and has_room(insts, 0)
    insts[0].status, insts[0].stopping = UNLOADED, True
    assert not has_room(insts, 1)


def test_status_json_reports_failures():
    i = _inst("a", UNLOADED)
    i.failed, i.exit_code, i.argv = True, -9, ["python", "-m", "server"]
    assert i.status_json() == {
        "value": "unloaded",
        "args": ["python", "-m", "server"],
        "failed": True,
        "exit_code": -9,
    }


def test_read_only_endpoints_are_not_tasks():
    assert not is_task({"method": "GET", "path": "/health"})
    assert not is_task({"method": "GET", "path": "/props"})
    assert not is_task({"method": "GET", "path": "/metrics"})
    assert not is_task({"method": "OPTIONS", "path": "/completion"})
    assert is_task({"method": "POST", "path": "/props"})
    assert is_task({"method": "POST", "path": "/tokenize"})
    assert is_task({"method": "GET", "path": "/slots"})


def test_sleep_controller_sleeps_when_idle_and_one_wake_serves_many():
    calls: list[str] = []
    loaded = [True]

    def sleep(level: int) -> None:
        assert level == 2  # the idle sleep frees the RAM cache too
        calls.append("sleep")
        loaded[0] = False

    def wake() -> None:
        calls.append("wake")
        loaded[0] = True

    async def scenario() -> None:
        ctl = SleepController(0.2, lambda: loaded[0], sleep, wake)
        watcher = asyncio.create_task(ctl.run())
        await ctl.enter()
        await asyncio.sleep(0.5)
        assert calls == []  # a running task keeps it awake
        ctl.leave()
        await asyncio.sleep(0.6)
        assert calls == ["sleep"] and ctl.sleeping
        await asyncio.gather(ctl.enter(), ctl.enter(), ctl.enter())
        assert calls == ["sleep", "wake"] and not ctl.sleeping
        for _ in range(3):
            ctl.leave()
        watcher.cancel()

    asyncio.run(scenario())
