"""Router mode's model list: ``--models-dir`` files, ``--models-preset`` INI sections, and
the command line's flags, merged into one argument set per model (pure: no processes).

An argument set (``Args``) maps a flag's ``Settings`` destination (``ctx_size``,
``compat:--lora``) to its text; a switch or ``--x/--no-x`` pair holds ``"true"`` or
``"false"``. ``to_argv`` writes one back as a command line. Precedence, lowest first:
the model's file (``--models-dir``), the preset's ``[*]`` section, the model's own section,
the router's command line (as llama-server)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..settings.config import build_parser
from ..settings.flags import COMPAT, OPTIONS

Args = dict[str, str]

# Flags the router owns: never handed to an instance (it sets host, port and key itself, and
# applies the HTTP rules once, at the front).
ROUTER_ONLY = frozenset(
    {
        "host",
        "port",
        "api_key",
        "api_key_file",
        "allowed_hosts",
        "cors_origins",
        "cors_methods",
        "cors_headers",
        "cors_credentials",
        "ssl_key_file",
        "ssl_cert_file",
        "log_file",
        "models_dir",
        "models_preset",
        "models_max",
        "models_autoload",
        "alias",
        "api_prefix",
        "reuse_port",
    }
)
# Preset-only keys (not flags): llama-server's names.
PRESET_KEYS = ("load-on-startup", "stop-timeout", "dedup-cache-models")
TRUE = frozenset({"1", "true", "yes", "on", "enabled"})
FALSE = frozenset({"0", "false", "no", "off", "disabled"})
STOP_TIMEOUT_S = 10.0
NO_MMPROJ = "compat:--mmproj-auto"  # "false": --no-mmproj (llama-server loads no projector)


class PresetError(ValueError):
    """A preset file that cannot be used: names the file, the section and the key."""


@dataclass(frozen=True)
class Flag:
    """How one spelling of a flag sets its destination: ``value`` is the fixed text of a
    switch spelling (``"true"``/``"false"``), None for a flag that takes ``nargs`` values."""

    dest: str
    value: str | None
    nargs: int


@dataclass(frozen=True)
class FlagTable:
    """Every spelling (``-c``, ``--ctx-size``, ``LLAMA_ARG_CTX_SIZE``) and, per destination,
    the spellings ``to_argv`` writes: (positive, negative or "")."""

    by_name: dict[str, Flag]
    by_env: dict[str, str]
    written: dict[str, tuple[str, str]]


def flag_table(parser: argparse.ArgumentParser | None = None) -> FlagTable:
    """The table of ``server.cli``'s parser (every implemented and accepted flag)."""
    parser = parser or build_parser()
    by_name: dict[str, Flag] = {}
    written: dict[str, tuple[str, str]] = {}
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", argparse.SUPPRESS):
            continue
        longest = next((o for o in action.option_strings if o.startswith("--")), None)
        spelled = longest or action.option_strings[0]
        if isinstance(action, argparse._StoreConstAction):
            value = "true" if action.const is True else "false"
            pos, neg = written.get(action.dest, ("", ""))
            written[action.dest] = (spelled, neg) if value == "true" else (pos, spelled)
            flag = Flag(action.dest, value, 0)
        else:
            nargs = action.nargs if isinstance(action.nargs, int) else 1
            written.setdefault(action.dest, (spelled, ""))
            flag = Flag(action.dest, None, nargs)
        for o in action.option_strings:
            by_name[o] = flag
    by_env = {o.env: o.dest for o in OPTIONS if o.env}
    by_env.update({c.env: f"compat:{c.name}" for c in COMPAT if c.env})
    return FlagTable(by_name, by_env, written)


def parse_argv(argv: Iterable[str], table: FlagTable) -> Args:
    """The flags given on a command line (already checked by ``parse_settings``), as text.
    Print-and-exit flags and unknown words are skipped."""
    out: Args = {}
    words = list(argv)
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        name, eq, inline = word.partition("=") if word.startswith("--") else (word, "", "")
        if name.startswith("--"):
            name = name.replace("_", "-")
        flag = table.by_name.get(name)
        if flag is None:
            continue
        if flag.value is not None:
            out[flag.dest] = flag.value
        elif eq:
            out[flag.dest] = inline
        else:
            out[flag.dest] = " ".join(words[i : i + flag.nargs])
            i += flag.nargs
    return out


def to_argv(args: Args, table: FlagTable) -> list[str]:
    """``args`` as command-line words, in a stable order (by destination)."""
    out: list[str] = []
    for dest in sorted(args):
        pos, neg = table.written[dest]
        value = args[dest]
        if table.by_name[pos or neg].value is not None:
            spelled = pos if value == "true" else neg
            if spelled:
                out.append(spelled)
            continue
        out.append(pos)
        out.extend(value.split(" ") if table.by_name[pos].nargs > 1 else [value])
    return out


def _truth(text: str, where: str) -> bool:
    v = text.strip().lower()
    if v in TRUE:
        return True
    if v in FALSE:
        return False
    raise PresetError(f"{where}: expected a boolean, got {text!r}")


