"""Evaluate a model on lm-evaluation-harness tasks, sharded on this machine's devices.

    python eval_harness.py --hf ./gpt-j-6b --mp 8 --tasks lambada_openai,winogrande,hellaswag,piqa
    python eval_harness.py --ckpt gs://bucket/run --tasks my_task --include-path my_tasks/ --output results.json

Prints lm-eval's results table; --output writes its JSON. Named tasks download their data from the
Hugging Face hub; --include-path DIR adds task YAMLs of your own (e.g. over local JSON files:
`dataset_path: json`, `dataset_kwargs: {data_files: ...}`). Needs lm-eval (pip install
'mesh-transformer[eval]'). See README, "Evaluate".
"""
import argparse
import logging
import sys

from mesh_transformer import cli, host_memory, loading


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
    args = parser.parse_args(argv)
    host_memory.keep_freed_memory()

    import jax

    logging.basicConfig(level=logging.WARNING)
    if args.dtype is None and jax.default_backend() == "cpu":
        args.dtype = "float32"  # XLA:CPU runs 16-bit matmuls through slow paths (README, "Decode")
    with cli.user_errors(OSError) as status:
        from mesh_transformer.evaluate import harness
        from mesh_transformer.evaluate.lm import MeshLM

        names = harness.task_names(args.tasks)
        manager = harness.task_manager(args.include_path, names)
        tasks = harness.load_tasks(names, manager)  # fail before loading weights
        lm = MeshLM.from_loaded(loading.from_args(args), batch_size=args.batch_size, max_gen_toks=args.max_gen_toks)
        limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
        results = harness.run(lm, tasks, manager, num_fewshot=args.num_fewshot, limit=limit,
                              bootstrap_iters=args.bootstrap_iters, log_samples=args.log_samples, seed=args.seed)
        print(harness.table(results))
        if args.output:
            harness.write_json(results, args.output)
    return status.code


if __name__ == "__main__":
    sys.exit(main())
