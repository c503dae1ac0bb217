"""A writer of mesh-transformer-jax "v1" checkpoints, from the format spec (not from our reader).

    oracle = write_v1(torch_model, tmp / "step_7", shards=4, dtype="bf16")

turns a HF `GPTJForCausalLM` into the original's per-shard layout and writes `step_7/shard_{s}/{i}.npz`.
It builds the original's train state as nested dicts / optax NamedTuples with haiku's module names and
lets `jax.tree_util.tree_flatten` order the leaves (sorted keys: opt_state, params, step; layer_1 <
layer_10 < layer_2), cuts them into 16 pieces as the original's `split` does and writes each with
`np.savez` (bf16 as ml_dtypes.bfloat16, which numpy stores as 'V2').

What training leaves in the per-shard copies is reproduced and made exact in the stored dtype:
summed biases (fc_out, embedding) are split into unequal terms whose sum is exact; LayerNorm copies
on shards >= 1 keep their init (1, 0); the embedding bias is random and the stored table is wte minus
it. The torch model is then set to exactly the weights the files represent (the oracle).
"""
from __future__ import annotations

import os

import jax
import ml_dtypes
import numpy as np
import optax

ROOT = "causal_transformer_shard/~/"
DTYPES = {"fp32": np.float32, "bf16": ml_dtypes.bfloat16, "fp16": np.float16}


def _layer_leaves(sd, i):
    """{(module, param): (whole array in the original's layout, how shards hold it)} of layer i."""
    h = f"transformer.h.{i}."
    mod = f"{ROOT}layer_{i}/~/"
    return {
        (mod + "linear", "w"): (sd[h + "attn.q_proj.weight"].T, ("split", 1)),
        (mod + "linear_1", "w"): (sd[h + "attn.v_proj.weight"].T, ("split", 1)),
        (mod + "linear_2", "w"): (sd[h + "attn.k_proj.weight"].T, ("split", 1)),
        (mod + "linear_3", "w"): (sd[h + "attn.out_proj.weight"].T, ("split", 0)),
        (mod + "linear_4", "w"): (sd[h + "mlp.fc_in.weight"].T, ("split", 1)),
        (mod + "linear_4", "b"): (sd[h + "mlp.fc_in.bias"], ("split", 0)),
        (mod + "linear_5", "w"): (sd[h + "mlp.fc_out.weight"].T, ("split", 0)),
        (mod + "linear_5", "b"): (sd[h + "mlp.fc_out.bias"], ("sum",)),
        (mod + "replicated_layer_norm", "scale"): (sd[h + "ln_1.weight"], ("first", 1.0)),
        (mod + "replicated_layer_norm", "offset"): (sd[h + "ln_1.bias"], ("first", 0.0)),
    }


def _global_leaves(sd, embed_bias):
    return {
        (ROOT + "embedding_shard/~/linear", "w"): (sd["transformer.wte.weight"], ("split", 0)),
        (ROOT + "embedding_shard/~/linear", "b"): (embed_bias, ("sum",)),
        (ROOT + "projection_shard/~/linear", "w"): (sd["lm_head.weight"].T, ("split", 1)),
        (ROOT + "projection_shard/~/linear", "b"): (sd["lm_head.bias"], ("split", 0)),
        (ROOT + "projection_shard/~/replicated_layer_norm", "scale"): (sd["transformer.ln_f.weight"], ("first", 1.0)),
        (ROOT + "projection_shard/~/replicated_layer_norm", "offset"): (sd["transformer.ln_f.bias"], ("first", 0.0)),
    }


def _shard_values(x, how, shards, moment=False):
    """The `shards` per-shard arrays holding whole leaf `x`."""
    if how[0] == "split":
        return np.split(x, shards, axis=how[1])
    if how[0] == "first":  # other shards: untouched init (params) or zero gradients (moments)
        return [x] + [np.full_like(x, 0.0 if moment else how[1]) for _ in range(shards - 1)]
    if moment:  # each summed term gets the whole gradient: identical moments
        return [x] * shards
    if shards == 1:
        return [x]
    # unequal terms whose sum is exact in any order and dtype: x/2, x/2, 0, 0, ...
    return [x * 0.5 if s < 2 else np.zeros_like(x) for s in range(shards)]


