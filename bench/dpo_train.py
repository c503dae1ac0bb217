"""Preference-tuning throughput and memory: ours (full fine-tuning, and LoRA) next to TRL on HF
transformers + torch doing the same, for one objective a run (`--objective`): DPO (ours: a frozen
reference copy for full fine-tuning, the base with adapters off for LoRA; TRL's DPOTrainer), ORPO
(no reference; TRL's ORPOTrainer), SimPO (no reference; TRL's CPOTrainer, loss_type "simpo") or
KTO (a reference as DPO's; TRL's KTOTrainer, on unpaired examples: each "pair" below is then one
example, labelled desirable or not in turn, and its KL row, which TRL builds from another example's
completion of the same length), or a reward model (num_labels 1; TRL's RewardTrainer on
transformers' ForSequenceClassification; with LoRA, PEFT's SEQ_CLS adapter, the score head trained
whole beside it on both sides).

    bash bench/setup_trl_venv.sh            # once: the peer's own venv, bench/.venv-trl
    python bench/dpo_train.py [--family gptj --layers 4 --d-model 512 --heads 8 --vocab 50400
                               --pairs 2 --prompt 128 --completion 128 --rank 16 --alpha 32
                               --targets q_proj,v_proj --runs 3 --steps 5] [--objective dpo|orpo|simpo|kto|reward] [--json]

Every measurement is a fresh subprocess (its own peak memory): ours and the peer, full and LoRA,
in turn, `--runs` rounds. All train the family's benchmark shape (bench/families.py; the peer's
model from our config through the library's HF export mapping) in fp32 with AdamW (weight decay
0.1, clip 1.0, constant learning rate), the objective at beta 0.1 (SimPO: 2.0), on `--pairs`
pairs a step, each a prompt of `--prompt` tokens and two completions of `--completion` tokens (the
last one EOS), so every row holds prompt + completion tokens and there is no padding. The peer is
what a TRL user runs: `DPOTrainer` with a `ref_model` (full) or a `peft_config` (LoRA: the
reference is the base with the adapter off), `ORPOTrainer` / `CPOTrainer` with neither,
activation checkpointing off (ours: `remat` none), the pairs as text of a word-level tokenizer
whose words are the token ids, so both sides see the same tokens; its steps are timed by a
callback around each optimizer step. A run's rate is the tokens of a
step (both completions of every pair, prompt included) / its median step time after 2 warm-up
steps; reported: median and min–max over the runs, with peak RSS. Prints the machine, software
and load (bench/machine.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PEER_PYTHON = os.path.join(HERE, ".venv-trl", "bin", "python")
sys.path.insert(0, HERE)
import families  # noqa: E402
import lora_train  # noqa: E402  (its workers' helpers: RSS, timing, the model's config, the summary)
import machine  # noqa: E402
KINDS = ("ours-full", "trl-full", "ours-lora", "trl-lora")
NAMES = {"ours-full": "mesh-transformer, full", "trl-full": "TRL + transformers, full",
         "ours-lora": "mesh-transformer, LoRA", "trl-lora": "TRL + PEFT, LoRA"}
# The objectives: our config key and options, the peer's trainer (trl or trl.experimental) and its options.
OBJECTIVES = {"dpo": ("dpo", {"beta": 0.1}, "DPO"), "orpo": ("orpo", {"beta": 0.1}, "ORPO"),
              "simpo": ("cpo", {"loss_type": "simpo", "cpo_alpha": 0.0, "beta": 2.0}, "CPO"),
              "kto": ("kto", {"beta": 0.1}, "KTO"), "reward": ("reward", {}, "Reward")}
WITH_REFERENCE = ("DPO", "KTO")  # the peers given a reference model for full fine-tuning


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    families.add_shape_args(p, vocab=50400)
    p.add_argument("--pairs", type=int, default=2, help="preference pairs a step (two rows each)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    p.add_argument("--completion", type=int, default=128, help="tokens of each completion, its EOS included")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32)
    p.add_argument("--targets", default="q_proj,v_proj", help="LoRA's targets (HF module names)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="timed steps per run, after 2 warm-up steps")
    p.add_argument("--kinds", default=",".join(KINDS), help="which of " + ", ".join(KINDS))
    p.add_argument("--objective", choices=OBJECTIVES, default="dpo")
    p.add_argument("--peer-python", default=PEER_PYTHON)
    machine.add_args(p)
    p.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    p.add_argument("--hf-config", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    # what lora_train's helpers read: rows a step, tokens a row, one device, no dropout, fp32 base
    args.batch, args.seq = 2 * args.pairs, args.prompt + args.completion
    args.mp, args.dropout, args.quantize_base = 1, 0.0, None
    return args


def pairs(args):
    """[2 * pairs, seq + 1] token ids (rows alternate chosen, rejected; each pair's prompt shared; ids
    from 1, 0 being the EOS that ends each completion) and the [2 * pairs, seq] completion mask."""
    import numpy as np
    rng = np.random.RandomState(0)
    rows = []
    for _ in range(args.pairs):
        prompt = rng.randint(1, args.vocab, args.prompt)
        for _side in range(2):
            rows.append(np.r_[prompt, rng.randint(1, args.vocab, args.completion - 1), 0, 0])  # + a pad target
    tokens = np.stack(rows).astype(np.int32)[:, : args.seq + 1]
    mask = np.zeros((len(rows), args.seq), np.float32)
    mask[:, args.prompt - 1: args.seq - 1] = 1  # predicting each completion token, its EOS included
    return tokens, mask


def worker_ours(args, lora: bool) -> dict:
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
    key, options, _ = OBJECTIVES[args.objective]
    keys = {**lora_train.config_keys(args, lora), "per_replica_batch": args.pairs, key: options,
            "end_lr": 1e-4, "seq": args.seq, **({"num_labels": 1} if key == "reward" else {})}
    trainer = Trainer(config_from_dict(keys), parallel.make_mesh(1, 1, jax.devices()[:1]))
    trainer.base = trainer.init_base(0)  # LoRA's base, or DPO's reference (full): the initial weights; else {}
    tokens, mask = pairs(args)
    rows = {"tokens": tokens[None], "mask": mask[None]}
    if key == "kto":  # examples desirable and not in turn, each with its KL row
        rows["labels"] = (np.arange(len(tokens)) // 2 % 2 == 0).astype(np.float32)[None, :, None]
    return lora_train.timed_trainer(trainer, trainer.shard_batch(rows), args, base_rss)


def worker_trl(args, lora: bool) -> dict:
    import datasets
    import torch
    import transformers
    import trl
    from tokenizers import Tokenizer, models, pre_tokenizers
    torch.set_num_threads(os.cpu_count() or 1)
    base_rss = lora_train.rss_mib()
    config = lora_train.peer_hf_config(args)
    _, options, peer = OBJECTIVES[args.objective]
    torch.manual_seed(0)
    if peer == "Reward":  # a classifier of one output on the same trunk
        config.num_labels = 1
        model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    reference = None
    if not lora and peer in WITH_REFERENCE:
        reference = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        reference.load_state_dict(model.state_dict())
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(args.vocab)}, unk_token="w1"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, eos_token="w0", pad_token="w0")
    tokens, _ = pairs(args)
    text = lambda ids: " ".join(f"w{int(i)}" for i in ids)  # noqa: E731
    end = args.seq if peer == "DPO" else args.seq - 1  # the other trainers append the EOS themselves
    record = lambda i: {"prompt": text(tokens[2 * i, : args.prompt]),  # noqa: E731
                        "chosen": " " + text(tokens[2 * i, args.prompt: end]),
                        "rejected": " " + text(tokens[2 * i + 1, args.prompt: end])}
    if peer == "KTO":
        record = lambda i: {"prompt": text(tokens[2 * i, : args.prompt]),  # noqa: E731
                            "completion": " " + text(tokens[2 * i, args.prompt: end]), "label": i % 2 == 0}
    steps = args.steps + 2
    data = datasets.Dataset.from_list([record(i % args.pairs) for i in range(args.pairs * steps)])
    times: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.start)

    peft_config = None
    if lora:
        import peft
        peft_config = peft.LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0, bias="none",
                                      target_modules=args.targets.split(","),
                                      task_type="SEQ_CLS" if peer == "Reward" else "CAUSAL_LM")
    with tempfile.TemporaryDirectory() as out:
        config_class, trainer_class = peer_classes(peer)
        sampling = {"train_sampling_strategy": "sequential"} if peer == "KTO" else {}  # KTOTrainer requires it
        trl_args = config_class(output_dir=out, per_device_train_batch_size=args.pairs, max_steps=steps, **options,
                                learning_rate=1e-4, lr_scheduler_type="constant", weight_decay=0.1, max_grad_norm=1.0,
                                gradient_checkpointing=False, bf16=False, use_cpu=True, report_to="none",
                                save_strategy="no", logging_steps=10**6, dataloader_num_workers=0, **sampling)
        kwargs = {"ref_model": reference} if peer in WITH_REFERENCE else {}
        trainer = trainer_class(model=model, args=trl_args, train_dataset=data, processing_class=tokenizer,
                                peft_config=peft_config, callbacks=[Clock()], **kwargs)
        row = trainer.train_dataset[0]
        length = (len(row["prompt_ids"]) + len(row["chosen_ids"]) if peer == "DPO"
                  else len(row["prompt_ids"]) + len(row["completion_ids"]) if peer == "KTO"
                  else len(row["chosen_ids"]) if peer == "Reward" else len(row["chosen_input_ids"]))
        assert length == args.seq, f"the peer's rows ({length} tokens) are not the benchmark's ({args.seq})"
        trainer.train()
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    import peft as peft_module
    return {"step_s": times[2:], "rss_after_imports_mib": base_rss, "peak_rss_mib": lora_train.peak_rss_mib(),
            "trainable_params": int(trainable),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
                         "peft": peft_module.__version__}}


def peer_classes(peer: str):
    """(config class, trainer class) of TRL's trainer for an objective."""
    import trl
    if peer in ("DPO", "KTO", "Reward"):
        return {"DPO": (trl.DPOConfig, trl.DPOTrainer), "KTO": (trl.KTOConfig, trl.KTOTrainer),
                "Reward": (trl.RewardConfig, trl.RewardTrainer)}[peer]
    from trl.experimental import cpo, orpo
    return {"CPO": (cpo.CPOConfig, cpo.CPOTrainer), "ORPO": (orpo.ORPOConfig, orpo.ORPOTrainer)}[peer]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        lora = args.worker.endswith("lora")
        result = worker_trl(args, lora) if args.worker.startswith("trl") else worker_ours(args, lora)
        print(json.dumps(result))
        return
    kinds = [k for k in KINDS if k in args.kinds.split(",")]
    sys.path.insert(0, ROOT)
    args.hf_config = lora_train.peer_config(args)
    description = machine.describe(("trl", "peft"))
    runs = lora_train.rounds(args, kinds, lambda kind: lora_train.run_worker(
        args, kind, argv, peer=kind.startswith("trl"), script=__file__, setup="bench/setup_trl_venv.sh"))
    results = {k: lora_train.summary(args, v) for k, v in runs.items()}
    skip = ("worker", "json", "peer_python", "hf_config", "batch", "seq", "mp", "dropout", "quantize_base")
    result = {"config": {k: v for k, v in vars(args).items() if k not in skip}, "kinds": results}
    for how in ("full", "lora"):
        if f"ours-{how}" in results and f"trl-{how}" in results:
            result[f"{how}_speedup_vs_trl"] = (results[f"ours-{how}"]["tokens_per_s"]["median"]
                                               / results[f"trl-{how}"]["tokens_per_s"]["median"])
    machine.report(description, result, args.json, lambda: text(result))


def text(result):
    objective = result["config"]["objective"]
    key, _, peer = OBJECTIVES[objective]
    print(f"objective: {objective} (ours: config key {key!r}; TRL: {peer}Trainer)")
    print(f"{'':28s} {'trainable':>11s} {'tokens/s (median, min-max)':>28s} {'peak RSS':>9s} {'XLA args + temps':>17s}")
    for kind, s in result["kinds"].items():
        t = s["tokens_per_s"]
        xla = f"{s['xla_arguments_mib']:.0f} + {s['xla_temporaries_mib']:.0f} MiB" if "xla_temporaries_mib" in s else ""
        rate = f"{t['median']:9.0f} ({t['min']:.0f}-{t['max']:.0f})"
        print(f"{NAMES[kind]:28s} {s['trainable_params']:11,d} {rate:27s} {s['peak_rss_mib']:6.0f} MiB {xla:>17s}")
    for how in ("full", "lora"):
        if f"{how}_speedup_vs_trl" in result:
            print(f"{how}: {result[f'{how}_speedup_vs_trl']:.2f}x TRL")


if __name__ == "__main__":
    main()
