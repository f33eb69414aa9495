#!/usr/bin/env bash
# Build llama.cpp once, from the llama.cpp vendored in the pinned llama-cpp-python sdist, for
# both of its users: the shared libraries that llama-cpp-python loads (libllama, libggml*,
# libmtmd) and llama.cpp's own `llama-server` (the benchmarks and the interchange tests run it
# on exactly the same ggml/llama code). One CMake build, only the targets needed; the Python
# wheel is then the sdist's Python code with those libraries in `llama_cpp/lib/` (its own CMake
# build switched off), so nothing is compiled twice. Cached outside the repository:
#
#   ~/.cache/llama-slot-server/llama-server-<version>/src/     the unpacked sdist
#   ~/.cache/llama-slot-server/llama-server-<version>/build/   the CPU build (bin/llama-server, lib*.so)
#   ~/.cache/llama-slot-server/llama-server-<version>/build-cuda/   LLAMA_GPU=cuda
#   ~/.cache/llama-slot-server/wheels/<version>/<variant>/     the wheel
#
#   scripts/build_llama.sh         build what is missing; print the wheel's path (last line)
#   scripts/build_llama.sh --server   ... and print llama-server's path instead
#
# Environment:
#   LLAMA_GPU=cuda           GGML_CUDA=on (else the native CPU build, AMX kept out)
#   LLAMA_SERVER_CACHE=DIR   cache root (default ~/.cache/llama-slot-server)
#   LLAMA_WHEEL_CACHE=DIR    wheel cache (default <cache root>/wheels)
#   PYTHON=python3           interpreter for pip download / pip wheel
#   JOBS=N                   parallel build jobs (default: nproc)
#
# ggml's AMX kernels segfault on Q4_K models (first llama_decode, ggml_backend_amx_mul_mat), so
# the native CPU build passes -mno-amx-*. Each step prints its time on stderr.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="$(sed -n 's/^llama-cpp-python==\(.*\)$/\1/p' "$ROOT/requirements.txt")"
[[ -n "$VERSION" ]] || { echo "no llama-cpp-python pin in requirements.txt" >&2; exit 1; }
PRINT=wheel
[[ "${1:-}" == "--server" ]] && PRINT=server

CACHE_ROOT="${LLAMA_SERVER_CACHE:-$HOME/.cache/llama-slot-server}"
DIR="$CACHE_ROOT/llama-server-$VERSION"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3
JOBS="${JOBS:-$(nproc)}"

if [[ "${LLAMA_GPU:-}" == "cuda" ]]; then
  VARIANT="cuda"
  BUILD="$DIR/build-cuda"
  ARCH_ARGS=(-DGGML_CUDA=ON)
  [[ -n "${CMAKE_CUDA_ARCHITECTURES:-}" ]] && ARCH_ARGS+=("-DCMAKE_CUDA_ARCHITECTURES=$CMAKE_CUDA_ARCHITECTURES")
else
  # The variant names the CPU's flags: a cache carried to another CPU rebuilds.
  VARIANT="cpu-$( (grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || uname -m) | md5sum | cut -c1-12)"
  BUILD="$DIR/build"
  NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  ARCH_ARGS=(-DGGML_NATIVE=ON "-DCMAKE_C_FLAGS=$NOAMX" "-DCMAKE_CXX_FLAGS=$NOAMX")
fi
# Shared libraries with $ORIGIN run paths: llama-server finds them beside it in bin/, and
# llama-cpp-python finds them beside each other in llama_cpp/lib/. Unversioned SONAMEs, so the
# one file of each name is both what Python loads and what the others link to. No UI download
# (offline).
CMAKE_ARGS_ALL=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DCMAKE_PLATFORM_NO_VERSIONED_SONAME=ON
  -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON "-DCMAKE_INSTALL_RPATH=\$ORIGIN"
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "${ARCH_ARGS[@]}")
# The build's stamp: the variant and the configuration; either changing rebuilds what it must.
STAMP="$VARIANT $(echo "${CMAKE_ARGS_ALL[*]}" | md5sum | cut -c1-12)"
# How it is compiled, not what: the common library and the server's own code as unity builds
# (scripts/llama_unity.cmake, copied beside the build), and the generator. Outside the stamp:
# the same libraries and binary either way, so a build made without them is kept.
UNITY="$DIR/llama_unity.cmake"
CMAKE_HOW=("-DCMAKE_PROJECT_INCLUDE=$UNITY")
BIN="$BUILD/bin/llama-server"
WHEEL_DIR="${LLAMA_WHEEL_CACHE:-$CACHE_ROOT/wheels}/$VERSION/$VARIANT"
LIBS=(libllama.so libggml.so libggml-base.so libggml-cpu.so libmtmd.so)
[[ "$VARIANT" == "cuda" ]] && LIBS+=(libggml-cuda.so)

log() { echo "[build_llama] $*" >&2; }
step_start=0
step() { step_start=$(date +%s); log "$*"; }
step_done() { log "  done in $(($(date +%s) - step_start)) s"; }

wheel_path() { ls "$WHEEL_DIR"/llama_cpp_python-"$VERSION"-*.whl 2>/dev/null | head -1; }
built() { [[ -x "$BIN" && "$(cat "$BUILD/.stamp" 2>/dev/null)" == "$STAMP" ]]; }
answer() { if [[ $PRINT == server ]]; then echo "$BIN"; else wheel_path; fi; }

