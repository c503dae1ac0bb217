"""The layers every family is built from: matmul, norms, rotary and ALiBi positions, attention, MLPs,
vocab-parallel embedding and head.

Nothing here names a device: each parameter is made by `parallel.param` / `parallel.weight` with
its logical axes, and comes back as the shard this device computes with. Row-parallel layers
return a `RowParallel` (partial sum over 'mp', bias), so a block adds its biases once, after the
one reduction it does (`reduce_mp`).

Shape letters: B batch, T time (new tokens), S cache slots (keys), D d_model, N query heads,
K key/value heads, G query heads per kv head, H head dim, F d_ff, V (local) vocabulary.
"""
from __future__ import annotations

import contextlib
import functools
import math
import threading
from typing import Callable, NamedTuple, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from mesh_transformer import kernels, parallel


def normal(std: float) -> hk.initializers.Initializer:
    return hk.initializers.RandomNormal(stddev=std)


ZEROS, ONES = hk.initializers.Constant(0.0), hk.initializers.Constant(1.0)


def dense(equation: str, x, w, dtype=None):
    """x [..., *inputs] times a weight [*inputs, *outputs] -> [..., *outputs]: one 2-d matmul
    accumulating in float32, the result in `dtype` (default x's).

    `equation` names the axes ("btd,dnh->btnh") and is checked: x's last axes are the weight's
    first ones. The weight may be a `parallel.InputsLast` one (decoding), stored [*outputs, *inputs],
    int8 (`parallel.Quantized`), with a LoRA adapter (`parallel.LoRAWeight`) or with a bank of them
    and each row's choice (`parallel.AdapterBank`, serving many adapters at once).
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
    if isinstance(w, parallel.LoRAWeight):
        return _lora_dense(x, w, n_in, batch, dtype or x.dtype)
    if isinstance(w, parallel.AdapterBank):
        y, outputs = _weight_product(x, w.base, n_in)
        y = y + _banked_low_rank(x, w, n_in)
    else:
        y, outputs = _weight_product(x, w, n_in)
    # named so remat="dots" keeps it: a custom_vjp call is no dot_general to jax.checkpoint_policies
    return checkpoint_name(y.reshape(*batch, *outputs).astype(dtype or x.dtype), WEIGHT_PRODUCT)


def _weight_product(x, w, n_in: int):
    """x [..., K] times a plain, inputs-last or int8 weight -> (float32 [..., O], the weight's output shape)."""
    if isinstance(w, parallel.InputsLast):
        outputs = w.array.shape[:-n_in]
        return product("...k,ok->...o", x, w.array.reshape(math.prod(outputs), -1)), outputs
    if isinstance(w, parallel.Quantized):
        outputs = w.values.shape[n_in:]
        return quantized_product(x, w.values.reshape(-1, math.prod(outputs)), w.scale.reshape(-1)), outputs
    outputs = w.shape[n_in:]
    return product("...k,ko->...o", x, w.reshape(-1, math.prod(outputs))), outputs


def _banked_low_rank(x, w: "parallel.AdapterBank", n_in: int):
    """x [B, ..., K] -> float32 [B, ..., O]: each row's (x A_e) B_e for its entry e = rows[b] (scales
    folded into B), as two products of the weight's own kind (the CPU kernels run them): x times
    every entry's A [K, N r], the other entries' ranks zeroed, times B [N r, O]. Costs N r (K + O)
    a row, N times the row's own adapter; measured faster on a CPU than gathering each row's A and
    B (a batched product per row), and no more than a few percent of K O while N r is small next
    to K and O (4 adapters of rank 16 on d_model 4,096: 3%)."""
    low, (n, r) = _weight_product(x, w.a, n_in)  # [..., N r]: every adapter's x A
    low = low.reshape(w.rows.shape[0], -1, n, r)
    low = jnp.where((jnp.arange(n) == w.rows[:, None])[:, None, :, None], low, 0).astype(x.dtype)
    y, _ = _weight_product(low.reshape(*x.shape[:-1], n * r), w.b, 2)
    return y


WEIGHT_PRODUCT = "weight_product"  # the checkpoint_name of every dense() output
_ROWS_DOT_WEIGHT = ("...k,ok->...o", "btd,vd->btv")  # rows times an inputs-last weight or a tied embedding table


def product(equation: str, a, b):
    """`jnp.einsum(equation, a, b)` accumulated and returned in float32, whose gradient matmuls take
    their operands in the forward's dtypes: with bfloat16 operands all three matmuls run natively
    (bf16 x bf16), as in torch's autocast, instead of in float32 on the float32 cotangent.

    Every index of `equation` appears in two of its three terms (no index summed inside one operand).
    Inside shard_map both operands first vary over the same mesh axes (what the einsum does
    implicitly), so the transposes of those casts add the reductions autodiff owes (a column-parallel
    input's gradient over 'mp', a weight's over 'dp')."""
    return _product(equation, *parallel.vary_alike(a, b))


def quantized_product(x, values, scale):
    """x [..., K] times an int8 weight (values [K, O], float32 scale [O]) -> float32 [..., O].

    A few rows on CPU (decoding): the kernels read the int8 values, the product is scaled after.
    Otherwise the weight is widened to x's dtype with its scale folded in, so the result is the
    matmul's own (scaling a logits-sized product would make a second buffer of it); differentiated
    (a LoRA run's `quantize_base`), the int8 values are what the backward keeps, widened again
    there, so a layer scan holds no float copy of the base."""
    if kernels.applies(x, values):
        return product("...k,ko->...o", x, values) * scale
    return _quantized_product(*parallel.vary_alike(x, values, scale))


def _folded(values, scale, dtype):
    return (values.astype(jnp.float32) * scale).astype(dtype)


@jax.custom_vjp
def _quantized_product(x, values, scale):
    return jnp.einsum("...k,ko->...o", x, _folded(values, scale, x.dtype), preferred_element_type=jnp.float32)


def _quantized_product_forward(x, values, scale):
    return _quantized_product(x, values, scale), (x, values, scale)


def _quantized_product_backward(saved, g):
    x, values, scale = saved
    dx = jnp.einsum("...o,ko->...k", g.astype(x.dtype), _folded(values, scale, x.dtype),
                    preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), np.zeros(values.shape, jax.dtypes.float0), jnp.zeros_like(scale)


_quantized_product.defvjp(_quantized_product_forward, _quantized_product_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _product(equation: str, a, b):
    """Not differentiated (decoding, evaluation): on CPU the `kernels` where they apply (they read
    an int8 `b`, a quantized weight's values, as it is)."""
    if equation == "...k,ko->...o" and kernels.applies(a, b):  # decoding a few rows, or a serving batch
        return kernels.rows_times_weight(a, b)
    if equation in _ROWS_DOT_WEIGHT and kernels.dot_applies(a, b):  # 1-64 rows, inputs-last (or a tied head)
        return kernels.rows_dot_weight(a, b)
    if equation in _PER_ROW_AND_KV_HEAD and kernels.grouped_applies(a, b):  # attention over the KV cache
        return kernels.grouped_rows_times_weight(a, b)
    return jnp.einsum(equation, a, b, preferred_element_type=jnp.float32)


def _product_forward(equation, a, b):
    """Differentiated (training): XLA's product, as the backward's, so a step sums in the same order
    whatever rows each device holds (a microbatch of 32-64 tokens would take the blocked kernel on
    one mesh and XLA's matmul on another). An int8 `b` (a few rows of a LoRA run's quantized base)
    is saved for the backward as it is and widened there: a layer scan keeps no float copy of it."""
    return jnp.einsum(equation, a, b, preferred_element_type=jnp.float32), (a, b)


def _product_backward(equation, saved, g):
    a, b = saved
    terms, out = equation.split("->")
    in_a, in_b = terms.split(",")
    if not jnp.issubdtype(b.dtype, jnp.floating):  # int8 values of a frozen base: rows' gradient only
        g = g.astype(a.dtype)
        da = jnp.einsum(f"{out},{in_b}->{in_a}", g, b.astype(a.dtype), preferred_element_type=jnp.float32)
        return da.astype(a.dtype), np.zeros(b.shape, jax.dtypes.float0)
    g = g.astype(jnp.promote_types(a.dtype, b.dtype))
    da = jnp.einsum(f"{out},{in_b}->{in_a}", g, b, preferred_element_type=jnp.float32)
    db = jnp.einsum(f"{in_a},{out}->{in_b}", a, g, preferred_element_type=jnp.float32)
    return da.astype(a.dtype), db.astype(b.dtype)


_product.defvjp(_product_forward, _product_backward)


def add_bias(x, b):
    """x [..., N] + b [N], whose gradient for b is a matmul (ones [1, rows] x g) instead of a sum over
    rows: XLA:CPU 0.10 runs that sum over a vocabulary head's [tokens, 50k] logit gradients as slowly
    as the head's matmul (490 ms where the matmul form takes 6, `bench/profile_train.py`)."""
    return _add_bias(*parallel.vary_alike(x, b))


@jax.custom_vjp
def _add_bias(x, b):
    return x + b


def _add_bias_forward(x, b):
    return x + b, jnp.zeros((0,), b.dtype)  # only b's dtype is needed


def _add_bias_backward(saved, g):
    rows = g.reshape(-1, g.shape[-1])
    db = jnp.dot(jnp.ones((1, rows.shape[0]), rows.dtype), rows, preferred_element_type=jnp.float32)
    return g, db[0].astype(saved.dtype)


_add_bias.defvjp(_add_bias_forward, _add_bias_backward)


def _lora_dense(x, w: "parallel.LoRAWeight", n_in: int, batch, dtype):
    """x [..., K] -> x W + scale * (dropout(x) A) B, W [*inputs, *outputs], A [*inputs, r], B [r, *outputs]
    (LoRA, Hu et al. 2021; PEFT's order of operations). The low-rank path costs 2 r (K + outputs) per row.
    W may be int8 (`parallel.Quantized`: a run's `quantize_base`), as QLoRA's 4-bit base (Dettmers et
    al. 2023) at 8 bits: x (values) x scale."""
    base = w.base
    if isinstance(base, parallel.Quantized):  # an int8 frozen base (`quantize_base`)
        outputs = base.values.shape[n_in:]
        y = quantized_product(x, base.values.reshape(-1, math.prod(outputs)), base.scale.reshape(-1))
    else:
        outputs = base.shape[n_in:]
        y = jnp.einsum("...k,ko->...o", x, base.reshape(-1, math.prod(outputs)), preferred_element_type=jnp.float32)
    xa = x
    key = hk.maybe_next_rng_key() if w.dropout > 0 else None
    if key is not None:  # training: one mask per data-parallel shard (the data differs), the same over mp
        key = jax.random.fold_in(key, parallel.dp_index())
        keep = jax.random.bernoulli(key, 1.0 - w.dropout, x.shape)
        xa = jnp.where(keep, x / (1.0 - w.dropout), 0).astype(x.dtype)
    low = jnp.einsum("...k,kr->...r", xa, w.a.reshape(-1, w.a.shape[-1]), preferred_element_type=jnp.float32)
    low = jnp.einsum("...r,ro->...o", low.astype(x.dtype), w.b.reshape(w.b.shape[0], -1),
                     preferred_element_type=jnp.float32)
    return (y + w.scale * low).reshape(*batch, *outputs).astype(dtype)


class RowParallel(NamedTuple):
    """A row-parallel layer's output: this shard's partial sum [B, T, D] and the bias to add once (or None)."""

    partial: jax.Array
    bias: Optional[jax.Array] = None


def reduce_mp(*outputs: RowParallel):
    """Sum row-parallel outputs over the mp shards with one all-reduce, then add their biases once."""
    total = parallel.psum_mp(sum(o.partial for o in outputs))
    for o in outputs:
        if o.bias is not None:
            total = total + o.bias
    return total


# --------------------------------------------------------------------------------------------
# Norms
# --------------------------------------------------------------------------------------------

class LayerNorm(hk.Module):
    """LayerNorm over D, in float32 (Ba et al. 2016)."""

    def __init__(self, d: int, eps: float, name: str):
        super().__init__(name=name)
        self.d, self.eps = d, eps

    def __call__(self, x):  # [B, T, D] -> [B, T, D]
        dtype, x = x.dtype, x.astype(jnp.float32)
        scale = parallel.param("scale", (self.d,), ("embed",), ONES)
        offset = parallel.param("offset", (self.d,), ("embed",), ZEROS)
        mean = jnp.mean(x, -1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
        return ((x - mean) * jax.lax.rsqrt(var + self.eps) * scale + offset).astype(dtype)


class RMSNorm(hk.Module):
    """RMSNorm over the last axis, in float32 (Zhang & Sennrich 2019): x / rms(x) * scale. `axis`
    names that axis: "embed" for the residual stream, "head_dim" for per-head q/k norms.
    `unit_offset` (Gemma): the parameter is stored as scale - 1 (made as zeros)."""

    def __init__(self, d: int, eps: float, name: str, axis: str = "embed", unit_offset: bool = False):
        super().__init__(name=name)
        self.d, self.eps, self.axis, self.unit_offset = d, eps, axis, unit_offset

    def __call__(self, x):  # [..., d] -> [..., d]
        dtype, x = x.dtype, x.astype(jnp.float32)
        scale = parallel.param("scale", (self.d,), (self.axis,), ZEROS if self.unit_offset else ONES)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + self.eps)
        return (x * (1.0 + scale if self.unit_offset else scale)).astype(dtype)


def norm(kind: str, d: int, eps: float, name: str) -> hk.Module:
    """"layernorm", "rmsnorm", or "rmsnorm+1" (Gemma's: scale stored as scale - 1)."""
    if kind == "rmsnorm+1":
        return RMSNorm(d, eps, name, unit_offset=True)
    return {"layernorm": LayerNorm, "rmsnorm": RMSNorm}[kind](d, eps, name)


def softcap(x, cap: Optional[float]):
    """cap * tanh(x / cap) (Gemma 2's logit soft-capping; None: x). -inf (a masked or padded entry)
    stays -inf."""
    if cap is None:
        return x
    return jnp.where(jnp.isneginf(x), x, cap * jnp.tanh(x / cap))


# --------------------------------------------------------------------------------------------
# Positions: rotary (interleaved or rotate-half pairing, partial, scaled) and ALiBi
# --------------------------------------------------------------------------------------------

class Rotary(NamedTuple):
    """Rotary position embedding (Su et al. 2021) on the first `dims` features of each head.

    pairing "interleaved": features (2i, 2i+1) rotate together (GPT-J, mesh-transformer-jax);
    "half": features (i, i + dims/2) (GPT-NeoX, LLaMA). `scaling`: HF's rope_scaling dict
    ({"rope_type": "linear" | "llama3" | "yarn", ...}) or None.
    """

    dims: int
    pairing: str = "interleaved"
    theta: float = 10000.0
    scaling: Optional[tuple] = None  # sorted (key, value) pairs of HF's rope_scaling dict

    @property
    def kind(self) -> Optional[str]:
        """The scaling's kind (HF's rope_type, or the older type), None without one."""
        scaling = dict(self.scaling or ())
        return scaling.get("rope_type", scaling.get("type"))

    def inv_freq(self):
        """[dims/2] float32 angular frequencies, after any scaling."""
        inv_freq = 1.0 / (self.theta ** (jnp.arange(0, self.dims, 2, dtype=jnp.float32) / self.dims))
        scaling, kind = dict(self.scaling or ()), self.kind
        if kind == "linear":
            return inv_freq / scaling["factor"]
        if kind == "llama3":
            return _llama3_inv_freq(inv_freq, scaling)
        if kind == "yarn":
            return _yarn_inv_freq(inv_freq, self.dims, self.theta, scaling)
        return inv_freq

    def magnitude(self) -> float:
        """What the rotated features are multiplied by: YaRN's attention factor (so the scores of two
        rotated heads by its square), else 1."""
        return _yarn_attention_factor(dict(self.scaling)) if self.kind == "yarn" else 1.0

    def __call__(self, x, positions, inv_freq=None, magnitude=None):
        """x [B, T, N, H], positions [B, T] (int) -> x with its first `dims` features rotated
        (`inv_freq`, `magnitude`: other ones than this rotary's, e.g. chosen per layer)."""
        inv_freq = self.inv_freq() if inv_freq is None else inv_freq
        magnitude = self.magnitude() if magnitude is None else magnitude
        angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, R/2]
        if self.pairing == "interleaved":
            sin = jnp.repeat(jnp.sin(angles), 2, axis=-1)[:, :, None, :]  # [B, T, 1, R]
            cos = jnp.repeat(jnp.cos(angles), 2, axis=-1)[:, :, None, :]
        else:
            sin = jnp.tile(jnp.sin(angles), 2)[:, :, None, :]
            cos = jnp.tile(jnp.cos(angles), 2)[:, :, None, :]
        if not (isinstance(magnitude, float) and magnitude == 1.0):
            sin, cos = sin * magnitude, cos * magnitude
        x_rot, x_pass = x[..., :self.dims].astype(jnp.float32), x[..., self.dims:]
        x_rot = x_rot * cos + _rotated(x_rot, self.pairing) * sin
        return jnp.concatenate([x_rot.astype(x.dtype), x_pass], axis=-1)


def _rotated(x, pairing: str):
    """The 90-degree rotation of each feature pair: (a, b) -> (-b, a)."""
    if pairing == "interleaved":
        pairs = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
        return jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-second, first], axis=-1)


