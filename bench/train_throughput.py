"""Training throughput on this machine: mesh-transformer vs HF transformers (torch) on the same GPT-J.

    .venv/bin/python bench/train_throughput.py [--layers 4 --d-model 512 --seq 256 --batch 4] [--json]

Both train the same config (fp32, AdamW, same batch) in the same run. Ours runs twice: on one
CPU device, and on one simulated device per core with the model split over them (mp = cores),
which is how this library uses a multi-core CPU (XLA runs each device's element-wise work on its
own thread). Reports tokens/s, model FLOP utilisation (MFU = tokens/s x training FLOPs per token /
peak matmul FLOP/s) and the peak matmul rate measured with both frameworks (MFU uses the higher).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=6, help="timed steps (after 2 warm-up steps)")
    p.add_argument("--json", action="store_true")
    return p.parse_args()


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


def bench_ours(args, tokens, dp=1, mp=1) -> float:
    import jax
    from mesh_transformer import parallel
    from mesh_transformer.config import config_from_dict
    from mesh_transformer.train.step import Trainer
    config = config_from_dict(dict(
        layers=args.layers, d_model=args.d_model, n_heads=args.heads, n_vocab=args.vocab, seq=args.seq,
        pe_rotary_dims=args.d_model // args.heads // 4, compute_dtype="float32", remat="none",
        per_replica_batch=args.batch // dp, cores_per_replica=mp, lr=1e-4, warmup_steps=0, anneal_steps=1000,
        total_steps=1000))
    trainer = Trainer(config, parallel.make_mesh(mp, dp, jax.devices()[: dp * mp]))
    state = trainer.init_state(0)
    batch = trainer.shard_batch({"tokens": tokens[None]})
    for _ in range(2):
        state, metrics = trainer.step(state, batch)
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        state, metrics = trainer.step(state, batch)
    jax.block_until_ready(metrics)
    return (time.perf_counter() - t0) / args.steps, config


def bench_torch(args, tokens) -> float:
    import torch
    from transformers import GPTJConfig, GPTJForCausalLM
    torch.manual_seed(0)
    model = GPTJForCausalLM(GPTJConfig(
        vocab_size=args.vocab, n_positions=args.seq, n_embd=args.d_model, n_layer=args.layers, n_head=args.heads,
        rotary_dim=args.d_model // args.heads // 4, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    inputs = torch.tensor(tokens, dtype=torch.long)

    def step():
        loss = model(inputs[:, :-1], labels=inputs[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    for _ in range(2):
        step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    return (time.perf_counter() - t0) / args.steps


def main():
    args = parse_args()
    cores = os.cpu_count() or 1
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={cores}"
    import torch
    torch.set_num_threads(os.cpu_count())
    tokens = np.random.RandomState(0).randint(0, args.vocab, (args.batch, args.seq + 1)).astype(np.int32)
    peak = peak_matmul_flops()
    ours_s, config = bench_ours(args, tokens)
    mp = cores if args.heads % cores == 0 else 1
    ours_mp_s, _ = bench_ours(args, tokens, mp=mp)
    torch_s = bench_torch(args, tokens)
    tokens_per_step = args.batch * args.seq
    flops = config.model.flops_per_token()
    rows = {}
    for name, seconds in [("mesh-transformer, 1 device", ours_s), (f"mesh-transformer, mp={mp}", ours_mp_s),
                          ("transformers (torch)", torch_s)]:
        rate = tokens_per_step / seconds
        rows[name] = {"step_s": seconds, "tokens_per_s": rate, "mfu": rate * flops / peak["peak"]}
    result = {"config": vars(args), "flops_per_token": flops, "peak_matmul_flops": peak, "results": rows,
              "speedup_vs_torch": torch_s / min(ours_s, ours_mp_s)}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"peak matmul: {peak['peak'] / 1e9:.1f} GFLOP/s (jax {peak['jax'] / 1e9:.1f}, torch {peak['torch'] / 1e9:.1f})")
    print(f"{'':28s} {'step s':>8s} {'tokens/s':>10s} {'MFU':>6s} {'MFU vs torch peak':>18s}")
    for name, r in rows.items():
        print(f"{name:28s} {r['step_s']:8.3f} {r['tokens_per_s']:10.0f} {100 * r['mfu']:5.1f}% "
              f"{100 * r['tokens_per_s'] * flops / peak['torch']:17.1f}%")
    print(f"speed-up vs torch: {result['speedup_vs_torch']:.2f}x")


if __name__ == "__main__":
    main()
