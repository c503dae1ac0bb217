"""GPT-J in Haiku (Wang & Komatsuzaki 2021; numerically `transformers.GPTJForCausalLM`).

    x = embed(tokens)
    for each layer:  h = LN(x);  x = x + Attn(h) + MLP(h)        # parallel residual
    logits = lm_head(LN_f(x))

Attention uses rotary position embedding on the first `pe_rotary_dims` dims of each head with
GPT-J's interleaved pairing, no biases on q/k/v/out. The MLP is fc_in -> tanh-GELU -> fc_out, with
biases. Matmuls accumulate in float32 (`dense`). For training, layers are stacked and scanned
(`hk.layer_stack`), so compile time does not grow with depth; with a KV cache (generation) they
run unrolled over per-layer parameters and caches (`unstack_layers`), because a scan slices each
layer's weights and cache out of the stack, and XLA:CPU copies such slices every decode step
(twice the memory traffic on a memory-bound step). Nothing here names a device or a
PartitionSpec: `parallel.param` returns the local shard of a parameter and `parallel.psum_mp` is
the one reduction the parallel residual needs per layer.

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


def dense(equation: str, x, w, dtype=None):
    """x [..., *inputs] times a weight [*inputs, *outputs] -> [..., *outputs]: one 2-d matmul
    accumulating in float32, the result in `dtype` (default x's).

    `equation` names the axes ("btd,dnh->btnh") and is checked: x's last axes are the weight's
    first ones. The weight may be a `parallel.InputsLast` one (decoding), stored [*outputs, *inputs].
    Why 2-d: with several contracted axes XLA may transpose the weight on every call. Why a float32
    result: with bfloat16 operands XLA:CPU runs the matmul natively only when asked for one.
    """
    lhs, rest = equation.split(",")
    w_axes, out = rest.split("->")
    n_in = len(set(lhs) & set(w_axes))
    if lhs[len(lhs) - n_in:] != w_axes[:n_in] or out != lhs[:len(lhs) - n_in] + w_axes[n_in:]:
        raise ValueError(f"dense({equation!r}): expected x [..., *inputs] and a weight [*inputs, *outputs]")
    batch = x.shape[:x.ndim - n_in]
    x = x.reshape(*batch, -1)
    if isinstance(w, parallel.InputsLast):
        outputs = w.array.shape[:-n_in]
        y = jnp.einsum("...k,ok->...o", x, w.array.reshape(math.prod(outputs), -1), preferred_element_type=jnp.float32)
    else:
        outputs = w.shape[n_in:]
        y = jnp.einsum("...k,ko->...o", x, w.reshape(-1, math.prod(outputs)), preferred_element_type=jnp.float32)
    return y.reshape(*batch, *outputs).astype(dtype or x.dtype)


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
    """Keys and values for decoding; sharded like activations (heads over mp).

    k: one [B, N, H, S] array per layer (a tuple of L), v: one [B, N, S, H] per layer, updated in
    place as layers run. These are the layouts attention's two matmuls (q.k^T, then weights.v)
    read, so no step transposes the cache. Row b's tokens live in slots start[b] .. index-1
    (prompts are left-padded to a shared length); the next tokens are written at slot `index`.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    start: jax.Array  # [B] int32
    index: jax.Array  # [] int32

    K_SLOTS, V_SLOTS = 3, 2  # the slot axis of each k and v array

    @property
    def slots(self) -> int:
        return self.v[0].shape[self.V_SLOTS]

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, slots: int, start=0, mp: int = 1):
        """An empty cache (with `mp`: one model-parallel shard's, N / mp heads)."""
        heads, dtype = config.n_heads // mp, jnp.dtype(config.compute_dtype)
        k = tuple(jnp.zeros((batch, heads, config.head_dim, slots), dtype) for _ in range(config.layers))
        v = tuple(jnp.zeros((batch, heads, slots, config.head_dim), dtype) for _ in range(config.layers))
        return cls(k, v, jnp.broadcast_to(jnp.asarray(start, jnp.int32), (batch,)), jnp.zeros((), jnp.int32))

    def along_slots(self, fn, *others: "KVCache") -> "KVCache":
        """The cache with each layer's k and v replaced by fn(array, *the same array of `others`,
        axis=its slot axis); start and index are kept."""
        k = tuple(fn(*xs, axis=self.K_SLOTS) for xs in zip(self.k, *(o.k for o in others)))
        v = tuple(fn(*xs, axis=self.V_SLOTS) for xs in zip(self.v, *(o.v for o in others)))
        return self._replace(k=k, v=v)


