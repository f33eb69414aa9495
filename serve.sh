#!/usr/bin/env bash
# Quick start: set everything up (first run builds llama-cpp-python, ~4 min) and serve
# the default model on 127.0.0.1:8080. Any llama-server-style flag may follow.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")" && pwd)"
"$ROOT/scripts/bootstrap.sh"
exec "${VENV:-$ROOT/.venv}/bin/python" -m server "$@"
