#!/usr/bin/env bash
# The system Chromium and its WebDriver for the playground's browser test (tests/test_serve_page.py).
# Idempotent and quiet: nothing to do when /usr/bin/chromium and /usr/bin/chromedriver exist. Installs
# Debian's `chromium` and `chromium-driver` as root (CI) or with passwordless sudo; otherwise says
# how and leaves the browser test to skip. Nothing downloads a browser at test time.
set -euo pipefail
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then exit 0; fi
if ! command -v apt-get >/dev/null; then
  echo "note: install chromium and its chromedriver for the browser test (tests/test_serve_page.py)" >&2; exit 0
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if sudo -n true 2>/dev/null; then sudo="sudo -n"; else
    echo "note: 'sudo apt-get install chromium chromium-driver' enables the browser test" >&2; exit 0
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq >/dev/null
$sudo apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
