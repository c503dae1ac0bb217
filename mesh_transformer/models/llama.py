"""LLaMA (Touvron et al. 2023) and the models that share its shape — Llama 2/3, Mistral, Qwen2,
Qwen3, Granite 3, TinyLlama: numerically `transformers.LlamaForCausalLM` (and Mistral's, Qwen2's,
Qwen3's, Granite's).

    x = x + Attn(RMSNorm1(x));  x = x + SwiGLU(RMSNorm2(x))      # two all-reduces per layer

Grouped-query attention (`n_kv_heads` kv heads shared by n_heads / n_kv_heads query heads),
rotate-half rotary with `rope_theta` and HF's `rope_scaling` kinds "linear", "llama3" and "yarn", optional
q/k/v bias (Qwen2) and o_proj bias, RMSNorm of each query and key head before rotary (`qk_norm`,
Qwen3), sliding-window attention in every layer (`sliding_window`, Mistral) or in the layers
`layer_types` marks (Qwen2/3), tied or untied embeddings. Granite's four constants: embeddings
times `embedding_multiplier`, each block's attention and MLP outputs times `residual_multiplier`
before they join the stream, `attention_multiplier` the scores' scale, logits divided by
`logits_scaling`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import jax.numpy as jnp

from mesh_transformer.config import ConfigError, ModelConfig, canonical_rope_scaling, require
from mesh_transformer.models import hf_layout as hl
from mesh_transformer.models.core import StemSpec
from mesh_transformer.models.layers import MLP, Attention, AttentionSpec, MLPSpec, Rotary, norm, reduce_mp

ROPE_SCALINGS = {"linear": ("factor",),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                 "yarn": ("factor", "original_max_position_embeddings")}  # (optional: beta_fast/slow, attention_factor, ...)


SLIDING, FULL = "sliding_attention", "full_attention"  # HF's layer_types


class LlamaShaped:
    """What the LLaMA-shaped families (llama, phi3, gemma, mixtral, olmo2, starcoder2) share beside
    ModelConfig's keys: grouped-query kv heads (`n_kv_heads`, default n_heads), a sliding window
    (`sliding_window`) in every layer or in those `layer_types` marks, a final norm (RMSNorm unless
    the family says otherwise) before a tied or untied head."""

    layer_types = None  # a family with the key declares it: HF's list, SLIDING or FULL per layer
    residual_multiplier = None  # LLaMA's key (Granite), read by the block other families share
    block_norm = "rmsnorm"  # the block's two pre-norms (StarCoder2's: LayerNorms); not a key

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def window(self) -> Optional[int]:
        """The attention window when it is shorter than the context (else None: full attention)."""
        return self.sliding_window if self.sliding_window is not None and self.sliding_window < self.seq else None

    def windowed_layers(self) -> Optional[tuple[bool, ...]]:
        """Per layer from `layer_types` (a layer kind also picks Gemma 3's rope, window or not)."""
        if self.layer_types is None or all(t == SLIDING for t in self.layer_types):
            return None
        return tuple(t == SLIDING for t in self.layer_types)

    def validate_kv_heads_and_window(self) -> None:
        require(self.kv_heads > 0 and self.n_heads % self.kv_heads == 0, "n_kv_heads",
                f"{self.kv_heads} must be positive and divide n_heads={self.n_heads}")
        if self.sliding_window is not None:
            require(isinstance(self.sliding_window, int) and not isinstance(self.sliding_window, bool)
                    and self.sliding_window > 0, "sliding_window",
                    f"must be a positive integer (tokens), got {self.sliding_window!r}")
        if self.layer_types is not None:
            kinds = self.layer_types
            require(isinstance(kinds, (list, tuple)) and len(kinds) == self.layers
                    and all(t in (SLIDING, FULL) for t in kinds), "layer_types",
                    f"must list {SLIDING!r} or {FULL!r} for each of the {self.layers} layers, got {kinds!r}")
            require(self.sliding_window is not None or SLIDING not in kinds, "layer_types",
                    f"marks {SLIDING!r} layers but sliding_window is not set")

    def stem(self) -> StemSpec:
        return StemSpec(final_norm="rmsnorm", tied=self.tie_embeddings)


def validate_rope(c, dims: Optional[int] = None) -> None:
    """An even number of rotated features (`dims`, default the head size), a positive `rope_theta`,
    and HF's `rope_scaling` (if any) of a kind `ROPE_SCALINGS` knows, with its keys, positive."""
    dims = c.head_dim if dims is None else dims
    require(dims % 2 == 0, "d_head", f"rotary needs an even number of rotated features, got {dims}")
    require(_positive(c.rope_theta), "rope_theta", f"must be a positive number, got {c.rope_theta!r}")
    if c.rope_scaling is None:
        return
    kind = canonical_rope_scaling(c.rope_scaling)["rope_type"]
    require(kind in ROPE_SCALINGS, "rope_scaling", f"rope_type must be one of {tuple(ROPE_SCALINGS)}, got {kind!r}")
    missing = [k for k in ROPE_SCALINGS[kind] if c.rope_scaling.get(k) is None]
    require(not missing, "rope_scaling", f"{kind!r} needs {missing}")
    for key in (*ROPE_SCALINGS[kind], "attention_factor"):
        value = c.rope_scaling.get(key)
        require(value is None or _positive(value), "rope_scaling", f"{key} must be a positive number, got {value!r}")


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def full_rotary(c, dims: Optional[int] = None) -> Rotary:
    """Rotate-half rotary over each whole head (or its first `dims` features), `rope_theta` and
    `rope_scaling` as HF's LLaMA reads them."""
    scaling = tuple(sorted(c.rope_scaling.items())) if c.rope_scaling else None
    return Rotary(c.head_dim if dims is None else dims, "half", c.rope_theta, scaling)


def hf_rope_keys(rope: dict, hf: dict, default_theta: float) -> tuple[float, Optional[dict]]:
    """(rope_theta, our `rope_scaling`) from a HF config.json's rope dict (`hf_rope_dict`) and its
    top-level keys."""
    return rope.get("rope_theta", hf.get("rope_theta", default_theta)), hf_scaling(rope, hf)


def hf_scaling(rope: dict, hf: dict) -> Optional[dict]:
    """The rope keys of a HF config.json beside rope_theta and partial_rotary_factor as our
    `rope_scaling` (None: plain rope), its kind under `rope_type` whichever key the file used. As
    transformers reads them, llama3's and YaRN's original context is a top-level
    original_max_position_embeddings where the file has one, else the dict's, else max_position_embeddings."""
    scaling = canonical_rope_scaling({k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")})
    if scaling["rope_type"] in (None, "default"):
        return None
    if scaling["rope_type"] in ("llama3", "yarn"):  # (a top-level key wins, as in transformers 5)
        original = hf.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
        original = original or hf.get("max_position_embeddings")
        scaling.update({} if original is None else {"original_max_position_embeddings": original})
    return scaling


def hf_rope_parameters(theta: float, scaling: Optional[dict] = None, **extra) -> dict:
    """HF's `rope_parameters` of a rope at base `theta` with our `rope_scaling` (its kind under
    `rope_type`, whichever key it was written with) and `extra` keys (partial_rotary_factor)."""
    scaling = canonical_rope_scaling(scaling or {"rope_type": "default"})
    return {**scaling, "rope_theta": theta, **extra}


def hf_rope(hf: dict, model: str) -> dict:
    """A LLaMA-shaped HF config.json's rope keys (`hf_rope_dict`); ConfigError unless the activation
    is SiLU."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"config.json: hidden_act {act!r} is not supported ({model} uses 'silu')")
    return hf_rope_dict(hf)


def hf_rope_dict(hf: dict) -> dict:
    """A HF config.json's rope keys as one dict: the older `rope_scaling` where the file has one (it
    then replaces `rope_parameters` whole, as transformers 5 reads it), else `rope_parameters`; may
    be empty."""
    return dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})


@dataclass(frozen=True)
class LlamaConfig(LlamaShaped, ModelConfig):
    family: str = "llama"
    n_kv_heads: Optional[int] = None  # default n_heads (no grouping)
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # HF's: {"rope_type": "linear" | "llama3" | "yarn", "factor": ..., ...}
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: q_norm / k_norm over each head's head_dim, before rotary
    sliding_window: Optional[int] = None  # Mistral: each token attends to the last sliding_window, itself included
    layer_types: Optional[list] = None  # Qwen2/3: which layers slide (SLIDING) and which see everything (FULL)
    tie_embeddings: bool = False
    layer_norm_eps: float = 1e-6  # RMSNorm's epsilon
    embedding_multiplier: Optional[float] = None  # Granite: embeddings times this
    residual_multiplier: Optional[float] = None  # Granite: each block's attention and MLP outputs times this
    attention_multiplier: Optional[float] = None  # Granite: the scores' scale (None: head_dim ** -0.5)
    logits_scaling: Optional[float] = None  # Granite: logits divided by this

    PE_CHOICES = ("rotary", "alibi", "none")
    GRANITE = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")

    def validate(self) -> None:
        super().validate()
        self.validate_kv_heads_and_window()
        for key in self.GRANITE:
            value = getattr(self, key)
            require(value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0),
                    key, f"must be a positive number or null, got {value!r}")
        validate_rope(self)

    def attention(self) -> AttentionSpec:
        rotary = full_rotary(self) if self.pe == "rotary" else None
        return AttentionSpec(self.d_model, self.n_heads, self.kv_heads, self.head_dim, rotary, alibi=self.pe == "alibi",
                             qkv_bias=self.qkv_bias, out_bias=self.out_bias,
                             qk_norm=self.layer_norm_eps if self.qk_norm else None, window=self.window,
                             scale=self.attention_multiplier)

    def mlp(self) -> MLPSpec:
        return MLPSpec(self.d_model, self.ff_dim, "silu", gated=True, bias=self.mlp_bias)

    def stem(self) -> StemSpec:
        return super().stem()._replace(embed_scale=self.embedding_multiplier, logit_divisor=self.logits_scaling)

    @property
    def granite(self) -> bool:
        return any(getattr(self, key) is not None for key in self.GRANITE)

    @classmethod
    def from_hf_config(cls, hf: dict) -> "LlamaConfig":
        rope = hf_rope(hf, "LLaMA")
        theta, scaling = hf_rope_keys(rope, hf, 10000.0)
        seq = hf.get("max_position_embeddings", 2048)
        window, kinds = hf_sliding_window(hf)
        qwen2, qwen3, granite = (hf.get("model_type") == t for t in ("qwen2", "qwen3", "granite"))
        constants = {key: float(1.0 if hf.get(key) is None else hf[key]) for key in cls.GRANITE} if granite else {}
        return cls(**constants, layers=hf["num_hidden_layers"], d_model=hf["hidden_size"], n_heads=hf["num_attention_heads"],
                   n_kv_heads=hf.get("num_key_value_heads"), d_head=hf.get("head_dim"), n_vocab=hf["vocab_size"],
                   seq=seq, sliding_window=window, layer_types=kinds, d_ff=hf["intermediate_size"],
                   rope_theta=theta, rope_scaling=scaling, qkv_bias=qwen2 or hf.get("attention_bias", False),
                   out_bias=not qwen2 and hf.get("attention_bias", False), mlp_bias=hf.get("mlp_bias", False),
                   qk_norm=qwen3, tie_embeddings=hf.get("tie_word_embeddings", False),
                   layer_norm_eps=hf.get("rms_norm_eps", 1e-6))

    def to_hf_config(self) -> dict:
        """LlamaForCausalLM; Qwen2ForCausalLM for q/k/v biases without an o_proj bias; Qwen3ForCausalLM
        for q/k norms; MistralForCausalLM for a sliding window without any of those or biases;
        GraniteForCausalLM with Granite's constants."""
        if self.granite:
            return self._granite_hf_config()
        qwen2 = self.qkv_bias and not self.out_bias
        qwen2_shape = not self.mlp_bias and self.head_dim * self.n_heads == self.d_model
        if self.pe != "rotary" or (self.out_bias and not self.qkv_bias) or (qwen2 and not qwen2_shape):
            raise ConfigError("only pe='rotary' LLaMA models with q/k/v biases wherever o_proj has one (and Qwen2-style "
                              "models without MLP biases, with n_heads * d_head == d_model) export to HF")
        if self.qk_norm and (qwen2 or self.mlp_bias):
            raise ConfigError("a LLaMA model with qk_norm exports as Qwen3, which has no MLP biases and biases on "
                              "all of q/k/v/o_proj or none")
        kind = "qwen3" if self.qk_norm else "qwen2" if qwen2 else "mistral" if self.window else "llama"
        if kind == "mistral" and (self.qkv_bias or self.out_bias or self.mlp_bias):
            raise ConfigError("a LLaMA model with a sliding window and biases has no HF class (Mistral has no biases)")
        if kind == "mistral" and self.windowed_layers():
            raise ConfigError("a LLaMA model with full and sliding layers (layer_types) exports as Qwen2 or Qwen3 "
                              "only (Mistral slides in every layer)")
        out = {"architectures": [{"qwen3": "Qwen3", "qwen2": "Qwen2", "mistral": "Mistral",
                                  "llama": "Llama"}[kind] + "ForCausalLM"],
               "model_type": kind, "hidden_size": self.d_model,
               "num_attention_heads": self.n_heads, "num_key_value_heads": self.kv_heads,
               "num_hidden_layers": self.layers, "intermediate_size": self.ff_dim, "vocab_size": self.n_vocab,
               "max_position_embeddings": self.seq, "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
               "hidden_act": "silu", "rms_norm_eps": self.layer_norm_eps, "tie_word_embeddings": self.tie_embeddings}
        kinds = self.windowed_layers() or (self.window is not None,) * self.layers
        window = {"use_sliding_window": self.window is not None, "sliding_window": self.window, "max_window_layers": 0,
                  "layer_types": [SLIDING if on else FULL for on in kinds]}
        if kind == "qwen2":
            return {**out, **window}
        if kind == "qwen3":
            return {**out, **window, "head_dim": self.head_dim, "attention_bias": self.qkv_bias}
        if kind == "mistral":
            return {**out, "head_dim": self.head_dim, "sliding_window": self.window}
        return {**out, "head_dim": self.head_dim, "attention_bias": self.qkv_bias, "mlp_bias": self.mlp_bias}

    def _granite_hf_config(self) -> dict:
        if (self.pe != "rotary" or self.qk_norm or self.window or self.qkv_bias != self.out_bias
                or self.head_dim * self.n_heads != self.d_model):
            raise ConfigError("a LLaMA model with Granite's constants exports as Granite, which has rotary positions, "
                              "no q/k norms, no sliding window, biases on all of q/k/v/o_proj or none, and "
                              "n_heads * d_head == d_model")
        return {"architectures": ["GraniteForCausalLM"], "model_type": "granite", "hidden_size": self.d_model,
                "num_attention_heads": self.n_heads, "num_key_value_heads": self.kv_heads,
                "num_hidden_layers": self.layers, "intermediate_size": self.ff_dim, "vocab_size": self.n_vocab,
                "max_position_embeddings": self.seq, "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
                "hidden_act": "silu", "rms_norm_eps": self.layer_norm_eps, "tie_word_embeddings": self.tie_embeddings,
                "attention_bias": self.qkv_bias, "mlp_bias": self.mlp_bias,
                **{key: getattr(self, key) for key in self.GRANITE if getattr(self, key) is not None},
                **({"attention_multiplier": self.head_dim ** -0.5} if self.attention_multiplier is None else {})}


def hf_sliding_window(hf: dict) -> tuple[Optional[int], Optional[list]]:
    """(the sliding window, or None; `layer_types`, or None where every layer slides) from HF's
    keys. Mistral's `sliding_window` holds in every layer; Qwen2/3's only with
    `use_sliding_window`, in the layers `layer_types` (else `max_window_layers`: the layers from it
    on) marks."""
    window = hf.get("sliding_window")
    if not window or not hf.get("use_sliding_window", True):
        return None, None
    kinds = hf.get("layer_types")
    if kinds is None and "max_window_layers" in hf:
        kinds = [SLIDING if i >= hf["max_window_layers"] else FULL for i in range(hf["num_hidden_layers"])]
    if kinds is None or all(kind == SLIDING for kind in kinds):
        return window, None
    if SLIDING not in kinds:
        return None, None
    return window, list(kinds)


def block(c: LlamaConfig, x, ctx, cache=None):
    """Pre-norm, sequential: x + Attn(RMSNorm(x)), then + SwiGLU(RMSNorm(x)) (`block_norm`, `mlp()`)."""
    attn, cache = Attention(c.attention())(norm(c.block_norm, c.d_model, c.layer_norm_eps, "ln_1")(x), ctx, cache)
    x = x + residual(c, reduce_mp(attn))
    return x + residual(c, reduce_mp(MLP(c.mlp())(norm(c.block_norm, c.d_model, c.layer_norm_eps, "ln_2")(x)))), cache


def residual(c: LlamaConfig, y):
    """A block's output as it joins the stream: times Granite's `residual_multiplier`, if any."""
    return y if c.residual_multiplier is None else y * jnp.asarray(c.residual_multiplier, y.dtype)


def hf_attention(layer: str, qkv_bias: bool = False, qk_norm: bool = False) -> list[hl.HFParam]:
    """q/k/v/o_proj, each its own HF tensor, with q/k/v_proj's biases and q/k_norm where asked
    (LLaMA's, Gemma's and the MoE models' names)."""
    table = [
        hl.HFParam(layer + "self_attn.q_proj.weight", (("layers/attn", "q_proj"),), hl.heads_out()),
        hl.HFParam(layer + "self_attn.k_proj.weight", (("layers/attn", "k_proj"),), hl.heads_out(kv=True)),
        hl.HFParam(layer + "self_attn.v_proj.weight", (("layers/attn", "v_proj"),), hl.heads_out(kv=True)),
        hl.HFParam(layer + "self_attn.o_proj.weight", (("layers/attn", "out_proj"),), hl.heads_in()),
    ]
    if qkv_bias:
        table += [hl.HFParam(layer + f"self_attn.{p}_proj.bias", (("layers/attn", f"{p}_bias"),), hl.head_bias(kv=p != "q"))
                  for p in "qkv"]
    if qk_norm:
        table += [hl.HFParam(layer + f"self_attn.{p}_norm.weight", ((f"layers/attn/{p}_norm", "scale"),), hl.SAME)
                  for p in "qk"]
    return table


def hf_projections(layer: str, qkv_bias: bool = False, qk_norm: bool = False) -> list[hl.HFParam]:
    """`hf_attention` and SwiGLU's gate/up/down_proj, each its own HF tensor (LLaMA's and Gemma's names)."""
    return [
        *hf_attention(layer, qkv_bias, qk_norm),
        hl.HFParam(layer + "mlp.gate_proj.weight", (("layers/mlp", "gate"),), hl.LINEAR),
        hl.HFParam(layer + "mlp.up_proj.weight", (("layers/mlp", "fc_in"),), hl.LINEAR),
        hl.HFParam(layer + "mlp.down_proj.weight", (("layers/mlp", "fc_out"),), hl.LINEAR),
    ]


def hf_table(c: LlamaConfig) -> list[hl.HFParam]:
    layer = "model.layers.{i}."
    table = [
        hl.HFParam("model.embed_tokens.weight", (("embed", "embeddings"),), hl.SAME),
        hl.HFParam(layer + "input_layernorm.weight", (("layers/ln_1", "scale"),), hl.SAME),
        hl.HFParam(layer + "post_attention_layernorm.weight", (("layers/ln_2", "scale"),), hl.SAME),
        *hf_projections(layer, c.qkv_bias, c.qk_norm),
        hl.HFParam("model.norm.weight", (("ln_f", "scale"),), hl.SAME),
    ]
    if c.out_bias:
        table.append(hl.HFParam(layer + "self_attn.o_proj.bias", (("layers/attn", "out_bias"),), hl.SAME))
    if c.mlp_bias:
        table += [hl.HFParam(layer + f"mlp.{hf}.bias", (("layers/mlp", ours),), hl.SAME)
                  for hf, ours in (("gate_proj", "gate_bias"), ("up_proj", "fc_in_bias"), ("down_proj", "fc_out_bias"))]
    table += hl.untied_head(c.tie_embeddings)
    return table
