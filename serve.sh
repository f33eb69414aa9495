#!/usr/bin/env bash
# Quick start: set everything up (first run builds llama-cpp-python, ~4 min) and serve a chat
# model on 127.0.0.1:8080. Any llama-server-style flag may follow.
#
# The model: SmolLM2-135M-Instruct (an instruct model with its own chat template: a first
# chat on the page ends by itself), unless a flag or LLAMA_ARG_* variable names a model
# source (-m, --models-dir, --models-preset, -hf, -mu, ...). `python -m server` alone serves
# the embedded Gemma 3 270M instead, a base model (the tests and benchmarks use it).
#
# SERVE_DRY_RUN=1: print the server's command line and exit (sets nothing up).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")" && pwd)"
PY="${VENV:-$ROOT/.venv}/bin/python"
[[ -n "${SERVE_DRY_RUN:-}" ]] || "$ROOT/scripts/bootstrap.sh"
# server.cli.models prints the arguments that choose SmolLM2, one per line (none when the
# user chose a model)
mapfile -t MODEL < <(cd "$ROOT" && "$PY" -m server.cli.models "$@")
CMD=("$PY" -m server "${MODEL[@]}" "$@")
if [[ -n "${SERVE_DRY_RUN:-}" ]]; then
  printf '%q ' "${CMD[@]}"
  echo
  exit 0
fi
exec "${CMD[@]}"
