"""Checkpoint save/restore throughput on local disk: our CheckpointManager vs numpy.save/numpy.load.

    .venv/bin/python bench/checkpoint_io.py [--mb 384] [--devices 8] [--repeats 3] [--dir /tmp/x] [--json]

The state is a model-shaped tree (params + two Adam moments, float32, layer-stacked matrices)
sharded over an ('dp', 'mp') mesh of `--devices` devices. Both methods start from the same device
arrays and end with the same device arrays (same shardings), so each number is end to end:

    ours      CheckpointManager.save(..., wait=True) / .restore(...): orbax OCDBT files (fsync'd),
              plus the fingerprints computed on save and checked on restore
    blocking  the part of an async save the training loop waits for (until save() returns);
              for numpy, which is synchronous, the whole save
    numpy     np.asarray + np.save (+ fsync) per array / np.load + jax.device_put per array

MB/s = state bytes (10^6) / seconds. Ours and numpy run in turn, --repeats rounds (ours, numpy, ours,
...); each rate is reported as median and min-max over the rounds. Reads come from the page cache
(the files were just written): it measures software overhead, not the disk. The machine, software
and load come first (bench/machine.py).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import machine  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=384, help="state size in MB (params + 2 Adam moments)")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices when running on CPU")
    p.add_argument("--mp", type=int, default=None, help="model-parallel size (default: all devices)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    machine.add_args(p)
    return p.parse_args()


def make_state(mb: int, mp: int):
    """{"params", "mu", "nu"}: layer-stacked [L, D, 4D] / [L, 4D, D] matrices, float32, split over mp."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from mesh_transformer import parallel

    mesh = parallel.make_mesh(mp)
    d, layers = 512, 4
    per_tree = mb * 10**6 // 3
    n_pairs = max(1, per_tree // (2 * layers * d * 4 * d * 4))
    rng = np.random.default_rng(0)

    def tree():
        out = {}
        for i in range(n_pairs):
            out[f"block_{i}/fc_in"] = (rng.standard_normal((layers, d, 4 * d), np.float32), P(None, None, "mp"))
            out[f"block_{i}/fc_out"] = (rng.standard_normal((layers, 4 * d, d), np.float32), P(None, "mp", None))
        return {k: jax.device_put(x, NamedSharding(mesh, spec)) for k, (x, spec) in out.items()}

    return {"params": tree(), "mu": tree(), "nu": tree()}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_ours(state, root: str, repeats: int = 1) -> dict:
    import jax

    from mesh_transformer.io.checkpoint import CheckpointManager

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    save, blocking, restore = [], [], []
    for i in range(repeats):
        directory = os.path.join(root, f"ours_{i}")
        ckpt = CheckpointManager(directory, keep_last=1)
        start = time.perf_counter()
        ckpt.save(1, state)
        blocking.append(time.perf_counter() - start)
        ckpt.wait()
        save.append(time.perf_counter() - start)
        reader = CheckpointManager(directory, read_only=True)
        restore.append(timed(lambda: jax.block_until_ready(reader.restore(abstract_state=abstract))))
        ckpt.close()
        shutil.rmtree(directory)
    return {"save_s": min(save), "blocking_s": min(blocking), "restore_s": min(restore)}


def bench_numpy(state, root: str, repeats: int = 1) -> dict:
    import jax
    import numpy as np

    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    names = [f"{i}.npy" for i in range(len(flat))]

    def save(directory):
        os.makedirs(directory)
        for name, (_, x) in zip(names, flat):
            with open(os.path.join(directory, name), "wb") as f:
                np.save(f, np.asarray(x))
                f.flush()
                os.fsync(f.fileno())

    def load(directory):
        arrays = [jax.device_put(np.load(os.path.join(directory, name)), x.sharding)
                  for name, (_, x) in zip(names, flat)]
        jax.block_until_ready(arrays)

    times_save, times_load = [], []
    for i in range(repeats):
        directory = os.path.join(root, f"numpy_{i}")
        times_save.append(timed(lambda: save(directory)))
        times_load.append(timed(lambda: load(directory)))
        shutil.rmtree(directory)
    return {"save_s": min(times_save), "blocking_s": min(times_save), "restore_s": min(times_load)}


def main():
    args = parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if os.environ["JAX_PLATFORMS"] == "cpu" and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    description = machine.describe()
    import jax

    from mesh_transformer import parallel

    mp = args.mp or len(jax.devices())
    state = make_state(args.mb, mp)
    megabytes = parallel.bytes_of(state) / 1e6
    root = tempfile.mkdtemp(prefix="ckpt_bench_", dir=args.dir)
    rounds = {"ours": [], "numpy": []}
    try:
        for _ in range(args.repeats):  # interleaved: a change of load hits both alike
            rounds["ours"].append(bench_ours(state, root))
            rounds["numpy"].append(bench_numpy(state, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results = {}
    for name, runs in rounds.items():
        results[name] = {key: machine.summary([r[key] for r in runs]) for key in runs[0]}
        for key in ("save", "blocking", "restore"):
            results[name][f"{key}_mb_s"] = machine.summary([megabytes / r[f"{key}_s"] for r in runs])
    report = {"state_mb": megabytes, "devices": len(jax.devices()), "mp": mp, "backend": jax.default_backend(),
              "repeats": args.repeats, "results": results}
    def text():
        print(f"state {megabytes:.0f} MB on {report['devices']} {report['backend']} devices (mp={mp}), "
              f"{args.repeats} interleaved rounds; MB/s as median (min-max)")
        print(f"{'method':<8} {'save MB/s':>18} {'blocking s':>11} {'restore MB/s':>18}")
        for name, r in results.items():
            print(f"{name:<8} {machine.fmt(r['save_mb_s']):>18} {r['blocking_s']['median']:>11.2f} "
                  f"{machine.fmt(r['restore_mb_s']):>18}")
    machine.report(description, report, args.json, text)


if __name__ == "__main__":
    main()
