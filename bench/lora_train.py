"""LoRA training throughput and memory: ours (LoRA and full fine-tuning of the same model) next to
PEFT + HF transformers on torch training the same LoRA config.

    bash bench/setup_peft_venv.sh          # once: the peer's own venv, bench/.venv-peft
    python bench/lora_train.py [--family gptj --layers 4 --d-model 512 --heads 8 --vocab 50400 --seq 256
                                --batch 4 --rank 16 --alpha 32 --targets q_proj,v_proj --runs 3 --steps 5
                                --mp 1] [--json]
    python bench/lora_train.py --family mixtral --targets q_proj,v_proj,experts.gate_up_proj,experts.down_proj

Every measurement is a fresh subprocess (so peak memory is its own): ours with LoRA, the peer
(bench/.venv-peft's python: the family's transformers model + peft.get_peft_model +
torch.optim.AdamW), ours with full fine-tuning, in turn, `--runs` rounds. All train the family's
benchmark shape (bench/families.py; the peer's model from our config through the library's HF
export mapping, made by the driver and handed to the peer as its config.json dict) in fp32 with
AdamW (weight decay 0.1, clip 1.0) on the same random batch; LoRA with the same rank, alpha,
targets and dropout. A mixture's experts are targeted as `experts.gate_up_proj` and
`experts.down_proj`, PEFT's `target_parameters` (it merges each adapted expert stack into a copy
of the weights every forward; ours multiplies each routed row by its expert's A and B). A run's
rate is tokens per step / its median step time (after 2 warm-up steps); reported: median and
min–max over the runs. Memory: the process's peak RSS, and how far it rose above the RSS after
imports (the model, optimizer and step's own); for ours also XLA's buffer assignment of the
compiled step (arguments + temporaries). Prints the machine, software and load average around
the runs (bench/machine.py): the machine may be shared, so read the numbers with the load.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PEER_PYTHON = os.path.join(HERE, ".venv-peft", "bin", "python")
sys.path.insert(0, HERE)
import families  # noqa: E402
import machine  # noqa: E402
KINDS = ("ours-lora", "peft-lora", "ours-full")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    families.add_shape_args(p, vocab=50400)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--targets", default="q_proj,v_proj",
                   help="comma-separated HF module names (PEFT's target_modules) and experts.gate_up_proj, "
                        "experts.down_proj (its target_parameters)")
    p.add_argument("--quantize-base", choices=("int8",),
                   help="ours: the frozen base's matmul weights in int8 (lora.quantize_base; the peer stays fp32)")
    p.add_argument("--runs", type=int, default=3, help="rounds of (ours LoRA, peer LoRA, ours full)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per run, after 2 warm-up steps")
    p.add_argument("--mp", type=int, default=1, help="ours: CPU devices the model is split over (mp)")
    p.add_argument("--kinds", default=",".join(KINDS), help="which of " + ", ".join(KINDS))
    p.add_argument("--peer-python", default=PEER_PYTHON)
    machine.add_args(p)
    p.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    p.add_argument("--hf-config", help=argparse.SUPPRESS)  # the peer's model, as config.json (from the driver)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- workers (one process each)

def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mib() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(step, args) -> list[float]:
    for _ in range(2):
        step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def tokens(args):
    import numpy as np
    return np.random.RandomState(0).randint(0, args.vocab, (args.batch, args.seq + 1)).astype(np.int32)


def config_keys(args, lora: bool) -> dict:
    """Our config for the benchmark's model (and LoRA)."""
    keys = dict(layers=args.layers, d_model=args.d_model, n_heads=args.heads, n_vocab=args.vocab, seq=args.seq,
                compute_dtype="float32", remat="none", per_replica_batch=args.batch, cores_per_replica=args.mp,
                lr=1e-4, warmup_steps=0, anneal_steps=1000, total_steps=1000, weight_decay=0.1, clip_norm=1.0,
                family=args.family, **families.family_keys(args.family, args.d_model, args.heads, args.layers))
    if lora:
        keys["lora"] = {"rank": args.rank, "alpha": args.alpha, "dropout": args.dropout,
                        "targets": args.targets.split(","), "quantize_base": args.quantize_base}
    return keys


