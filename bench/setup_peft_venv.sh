#!/usr/bin/env bash
# The peer of bench/lora_train.py: PEFT + HF transformers on torch, in a venv of its own
# (bench/.venv-peft, git-ignored), so the comparison does not depend on what the project's venv holds.
#   bash bench/setup_peft_venv.sh [python]      # then: python bench/lora_train.py
set -euo pipefail
cd "$(dirname "$0")"
PY="${1:-python3}"
[ -x .venv-peft/bin/python ] || "$PY" -m venv .venv-peft
# pip's configured index (find-links / extra-index-url) provides the CPU build of torch
.venv-peft/bin/pip install -q "torch==2.13.0" transformers peft
.venv-peft/bin/python -c "import torch, transformers, peft; print('peer venv:', 'torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
