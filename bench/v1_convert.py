"""v1 (mesh-transformer-jax) checkpoint conversion: throughput and peak host memory, in one run.

    python bench/v1_convert.py [--layers 8] [--d-model 2048] [--shards 8] [--dir /tmp/v1bench]

Writes a random slim (bf16) v1 checkpoint of a GPT-J-shaped model (vocabulary 50,400; the defaults
give 1.22 GB), then, each in a fresh process:
  to_hf     to_hf_weights.py --dtype fp16          (v1 -> HF safetensors, leaf by leaf)
  to_ours   slim_model.py --dtype bf16              (v1 -> our params-only checkpoint)
  load      loading.load(..., dtype="bfloat16")     (v1 -> params on the device, as sampling loads them)
and reports MB/s (checkpoint bytes / seconds) and the peak resident memory above the process's
baseline after its imports (VmHWM reset by /proc/self/clear_refs), next to the checkpoint's size
and the loaded model's. Targets (issue 9): to_hf peak < 25% of the checkpoint; load peak <= 125% of
the loaded model.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import machine  # noqa: E402


def config_dict(args) -> dict:
    return {"layers": args.layers, "d_model": args.d_model, "n_heads": 16, "n_vocab": 50400, "seq": 2048,
            "pe_rotary_dims": min(64, args.d_model // 16), "norm": "layernorm", "pe": "rotary", "cores_per_replica": args.shards}


def write_checkpoint(step_dir: str, args) -> None:
    """Random bf16 params in the v1 layout (mtj_v1.layout), written piece by piece."""
    import ml_dtypes

    from mesh_transformer.config import config_from_dict
    from mesh_transformer.io import mtj_v1

    model = config_from_dict(config_dict(args)).model
    leaves = mtj_v1.layout(model.layers, full=False)
    rng = np.random.default_rng(0)
    for s in range(args.shards):
        os.makedirs(os.path.join(step_dir, f"shard_{s}"), exist_ok=True)
        for i, (a, b) in enumerate(mtj_v1.piece_bounds(len(leaves))):
            arrays = []
            for leaf in leaves[a:b]:
                if leaf.kind is None:
                    arrays.append(np.int32(1000))
                    continue
                shape = mtj_v1.shard_shape(leaf.kind, model, args.shards)
                arrays.append((rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16))
            np.savez(os.path.join(step_dir, f"shard_{s}", f"{i}.npz"), *arrays)
            del arrays


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def child(mode: str, step_dir: str, config: str, out: str) -> dict:
    """Run one conversion in this (fresh) process; peak RSS above the post-import baseline."""
    import jax

    import slim_model
    import to_hf_weights
    from mesh_transformer import loading
    from mesh_transformer.io import convert, hf, mtj_v1  # noqa: F401 - imports are not part of the peak
    from mesh_transformer.models import core  # noqa: F401

    jax.devices()
    baseline = _rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    start = time.perf_counter()
    extra = {}
    if mode == "to_hf":
        assert to_hf_weights.main(["--input-ckpt", step_dir, "--config", config, "--output-path", out,
                                   "--dtype", "fp16"]) == 0
    elif mode == "to_ours":
        assert slim_model.main(["--input-ckpt", step_dir, "--config", config, "--output-ckpt", out,
                                "--dtype", "bf16"]) == 0
    else:
        model = loading.load(ckpt=step_dir, config=config, mp=1, dp=1, dtype="bfloat16")
        jax.block_until_ready(model.params)
        extra["model_bytes"] = sum(x.nbytes for x in jax.tree.leaves(model.params))
    seconds = time.perf_counter() - start
    return {"mode": mode, "seconds": seconds, "peak_above_baseline": _rss("VmHWM") - baseline,
            "baseline": baseline, **extra}


def run_child(mode: str, step_dir: str, config: str, out: str) -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, __file__, "--child", mode, step_dir, config, out],
                            env=env, capture_output=True, text=True, cwd=ROOT)
    if result.returncode:
        raise SystemExit(f"{mode} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--dir", default="/tmp/v1bench")
    p.add_argument("--modes", default="to_hf,to_ours,load", help="comma-separated subset to run")
    machine.add_args(p)
    p.add_argument("--child", nargs=4, metavar=("MODE", "STEP_DIR", "CONFIG", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    import shutil

    description = machine.describe()
    say = (lambda *a, **k: None) if args.json else print
    if not args.json:
        print(machine.header(description), flush=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    step_dir, config = os.path.join(args.dir, "step_1000"), os.path.join(args.dir, "config.json")
    os.makedirs(args.dir)
    with open(config, "w") as f:
        json.dump(config_dict(args), f)
    started = time.perf_counter()
    write_checkpoint(step_dir, args)
    size = sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(step_dir) for n in ns)
    say(f"v1 checkpoint: {size / 1e9:.2f} GB ({args.layers} layers, d_model {args.d_model}, vocab 50400, "
          f"{args.shards} shards, bf16), written in {time.perf_counter() - started:.0f} s")
    results = {"checkpoint_bytes": size, "modes": {}}
    for mode in args.modes.split(","):
        r = run_child(mode, step_dir, config, os.path.join(args.dir, f"out_{mode}"))
        results["modes"][mode] = {**r, "mb_s": size / 1e6 / r["seconds"]}
        line = (f"{mode:8s} {size / 1e6 / r['seconds']:7.0f} MB/s  {r['seconds']:6.1f} s  peak above baseline "
                f"{r['peak_above_baseline'] / 1e9:.2f} GB = {r['peak_above_baseline'] / size:.0%} of the checkpoint")
        if "model_bytes" in r:
            line += (f"; loaded model {r['model_bytes'] / 1e9:.2f} GB, peak = "
                     f"{r['peak_above_baseline'] / r['model_bytes']:.0%} of it")
        say(line, flush=True)
        shutil.rmtree(os.path.join(args.dir, f"out_{mode}"), ignore_errors=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    if args.json:
        machine.report(description, results, True)


if __name__ == "__main__":
    main()
