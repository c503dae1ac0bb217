"""Evaluate a model on lm-evaluation-harness tasks, sharded on this machine's devices.

    python eval_harness.py --hf ./gpt-j-6b --mp 8 --tasks lambada_openai,winogrande,hellaswag,piqa
    python eval_harness.py --ckpt gs://bucket/run --tasks my_task --include-path my_tasks/ --output results.json
    python eval_harness.py --hf ./base --lora-modules sql=./sql-adapter chat=./chat-adapter --with-base --tasks piqa

Prints lm-eval's results table; --output writes its JSON. Named tasks download their data from the
Hugging Face hub; --include-path DIR adds task YAMLs of your own (e.g. over local JSON files:
`dataset_path: json`, `dataset_kwargs: {data_files: ...}`). --lora-modules evaluates several PEFT
LoRA adapters over one load of the base (each unmerged, in turn; one table each, and --output's
JSON keyed by adapter name); --lora-adapter instead merges one into the weights. Needs lm-eval
(pip install 'mesh-transformer[eval]'). See README, "Evaluate".
"""
import argparse
import logging
import sys

from mesh_transformer import cli, host_memory, loading, lora
from mesh_transformer.config import ConfigError


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    loading.add_model_args(parser)
    g = parser.add_argument_group("evaluation")
    g.add_argument("--tasks", required=True, help="comma-separated lm-eval task (or group) names")
    g.add_argument("--include-path", metavar="DIR", help="a folder of task YAMLs to add to lm-eval's")
    g.add_argument("--num-fewshot", type=int, help="examples in each prompt (default: the task's, else 0)")
    g.add_argument("--limit", type=float, help="only this many examples per task (a fraction if < 1)")
    g.add_argument("--batch-size", type=int, help="sequences per forward pass (default: as many as fit "
                                                   "8192 positions)")
    g.add_argument("--max-gen-toks", type=int, default=256, help="default new tokens for generating tasks")
    g.add_argument("--bootstrap-iters", type=int, default=100_000, help="for the stderr of non-mean metrics")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--log-samples", action="store_true", help="keep every request and answer in the JSON")
    g.add_argument("--output", metavar="FILE", help="write lm-eval's results JSON here")
    g.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="evaluate each of these PEFT LoRA adapters in turn over one load of the base, unmerged "
                        "(device_serve.py's flag); --output then holds {NAME: results}")
    g.add_argument("--with-base", action="store_true", help="with --lora-modules, evaluate the base too (as 'base')")
    args = parser.parse_args(argv)
    if args.with_base and not args.lora_modules:
        parser.error("--with-base compares the base with --lora-modules adapters: pass --lora-modules")
    cli.check_at_least(parser, [("--num-fewshot", args.num_fewshot, 0), ("--batch-size", args.batch_size, 1),
                                ("--max-gen-toks", args.max_gen_toks, 1), ("--bootstrap-iters", args.bootstrap_iters, 0)])
    # (a --limit of 0 or less: lm-eval's islice raised a ValueError deep inside)
    cli.check_above_zero(parser, [("--limit", args.limit, " (examples per task, or a fraction of them below 1)")])
    host_memory.keep_freed_memory()

    import jax

    logging.basicConfig(level=logging.WARNING)
    if args.dtype is None and jax.default_backend() == "cpu":
        args.dtype = "float32"  # XLA:CPU runs 16-bit matmuls through slow paths (README, "Decode")
    with cli.user_errors(OSError) as status:
        from mesh_transformer.evaluate import harness
        from mesh_transformer.evaluate.lm import MeshLM

        adapters = lora.parse_named(args.lora_modules, "--lora-modules")
        if adapters and args.lora_adapter:
            raise ConfigError("--lora-adapter merges an adapter into the base and --lora-modules evaluates adapters "
                              "made for the base: pass one")
        if "base" in (name for name, _ in adapters) and args.with_base:
            raise ConfigError("--lora-modules: 'base' names the base with --with-base; call the adapter otherwise")
        names = harness.task_names(args.tasks)
        manager = harness.task_manager(args.include_path, names)
        tasks = harness.load_tasks(names, manager)  # fail before loading weights
        lm = MeshLM.from_loaded(loading.from_args(args), batch_size=args.batch_size, max_gen_toks=args.max_gen_toks,
                                adapters=adapters)
        limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
        evaluated = ([None] if args.with_base else []) + [name for name, _ in adapters] if adapters else [None]
        every = {}
        for name in evaluated:
            results = harness.run(lm.under(name), tasks, manager, num_fewshot=args.num_fewshot, limit=limit,
                                  bootstrap_iters=args.bootstrap_iters, log_samples=args.log_samples, seed=args.seed)
            if adapters:
                print(f"\n{name or 'base'}:")
            print(harness.table(results))
            every[name or "base"] = results
        if args.output:
            harness.write_json(every if adapters else every["base"], args.output)
    return status.code


if __name__ == "__main__":
    sys.exit(main())