class Attention(hk.Module):
    """Causal multi-head attention; heads are split over 'mp' (column-parallel q/k/v, row-parallel out)."""

    def __init__(self, config: ModelConfig, name: str = "attn"):
        super().__init__(name=name)
        self.config = config

    def __call__(self, h, positions, mask, cache=None):
        """h [B, T, D], positions [B, T], mask [B, 1, T, S] (True = may attend), cache (k, v, index):
        k [B, N, H, S], v [B, N, S, H] (see KVCache) and the slot `index` the T new ones go to.

        Returns (partial sum over mp shards [B, T, D], updated (k, v) or None).
        """
        c = self.config
        d, n, hd = c.d_model, c.n_heads, c.head_dim
        init = _normal(0.02)
        q = dense("btd,dnh->btnh", h, parallel.param("q_proj", (d, n, hd), init, h.dtype))
        k = dense("btd,dnh->btnh", h, parallel.param("k_proj", (d, n, hd), init, h.dtype))
        v = dense("btd,dnh->btnh", h, parallel.param("v_proj", (d, n, hd), init, h.dtype))
        q, k = rotary(q, positions, c.rotary_dims), rotary(k, positions, c.rotary_dims)
        k, v = jnp.transpose(k, (0, 2, 3, 1)), jnp.swapaxes(v, 1, 2)  # [B, N, H, T], [B, N, T, H] as cached
        if cache is not None:
            cache_k, cache_v, index = cache
            k = jax.lax.dynamic_update_slice_in_dim(cache_k, k.astype(cache_k.dtype), index, KVCache.K_SLOTS)
            v = jax.lax.dynamic_update_slice_in_dim(cache_v, v.astype(cache_v.dtype), index, KVCache.V_SLOTS)
            cache = (k, v)
        scores = jnp.einsum("btnh,bnhs->bnts", q.astype(k.dtype), k, preferred_element_type=jnp.float32)
        scores = jnp.where(mask, scores / jnp.sqrt(jnp.float32(hd)), jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bnts,bnsh->btnh", weights, v, preferred_element_type=jnp.float32).astype(h.dtype)
        w_out = parallel.param("out_proj", (n, hd, d), _normal(0.02 / math.sqrt(2 * c.layers)), h.dtype)
        return dense("btnh,nhd->btd", out, w_out), cache


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
        x = jax.nn.gelu(dense("btd,df->btf", h, w_in) + b_in, approximate=True)
        w_out = parallel.param("fc_out", (f, d), _normal(0.02 / math.sqrt(2 * c.layers)), h.dtype)
        b_out = parallel.param("fc_out_bias", (d,), hk.initializers.Constant(0.0), h.dtype)
        return dense("btf,fd->btd", x, w_out), b_out


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
        return dense("btd,dv->btv", x, w, jnp.float32) + b


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

        def layer(x, kv=None):
            h = Norm(c, name="ln_1")(x)
            attn_out, kv = Attention(c)(h, positions, mask, kv)
            mlp_out, mlp_bias = MLP(c)(h)
            return x + parallel.psum_mp(attn_out + mlp_out) + mlp_bias, kv

        if cache is None:
            block = lambda x: layer(x)[0]  # noqa: E731
            if c.remat != "none":
                block = hk.remat(block, policy=REMAT_POLICIES[c.remat])
            x = hk.layer_stack(c.layers, name=STACKED)(block)(x)
        else:
            new_k, new_v = [], []
            for i in range(c.layers):
                with hk.name_scope(unstacked(i)):
                    x, (k, v) = layer(x, (cache.k[i], cache.v[i], cache.index))
                new_k.append(k)
                new_v.append(v)
            cache = KVCache(tuple(new_k), tuple(new_v), cache.start, cache.index + tokens.shape[1])
        x = Norm(c, name="ln_f")(x)
        logits = LMHead(c, self.padded_vocab)(x[:, -1:] if last_only else x)
        return logits, cache


def _positions_and_mask(shape, cache: Optional[KVCache]):
    """positions [B, T] and attention mask [B, 1, T, S] for `shape` = (B, T) new tokens."""
    batch, t = shape
    if cache is None:
        positions = jnp.broadcast_to(jnp.arange(t), shape)
        return positions, jnp.tril(jnp.ones((t, t), dtype=bool))[None, None]
    slots = cache.index + jnp.arange(t)  # [T]
    positions = jnp.maximum(slots[None, :] - cache.start[:, None], 0)
    keys = jnp.arange(cache.slots)  # [S]
    mask = (keys[None, None, :] <= slots[None, :, None]) & (keys[None, None, :] >= cache.start[:, None, None])
    return positions, mask[:, None]


STACKED = "layers"  # module of the scanned layers: parameters "gptj/layers/..." with a leading [L] axis


def unstacked(i: int) -> str:
    """Name scope of layer i when layers run unrolled (parameters "gptj/layer_{i}/...")."""
    return f"layer_{i}"


def unstack_layers(params, layers: int, convert=lambda name, x: x):
    """Scanned parameters -> the per-layer ones the unrolled (KV-cache) model reads.

    "gptj/layers/attn" [L, ...] becomes "gptj/layer_0/attn" ... "gptj/layer_{L-1}/attn"; other
    modules are kept. `convert(leaf name, array)` makes each output leaf (e.g. casts and places it),
    one at a time.
    """
    out = {}
    for module, leaves in params.items():
        root, _, rest = module.partition(f"/{STACKED}/")
        if not rest:
            out[module] = {name: convert(name, x) for name, x in leaves.items()}
            continue
        for i in range(layers):
            out[f"{root}/{unstacked(i)}/{rest}"] = {name: convert(name, x[i]) for name, x in leaves.items()}
    return out


def build(config: ModelConfig, mp: int = 1) -> hk.Transformed:
    """The Haiku-transformed model: `init(rng, tokens)` -> params (layers stacked);
    `apply(params, tokens, cache=None, last_only=False)` -> (logits, cache). With a cache, `params`
    are per-layer (`unstack_layers`).

    `mp` only decides the vocabulary padding (see `ModelConfig.padded_vocab`).
    """
    padded = config.padded_vocab(mp)
    return hk.without_apply_rng(hk.transform(
        lambda tokens, cache=None, last_only=False: GPTJ(config, padded)(tokens, cache, last_only)))
