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
# The system packages (apt: network and disk) install while llama.cpp compiles (CPU): started
# first, in the background, and waited for after the setup.
sysdeps_log="$(mktemp)"
"$ROOT/scripts/system-deps.sh" >"$sysdeps_log" 2>&1 &
sysdeps_pid=$!
trap 'rm -f "$sysdeps_log"' EXIT # an apt run is never killed midway: it finishes on its own
wait_sysdeps() {
  local rc=0
  wait "$sysdeps_pid" || rc=$?
  cat "$sysdeps_log"
  return $rc
}
step "setup (venv, llama.cpp build, dependencies)" "$ROOT/scripts/bootstrap.sh" --dev
step "system packages (installed during the setup)" wait_sysdeps
step "llama-server (same build)" bash -c "PYTHON='$PY' '$ROOT/scripts/build_llama.sh' --server >/dev/null"
cd "$ROOT"
step "smoke (model loads, one decode; llama-server runs)" "$PY" scripts/smoke.py
step "lint" "$PY" -m ruff check server tests bench scripts/smoke.py
step "format" "$PY" -m ruff format --check server tests bench scripts/smoke.py
# the chat page's shipped files (server/webui/static) equal a fresh build of webui/ (npm ci
# at the locked versions, then esbuild); fails, never skips, without node and npm
step "web page (shipped = fresh build)" "$ROOT/webui/build.sh" --check
# mypy over server/ and the fake backend (pyproject.toml [tool.mypy]; ~10 s cold, <1 s
# warm from .mypy_cache)
step "types" "$PY" -m mypy
# The suite: with no arguments (or only -q), in two phases. First every test but the
# ``serial`` ones on two workers (pytest-xdist, a file per worker at a time, one thread per
# server, so the two cores are both busy while a server starts or a client waits); then the
# ``serial`` ones (latencies, stalls, races) alone. Any other arguments: one plain pytest run.
# --no-loadscope-reorder: files go out slowest first (tests/conftest.py SLOWEST_FIRST), not
# in xdist's order (most tests first), which left the long few-test files for the end.
run_tests() {
  local s rc=0
  s=$(date +%s)
  echo "[test.sh] tests: $1 ..."
  shift
  "$@" || rc=$?
  echo "[test.sh] tests: $(($(date +%s) - s)) s (exit $rc)"
  return $rc
}
rc=0
if [[ $# -eq 0 || "$*" == "-q" ]]; then
  E2E_THREADS=1 run_tests "all but serial, 2 workers" "$PY" -m pytest "$@" -m "not serial" \
    -n 2 --dist loadfile --no-loadscope-reorder -p no:cacheprovider || rc=$?
  run_tests "serial" "$PY" -m pytest "$@" -m serial -p no:cacheprovider || rc=$?
else
  run_tests "pytest $*" "$PY" -m pytest "$@" || rc=$?
fi
echo "[test.sh] total $(($(date +%s) - t0)) s (exit $rc)"
exit $rc
