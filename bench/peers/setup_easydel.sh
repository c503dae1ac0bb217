#!/usr/bin/env bash
# The JAX peer EasyDeL 0.3 (trains a GPT-J) in a venv of its own, bench/peers/.venv-easydel (git-ignored),
# for bench/peers/train_peers.py. EasyDeL imports torch and pillow without declaring them: both go in
# beside it (torch pinned to the project's CPU build, which pip's configured find-links provides).
#   bash bench/peers/setup_easydel.sh [python3.11]
set -euo pipefail
cd "$(dirname "$0")"
PY="${1:-python3.11}"
[ -x .venv-easydel/bin/python ] || "$PY" -m venv .venv-easydel
.venv-easydel/bin/pip install -q "easydel==0.3.*" "torch==2.13.0" pillow
.venv-easydel/bin/python -c "import easydel, jax, torch; print('easydel', easydel.__version__, 'jax', jax.__version__, 'torch', torch.__version__)"
