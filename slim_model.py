"""Drop the optimizer state of a checkpoint and cast its weights: a small params-only checkpoint.

    python slim_model.py --config configs/my_run.json [--ckpt-step N] [--f16]     # the original's flags
    python slim_model.py --input-ckpt step_383500/ --config configs/6B_roto_256.json --output-ckpt gptj_slim

With the original's flags, the checkpoint is the config's model_dir (gs://{bucket}/{model_dir}, or the
local model_dir): its latest step, or --ckpt-step; the output goes beside it, to <model_dir>_slim
(<model_dir>_slim_f16 with --f16). The input is ours or a mesh-transformer-jax v1 checkpoint (which
needs --config). The output is our params-only checkpoint (bf16 unless --dtype/--f16 say otherwise)
that every tool reads; sizes before and after are printed.
"""
import argparse
import sys

from mesh_transformer import cli


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="JSON config: its model_dir is the input when --input-ckpt is not given "
                                    "(required for v1 checkpoints)")
    p.add_argument("--ckpt-step", type=int, help="step to slim (default: the latest)")
    p.add_argument("--f16", action="store_true", help="float16 instead of bfloat16 (the original's flag)")
    p.add_argument("--input-ckpt", help="checkpoint to slim: ours, or a v1 step/model directory (local or gs://)")
    p.add_argument("--output-ckpt", help="where to write (default: <model_dir>_slim beside the input)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="default bf16 (fp16 with --f16)")
    args = p.parse_args(argv)

    with cli.user_errors(OSError) as status:
        src, dst, dtype = paths(args)
        from mesh_transformer.io import convert
        before, after = convert.slim(src, dst, args.config, dtype, args.ckpt_step)
        print(f"{src}: {convert.format_bytes(before)} -> {dst}: {convert.format_bytes(after)} ({dtype}, params only)")
    return status.code


def paths(args) -> tuple[str, str, str]:
    """(input, output, dtype) from either flag set."""
    from mesh_transformer.config import ConfigError

    if args.f16 and args.dtype not in (None, "fp16"):
        raise ConfigError(f"--f16 and --dtype {args.dtype} disagree")
    dtype = args.dtype or ("fp16" if args.f16 else "bf16")
    src = args.input_ckpt
    if src is None:
        if not args.config:
            raise ConfigError("give --input-ckpt, or --config whose model_dir holds the checkpoint")
        src = model_dir(args.config)
    dst = args.output_ckpt or src.rstrip("/") + ("_slim_f16" if dtype == "fp16" else "_slim")
    return src, dst, dtype


def model_dir(config_path: str) -> str:
    """gs://{bucket}/{model_dir} or model_dir, from the config's keys (training keys need not be valid here)."""
    from mesh_transformer.io import mtj_v1
    from mesh_transformer.io.checkpoint import checkpoint_dir

    return checkpoint_dir(mtj_v1.load_config(config_path).train)


if __name__ == "__main__":
    sys.exit(main())
