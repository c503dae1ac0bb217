"""GPT-J (Wang & Komatsuzaki 2021): numerically `transformers.GPTJForCausalLM`; the default family.

    h = LN(x);  x = x + Attn(h) + MLP(h)        # parallel residual: one all-reduce per layer

Rotary on the first `pe_rotary_dims` features of each head with interleaved pairing, no biases on
q/k/v/out; MLP fc_in -> tanh-GELU -> fc_out with biases; untied head with a bias. The original's
options stay: `norm` (layernorm | rmsnorm) and `pe` (rotary | fixed | none | alibi).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from mesh_transformer.config import ConfigError, ModelConfig, require
from mesh_transformer.models import hf_layout as hl
from mesh_transformer.models.core import StemSpec
from mesh_transformer.models.layers import MLP, Attention, AttentionSpec, MLPSpec, Rotary, norm, reduce_mp

NORMS = ("layernorm", "rmsnorm")


@dataclass(frozen=True)
class GPTJConfig(ModelConfig):
    family: str = "gptj"
    norm: str = "layernorm"
    pe_rotary_dims: Optional[int] = None  # default: the whole head

    @property
    def rotary_dims(self) -> int:
        if self.pe != "rotary":
            return 0
        return self.pe_rotary_dims if self.pe_rotary_dims is not None else self.head_dim

    def validate(self) -> None:
        super().validate()
        require(self.norm in NORMS, "norm", f"must be one of {NORMS}, got {self.norm!r}")
        if self.pe_rotary_dims is not None:
            require(self.pe_rotary_dims <= self.head_dim, "pe_rotary_dims",
                     f"{self.pe_rotary_dims} is larger than the head size d_model/n_heads={self.head_dim}")
            require(self.pe_rotary_dims > 0 and self.pe_rotary_dims % 2 == 0, "pe_rotary_dims",
                     f"must be a positive even number, got {self.pe_rotary_dims}")

    def architecture(self) -> dict:
        return {**super().architecture(), "pe_rotary_dims": self.rotary_dims}

    def attention(self) -> AttentionSpec:
        rotary = Rotary(self.rotary_dims, "interleaved") if self.pe == "rotary" else None
        return AttentionSpec(self.d_model, self.n_heads, self.n_heads, self.head_dim, rotary, alibi=self.pe == "alibi",
                             out_std=0.02 / math.sqrt(2 * self.layers))

    def mlp(self) -> MLPSpec:
        return MLPSpec(self.d_model, self.ff_dim, "gelu_new", out_std=0.02 / math.sqrt(2 * self.layers))

    def stem(self) -> StemSpec:
        return StemSpec(final_norm=self.norm, head_bias=True)

    @classmethod
    def from_hf_config(cls, hf: dict) -> "GPTJConfig":
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ConfigError(f"config.json: activation_function {act!r} is not supported (GPT-J uses 'gelu_new')")
        d, n = hf["n_embd"], hf["n_head"]
        return cls(layers=hf["n_layer"], d_model=d, n_heads=n, n_vocab=hf["vocab_size"], seq=hf.get("n_positions", 2048),
                   d_ff=hf.get("n_inner") or 4 * d, pe="rotary", pe_rotary_dims=hf.get("rotary_dim") or d // n,
                   layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5))

    def to_hf_config(self) -> dict:
        if self.pe != "rotary" or self.norm != "layernorm" or self.n_heads * self.head_dim != self.d_model:
            raise ConfigError("only GPT-J models (pe='rotary', norm='layernorm', n_heads*d_head == d_model) "
                              "can be exported to HF GPTJForCausalLM")
        return {"architectures": ["GPTJForCausalLM"], "model_type": "gptj", "activation_function": "gelu_new",
                "n_embd": self.d_model, "n_head": self.n_heads, "n_layer": self.layers, "n_inner": self.ff_dim,
                "n_positions": self.seq, "rotary_dim": self.rotary_dims, "vocab_size": self.n_vocab,
                "layer_norm_epsilon": self.layer_norm_eps, "tie_word_embeddings": False,
                "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0}


def block(c: GPTJConfig, x, ctx, cache=None):
    """x [B, T, D] -> x + Attn(LN(x)) + MLP(LN(x)), with one all-reduce over mp."""
    h = norm(c.norm, c.d_model, c.layer_norm_eps, "ln_1")(x)
    attn, cache = Attention(c.attention())(h, ctx, cache)
    return x + reduce_mp(attn, MLP(c.mlp())(h)), cache


def hf_table(c: GPTJConfig) -> list[hl.HFParam]:
    layer = "transformer.h.{i}."
    return [
        hl.HFParam("transformer.wte.weight", (("embed", "embeddings"),), hl.SAME),
        hl.HFParam(layer + "ln_1.weight", (("layers/ln_1", "scale"),), hl.SAME),
        hl.HFParam(layer + "ln_1.bias", (("layers/ln_1", "offset"),), hl.SAME),
        *(hl.HFParam(layer + f"attn.{p}.weight", (("layers/attn", p),), hl.heads_out()) for p in ("q_proj", "k_proj", "v_proj")),
        hl.HFParam(layer + "attn.out_proj.weight", (("layers/attn", "out_proj"),), hl.heads_in()),
        hl.HFParam(layer + "mlp.fc_in.weight", (("layers/mlp", "fc_in"),), hl.LINEAR),
        hl.HFParam(layer + "mlp.fc_in.bias", (("layers/mlp", "fc_in_bias"),), hl.SAME),
        hl.HFParam(layer + "mlp.fc_out.weight", (("layers/mlp", "fc_out"),), hl.LINEAR),
        hl.HFParam(layer + "mlp.fc_out.bias", (("layers/mlp", "fc_out_bias"),), hl.SAME),
        hl.HFParam("transformer.ln_f.weight", (("ln_f", "scale"),), hl.SAME),
        hl.HFParam("transformer.ln_f.bias", (("ln_f", "offset"),), hl.SAME),
        hl.LM_HEAD,
        hl.HFParam("lm_head.bias", (("head", "lm_head_bias"),), hl.SAME),
    ]
