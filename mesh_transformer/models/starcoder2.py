"""StarCoder2 (Lozhkov et al. 2024): numerically `transformers.Starcoder2ForCausalLM`.

    x = x + Attn(LN1(x));  x = x + MLP(LN2(x))        # LLaMA's block (`llama.block`), with LayerNorms

Mistral's attention — grouped kv heads, rotate-half rotary over each whole head, a sliding window
(4,096 tokens in the released 3B/7B/15B) — with biases on q/k/v/o (`use_bias`); a plain MLP
c_fc -> tanh-GELU -> c_proj with biases; LayerNorms with biases; a head tied to the embeddings.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mesh_transformer.config import ModelConfig, require
from mesh_transformer.models import hf_layout as hl
from mesh_transformer.models.core import StemSpec
from mesh_transformer.models.layers import ACTIVATIONS, AttentionSpec, MLPSpec
from mesh_transformer.models.llama import (LlamaShaped, full_rotary, hf_attention, hf_rope_dict, hf_rope_keys, hf_rope_parameters,
                                           validate_rope)
from mesh_transformer.models.llama import block  # noqa: F401 - the family's block is LLaMA's


@dataclass(frozen=True)
class Starcoder2Config(LlamaShaped, ModelConfig):
    family: str = "starcoder2"
    n_kv_heads: Optional[int] = None  # default n_heads (no grouping)
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # HF's: {"rope_type": "linear" | "llama3" | "yarn", "factor": ..., ...}
    sliding_window: Optional[int] = None  # each token attends to the last sliding_window, itself included
    use_bias: bool = True  # biases on q/k/v/o_proj, c_fc and c_proj
    activation: str = "gelu_pytorch_tanh"
    tie_embeddings: bool = True
    layer_norm_eps: float = 1e-5  # every LayerNorm's epsilon

    PE_CHOICES = ("rotary",)
    block_norm = "layernorm"

    def validate(self) -> None:
        super().validate()
        self.validate_kv_heads_and_window()
        validate_rope(self)
        require(self.activation in ACTIVATIONS, "activation", f"must be one of {tuple(ACTIVATIONS)}, got {self.activation!r}")

    def attention(self) -> AttentionSpec:
        return AttentionSpec(self.d_model, self.n_heads, self.kv_heads, self.head_dim, full_rotary(self),
                             qkv_bias=self.use_bias, out_bias=self.use_bias, window=self.window)

    def mlp(self) -> MLPSpec:
        return MLPSpec(self.d_model, self.ff_dim, self.activation, bias=self.use_bias)

    def stem(self) -> StemSpec:
        return StemSpec(final_norm="layernorm", tied=self.tie_embeddings)

    @classmethod
    def from_hf_config(cls, hf: dict) -> "Starcoder2Config":
        theta, scaling = hf_rope_keys(hf_rope_dict(hf), hf, 10000.0)
        return cls(layers=hf["num_hidden_layers"], d_model=hf["hidden_size"], n_heads=hf["num_attention_heads"],
                   n_kv_heads=hf.get("num_key_value_heads"), d_head=hf.get("head_dim"), n_vocab=hf["vocab_size"],
                   seq=hf.get("max_position_embeddings", 4096), d_ff=hf["intermediate_size"],
                   rope_theta=theta, rope_scaling=scaling,
                   sliding_window=hf.get("sliding_window"), use_bias=hf.get("use_bias", True),
                   activation=hf.get("hidden_act", "gelu_pytorch_tanh"),
                   tie_embeddings=hf.get("tie_word_embeddings", True), layer_norm_eps=hf.get("norm_epsilon", 1e-5))

    def to_hf_config(self) -> dict:
        return {"architectures": ["Starcoder2ForCausalLM"], "model_type": "starcoder2", "hidden_size": self.d_model,
                "head_dim": self.head_dim, "num_attention_heads": self.n_heads, "num_key_value_heads": self.kv_heads,
                "num_hidden_layers": self.layers, "intermediate_size": self.ff_dim, "vocab_size": self.n_vocab,
                "max_position_embeddings": self.seq, "sliding_window": self.window,
                "rope_parameters": hf_rope_parameters(self.rope_theta, self.rope_scaling),
                "use_bias": self.use_bias, "hidden_act": self.activation, "norm_epsilon": self.layer_norm_eps,
                "tie_word_embeddings": self.tie_embeddings, "residual_dropout": 0.0, "embedding_dropout": 0.0,
                "attention_dropout": 0.0}


def hf_table(c: Starcoder2Config) -> list[hl.HFParam]:
    layer = "model.layers.{i}."
    table = [
        hl.HFParam("model.embed_tokens.weight", (("embed", "embeddings"),), hl.SAME),
        *(hl.HFParam(layer + f"{hf}.{p}", ((f"layers/{ours}", leaf),), hl.SAME)
          for hf, ours in (("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_2"))
          for p, leaf in (("weight", "scale"), ("bias", "offset"))),
        *hf_attention(layer, c.use_bias),
        hl.HFParam(layer + "mlp.c_fc.weight", (("layers/mlp", "fc_in"),), hl.LINEAR),
        hl.HFParam(layer + "mlp.c_proj.weight", (("layers/mlp", "fc_out"),), hl.LINEAR),
        hl.HFParam("model.norm.weight", (("ln_f", "scale"),), hl.SAME),
        hl.HFParam("model.norm.bias", (("ln_f", "offset"),), hl.SAME),
    ]
    if c.use_bias:
        table += [hl.HFParam(layer + "self_attn.o_proj.bias", (("layers/attn", "out_bias"),), hl.SAME),
                  hl.HFParam(layer + "mlp.c_fc.bias", (("layers/mlp", "fc_in_bias"),), hl.SAME),
                  hl.HFParam(layer + "mlp.c_proj.bias", (("layers/mlp", "fc_out_bias"),), hl.SAME)]
    table += hl.untied_head(c.tie_embeddings)
    return table
