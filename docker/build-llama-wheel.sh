#!/usr/bin/env bash
# Builds the llama-cpp-python wheel for the container images (the builder stage of
# ../Dockerfile and Dockerfile.cuda). Portable: it runs on any x86-64 machine, not just the
# one that built it.
#
#   docker/build-llama-wheel.sh VENV OUT_DIR [cpu|cuda]
#
#   VENV     the virtual environment the wheel will be installed into, at the same path in
#            the final image (/opt/venv): the backend directory is compiled into libggml
#   OUT_DIR  where the wheel is written
#
# Environment: LLAMA_SDIST=path/to/llama_cpp_python-X.tar.gz to build from a local sdist
# instead of downloading it; CUDA_ARCHITECTURES="80;90" to narrow the CUDA build (default:
# llama.cpp's list); REQUIREMENTS (default requirements.txt) holds the version pin.
#
# How the build stays portable and free of AMX:
#   - GGML_NATIVE=OFF, GGML_BACKEND_DL=ON, GGML_CPU_ALL_VARIANTS=ON: ggml builds one CPU
#     backend per x86-64 level (x64, sse42, sandybridge, haswell, skylakex, icelake, zen4,
#     alderlake, ...) as libggml-cpu-<variant>.so and loads the best one the CPU supports.
#   - The variant list (ggml/src/CMakeLists.txt) includes `sapphirerapids`, built with
#     AMX_TILE and AMX_INT8, which would be chosen on Sapphire/Emerald/Granite Rapids; ggml's
#     AMX matmul crashes on Q4_K models (segfault in ggml_backend_amx_mul_mat). Each variant
#     resets GGML_AMX_* before turning on its own features, so -DGGML_AMX_*=OFF on the command
#     line cannot remove it: the sapphirerapids line is deleted from the vendored CMakeLists
#     instead, and the wheel is checked to hold no such library. Those CPUs then load the
#     zen4 variant (AVX512 VBMI/VNNI/BF16, no AMX). -DGGML_AMX_*=OFF is passed as well.
#   - The backend libraries are MODULE targets that llama-cpp-python does not package, and
#     ggml looks for them next to the executable (python's bin/), in the working directory
#     and in GGML_BACKEND_DIR. So GGML_BACKEND_DIR is set to VENV's llama_cpp/lib and the
#     modules are installed into the wheel's llama_cpp/lib (next to libllama.so).
set -euo pipefail

VENV="${1:?usage: $0 VENV OUT_DIR [cpu|cuda]}"
OUT="${2:?usage: $0 VENV OUT_DIR [cpu|cuda]}"
FLAVOR="${3:-cpu}"
REQUIREMENTS="${REQUIREMENTS:-requirements.txt}"
PY="$VENV/bin/python"

VERSION="$(sed -n 's/^llama-cpp-python==\(.*\)$/\1/p' "$REQUIREMENTS")"
[[ -n "$VERSION" ]] || { echo "no llama-cpp-python pin in $REQUIREMENTS" >&2; exit 1; }
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')"
BACKEND_DIR="$SITE/llama_cpp/lib"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
if [[ -n "${LLAMA_SDIST:-}" ]]; then
  cp "$LLAMA_SDIST" "$WORK/"
else
  "$PY" -m pip download --no-cache-dir --no-deps --no-binary llama-cpp-python \
    -d "$WORK" "llama-cpp-python==$VERSION"
fi
tar -xzf "$WORK"/llama_cpp_python-*.tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION"
GGML_CMAKE="$SRC/vendor/llama.cpp/ggml/src/CMakeLists.txt"

# 1. No AMX variant.
sed -i '/ggml_add_cpu_backend_variant(sapphirerapids/d' "$GGML_CMAKE"
if grep -nE 'ggml_add_cpu_backend_variant\(.*AMX' "$GGML_CMAKE"; then
  echo "a CPU variant with AMX is still listed in $GGML_CMAKE" >&2
  exit 1
fi
# 2. Backend modules go into the wheel, next to libllama.so (GGML_BACKEND_DIR would install
#    them to that absolute path on the build machine, outside the wheel).
# shellcheck disable=SC2016  # literal CMake variables
sed -i 's|install(TARGETS ${backend} LIBRARY DESTINATION ${GGML_BACKEND_DIR})|install(TARGETS ${backend} LIBRARY DESTINATION llama_cpp/lib)|' "$GGML_CMAKE"
grep -q 'LIBRARY DESTINATION llama_cpp/lib)' "$GGML_CMAKE" || {
  echo "could not redirect the backend install destination in $GGML_CMAKE" >&2
  exit 1
}

CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON"
CMAKE_ARGS+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
CMAKE_ARGS+=" -DGGML_BACKEND_DIR=$BACKEND_DIR -DLLAMA_BUILD_TESTS=OFF"
if [[ "$FLAVOR" == "cuda" ]]; then
  CMAKE_ARGS+=" -DGGML_CUDA=ON"
  [[ -n "${CUDA_ARCHITECTURES:-}" ]] && CMAKE_ARGS+=" -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCHITECTURES"
fi
echo "[build-llama-wheel] llama-cpp-python $VERSION ($FLAVOR): CMAKE_ARGS=$CMAKE_ARGS"
mkdir -p "$OUT"
CMAKE_ARGS="$CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
  "$PY" -m pip wheel --no-cache-dir --no-deps -w "$OUT" "$SRC"

# 3. Check what the wheel holds.
"$PY" - "$OUT" "$FLAVOR" <<'EOF'
import pathlib, sys, zipfile
out, flavor = pathlib.Path(sys.argv[1]), sys.argv[2]
(wheel,) = out.glob("llama_cpp_python-*.whl")
names = [n.rsplit("/", 1)[-1] for n in zipfile.ZipFile(wheel).namelist() if n.startswith("llama_cpp/lib/")]
variants = sorted(n for n in names if n.startswith("libggml-cpu-"))
print(f"[build-llama-wheel] {wheel.name}: CPU variants {variants}")
problems = []
if "libggml-cpu-x64.so" not in names:
    problems.append("no baseline CPU backend libggml-cpu-x64.so")
if any("sapphirerapids" in n or "amx" in n for n in names):
    problems.append("an AMX CPU backend is in the wheel")
if flavor == "cuda" and "libggml-cuda.so" not in names:
    problems.append("no libggml-cuda.so")
if problems:
    sys.exit("; ".join(problems))
EOF
