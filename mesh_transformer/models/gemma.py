"""Gemma (Gemma Team 2024), Gemma 2 and Gemma 3's text models: numerically
`transformers.GemmaForCausalLM`, `Gemma2ForCausalLM` and `Gemma3ForCausalLM`.

    x = embed(tokens) * sqrt(d_model)
    x = x + PostNorm1(Attn(RMSNorm1(x)));  x = x + PostNorm2(GeGLU(RMSNorm2(x)))   # two all-reduces per layer
    logits = cap * tanh(head(RMSNorm(x)) / cap)

LLaMA's grouped-query attention and rotate-half rotary, with what Gemma changes: every RMSNorm
scales by (1 + w) (`rmsnorm+1`), the MLP gates with tanh-GELU, embeddings are scaled by
sqrt(d_model) and tied to the head. Gemma 2 and 3 add the post-norms ("sandwich", `sandwich_norms`)
and scale scores by `query_pre_attn_scalar` ** -0.5; their layers alternate between a sliding
window and full attention (`layer_types`: Gemma 2 one in two, Gemma 3 five in six). Gemma 2
soft-caps attention scores and logits (`attn_softcap`, `logit_softcap`); Gemma 3 instead RMS-norms
each query and key head (`qk_norm`) and gives its windowed layers their own rope base
(`rope_local_theta`), the full ones a longer one (`rope_theta`, with linear `rope_scaling` in the
4B-27B models).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from mesh_transformer.config import ConfigError, ModelConfig, canonical_rope_scaling, require
from mesh_transformer.models import hf_layout as hl
from mesh_transformer.models.core import StemSpec
from mesh_transformer.models.layers import MLP, Attention, AttentionSpec, MLPSpec, Rotary, norm, reduce_mp
from mesh_transformer.models.llama import FULL, SLIDING, LlamaShaped, hf_projections, hf_rope_parameters, validate_rope

NORM = "rmsnorm+1"
HF_CLASSES = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


@dataclass(frozen=True)
class GemmaConfig(LlamaShaped, ModelConfig):
    family: str = "gemma"
    n_kv_heads: Optional[int] = None  # default n_heads (no grouping)
    rope_theta: float = 10000.0  # the full-attention layers' (all layers' without rope_local_theta)
    rope_scaling: Optional[dict] = None  # the full-attention layers': {"rope_type": "linear", "factor": ...}
    rope_local_theta: Optional[float] = None  # Gemma 3: the sliding layers' rope base
    sliding_window: Optional[int] = None  # the windowed layers' window, the query's own position included
    layer_types: Optional[list] = None  # SLIDING or FULL per layer (None: every layer slides where there is a window)
    sandwich_norms: bool = False  # Gemma 2/3: attention and MLP outputs RMS-normed before the residual add
    qk_norm: bool = False  # Gemma 3: q_norm / k_norm over each head's head_dim, before rotary
    query_pre_attn_scalar: Optional[float] = None  # scores scaled by its -1/2 power (None: head_dim's)
    attn_softcap: Optional[float] = None  # Gemma 2: scores soft-capped to (-cap, cap)
    logit_softcap: Optional[float] = None  # Gemma 2: logits soft-capped to (-cap, cap)
    tie_embeddings: bool = True
    layer_norm_eps: float = 1e-6  # RMSNorm's epsilon

    PE_CHOICES = ("rotary",)

    def validate(self) -> None:
        super().validate()
        self.validate_kv_heads_and_window()
        validate_rope(self)
        for key in ("rope_local_theta", "query_pre_attn_scalar", "attn_softcap", "logit_softcap"):
            value = getattr(self, key)
            require(value is None or value > 0, key, f"must be positive (or null), got {value!r}")
        if self.rope_scaling is not None:
            kind = canonical_rope_scaling(self.rope_scaling)["rope_type"]
            require(kind == "linear" and "factor" in self.rope_scaling, "rope_scaling",
                    f"Gemma supports rope_type 'linear' with a factor, got {self.rope_scaling!r}")

    def stem(self) -> StemSpec:
        return StemSpec(final_norm=NORM, tied=self.tie_embeddings, embed_scale=math.sqrt(self.d_model),
                        scaled_embedding=True, logit_softcap=self.logit_softcap)

    def attention(self) -> AttentionSpec:
        scaling = tuple(sorted(self.rope_scaling.items())) if self.rope_scaling else None
        local = Rotary(self.head_dim, "half", self.rope_local_theta) if self.rope_local_theta is not None else None
        scale = None if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar ** -0.5
        return AttentionSpec(self.d_model, self.n_heads, self.kv_heads, self.head_dim,
                             Rotary(self.head_dim, "half", self.rope_theta, scaling), window=self.window,
                             qk_norm=self.layer_norm_eps if self.qk_norm else None, qk_norm_unit_offset=True,
                             local_rotary=local, scale=scale, softcap=self.attn_softcap)

    def mlp(self) -> MLPSpec:
        return MLPSpec(self.d_model, self.ff_dim, "gelu_pytorch_tanh", gated=True, bias=False)

    @classmethod
    def from_hf_config(cls, hf: dict) -> "GemmaConfig":
        kind = hf.get("model_type", "gemma")
        hf = hl.as_transformers_reads_it(hf)
        act = hf.get("hidden_activation") or hf.get("hidden_act")
        if act != "gelu_pytorch_tanh":
            raise ConfigError(f"config.json: hidden_activation {act!r} is not supported (Gemma uses 'gelu_pytorch_tanh')")
        if hf.get("use_bidirectional_attention"):
            raise ConfigError("config.json: use_bidirectional_attention (EmbeddingGemma) is not supported: "
                              "this library runs causal language models")
        full, local = _hf_ropes(hf)
        later = kind != "gemma"
        seq = hf["max_position_embeddings"]
        kinds = hf.get("layer_types") if later else None
        window = (hf["sliding_window"] or seq) if later else None  # null: sliding layers see everything
        return cls(layers=hf["num_hidden_layers"], d_model=hf["hidden_size"], n_heads=hf["num_attention_heads"],
                   n_kv_heads=hf.get("num_key_value_heads"), d_head=hf.get("head_dim"), n_vocab=hf["vocab_size"],
                   seq=seq, d_ff=hf["intermediate_size"],
                   rope_theta=full.pop("rope_theta"), rope_scaling=full or None,
                   rope_local_theta=local, sliding_window=window,
                   layer_types=list(kinds) if kinds else None, sandwich_norms=later,
                   qk_norm=kind == "gemma3_text", query_pre_attn_scalar=hf["query_pre_attn_scalar"] if later else None,
                   attn_softcap=hf["attn_logit_softcapping"] if later else None,
                   logit_softcap=hf["final_logit_softcapping"] if later else None,
                   tie_embeddings=hf["tie_word_embeddings"], layer_norm_eps=hf["rms_norm_eps"])

    def _hf_model_type(self) -> str:
        """gemma3_text with q/k norms or a local rope base, gemma2 with post-norms, else gemma; a
        ConfigError where the keys match none of them."""
        if self.qk_norm or self.rope_local_theta is not None:
            if not self.sandwich_norms or not self.qk_norm:
                raise ConfigError("a Gemma model with qk_norm or rope_local_theta exports as Gemma 3, which has both "
                                  "and sandwich_norms")
            return "gemma3_text"
        if self.sandwich_norms:
            if self.rope_scaling:
                raise ConfigError("a Gemma 2 model (sandwich_norms without qk_norm) has no rope_scaling in HF")
            return "gemma2"
        if self.window or self.attn_softcap or self.logit_softcap or self.query_pre_attn_scalar or self.rope_scaling:
            raise ConfigError("a Gemma model without sandwich_norms exports as Gemma (1), which has no sliding window, "
                              "soft-capping, query_pre_attn_scalar or rope_scaling")
        return "gemma"

    def to_hf_config(self) -> dict:
        kind = self._hf_model_type()
        out = {"architectures": [HF_CLASSES[kind]], "model_type": kind, "hidden_size": self.d_model,
               "num_attention_heads": self.n_heads, "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
               "num_hidden_layers": self.layers, "intermediate_size": self.ff_dim, "vocab_size": self.n_vocab,
               "max_position_embeddings": self.seq, "rms_norm_eps": self.layer_norm_eps,
               "tie_word_embeddings": self.tie_embeddings, "hidden_activation": "gelu_pytorch_tanh",
               "attention_bias": False}
        full = hf_rope_parameters(self.rope_theta, self.rope_scaling)
        if kind == "gemma":
            return {**out, "hidden_act": "gelu_pytorch_tanh", "rope_parameters": full}
        kinds = self.windowed_layers() or (True,) * self.layers
        scalar = self.query_pre_attn_scalar or self.head_dim
        out.update(query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,  # HF's is typed int
                   sliding_window=self.sliding_window or self.seq,
                   layer_types=[SLIDING if on and self.sliding_window else FULL for on in kinds],
                   attn_logit_softcapping=self.attn_softcap, final_logit_softcapping=self.logit_softcap)
        if kind == "gemma2":
            return {**out, "rope_parameters": full}
        local = hf_rope_parameters(self.rope_local_theta or self.rope_theta)
        return {**out, "rope_parameters": {"full_attention": full, "sliding_attention": local}}


def _hf_ropes(hf: dict) -> tuple[dict, Optional[float]]:
    """(the full layers' rope: rope_theta and any scaling keys; the sliding layers' base, or None
    where they share the full layers' rope) from transformers' `rope_parameters`: per layer kind
    (Gemma 3), or one dict (Gemma 1/2)."""
    params = dict(hf["rope_parameters"])
    if FULL in params or SLIDING in params:
        full, local = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
    else:
        full, local = params, {}
    for which, rope in (("full-attention", full), ("sliding-attention", local)):
        kind = rope.pop("rope_type", rope.pop("type", "default"))
        rope.pop("partial_rotary_factor", None)
        if kind not in ("default", "linear") or (which != "full-attention" and kind != "default"):
            raise ConfigError(f"config.json: Gemma {which} rope_type {kind!r} is not supported")
        if kind == "linear":
            rope["rope_type"] = "linear"
    return full, local.get("rope_theta")


def block(c: GemmaConfig, x, ctx, cache=None):
    """Pre-norm with (1 + w) RMSNorms; Gemma 2/3 also norm each branch's output (sandwich)."""
    post = lambda name, y: norm(NORM, c.d_model, c.layer_norm_eps, name)(y) if c.sandwich_norms else y  # noqa: E731
    attn, cache = Attention(c.attention())(norm(NORM, c.d_model, c.layer_norm_eps, "ln_1")(x), ctx, cache)
    x = x + post("ln_1_post", reduce_mp(attn))
    mlp = reduce_mp(MLP(c.mlp())(norm(NORM, c.d_model, c.layer_norm_eps, "ln_2")(x)))
    return x + post("ln_2_post", mlp), cache


def hf_table(c: GemmaConfig) -> list[hl.HFParam]:
    layer = "model.layers.{i}."
    norms = (("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_1_post"),
             ("pre_feedforward_layernorm", "ln_2"), ("post_feedforward_layernorm", "ln_2_post")) \
        if c.sandwich_norms else (("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_2"))
    table = [
        hl.HFParam("model.embed_tokens.weight", (("embed", "embeddings"),), hl.SAME),
        *(hl.HFParam(layer + f"{hf}.weight", ((f"layers/{ours}", "scale"),), hl.SAME) for hf, ours in norms),
        *hf_projections(layer, qk_norm=c.qk_norm),
        hl.HFParam("model.norm.weight", (("ln_f", "scale"),), hl.SAME),
    ]
    table += hl.untied_head(c.tie_embeddings)
    return table
