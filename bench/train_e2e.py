"""End-to-end `device_train.py` throughput next to the bare train step, same config, same devices.

    python bench/train_e2e.py [--steps 30] [--cpu-devices 8] [--json]

"bare step": `Trainer.step` on one batch already on the devices, in a loop. "end to end": the
whole `TrainRun` loop (loader with prefetch, host->device copy, step, metrics, logging) over a real
tokenised dataset, checkpoints off. If the loader kept the devices waiting, the second would trail
the first.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import machine  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(ROOT, "configs/tiny_cpu.json"))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--cpu-devices", type=int, default=8)
    machine.add_args(p)
    args = p.parse_args()
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.cpu_devices}"
    description = machine.describe()
    import dataclasses

    import jax
    import numpy as np

    from mesh_transformer.config import load_config
    from mesh_transformer.train.loop import RunOptions, TrainRun, build_mesh
    from mesh_transformer.train.step import Trainer

    base = load_config(args.config)
    tmp = tempfile.mkdtemp(prefix="bench-e2e-")
    subprocess.run([sys.executable, os.path.join(ROOT, "create_finetune_dataset.py"),
                    os.path.join(ROOT, "data/corpus/stories.txt"), "train", "--output-dir", tmp,
                    "--seq", str(base.model.seq)], check=True, capture_output=True)
    config = dataclasses.replace(base, train=dataclasses.replace(
        base.train, train_set=f"{tmp}/train.index.json", val_set={}, val_every=0, ckpt_every=0,
        model_dir=f"{tmp}/ckpt", total_steps=args.steps + 1, wandb_project=None))

    trainer = Trainer(config, build_mesh(config))
    state = trainer.init_state(0)
    t = config.train
    tokens = np.random.RandomState(0).randint(0, config.model.n_vocab,
                                              (t.gradient_accumulation_steps, trainer.global_batch, config.model.seq + 1))
    batch = trainer.shard_batch({"tokens": tokens.astype(np.int32)})
    state, metrics = trainer.step(state, batch)
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for _ in range(args.steps):
        state, metrics = trainer.step(state, batch)
        float(metrics["loss"])  # the loop reads the loss every step too
    bare = (time.perf_counter() - start) / args.steps

    run = TrainRun(config, RunOptions(log_dir=f"{tmp}/logs", tensorboard=False))
    with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):  # --json: stdout holds the JSON only
        run.train()
    rows = [json.loads(line) for line in open(f"{tmp}/logs/metrics.jsonl")][1:]  # step 1 compiles
    e2e = float(np.median([1.0 / r["steps_per_sec"] for r in rows]))
    tokens_per_step = t.gradient_accumulation_steps * trainer.global_batch * config.model.seq
    result = {"config": args.config, "mesh": f"dp={trainer.dp} x mp={trainer.mp}", "steps": args.steps,
              "bare_step_s": bare, "end_to_end_step_s": e2e, "bare_tokens_per_s": tokens_per_step / bare,
              "end_to_end_tokens_per_s": tokens_per_step / e2e, "end_to_end_over_bare": bare / e2e}
    def text():
        print(f"{args.config} on {result['mesh']} ({args.cpu_devices} CPU devices), {tokens_per_step} tokens/step")
        print(f"bare train step          {bare:.3f} s/step  {result['bare_tokens_per_s']:9.0f} tokens/s")
        print(f"device_train loop        {e2e:.3f} s/step  {result['end_to_end_tokens_per_s']:9.0f} tokens/s "
              f"({100 * result['end_to_end_over_bare']:.0f}% of bare)")
    machine.report(description, result, args.json, text)


if __name__ == "__main__":
    main()
