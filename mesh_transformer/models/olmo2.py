"""OLMo 2 (Team OLMo et al. 2024, "2 OLMo 2 Furious") and OLMo 3 (Team OLMo 2025): numerically
`transformers.Olmo2ForCausalLM` and `Olmo3ForCausalLM`.

    x = x + RMSNorm1(Attn(x));  x = x + RMSNorm2(SwiGLU(x))    # each sublayer's output normed, then added

LLaMA's grouped-query attention (rotate-half rotary, `rope_scaling`) and SwiGLU otherwise; the
queries and keys are RMS-normed across all heads before rotary — q_norm over the q projection's
whole output (n_heads * head_dim features), k_norm over k's (n_kv_heads * head_dim): under mp the
sums of squares of the heads each shard holds are added over 'mp' (`layers.norm_across_heads`).
OLMo 3 adds a sliding window in the layers `layer_types` marks (three of every four); its rope
scaling (YaRN in the long-context models) holds in the full-attention layers only, the sliding
ones rotating with plain rope at their own base (`rope_local_theta`; the released models: the same).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mesh_transformer.config import ConfigError, ModelConfig, require
from mesh_transformer.models import hf_layout as hl
from mesh_transformer.models.layers import MLP, Attention, AttentionSpec, MLPSpec, Rotary, norm, reduce_mp
from mesh_transformer.models.llama import (FULL, SLIDING, LlamaShaped, full_rotary, hf_attention, hf_rope, hf_rope_keys,
                                           hf_rope_parameters, hf_scaling, hf_sliding_window, validate_rope)


@dataclass(frozen=True)
class Olmo2Config(LlamaShaped, ModelConfig):
    family: str = "olmo2"
    n_kv_heads: Optional[int] = None  # default n_heads (no grouping)
    rope_theta: float = 10000.0  # (HF's Olmo2Config defaults; the released models set 500000)
    rope_scaling: Optional[dict] = None  # HF's: {"rope_type": "linear" | "llama3" | "yarn", "factor": ..., ...}
    attention_bias: bool = False  # biases on q/k/v_proj and o_proj
    tie_embeddings: bool = False
    layer_norm_eps: float = 1e-5  # every RMSNorm's epsilon
    sliding_window: Optional[int] = None  # OLMo 3: each token attends to the last sliding_window, itself included
    layer_types: Optional[list] = None  # OLMo 3: HF's list, "sliding_attention" or "full_attention" per layer
    rope_local_theta: Optional[float] = None  # OLMo 3: the sliding layers' rope base (None: rope_theta)

    PE_CHOICES = ("rotary",)

    def validate(self) -> None:
        super().validate()
        self.validate_kv_heads_and_window()
        validate_rope(self)
        if self.rope_local_theta is not None:
            require(isinstance(self.rope_local_theta, (int, float)) and self.rope_local_theta > 0, "rope_local_theta",
                    f"must be a positive number, got {self.rope_local_theta!r}")
            require(self.sliding_window is not None, "rope_local_theta", "is the sliding layers' base: set sliding_window")

    @property
    def local_theta(self) -> float:
        return self.rope_theta if self.rope_local_theta is None else self.rope_local_theta

    def attention(self) -> AttentionSpec:
        sliding_rope_differs = self.sliding_window and (self.rope_scaling or self.local_theta != self.rope_theta)
        sliding_rope = Rotary(self.head_dim, "half", self.local_theta) if sliding_rope_differs else None
        return AttentionSpec(self.d_model, self.n_heads, self.kv_heads, self.head_dim, full_rotary(self),
                             qkv_bias=self.attention_bias, out_bias=self.attention_bias, qk_norm=self.layer_norm_eps,
                             qk_norm_across_heads=True, window=self.window, local_rotary=sliding_rope)

    def mlp(self) -> MLPSpec:
        return MLPSpec(self.d_model, self.ff_dim, "silu", gated=True, bias=False)

    @classmethod
    def from_hf_config(cls, hf: dict) -> "Olmo2Config":
        """OLMo 2's keys (missing ones: Olmo2Config's defaults); OLMo 3's as transformers' Olmo3Config
        reads them — its defaults (4,096-token window in three layers of four, base 5e5), older
        rope keys in per-layer-kind `rope_parameters` (`_olmo3_ropes`)."""
        olmo3 = hf.get("model_type") == "olmo3"
        if olmo3:
            hf = hl.as_transformers_reads_it(hf)
        full, local_theta = _olmo3_ropes(hf) if olmo3 else (hf_rope(hf, "OLMo 2"), None)
        theta, scaling = hf_rope_keys(full, hf, 10000.0)
        window, kinds = hf_sliding_window(hf) if olmo3 else (None, None)
        return cls(layers=hf["num_hidden_layers"], d_model=hf["hidden_size"], n_heads=hf["num_attention_heads"],
                   n_kv_heads=hf.get("num_key_value_heads"), d_head=hf.get("head_dim"), n_vocab=hf["vocab_size"],
                   seq=hf.get("max_position_embeddings", 2048), d_ff=hf["intermediate_size"], rope_theta=theta,
                   rope_scaling=scaling, sliding_window=window, layer_types=kinds,
                   rope_local_theta=local_theta if window and local_theta != theta else None,
                   attention_bias=hf.get("attention_bias", False), tie_embeddings=hf.get("tie_word_embeddings", False),
                   layer_norm_eps=hf.get("rms_norm_eps", 1e-5))

    def to_hf_config(self) -> dict:
        """Olmo2ForCausalLM; Olmo3ForCausalLM with a sliding window."""
        out = {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "hidden_size": self.d_model,
               "head_dim": self.head_dim, "num_attention_heads": self.n_heads, "num_key_value_heads": self.kv_heads,
               "num_hidden_layers": self.layers, "intermediate_size": self.ff_dim, "vocab_size": self.n_vocab,
               "max_position_embeddings": self.seq, "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
               "attention_bias": self.attention_bias, "hidden_act": "silu", "rms_norm_eps": self.layer_norm_eps,
               "tie_word_embeddings": self.tie_embeddings}
        if self.sliding_window is None:
            return out
        kinds = self.windowed_layers() or (True,) * self.layers
        return {**{k: v for k, v in out.items() if k not in ("rope_theta", "rope_scaling")},
                "architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "sliding_window": self.sliding_window,
                "layer_types": [SLIDING if windowed else FULL for windowed in kinds],
                "rope_parameters": _olmo3_rope_parameters(self)}


def _olmo3_rope_parameters(c: Olmo2Config) -> dict:
    """Olmo3Config's per-layer-kind `rope_parameters` of `c` (YaRN's `truncate` beside them, where
    transformers reads it: `_olmo3_ropes`)."""
    scaling = dict(c.rope_scaling or {})
    truncate = scaling.pop("truncate", None)
    return {FULL: hf_rope_parameters(c.rope_theta, scaling or None), SLIDING: hf_rope_parameters(c.local_theta),
            **({} if truncate is None else {"truncate": truncate})}


def _olmo3_ropes(hf: dict) -> tuple[dict, float]:
    """(the full-attention layers' rope keys, the sliding layers' base) from Olmo3Config's
    per-layer-kind `rope_parameters`. Its reading of a config.json's older flat rope_theta and
    rope_scaling is transformers' own: the full layers' only, the sliding layers rotating at the
    default base 5e5. YaRN's `truncate` is read where transformers' YaRN reads it: beside the two
    layer kinds' dicts (one among the full layers' keys is ignored)."""
    rope = hf_rope(hf, "OLMo 3")
    full, sliding = dict(rope[FULL]), dict(rope[SLIDING])
    full.pop("truncate", None)
    if rope.get("truncate") is not None:
        full["truncate"] = rope["truncate"]
    if hf_scaling(sliding, hf) is not None:
        raise ConfigError(f"config.json: OLMo 3's sliding-attention layers with rope scaling ({sliding}) are not "
                          "supported; only the full-attention layers' rope may be scaled")
    return full, sliding["rope_theta"]


def block(c: Olmo2Config, x, ctx, cache=None):
    """Norms on the sublayers' outputs: x + RMSNorm(Attn(x)), then + RMSNorm(SwiGLU(x))."""
    attn, cache = Attention(c.attention())(x, ctx, cache)
    x = x + norm("rmsnorm", c.d_model, c.layer_norm_eps, "post_attn_norm")(reduce_mp(attn))
    return x + norm("rmsnorm", c.d_model, c.layer_norm_eps, "post_mlp_norm")(reduce_mp(MLP(c.mlp())(x))), cache