def peer_config(args) -> str:
    """In the driver: the peer's transformers config (config.json's dict, JSON) of our model."""
    from mesh_transformer.config import config_from_dict
    from mesh_transformer.io.hf import config_to_hf
    hf = config_to_hf(config_from_dict(config_keys(args, False)).model)
    for key in ("torch_dtype", "dtype", "architectures"):
        hf.pop(key, None)
    return json.dumps(hf)


def worker_ours(args, lora: bool) -> dict:
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.mp}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, ROOT)
    from mesh_transformer import host_memory
    host_memory.keep_freed_memory()  # as device_train.py runs
    import jax
    from mesh_transformer import parallel
    from mesh_transformer.config import config_from_dict
    from mesh_transformer.train.step import Trainer
    base_rss = rss_mib()
    keys = config_keys(args, lora)
    trainer = Trainer(config_from_dict(keys), parallel.make_mesh(args.mp, 1, jax.devices()[: args.mp]))
    if lora:
        trainer.base = trainer.init_base(0)
    batch = trainer.shard_batch({"tokens": tokens(args)[None]})
    return timed_trainer(trainer, batch, args, base_rss)


def timed_trainer(trainer, batch, args, base_rss: float) -> dict:
    """A worker's measurement of our `trainer`'s step on `batch` from a fresh state: its step times
    (`timed`), memory (peak RSS, XLA's buffer assignment of the compiled step), trainable parameters."""
    import jax
    state = trainer.init_state(0)
    mem = trainer.step.lower(state, batch).compile().memory_analysis()
    box = {"state": state}

    def step():
        box["state"], metrics = trainer.step(box["state"], batch)
        jax.block_until_ready(metrics)
    times = timed(step, args)
    return {"step_s": times, "rss_after_imports_mib": base_rss, "peak_rss_mib": peak_rss_mib(),
            "trainable_params": int(sum(x.size for x in jax.tree.leaves(state.params))),
            "xla_arguments_mib": mem.argument_size_in_bytes / 2**20 if mem else None,
            "xla_temporaries_mib": mem.temp_size_in_bytes / 2**20 if mem else None}


def peer_hf_config(args):
    """In a peer's worker: the transformers config of the driver's `--hf-config`, dropout off
    (whatever the family calls it)."""
    from transformers import AutoConfig
    hf = json.loads(args.hf_config)
    config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    for key, value in config.to_dict().items():
        if key.endswith(("pdrop", "dropout")) and isinstance(value, float):
            setattr(config, key, 0.0)
    return config


