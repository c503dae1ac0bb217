"""Export a mesh-transformer checkpoint to a directory `GPTJForCausalLM.from_pretrained` loads.

    python to_hf_weights.py --input-ckpt gs://bucket/run --output-path ./gptj-hf --dtype fp16

Writes config.json and safetensors shards (plus the checkpoint's tokenizer files), converting one
tensor at a time: host memory holds the parameters once plus one output shard.
"""
import argparse
import sys

from mesh_transformer import cli
from mesh_transformer.io import remote


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input-ckpt", required=True, help="checkpoint directory (local or gs://)")
    p.add_argument("--output-path", required=True, help="HF directory to write (local or gs://)")
    p.add_argument("--dtype", default="fp16", choices=("fp16", "bf16", "fp32"))
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    p.add_argument("--max-shard-gb", type=float, default=2.0, help="size of each safetensors file")
    args = p.parse_args(argv)
    from mesh_transformer.io import hf

    with cli.user_errors(OSError) as status:
        with remote.local_output(args.output_path) as local_out:
            hf.checkpoint_to_hf(args.input_ckpt, local_out, args.dtype, args.step, int(args.max_shard_gb * 2**30))
    if status.code:
        return status.code
    print(f"wrote {args.output_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
