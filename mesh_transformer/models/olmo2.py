"""OLMo 2 (Team OLMo et al. 2024, "2 OLMo 2 Furious"): numerically `transformers.Olmo2ForCausalLM`.

    x = x + RMSNorm1(Attn(x));  x = x + RMSNorm2(SwiGLU(x))    # each sublayer's output normed, then added

LLaMA's grouped-query attention (rotate-half rotary, `rope_scaling`) and SwiGLU otherwise; the
queries and keys are RMS-normed across all heads before rotary — q_norm over the q projection's
whole output (n_heads * head_dim features), k_norm over k's (n_kv_heads * head_dim): under mp the
sums of squares of the heads each shard holds are added over 'mp' (`layers.norm_across_heads`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mesh_transformer.config import ModelConfig, require
from mesh_transformer.models import hf_layout as hl
from mesh_transformer.models.layers import MLP, Attention, AttentionSpec, MLPSpec, norm, reduce_mp
from mesh_transformer.models.llama import LlamaShaped, full_rotary, hf_attention, hf_rope, validate_rope


@dataclass(frozen=True)
class Olmo2Config(LlamaShaped, ModelConfig):
    family: str = "olmo2"
    n_kv_heads: Optional[int] = None  # default n_heads (no grouping)
    rope_theta: float = 10000.0  # (HF's Olmo2Config defaults; the released models set 500000)
    rope_scaling: Optional[dict] = None  # HF's: {"rope_type": "linear" | "llama3", "factor": ..., ...}
    attention_bias: bool = False  # biases on q/k/v_proj and o_proj
    tie_embeddings: bool = False
    layer_norm_eps: float = 1e-5  # every RMSNorm's epsilon
    sliding_window: Optional[int] = None  # (LlamaShaped's key; OLMo 2 attends to the whole context)

    PE_CHOICES = ("rotary",)

    def validate(self) -> None:
        super().validate()
        self.validate_kv_heads_and_window()
        require(self.sliding_window is None, "sliding_window", "OLMo 2 has no sliding window")
        validate_rope(self)

    def attention(self) -> AttentionSpec:
        return AttentionSpec(self.d_model, self.n_heads, self.kv_heads, self.head_dim, full_rotary(self),
                             qkv_bias=self.attention_bias, out_bias=self.attention_bias, qk_norm=self.layer_norm_eps,
                             qk_norm_across_heads=True)

    def mlp(self) -> MLPSpec:
        return MLPSpec(self.d_model, self.ff_dim, "silu", gated=True, bias=False)

    @classmethod
    def from_hf_config(cls, hf: dict) -> "Olmo2Config":
        rope = hf_rope(hf, "OLMo 2")
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))  # (missing keys: Olmo2Config's defaults)
        scaling = None if rope.get("rope_type", rope.get("type", "default")) == "default" else rope
        return cls(layers=hf["num_hidden_layers"], d_model=hf["hidden_size"], n_heads=hf["num_attention_heads"],
                   n_kv_heads=hf.get("num_key_value_heads"), d_head=hf.get("head_dim"), n_vocab=hf["vocab_size"],
                   seq=hf.get("max_position_embeddings", 2048), d_ff=hf["intermediate_size"], rope_theta=theta,
                   rope_scaling=scaling, attention_bias=hf.get("attention_bias", False),
                   tie_embeddings=hf.get("tie_word_embeddings", False), layer_norm_eps=hf.get("rms_norm_eps", 1e-5))

    def to_hf_config(self) -> dict:
        return {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "hidden_size": self.d_model,
                "head_dim": self.head_dim, "num_attention_heads": self.n_heads, "num_key_value_heads": self.kv_heads,
                "num_hidden_layers": self.layers, "intermediate_size": self.ff_dim, "vocab_size": self.n_vocab,
                "max_position_embeddings": self.seq, "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
                "attention_bias": self.attention_bias, "hidden_act": "silu", "rms_norm_eps": self.layer_norm_eps,
                "tie_word_embeddings": self.tie_embeddings}


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
