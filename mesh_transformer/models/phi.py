"""Phi-1, Phi-1.5 and Phi-2 (Gunasekar et al. 2023, Li et al. 2023): numerically `transformers.PhiForCausalLM`.

    h = LN(x);  x = x + Attn(h) + MLP(h)        # GPT-J's parallel residual: one all-reduce per layer

GPT-J's block (`gptj.block`) with the attention of GPT-NeoX: biases on q/k/v and the output
projection (HF's `dense`), rotate-half rotary on the first `rotary_pct` of each head's features
(HF's partial_rotary_factor: 0.5 for Phi-1/1.5, 0.4 for Phi-2), optionally grouped kv heads; the
MLP fc1 -> tanh-GELU -> fc2 with biases; a final LayerNorm, and an untied head with a bias.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mesh_transformer.config import ConfigError, ModelConfig, require
from mesh_transformer.models import hf_layout as hl
from mesh_transformer.models.core import StemSpec
from mesh_transformer.models.gptj import block  # noqa: F401 - the family's block is GPT-J's
from mesh_transformer.models.layers import ACTIVATIONS, AttentionSpec, MLPSpec
from mesh_transformer.models.llama import full_rotary, hf_rope_dict, hf_rope_keys, hf_rope_parameters, validate_rope


@dataclass(frozen=True)
class PhiConfig(ModelConfig):
    family: str = "phi"
    n_kv_heads: Optional[int] = None  # default n_heads (no grouping; every released Phi-1/1.5/2)
    rotary_pct: float = 0.5  # rotary on this share of each head's features
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # HF's: {"rope_type": "linear" | "llama3" | "yarn", "factor": ..., ...}
    activation: str = "gelu_new"

    PE_CHOICES = ("rotary",)
    norm = "layernorm"  # (what `gptj.block` reads: not a key)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.rotary_pct)

    def validate(self) -> None:
        super().validate()
        require(self.kv_heads > 0 and self.n_heads % self.kv_heads == 0, "n_kv_heads",
                f"{self.kv_heads} must be positive and divide n_heads={self.n_heads}")
        require(0 < self.rotary_pct <= 1, "rotary_pct", f"must be in (0, 1], got {self.rotary_pct}")
        require(self.rotary_dims % 2 == 0 and self.rotary_dims > 0, "rotary_pct",
                f"gives {self.rotary_dims} rotary features of the {self.head_dim} in a head; it must be even and > 0")
        require(self.activation in ACTIVATIONS, "activation", f"must be one of {tuple(ACTIVATIONS)}, got {self.activation!r}")
        validate_rope(self, self.rotary_dims)

    def attention(self) -> AttentionSpec:
        return AttentionSpec(self.d_model, self.n_heads, self.kv_heads, self.head_dim,
                             full_rotary(self, self.rotary_dims), qkv_bias=True, out_bias=True)

    def mlp(self) -> MLPSpec:
        return MLPSpec(self.d_model, self.ff_dim, self.activation)

    def stem(self) -> StemSpec:
        return StemSpec(final_norm="layernorm", head_bias=True)

    @classmethod
    def from_hf_config(cls, hf: dict) -> "PhiConfig":
        if hf.get("qk_layernorm"):
            raise ConfigError("config.json: Phi with qk_layernorm=true is not supported (no released Phi-1/1.5/2 uses it)")
        if hf.get("tie_word_embeddings"):
            raise ConfigError("config.json: Phi with tie_word_embeddings=true is not supported "
                              "(its head has a bias of its own; no released Phi-1/1.5/2 ties it)")
        rope = hf_rope_dict(hf)
        theta, scaling = hf_rope_keys(rope, hf, 10000.0)
        pct = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))
        n_heads = hf["num_attention_heads"]
        return cls(layers=hf["num_hidden_layers"], d_model=hf["hidden_size"], n_heads=n_heads,
                   n_kv_heads=hf.get("num_key_value_heads") or n_heads, d_head=hf.get("head_dim"), n_vocab=hf["vocab_size"],
                   seq=hf.get("max_position_embeddings", 2048), d_ff=hf["intermediate_size"], rotary_pct=pct,
                   rope_theta=theta, rope_scaling=scaling, activation=hf.get("hidden_act", "gelu_new"),
                   layer_norm_eps=hf.get("layer_norm_eps", 1e-5))

    def to_hf_config(self) -> dict:
        rope = hf_rope_parameters(self.rope_theta, self.rope_scaling, partial_rotary_factor=self.rotary_pct)
        return {"architectures": ["PhiForCausalLM"], "model_type": "phi", "hidden_size": self.d_model,
                "num_attention_heads": self.n_heads, "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
                "num_hidden_layers": self.layers, "intermediate_size": self.ff_dim, "vocab_size": self.n_vocab,
                "max_position_embeddings": self.seq, "rope_parameters": rope, "hidden_act": self.activation,
                "layer_norm_eps": self.layer_norm_eps, "qk_layernorm": False, "tie_word_embeddings": False,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0}


def hf_table(c: PhiConfig) -> list[hl.HFParam]:
    layer = "model.layers.{i}."
    attn = layer + "self_attn."
    return [
        hl.HFParam("model.embed_tokens.weight", (("embed", "embeddings"),), hl.SAME),
        hl.HFParam(layer + "input_layernorm.weight", (("layers/ln_1", "scale"),), hl.SAME),
        hl.HFParam(layer + "input_layernorm.bias", (("layers/ln_1", "offset"),), hl.SAME),
        *(hl.HFParam(attn + f"{p}_proj.weight", (("layers/attn", f"{p}_proj"),), hl.heads_out(kv=p != "q")) for p in "qkv"),
        *(hl.HFParam(attn + f"{p}_proj.bias", (("layers/attn", f"{p}_bias"),), hl.head_bias(kv=p != "q")) for p in "qkv"),
        hl.HFParam(attn + "dense.weight", (("layers/attn", "out_proj"),), hl.heads_in()),
        hl.HFParam(attn + "dense.bias", (("layers/attn", "out_bias"),), hl.SAME),
        hl.HFParam(layer + "mlp.fc1.weight", (("layers/mlp", "fc_in"),), hl.LINEAR),
        hl.HFParam(layer + "mlp.fc1.bias", (("layers/mlp", "fc_in_bias"),), hl.SAME),
        hl.HFParam(layer + "mlp.fc2.weight", (("layers/mlp", "fc_out"),), hl.LINEAR),
        hl.HFParam(layer + "mlp.fc2.bias", (("layers/mlp", "fc_out_bias"),), hl.SAME),
        hl.HFParam("model.final_layernorm.weight", (("ln_f", "scale"),), hl.SAME),
        hl.HFParam("model.final_layernorm.bias", (("ln_f", "offset"),), hl.SAME),
        hl.LM_HEAD,
        hl.HFParam("lm_head.bias", (("head", "lm_head_bias"),), hl.SAME),
    ]
