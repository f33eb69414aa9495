#!/usr/bin/env bash
# Run the whole test suite (sets itself up like serve.sh). Extra args go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")" && pwd)"
"$ROOT/scripts/bootstrap.sh" --dev
"$ROOT/scripts/system-deps.sh"
cd "$ROOT"
PY="${VENV:-$ROOT/.venv}/bin/python"
"$PY" -m ruff check server tests bench
"$PY" -m ruff format --check server tests bench
exec "$PY" -m pytest "$@"
