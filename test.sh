#!/usr/bin/env bash
# Run the whole test suite (sets itself up like serve.sh). Extra args go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")" && pwd)"
"$ROOT/scripts/bootstrap.sh" --dev
"$ROOT/scripts/system-deps.sh"
# llama.cpp's own llama-server, built once from the same vendored llama.cpp (cached under
# ~/.cache): the slot-file interchange test runs against it.
PYTHON="${VENV:-$ROOT/.venv}/bin/python" "$ROOT/bench/build_llama_server.sh" >/dev/null
cd "$ROOT"
PY="${VENV:-$ROOT/.venv}/bin/python"
"$PY" -m ruff check server tests bench
"$PY" -m ruff format --check server tests bench
exec "$PY" -m pytest "$@"
