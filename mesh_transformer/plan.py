"""Will it fit? Parameter count, FLOPs and per-device memory of a config on a dp x mp mesh.

    python -m mesh_transformer.plan --config configs/6B_roto_256.json [--dp 32] [--mp 8] [--zero] [--json]

Nothing is allocated: the real sharded train step (`train_step.Trainer.step`, with its donation
and shardings) is lowered from abstract shapes and compiled ahead of time for dp*mp simulated CPU
devices. The per-device bytes come from that executable's `memory_analysis()`; the split of its
arguments into params / optimizer state / batch comes from each leaf's shard shape.

The numbers are XLA:CPU's buffer assignment for our program. TPU and GPU compilers schedule and
fuse differently, so treat `temporaries` as an estimate; params, opt_state and batch are exact.
Called as a library, `plan()` compiles for whatever `jax.devices()` are (a real TPU slice gives
that compiler's numbers).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from mesh_transformer.cli import cpu_devices_env, simulate_cpu_devices
from mesh_transformer.config import Config, ConfigError, load_config

GiB = 2**30
DEVICE_MEMORIES_GIB = (16, 32, 80)  # a TPU v3 core, a TPU v4 chip, an A100/H100


@dataclass(frozen=True)
class Plan:
    """What one training step of `config` costs on a dp x mp mesh (memory per device, in bytes)."""

    n_params: int  # unique parameters of the model, unpadded vocabulary (HF's count)
    flops_per_token: int  # model FLOPs per trained token (forward + backward, no remat; DPO: + the reference's
    # forward; KTO: its KL rows forward only)
    tokens_per_step: int
    dp: int
    mp: int
    zero: bool
    platform: str
    bytes_per_device: dict  # params, opt_state, batch, temporaries, outputs, code, total
    compiled: dict  # the raw memory_analysis() fields the split was made from
    compile_seconds: float
    n_trainable: int = 0  # parameters with gradients and optimizer state (LoRA: the adapters only)
    # Of the temporaries: XLA:CPU's float32 copy of a bf16/fp16 frozen base. XLA:CPU has no bf16
    # matmul, so it converts the (stacked) base weights to float32 once per step; GPU and TPU
    # compilers multiply in bf16 and make no such copy. Subtracted from what `fits` compares.
    cpu_upcast_bytes: int = 0

    def fits(self, gib: float) -> bool:
        return self.bytes_per_device["total"] - self.cpu_upcast_bytes <= gib * GiB

    def to_json(self, device_memories_gib: Sequence[float] = DEVICE_MEMORIES_GIB) -> dict:
        out = dataclasses.asdict(self)
        out["flops_per_step"] = self.flops_per_token * self.tokens_per_step
        out["fits"] = {f"{g:g}": self.fits(g) for g in device_memories_gib}
        return out


# --------------------------------------------------------------------------------------------
# Counting
# --------------------------------------------------------------------------------------------

def shard_bytes(tree, shardings) -> int:
    """Bytes one device holds of `tree` (arrays or ShapeDtypeStructs) laid out by `shardings`."""
    import jax

    sizes = jax.tree.map(lambda x, s: math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize, tree, shardings)
    return sum(jax.tree.leaves(sizes))


def _compiled_stats(compiled) -> dict:
    stats = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
              "temp_size_in_bytes", "generated_code_size_in_bytes")
    return {f: int(getattr(stats, f)) for f in fields}


def mesh_shape(config: Config, dp: Optional[int] = None, mp: Optional[int] = None) -> tuple[int, int]:
    """(dp, mp): mp defaults to cores_per_replica, dp to tpu_size // mp (1 without tpu_size)."""
    from mesh_transformer.parallel.mesh import mesh_shape as derive
    return derive(config.train, None, dp, mp)


# --------------------------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------------------------

