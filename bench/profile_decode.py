"""Where a decode step's time goes: the JAX profiler over one greedy decode, summed per XLA operation.

    .venv/bin/python bench/profile_decode.py [--family llama] [--dtype float32] [--batch 1] [--new 64]
                                             [--layers 8 --d-model 1024 --heads 16] [--top 25] [--json]

Builds bench/decode.py's random model (the family's shape, bench/families.py), decodes `--new` tokens
from a 32-token prompt as bench/decode.py does (batch 1: `Generator(matvec=True)`, as device_sample.py),
once to compile, then once traced with `jax.profiler.trace`. Every XLA:CPU operation of the decode
program (its HLO, compiled again from the call's shapes) gets its time per step, its calls per step,
its kind (a custom call names its kernel: `custom-call:<target>`), its output shape, the JAX code it
came from and, for custom calls, how fast it read its operands (their bytes over its time: the
weights of a product, the cache of attention). That tells the products that read below the
machine's speed from the small operations between them.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import families  # noqa: E402
import machine  # noqa: E402
from profile_train import hlo_ops, xla_events  # noqa: E402

DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "s32": 4, "u32": 4, "pred": 1, "f64": 8, "s64": 8}
OPERAND = re.compile(r"\b(f32|bf16|f16|s8|u8|s32|u32|pred|f64|s64)\[([\d,]*)\]")
OPERAND_NAME = re.compile(r"%([\w.\-]+)")
CUSTOM_CALL = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+) = .*? custom-call\((?P<operands>.*?)\), "
                         r".*?custom_call_target=\"(?P<target>[^\"]+)\"")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    families.add_arg(p)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--new", type=int, default=64, help="new tokens (the traced steps: one fewer)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--top", type=int, default=25)
    machine.add_args(p)
    return p.parse_args(argv)


def custom_calls(text: str, ops: dict) -> dict:
    """{custom call name: (kernel, bytes of its operands)} from an HLO module's text; `ops` (`hlo_ops`
    of the same text) gives each operand's shape."""
    calls = {}
    for line in text.splitlines():
        m = CUSTOM_CALL.match(line)
        if m:
            shapes = [ops[name][1] if name in ops else "" for name in OPERAND_NAME.findall(m["operands"])]
            operand_bytes = sum(DTYPE_BYTES[dtype] * _count(dims) for shape in shapes
                                for dtype, dims in OPERAND.findall(shape))
            calls[m["name"]] = (m["target"], operand_bytes)
    return calls


def _count(dims: str) -> int:
    n = 1
    for d in filter(None, dims.split(",")):
        n *= int(d)
    return n


def recorded(fn, calls: list):
    """`fn` (a jitted function), recording the abstract arguments of each call before it runs
    (the decode donates its state, so the arrays are gone afterwards)."""
    import jax

    def abstract(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x

    def call(*args, **kwargs):
        calls.append((jax.tree.map(abstract, args), kwargs))
        return fn(*args, **kwargs)
    return call


def main(argv=None):
    args = parse_args(argv)
    from mesh_transformer import host_memory
    host_memory.keep_freed_memory()  # as device_sample.py and bench/decode.py do
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=1"
    description = machine.describe()
    import jax
    import numpy as np

    import decode as bench_decode
    from mesh_transformer import loading
    from mesh_transformer.generate import Batch, Generator, SamplingOptions

    with tempfile.TemporaryDirectory() as tmp:
        bench_decode.make_random(tmp, args.family, args.layers, args.d_model, args.heads)
        model = loading.load(hf=tmp, mp=1, dp=1, dtype=args.dtype)
    gen = Generator(model.config, model.params, model.mesh, matvec=True if args.batch <= 1 else None)
    decode_fn, calls = gen._decode, []
    gen._decode = recorded(decode_fn, calls)
    options = SamplingOptions(max_new_tokens=args.new, temperature=0.0)
    rng = np.random.RandomState(0)

    def decode_once() -> float:
        seqs = gen.sequences(rng.randint(0, 50000, (args.batch, 32)).tolist(), options)
        batch = Batch.for_sequences(gen, seqs, chunk=None)
        batch.admit(seqs)
        jax.block_until_ready(batch.state)
        t0 = time.perf_counter()
        while batch.active():
            batch.step()
        return time.perf_counter() - t0

    decode_once()  # compile
    steps = args.new - 1
    untraced_ms = 1e3 * decode_once() / steps
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            traced_ms = 1e3 * decode_once() / steps
        per_op: collections.Counter = collections.Counter()
        calls_of: collections.Counter = collections.Counter()
        for _, name, ns in xla_events(tmp):  # an operation runs on whichever worker thread is free
            per_op[name] += ns
            calls_of[name] += 1
    last_args, last_kwargs = calls[-1]
    text_hlo = decode_fn.lower(*last_args, **last_kwargs).compile().as_text()
    ops = hlo_ops(text_hlo)
    kernels = custom_calls(text_hlo, ops)
    rows = []
    for name, ns in per_op.items():
        if name not in ops:
            continue
        kind, shape, source = ops[name]
        row = {"op": name, "kind": kind, "shape": shape, "source": source, "us_per_step": ns / 1e3 / steps,
               "calls_per_step": calls_of[name] / steps}
        if name in kernels:
            target, operand_bytes = kernels[name]
            row["kind"] = f"custom-call:{target.removeprefix('mesh_transformer_')}"
            row["operand_mb"] = operand_bytes / 1e6
            row["read_gb_s"] = operand_bytes * calls_of[name] / ns if ns else 0.0
        rows.append(row)
    rows.sort(key=lambda r: -r["us_per_step"])
    by_kind: collections.Counter = collections.Counter()
    for r in rows:
        by_kind[r["kind"] if r["kind"].startswith(("custom-call", "fusion")) else r["kind"].split(":")[0]] += \
            r["us_per_step"]
    results = {"config": vars(args), "step_ms": untraced_ms, "traced_step_ms": traced_ms,
               "ops_ms_total": sum(r["us_per_step"] for r in rows) / 1e3,
               "by_kind_ms": {k: v / 1e3 for k, v in by_kind.most_common()}, "top": rows[: args.top]}

    def text():
        print(f"{args.family} {args.layers} x {args.d_model} {args.dtype}, batch {args.batch}: step {untraced_ms:.2f} ms "
              f"({traced_ms:.2f} traced); XLA ops sum to {results['ops_ms_total']:.2f} ms a step")
        print("by kind: " + ", ".join(f"{k} {v / 1e3:.2f} ms" for k, v in by_kind.most_common(8)))
        for r in rows[: args.top]:
            read = f"{r['operand_mb']:7.2f} MB {r['read_gb_s']:5.1f} GB/s" if "read_gb_s" in r else " " * 21
            print(f"{r['us_per_step']:8.1f} us {r['calls_per_step']:4.1f}x {read} {r['kind'][:34]:34s} "
                  f"{r['shape'][:22]:22s} {r['source'][-50:]}")
    machine.report(description, results, args.json, text)


if __name__ == "__main__":
    main()
