"""A training step's attention, one layer, forward and backward: ours against autodiff's and torch's.

    .venv/bin/python bench/attention_train.py [--rounds 5] [--dtype float32] [--json]

Three sides compute causal self-attention of q, k, v and the gradients of sum(out * g) for all three:
- ours: `layers.Attention._attend` as a train step runs it: in causal blocks of 128 query positions,
  each over the keys up to its end (`_attend_causal_blocks`), whose softmax and values product are
  `layers.softmax_times_values`, with flash attention's backward;
- autodiff: the same formula in one block (`product`s of the scores and values, a masked float32
  softmax) differentiated by JAX, which is what the library ran before session 67;
- torch: `torch.nn.functional.scaled_dot_product_attention(is_causal=True)` and its backward, the
  peer a transformers user trains with (its CPU flash-attention kernel), `torch.get_num_threads()`
  threads.
Shapes (rows B, query heads N, kv heads K, tokens T, head size H): bench/train_throughput.py's
GPT-J-shaped and LLaMA-shaped layers at 4 x 256 tokens, and one row of 1,024 and 2,048. Each shape:
all sides compiled and checked against each other, then `--rounds` rounds, in turn, of enough calls
for ~50 ms or more; milliseconds a call, median and min-max.
"""
from __future__ import annotations

import argparse
import functools
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

from mesh_transformer.models import layers  # noqa: E402

SHAPES = [(4, 8, 8, 256, 64), (4, 8, 2, 256, 64), (1, 8, 8, 1024, 64), (1, 8, 8, 2048, 64)]  # (B, N, K, T, H)


def ours(q, k, v, mask):
    """q [B, K, G, T, H], k [B, K, H, T], v [B, K, T, H] (the layer's layouts) -> [B, K, G, T, H], as
    `Attention._attend` runs it without a cache: in causal blocks where `causal_query_blocks` says."""
    b, kv, g, t, hd = q.shape
    stand_in = SimpleNamespace(spec=SimpleNamespace(alibi=False, softcap=None))
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    attend_block = functools.partial(inspect.unwrap(layers.Attention._attend_block), stand_in,  # outside hk.transform
                                     shared_k=None, shared_v=None)
    block = layers.causal_query_blocks(t)
    if block is None:
        return attend_block(q, k, v, mask, positions, positions, None)
    return layers.Attention._attend_causal_blocks(attend_block, q, k, v, layers.Context(positions, mask, positions),
                                                  block)


def autodiff(q, k, v, mask):
    """The same attention as `ours` before its own backward: the softmax and values product differentiated by JAX."""
    b, kv, g, t, hd = q.shape
    scores = layers.product("bkmh,bkhs->bkms", q.reshape(b, kv, g * t, hd), k).reshape(b, kv, g, t, -1)
    scores = jnp.where(mask, scores / jnp.sqrt(jnp.float32(hd)), layers.NEG)
    p = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b, kv, g * t, -1)
    return layers.product("bkms,bksh->bkmh", p, v).reshape(b, kv, g, t, hd)


def jax_side(attend, g_out, mask):
    loss = lambda q, k, v: jnp.sum(attend(q, k, v, mask) * g_out)  # noqa: E731
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def torch_side(q, k, v, g_out, kv_groups: int):
    """q [B, N, T, H], k and v [B, K, T, H] as torch tensors -> a callable: the gradients of sum(out * g)."""
    import torch
    leaves = [torch.tensor(np.asarray(x), requires_grad=True) for x in (q, k, v)]
    g = torch.tensor(np.asarray(g_out))

    def step():
        for x in leaves:
            x.grad = None
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=kv_groups > 1)
        (out * g).sum().backward()
        return [x.grad for x in leaves]
    return step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    machine.add_args(p, rounds=5)
    args = p.parse_args(argv)
    description = machine.describe()
    rng = np.random.RandomState(0)
    results = []
    for b, n, kv, t, hd in SHAPES:
        g = n // kv
        q, k, v, g_out = (rng.standard_normal(shape).astype(np.float32)
                          for shape in ((b, n, t, hd), (b, kv, t, hd), (b, kv, t, hd), (b, n, t, hd)))
        # the layer's layouts: q [B, K, G, T, H], k [B, K, H, T], v [B, K, T, H]
        mine = [jnp.asarray(x, args.dtype) for x in (q.reshape(b, kv, g, t, hd), k.transpose(0, 1, 3, 2), v)]
        g_mine = jnp.asarray(g_out.reshape(b, kv, g, t, hd))
        mask = jnp.tril(jnp.ones((t, t), bool))[None, None, None]
        grads = {name: jax_side(f, g_mine, mask) for name, f in (("ours", ours), ("autodiff", autodiff))}
        sides = {name: (lambda f=f: f(*mine)) for name, f in grads.items()}
        if args.dtype == "float32":  # torch's CPU kernel in bf16 is another computation's rounding: compared in fp32
            sides["torch"] = torch_side(q, k, v, g_out, g)
        outs = {name: side() for name, side in sides.items()}
        dq = {name: np.asarray(out[0], np.float32).reshape(b, n, t, hd) if name != "torch" else out[0].numpy()
              for name, out in outs.items()}
        difference = max(float(np.abs(dq[name] - dq["autodiff"]).max()) for name in dq)
        once = machine.per_call(sides["autodiff"], 2)()
        calls = max(2, int(50 / max(once, 0.1)))
        times = machine.interleaved({name: machine.per_call(side, calls) for name, side in sides.items()}, args.rounds)
        results.append({"shape": dict(B=b, N=n, K=kv, T=t, H=hd), "max_abs_difference_dq": difference, "ms": times})

    def text():
        print(f"{args.dtype}; milliseconds a forward + backward, median (min-max) of {args.rounds} interleaved rounds")
        for r in results:
            sh, ms = r["shape"], r["ms"]
            row = "  ".join(f"{name} {machine.fmt(s, 2):>22s}" for name, s in ms.items())
            ratios = "  ".join(f"{name} / ours {s['median'] / ms['ours']['median']:4.2f}x"
                               for name, s in ms.items() if name != "ours")
            print(f"B {sh['B']} N {sh['N']} K {sh['K']} T {sh['T']:5d} H {sh['H']}: {row}  {ratios}"
                  f"  (max |dq difference| {r['max_abs_difference_dq']:.1e})")
    machine.report(description, results, args.json, text)


if __name__ == "__main__":
    main()
