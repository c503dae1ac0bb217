#!/usr/bin/env bash
# The JAX peer MaxText 0.2.5 (a LLaMA-shaped decoder) in a venv of its own, bench/peers/.venv-maxtext
# (git-ignored), for bench/peers/train_peers.py. MaxText needs Python >= 3.12, and its wheel declares
# no dependencies of its own: the list comes from its 'tpu' extra, less libtpu and the nvidia-* wheels
# (it then runs on CPU with hardware=cpu).
#   bash bench/peers/setup_maxtext.sh [python3.12]
set -euo pipefail
cd "$(dirname "$0")"
PY="${1:-python3.12}"
"$PY" --version >/dev/null 2>&1 || PY="$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 | tail -1)"
[ -x .venv-maxtext/bin/python ] || "$PY" -m venv .venv-maxtext
.venv-maxtext/bin/pip install -q packaging
.venv-maxtext/bin/pip install -q --no-deps "maxtext==0.2.5"
.venv-maxtext/bin/python - > .venv-maxtext/tpu-extra.txt <<'PYEOF'
import importlib.metadata as md
from packaging.requirements import Requirement
for line in md.requires("maxtext") or []:
    req = Requirement(line)
    if req.marker is None or not req.marker.evaluate({"extra": "tpu"}):
        continue
    if req.name == "libtpu" or req.name.startswith("nvidia-"):
        continue
    req.marker = None
    print(req)
PYEOF
.venv-maxtext/bin/pip install -q -r .venv-maxtext/tpu-extra.txt
.venv-maxtext/bin/python -c "import maxtext, jax; print('maxtext', __import__('importlib.metadata').metadata.version('maxtext'), 'jax', jax.__version__)"
