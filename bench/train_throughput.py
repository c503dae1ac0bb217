"""Training throughput on this machine: mesh-transformer vs HF transformers (torch) on the same model.

    .venv/bin/python bench/train_throughput.py [--family gptj|llama|gpt_neox|gpt2|opt]
                                               [--layers 4 --d-model 512 --seq 256 --batch 4]
                                               [--steps 4 --rounds 3] [--json]

Both train the same config (fp32, AdamW, same batch) in the same process; the transformers model is
built from ours through the library's HF export mapping (each family's shape:
bench/families.py). Ours runs twice: on one CPU device, and on one simulated device per core with
the model split over them (mp = cores), which is how this library uses a multi-core CPU. After
compiling and 2 warm-up steps each (up to 10 while a step still faults fresh memory in), the three
sides run `--steps` timed steps in turn, `--rounds` times (ours, ours mp, torch, ours, ...), and
each reports the median and min-max of its rounds. Reports tokens/s, model FLOP utilisation (MFU =
tokens/s x training FLOPs per token / peak matmul FLOP/s), the peak matmul rate measured with both
frameworks (MFU uses the higher) and the fresh memory each round touched (page faults, which the
kernel zero-fills: a cost of the allocator, not of the step; mesh_transformer/host_memory.py),
after the machine, software and load (bench/machine.py).
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
    families.add_arg(p)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="timed steps per round (after 2 warm-up steps)")
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


def timed_steps(step, steps: int, warmup: int = 2, settle: int = 10):
    """Run `warmup` steps now, and more (up to `settle` in all) while a step still touches fresh
    memory (the heap grows to its peak over the first steps: mesh_transformer/host_memory.py);
    return a callable that times `steps` more and returns seconds per step."""
    for done in range(settle):
        faults = machine.minor_faults()
        step()
        if done + 1 >= warmup and (machine.minor_faults() - faults) * machine.PAGE < 16 << 20:
            break

    def measure() -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - t0) / steps
    return measure


def make_trainer(args, mp: int = 1, dp: int = 1, **overrides):
    """Our Trainer for the benchmark's config on dp x mp CPU devices (`overrides`: more config keys)."""
    import jax
    from mesh_transformer import parallel
    from mesh_transformer.config import config_from_dict
    from mesh_transformer.train.step import Trainer
    keys = dict(layers=args.layers, d_model=args.d_model, n_heads=args.heads, n_vocab=args.vocab, seq=args.seq,
                compute_dtype="float32", remat="none", per_replica_batch=args.batch // dp, cores_per_replica=mp,
                lr=1e-4, warmup_steps=0, anneal_steps=1000, total_steps=1000, weight_decay=0.1, clip_norm=1.0)
    family = overrides.pop("family", getattr(args, "family", "gptj"))
    keys.update(family=family, **families.family_keys(family, args.d_model, args.heads))
    config = config_from_dict({**keys, **overrides})
    return Trainer(config, parallel.make_mesh(mp, dp, jax.devices()[: dp * mp]))


def bench_ours(args, tokens, dp=1, mp=1):
    """-> (a callable timing `args.steps` steps: seconds per step, the config)."""
    import jax
    trainer = make_trainer(args, mp, dp)
    box = {"state": trainer.init_state(0)}
    batch = trainer.shard_batch({"tokens": tokens[None]})

    def step():
        box["state"], metrics = trainer.step(box["state"], batch)
        jax.block_until_ready(metrics)
    return timed_steps(step, args.steps), trainer.config


def bench_torch(args, tokens, config):
    """-> a callable timing `args.steps` steps of the transformers twin of `config` + torch AdamW:
    seconds per step."""
    import torch
    model = families.hf_model(config.model).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    inputs = torch.tensor(tokens, dtype=torch.long)

    def step():
        loss = model(inputs[:, :-1], labels=inputs[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return timed_steps(step, args.steps)


def main():
    args = parse_args()
    from mesh_transformer import host_memory
    host_memory.keep_freed_memory()  # as device_train.py does; the in-process torch side gets it too (README)
    cores = os.cpu_count() or 1
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={cores}"
    description = machine.describe()
    import torch
    torch.set_num_threads(cores)
    tokens = np.random.RandomState(0).randint(0, args.vocab, (args.batch, args.seq + 1)).astype(np.int32)
    peak = peak_matmul_flops()
    kv_heads = families.family_keys(args.family, args.d_model, args.heads).get("n_kv_heads", args.heads)
    mp = cores if args.heads % cores == 0 and kv_heads % cores == 0 else 1
    ours, config = bench_ours(args, tokens)
    sides = {"mesh-transformer, 1 device": ours, f"mesh-transformer, mp={mp}": bench_ours(args, tokens, mp=mp)[0],
             "transformers (torch)": bench_torch(args, tokens, config)}
    seconds = machine.interleaved(sides, args.rounds, progress=not args.json, faults=True)
    tokens_per_step = args.batch * args.seq
    flops = config.model.flops_per_token()
    rows = {}
    for name, s in seconds.items():
        rate = machine.summary([tokens_per_step / x for x in s["runs"]])
        rows[name] = {"step_s": s, "tokens_per_s": rate, "mfu": rate["median"] * flops / peak["peak"]}
    torch_rate = rows["transformers (torch)"]["tokens_per_s"]["median"]
    speedups = {name: r["tokens_per_s"]["median"] / torch_rate for name, r in rows.items() if "torch" not in name}
    results = {"config": vars(args), "flops_per_token": flops, "peak_matmul_flops": peak, "sides": rows,
               "speedup_vs_torch": speedups}

    def text():
        print(f"{args.family}: {args.layers} layers, d_model {args.d_model}, {args.heads} heads "
              f"({config.model.kv_heads} key/value), d_ff {config.model.ff_dim}, {config.model.n_params() / 1e6:.1f}M parameters")
        print(f"peak matmul: {peak['peak'] / 1e9:.1f} GFLOP/s (jax {peak['jax'] / 1e9:.1f}, torch {peak['torch'] / 1e9:.1f}); "
              f"{args.rounds} rounds x {args.steps} steps, interleaved")
        print(f"{'':28s} {'step s':>8s} {'tokens/s median (min-max)':>26s} {'MFU':>6s} {'MFU vs torch peak':>18s} {'vs torch':>9s}  faulted MB per round")
        for name, r in rows.items():
            t = r["tokens_per_s"]
            print(f"{name:28s} {r['step_s']['median']:8.3f} {machine.fmt(t):>26s} {100 * r['mfu']:5.1f}% "
                  f"{100 * t['median'] * flops / peak['torch']:17.1f}% {t['median'] / torch_rate:8.2f}x  "
                  + " / ".join(f"{mb:.0f}" for mb in r["step_s"]["faulted_mb"]))
    machine.report(description, results, args.json, text)


if __name__ == "__main__":
    main()
