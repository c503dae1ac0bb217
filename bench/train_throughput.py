"""Training throughput on this machine: mesh-transformer vs HF transformers (torch) on the same model.

    .venv/bin/python bench/train_throughput.py [--family gptj|llama|mixtral|... (bench/families.py)]
                                               [--layers 4 --d-model 512 --seq 256 --batch 4]
                                               [--steps 4 --rounds 3] [--loss-chunk N] [--json]

Both train the same config (fp32, AdamW, same batch); the transformers model is built from ours
through the library's HF export mapping (each family's shape: bench/families.py). Ours runs twice:
on one CPU device, and on one simulated device per core with the model split over them (mp = cores),
which is how this library uses a multi-core CPU. Each side runs in a process of its own, as a user
runs one of them: ours under the library's malloc setting (device_train.py's,
mesh_transformer/host_memory.py) with as many devices as it uses, and torch with a thread per core,
twice: under the same malloc setting (the reference: the same allocator on both sides, so the ratio
compares the computation) and under glibc's default, as a script using transformers runs out of the
box. After compiling and 2 warm-up steps each (more, up to 24, until 3 steps in a row fault no fresh
memory in), the sides run `--steps` timed steps in turn, `--rounds` times (ours, ours mp, torch,
torch with glibc's malloc, ours, ...), and each reports the median and min-max of its rounds.
Reports tokens/s, model FLOP utilisation (MFU = tokens/s x training FLOPs per token / peak matmul
FLOP/s), the peak matmul rate measured with both frameworks (MFU uses the higher) and the fresh
memory each round touched (page faults, which the kernel zero-fills: a cost of the allocator, not of
the step), after the machine, software and load (bench/machine.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import families  # noqa: E402
import machine  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    families.add_shape_args(p, vocab=50257)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="timed steps per round (after 2 warm-up steps)")
    p.add_argument("--loss-chunk", type=int, default=0, metavar="N",
                   help="one more side: ours on 1 device with the config's loss_chunk N (the head and loss N tokens "
                        "at a time), in the same rounds as the others")
    p.add_argument("--expert-parallel", action="store_true",
                   help="--family mixtral: ours on mp devices with each expert's d_ff split against the experts "
                        "split whole (expert_parallel), and torch (the 1-device and glibc sides left out: memory)")
    machine.add_args(p, rounds=3)
    return p.parse_args(argv)


def peak_matmul_flops(n=2048, repeats=10) -> dict:
    import jax
    import jax.numpy as jnp
    import torch
    a = jnp.asarray(np.random.rand(n, n).astype(np.float32))
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(repeats):
        f(a).block_until_ready()
    jax_rate = 2 * n**3 * repeats / (time.perf_counter() - t0)
    ta = torch.rand(n, n)
    ta @ ta
    t0 = time.perf_counter()
    for _ in range(repeats):
        ta @ ta
    torch_rate = 2 * n**3 * repeats / (time.perf_counter() - t0)
    return {"jax": jax_rate, "torch": torch_rate, "peak": max(jax_rate, torch_rate)}


def timed_steps(step, steps: int):
    """Settle the heap (`machine.settle`), then return a callable that times `steps` more and returns
    seconds per step."""
    machine.settle(step)

    def measure() -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - t0) / steps
    return measure


def make_config(args, mp: int = 1, dp: int = 1, **overrides):
    """Our Config for the benchmark's model on dp x mp devices (`overrides`: more config keys)."""
    from mesh_transformer.config import config_from_dict
    keys = dict(layers=args.layers, d_model=args.d_model, n_heads=args.heads, n_vocab=args.vocab, seq=args.seq,
                compute_dtype="float32", remat="none", per_replica_batch=args.batch // dp, cores_per_replica=mp,
                lr=1e-4, warmup_steps=0, anneal_steps=1000, total_steps=1000, weight_decay=0.1, clip_norm=1.0)
    family = overrides.pop("family", getattr(args, "family", "gptj"))
    keys.update({"family": family, **families.family_keys(family, args.d_model, args.heads, args.layers)})
    return config_from_dict({**keys, **overrides})


def make_trainer(args, mp: int = 1, dp: int = 1, **overrides):
    """Our Trainer for the benchmark's config on dp x mp CPU devices (`overrides`: more config keys)."""
    import jax
    from mesh_transformer import parallel
    from mesh_transformer.train.step import Trainer
    return Trainer(make_config(args, mp, dp, **overrides), parallel.make_mesh(mp, dp, jax.devices()[: dp * mp]))


def batch_tokens(args) -> np.ndarray:
    """The batch every side trains on: [batch, seq + 1] token ids."""
    return np.random.RandomState(0).randint(0, args.vocab, (args.batch, args.seq + 1)).astype(np.int32)


def bench_ours(args, mp: int = 1, expert_parallel: bool = False, loss_chunk: int = 0):
    """In this side's process: our training step on `mp` devices under the library's malloc setting,
    as device_train.py runs it -> a callable timing `args.steps` steps: seconds per step."""
    from mesh_transformer import host_memory
    host_memory.keep_freed_memory()
    import jax
    trainer = make_trainer(args, mp, **({"expert_parallel": True} if expert_parallel else {}),
                           **({"loss_chunk": loss_chunk} if loss_chunk else {}))
    box = {"state": trainer.init_state(0)}
    batch = trainer.shard_batch({"tokens": batch_tokens(args)[None]})

    def step():
        box["state"], metrics = trainer.step(box["state"], batch)
        jax.block_until_ready(metrics)
    return timed_steps(step, args.steps)