def plan(config: Config, dp: int, mp: int, zero: Optional[bool] = None, devices=None) -> Plan:
    """Compile the train step for a dp x mp mesh of `devices` (default: the first dp*mp of jax.devices())."""
    import jax

    from mesh_transformer import models, parallel
    from mesh_transformer.train.step import Trainer

    if zero is not None:
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, zero=zero))
    trainer = Trainer(config, parallel.make_mesh(mp, dp, devices))
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         trainer.abstract_state, trainer.state_shardings)
    # LoRA's frozen base, or DPO's reference (compute dtype, no gradient, no optimizer state), is an input of the step.
    trainer.base = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                trainer.abstract_base, trainer.base_shardings)
    batch = trainer.abstract_batch()
    start = time.perf_counter()
    compiled = trainer.step.lower(state, batch).compile()
    seconds = time.perf_counter() - start

    stats = _compiled_stats(compiled)
    params = shard_bytes(trainer.abstract_state.params, trainer.state_shardings.params)
    # The optimizer's moments plus the 4-byte step counter: the rest of the donated TrainState.
    opt_state = shard_bytes((trainer.abstract_state.opt_state, trainer.abstract_state.step),
                            (trainer.state_shardings.opt_state, trainer.state_shardings.step))
    frozen = "reference" if trainer.holds_reference else "frozen_base"
    memory = {
        **({frozen: shard_bytes(trainer.abstract_base, trainer.base_shardings)} if trainer.base else {}),
        "params": params,
        "opt_state": opt_state,
        "batch": shard_bytes(batch, jax.tree.map(lambda b: b.sharding, batch)),
        "temporaries": stats["temp_size_in_bytes"],
        # Outputs that do not reuse a donated buffer (the metrics).
        "outputs": stats["output_size_in_bytes"] - stats["alias_size_in_bytes"],
        "code": stats["generated_code_size_in_bytes"],
    }
    memory["total"] = sum(memory.values())
    m, t = config.model, config.train
    platform = trainer.mesh.devices.flat[0].platform
    itemsize = jax.numpy.dtype(m.compute_dtype).itemsize
    upcast = (_multiplied_bytes(trainer) * 4 // itemsize  # (an int8 base is widened a layer at a time: no copy)
              if trainer.base and not trainer.quantize_base and platform == "cpu" and itemsize < 4 else 0)
    return Plan(
        n_params=trainer.model.n_params() if trainer.lora is None else models.build(m, mp).n_params(),
        n_trainable=(trainer.model.n_params() if trainer.lora is None
                     else sum(x.size for x in jax.tree.leaves(trainer.abstract_state.params))),
        flops_per_token=trainer.model.flops_per_token() * _forwards_per_two_rows(trainer.preference) // 6,
        tokens_per_step=t.gradient_accumulation_steps * trainer.global_batch * m.seq,
        dp=dp, mp=mp, zero=config.train.zero,
        platform=platform, cpu_upcast_bytes=upcast,
        bytes_per_device=memory, compiled=stats, compile_seconds=round(seconds, 2))


def _multiplied_bytes(trainer) -> int:
    """Bytes a device holds of the frozen base (or reference) that the step multiplies by: all of it,
    but a classifier's embedding table, which it only gathers rows from (it has no language-model head)."""
    leaves = {m: {n: x for n, x in v.items()
                  if not (trainer.config.model.classifier and "vocab" in trainer.model.infos[m][n].axes)}
              for m, v in trainer.abstract_base.items()}
    return shard_bytes(leaves, {m: {n: trainer.base_shardings[m][n] for n in v} for m, v in leaves.items()})


def _forwards_per_two_rows(objective) -> int:
    """A step's model forwards over two rows' tokens, a backward counting two: 6 for the language-model
    loss and the reference-free objectives; DPO's reference adds a forward a row (8); KTO's example
    row costs that too, its KL row a forward under the policy and one under the reference (6), or
    none where its loss reads no KL row (4)."""
    if objective is None:
        return 6
    row = 4 if objective.needs_reference else 3
    if objective.kl_rows is None:
        return 2 * row
    return row + (2 if objective.kl_rows == "read" else 0)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mesh_transformer.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="JSON config (original mesh-transformer-jax keys)")
    p.add_argument("--dp", type=int, help="data-parallel size (default: tpu_size // mp, or 1)")
    p.add_argument("--mp", type=int, help="model-parallel size (default: cores_per_replica)")
    p.add_argument("--zero", action=argparse.BooleanOptionalAction, default=None,
                   help="shard params and optimizer state over dp too (default: the config's 'zero')")
    p.add_argument("--lora-rank", type=int, help="plan a LoRA run of this rank (sets the config's 'lora')")
    p.add_argument("--lora-targets", default="all-linear",
                   help="with --lora-rank: comma-separated HF module names, or all-linear (default)")
    p.add_argument("--lora-quantize-base", choices=("int8",),
                   help="with --lora-rank: the frozen base's matmul weights in int8 (lora.quantize_base)")
    p.add_argument("--bf16-optimizer", action="store_true", help="Adam moments in bfloat16 (config key bf16_optimizer)")
    p.add_argument("--loss-chunk", type=int, metavar="N",
                   help="the vocabulary head and loss N tokens at a time (config key loss_chunk; 0: all at once)")
    p.add_argument("--dpo", action="store_true", help="plan a preference run: DPO (sets the config's 'dpo': "
                   "per_replica_batch counts pairs, two sequences each; without LoRA a frozen reference copy), "
                   "or the objective the config already sets ('cpo', 'orpo': no reference; 'kto': per_replica_batch "
                   "counts examples, each with its KL row)")
    p.add_argument("--device-memory", type=float, action="append", metavar="GIB",
                   help=f"report whether the step fits in GIB per device (repeatable; default {DEVICE_MEMORIES_GIB})")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p


