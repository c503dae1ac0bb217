"""train.py with local worker processes vs device_train.py's single process, on the same 8 CPU devices.

    source scripts/env.sh && .venv/bin/python bench/multihost.py [--steps 12] [--hosts 1 2 4] [--json]

One run trains the same config (dp=4 x mp=2) three ways and reports step time and tokens/s:
  * one process on 8 simulated devices (`TrainRun`, the loop of device_train.py);
  * the Ray driver with `--local-hosts 2` (2 workers x 4 devices, gloo collectives between them);
and, for each worker count in --hosts, the bytes of batch data the driver sends per step (all
hosts together, and per host) -- the part of the driver's traffic that grows with the batch.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import machine  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="per_replica_batch (global batch = 4 x this)")
    p.add_argument("--steps", type=int, default=12, help="steps per run; the first 2 and the last are not timed")
    p.add_argument("--hosts", type=int, nargs="+", default=[1, 2, 4], help="worker counts for the bytes table")
    machine.add_args(p)
    return p.parse_args()


def write_dataset(directory: str, n: int, seq: int, vocab: int) -> str:
    tokens = np.random.default_rng(0).integers(0, vocab, (n, seq + 1)).astype(np.uint16)
    np.save(os.path.join(directory, "bench-00000.tokens.npy"), tokens)
    index = {"format": "mesh-transformer-dataset", "version": 1, "name": "bench", "seq": seq, "dtype": "uint16",
             "eos_id": 0, "n_sequences": n, "has_mask": False,
             "shards": [{"tokens": "bench-00000.tokens.npy", "mask": None, "n_sequences": n,
                         "sha256": {"tokens": "unchecked"}}]}  # local shards are read without a check
    path = os.path.join(directory, "bench.index.json")
    with open(path, "w") as f:
        json.dump(index, f)
    return path


def make_config(args, train_set: str, model_dir: str):
    from mesh_transformer.config import config_from_dict
    return config_from_dict(dict(
        layers=args.layers, d_model=args.d_model, n_heads=args.heads, n_vocab=args.vocab, seq=args.seq,
        pe_rotary_dims=max(2, args.d_model // args.heads // 4), compute_dtype="float32", remat="none",
        cores_per_replica=2, tpu_size=8, per_replica_batch=args.batch, warmup_steps=2, anneal_steps=100,
        lr=1e-3, end_lr=1e-4, total_steps=args.steps, train_set=train_set, model_dir=model_dir, name="bench"))


def timed(seconds: list[float]) -> float:
    """Median step time, leaving out the first 2 steps (compile, warm-up) and the last (final save)."""
    return statistics.median(seconds[2:-1])


def single_process(args, train_set: str, tmp: str) -> dict:
    from mesh_transformer.train.metrics import read_metrics
    from mesh_transformer.train.loop import RunOptions, TrainRun
    config = make_config(args, train_set, os.path.join(tmp, "single"))
    log_dir = os.path.join(tmp, "single-logs")
    TrainRun(config, RunOptions(log_dir=log_dir, tensorboard=False)).train()
    seconds = [1.0 / r["steps_per_sec"] for r in read_metrics(os.path.join(log_dir, "metrics.jsonl"))]
    return {"step_s": timed(seconds), "tokens_per_step": 4 * args.batch * args.seq}


def ray_run(args, train_set: str, tmp: str, hosts: int) -> dict:
    from mesh_transformer.train.cluster import ClusterOptions, ClusterRun
    from mesh_transformer.train.loop import RunOptions
    config = make_config(args, train_set, os.path.join(tmp, f"ray{hosts}"))
    options = ClusterOptions(local_hosts=hosts, cpu_devices=8, new=True, overwrite=True,
                             run=RunOptions(log_dir=os.path.join(tmp, f"ray{hosts}-logs"), tensorboard=False))
    started = time.perf_counter()
    summary = ClusterRun(config, options).train()
    return {"step_s": timed(summary.step_seconds), "bytes_per_step": summary.bytes_per_step,
            "wall_s": time.perf_counter() - started}


def pickled_overhead(args, hosts: int) -> int:
    """Bytes the step arguments take pickled (what Ray ships) beyond the arrays themselves, per step."""
    from mesh_transformer.train.cluster import pack_batch, rows_of
    b = 4 * args.batch
    batch = {"tokens": np.zeros((1, b, args.seq + 1), np.int32), "mask": np.ones((1, b, args.seq), np.float32)}
    packed = pack_batch(batch, args.seq)
    slices = [rows_of(packed, (i * b // hosts, (i + 1) * b // hosts)) for i in range(hosts)]
    return sum(len(pickle.dumps(s, protocol=5)) - sum(v.nbytes for v in s.values()) for s in slices)


def main():
    args = parse_args()
    description = machine.describe()
    from mesh_transformer.train import cluster
    tmp = tempfile.mkdtemp(prefix="bench-multihost-")
    ray_dir = cluster.start_local_ray(max(args.hosts + [2]))
    try:
        train_set = write_dataset(tmp, 4 * args.batch * args.steps * 2, args.seq, args.vocab)
        single = single_process(args, train_set, tmp)
        runs = {h: ray_run(args, train_set, tmp, h) for h in sorted(set(args.hosts) | {2})}
    finally:
        import ray
        ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    tokens = single["tokens_per_step"]
    result = {"config": vars(args), "tokens_per_step": tokens,
              "single_process": {"step_ms": 1e3 * single["step_s"], "tokens_per_s": tokens / single["step_s"]},
              "workers": {h: {"step_ms": 1e3 * r["step_s"], "tokens_per_s": tokens / r["step_s"],
                              "driver_batch_bytes_per_step": r["bytes_per_step"],
                              "per_host_bytes_per_step": r["bytes_per_step"] // h,
                              "pickle_overhead_bytes_per_step": pickled_overhead(args, h),
                              "run_wall_s": r["wall_s"]} for h, r in runs.items()}}
    machine.report(description, result, args.json, lambda: text(args, result, tokens))


def text(args, result, tokens):
    print(f"\nmodel: {args.layers} layers, d_model {args.d_model}, vocab {args.vocab}, seq {args.seq}; "
          f"dp=4 x mp=2 on 8 CPU devices; {tokens} tokens/step")
    print(f"{'':26s}{'step ms':>10s}{'tokens/s':>10s}{'driver B/step':>15s}{'per host':>10s}{'+pickle':>9s}")
    s = result["single_process"]
    print(f"{'1 process (device_train)':26s}{s['step_ms']:10.1f}{s['tokens_per_s']:10.0f}{'-':>15s}{'-':>10s}{'-':>9s}")
    for h, r in result["workers"].items():
        print(f"{f'train.py, {h} worker(s)':26s}{r['step_ms']:10.1f}{r['tokens_per_s']:10.0f}"
              f"{r['driver_batch_bytes_per_step']:15d}{r['per_host_bytes_per_step']:10d}"
              f"{r['pickle_overhead_bytes_per_step']:9d}")


if __name__ == "__main__":
    main()
