"""GPT-J in Haiku (Wang & Komatsuzaki 2021; numerically `transformers.GPTJForCausalLM`).

    x = embed(tokens)
    for each layer:  h = LN(x);  x = x + Attn(h) + MLP(h)        # parallel residual
    logits = lm_head(LN_f(x))

Attention uses rotary position embedding on the first `pe_rotary_dims` dims of each head with
GPT-J's interleaved pairing, no biases on q/k/v/out. The MLP is fc_in -> tanh-GELU -> fc_out, with
biases. Layers are stacked and scanned (`hk.layer_stack`), so compile time does not grow with
depth. Nothing here names a device or a PartitionSpec: `parallel.param` returns the local shard of
a parameter and `parallel.psum_mp` is the one reduction the parallel residual needs per layer.

Shape letters: B batch, T time, D d_model, N heads, H head dim, F d_ff, V (local) vocabulary.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import haiku as hk
import jax
import jax.numpy as jnp

from mesh_transformer import parallel
from mesh_transformer.config import ModelConfig

REMAT_POLICIES = {
    "full": None,  # save nothing, recompute the layer in the backward pass
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _normal(std: float) -> hk.initializers.Initializer:
    return hk.initializers.RandomNormal(stddev=std)


class Norm(hk.Module):
    """LayerNorm or RMSNorm over D, computed in float32."""

    def __init__(self, config: ModelConfig, name: str):
        super().__init__(name=name)
        self.kind, self.eps, self.d = config.norm, config.layer_norm_eps, config.d_model

    def __call__(self, x):  # [B, T, D] -> [B, T, D]
        dtype = x.dtype
        x = x.astype(jnp.float32)
        scale = parallel.param("scale", (self.d,), hk.initializers.Constant(1.0))
        if self.kind == "rmsnorm":
            x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + self.eps)
            return (x * scale).astype(dtype)
        offset = parallel.param("offset", (self.d,), hk.initializers.Constant(0.0))
        mean = jnp.mean(x, -1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
        x = (x - mean) * jax.lax.rsqrt(var + self.eps)
        return (x * scale + offset).astype(dtype)


def rotary(x, positions, rotary_dims: int):
    """Rotate the first `rotary_dims` features of each head, pairing features (2i, 2i+1).

    x: [B, T, N, H]; positions: [B, T] (int). GPT-J's `rotate_every_two` convention.
    """
    if rotary_dims == 0:
        return x
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, rotary_dims, 2, dtype=jnp.float32) / rotary_dims))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, R/2]
    sin = jnp.repeat(jnp.sin(angles), 2, axis=-1)[:, :, None, :]  # [B, T, 1, R]
    cos = jnp.repeat(jnp.cos(angles), 2, axis=-1)[:, :, None, :]
    x_rot, x_pass = x[..., :rotary_dims], x[..., rotary_dims:]
    pairs = x_rot.astype(jnp.float32).reshape(*x_rot.shape[:-1], rotary_dims // 2, 2)
    rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x_rot.shape)
    x_rot = x_rot.astype(jnp.float32) * cos + rotated * sin
    return jnp.concatenate([x_rot.astype(x.dtype), x_pass], axis=-1)


class KVCache(NamedTuple):
    """Keys and values of every layer for decoding; sharded like activations (heads over mp).

    k, v: [L, B, S, N, H]. Row b's tokens live in slots start[b] .. index-1 (prompts are
    left-padded to a shared length); the next tokens are written at slot `index`.
    """

    k: jax.Array
    v: jax.Array
    start: jax.Array  # [B] int32
    index: jax.Array  # [] int32

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, slots: int, start, dtype=None):
        shape = (config.layers, batch, slots, config.n_heads, config.head_dim)
        dtype = dtype or jnp.dtype(config.compute_dtype)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.asarray(start, jnp.int32), jnp.zeros((), jnp.int32))


class Attention(hk.Module):
    """Causal multi-head attention; heads are split over 'mp' (column-parallel q/k/v, row-parallel out)."""

    def __init__(self, config: ModelConfig, name: str = "attn"):
        super().__init__(name=name)
        self.config = config

    def __call__(self, h, positions, mask, cache=None):
        """h [B, T, D], positions [B, T], mask [B, 1, T, S] (True = may attend), cache (k, v) [B, S, N, H].

        Returns (partial sum over mp shards [B, T, D], updated cache or None).
        """
        c = self.config
        d, n, hd = c.d_model, c.n_heads, c.head_dim
        init = _normal(0.02)
        q = jnp.einsum("btd,dnh->btnh", h, parallel.param("q_proj", (d, n, hd), init, h.dtype))
        k = jnp.einsum("btd,dnh->btnh", h, parallel.param("k_proj", (d, n, hd), init, h.dtype))
        v = jnp.einsum("btd,dnh->btnh", h, parallel.param("v_proj", (d, n, hd), init, h.dtype))
        q, k = rotary(q, positions, c.rotary_dims), rotary(k, positions, c.rotary_dims)
        if cache is not None:
            cache_k, cache_v, index = cache
            k = jax.lax.dynamic_update_slice_in_dim(cache_k, k.astype(cache_k.dtype), index, axis=1)
            v = jax.lax.dynamic_update_slice_in_dim(cache_v, v.astype(cache_v.dtype), index, axis=1)
            cache = (k, v)
        scores = jnp.einsum("btnh,bsnh->bnts", q.astype(jnp.float32), k.astype(jnp.float32))
        scores = jnp.where(mask, scores / jnp.sqrt(jnp.float32(hd)), jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bnts,bsnh->btnh", weights, v).astype(h.dtype)
        w_out = parallel.param("out_proj", (n, hd, d), _normal(0.02 / math.sqrt(2 * c.layers)), h.dtype)
        return jnp.einsum("btnh,nhd->btd", out, w_out), cache


class MLP(hk.Module):
    """fc_in -> tanh-GELU -> fc_out; F is split over 'mp' (column- then row-parallel)."""

    def __init__(self, config: ModelConfig, name: str = "mlp"):
        super().__init__(name=name)
        self.config = config

    def __call__(self, h):
        """h [B, T, D] -> (partial sum over mp shards [B, T, D], fc_out bias [D]).

        The bias is returned, not added, so it is added once after the mp reduction.
        """
        c = self.config
        d, f = c.d_model, c.ff_dim
        w_in = parallel.param("fc_in", (d, f), _normal(0.02), h.dtype)
        b_in = parallel.param("fc_in_bias", (f,), hk.initializers.Constant(0.0), h.dtype)
        x = jax.nn.gelu(jnp.einsum("btd,df->btf", h, w_in) + b_in, approximate=True)
        w_out = parallel.param("fc_out", (f, d), _normal(0.02 / math.sqrt(2 * c.layers)), h.dtype)
        b_out = parallel.param("fc_out_bias", (d,), hk.initializers.Constant(0.0), h.dtype)
        return jnp.einsum("btf,fd->btd", x, w_out), b_out


class Embedding(hk.Module):
    """Vocab-parallel token embedding (each mp shard holds V/mp rows), plus learned positions if pe='fixed'."""

    def __init__(self, config: ModelConfig, padded_vocab: int, name: str = "embed"):
        super().__init__(name=name)
        self.config, self.padded_vocab = config, padded_vocab

    def __call__(self, tokens, positions, dtype):  # [B, T] -> [B, T, D]
        c = self.config
        table = parallel.param("embeddings", (self.padded_vocab, c.d_model), _normal(0.02), dtype)
        local_vocab = table.shape[0]
        local_ids = tokens - parallel.mp_index() * local_vocab
        here = (local_ids >= 0) & (local_ids < local_vocab)
        x = jnp.take(table, jnp.clip(local_ids, 0, local_vocab - 1), axis=0)
        x = parallel.psum_mp(jnp.where(here[..., None], x, 0))
        if c.pe == "fixed":
            pos_table = parallel.param("pos_embeddings", (c.seq, c.d_model), _normal(0.01), dtype)
            x = x + jnp.take(pos_table, positions, axis=0)
        return x


class LMHead(hk.Module):
    """Vocab-parallel output projection; padded vocabulary entries get -inf."""

    def __init__(self, config: ModelConfig, padded_vocab: int, name: str = "head"):
        super().__init__(name=name)
        self.config, self.padded_vocab = config, padded_vocab

    def __call__(self, x):  # [B, T, D] -> local logits [B, T, V/mp] (float32)
        c = self.config
        w = parallel.param("lm_head", (c.d_model, self.padded_vocab), _normal(0.02), x.dtype)
        b = parallel.param("lm_head_bias", (self.padded_vocab,), hk.initializers.Constant(0.0))
        vocab_ids = parallel.mp_index() * b.shape[-1] + jnp.arange(b.shape[-1])
        b = jnp.where(vocab_ids < c.n_vocab, b.astype(jnp.float32), -jnp.inf)  # [V/mp]: cheaper than masking logits
        return jnp.einsum("btd,dv->btv", x, w).astype(jnp.float32) + b


class GPTJ(hk.Module):
    def __init__(self, config: ModelConfig, padded_vocab: int, name: str = "gptj"):
        super().__init__(name=name)
        self.config, self.padded_vocab = config, padded_vocab

    def __call__(self, tokens, cache: Optional[KVCache] = None, last_only: bool = False):
        """tokens [B, T] (int) -> (logits [B, T, V/mp] float32, this shard's vocabulary slice; new cache).

        Without a cache the T tokens are positions 0..T-1 under a causal mask (training). With a
        cache they go into slots cache.index .. index+T-1 and attend to every earlier valid slot.
        `last_only` computes logits for the last position only ([B, 1, V/mp]; prefill).
        """
        c = self.config
        positions, mask = _positions_and_mask(tokens.shape, cache)
        dtype = jnp.dtype(c.compute_dtype)
        x = Embedding(c, self.padded_vocab)(tokens, positions, dtype)

        def layer(x, layer_cache):
            h = Norm(c, name="ln_1")(x)
            kv = None if layer_cache is None else (*layer_cache, cache.index)
            attn_out, kv = Attention(c)(h, positions, mask, kv)
            mlp_out, mlp_bias = MLP(c)(h)
            return x + parallel.psum_mp(attn_out + mlp_out) + mlp_bias, kv

        if c.remat != "none" and cache is None:
            layer = hk.remat(layer, policy=REMAT_POLICIES[c.remat])
        per_layer = None if cache is None else (cache.k, cache.v)
        x, kv = hk.layer_stack(c.layers, with_per_layer_inputs=True, name="layers")(layer)(x, per_layer)
        x = Norm(c, name="ln_f")(x)
        logits = LMHead(c, self.padded_vocab)(x[:, -1:] if last_only else x)
        if cache is None:
            return logits, None
        return logits, KVCache(kv[0], kv[1], cache.start, cache.index + tokens.shape[1])


def _positions_and_mask(shape, cache: Optional[KVCache]):
    """positions [B, T] and attention mask [B, 1, T, S] for `shape` = (B, T) new tokens."""
    batch, t = shape
    if cache is None:
        positions = jnp.broadcast_to(jnp.arange(t), shape)
        return positions, jnp.tril(jnp.ones((t, t), dtype=bool))[None, None]
    slots = cache.index + jnp.arange(t)  # [T]
    positions = jnp.maximum(slots[None, :] - cache.start[:, None], 0)
    keys = jnp.arange(cache.k.shape[2])  # [S]
    mask = (keys[None, None, :] <= slots[None, :, None]) & (keys[None, None, :] >= cache.start[:, None, None])
    return positions, mask[:, None]


def build(config: ModelConfig, mp: int = 1) -> hk.Transformed:
    """The Haiku-transformed model: `init(rng, tokens)` -> params;
    `apply(params, tokens, cache=None, last_only=False)` -> (logits, cache).

    `mp` only decides the vocabulary padding (see `ModelConfig.padded_vocab`).
    """
    padded = config.padded_vocab(mp)
    return hk.without_apply_rng(hk.transform(
        lambda tokens, cache=None, last_only=False: GPTJ(config, padded)(tokens, cache, last_only)))
