"""A decode step's attention over a KV cache, one layer: the fused CPU kernel against XLA's path.

    .venv/bin/python bench/attention_decode.py [--rounds 5] [--dtype float32] [--json]

Both sides are the library's own: `kernels.attention` (attention.cc's decode path: a task's few
query rows over the slots they see, one call) and `layers.Attention._attend_block` as it runs where
the fused kernel does not (two grouped products over the whole cache, XLA's masked softmax between
them). Shapes (rows B, kv heads K, query heads per kv head G, head size H, cache slots S, slots
written): a GPT-J-shaped and a LLaMA-shaped (4 query heads per kv head) cache at batch 1, 16 and 64,
short caches and long ones, and long ones barely written (a server's cache early in its requests).
Each shape: both sides compiled, then `--rounds` rounds, in turn, of enough calls for ~2 ms or
more; microseconds a call, median and min-max.
"""
from __future__ import annotations

import argparse
import inspect
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
import machine  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from mesh_transformer import kernels  # noqa: E402
from mesh_transformer.models import layers  # noqa: E402

# (B, K, G, H, S, written)
SHAPES = [(1, 16, 1, 64, 128, 96), (16, 16, 1, 64, 128, 96), (64, 16, 1, 64, 256, 200),
          (64, 16, 1, 64, 2048, 1500), (1, 16, 1, 64, 2048, 100), (1, 4, 4, 64, 2048, 1500),
          (16, 4, 4, 64, 512, 400)]


def xla_path(q, k, v, mask):
    """`_attend_block` of a layer without ALiBi or soft-capped scores (its only uses of the spec):
    q [B, K, G, H] at one position, mask [B, S]."""
    b, kv, g, hd = q.shape
    s = k.shape[-1]
    stand_in = SimpleNamespace(spec=SimpleNamespace(alibi=False, softcap=None))
    positions = jnp.zeros((b, 1), jnp.int32)
    attend_block = inspect.unwrap(layers.Attention._attend_block)  # the method's code, outside hk.transform
    out = attend_block(stand_in, q[:, :, :, None], k, v, mask.reshape(b, 1, 1, 1, s), positions,
                       jnp.broadcast_to(jnp.arange(s), (b, s)), None, None, None)
    return out[:, :, :, 0]


def fused(q, k, v, mask):
    """`kernels.attention` of q [B, K, G, H] at one position, mask [B, S]."""
    return kernels.attention(q, k, v, mask[:, None])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    machine.add_args(p, rounds=5)
    args = p.parse_args(argv)
    if not kernels.available():
        raise SystemExit("the CPU kernels are not available here: nothing to compare")
    description = machine.describe()
    rng = np.random.RandomState(0)
    results = []
    for b, kv, g, hd, s, written in SHAPES:
        q, k, v = (jnp.asarray(rng.standard_normal(shape), args.dtype)
                   for shape in ((b, kv, g, hd), (b, kv, hd, s), (b, kv, s, hd)))
        mask = jnp.asarray(np.broadcast_to(np.arange(s) < written, (b, s)))
        sides = {"fused": jax.jit(fused), "xla": jax.jit(xla_path)}
        outs = {name: np.asarray(f(q, k, v, mask), np.float32) for name, f in sides.items()}
        difference = float(np.abs(outs["fused"] - outs["xla"]).max())
        once = machine.per_call(lambda: sides["xla"](q, k, v, mask), 3, 1e6)()
        calls = max(3, int(2000 / max(once, 1.0)))
        times = machine.interleaved({name: machine.per_call(lambda f=f: f(q, k, v, mask), calls, 1e6)
                                     for name, f in sides.items()}, args.rounds)
        cache_mb = b * kv * hd * s * 2 * jnp.dtype(args.dtype).itemsize / 1e6
        results.append({"shape": dict(B=b, K=kv, G=g, H=hd, S=s, written=written), "cache_mb": cache_mb,
                        "max_abs_difference": difference, "us": times})

    def text():
        print(f"{args.dtype}; microseconds a call, median (min-max) of {args.rounds} interleaved rounds")
        for r in results:
            sh, us = r["shape"], r["us"]
            print(f"B {sh['B']:3d} K {sh['K']:2d} G {sh['G']} H {sh['H']} S {sh['S']:5d} written {sh['written']:5d} "
                  f"({r['cache_mb']:7.1f} MB): fused {machine.fmt(us['fused'], 1):>26s}  xla {machine.fmt(us['xla'], 1):>26s}"
                  f"  xla / fused {us['xla']['median'] / us['fused']['median']:5.2f}x  (max |difference| {r['max_abs_difference']:.1e})")
    machine.report(description, results, args.json, text)


if __name__ == "__main__":
    main()