def _llama3_inv_freq(inv_freq, s: dict):
    """Llama 3.1's frequency-dependent scaling: long wavelengths / factor, short ones kept, a smooth
    blend between (HF `_compute_llama3_parameters`)."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    context = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return jnp.where(medium, blended, scaled)


def _yarn_inv_freq(inv_freq, dims: int, theta: float, s: dict):
    """YaRN (Peng et al. 2023; HF `_compute_yarn_parameters`): frequencies that turn fewer than
    `beta_slow` times over the original context are divided by `factor`, those turning more than
    `beta_fast` times kept, a linear ramp over the dimensions between."""
    factor, context = s["factor"], s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dimension_of(rotations):  # the dimension whose frequency turns `rotations` times over the context
        return dims * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dimension_of(beta_fast), dimension_of(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    high = high + 0.001 if low == high else high
    ramp = jnp.clip((jnp.arange(dims // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def _yarn_attention_factor(s: dict) -> float:
    """YaRN's magnitude of the rotated features: `attention_factor`, else 0.1 ln(factor) + 1
    (DeepSeek's: that with `mscale` over that with `mscale_all_dim`)."""
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])

    def scale(mscale=1.0):
        return 1.0 if s["factor"] <= 1 else 0.1 * mscale * math.log(s["factor"]) + 1.0
    if s.get("mscale") and s.get("mscale_all_dim"):
        return scale(s["mscale"]) / scale(s["mscale_all_dim"])
    return scale()


