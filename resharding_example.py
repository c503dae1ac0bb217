"""Load any checkpoint onto an N-way model-parallel mesh of this machine's devices and sample from it.

    python resharding_example.py --input-ckpt step_383500/ --config configs/6B_roto_256.json --mp 1 \
        --prompt "EleutherAI is" --max-new-tokens 32                              # 8 shards -> one GPU
    python resharding_example.py --input-ckpt gs://bucket/run --mp 2 --output-ckpt gptj_mp2 --dtype bf16

The input is our checkpoint or a mesh-transformer-jax v1 one (step or model directory; any shard
count; slim or full — optimizer state is never read), which needs the --config it was trained with.
Prints (on stderr) the memory each device needs before loading, optionally writes our params-only
checkpoint in --dtype, and prints the completion of --prompt on stdout (greedy at --temperature 0).
"""
import argparse
import dataclasses
import sys

from mesh_transformer import cli


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input-ckpt", required=True, help="our checkpoint, or a v1 step/model directory (local or gs://)")
    p.add_argument("--config", help="JSON config (required for v1 checkpoints; overrides ours' saved config)")
    p.add_argument("--mp", type=int, required=True, help="model-parallel devices to split the model over")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default 1)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="weights and compute dtype")
    p.add_argument("--output-ckpt", help="also write our params-only checkpoint here, in --dtype")
    p.add_argument("--tokenizer", help="default: files beside the checkpoint, else GPT-2 BPE")
    p.add_argument("--prompt", help="text to complete")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    with cli.user_errors(OSError) as status:
        run(args)
    return status.code


def run(args) -> None:
    from mesh_transformer import loading, parallel
    from mesh_transformer.generate import SamplingOptions
    from mesh_transformer.io import convert

    dtype = convert.dtype_name(args.dtype)
    config = convert.source_config(args.input_ckpt, args.config)
    mesh = parallel.make_mesh(args.mp, args.dp)
    need = convert.memory_per_device(config.model, mesh, dtype)
    print(f"dp={args.dp} x mp={args.mp}, {dtype}: each device needs {convert.format_bytes(need['params'])} of "
          f"weights + {convert.format_bytes(need['kv_cache_per_row'])} of KV cache per {config.model.seq}-token "
          f"sequence = {convert.format_bytes(need['total'])}", file=sys.stderr, flush=True)
    model = loading.load(ckpt=args.input_ckpt, config=args.config, tokenizer=args.tokenizer, mp=args.mp,
                         dp=args.dp, dtype=dtype)
    if args.output_ckpt:
        train = dataclasses.replace(config.train, cores_per_replica=args.mp, tpu_size=None)  # what it was loaded for
        out_config = dataclasses.replace(config, model=model.config, train=train)
        convert.save_params(model.params, out_config, args.output_ckpt, dtype, args.input_ckpt)
        print(f"wrote {args.output_ckpt}", file=sys.stderr)
    if args.prompt is not None:
        generator = model.generator()  # takes the weights over: they stay on the devices once
        options = SamplingOptions(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  top_p=args.top_p, seed=args.seed)
        [seq] = generator.generate([model.tokenizer.encode(args.prompt)], options, tokenizer=model.tokenizer)
        print(seq.text)


if __name__ == "__main__":
    sys.exit(main())
