"""Classifier fine-tuning throughput and memory: ours (config key "classify", full fine-tuning and
LoRA) next to HF transformers on torch training the family's ForSequenceClassification with
`labels` (what its Trainer and run_classification.py run), and PEFT's SEQ_CLS adapter for LoRA.

    bash bench/setup_peft_venv.sh          # once: the peer's own venv, bench/.venv-peft
    python bench/classify_train.py [--family gptj --layers 4 --d-model 512 --heads 8 --vocab 50400
                                    --seq 256 --batch 4 --labels 2 --rank 16 --alpha 32
                                    --targets q_proj,v_proj --runs 3 --steps 5 --mp 1] [--json]

Every measurement is a fresh subprocess (its own peak memory): ours full, transformers full, ours
LoRA, PEFT LoRA, in turn, `--runs` rounds (bench/machine.py interleaves them). All train the
family's benchmark shape (bench/families.py; the peer's model from our config through the
library's HF export mapping) with a score head of `--labels` outputs in fp32 with AdamW (weight
decay 0.1, clip 1.0) on the same batch: `--batch` texts of `--seq` random tokens (no padding:
the peer's pad id is one no text holds), each with a class; LoRA with the same rank, alpha and
targets, the score head trained whole beside the adapters on both sides (PEFT's modules_to_save).
A run's rate is tokens per step / its median step time after 2 warm-up steps; reported: median
and min-max over the runs, with peak RSS; after the machine, software and load (bench/machine.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import families  # noqa: E402
import lora_train  # noqa: E402  (the workers' helpers: RSS, timing, the model's config, the summary)
import machine  # noqa: E402
KINDS = ("ours-full", "hf-full", "ours-lora", "peft-lora")
NAMES = {"ours-full": "mesh-transformer, full", "hf-full": "transformers, full",
         "ours-lora": "mesh-transformer, LoRA", "peft-lora": "PEFT + transformers, LoRA"}
PEERS = ("hf-full", "peft-lora")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    families.add_shape_args(p, vocab=50400)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="texts a step")
    p.add_argument("--labels", type=int, default=2, help="classes (num_labels)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32)
    p.add_argument("--targets", default="q_proj,v_proj", help="comma-separated HF module names (PEFT's target_modules)")
    p.add_argument("--runs", type=int, default=3, help="rounds of every kind")
    p.add_argument("--steps", type=int, default=5, help="timed steps per run, after 2 warm-up steps")
    p.add_argument("--mp", type=int, default=1, help="ours: CPU devices the model is split over (mp)")
    p.add_argument("--kinds", default=",".join(KINDS), help="which of " + ", ".join(KINDS))
    p.add_argument("--peer-python", default=lora_train.PEER_PYTHON)
    machine.add_args(p)
    p.set_defaults(dropout=0.0, quantize_base=None)  # (what lora_train.config_keys reads)
    p.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    p.add_argument("--hf-config", help=argparse.SUPPRESS)  # the peer's model, as config.json (from the driver)
    return p.parse_args(argv)


def config_keys(args, lora: bool) -> dict:
    """Our config: lora_train's model (and LoRA), a classifier of `--labels` classes."""
    return {**lora_train.config_keys(args, lora), "num_labels": args.labels, "classify": {}}


def texts(args):
    """(tokens [batch, seq + 1] with ids below vocab - 1, the peer's pad id; classes [batch])."""
    import numpy as np
    rng = np.random.RandomState(0)
    return (rng.randint(0, args.vocab - 1, (args.batch, args.seq + 1)).astype(np.int32),
            rng.randint(0, args.labels, args.batch).astype(np.float32))


def peer_config(args) -> str:
    """In the driver: the peer's transformers config (config.json's dict, JSON) of our classifier."""
    from mesh_transformer.config import config_from_dict
    from mesh_transformer.io.hf import config_to_hf
    hf = config_to_hf(config_from_dict(config_keys(args, False)).model)
    for key in ("torch_dtype", "dtype", "architectures"):
        hf.pop(key, None)
    return json.dumps({**hf, "pad_token_id": args.vocab - 1})