def alibi_slopes(n_heads: int):
    """ALiBi's per-head slopes (Press et al. 2022): a geometric sequence, interleaved for n not a power of 2."""
    def powers(n):
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]
    if math.log2(n_heads).is_integer():
        return jnp.asarray(powers(n_heads), jnp.float32)
    closest = 2 ** math.floor(math.log2(n_heads))
    return jnp.asarray(powers(closest) + powers(2 * closest)[0::2][: n_heads - closest], jnp.float32)


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------

# The leaves decoding stores as one (`parallel.Layout.fused`: `generate.Generator` builds them),
# concatenated along their first output axis shard by shard, so each mp shard holds its q, k, v
# (gate, up) parts one after the other: a decode step makes one product where training makes
# several — on a CPU one kernel call instead of three (XLA:GPU merges such sibling products itself).
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "qkv_bias": ("q_bias", "k_bias", "v_bias"),
         "gate_fc_in": ("gate", "fc_in"), "gate_fc_in_bias": ("gate_bias", "fc_in_bias")}


class AttentionSpec(NamedTuple):
    """What a family's attention is: sizes, positions, biases."""

    d_model: int
    n_heads: int
    kv_heads: int
    head_dim: int
    rotary: Optional[Rotary] = None
    alibi: bool = False
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: Optional[float] = None  # RMSNorm of each query and key head before rotary (Qwen3): its epsilon
    qk_norm_unit_offset: bool = False  # those norms' scales stored as scale - 1 (Gemma 3)
    qk_norm_across_heads: bool = False  # those norms over all heads' features at once (OLMo 2), not each head's
    window: Optional[int] = None  # sliding window (Mistral): the last `window` positions, the query's own included
    local_rotary: Optional[Rotary] = None  # the rotary of the layers with a window, when it differs (Gemma 3, OLMo 3)
    scale: Optional[float] = None  # scores' scale (Gemma: query_pre_attn_scalar ** -0.5); None: head_dim ** -0.5
    softcap: Optional[float] = None  # scores soft-capped to (-softcap, softcap) before the mask (Gemma 2)
    sinks: bool = False  # a learned score per head that joins each softmax and attends to nothing (GPT-OSS)
    init_std: float = 0.02
    out_std: float = 0.02


class Context(NamedTuple):
    """What every layer of one forward pass shares.

    positions [B, T] of the new tokens; mask [B, 1, 1, T, S] (True = may attend);
    key_positions [B, S] (ALiBi); slot_index: the cache slot the T new tokens go to (None: no cache,
    the keys are the T new tokens themselves and no query sees a later one: `_context`);
    causal: the mask is exactly the causal one (no segments, no dropped keys; within a layer's
    sliding window, the causal one cut to it); attention: the
    config's implementation ("xla" or "cudnn"); shared_positions [B, U]: each row's positions of
    the shared prefix's U slots, -1 where it does not read one (decoding with a `SharedPrefix`).
    windowed: whether this layer attends within its sliding window, where the family has one: True
    (every layer), False, or a traced bool (a scanned stack of windowed and full layers: Gemma 2/3,
    Qwen2's `layer_types`); `ModelConfig.windowed_layers`.
    """

    positions: jax.Array
    mask: jax.Array
    key_positions: jax.Array
    slot_index: Optional[jax.Array] = None
    causal: bool = False
    attention: str = "xla"
    shared_positions: Optional[jax.Array] = None
    windowed: object = True


