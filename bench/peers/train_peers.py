"""Training throughput next to the JAX peers a user would pick instead: EasyDeL (GPT-J) and MaxText (LLaMA).

    bash bench/peers/setup_easydel.sh && bash bench/peers/setup_maxtext.sh   # once: their own venvs
    .venv/bin/python bench/peers/train_peers.py [--layers 4 --d-model 512 --heads 8 --seq 256 --batch 4]
                                                [--steps 4 --rounds 2 --kinds ...] [--json]

Same shapes on every side: 4 layers, d_model 512, 8 heads, batch 4 x 256 tokens, float32, AdamW
(weight decay 0.1, clip 1.0), one CPU device, no rematerialisation where the peer lets us choose:

  ours-gptj      mesh-transformer's gptj family (rotary 1/4 of each head, parallel attention + MLP)
  easydel-gptj   EasyDeL 0.3's GPTJForCausalLM (compute_loss) + optax AdamW in one jitted step
                 (EasyDeL's GPT-J has no head bias; ours has HF's)
  ours-llama     mesh-transformer's llama family (RMSNorm, SwiGLU d_ff 2048, vocab --llama-vocab)
  maxtext-llama  MaxText 0.2.5's own training loop (maxtext.trainers.pre_train.train, decoder_block
                 llama2, remat_policy minimal, synthetic data, hardware=cpu); its per-step seconds

GPT-J uses vocabulary --vocab (50,257, GPT-2's), LLaMA --llama-vocab (32,000, MaxText's default).
Every measurement is a fresh process: compile, 2 warm-up steps (ours and EasyDeL: more, up to 24,
until 3 in a row fault no fresh memory in, as bench/train_throughput.py does: a step that grows the
heap by GBs takes 3x as long; MaxText's loop runs its own steps), then --steps timed steps (median
step time). The kinds run in turn, --rounds times (ours, peer, ours, peer, ...), and each reports
tokens/s as median and min-max over its rounds, after the machine, software and load.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
import machine  # noqa: E402

PYTHONS = {"easydel-gptj": os.path.join(HERE, ".venv-easydel", "bin", "python"),
           "maxtext-llama": os.path.join(HERE, ".venv-maxtext", "bin", "python")}
SETUP = {"easydel-gptj": "setup_easydel.sh", "maxtext-llama": "setup_maxtext.sh"}
KINDS = ("ours-gptj", "easydel-gptj", "ours-llama", "maxtext-llama")
PAIRS = {"easydel-gptj": "ours-gptj", "maxtext-llama": "ours-llama"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--d-ff", type=int, default=2048, help="LLaMA's SwiGLU width")
    p.add_argument("--vocab", type=int, default=50257, help="GPT-J's vocabulary")
    p.add_argument("--llama-vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="timed steps per run, after the warm-up")
    p.add_argument("--kinds", default=",".join(KINDS), help="which of " + ", ".join(KINDS))
    p.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    p.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    machine.add_args(p, rounds=2)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- workers (one process each)

def timed(step, steps: int) -> list[float]:
    """Each of `steps` steps' seconds, after the warm-up `machine.settle` gives every in-process side."""
    machine.settle(step)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def worker_ours(args, family: str) -> dict:
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=1"
    sys.path.insert(0, ROOT)
    from mesh_transformer import host_memory
    host_memory.keep_freed_memory()  # as device_train.py does (each kind runs in its own process)
    import jax
    import numpy as np
    import train_throughput
    vocab = args.vocab if family == "gptj" else args.llama_vocab
    overrides = {} if family == "gptj" else {"family": "llama", "d_ff": args.d_ff}
    trainer = train_throughput.make_trainer(argparse.Namespace(**{**vars(args), "vocab": vocab}), **overrides)
    tokens = np.random.RandomState(0).randint(0, vocab, (1, args.batch, args.seq + 1)).astype(np.int32)
    batch = trainer.shard_batch({"tokens": tokens})
    box = {"state": trainer.init_state(0)}

    def step():
        box["state"], metrics = trainer.step(box["state"], batch)
        jax.block_until_ready(metrics)
    return {"step_s": timed(step, args.steps)}