FRESH_ENV = "MESH_TRANSFORMER_PLAN_FRESH"  # set in the one fresh process: it never starts another


def _have_devices(n: int) -> bool:
    """Whether this process can plan on n devices (jax not yet imported: it will, see above)."""
    if "jax" not in sys.modules:
        simulate_cpu_devices(n)
        return True
    return sys.modules["jax"].device_count() >= n


def _run_fresh(argv: Sequence[str], n: int) -> int:
    """Plan in a new process whose XLA is asked for n CPU devices before anything imports jax."""
    if os.environ.get(FRESH_ENV):
        raise ConfigError(f"the planner could not get {n} devices (XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r})")
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, **cpu_devices_env(n), FRESH_ENV: "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "mesh_transformer.plan", *argv], env=env).returncode


def _bytes(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:8.2f} {unit}"
    return f"{n:8d} B"


def format_plan(result: Plan, config_path: str, device_memories_gib: Sequence[float]) -> str:
    b = result.bytes_per_device
    rows = [
        ("config", config_path),
        ("mesh", f"dp={result.dp} x mp={result.mp} = {result.dp * result.mp} {result.platform} devices, "
                 f"zero={result.zero}"),
        ("parameters", f"{result.n_params:,} ({result.n_params / 1e9:.2f} B, unique, unpadded vocab)"),
        *([("trainable", f"{result.n_trainable:,} (LoRA adapters; the rest is the frozen base)")]
          if result.n_trainable and result.n_trainable != result.n_params else []),
        ("FLOPs/token", f"{result.flops_per_token:,} ({result.flops_per_token / 1e9:.1f} GFLOP, training)"),
        ("tokens/step", f"{result.tokens_per_step:,}"),
        ("per device", ""),
        *((f"  {k}", _bytes(v)) for k, v in b.items()),
        *([("  of which", f"{_bytes(result.cpu_upcast_bytes)} of the temporaries: XLA:CPU's float32 copy of the "
                          f"{'reference' if 'reference' in b else 'frozen base'} "
                          "(no bf16 matmul on CPU; GPU/TPU make none)"),
           ("  GPU/TPU", f"{_bytes(b['total'] - result.cpu_upcast_bytes)} total (what 'fits' compares)")]
          if result.cpu_upcast_bytes else []),
        ("fits", "   ".join(f"{g:g} GiB: {'yes' if result.fits(g) else 'no'}" for g in device_memories_gib)),
        ("compiled in", f"{result.compile_seconds:.1f} s"),
    ]
    return "\n".join(f"{k:<14} {v}".rstrip() for k, v in rows)


def _with_flags(config: Config, args) -> Config:
    """The config with --lora-rank / --bf16-optimizer / --loss-chunk / --dpo applied (validated like the keys)."""
    from mesh_transformer.config import config_from_dict
    raw = config.to_json_dict()
    if args.lora_rank is not None:
        targets = args.lora_targets if args.lora_targets == "all-linear" else args.lora_targets.split(",")
        raw["lora"] = {"rank": args.lora_rank, "alpha": 2 * args.lora_rank, "targets": targets,
                       **({"quantize_base": args.lora_quantize_base} if args.lora_quantize_base else {})}
    if args.bf16_optimizer:
        raw["bf16_optimizer"] = True
    if args.loss_chunk is not None:
        raw["loss_chunk"] = args.loss_chunk
    if args.dpo and config.train.preference is None:
        raw["dpo"] = {}
    return config_from_dict(raw)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(argv)
    if any(not gib > 0 for gib in args.device_memory or ()):  # -1 printed "fits -1 GiB: no"
        parser.error(f"--device-memory must be above 0 GiB; got {' '.join(f'{g:g}' for g in args.device_memory)}")
    memories = args.device_memory or DEVICE_MEMORIES_GIB
    try:
        config = _with_flags(load_config(args.config), args)
        dp, mp = mesh_shape(config, args.dp, args.mp)
        if not _have_devices(dp * mp):
            # jax is already up with too few devices (we were called as a library): start afresh.
            return _run_fresh(argv, dp * mp)
        result = plan(config, dp, mp, args.zero)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_json(memories), indent=2))
    else:
        print(format_plan(result, args.config, memories))
    return 0


if __name__ == "__main__":
    sys.exit(main())