class Attention(hk.Module):
    """Causal multi-head attention with grouped-query keys/values.

    Column-parallel q/k/v (query heads and, when they split, kv heads over 'mp'), row-parallel
    out_proj. When kv heads do not split over mp (fewer than mp), every shard holds all of
    k_proj/v_proj and computes only the kv head its query heads share (see parallel/rules.py).
    """

    def __init__(self, spec: AttentionSpec, name: str = "attn"):
        super().__init__(name=name)
        self.spec = spec

    def __call__(self, h, ctx: Context, cache=None):
        """h [B, T, D], cache (k [B, K, H, S], v [B, K, S, H]) or None; it may be followed by a
        shared prefix's keys and values (k [K, H, U], v [K, U, H]) that every row reads where
        `ctx.shared_positions` says.

        Returns (RowParallel out [B, T, D], updated (k, v) or None).
        """
        s = self.spec
        d, n, kv, hd, dt = s.d_model, s.n_heads, s.kv_heads, s.head_dim, h.dtype
        if s.window is not None:
            ctx = within_window(ctx, s.window)
        window = s.window if s.window is not None and ctx.windowed is not False else None  # may hold per layer
        if parallel.fused(("heads", "kv_heads")):  # decoding: one product, then split (`FUSED`)
            qkv = self._project(h, "qkv", (d, n + 2 * kv, hd), ("embed", "heads", "head_dim"))
            nq, nk = n // parallel.mp_size(), kv // parallel.mp_size()  # this shard's (both split over mp)
            q, k, v = jnp.split(qkv, [nq, nq + nk], axis=2)
        else:
            q = self._project(h, "q", (d, n, hd), ("embed", "heads", "head_dim"))
            k = self._project(h, "k", (d, kv, hd), ("embed", "kv_heads", "head_dim"), kv_group=n // kv,
                              n_local=q.shape[2])
            v = self._project(h, "v", (d, kv, hd), ("embed", "kv_heads", "head_dim"), kv_group=n // kv,
                              n_local=q.shape[2])
        if s.qk_norm is not None and s.qk_norm_across_heads:
            q, k = norm_across_heads(q, k, n, kv, s.qk_norm)
        elif s.qk_norm is not None:
            q, k = norm_heads(q, k, s.head_dim, s.qk_norm, s.qk_norm_unit_offset)
        if s.rotary is not None:
            inv_freq, magnitude = self._rotary_of_layer(ctx.windowed)
            q, k = s.rotary(q, ctx.positions, inv_freq, magnitude), s.rotary(k, ctx.positions, inv_freq, magnitude)
        if s.scale is not None and s.scale != hd ** -0.5:  # every path then scales by head_dim ** -0.5
            q = (q.astype(jnp.float32) * (s.scale * math.sqrt(hd))).astype(q.dtype)
        if cache is None and ctx.attention == "cudnn" and not s.alibi and s.softcap is None and not s.sinks:
            out = _fused_attention(q, k, v, ctx, window, ctx.windowed)
        else:
            k, v = jnp.transpose(k, (0, 2, 3, 1)), jnp.swapaxes(v, 1, 2)  # [B, K, H, T], [B, K, T, H] as cached
            shared = None
            if cache is not None:
                cache_k, cache_v, *shared = cache
                k = write_slots(cache_k, k, ctx.slot_index, 3)
                v = write_slots(cache_v, v, ctx.slot_index, 2)
                cache = (k, v)
            sinks = parallel.param("sinks", (n,), ("heads",), ZEROS) if s.sinks else None
            out = self._attend(q, k, v, ctx, shared or None, sinks)  # [B, T, N, H]
        w_out = parallel.weight("out_proj", (n, hd, d), ("heads", "head_dim", "embed"), 2, normal(s.out_std), dt)
        bias = parallel.param("out_bias", (d,), ("embed",), ZEROS, dt) if s.out_bias else None
        return RowParallel(dense("btnh,nhd->btd", out, w_out), bias), cache

    def _rotary_of_layer(self, windowed):
        """This layer's rotary frequencies and magnitude: `local_rotary`'s in windowed layers (chosen
        at run time in a scanned stack), else the rotary's."""
        s = self.spec
        if s.local_rotary is None or windowed is False:
            return s.rotary.inv_freq(), s.rotary.magnitude()
        if windowed is True:
            return s.local_rotary.inv_freq(), s.local_rotary.magnitude()
        return (jnp.where(windowed, s.local_rotary.inv_freq(), s.rotary.inv_freq()),
                jnp.where(windowed, s.local_rotary.magnitude(), s.rotary.magnitude()))

    def _project(self, h, which: str, shape, axes, kv_group: int = 1, n_local: Optional[int] = None):
        """h [B, T, D] -> [B, T, heads here, H] (q, k, v, or the three fused); for replicated kv heads,
        only this shard's one."""
        w = parallel.weight(f"{which}_proj", shape, axes, 1, normal(self.spec.init_std), h.dtype)
        b = parallel.param(f"{which}_bias", shape[1:], axes[1:], ZEROS, h.dtype) if self.spec.qkv_bias else None
        base = w.base if isinstance(w, (parallel.LoRAWeight, parallel.AdapterBank)) else w
        heads_here = (base.array.shape[0] if isinstance(base, parallel.InputsLast)
                      else base.values.shape[1] if isinstance(base, parallel.Quantized) else base.shape[1])
        if n_local is not None and heads_here * kv_group > n_local:  # kv heads replicated over mp
            head = (parallel.mp_index() * n_local) // kv_group
            w = _one_head(w, head)
            b = None if b is None else jax.lax.dynamic_slice_in_dim(b, head, 1, axis=0)
        x = dense("btd,dnh->btnh", h, w)
        return x if b is None else x + b

    def _attend(self, q, k, v, ctx: Context, shared=None, sinks=None):
        """q [B, T, N, H], k [B, K, H, S], v [B, K, S, H] -> [B, T, N, H] (softmax in float32).

        shared (k [K, H, U], v [K, U, H]) or None: slots every row may read (`ctx.shared_positions`),
        one softmax over them and the row's own S slots. sinks [N] float32 or None: each query head's
        sink score (`_attend_block`).

        A prefill's many queries run on a CPU as one fused kernel (`_fused_on_cpu`); without the
        kernels, in blocks of one row and a few of its positions
        (`query_block`), one after the other, so a block's scores stay in the cache between the
        passes the softmax makes over them (16 rows of 128 tokens behind a 1,024-slot prefix: 20 ms
        a layer in blocks, 91 ms in one piece, whose 75 MB of scores went through memory about ten
        times). One token per row (decode) is one block of every row, so the shared slots are read
        once for all of them. A pass without a cache (training, scoring) runs on a CPU in blocks of
        query positions (`causal_query_blocks`), each over the keys up to its end (`_attend_causal_blocks`):
        the blocks above the diagonal are never computed. (Blocks over all keys made training no
        faster: seq 1,024 +8% for LLaMA, seq 2,048 -3% for GPT-J.)
        """
        b, t, n, hd = q.shape
        kv, s = k.shape[1], k.shape[3]
        g = n // kv
        q = q.reshape(b, t, kv, g, hd).transpose(0, 2, 3, 1, 4).astype(k.dtype)  # [B, K, G, T, H]
        shared_k, shared_v = shared if shared is not None else (None, None)
        if self._fused_on_cpu(q, k, ctx):
            mask = jnp.broadcast_to(ctx.mask, (b,) + ctx.mask.shape[1:]).reshape(b, t, s)
            out = kernels.attention(q.reshape(b, kv, g * t, hd), k, v, mask, shared_k, shared_v, ctx.shared_positions,
                                    None if sinks is None else sinks.reshape(kv, g)).reshape(b, kv, g, t, hd)
        else:
            keys = s + (0 if shared is None else shared_k.shape[-1])
            block = query_block(b, t, n * keys) if ctx.slot_index is not None else None
            attend = functools.partial(self._attend_block, shared_k=shared_k, shared_v=shared_v,
                                       shared_window=self._shared_window(ctx) if shared is not None else None,
                                       sinks=None if sinks is None else sinks.reshape(kv, g))
            causal_block = causal_query_blocks(t) if ctx.slot_index is None else None
            if block is not None:
                out = self._attend_in_blocks(attend, q, k, v, ctx, block)
            elif causal_block is not None:
                out = self._attend_causal_blocks(attend, q, k, v, ctx, causal_block)
            else:
                out = attend(q, k, v, ctx.mask, ctx.positions, ctx.key_positions, ctx.shared_positions)
        return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, hd).astype(q.dtype)

    def _fused_on_cpu(self, q, k, ctx: Context) -> bool:
        """Whether `_attend` runs as one CPU kernel (`kernels.attention`, the softmax fused in) over
        a KV cache: a prefill's many queries, and a decode step's few (a kv head's query heads at
        one position, at most `kernels.ATTENTION_FEW_ROWS`: the kernel's decode path, which reads
        only the slots a query sees). Not training (it is differentiated), not ALiBi (the kernel
        lacks it), not a sliding window over a shared prefix (the kernel sees every shared slot as
        before every query). An admission of 16 prompts behind a cached 1,000-token prefix (bench/decode.py
        --shared-prefix, GPT-J 4 x 512, fp32): 722 -> 580 ms."""
        b, kv, g, t, hd = q.shape
        shared_in_window = self._shared_window(ctx) is not None and ctx.shared_positions is not None
        return (ctx.slot_index is not None and (t > 1 or g <= kernels.ATTENTION_FEW_ROWS) and not self.spec.alibi
                and self.spec.softcap is None and not shared_in_window and kernels.attention_applies(k))

    def _shared_window(self, ctx: Context) -> Optional[int]:
        """The window this layer reads a shared prefix through (decoding: layers run unrolled, so
        `ctx.windowed` is a Python bool)."""
        return self.spec.window if ctx.windowed is True else None

    @staticmethod
    def _attend_in_blocks(attend, q, k, v, ctx: Context, block: int):
        """`attend` (`_attend_block`) over one row and `block` of its query positions at a time, in
        turn: q [B, K, G, T, H] -> [B, K, G, T, H] (the last block of each row padded)."""
        b, kv, g, t, hd = q.shape
        blocks = -(-t // block)
        padded = blocks * block
        pad = lambda x, axis: jnp.pad(x, [(0, padded - t if a == axis else 0) for a in range(x.ndim)])  # noqa: E731
        split = lambda x, axis: jnp.moveaxis(  # noqa: E731 - [.., T, ..] -> [T / block, .., block, ..]
            x.reshape(x.shape[:axis] + (blocks, block) + x.shape[axis + 1:]), axis, 0)

        def row(xs):
            q, k, v, mask, positions, key_positions, shared_positions = jax.tree.map(lambda x: x[None], xs)

            def one_block(xs):
                q, mask, positions = xs
                return attend(q, k, v, mask, positions, key_positions, shared_positions)
            out = jax.lax.map(one_block, (split(q, 3), split(mask, 3), split(positions, 1)))  # [blocks, 1, K, G, ..]
            return jnp.moveaxis(out[:, 0], 0, 2).reshape(kv, g, padded, hd)

        mask = jnp.broadcast_to(ctx.mask, (b,) + ctx.mask.shape[1:])
        rows = (pad(q, 3), k, v, pad(mask, 3), pad(ctx.positions, 1), ctx.key_positions, ctx.shared_positions)
        return jax.lax.map(row, rows)[:, :, :, :t]

    @staticmethod
    def _attend_causal_blocks(attend, q, k, v, ctx: Context, block: int):
        """`attend` over `block` query positions at a time, each block over the keys up to its last
        position only: without a cache the keys are the T new tokens and no query sees a later one
        (`Context`), so the scores above the diagonal's blocks are never computed — of T / block
        blocks, (blocks + 1) / (2 blocks) of the work. q [B, K, G, T, H] -> [B, K, G, T, H]."""
        t = q.shape[3]
        outs = []
        for start in range(0, t, block):
            end = min(start + block, t)
            outs.append(attend(q[:, :, :, start:end], k[..., :end], v[:, :, :end], ctx.mask[..., start:end, :end],
                               ctx.positions[:, start:end], ctx.key_positions[:, :end], None))
        return jnp.concatenate(outs, axis=3)

    def _attend_block(self, q, k, v, mask, positions, key_positions, shared_positions, shared_k, shared_v,
                      shared_window=None, sinks=None):
        """q [b, K, G, T, H] of b rows (mask [b, 1, 1, T, S], positions [b, T], key_positions [b, S],
        shared_positions [b, U] or None) -> [b, K, G, T, H] float32.

        With a shared prefix the softmax runs over its scores and the row's own without joining them:
        one maximum, then each part's exponentials times its values, divided by the sum of both.

        sinks [K, G] (GPT-OSS; Xiao et al. 2023's attention sinks, learned): one more score per query
        head, the same for every query, in the softmax's sum but attending to no value, so a head can
        put weight nowhere: one more term in each softmax's sum (`softmax_times_values`'s `sink`),
        and in the shared prefix's.
        """
        b, kv, g, t, hd = q.shape
        # A kv head's g query heads and t positions are one row dimension of both matmuls (g x t rows
        # per kv head): XLA:CPU ran them 17x slower with g and t as separate dimensions (g = 4, t = 1).
        q = q.reshape(b, kv, g * t, hd)
        scale = lambda scores: softcap(  # noqa: E731
            scores.reshape(b, kv, g, t, -1) / jnp.sqrt(jnp.float32(hd)), self.spec.softcap)
        own = scale(_rows_product("bkmh,bkhs->bkms", q, k))
        if self.spec.alibi:
            own = own + self._alibi(kv, g, key_positions, positions)
        own = jnp.where(mask, own, NEG)
        rows = lambda weights: weights.astype(v.dtype).reshape(b, kv, g * t, -1)  # noqa: E731
        sink = None if sinks is None else jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, :, None, None],
                                                            (b, kv, g, t, 1))
        if shared_k is None:
            return softmax_times_values(own.reshape(b, kv, g * t, -1), v,
                                        None if sink is None else sink.reshape(b, kv, g * t, 1)).reshape(b, kv, g, t, hd)
        shared = scale(_all_rows_product(q, shared_k))
        if self.spec.alibi:
            shared = shared + self._alibi(kv, g, shared_positions, positions)
        visible = jnp.broadcast_to((shared_positions >= 0)[:, None, :], (b, t, shared_positions.shape[-1]))
        if shared_window is not None:
            visible = visible & (positions[:, :, None] - shared_positions[:, None, :] < shared_window)
        shared = jnp.where(visible[:, None, None], shared, NEG)
        top = jax.lax.stop_gradient(jnp.maximum(own.max(-1, keepdims=True), shared.max(-1, keepdims=True)))
        if sink is not None:
            top = jnp.maximum(top, jax.lax.stop_gradient(sink))
        own, shared = jnp.exp(own - top), jnp.exp(shared - top)
        out = _rows_product("bkms,bksh->bkmh", rows(own), v) + _all_rows_product(rows(shared), shared_v)
        total = own.sum(-1, keepdims=True) + shared.sum(-1, keepdims=True)
        return out.reshape(b, kv, g, t, hd) / (total if sink is None else total + jnp.exp(sink - top))

    def _alibi(self, kv: int, group: int, key_positions, positions):
        """[B, K, G, T, S] bias: -slope * distance from each query (positions [B, T]) back to each key
        (key_positions [B, S])."""
        n_local = kv * group
        slopes = jnp.take(alibi_slopes(self.spec.n_heads), parallel.mp_index() * n_local + jnp.arange(n_local))
        distance = key_positions[:, None, :] - positions[:, :, None]  # [B, T, S], <= 0 where attended
        return slopes.reshape(1, kv, group, 1, 1) * distance[:, None, None].astype(jnp.float32)


