#!/usr/bin/env bash
# llama.cpp's own `llama-server`, from the same one build of the vendored llama.cpp that
# llama-cpp-python's libraries come from (scripts/build_llama.sh); prints its path.
set -euo pipefail
exec "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/scripts/build_llama.sh" --server
