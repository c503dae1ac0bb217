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

from mesh_transformer import cli, host_memory


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_run_args(p)
    p.add_argument("--cpu-devices", type=int, help="simulate this many CPU devices (try dp x mp on a laptop)")
    p.add_argument("--plot", metavar="PNG", help="after training, draw train/val loss curves to this PNG")
    p.add_argument("--sample", metavar="PROMPT", action="append",
                   help="after training, print a completion of PROMPT (repeatable)")
    p.add_argument("--sample-tokens", type=int, default=48)
    args = p.parse_args(argv)
    cli.check_at_least(p, [("--cpu-devices", args.cpu_devices, 1), ("--sample-tokens", args.sample_tokens, 1)])
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    host_memory.keep_freed_memory()
    if args.cpu_devices:  # must happen before jax is imported
        cli.simulate_cpu_devices(args.cpu_devices)
    from mesh_transformer.config import load_config
    from mesh_transformer.train.loop import TrainRun

    with cli.user_errors() as status:
        config = load_config(args.config)
        if args.sample:  # found before training, not after it
            cli.check_new_tokens("--sample-tokens", args.sample_tokens, config.model.seq)
        run = TrainRun(config, cli.run_options(args))
        state = run.train()
    if status.code:
        return status.code
    log_dir = args.log_dir or f"logs/{config.train.name}"
    if args.plot:
        from mesh_transformer.train.metrics import plot_metrics
        print(f"loss curves: {plot_metrics(os.path.join(log_dir, 'metrics.jsonl'), args.plot)}")
    if args.sample:
        with cli.user_errors() as status:
            from mesh_transformer.generate import Generator, SamplingOptions
            from mesh_transformer.io.tokenizer import load_tokenizer
            from mesh_transformer.loading import end_of_text_ids
            tokenizer = load_tokenizer(run.tokenizer)  # the training data's
            eos = end_of_text_ids(tokenizer, run.ckpt.directory) or None  # and a generation config kept from the base
            options = [SamplingOptions(max_new_tokens=args.sample_tokens, temperature=0.7, top_p=0.9, seed=seed,
                                       eos_token_id=eos) for seed in range(len(args.sample))]
            params = state.params
            if config.train.lora is not None:  # the state holds the adapters alone: merged into the base
                from mesh_transformer import lora, parallel
                params = lora.restore_merged(run.ckpt, config, run.trainer.mesh.shape[parallel.MP])
            generator = Generator(config.model, params, run.trainer.mesh)
            for prompt, seq in zip(args.sample, generator.generate([tokenizer.encode(p) for p in args.sample],
                                                                   options, tokenizer=tokenizer)):
                print(f"\n>>> {prompt}{seq.text}")
        return status.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