def hf_table(c: Olmo2Config) -> list[hl.HFParam]:
    layer = "model.layers.{i}."
    table = [
        hl.HFParam("model.embed_tokens.weight", (("embed", "embeddings"),), hl.SAME),
        *hf_attention(layer, c.attention_bias),
        hl.HFParam(layer + "self_attn.q_norm.weight", (("layers/attn/q_norm", "scale"),), hl.head_bias()),
        hl.HFParam(layer + "self_attn.k_norm.weight", (("layers/attn/k_norm", "scale"),), hl.head_bias(kv=True)),
        hl.HFParam(layer + "post_attention_layernorm.weight", (("layers/post_attn_norm", "scale"),), hl.SAME),
        hl.HFParam(layer + "mlp.gate_proj.weight", (("layers/mlp", "gate"),), hl.LINEAR),
        hl.HFParam(layer + "mlp.up_proj.weight", (("layers/mlp", "fc_in"),), hl.LINEAR),
        hl.HFParam(layer + "mlp.down_proj.weight", (("layers/mlp", "fc_out"),), hl.LINEAR),
        hl.HFParam(layer + "post_feedforward_layernorm.weight", (("layers/post_mlp_norm", "scale"),), hl.SAME),
        hl.HFParam("model.norm.weight", (("ln_f", "scale"),), hl.SAME),
    ]
    if c.attention_bias:
        table.append(hl.HFParam(layer + "self_attn.o_proj.bias", (("layers/attn", "out_bias"),), hl.SAME))
    table += hl.untied_head(c.tie_embeddings)
    return table
