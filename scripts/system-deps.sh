#!/usr/bin/env bash
# System packages the end-to-end tests drive for real: Prometheus (and promtool), and nginx
# (tests/deploy runs the conversation-affinity router in front of two servers), and Chromium
# with its WebDriver (tests/e2e/test_webui_e2e.py drives the chat page at / through Selenium);
# Node.js and npm build the page (webui/build.sh --check in ./test.sh).
# Installed with apt when missing (needs root, as on CI and the dev machines).
set -euo pipefail
need=()
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v nginx >/dev/null 2>&1 || [[ -x /usr/sbin/nginx ]] || need+=(nginx)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
command -v node >/dev/null 2>&1 || need+=(nodejs)
command -v npm >/dev/null 2>&1 || need+=(npm)
if ((${#need[@]})); then
  if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    echo "[system-deps] missing: ${need[*]} (install them with your package manager)" >&2
    exit 1
  fi
  echo "[system-deps] installing ${need[*]}"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
