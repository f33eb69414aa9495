#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` once, from the llama.cpp vendored in the pinned
# llama-cpp-python sdist (the version in requirements.txt), so the benchmark compares both
# servers on exactly the same ggml/llama.cpp code. Cached outside the repository:
#
#   ~/.cache/llama-slot-server/llama-server-<version>/build/bin/llama-server
#
#   bench/build_llama_server.sh            build if missing, print the binary's path (last line)
#
# Environment:
#   LLAMA_SERVER_CACHE=DIR   cache root (default ~/.cache/llama-slot-server)
#   PYTHON=python3           interpreter used for `pip download` (default: .venv/bin/python)
#   JOBS=N                   parallel build jobs (default: nproc)
#
# The CPU build keeps AMX out (-mno-amx-*): ggml's AMX kernels segfault on Q4_K models on
# CPUs that have AMX, like scripts/bootstrap.sh does for llama-cpp-python.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="$(sed -n 's/^llama-cpp-python==\(.*\)$/\1/p' "$ROOT/requirements.txt")"
[[ -n "$VERSION" ]] || { echo "no llama-cpp-python pin in requirements.txt" >&2; exit 1; }

CACHE_ROOT="${LLAMA_SERVER_CACHE:-$HOME/.cache/llama-slot-server}"
DIR="$CACHE_ROOT/llama-server-$VERSION"
BUILD="$DIR/build"
BIN="$BUILD/bin/llama-server"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3
JOBS="${JOBS:-$(nproc)}"
NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"

log() { echo "[build_llama_server] $*" >&2; }

if [[ -x "$BIN" ]]; then
  echo "$BIN"
  exit 0
fi

mkdir -p "$DIR"
# One build at a time: a second caller waits on the lock, then finds the binary.
exec 9>"$DIR/.build.lock"
if ! flock -n 9; then
  log "another build holds $DIR/.build.lock; waiting for it"
  flock 9
fi
if [[ -x "$BIN" ]]; then
  echo "$BIN"
  exit 0
fi

# A build started by hand (without the lock) into the same directory: wait for its binary.
if pgrep -f -- "cmake --build $BUILD" >/dev/null 2>&1; then
  log "a cmake build of $BUILD is already running; waiting for $BIN"
  while pgrep -f -- "cmake --build $BUILD" >/dev/null 2>&1; do
    sleep 10
  done
  if [[ -x "$BIN" ]]; then
    echo "$BIN"
    exit 0
  fi
  log "that build finished without a binary; building here"
fi

SRC_PARENT="$DIR/src"
SRC="$SRC_PARENT/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
  log "downloading the llama-cpp-python $VERSION sdist"
  TMP="$(mktemp -d)"
  trap 'rm -rf "$TMP"' EXIT
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
    -d "$TMP" "llama-cpp-python==$VERSION"
  mkdir -p "$SRC_PARENT"
  tar -xzf "$TMP"/llama_cpp_python-"$VERSION".tar.gz -C "$SRC_PARENT"
fi
[[ -f "$SRC/CMakeLists.txt" ]] || { echo "no vendored llama.cpp in $SRC" >&2; exit 1; }

# A build directory configured from another source tree (e.g. an earlier, interrupted
# build from /tmp) cannot be reused: CMake refuses a different source directory.
if [[ -f "$BUILD/CMakeCache.txt" ]] &&
  ! grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$SRC" "$BUILD/CMakeCache.txt"; then
  log "removing $BUILD (configured from another source tree)"
  rm -rf "$BUILD"
fi

log "configuring llama-server $VERSION (GGML_NATIVE, AMX off) in $BUILD"
cmake -S "$SRC" -B "$BUILD" \
  -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DCMAKE_C_FLAGS="$NOAMX" -DCMAKE_CXX_FLAGS="$NOAMX" >&2
log "building llama-server with $JOBS jobs (several minutes, once)"
cmake --build "$BUILD" --target llama-server -j"$JOBS" >&2
[[ -x "$BIN" ]] || { echo "build finished but $BIN is missing" >&2; exit 1; }
echo "$BIN"
