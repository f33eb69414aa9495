#!/usr/bin/env bash
# Run the whole test suite (sets itself up like serve.sh). Extra args go to pytest.
# Each step prints its time; a failed build or smoke check stops before the long test run.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")" && pwd)"
PY="${VENV:-$ROOT/.venv}/bin/python"
t0=$(date +%s)
step() {
  local name="$1" s
  shift
  s=$(date +%s)
  echo "[test.sh] $name ..."
  "$@" || { echo "[test.sh] FAILED: $name (after $(($(date +%s) - s)) s)" >&2; exit 1; }
  echo "[test.sh] $name: $(($(date +%s) - s)) s"
}
# The venv, llama.cpp built once (the wheel's libraries and llama-server from one CMake
# build, cached under ~/.cache/llama-slot-server), the dependencies and the model.
step "setup (venv, llama.cpp build, dependencies)" "$ROOT/scripts/bootstrap.sh" --dev
step "system packages" "$ROOT/scripts/system-deps.sh"
step "llama-server (same build)" bash -c "PYTHON='$PY' '$ROOT/scripts/build_llama.sh' --server >/dev/null"
cd "$ROOT"
step "smoke (model loads, one decode; llama-server runs)" "$PY" scripts/smoke.py
step "lint" "$PY" -m ruff check server tests bench scripts/smoke.py
step "format" "$PY" -m ruff format --check server tests bench scripts/smoke.py
s=$(date +%s)
echo "[test.sh] tests ..."
rc=0
"$PY" -m pytest "$@" || rc=$?
echo "[test.sh] tests: $(($(date +%s) - s)) s (exit $rc); total $(($(date +%s) - t0)) s"
exit $rc
