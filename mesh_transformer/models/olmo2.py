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
from mesh_transformer.models.llama import (FULL, SLIDING, LlamaShaped, full_rotary, hf_attention, hf_rope, hf_scaling,
                                           hf_sliding_window, validate_rope)


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
            require(self.rope_local_theta > 0, "rope_local_theta", f"must be positive, got {self.rope_local_theta}")
            require(self.sliding_window is not None, "rope_local_theta", "is the sliding layers' base: set sliding_window")

    @property
    def local_theta(self) -> float:
        return self.rope_theta if self.rope_local_theta is None else self.rope_local_theta

    def attention(self) -> AttentionSpec:
        own = self.sliding_window and (self.rope_scaling or self.local_theta != self.rope_theta)
        sliding_rope = Rotary(self.head_dim, "half", self.local_theta) if own else None
        return AttentionSpec(self.d_model, self.n_heads, self.kv_heads, self.head_dim, full_rotary(self),
                             qkv_bias=self.attention_bias, out_bias=self.attention_bias, qk_norm=self.layer_norm_eps,
                             qk_norm_across_heads=True, window=self.window, local_rotary=sliding_rope)

    def mlp(self) -> MLPSpec:
        return MLPSpec(self.d_model, self.ff_dim, "silu", gated=True, bias=False)

    @classmethod
    def from_hf_config(cls, hf: dict) -> "Olmo2Config":
        """(Missing keys: Olmo2Config's and Olmo3Config's defaults.)"""
        olmo3 = hf.get("model_type") == "olmo3"
        if olmo3:
            hf = {"sliding_window": 4096, **hf}
            hf["layer_types"] = hf.get("layer_types") or [SLIDING if (i + 1) % 4 else FULL
                                                          for i in range(hf["num_hidden_layers"])]
        rope, local_theta = _hf_ropes(hf, olmo3)
        theta = rope.get("rope_theta", hf.get("rope_theta", OLMO3_THETA if olmo3 else 10000.0))
        window, kinds = hf_sliding_window(hf) if olmo3 else (None, None)
        return cls(layers=hf["num_hidden_layers"], d_model=hf["hidden_size"], n_heads=hf["num_attention_heads"],
                   n_kv_heads=hf.get("num_key_value_heads"), d_head=hf.get("head_dim"), n_vocab=hf["vocab_size"],
                   seq=hf.get("max_position_embeddings", 2048), d_ff=hf["intermediate_size"], rope_theta=theta,
                   rope_scaling=hf_scaling(rope, hf), sliding_window=window, layer_types=kinds,
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
                "rope_parameters": {FULL: {"rope_type": "default", "rope_theta": self.rope_theta, **(self.rope_scaling or {})},
                                    SLIDING: {"rope_type": "default", "rope_theta": self.local_theta}}}


OLMO3_THETA = 500000.0  # Olmo3Config.default_theta


def _hf_ropes(hf: dict, olmo3: bool) -> tuple[dict, Optional[float]]:
    """(the rope keys of the full-attention layers, all layers' in OLMo 2; the sliding layers' base)
    as transformers reads them: OLMo 3's `rope_parameters` hold one dict per layer kind; where a
    config.json has the older flat keys, rope_theta and rope_scaling are the full layers' only, the
    sliding ones rotating at Olmo3Config's default base (as they do where their dict has no rope_theta)."""
    rope = hf_rope(hf, "OLMo 3" if olmo3 else "OLMo 2")
    if not olmo3:
        return rope, None
    if FULL not in rope and SLIDING not in rope:
        return rope, OLMO3_THETA
    full, sliding = dict(rope.get(FULL) or {}), dict(rope.get(SLIDING) or {})
    if hf_scaling(sliding, hf) is not None:
        raise ConfigError(f"config.json: OLMo 3's sliding-attention layers with rope scaling ({sliding}) are not "
                          "supported; only the full-attention layers' rope may be scaled")
    return full, sliding.get("rope_theta", OLMO3_THETA)


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
    if not c.tie_embeddings:
        table.append(hl.HFParam("lm_head.weight", (("head", "lm_head"),), hl.LINEAR))
    return table