def worker_easydel(args) -> dict:
    import easydel as ed
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    config = ed.GPTJConfig(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.d_model, n_layer=args.layers,
                           n_head=args.heads, rotary_dim=args.d_model // args.heads // 4)
    model = ed.GPTJForCausalLM(config, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.random.RandomState(0).randint(0, args.vocab, (args.batch, args.seq)), jnp.int32)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4, weight_decay=0.1))
    with model.mesh:
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        box = {"params": params, "opt": tx.init(params)}

        def loss_fn(p, ids):
            return nnx.merge(graphdef, p, rest).compute_loss(input_ids=ids, labels=ids)[1].loss

        @jax.jit
        def train_step(p, o, ids):
            loss, grads = jax.value_and_grad(loss_fn)(p, ids)
            updates, o = tx.update(grads, o, p)
            return optax.apply_updates(p, updates), o, loss

        def step():
            box["params"], box["opt"], loss = train_step(box["params"], box["opt"], ids)
            loss.block_until_ready()
        times = timed(step, args.steps)
    return {"step_s": times, "versions": _versions("easydel", "jax", "flax")}


def worker_maxtext(args) -> dict:
    """MaxText's own loop in a subprocess of this venv's python; its logged seconds of steps 2.. ."""
    import maxtext
    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "maxtext.trainers.pre_train.train", base, "run_name=bench",
               f"base_output_directory={out}", "hardware=cpu", "skip_jax_distributed_system=true",
               "dataset_type=synthetic", f"base_num_decoder_layers={args.layers}", f"base_emb_dim={args.d_model}",
               f"base_num_query_heads={args.heads}", f"base_num_kv_heads={args.heads}", f"base_mlp_dim={args.d_ff}",
               f"head_dim={args.d_model // args.heads}", f"vocab_size={args.llama_vocab}",
               f"per_device_batch_size={args.batch}", f"max_target_length={args.seq}", f"steps={args.steps + 2}",
               "dtype=float32", "weight_dtype=float32", "enable_checkpointing=false", "remat_policy=minimal",
               "enable_tensorboard=false", "gradient_clipping_threshold=1.0", "adam_weight_decay=0.1"]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=out,
                              env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"})
    if proc.returncode:
        raise SystemExit(f"MaxText exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    seconds = {int(m[1]): float(m[2]) for m in re.finditer(r"completed step: (\d+), seconds: ([\d.]+)", proc.stderr)}
    return {"step_s": [seconds[s] for s in sorted(seconds) if s >= 2], "versions": _versions("maxtext", "jax")}


def _versions(*names) -> dict:
    import importlib.metadata
    return {n: importlib.metadata.version(n) for n in names}


# ----------------------------------------------------------------------------- driver

def run_worker(args, kind: str, argv: list[str]) -> dict:
    python = PYTHONS.get(kind, sys.executable)
    if not os.path.exists(python):
        sys.exit(f"{python} not found: run bash bench/peers/{SETUP[kind]} first")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")} if kind in PYTHONS else os.environ
    proc = subprocess.run([python, os.path.abspath(__file__), *argv, "--worker", kind], capture_output=True,
                          text=True, env={**env, "JAX_PLATFORMS": "cpu"}, cwd=ROOT, timeout=args.timeout)
    if proc.returncode:
        sys.exit(f"{kind} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        workers = {"ours-gptj": lambda: worker_ours(args, "gptj"), "ours-llama": lambda: worker_ours(args, "llama"),
                   "easydel-gptj": lambda: worker_easydel(args), "maxtext-llama": lambda: worker_maxtext(args)}
        print(json.dumps(workers[args.worker]()))
        return
    description = machine.describe()
    kinds = [k for k in KINDS if k in args.kinds.split(",")]
    tokens_per_step = args.batch * args.seq
    runs: dict[str, list] = {k: [] for k in kinds}

    def measure(kind):
        def once() -> float:
            runs[kind].append(run_worker(args, kind, argv))
            return tokens_per_step / statistics.median(runs[kind][-1]["step_s"])
        return once
    rates = machine.interleaved({k: measure(k) for k in kinds}, args.rounds, progress=not args.json)
    results = {"config": {k: v for k, v in vars(args).items() if k not in ("worker", "json")},
               "tokens_per_s": rates, "versions": {k: r[0]["versions"] for k, r in runs.items() if "versions" in r[0]},
               "speedup": {f"{PAIRS[k]} / {k}": rates[PAIRS[k]]["median"] / rates[k]["median"]
                           for k in kinds if k in PAIRS and PAIRS[k] in rates}}

    def text():
        print(f"{args.rounds} rounds, interleaved; each run: compile, warm-up steps until the heap settles, "
              f"{args.steps} timed steps")
        for kind, r in rates.items():
            print(f"{kind:16s} {machine.fmt(r):>24s} tokens/s  {results['versions'].get(kind, '')}")
        for pair, x in results["speedup"].items():
            print(f"{pair}: {x:.2f}x")
    machine.report(description, results, args.json, text)


if __name__ == "__main__":
    main()
