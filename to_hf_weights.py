"""Export a checkpoint to a directory `GPTJForCausalLM.from_pretrained` loads.

    python to_hf_weights.py --input-ckpt gs://bucket/run --output-path ./gptj-hf --dtype fp16
    python to_hf_weights.py --input-ckpt step_383500/ --config configs/6B_roto_256.json \
        --output-path ./gpt-j-6b-hf --dtype fp16                  # a mesh-transformer-jax v1 checkpoint

Writes config.json and safetensors shards (plus the checkpoint's tokenizer files), converting one
tensor at a time: from our checkpoints host memory holds the parameters once plus one output shard;
from v1 checkpoints (any shard count, slim or full) one tensor, or one shard's part of it, at a time
(bench/v1_convert.py: 4-7% of the checkpoint's size).
A LoRA run's checkpoint exports merged (a plain HF model); `--peft` writes its adapter for
`peft.PeftModel.from_pretrained(base, OUT)` instead.
--config is required for v1 checkpoints (the original's flag), ignored for ours, which carry their own.
"""
import argparse
import os
import sys

from mesh_transformer import cli


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input-ckpt", required=True, help="checkpoint: ours, or a v1 step/model directory (local or gs://)")
    p.add_argument("--output-path", required=True, help="HF directory to write (local or gs://)")
    p.add_argument("--config", help="the JSON config a v1 checkpoint was trained with")
    p.add_argument("--dtype", default="fp16", choices=("fp16", "bf16", "fp32"))
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    p.add_argument("--max-shard-gb", type=float, default=2.0, help="size of each safetensors file")
    p.add_argument("--peft", action="store_true",
                   help="a LoRA run: write the adapter in PEFT's format (adapter_config.json + "
                        "adapter_model.safetensors) instead of the merged model")
    p.add_argument("--cpu", action="store_true", help="run on the CPU (the conversion never needs an accelerator)")
    p.add_argument("--debug", action="store_true", help="print each tensor as it is written")
    args = p.parse_args(argv)
    cli.check_above_zero(p, [("--max-shard-gb", args.max_shard_gb, "")])  # 0 or less wrote one file per tensor
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"  # before jax is imported
    from mesh_transformer.io import hf, mtj_v1, remote

    max_shard = int(args.max_shard_gb * 2**30)
    with cli.user_errors(OSError) as status:
        if mtj_v1.find(args.input_ckpt, args.step) is not None:
            ckpt, _ = mtj_v1.open_checkpoint(args.input_ckpt, args.config, args.step)
            progress = (lambda name: print(name, file=sys.stderr)) if args.debug else None
            with remote.local_output(args.output_path) as local_out:
                mtj_v1.export_hf(ckpt, local_out, args.dtype, max_shard, progress)
        else:
            with remote.local_output(args.output_path) as local_out:
                hf.checkpoint_to_hf(args.input_ckpt, local_out, args.dtype, args.step, max_shard, peft=args.peft)
    if status.code:
        return status.code
    print(f"wrote {args.output_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
