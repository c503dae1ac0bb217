"""A decode step's products alone: our CPU kernels against XLA's, on the same weights, same run.

    .venv/bin/python bench/products.py [--dtypes float32 bfloat16] [--rows 1 2 4 8 16 32 64]
                                       [--k 1024 --o 4096 --chain 16] [--rounds 5] [--json]

Each side multiplies `--rows` rows by `--chain` different [K, O] weights in one program (their
bytes together far past the caches, as a decode step's layers are), `--rounds` interleaved rounds,
median and min-max of the time per program. The sides, where they run here (the two kernel sides
are `models.layers.product`, as a model's layers call it):
- `dot (inputs-last)`: `kernels.rows_dot_weight` over weights stored [O, K], the layout
  `Generator` decodes with wherever this kernel runs for the dtype (float32 with AVX-512; bf16
  with AVX-512-BF16 or AMX);
- `kernels (inputs-first)`: `kernels.rows_times_weight` over [K, O] weights, for the rows it takes
  (and the bf16 pair products where the CPU has them), else XLA's product in its place;
- `XLA (inputs-first)`: XLA:CPU's own product, as a program of the library calls it elsewhere.
The rate columns are the weights' bytes read per second and the products' FLOP/s. The numbers
behind the row ranges and layouts in `mesh_transformer/kernels/__init__.py` and `generate/decode.py`
came from runs of this shape.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import machine  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--k", type=int, default=1024, help="inputs of each weight")
    p.add_argument("--o", type=int, default=4096, help="outputs of each weight")
    p.add_argument("--chain", type=int, default=16, help="weights per program")
    machine.add_args(p, rounds=5)
    return p.parse_args(argv)


def sides(dtype, rows: int, args) -> dict:
    """{side: a callable that runs its program once and returns seconds}, compiled and warmed up."""
    import jax
    import jax.numpy as jnp

    from mesh_transformer import kernels
    from mesh_transformer.models.layers import product as model_product

    rng = np.random.RandomState(0)
    last = [jnp.asarray(rng.standard_normal((args.o, args.k)) * 0.02, dtype) for _ in range(args.chain)]
    first = [jnp.asarray(w.T) for w in last]
    x = jnp.asarray(rng.standard_normal((rows, args.k)), dtype)

    def xla(x, w):
        return jnp.einsum("rk,ko->ro", x, w, preferred_element_type=jnp.float32)

    def model(equation):  # the product a model's layer makes (its kernel where one applies, else XLA's)
        return lambda x, w: model_product(equation, x, w)

    programs = {"dot (inputs-last)": (model("...k,ok->...o"), last)} if kernels.dot_applies(x, last[0]) else {}
    programs.update({"kernels (inputs-first)": (model("...k,ko->...o"), first), "XLA (inputs-first)": (xla, first)})
    out = {}
    for name, (product, weights) in programs.items():
        program = jax.jit(lambda x, ws, product=product: [product(x, w) for w in ws])
        jax.block_until_ready(program(x, weights))

        def once(program=program, weights=weights):
            start = time.perf_counter()
            jax.block_until_ready(program(x, weights))
            return time.perf_counter() - start
        out[name] = once
    return out


def main():
    args = parse_args()
    description = machine.describe()
    import jax.numpy as jnp

    from mesh_transformer import host_memory, kernels
    host_memory.keep_freed_memory()  # as the tools that decode run
    results = {"kernels": {"available": kernels.available(), "dot": {d: kernels.dot_kernel(jnp.dtype(d)) for d in args.dtypes},
                           "bf16_pairs": kernels.bf16_pairs(), "amx": kernels.amx()}, "rows": {}}
    for dtype in args.dtypes:
        weight_bytes = args.chain * args.k * args.o * jnp.dtype(dtype).itemsize
        for rows in args.rows:
            timed = machine.interleaved(sides(jnp.dtype(dtype), rows, args), args.rounds)
            for name, summary in timed.items():
                summary["GB/s"] = weight_bytes / summary["median"] / 1e9
                summary["GFLOP/s"] = 2 * rows * args.chain * args.k * args.o / summary["median"] / 1e9
            results["rows"].setdefault(dtype, {})[rows] = timed
            if not args.json:
                print(f"{dtype:8s} {rows:3d} rows: " + " | ".join(
                    f"{name} {1e3 * s['median']:7.2f} ms ({1e3 * s['min']:.2f}-{1e3 * s['max']:.2f}), "
                    f"{s['GB/s']:5.1f} GB/s, {s['GFLOP/s']:6.1f} GFLOP/s" for name, s in timed.items()), flush=True)

    def text():
        print(f"{args.chain} chained [rows, {args.k}] x [{args.k}, {args.o}] products a program, {args.rounds} "
              f"interleaved rounds; kernels: {results['kernels']}")
    machine.report(description, results, args.json, text)


if __name__ == "__main__":
    main()