def worker_ours(args, lora: bool) -> dict:
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.mp}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, ROOT)
    from mesh_transformer import host_memory
    host_memory.keep_freed_memory()  # as device_train.py runs
    import jax
    import numpy as np
    from mesh_transformer import parallel
    from mesh_transformer.config import config_from_dict
    from mesh_transformer.train.step import Trainer
    base_rss = lora_train.rss_mib()
    trainer = Trainer(config_from_dict(config_keys(args, lora)), parallel.make_mesh(args.mp, 1, jax.devices()[: args.mp]))
    if lora:
        trainer.base = trainer.init_base(0)
    tokens, classes = texts(args)
    batch = trainer.shard_batch({"tokens": tokens[None], "mask": np.ones((1, args.batch, args.seq), np.float32),
                                 "labels": classes[None, :, None]})
    return lora_train.timed_trainer(trainer, batch, args, base_rss)


def worker_peer(args, lora: bool) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForSequenceClassification
    torch.set_num_threads(os.cpu_count() or 1)
    base_rss = lora_train.rss_mib()
    config = lora_train.peer_hf_config(args)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    if lora:
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0,
                                                           target_modules=args.targets.split(","), bias="none",
                                                           task_type="SEQ_CLS"))
        versions["peft"] = peft.__version__
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.1)
    tokens, classes = texts(args)
    inputs, labels = torch.tensor(tokens[:, :-1], dtype=torch.long), torch.tensor(classes, dtype=torch.long)

    def step():
        loss = model(input_ids=inputs, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    times = lora_train.timed(step, args)
    return {"step_s": times, "rss_after_imports_mib": base_rss, "peak_rss_mib": lora_train.peak_rss_mib(),
            "trainable_params": int(sum(p.numel() for p in trainable)), "versions": versions}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        lora = args.worker.endswith("lora")
        result = worker_peer(args, lora) if args.worker in PEERS else worker_ours(args, lora)
        print(json.dumps(result))
        return
    kinds = [k for k in KINDS if k in args.kinds.split(",")]
    sys.path.insert(0, ROOT)
    args.hf_config = peer_config(args) if set(PEERS) & set(kinds) else None
    description = machine.describe(("peft",))
    runs = lora_train.rounds(args, kinds, lambda kind: lora_train.run_worker(args, kind, argv, peer=kind in PEERS,
                                                                             script=__file__))
    results = {k: lora_train.summary(args, v) for k, v in runs.items()}
    result = {"config": {k: v for k, v in vars(args).items() if k not in ("worker", "json", "peer_python", "hf_config")},
              "kinds": results}
    for ours, peer in (("ours-full", "hf-full"), ("ours-lora", "peft-lora")):
        if ours in results and peer in results:
            result[f"{ours}_vs_{peer}"] = (results[ours]["tokens_per_s"]["median"]
                                           / results[peer]["tokens_per_s"]["median"])
    machine.report(description, result, args.json, lambda: text(result))


def text(result):
    print(f"{'':26s} {'trainable':>11s} {'tokens/s (median, min-max)':>28s} {'peak RSS':>9s} {'XLA args + temps':>17s}")
    for kind, s in result["kinds"].items():
        t = s["tokens_per_s"]
        xla = (f"{s['xla_arguments_mib']:.0f} + {s['xla_temporaries_mib']:.0f} MiB" if "xla_temporaries_mib" in s else "")
        print(f"{NAMES[kind]:26s} {s['trainable_params']:11,d} {t['median']:9.0f} ({t['min']:.0f}-{t['max']:.0f}){'':8s} "
              f"{s['peak_rss_mib']:6.0f} MiB {xla:>17s}")
    for key, value in result.items():
        if key.endswith(("_vs_hf-full", "_vs_peft-lora")):
            print(f"{key}: {value:.2f}x")


if __name__ == "__main__":
    main()
