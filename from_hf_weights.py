"""Import a Hugging Face model directory (any supported family) as a mesh-transformer checkpoint (params, config, tokenizer).

    python from_hf_weights.py --input-hf ./gpt-j-6b --output-ckpt gs://bucket/gptj6b_base
    python device_train.py --config my_finetune.json --tune-model-path gs://bucket/gptj6b_base

The checkpoint is params-only (step 0); fine-tuning from it starts a fresh optimizer. --config
records training keys (mesh, schedule, ...) beside the imported model shape.
"""
import argparse
import sys

from mesh_transformer import cli
from mesh_transformer.io import remote


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input-hf", required=True, help="HF model directory: GPT-J, GPT-NeoX, LLaMA/Mistral/Qwen2/Qwen3/Granite, OLMo 2/3, Phi-1/1.5/2, Phi-3/Phi-4, StarCoder2, Gemma 1-3, Mixtral/Qwen2-MoE/Qwen3-MoE, GPT-2 or OPT (local or gs://)")
    p.add_argument("--output-ckpt", required=True, help="checkpoint directory to create (local or gs://)")
    p.add_argument("--config", help="JSON config whose training keys to record (model keys come from the HF config)")
    args = p.parse_args(argv)
    from mesh_transformer.io import hf
    from mesh_transformer.config import load_config

    with cli.user_errors(OSError) as status:
        train = load_config(args.config).train if args.config else None
        with remote.local_copy(args.input_hf) as local_hf:
            n = hf.hf_to_checkpoint(local_hf, args.output_ckpt, train)
    if status.code:
        return status.code
    print(f"imported {n:,} parameters from {args.input_hf} into {args.output_ckpt}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