def worker_peft(args) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(os.cpu_count() or 1)
    base_rss = rss_mib()
    config = peer_hf_config(args)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    targets = args.targets.split(",")
    parameters = [t for t in targets if t.startswith("experts.")]
    model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=args.dropout,
                                             target_modules=[t for t in targets if t not in parameters],
                                             target_parameters=parameters or None, bias="none",
                                             task_type="CAUSAL_LM")).train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.1)
    inputs = torch.tensor(tokens(args), dtype=torch.long)

    def step():
        loss = model(input_ids=inputs[:, :-1], labels=inputs[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    times = timed(step, args)
    import peft
    import transformers
    return {"step_s": times, "rss_after_imports_mib": base_rss, "peak_rss_mib": peak_rss_mib(),
            "trainable_params": int(sum(p.numel() for p in trainable)),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "peft": peft.__version__}}


# ----------------------------------------------------------------------------- driver

def run_worker(args, kind: str, argv: list[str], peer: bool, script: str = __file__,
               setup: str = "bench/setup_peft_venv.sh") -> dict:
    """`script --worker kind` in a process of its own (the peer's in its venv, given its model as
    --hf-config) -> the JSON it prints last."""
    python = args.peer_python if peer else sys.executable
    if peer and not os.path.exists(python):
        sys.exit(f"{python} not found: run bash {setup} first")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} if peer else os.environ
    extra = ["--hf-config", args.hf_config] if peer else []
    proc = subprocess.run([python, os.path.abspath(script), *argv, "--worker", kind, *extra], capture_output=True,
                          text=True, env=env, cwd=ROOT)
    if proc.returncode:
        sys.exit(f"{kind} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def rounds(args, kinds: list[str], run_one) -> dict[str, list]:
    """`run_one(kind)` for every kind in turn, `args.runs` rounds (machine.interleaved) -> {kind: its runs}."""
    runs: dict[str, list] = {k: [] for k in kinds}

    def measure(kind):
        def once() -> float:
            runs[kind].append(run_one(kind))
            return args.batch * args.seq / statistics.median(runs[kind][-1]["step_s"])
        return once
    machine.interleaved({k: measure(k) for k in kinds}, args.runs, progress=not args.json)
    return runs


def summary(args, runs: list[dict]) -> dict:
    tokens_per_step = args.batch * args.seq
    rates = [tokens_per_step / statistics.median(r["step_s"]) for r in runs]
    peaks = [r["peak_rss_mib"] for r in runs]
    rises = [r["peak_rss_mib"] - r["rss_after_imports_mib"] for r in runs]
    out = {"tokens_per_s": {"median": statistics.median(rates), "min": min(rates), "max": max(rates), "runs": rates},
           "peak_rss_mib": statistics.median(peaks), "peak_rss_above_imports_mib": statistics.median(rises),
           "trainable_params": runs[0]["trainable_params"]}
    for key in ("xla_arguments_mib", "xla_temporaries_mib", "versions"):
        if runs[0].get(key) is not None:
            out[key] = runs[0][key]
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        result = worker_peft(args) if args.worker == "peft-lora" else worker_ours(args, args.worker == "ours-lora")
        print(json.dumps(result))
        return
    kinds = [k for k in KINDS if k in args.kinds.split(",")]
    sys.path.insert(0, ROOT)
    args.hf_config = peer_config(args) if "peft-lora" in kinds else None
    description = machine.describe(("peft",))
    runs = rounds(args, kinds, lambda kind: run_worker(args, kind, argv, peer=kind == "peft-lora"))
    results = {k: summary(args, v) for k, v in runs.items()}
    result = {"config": {k: v for k, v in vars(args).items() if k not in ("worker", "json", "peer_python", "hf_config")},
              "kinds": results}
    if "ours-lora" in results and "peft-lora" in results:
        result["lora_speedup_vs_peft"] = results["ours-lora"]["tokens_per_s"]["median"] / results["peft-lora"]["tokens_per_s"]["median"]
    if "ours-lora" in results and "ours-full" in results:
        result["lora_speedup_vs_full"] = results["ours-lora"]["tokens_per_s"]["median"] / results["ours-full"]["tokens_per_s"]["median"]
    machine.report(description, result, args.json, lambda: text(result))


def text(result):
    results = result["kinds"]
    print(f"{'':24s} {'trainable':>11s} {'tokens/s (median, min-max)':>28s} {'peak RSS':>9s} {'above imports':>14s} "
          f"{'XLA args + temps':>17s}")
    names = {"ours-lora": "mesh-transformer LoRA", "peft-lora": "PEFT + transformers", "ours-full": "mesh-transformer full"}
    for kind, s in results.items():
        t = s["tokens_per_s"]
        xla = (f"{s['xla_arguments_mib']:.0f} + {s['xla_temporaries_mib']:.0f} MiB" if "xla_temporaries_mib" in s else "")
        print(f"{names[kind]:24s} {s['trainable_params']:11,d} {t['median']:9.0f} ({t['min']:.0f}-{t['max']:.0f}){'':8s} "
              f"{s['peak_rss_mib']:6.0f} MiB {s['peak_rss_above_imports_mib']:10.0f} MiB {xla:>17s}")
    for key in ("lora_speedup_vs_peft", "lora_speedup_vs_full"):
        if key in result:
            print(f"{key}: {result[key]:.2f}x")


if __name__ == "__main__":
    main()
