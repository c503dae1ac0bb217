"""Phi-3 and Phi-4 (Abdin et al. 2024): LLaMA's block (`llama.block`: pre-RMSNorm, SwiGLU,
grouped-query attention, rotate-half rotary), held in HF checkpoints the Phi way — q/k/v as one
`qkv_proj`, SwiGLU's gate and up as one `gate_up_proj` — with rotary on `rotary_pct` of each head
(HF's partial_rotary_factor) and Phi-3-mini-4k's sliding window: numerically
`transformers.Phi3ForCausalLM`. The long-context models' "longrope" scaling (Phi-3-*-128k,
Phi-3.5, Phi-4-mini) is not supported; Phi-3-mini-4k, Phi-3-medium-4k and Phi-4 use plain rope.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mesh_transformer.config import ConfigError, ModelConfig, require
from mesh_transformer.models import hf_layout as hl
from mesh_transformer.models.layers import AttentionSpec, MLPSpec, Rotary
from mesh_transformer.models.llama import LlamaShaped, hf_rope, hf_rope_parameters, hf_sliding_window
from mesh_transformer.models.llama import block  # noqa: F401 - the family's block is LLaMA's


@dataclass(frozen=True)
class Phi3Config(LlamaShaped, ModelConfig):
    family: str = "phi3"
    n_kv_heads: Optional[int] = None  # default n_heads (no grouping)
    rope_theta: float = 10000.0
    rotary_pct: float = 1.0  # rotary on this share of each head's dimensions
    sliding_window: Optional[int] = None  # each token attends to the last sliding_window, itself included
    tie_embeddings: bool = False
    layer_norm_eps: float = 1e-5  # RMSNorm's epsilon

    PE_CHOICES = ("rotary", "alibi", "none")

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.rotary_pct)

    def validate(self) -> None:
        super().validate()
        self.validate_kv_heads_and_window()
        require(0 < self.rotary_pct <= 1, "rotary_pct", f"must be in (0, 1], got {self.rotary_pct}")
        require(self.pe != "rotary" or self.rotary_dims % 2 == 0 and self.rotary_dims > 0, "rotary_pct",
                f"gives {self.rotary_dims} rotary features of the {self.head_dim} in a head; it must be even and > 0")

    def attention(self) -> AttentionSpec:
        rotary = Rotary(self.rotary_dims, "half", self.rope_theta) if self.pe == "rotary" else None
        return AttentionSpec(self.d_model, self.n_heads, self.kv_heads, self.head_dim, rotary, alibi=self.pe == "alibi",
                             window=self.window)

    def mlp(self) -> MLPSpec:
        return MLPSpec(self.d_model, self.ff_dim, "silu", gated=True, bias=False)

    @classmethod
    def from_hf_config(cls, hf: dict) -> "Phi3Config":
        rope = hf_rope(hf, "Phi-3")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ConfigError(f"config.json: Phi-3 rope_type {kind!r} is not supported (only plain rope: "
                              "Phi-3-mini-4k, Phi-3-medium-4k, Phi-4)")
        window, kinds = hf_sliding_window(hf)
        if kinds:
            raise ConfigError("config.json: Phi-3 with sliding and full layers (layer_types) is not supported")
        seq = hf.get("max_position_embeddings", 4096)
        return cls(layers=hf["num_hidden_layers"], d_model=hf["hidden_size"], n_heads=hf["num_attention_heads"],
                   n_kv_heads=hf.get("num_key_value_heads"), d_head=hf.get("head_dim"), n_vocab=hf["vocab_size"],
                   seq=seq, sliding_window=window, d_ff=hf["intermediate_size"],
                   rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
                   rotary_pct=rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)),
                   tie_embeddings=hf.get("tie_word_embeddings", False), layer_norm_eps=hf.get("rms_norm_eps", 1e-5))

    def to_hf_config(self) -> dict:
        if self.pe != "rotary":
            raise ConfigError("only pe='rotary' Phi-3 models export to HF")
        return {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": self.d_model,
                "num_attention_heads": self.n_heads, "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
                "num_hidden_layers": self.layers, "intermediate_size": self.ff_dim, "vocab_size": self.n_vocab,
                "max_position_embeddings": self.seq, "original_max_position_embeddings": self.seq,
                "rope_parameters": hf_rope_parameters(self.rope_theta, partial_rotary_factor=self.rotary_pct),
                "sliding_window": self.window, "hidden_act": "silu", "rms_norm_eps": self.layer_norm_eps,
                "tie_word_embeddings": self.tie_embeddings,
                "pad_token_id": None}  # HF's default (32000) would be an embedding row torch never trains


def hf_table(c: Phi3Config) -> list[hl.HFParam]:
    layer = "model.layers.{i}."
    qkv = (("layers/attn", "q_proj"), ("layers/attn", "k_proj"), ("layers/attn", "v_proj"))
    table = [
        hl.HFParam("model.embed_tokens.weight", (("embed", "embeddings"),), hl.SAME),
        hl.HFParam(layer + "input_layernorm.weight", (("layers/ln_1", "scale"),), hl.SAME),
        hl.HFParam(layer + "self_attn.qkv_proj.weight", qkv, hl.stacked_qkv()),
        hl.HFParam(layer + "self_attn.o_proj.weight", (("layers/attn", "out_proj"),), hl.heads_in()),
        hl.HFParam(layer + "post_attention_layernorm.weight", (("layers/ln_2", "scale"),), hl.SAME),
        hl.HFParam(layer + "mlp.gate_up_proj.weight", (("layers/mlp", "gate"), ("layers/mlp", "fc_in")),
                   hl.stacked_linear(2)),
        hl.HFParam(layer + "mlp.down_proj.weight", (("layers/mlp", "fc_out"),), hl.LINEAR),
        hl.HFParam("model.norm.weight", (("ln_f", "scale"),), hl.SAME),
    ]
    table += hl.untied_head(c.tie_embeddings)
    return table