def preset_entry(key: str, value: str, table: FlagTable, where: str) -> tuple[str, str]:
    """One INI line as (destination, text): ``key`` is a flag name without its dashes
    (``n-gpu-layers``, ``c``), with them, or a ``LLAMA_ARG_*`` variable."""
    if key in table.by_env:
        dest = table.by_env[key]
        pos, neg = table.written[dest]
        if table.by_name[pos or neg].value is not None:
            return dest, "true" if _truth(value, where) else "false"
        return dest, value
    bare = key.lstrip("-")
    flag = table.by_name.get(f"--{bare}") or table.by_name.get(f"-{bare}")
    if flag is None:
        raise PresetError(f"{where}: unknown key {key!r}")
    if flag.value is None:
        return flag.dest, value
    on = _truth(value, where)
    return flag.dest, flag.value if on else ("false" if flag.value == "true" else "true")


def read_ini(text: str, path: str = "<preset>") -> dict[str, dict[str, str]]:
    """llama-server's INI: ``[section]`` headers, ``key = value`` lines, ``;``/``#`` comments.
    Keys before the first section (``version = 1``) go to the section ``""``."""
    sections: dict[str, dict[str, str]] = {"": {}}
    current = ""
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in ";#":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1].strip()
            sections.setdefault(current, {})
            continue
        key, eq, value = line.partition("=")
        if not eq or not key.strip():
            raise PresetError(f"{path}:{n}: expected 'key = value' or '[section]', got {raw!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        sections[current][key.strip()] = value
    return sections


@dataclass(frozen=True)
class ModelSpec:
    """One model the router serves: its name, its merged arguments (``model`` holds the
    GGUF path; empty when the preset named none), and the preset-only options."""

    name: str
    args: Args
    source: str  # "dir" or "preset"
    load_on_startup: bool = False
    stop_timeout: float = STOP_TIMEOUT_S
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return self.args.get("model", "")


def is_projector(name: str) -> bool:
    """A projector file, never a model (llama-server's rule: "mmproj" in the name)."""
    return "mmproj" in name


def scan_models_dir(path: str) -> dict[str, Args]:
    """``--models-dir``: each ``.gguf`` file by its stem; each subfolder holding ``.gguf``
    files by its name (its first shard, else its first model file in name order), with the
    subfolder's projector as ``--mmproj`` (the last ``*mmproj*.gguf`` in name order), as
    llama-server pairs them. Projectors at the top level belong to no model."""
    out: dict[str, Args] = {}
    for entry in sorted(os.listdir(path)):
        full = os.path.join(path, entry)
        if os.path.isfile(full) and entry.endswith(".gguf") and not is_projector(entry):
            out[entry[: -len(".gguf")]] = {"model": full}
        elif os.path.isdir(full):
            ggufs = sorted(f for f in os.listdir(full) if f.endswith(".gguf"))
            main = [f for f in ggufs if not is_projector(f)]
            shards = [f for f in main if "-00001-of-" in f]
            mmproj = [f for f in ggufs if is_projector(f)]
            if main:
                out[entry] = {"model": os.path.join(full, (shards or main)[0])}
                if mmproj:
                    out[entry]["mmproj"] = os.path.join(full, mmproj[-1])
    return out


def _section(items: dict[str, str], table: FlagTable, where: str) -> tuple[Args, dict[str, str]]:
    """A section's flags and its preset-only keys."""
    args: Args = {}
    extra: dict[str, str] = {}
    for key, value in items.items():
        if key in PRESET_KEYS:
            extra[key] = value
            continue
        dest, text = preset_entry(key, value, table, f"{where} {key}")
        args[dest] = text
    return args, extra


def build_specs(
    cli: Args,
    table: FlagTable,
    models_dir: str | None = None,
    preset_text: str | None = None,
    preset_path: str = "<preset>",
) -> dict[str, ModelSpec]:
    """Every model of the sources, each with its merged arguments (see the module doc);
    the router's own flags (``ROUTER_ONLY``) are left out. PresetError on a bad preset."""
    files = scan_models_dir(models_dir) if models_dir else {}
    sections = read_ini(preset_text, preset_path) if preset_text is not None else {"": {}}
    star, star_extra = _section(sections.get("*", {}), table, f"{preset_path} [*]")
    names = list(files) + [n for n in sections if n not in ("", "*") and n not in files]
    own_cli = {k: v for k, v in cli.items() if k not in ROUTER_ONLY}
    specs: dict[str, ModelSpec] = {}
    for name in names:
        own, own_extra = _section(sections.get(name, {}), table, f"{preset_path} [{name}]")
        args = {**files.get(name, {}), **star, **own, **own_cli}
        if args.get(NO_MMPROJ) == "false":  # --no-mmproj: no projector, paired or named
            args.pop("mmproj", None)
        extra = {**star_extra, **own_extra}
        specs[name] = ModelSpec(
            name=name,
            args={k: v for k, v in args.items() if k not in ROUTER_ONLY},
            source="dir" if name in files else "preset",
            load_on_startup=_truth(extra.get("load-on-startup", "false"), name),
            stop_timeout=float(extra.get("stop-timeout", STOP_TIMEOUT_S)),
            extra=extra,
        )
    return specs