NEG = float(jnp.finfo(jnp.float32).min)  # the score of a key a query may not attend to
SCORES_PER_BLOCK = 1 << 20  # float32 attention scores one block computes at most (4 MiB: a CPU's L2/L3)


def query_block(rows: int, queries: int, scores_per_query: int) -> Optional[int]:
    """Query positions per block of `Attention._attend` (each block is one row's), or None for one
    block of everything: on accelerators (their fused kernels want it whole), for one query per row
    (decode), and when all the scores fit one block anyway."""
    if jax.default_backend() != "cpu" or queries == 1 or rows * queries * scores_per_query <= SCORES_PER_BLOCK:
        return None
    blocks = -(-queries // max(8, SCORES_PER_BLOCK // scores_per_query))
    return -(-queries // blocks)  # blocks of equal size: the last one is padded least


CAUSAL_BLOCK = 128  # query positions per block of attention without a cache on CPU, at least (`causal_query_blocks`)
MAX_CAUSAL_BLOCKS = 8  # blocks at most: the program grows with them; 8 do 56% of one block's work


def causal_query_blocks(queries: int) -> Optional[int]:
    """Query positions per block of `Attention._attend_causal_blocks` for a pass without a cache
    (training, scoring), or None for one block: on accelerators (their fused kernels want it whole)
    and for one block's worth of queries. One layer's attention forward and backward on two Zen 5
    cores (bench/attention_train.py): 4 x 256 tokens 16 -> 9 ms in blocks of 128, 2,048 tokens
    269 -> 144-178 ms in blocks of 128 or 256; blocks of 512 saved less at every length."""
    if jax.default_backend() != "cpu" or queries <= CAUSAL_BLOCK:
        return None
    return max(CAUSAL_BLOCK, -(-queries // MAX_CAUSAL_BLOCKS))


_PER_ROW_AND_KV_HEAD = ("bkmh,bkhs->bkms", "bkms,bksh->bkmh")  # `_rows_product`'s: [B, K] groups


def softmax_times_values(scores, v, sink=None):
    """softmax(scores) over S, rounded to v's dtype, times the values: scores float32 [B, K, M, S],
    v [B, K, S, H] -> float32 [B, K, M, H] (M: a kv head's query rows). sink float32 [B, K, M, 1]
    or None: one more score a row (GPT-OSS's attention sinks) in the softmax's sum, with no value;
    its gradient is -p_sink rowsum(dO * O).

    Differentiated, its backward is flash attention's (Dao et al. 2022): the scores' gradient is
    P (dP - rowsum(dO * O)) with dP = dO V^T, so the one reduction runs over [M, H] outputs, not
    autodiff's over [M, S] probabilities, and V's gradient is (dO^T P)^T, a product XLA:CPU runs as
    fast as P^T dO over 256 keys and 1.5-2.7x faster over 1,024-2,048. One GPT-J layer's attention,
    forward and backward on two Zen 5 cores: 4 x 256 tokens 9.6 -> 8.7 ms, 1,024 tokens 93 -> 60 ms
    (docs/speed.md, session 67)."""
    if sink is not None:
        return _sunk_softmax_times_values(*parallel.vary_alike(scores, v, sink))
    return _softmax_times_values(*parallel.vary_alike(scores, v))


@jax.custom_vjp
def _softmax_times_values(scores, v):
    return _rows_product("bkms,bksh->bkmh", jax.nn.softmax(scores, axis=-1).astype(v.dtype), v)


def _softmax_times_values_forward(scores, v):
    return _softmax_times_values_forward_of(jax.nn.softmax(scores, axis=-1).astype(v.dtype), v)


def _softmax_times_values_forward_of(p, v):
    """The product of probabilities p (in v's dtype) and the values, and what the backward keeps."""
    out = jnp.einsum("bkms,bksh->bkmh", p, v, preferred_element_type=jnp.float32)  # XLA's, as `_product_forward`
    return out, (p, v, out)


def _softmax_times_values_backward(saved, g):
    p, v, out = saved
    g_rows = g.astype(v.dtype)  # bfloat16 operands: both products run natively, as `product`'s backward
    dv = jnp.swapaxes(jnp.einsum("bkmh,bkms->bkhs", g_rows, p, preferred_element_type=jnp.float32), 2, 3)
    dp = jnp.einsum("bkmh,bksh->bkms", g_rows, v, preferred_element_type=jnp.float32)
    row_sums = jnp.sum(g.astype(jnp.float32) * out, axis=-1, keepdims=True)  # = rowsum(dP * P)
    return p.astype(jnp.float32) * (dp - row_sums), dv.astype(v.dtype)


_softmax_times_values.defvjp(_softmax_times_values_forward, _softmax_times_values_backward)


def _sunk_probabilities(scores, sink):
    """(probabilities [.., S], the sink's [.., 1]) of the softmax over the scores and the sink, float32."""
    top = jax.lax.stop_gradient(jnp.maximum(scores.max(-1, keepdims=True), sink))
    exps, sunk = jnp.exp(scores - top), jnp.exp(sink - top)
    total = exps.sum(-1, keepdims=True) + sunk
    return exps / total, sunk / total


@jax.custom_vjp
def _sunk_softmax_times_values(scores, v, sink):
    p, _ = _sunk_probabilities(scores, sink)
    return _rows_product("bkms,bksh->bkmh", p.astype(v.dtype), v)


def _sunk_softmax_times_values_forward(scores, v, sink):
    p, p_sink = _sunk_probabilities(scores, sink)
    out, (p, v, out) = _softmax_times_values_forward_of(p.astype(v.dtype), v)
    return out, (p, v, out, p_sink)


def _sunk_softmax_times_values_backward(saved, g):
    p, v, out, p_sink = saved
    d_scores, dv = _softmax_times_values_backward((p, v, out), g)
    d_sink = -p_sink * jnp.sum(g.astype(jnp.float32) * out, axis=-1, keepdims=True)
    return d_scores, dv, d_sink


_sunk_softmax_times_values.defvjp(_sunk_softmax_times_values_forward, _sunk_softmax_times_values_backward)


def _rows_product(equation: str, rows, other):
    """`product(equation, rows, other)` for rows [B, K, M, X] (M: a kv head's query rows). A single
    16-bit row (one token, no grouping) is doubled and the copy's result dropped: XLA:CPU hands a
    matmul of 2+ rows to YNNPACK, which reads the 16-bit cache in place, but runs a one-row one on
    a float32 copy of the layer's cache, made every decode step (with `write_slots`: GPT-J in bf16
    at 16 rows, bench/decode.py's model, 6-29% faster). On CPU with `kernels` built, a bf16 cache
    is read by the grouped kernel instead (`_product`), which needs no spare row."""
    if rows.shape[2] > 1 or not _is_16_bit_float(rows) or kernels.grouped_applies(rows, other):
        return product(equation, rows, other)
    return product(equation, jnp.concatenate([rows, rows], axis=2), other)[:, :, :1]


def _all_rows_product(rows, shared):
    """rows [B, K, M, X] . shared [K, X, Y] -> [B, K, M, Y]: one matmul of B x M rows per kv head,
    so the shared operand (which has no row axis) is read once for all rows."""
    b, kv, m, _ = rows.shape
    out = product("knx,kxy->kny", jnp.swapaxes(rows, 0, 1).reshape(kv, b * m, -1), shared)
    return jnp.swapaxes(out.reshape(kv, b, m, -1), 0, 1)


def write_slots(cache, new, index, axis: int):
    """`new` written into `cache` at `index` along `axis`, in place (`update_slice`)."""
    starts = [0] * cache.ndim
    starts[axis] = index
    return update_slice(cache, new, starts)


def update_slice(x, update, starts, kernel: bool = True):
    """`lax.dynamic_update_slice(x, update, starts)` of one device's arrays (a KV cache), in place
    (`kernel=False`: XLA's, for arrays that span a mesh outside `shard_map`).

    On CPU by `kernels.update_slice`, which moves only the update: XLA:CPU's dynamic-update-slice
    was copied whole when its result had two consumers of different shapes (the next state, and a
    one-row attention's view without the row axis: XLA made two fusions of it, each from a copy of
    the cache — every layer's cache copied four times per decode step, half the one-row speed at a
    1,000-token context), and a 16-bit one runs over float32 copies of the whole array, or on its
    bits (`on_bits`) as a fusion that rewrites the whole array (a bfloat16 serving batch copied
    each layer's keys once per decode call and per admitted row). Elsewhere (or without the
    kernels) XLA's, a 16-bit array updated as 16-bit integers (exact)."""
    if kernel and kernels.available():
        return kernels.update_slice(x, update, starts)
    return on_bits(lambda a, b: jax.lax.dynamic_update_slice(a, b, starts), x, update)


def dynamic_slice(x, starts, sizes):
    """`lax.dynamic_slice(x, starts, sizes)` of one device's array (a window of a KV cache). On CPU
    by `kernels.slice`, one memcpy per contiguous run: XLA:CPU sliced a serving batch's window
    element by element (16 of 64 rows, 256 of 2,048 slots: 5-6 ms of a 64-row decode call's
    ~70). Elsewhere XLA's, 16-bit arrays on their bits."""
    if kernels.available():
        return kernels.slice(x, starts, sizes)
    return on_bits(lambda a: jax.lax.dynamic_slice(a, starts, sizes), x)


def _is_16_bit_float(x) -> bool:
    return jnp.dtype(x.dtype).itemsize == 2 and jnp.issubdtype(x.dtype, jnp.floating)


def on_bits(op, *arrays):
    """`op`, a pure data movement (slices, updates, gathers, rolls), on `arrays`: 16-bit floats
    viewed as 16-bit integers and the result viewed back (bit-exact). XLA:CPU runs such ops on
    16-bit floats over float32 copies of whole operands: a dynamic-update-slice of one row into a
    bfloat16 KV cache converted and rewrote the whole cache. Every array takes the first's dtype."""
    dtype = arrays[0].dtype
    arrays = [a.astype(dtype) for a in arrays]
    if not _is_16_bit_float(arrays[0]):
        return op(*arrays)
    bits = op(*(jax.lax.bitcast_convert_type(a, jnp.uint16) for a in arrays))
    return jax.lax.bitcast_convert_type(bits, dtype)


def _fused_attention(q, k, v, ctx: Context, window: Optional[int] = None, windowed=True):
    """q [B, T, N, H], k and v [B, T, K, H] -> [B, T, N, H] with `jax.nn.dot_product_attention`:
    cuDNN's flash attention on NVIDIA GPUs in 16-bit (the [T, S] scores never reach memory; a plain
    causal mask skips the blocks above the diagonal, a sliding window those left of it too), XLA's
    implementation elsewhere. Used for training (no cache, no ALiBi); decoding keeps the einsum
    path, which reads the cache in place."""
    on_gpu = jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    mask = None if ctx.causal else ctx.mask[:, 0]  # [B, 1, T, S]
    attend = functools.partial(jax.nn.dot_product_attention, q, k, v, mask=mask, is_causal=ctx.causal,
                               implementation="cudnn" if on_gpu else "xla")
    if not ctx.causal or window is None:  # an explicit mask holds the window
        return attend()
    local = (window - 1, 0)  # keys q - (window - 1) .. q
    if windowed is True:
        return attend(local_window_size=local)
    return jax.lax.cond(windowed, lambda: attend(local_window_size=local), attend)  # per layer of a scanned stack


def within_window(ctx: Context, window: int) -> Context:
    """`ctx` with each query's keys cut to the last `window` positions, its own included — HF's
    sliding window (key > query - window) — in the layers `ctx.windowed` marks; `causal` then means
    "causal within the layer's window"."""
    if ctx.windowed is False:
        return ctx
    near = ctx.positions[:, :, None] - ctx.key_positions[:, None, :] < window  # [B, T, S]
    if ctx.windowed is not True:  # traced: this layer of a scanned stack may attend to everything
        near = near | ~ctx.windowed
    return ctx._replace(mask=ctx.mask & near[:, None, None])


def _one_head(w, head):
    """The weight [D, K, H] (or inputs-last [K, H, D]) of kv head `head` alone: [D, 1, H]."""
    if isinstance(w, parallel.InputsLast):
        return parallel.InputsLast(jax.lax.dynamic_slice_in_dim(w.array, head, 1, axis=0), w.inputs)
    if isinstance(w, parallel.LoRAWeight):  # B [r, K, H]: its kv head too
        return w._replace(base=_one_head(w.base, head), b=jax.lax.dynamic_slice_in_dim(w.b, head, 1, axis=1))
    if isinstance(w, parallel.AdapterBank):  # B [N, r, K, H] (inputs-last: [K, H, N, r])
        b = (parallel.InputsLast(jax.lax.dynamic_slice_in_dim(w.b.array, head, 1, axis=0), w.b.inputs)
             if isinstance(w.b, parallel.InputsLast) else jax.lax.dynamic_slice_in_dim(w.b, head, 1, axis=2))
        return w._replace(base=_one_head(w.base, head), b=b)
    if isinstance(w, parallel.Quantized):  # scale [K, H]
        return parallel.Quantized(_one_head(w.values, head), jax.lax.dynamic_slice_in_dim(w.scale, head, 1, axis=0))
    return jax.lax.dynamic_slice_in_dim(w, head, 1, axis=1)


# --------------------------------------------------------------------------------------------
# MLPs
# --------------------------------------------------------------------------------------------

ACTIVATIONS = {
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),  # tanh approximation (GPT-2, GPT-J)
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),  # erf (GPT-NeoX / Pythia)
    "relu": jax.nn.relu,  # OPT
    "silu": jax.nn.silu,  # SwiGLU's gate (LLaMA)
}


def norm_heads(q, k, head_dim: int, eps: float, unit_offset: bool = False):
    """Qwen3's and Gemma 3's q_norm / k_norm (inside `Attention`, so named attn/q_norm, attn/k_norm):
    each head's query and key RMS-normed over head_dim, one scale per head_dim entry shared by all
    heads (replicated over mp)."""
    return (RMSNorm(head_dim, eps, "q_norm", axis="head_dim", unit_offset=unit_offset)(q),
            RMSNorm(head_dim, eps, "k_norm", axis="head_dim", unit_offset=unit_offset)(k))


def norm_across_heads(q, k, n_heads: int, kv_heads: int, eps: float):
    """OLMo 2's q_norm / k_norm (named attn/q_norm, attn/k_norm): the queries RMS-normed over all
    n_heads * head_dim features of a position at once, the keys over all kv_heads * head_dim, one
    scale per feature, held [heads, head_dim] and split over mp like the heads."""
    return (HeadsRMSNorm(n_heads, eps, "q_norm", "heads")(q, q.shape[2]),
            HeadsRMSNorm(kv_heads, eps, "k_norm", "kv_heads", group=n_heads // kv_heads)(k, q.shape[2]))


class HeadsRMSNorm(hk.Module):
    """RMSNorm over the last two axes of x [B, T, heads here, H] as one vector of `heads` x H (all
    heads, though a shard holds some): the shards' sums of squares are added over 'mp', each head
    counted once (kv heads replicated over mp are each computed by several shards, which hold their
    query group's one: `Attention._project`)."""

    def __init__(self, heads: int, eps: float, name: str, axis: str, group: int = 1):
        super().__init__(name=name)
        self.heads, self.eps, self.axis, self.group = heads, eps, axis, group

    def __call__(self, x, query_heads_here: int):
        dtype, x = x.dtype, x.astype(jnp.float32)
        here, head_dim = x.shape[2], x.shape[3]
        scale = parallel.param("scale", (self.heads, head_dim), (self.axis, "head_dim"), ONES)
        if scale.shape[0] > here:  # kv heads replicated over mp: the scale of this shard's one
            head = (parallel.mp_index() * query_heads_here) // self.group
            scale = jax.lax.dynamic_slice_in_dim(scale, head, here, axis=0)
        copies = parallel.mp_size() * here // self.heads  # shards computing each head
        squares = parallel.psum_mp(jnp.sum(x * x, axis=(2, 3), keepdims=True)) / copies
        x = x * jax.lax.rsqrt(squares / (self.heads * head_dim) + self.eps)
        return (x * scale).astype(dtype)


class MLPSpec(NamedTuple):
    d_model: int
    d_ff: int
    activation: str = "gelu_new"
    gated: bool = False  # SwiGLU: fc_out(act(gate(h)) * fc_in(h))
    bias: bool = True
    init_std: float = 0.02
    out_std: float = 0.02


class MLP(hk.Module):
    """fc_in -> activation -> fc_out (or gated, SwiGLU); F is split over 'mp' (column- then row-parallel)."""

    def __init__(self, spec: MLPSpec, name: str = "mlp"):
        super().__init__(name=name)
        self.spec = spec

    def __call__(self, h) -> RowParallel:
        """h [B, T, D] -> RowParallel([B, T, D] partial over mp, fc_out bias [D] or None)."""
        s, dt = self.spec, h.dtype
        act = ACTIVATIONS[s.activation]
        if s.gated and parallel.fused(("mlp",)):  # decoding: gate and up as one product (`FUSED`)
            gate, x = jnp.split(self._in("gate_fc_in", h, 2 * s.d_ff), 2, axis=-1)
            x = act(gate) * x
        else:
            x = self._in("fc_in", h)
            x = act(self._in("gate", h)) * x if s.gated else act(x)
        w_out = parallel.weight("fc_out", (s.d_ff, s.d_model), ("mlp", "embed"), 1, normal(s.out_std), dt)
        bias = parallel.param("fc_out_bias", (s.d_model,), ("embed",), ZEROS, dt) if s.bias else None
        return RowParallel(dense("btf,fd->btd", x.astype(dt), w_out), bias)

    def _in(self, name: str, h, width: Optional[int] = None):
        """h [B, T, D] -> [B, T, F] float32 (the product rounded to h's dtype, then its bias added);
        `width` F: d_ff, or twice it for gate and up fused.

        The activation then runs in float32 and is rounded once: run on a 16-bit array, XLA:CPU
        rounds after each of its operations (bf16 GPT-J: a 16-prompt admission 150 -> 125 ms)."""
        s = self.spec
        f = width or s.d_ff
        w = parallel.weight(name, (s.d_model, f), ("embed", "mlp"), 1, normal(s.init_std), h.dtype)
        x = dense("btd,df->btf", h, w).astype(jnp.float32)
        return x + parallel.param(f"{name}_bias", (f,), ("mlp",), ZEROS, h.dtype) if s.bias else x


# --------------------------------------------------------------------------------------------
# Mixture of experts
# --------------------------------------------------------------------------------------------

class MoESpec(NamedTuple):
    d_model: int
    d_ff: int  # each expert's width
    n_experts: int
    top_k: int  # experts per token
    normalize: bool = True  # the chosen experts' weights renormalised to sum to 1 (Mixtral; Qwen3-MoE's norm_topk_prob)
    activation: str = "silu"
    bias: bool = False  # biases on the router and on each expert's gate, up and down projections (GPT-OSS)
    glu_limit: Optional[float] = None  # GPT-OSS's clamped SwiGLU (`clamped_swiglu`): its limit and alpha
    glu_alpha: float = 1.702
    init_std: float = 0.02


EXPERT_SCORES = "expert_scores"  # the router's output axis: replicated, so every shard routes alike


def _argsort(keys):
    """`jnp.argsort(keys, stable=True)`, typed as varying over the mesh axes `keys` vary over: JAX
    0.10 types a varying key's sort indices as invariant, so a gather by them (each expert-parallel
    shard orders its own experts' copies first) would skip the psum its backward owes."""
    return parallel.vary(jnp.argsort(keys, stable=True), tuple(sorted(parallel.varying(keys))))


def _experts_here(w) -> int:
    """How many experts this shard holds (all but under expert parallelism)."""
    w = w.base if isinstance(w, parallel.LoRAWeight) else w
    return (w.values if isinstance(w, parallel.Quantized) else w).shape[0]


def clamped_swiglu(gate, up, alpha: float, limit: float):
    """GPT-OSS's gated unit: gate capped above at `limit`, up clipped to +-limit, then
    gate sigmoid(alpha gate) (up + 1): SiLU's shape with a sharper sigmoid, and up shifted by one, so
    an up of 0 passes the gate's unit through unscaled."""
    gate = jnp.minimum(gate, limit)
    return gate * jax.nn.sigmoid(alpha * gate) * (jnp.clip(up, -limit, limit) + 1)


class MoE(hk.Module):
    """A sparse mixture of SwiGLU experts (Shazeer et al. 2017; Mixtral, Jiang et al. 2024): a router
    scores the E experts of each token, the top k run on it, and their outputs are summed weighted
    by the router's softmax (renormalised over the chosen k where `normalize`). GPT-OSS's: biases on
    the router and every projection, and its clamped SwiGLU (`clamped_swiglu`).

    Dropless: the token copies are sorted by expert and every expert multiplies its own contiguous
    rows (`grouped_product`: XLA's ragged_dot, grouped matmuls on GPU/TPU; on CPU the experts
    kernel). Tensor-parallel as the dense MLP: each expert's F is split over 'mp' (column
    then row parallel), the router is replicated, so every shard routes alike and the block's one
    all-reduce sums the experts' partial outputs. Expert-parallel (the rules split 'experts' over
    'mp' instead of 'expert_mlp'): a shard holds whole experts, sorts its own experts' copies first
    and multiplies only those; the same all-reduce sums every shard's share."""

    def __init__(self, spec: MoESpec, name: str = "moe"):
        super().__init__(name=name)
        self.spec = spec

    def __call__(self, h) -> RowParallel:
        """h [B, T, D] -> RowParallel([B, T, D] partial over mp)."""
        s, dt = self.spec, h.dtype
        x = h.reshape(-1, s.d_model)  # [N, D]
        weights, experts, probs = self.route(x)  # [N, k], [N, k], [N, E]
        chosen = experts.reshape(-1)
        sizes = jnp.bincount(chosen, length=s.n_experts).astype(jnp.int32)
        _record(RouterStats(sizes.astype(jnp.float32), jnp.sum(probs, axis=0), jnp.float32(x.shape[0])))
        init, f = normal(s.init_std), s.d_ff
        w_gate, w_in = (parallel.expert_weights(n, (s.n_experts, s.d_model, f), ("experts", "embed", "expert_mlp"), 1,
                                                init, dt) for n in ("experts_gate", "experts_in"))
        w_out = parallel.expert_weights("experts_out", (s.n_experts, f, s.d_model), ("experts", "expert_mlp", "embed"),
                                        1, init, dt)
        here = _experts_here(w_out)
        first = parallel.mp_index() * here if here < s.n_experts else 0  # this shard's first expert
        # token copies grouped by expert, this shard's experts first (all of them without expert parallelism)
        order = _argsort((chosen - first) % s.n_experts)
        token = order // s.top_k
        local = jnp.roll(sizes, -first)[:here]  # rows of each of this shard's experts, in turn
        rows = x[token]  # [N k, D]
        m = rows.shape[0]
        gate, up = grouped_product(rows, w_gate, local), grouped_product(rows, w_in, local)
        if s.bias:
            gate = gate + self._expert_bias("experts_gate_bias", f, local, m)
            up = up + self._expert_bias("experts_in_bias", f, local, m)
        if s.glu_limit is None:
            gated = ACTIVATIONS[s.activation](gate) * up
        else:
            gated = clamped_swiglu(gate, up, s.glu_alpha, s.glu_limit)
        y = grouped_product(gated.astype(dt), w_out, local)  # [N k, D] float32
        if s.bias:  # added once: by the shard that holds the expert whole, else by the first shard
            owner = (here < s.n_experts) | (parallel.mp_index() == 0)
            y = y + jnp.where(owner, self._expert_bias("experts_out_bias", s.d_model, local, m, "embed"), 0.0)
        y = y * weights.reshape(-1)[order][:, None]
        if here < s.n_experts:  # the copies other shards' experts take: 0 here
            y = jnp.where((jnp.arange(m) < jnp.sum(local))[:, None], y, 0.0)
        out = jnp.zeros((x.shape[0], s.d_model), jnp.float32).at[token].add(y)
        return RowParallel(out.reshape(h.shape).astype(dt))

    def _expert_bias(self, name: str, width: int, local, rows: int, axis: str = "expert_mlp"):
        """Each of the `rows` grouped rows' expert's bias [rows, width here] (a parameter [E, width];
        `local`: the rows of each of this shard's experts, in turn)."""
        bias = parallel.param(name, (self.spec.n_experts, width), ("experts", axis), ZEROS)
        return _expert_rows(bias, local, rows)

    def route(self, x):
        """x [N, D] -> (weights [N, k] float32, experts [N, k] int32, probabilities [N, E] float32): the
        router's softmax in float32, its top k (ties to the lower expert, as torch.topk), renormalised
        where the spec says."""
        s = self.spec
        router = parallel.param("router", (s.d_model, s.n_experts), ("embed", EXPERT_SCORES), normal(s.init_std),
                                x.dtype, decay=True)
        logits = product("nd,de->ne", x, router)
        if s.bias:
            logits = logits + parallel.param("router_bias", (s.n_experts,), (EXPERT_SCORES,), ZEROS)
        probs = jax.nn.softmax(logits, axis=-1)
        weights, experts = jax.lax.top_k(probs, s.top_k)
        if s.normalize:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights, experts, probs


class RouterStats(NamedTuple):
    """What the load-balancing loss needs of the routers a forward pass ran, summed over their
    tokens (and, from `core.scanned_layers`, over layers): float32 [E], [E], []."""

    chosen: jax.Array  # token copies routed to each expert
    probability: jax.Array  # the router's probability of each expert, summed
    tokens: jax.Array

    def balance_loss(self):
        """Switch Transformer's load-balancing loss (Fedus et al. 2021, eqs. 4-6) as transformers
        computes it over all layers' tokens: E x sum_e (copies routed to e / tokens) x (mean
        probability of e). 1 when both are uniform; its gradient reaches the routers through the
        probabilities."""
        return self.chosen.shape[-1] * jnp.sum(self.chosen / self.tokens * self.probability / self.tokens)


_routers = threading.local()


@contextlib.contextmanager
def routers_recorded():
    """Collect the `RouterStats` of every MoE layer called inside (one trace: a scanned layer's body)."""
    previous = getattr(_routers, "seen", None)
    _routers.seen = []
    try:
        yield _routers.seen
    finally:
        _routers.seen = previous


def _record(stats: RouterStats) -> None:
    seen = getattr(_routers, "seen", None)
    if seen is not None:
        seen.append(stats)


def grouped_product(rows, w, sizes):
    """rows [M, K] (grouped: sizes[e] rows for expert e in turn) times w [E, K, F] -> [M, F] float32:
    each group of rows by its expert's weight (int8 `parallel.Quantized` ones, decoding: the
    product of the values, times each row's expert's scales; `parallel.LoRAWeight`s, training an
    adapter per expert: rows W + scale * (rows A) B, as PEFT's `target_parameters`). Inside
    shard_map all three first vary over the same mesh axes, so a weight's gradient is summed over
    'dp' (as `product` does)."""
    if isinstance(w, parallel.LoRAWeight):
        low = grouped_product(rows, w.a, sizes).astype(rows.dtype)  # [M, r]
        return grouped_product(rows, w.base, sizes) + w.scale * grouped_product(low, w.b, sizes)
    if isinstance(w, parallel.Quantized):  # int8 values: the kernel reads them; elsewhere widened inside
        return _quantized_grouped_product(*parallel.vary_alike(rows, w.values, sizes, w.scale))
    return _grouped_product(*parallel.vary_alike(rows, w, sizes))


def _expert_rows(table, sizes, m: int):
    """table [E, F] (an expert's scales or biases a row) -> [m, F]: each of the m grouped rows'
    expert's row (rows past sum(sizes) take the last expert's)."""
    return table[jnp.repeat(jnp.arange(table.shape[0]), sizes, total_repeat_length=m)]


@jax.custom_vjp
def _quantized_grouped_product(rows, values, sizes, scale):
    """int8 experts (values [E, K, F], scale [E, F]): the product of the values, times each row's
    expert's scales. Differentiated (a LoRA run's int8 base), it keeps the int8 values and the
    scales for the backward, and gathers the rows' scales again there, not an [M, F] residual."""
    return _grouped_product(rows, values, sizes) * _expert_rows(scale, sizes, rows.shape[0])


def _quantized_grouped_forward(rows, values, sizes, scale):
    y, _ = _grouped_product_forward(rows, values, sizes)
    return y * _expert_rows(scale, sizes, rows.shape[0]), (rows, values, sizes, scale)


def _quantized_grouped_backward(saved, g):
    rows, values, sizes, scale = saved
    d_rows, d_values, d_sizes = _grouped_product_backward((rows, values, sizes),
                                                          g * _expert_rows(scale, sizes, rows.shape[0]))
    return d_rows, d_values, d_sizes, jnp.zeros_like(scale)


_quantized_grouped_product.defvjp(_quantized_grouped_forward, _quantized_grouped_backward)


@jax.custom_vjp
def _grouped_product(rows, w, sizes):
    """Not differentiated (decoding, evaluation): on CPU the experts kernel, which reads only the
    experts rows chose (XLA:CPU's ragged_dot multiplies every row by every expert)."""
    if kernels.experts_apply(rows, w):
        return kernels.expert_rows_times_weight(rows, w, sizes)
    return jax.lax.ragged_dot(rows, _widened(w, rows), sizes, preferred_element_type=jnp.float32)


def _widened(w, rows):
    """An int8 experts' values in the rows' dtype (XLA's ragged_dot multiplies like types)."""
    return w if jnp.issubdtype(w.dtype, jnp.floating) else w.astype(rows.dtype)


def _grouped_product_forward(rows, w, sizes):
    """Differentiated (training): on CPU the experts kernel register-blocked for every group (each
    sum in one order whatever rows a device holds), and its backward's; elsewhere XLA's ragged_dot
    (grouped matmuls on GPU/TPU) and its transpose."""
    if kernels.experts_apply(rows, w):
        return kernels.expert_rows_times_weight(rows, w, sizes, blocked=True), (rows, w, sizes)
    return jax.lax.ragged_dot(rows, _widened(w, rows), sizes, preferred_element_type=jnp.float32), (rows, w, sizes)


def _grouped_product_backward(saved, g):
    rows, w, sizes = saved
    frozen = not jnp.issubdtype(w.dtype, jnp.floating)  # int8 experts of a frozen base: no weight gradient
    if kernels.experts_apply(rows, w):
        d_rows = kernels.expert_rows_times_weight(g, jnp.swapaxes(w, 1, 2), sizes, blocked=True)
        d_w = None if frozen else kernels.expert_weight_gradient(rows, g, sizes, w.shape[0])
    elif frozen:
        _, pullback = jax.vjp(lambda a: jax.lax.ragged_dot(a, _widened(w, rows), sizes,
                                                           preferred_element_type=jnp.float32), rows)
        (d_rows,), d_w = pullback(g), None
    else:
        _, pullback = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, sizes, preferred_element_type=jnp.float32),
                              rows, w)
        d_rows, d_w = pullback(g)
    d_w = np.zeros(w.shape, jax.dtypes.float0) if frozen else d_w.astype(w.dtype)
    return d_rows.astype(rows.dtype), d_w, np.zeros(sizes.shape, jax.dtypes.float0)


_grouped_product.defvjp(_grouped_product_forward, _grouped_product_backward)


# --------------------------------------------------------------------------------------------
# Embedding and head (vocab-parallel)
# --------------------------------------------------------------------------------------------

def take_rows(table, ids):
    """`table[ids]` (rows of axis 0, ids inside the table). XLA:CPU runs a bf16 gather on a float32
    copy of its whole operand, which inside a decode loop is hoisted and held for the call (a 50k x
    4k embedding table: an extra 800 MB), and gathers 16-bit integers from a 16-bit copy of it,
    made once per decode call (a 50k x 512 bfloat16 table: 13 ms of a 16-row call's ~90). A 16-bit
    table's rows are copied by `kernels.take_rows` on CPU (not differentiated), elsewhere gathered
    as 16-bit integers."""
    if _is_16_bit_float(table):
        return _take_16_bit(table, ids)
    return jnp.take(table, ids, axis=0)


def _take_16_bit_differentiable(table, ids):
    return on_bits(lambda bits: jnp.take(bits, ids, axis=0), table)


@jax.custom_vjp
def _take_16_bit(table, ids):  # not differentiated (decoding, evaluation)
    return kernels.take_rows(table, ids) if kernels.available() else _take_16_bit_differentiable(table, ids)


def _take_16_bit_fwd(table, ids):
    return _take_16_bit_differentiable(table, ids), (table, ids)


def _take_16_bit_bwd(residuals, g):  # jnp.take's gradient: g scattered-added into the table's rows
    table, ids = residuals
    _, pullback = jax.vjp(lambda t: jnp.take(t, ids, axis=0), table)
    return pullback(g)[0], None


_take_16_bit.defvjp(_take_16_bit_fwd, _take_16_bit_bwd)


def neftune(x, alpha: float, key):
    """NEFTune (Jain et al. 2023): token embeddings x [B, T, width] plus noise drawn uniformly from
    ±alpha / sqrt(T * width), as HF's hook adds it on the embedding's output (training only)."""
    bound = alpha / math.sqrt(x.shape[1] * x.shape[2])
    return x + jax.random.uniform(key, x.shape, jnp.float32, -bound, bound).astype(x.dtype)


class Embedding(hk.Module):
    """Vocab-parallel token embedding (each mp shard holds V/mp rows) and, tied, the output projection."""

    def __init__(self, padded_vocab: int, width: int, init_std: float = 0.02, width_axis: str = "embed",
                 name: str = "embed"):
        """`width_axis`: "embed" (d_model wide) or "embed_proj" (OPT's narrower word_embed_proj_dim)."""
        super().__init__(name=name)
        self.padded_vocab, self.width, self.init_std, self.width_axis = padded_vocab, width, init_std, width_axis

    def _table(self, dtype):
        return parallel.param("embeddings", (self.padded_vocab, self.width), ("vocab", self.width_axis),
                              normal(self.init_std), dtype, decay=True)

    def __call__(self, tokens, dtype):  # [B, T] -> [B, T, width]
        table = self._table(dtype)
        local_vocab = table.shape[0]
        local_ids = tokens - parallel.mp_index() * local_vocab
        here = (local_ids >= 0) & (local_ids < local_vocab)
        x = take_rows(table, jnp.clip(local_ids, 0, local_vocab - 1))
        return parallel.psum_mp(jnp.where(here[..., None], x, 0))

    def positions(self, positions, seq: int, d: int, dtype, offset: int = 0, init_std: float = 0.01):
        """Learned absolute position embeddings [B, T, D] (GPT-2; OPT keeps `offset` = 2 rows before position 0).
        Positions past the table take its last row: a speculative pass's drafts near the end of the
        context, or a finished row of a batch, compute them and keep nothing of them (an index past
        the table would read NaN, whose keys and values would poison the masked-out slots' sums)."""
        table = parallel.param("pos_embeddings", (seq + offset, d), ("seq", "embed"), normal(init_std), dtype, decay=True)
        return take_rows(table, jnp.minimum(positions, seq - 1) + offset)

    def projection(self, dtype, n_vocab: int) -> tuple[Callable, jax.Array]:
        """The tied output projection as (a pure function of (table, x [B, T, width]) -> local
        logits [B, T, V/mp] float32, padding -inf; the table): pure, so that a training loss can run
        it over chunks of tokens, and differentiate it, outside Haiku (`Transformer`'s `on_head`)."""
        return functools.partial(_attend, n_vocab=n_vocab), self._table(dtype)


def _attend(table, x, n_vocab: int):
    return product("btd,vd->btv", x, table) + vocab_padding(table.shape[0], n_vocab)


def vocab_padding(local_vocab: int, n_vocab: int):
    """[V/mp] float32: 0 for real vocabulary entries of this shard, -inf for padding."""
    vocab_ids = parallel.mp_index() * local_vocab + jnp.arange(local_vocab)
    return jnp.where(vocab_ids < n_vocab, 0.0, -jnp.inf).astype(jnp.float32)


class LMHead(hk.Module):
    """Untied vocab-parallel output projection (with an optional bias); padded vocabulary entries get -inf."""

    def __init__(self, d: int, padded_vocab: int, n_vocab: int, bias: bool, name: str = "head"):
        super().__init__(name=name)
        self.d, self.padded_vocab, self.n_vocab, self.bias = d, padded_vocab, n_vocab, bias

    def projection(self, dtype) -> tuple[Callable, tuple]:
        """The head as (a pure function of (weights, x [B, T, D]) -> local logits [B, T, V/mp]
        float32; the weights): see `Embedding.projection`."""
        w = parallel.weight("lm_head", (self.d, self.padded_vocab), ("embed", "vocab"), 1, normal(0.02), dtype)
        if not self.bias:
            return functools.partial(_project, n_vocab=self.n_vocab), (w,)
        # padding folded into the bias: cheaper than masking [B, T, V] logits
        b = parallel.param("lm_head_bias", (self.padded_vocab,), ("vocab",), ZEROS)
        return _project_with_bias, (w, jnp.where(jnp.isfinite(vocab_padding(b.shape[0], self.n_vocab)), b, -jnp.inf))


def _project(weights, x, n_vocab: int):
    logits = dense("btd,dv->btv", x, weights[0], jnp.float32)
    return logits + vocab_padding(logits.shape[-1], n_vocab)


def _project_with_bias(weights, x):
    w, b = weights
    return add_bias(dense("btd,dv->btv", x, w, jnp.float32), b)