if built && [[ -n "$(wheel_path)" ]]; then
  answer
  exit 0
fi

mkdir -p "$DIR"
# One build at a time: a second caller waits on the lock, then finds the results.
exec 9>"$DIR/.build.lock"
if ! flock -n 9; then
  log "another build holds $DIR/.build.lock; waiting for it"
  flock 9
fi

SRC_PARENT="$DIR/src"
SDIST="$SRC_PARENT/llama_cpp_python-$VERSION"
SRC="$SDIST/vendor/llama.cpp"
if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
  step "downloading the llama-cpp-python $VERSION sdist"
  TMP="$(mktemp -d)"
  trap 'rm -rf "$TMP"' EXIT
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary llama-cpp-python \
    -d "$TMP" "llama-cpp-python==$VERSION"
  mkdir -p "$SRC_PARENT"
  tar -xzf "$TMP"/llama_cpp_python-"$VERSION".tar.gz -C "$SRC_PARENT"
  step_done
fi
[[ -f "$SRC/CMakeLists.txt" ]] || { echo "no vendored llama.cpp in $SRC" >&2; exit 1; }

if ! built; then
  # A build directory configured from another source tree, or for another CPU, is not reused.
  if [[ -f "$BUILD/CMakeCache.txt" ]] &&
    { ! grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$SRC" "$BUILD/CMakeCache.txt" ||
      [[ -f "$BUILD/.stamp" && "$(cut -d' ' -f1 "$BUILD/.stamp")" != "$VARIANT" ]]; }; then
    log "removing $BUILD (configured from another source tree or CPU)"
    rm -rf "$BUILD"
  fi
  # Ninja when there is one (on PATH, or the `ninja` wheel beside $PY, installed here into a
  # virtual environment when the system has none): it keeps both jobs busy where make's
  # per-target steps leave one idle. Else make.
  NINJA="$(command -v ninja || true)"
  PYBIN="$(dirname "$PY")"
  if [[ -z "$NINJA" && ! -x "$PYBIN/ninja" ]] &&
    "$PY" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' 2>/dev/null; then
    "$PY" -m pip install -q --disable-pip-version-check ninja >&2 || log "no ninja wheel: make builds"
  fi
  [[ -z "$NINJA" && -x "$PYBIN/ninja" ]] && NINJA="$PYBIN/ninja"
  GEN=()
  [[ -n "$NINJA" && ! -f "$BUILD/Makefile" ]] && GEN=(-G Ninja "-DCMAKE_MAKE_PROGRAM=$NINJA")
  step "configuring llama.cpp $VERSION ($VARIANT) in $BUILD"
  cp "$ROOT/scripts/llama_unity.cmake" "$UNITY"
  cmake -S "$SRC" -B "$BUILD" "${GEN[@]}" "${CMAKE_ARGS_ALL[@]}" "${CMAKE_HOW[@]}" \
    >"$DIR/configure.log" 2>&1 ||
    { tail -40 "$DIR/configure.log" >&2; exit 1; }
  step_done
  step "building llama, ggml, mtmd and llama-server with $JOBS jobs (the long step, once)"
  TARGETS=(--target llama-server llama mtmd -j"$JOBS")
  if ! cmake --build "$BUILD" "${TARGETS[@]}" >"$DIR/build.log" 2>&1; then
    # The unity batches are ours, not upstream's: should a llama.cpp update break one, build
    # the way upstream does rather than fail (an empty include, configured again).
    tail -20 "$DIR/build.log" >&2
    log "the build failed; once more without the unity batches"
    : >"$UNITY"
    { cmake -S "$SRC" -B "$BUILD" >>"$DIR/configure.log" 2>&1 &&
      cmake --build "$BUILD" "${TARGETS[@]}" >"$DIR/build.log" 2>&1; } ||
      { tail -60 "$DIR/build.log" >&2; exit 1; }
  fi
  [[ -x "$BIN" ]] || { echo "build finished but $BIN is missing" >&2; exit 1; }
  for lib in "${LIBS[@]}"; do
    [[ -f "$BUILD/bin/$lib" ]] || { echo "build finished but $BUILD/bin/$lib is missing" >&2; exit 1; }
  done
  echo "$STAMP" >"$BUILD/.stamp"
  rm -rf "$WHEEL_DIR"  # packed from an earlier build
  step_done
fi

if [[ -z "$(wheel_path)" ]]; then
  step "packing the llama-cpp-python $VERSION wheel around the built libraries"
  TMPW="$(mktemp -d)"
  cp -a "$SDIST/." "$TMPW/pkg"
  rm -rf "$TMPW/pkg/vendor" "$TMPW/pkg/.gitignore"  # .gitignore lists lib/ and *.so
  mkdir -p "$TMPW/pkg/llama_cpp/lib"
  for lib in "${LIBS[@]}"; do cp "$BUILD/bin/$lib" "$TMPW/pkg/llama_cpp/lib/"; done
  # LLAMA_BUILD=OFF: the sdist's CMake builds nothing; the wheel takes llama_cpp/ as it is.
  CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$PY" -m pip wheel -q --no-deps \
    --disable-pip-version-check -w "$TMPW/out" "$TMPW/pkg" >&2
  mkdir -p "$WHEEL_DIR"
  mv "$TMPW"/out/llama_cpp_python-*.whl "$WHEEL_DIR"/
  rm -rf "$TMPW"
  step_done
fi
answer