def _tree(leaves: dict, shard: int, shards: int, dtype, moment=False) -> dict:
    """haiku params {module: {param: array}} of one shard."""
    out: dict = {}
    for (module, param), (x, how) in leaves.items():
        value = _shard_values(x, how, shards, moment)[shard]
        out.setdefault(module, {})[param] = np.ascontiguousarray(value).astype(dtype)
    return out


def _split16(leaves):
    k, m = divmod(len(leaves), 16)
    return [leaves[i * k + min(i, m):(i + 1) * k + min(i + 1, m)] for i in range(16)]


def _quantize(sd, dtype):
    return {k: v.astype(dtype).astype(np.float32) for k, v in sd.items()}


def _state_dict(model) -> dict:
    return {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()
            if not k.endswith(("attn.bias", "attn.masked_bias"))}


def v1_leaves(sd: dict, layers: int, embed_bias) -> dict:
    leaves = _global_leaves(sd, embed_bias)
    for i in range(layers):
        leaves.update(_layer_leaves(sd, i))
    return leaves


def write_v1(model, step_dir, shards: int, dtype: str = "fp32", moments=None, seed: int = 0,
             step: int = 7) -> dict:
    """Write `model` (torch GPTJForCausalLM, changed in place to the stored weights) as a v1 checkpoint.

    `moments`: (mu, nu) as HF-named state dicts -> a full checkpoint (float32 params, Adam state,
    schedule count); else slim with params in `dtype`. Returns the HF state dict the files represent.
    """
    import torch

    np_dtype = DTYPES[dtype if moments is None else "fp32"]
    layers = model.config.n_layer
    sd = _quantize(_state_dict(model), np_dtype)
    rng = np.random.RandomState(seed)
    embed_bias = rng.normal(0, 0.1, sd["transformer.wte.weight"].shape[1]).astype(np_dtype).astype(np.float32)
    sd["transformer.wte.weight"] = (sd["transformer.wte.weight"] - embed_bias).astype(np_dtype).astype(np.float32)
    leaves = v1_leaves(sd, layers, embed_bias)
    represented = dict(sd, **{"transformer.wte.weight": sd["transformer.wte.weight"] + embed_bias})
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(represented[name]))
    moment_leaves = None
    if moments is not None:
        moment_leaves = [v1_leaves(m, layers, rng.normal(0, 1, embed_bias.shape).astype(np.float32)) for m in moments]
    for s in range(shards):
        state = {"params": _tree(leaves, s, shards, np_dtype), "step": np.int32(step)}
        if moment_leaves is not None:
            mu, nu = (_tree(m, s, shards, np.float32, moment=True) for m in moment_leaves)
            state["opt_state"] = [optax.EmptyState(), optax.EmptyState(),
                                  optax.ScaleByAdamState(np.int32(step), mu, nu), optax.EmptyState(),
                                  optax.EmptyState(), optax.ScaleByScheduleState(np.int32(step))]
        flat = jax.tree_util.tree_flatten(state)[0]
        directory = os.path.join(step_dir, f"shard_{s}")
        os.makedirs(directory, exist_ok=True)
        for i, piece in enumerate(_split16(flat)):
            np.savez(os.path.join(directory, f"{i}.npz"), *piece)
    return represented


def random_moments(model, seed: int = 1) -> tuple[dict, dict]:
    """(mu, nu): HF-named random float32 arrays shaped like the model's parameters (nu > 0)."""
    rng = np.random.RandomState(seed)
    sd = _state_dict(model)
    mu = {k: rng.normal(0, 1e-3, v.shape).astype(np.float32) for k, v in sd.items()}
    nu = {k: rng.uniform(1e-8, 1e-6, v.shape).astype(np.float32) for k, v in sd.items()}
    return mu, nu
