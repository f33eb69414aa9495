#!/usr/bin/env bash
# Idempotent setup: virtual environment, llama-cpp-python from a cached wheel (built once
# with the right CMake flags), the project and its dependencies, the default model.
#
#   scripts/bootstrap.sh [--dev]        (--dev adds the test tools)
#
# Environment:
#   VENV=.venv                    where the virtual environment lives
#   LLAMA_GPU=cuda                build llama-cpp-python with GGML_CUDA=on instead of the CPU build
#   LLAMA_WHEEL_CACHE=DIR         wheel cache (default ~/.cache/llama-slot-server/wheels)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
DEV=0
[[ "${1:-}" == "--dev" ]] && DEV=1

LLAMA_VERSION="$(sed -n 's/^llama-cpp-python==\(.*\)$/\1/p' requirements.txt)"
CACHE="${LLAMA_WHEEL_CACHE:-$HOME/.cache/llama-slot-server/wheels}"

if [[ "${LLAMA_GPU:-}" == "cuda" ]]; then
  VARIANT="cuda"
  CMAKE_ARGS_BUILD="-DGGML_CUDA=on"
else
  # ggml's AMX kernels crash on Q4_K models (first llama_decode segfaults in
  # ggml_backend_amx_mul_mat), so the native CPU build keeps AMX instructions out.
  VARIANT="cpu-$( (grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || uname -m) | md5sum | cut -c1-12)"
  NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  CMAKE_ARGS_BUILD="-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$NOAMX' -DCMAKE_CXX_FLAGS='$NOAMX'"
fi
WHEEL_DIR="$CACHE/$LLAMA_VERSION/$VARIANT"

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[bootstrap] creating virtual environment in $VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip wheel setuptools
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)

# Reinstall when the version or the build variant (CPU / CUDA) differs from what is installed.
if [[ "$(cat "$VENV/.llama-variant" 2>/dev/null)" != "$LLAMA_VERSION/$VARIANT" ]] || \
   ! "$VENV/bin/python" -c "import importlib.metadata as m,sys; sys.exit(m.version('llama_cpp_python')!='$LLAMA_VERSION')" 2>/dev/null; then
  if ! ls "$WHEEL_DIR"/llama_cpp_python-"$LLAMA_VERSION"-*.whl >/dev/null 2>&1; then
    echo "[bootstrap] building llama-cpp-python $LLAMA_VERSION ($VARIANT); takes ~4 minutes once, then cached in $WHEEL_DIR"
    mkdir -p "$WHEEL_DIR"
    TMP_DIR="$(mktemp -d)"
    CMAKE_ARGS="$CMAKE_ARGS_BUILD" "$VENV/bin/python" -m pip wheel --no-deps --no-binary llama-cpp-python \
      -w "$TMP_DIR" "llama-cpp-python==$LLAMA_VERSION"
    mv "$TMP_DIR"/llama_cpp_python-*.whl "$WHEEL_DIR"/
    rm -rf "$TMP_DIR"
  fi
  "${PIP[@]}" --force-reinstall --no-deps "$WHEEL_DIR"/llama_cpp_python-"$LLAMA_VERSION"-*.whl
  "${PIP[@]}" "$WHEEL_DIR"/llama_cpp_python-"$LLAMA_VERSION"-*.whl
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