def bench_torch(args, threads: int, keep_freed: bool = True):
    """In this side's process: the transformers twin of our config + torch AdamW on `threads`
    threads, under the library's malloc setting (`keep_freed`) or glibc's default -> a callable
    timing `args.steps` steps: seconds per step."""
    if keep_freed:
        from mesh_transformer import host_memory
        host_memory.keep_freed_memory()
    import torch
    torch.set_num_threads(threads)
    model = families.hf_model(make_config(args).model).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    inputs = torch.tensor(batch_tokens(args), dtype=torch.long)

    def step():
        loss = model(inputs[:, :-1], labels=inputs[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return timed_steps(step, args.steps)


TORCH = "transformers (torch)"  # the reference side: torch under the same malloc setting as ours


def devices_flag(n: int) -> dict:
    """The environment a side's process needs for `n` CPU devices."""
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f)
    return {"XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={n}".strip()}


def main():
    args = parse_args()
    cores = os.cpu_count() or 1
    description = machine.describe()
    peak = peak_matmul_flops()
    kv_heads = families.family_keys(args.family, args.d_model, args.heads, args.layers).get("n_kv_heads", args.heads)
    # kv heads split over mp, or (fewer of them than cores) each held whole by cores / kv_heads shards
    mp = cores if args.heads % cores == 0 and (kv_heads % cores == 0 or cores % kv_heads == 0) else 1
    config = make_config(args)
    if args.expert_parallel:
        sides = {f"mesh-transformer, mp={mp}": machine.Apart(f"ours, mp={mp}", bench_ours, args, mp,
                                                             env=devices_flag(mp)),
                 f"mesh-transformer, mp={mp}, experts split": machine.Apart(
                     f"ours, mp={mp}, expert-parallel", bench_ours, args, mp, True, env=devices_flag(mp)),
                 TORCH: machine.Apart("torch", bench_torch, args, cores)}
    else:
        sides = {"mesh-transformer, 1 device": machine.Apart("ours, 1 device", bench_ours, args, 1,
                                                             env=devices_flag(1)),
                 f"mesh-transformer, mp={mp}": machine.Apart(f"ours, mp={mp}", bench_ours, args, mp,
                                                             env=devices_flag(mp)),
                 TORCH: machine.Apart("torch", bench_torch, args, cores),
                 "transformers, glibc malloc": machine.Apart("torch, glibc's malloc", bench_torch, args, cores,
                                                             False)}
        if args.loss_chunk:
            sides[f"ours, 1 device, loss_chunk {args.loss_chunk}"] = machine.Apart(
                f"ours, 1 device, loss_chunk {args.loss_chunk}", bench_ours, args, 1, False, args.loss_chunk,
                env=devices_flag(1))
    try:
        seconds = machine.interleaved(sides, args.rounds, progress=not args.json, faults=True)
    finally:
        for side in sides.values():
            side.close()
    tokens_per_step = args.batch * args.seq
    flops = config.model.flops_per_token()
    rows = {}
    for name, s in seconds.items():
        rate = machine.summary([tokens_per_step / x for x in s["runs"]])
        rows[name] = {"step_s": s, "tokens_per_s": rate, "mfu": rate["median"] * flops / peak["peak"]}
    torch_rate = rows[TORCH]["tokens_per_s"]["median"]
    speedups = {name: r["tokens_per_s"]["median"] / torch_rate for name, r in rows.items() if name != TORCH}
    results = {"config": vars(args), "flops_per_token": flops, "peak_matmul_flops": peak, "sides": rows,
               "speedup_vs_torch": speedups}

    def text():
        print(f"{args.family}: {args.layers} layers, d_model {args.d_model}, {args.heads} heads "
              f"({config.model.kv_heads} key/value), d_ff {config.model.ff_dim}, {config.model.n_params() / 1e6:.1f}M parameters")
        print(f"peak matmul: {peak['peak'] / 1e9:.1f} GFLOP/s (jax {peak['jax'] / 1e9:.1f}, torch {peak['torch'] / 1e9:.1f}); "
              f"{args.rounds} rounds x {args.steps} steps, interleaved; each side in its own process "
              + ("(malloc: the library's setting)" if args.expert_parallel
                 else "(malloc: the library's setting, but the last row's glibc default)"))
        print(f"{'':28s} {'step s':>8s} {'tokens/s median (min-max)':>26s} {'MFU':>6s} {'MFU vs torch peak':>18s} {'vs torch':>9s}  faulted MB per round")
        for name, r in rows.items():
            t = r["tokens_per_s"]
            print(f"{name:28s} {r['step_s']['median']:8.3f} {machine.fmt(t):>26s} {100 * r['mfu']:5.1f}% "
                  f"{100 * t['median'] * flops / peak['torch']:17.1f}% {t['median'] / torch_rate:8.2f}x  "
                  + " / ".join(f"{mb:.0f}" for mb in r["step_s"]["faulted_mb"]))
    machine.report(description, results, args.json, text)


if __name__ == "__main__":
    main()
