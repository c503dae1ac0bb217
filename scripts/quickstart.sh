#!/usr/bin/env bash
# Fresh machine -> venv -> tokenised demo corpus -> a tiny GPT-J trained on 8 simulated CPU devices
# (dp=4 x mp=2), checkpointed, its loss curve drawn, and a few completions sampled from it.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install --quiet --disable-pip-version-check -r requirements.txt -e .
source scripts/env.sh  # after pip: its proxy settings keep everything below on loopback

for split in corpus:stories val:stories_val; do
  src="data/${split%%:*}/stories.txt"; name="${split##*:}"
  [ -f "runs/data/$name.index.json" ] || .venv/bin/python create_finetune_dataset.py "$src" "$name" --output-dir runs/data --seq 128
done
.venv/bin/python device_train.py --config configs/tiny_cpu.json --cpu-devices 8 --log-dir runs/tiny_cpu/logs \
  --plot runs/tiny_cpu/loss.png --sample "Snow had fallen in the night when" --sample "The sun was bright when Omar"
