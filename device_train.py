"""Train or fine-tune on the devices of this machine (a TPU VM, a GPU box, or a CPU).

    python device_train.py --config configs/tiny_cpu.json --cpu-devices 8
    python device_train.py --config CFG --hf path/to/hf-gptj          # fine-tune HF weights
    python device_train.py --config CFG --tune-model-path CKPT [--fresh-opt]

Resumes from the latest checkpoint in the config's model_dir when there is one. Ctrl-C saves a
checkpoint and exits. Metrics go to logs/<name>/ (metrics.jsonl, TensorBoard) and to W&B when the
config sets wandb_project.
"""
from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="JSON config (original mesh-transformer-jax keys)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--tune-model-path", help="fine-tune from this checkpoint directory (fresh LR schedule)")
    source.add_argument("--hf", help="fine-tune from this HF GPT-J directory (fresh LR schedule and optimizer)")
    p.add_argument("--fresh-opt", action="store_true", help="with --tune-model-path: do not load optimizer state")
    p.add_argument("--cpu-devices", type=int, help="simulate this many CPU devices (try dp x mp on a laptop)")
    p.add_argument("--log-dir", help="metrics.jsonl + TensorBoard events (default logs/<name>)")
    p.add_argument("--no-tensorboard", action="store_true")
    p.add_argument("--plot", metavar="PNG", help="after training, draw train/val loss curves to this PNG")
    p.add_argument("--sample", metavar="PROMPT", action="append",
                   help="after training, print a completion of PROMPT (repeatable)")
    p.add_argument("--sample-tokens", type=int, default=48)
    p.add_argument("--stop-after", type=int, help="stop (with a checkpoint) after this many steps of this run")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpu_devices:  # must happen before jax is imported
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.cpu_devices}"
    from mesh_transformer.checkpoint import CheckpointError
    from mesh_transformer.config import ConfigError, load_config
    from mesh_transformer.data import DatasetError
    from mesh_transformer.train_loop import RunOptions, TrainingError, TrainRun

    try:
        config = load_config(args.config)
        run = TrainRun(config, RunOptions(tune_model_path=args.tune_model_path, hf=args.hf, fresh_opt=args.fresh_opt,
                                          log_dir=args.log_dir, tensorboard=not args.no_tensorboard,
                                          stop_after=args.stop_after))
        state = run.train()
    except (ConfigError, CheckpointError, DatasetError, TrainingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    log_dir = args.log_dir or f"logs/{config.train.name}"
    if args.plot:
        from mesh_transformer.metrics import plot_metrics
        print(f"loss curves: {plot_metrics(os.path.join(log_dir, 'metrics.jsonl'), args.plot)}")
    if args.sample:
        from mesh_transformer.generate import Generator, SamplingOptions
        from mesh_transformer.tokenizer import load_tokenizer
        tokenizer = load_tokenizer()
        options = [SamplingOptions(max_new_tokens=args.sample_tokens, temperature=0.7, top_p=0.9, seed=seed,
                                   eos_token_id=tokenizer.eos_token_id) for seed in range(len(args.sample))]
        generator = Generator(config.model, state.params, run.trainer.mesh)
        for prompt, seq in zip(args.sample, generator.generate([tokenizer.encode(p) for p in args.sample],
                                                               options, tokenizer=tokenizer)):
            print(f"\n>>> {prompt}{seq.text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
