"""What the command-line tools share: one way to report a user's error, the run flags of
`device_train.py` and `train.py`, the speculative decoding flags of `device_sample.py` and
`device_serve.py`, and simulated CPU devices.

    def main(argv=None) -> int:
        args = parser.parse_args(argv)
        with cli.user_errors() as status:
            ...                     # any UserError -> "error: <message>" on stderr, exit code 2
        return status.code
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from dataclasses import dataclass

from mesh_transformer.errors import UserError

EXIT_USER_ERROR = 2


@dataclass
class Status:
    code: int = 0


@contextlib.contextmanager
def user_errors(*also: type[BaseException]):
    """Turn a UserError (or one of `also`, e.g. OSError for file tools) into one line and exit code 2."""
    status = Status()
    try:
        yield status
    except (UserError, *also) as e:
        print(f"error: {e}", file=sys.stderr)
        status.code = EXIT_USER_ERROR


def check_at_least(parser: argparse.ArgumentParser, checks) -> None:
    """`parser.error` (one line, exit code 2) for the first (flag, value, least) whose value is below
    `least`; a value of None (a flag not given) passes."""
    for flag, value, least in checks:
        if value is not None and value < least:
            parser.error(f"{flag} must be at least {least}; got {value}")


def check_above_zero(parser: argparse.ArgumentParser, checks) -> None:
    """`parser.error` for the first (flag, value, unit) whose value is not above 0 (None passes):
    "--flag must be above 0<unit>; got <value>"."""
    for flag, value, unit in checks:
        if value is not None and not value > 0:
            parser.error(f"{flag} must be above 0{unit}; got {value:g}")


def check_new_tokens(flag: str, tokens: int, context: int) -> None:
    """UserError unless `tokens` new tokens fit a model of `context` positions beside a prompt."""
    if tokens >= context:
        raise UserError(f"{flag} {tokens}: at most {context - 1} for this model (its context is {context} tokens, "
                        f"the prompt's included)")


def add_speculate_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    from mesh_transformer.generate.decode import LOOKUP_NGRAM
    g = parser.add_argument_group("speculative decoding (prompt lookup)")
    g.add_argument("--speculate", type=int, default=0, metavar="K",
                   help="each decode step also checks K tokens drafted from the text so far (the tokens that "
                        "followed the latest earlier occurrence of its last --lookup-ngram .. 1 tokens): the same "
                        "output, faster where text repeats (code, quotes, summaries). Each draft position costs "
                        "compute: start at 2 on a CPU (default: 0, off)")
    g.add_argument("--lookup-ngram", type=int, default=LOOKUP_NGRAM, metavar="N",
                   help=f"the longest run of last tokens a draft looks up (default: {LOOKUP_NGRAM})")
    return g


def check_speculate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from mesh_transformer.generate.decode import MAX_LOOKUP_NGRAM, MAX_SPECULATE
    if not 0 <= args.speculate <= MAX_SPECULATE:
        parser.error(f"--speculate must be in [0, {MAX_SPECULATE}] draft tokens a step; got {args.speculate}")
    if not 1 <= args.lookup_ngram <= MAX_LOOKUP_NGRAM:
        parser.error(f"--lookup-ngram must be in [1, {MAX_LOOKUP_NGRAM}] tokens; got {args.lookup_ngram}")


def simulate_cpu_devices(n: int) -> None:
    """Ask XLA for n CPU devices (try a dp x mp layout on a laptop); only effective before jax is imported."""
    os.environ.update(cpu_devices_env(n))


def cpu_devices_env(n: int) -> dict:
    """The environment variables that give a process started with them n simulated CPU devices."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
    return {"XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={n}".strip(), "JAX_PLATFORMS": "cpu"}


def add_run_args(p: argparse.ArgumentParser) -> None:
    """The flags of a training run that `device_train.py` and `train.py` both take."""
    p.add_argument("--config", required=True, help="JSON config (original mesh-transformer-jax keys)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--tune-model-path", help="fine-tune from this checkpoint directory (fresh LR schedule)")
    source.add_argument("--hf", help="fine-tune from this Hugging Face model directory (fresh LR schedule and optimizer)")
    p.add_argument("--fresh-opt", action="store_true", help="with --tune-model-path: do not load optimizer state")
    p.add_argument("--log-dir", help="metrics.jsonl + TensorBoard events (default logs/<name>)")
    p.add_argument("--no-tensorboard", action="store_true")
    p.add_argument("--stop-after", type=int, help="stop (with a checkpoint) after this many steps of this run")


def run_options(args: argparse.Namespace):
    """RunOptions from the flags `add_run_args` defined."""
    from mesh_transformer.train.loop import RunOptions

    return RunOptions(tune_model_path=args.tune_model_path, hf=args.hf, fresh_opt=args.fresh_opt,
                      log_dir=args.log_dir, tensorboard=not args.no_tensorboard, stop_after=args.stop_after)
