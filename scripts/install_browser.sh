#!/usr/bin/env bash
# The system Chromium and its WebDriver for the playground's browser test (tests/test_serve_page.py).
# Idempotent and quiet: does nothing when /usr/bin/chromium and /usr/bin/chromedriver exist; needs
# root (CI) or sudo to install. Nothing downloads a browser at test time.
set -euo pipefail
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then exit 0; fi
if ! command -v apt-get >/dev/null; then
  echo "install chromium and chromium-driver with your package manager for the browser test" >&2; exit 0
fi
sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq >/dev/null
$sudo apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
