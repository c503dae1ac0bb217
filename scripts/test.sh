#!/usr/bin/env bash
# Fresh machine -> venv -> dependencies -> the whole test suite, with non-loopback traffic refused.
#   bash scripts/test.sh            # everything (CI runs exactly this)
#   bash scripts/test.sh -k hf -x   # extra arguments go to pytest
#   TEST_WORKERS=0 bash scripts/test.sh   # in one process (default: 2 workers, a test file each at a time)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_browser.sh  # system Chromium for the playground test (skipped when present)
python3 -m venv .venv
.venv/bin/pip install --quiet --disable-pip-version-check -r requirements-dev.txt -e .
source scripts/env.sh  # after pip: its proxy settings keep everything below on loopback

# The loopback guard (../shared/netguard) makes any non-loopback connect fail and logs it.
guard="$(cd .. && pwd)/shared/netguard"
if [ -f "$guard/sitecustomize.py" ]; then
  export PYTHONPATH="$guard${PYTHONPATH:+:$PYTHONPATH}"
  export NETGUARD_LOG="$PWD/netguard.log"
  rm -f "$NETGUARD_LOG"
elif [ "${CI:-}" = "true" ]; then
  echo "CI needs ../shared/netguard beside the checkout" >&2; exit 1
fi

status=0
.venv/bin/python -m pytest -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@" || status=$?
if [ -n "${NETGUARD_LOG:-}" ] && [ -s "$NETGUARD_LOG" ]; then
  echo "non-loopback traffic was attempted:" >&2; cat "$NETGUARD_LOG" >&2; exit 1
fi
exit $status
