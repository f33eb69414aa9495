#!/usr/bin/env bash
# Builds the chat page (webui/src) into server/webui/static, which ships in the Python
# package (serving it needs no Node.js). Needs node and npm; the libraries come from the
# npm registry at the versions package-lock.json pins (npm ci).
#
#   webui/build.sh            build into server/webui/static
#   webui/build.sh --check    build into a temporary folder and fail unless it equals the
#                             shipped files (./test.sh runs this; without npm it fails)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SHIPPED="$HERE/../server/webui/static"
for tool in node npm; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "[webui] $tool is missing: the page cannot be built or checked (install Node.js 20 and npm)" >&2
    exit 1
  fi
done
cd "$HERE"
# the lock file's exact versions; install scripts are not needed (esbuild's binary comes
# in its platform package)
npm ci --no-audit --no-fund --ignore-scripts --loglevel=error >/dev/null
if [[ "${1:-}" == "--check" ]]; then
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  node build.mjs "$tmp"
  if ! diff -r "$tmp" "$SHIPPED"; then
    echo "[webui] server/webui/static differs from a fresh build of webui/src: run webui/build.sh and commit" >&2
    exit 1
  fi
  echo "[webui] server/webui/static matches a fresh build ($(ls "$tmp" | wc -l) files)"
else
  rm -rf "$SHIPPED"
  node build.mjs "$SHIPPED"
  ls -l "$SHIPPED"
fi
