#!/usr/bin/env bash
# The peer of bench/dpo_train.py: TRL's DPOTrainer (+ PEFT for LoRA) on HF transformers and torch, in a
# venv of its own (bench/.venv-trl, git-ignored), so the comparison does not depend on the project's venv.
#   bash bench/setup_trl_venv.sh [python]      # then: python bench/dpo_train.py
set -euo pipefail
cd "$(dirname "$0")"
PY="${1:-python3}"
[ -x .venv-trl/bin/python ] || "$PY" -m venv .venv-trl
# pip's configured index (find-links / extra-index-url) provides the CPU build of torch
.venv-trl/bin/pip install -q "torch==2.13.0" transformers peft "trl==1.16.0"
.venv-trl/bin/python -c "import torch, transformers, peft, trl; print('peer venv:', 'torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'trl', trl.__version__)"
