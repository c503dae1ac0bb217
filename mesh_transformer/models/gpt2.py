"""GPT-2 (Radford et al. 2019): numerically `transformers.GPT2LMHeadModel`.

    x = x + Attn(LN1(x));  x = x + MLP(LN2(x))        # sequential: two all-reduces per layer

Learned absolute positions, tanh-GELU, biases everywhere, tied embeddings. HF stores weights in
Conv1D's [in, out] layout and q|k|v fused in one `c_attn` (split here).
"""
from __future__ import annotations

from dataclasses import dataclass

from mesh_transformer.config import ConfigError, ModelConfig, require
from mesh_transformer.models import hf_layout as hl
from mesh_transformer.models.core import StemSpec
from mesh_transformer.models.layers import ACTIVATIONS, MLP, Attention, AttentionSpec, MLPSpec, norm, reduce_mp


@dataclass(frozen=True)
class GPT2Config(ModelConfig):
    family: str = "gpt2"
    pe: str = "fixed"
    activation: str = "gelu_new"
    tie_embeddings: bool = True

    PE_CHOICES = ("fixed", "alibi", "none")

    def validate(self) -> None:
        super().validate()
        require(self.activation in ACTIVATIONS, "activation", f"must be one of {tuple(ACTIVATIONS)}, got {self.activation!r}")

    def attention(self) -> AttentionSpec:
        return AttentionSpec(self.d_model, self.n_heads, self.n_heads, self.head_dim, None, alibi=self.pe == "alibi",
                             qkv_bias=True, out_bias=True)

    def mlp(self) -> MLPSpec:
        return MLPSpec(self.d_model, self.ff_dim, self.activation)

    def stem(self) -> StemSpec:
        return StemSpec(final_norm="layernorm", tied=self.tie_embeddings)

    @classmethod
    def from_hf_config(cls, hf: dict) -> "GPT2Config":
        for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if hf.get(key):
                raise ConfigError(f"config.json: GPT-2 option {key} is not supported")
        if not hf.get("scale_attn_weights", True):
            raise ConfigError("config.json: GPT-2 without scale_attn_weights is not supported")
        d = hf["n_embd"]
        return cls(layers=hf["n_layer"], d_model=d, n_heads=hf["n_head"], n_vocab=hf["vocab_size"],
                   seq=hf.get("n_positions", 1024), d_ff=hf.get("n_inner") or 4 * d,
                   activation=hf.get("activation_function", "gelu_new"), tie_embeddings=hf.get("tie_word_embeddings", True),
                   layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5))

    def to_hf_config(self) -> dict:
        if self.pe != "fixed" or self.n_heads * self.head_dim != self.d_model:
            raise ConfigError("only pe='fixed' GPT-2 models with n_heads*d_head == d_model export to HF")
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": self.d_model,
                "n_head": self.n_heads, "n_layer": self.layers, "n_inner": self.ff_dim, "n_positions": self.seq,
                "vocab_size": self.n_vocab, "activation_function": self.activation,
                "layer_norm_epsilon": self.layer_norm_eps, "tie_word_embeddings": self.tie_embeddings}


def block(c: GPT2Config, x, ctx, cache=None):
    """Pre-norm, sequential: x + Attn(LN1 x), then + MLP(LN2 x)."""
    attn, cache = Attention(c.attention())(norm("layernorm", c.d_model, c.layer_norm_eps, "ln_1")(x), ctx, cache)
    x = x + reduce_mp(attn)
    return x + reduce_mp(MLP(c.mlp())(norm("layernorm", c.d_model, c.layer_norm_eps, "ln_2")(x))), cache


def hf_table(c: GPT2Config) -> list[hl.HFParam]:
    layer = "transformer.h.{i}."
    qkv = (("layers/attn", "q_proj"), ("layers/attn", "k_proj"), ("layers/attn", "v_proj"))
    table = [
        hl.HFParam("transformer.wte.weight", (("embed", "embeddings"),), hl.SAME),
        *([hl.HFParam("transformer.wpe.weight", (("embed", "pos_embeddings"),), hl.SAME)] if c.pe == "fixed" else []),
        hl.HFParam(layer + "ln_1.weight", (("layers/ln_1", "scale"),), hl.SAME),
        hl.HFParam(layer + "ln_1.bias", (("layers/ln_1", "offset"),), hl.SAME),
        hl.HFParam(layer + "attn.c_attn.weight", qkv, hl.fused_qkv(per_head=False, transposed=False)),
        hl.HFParam(layer + "attn.c_attn.bias", tuple((m, leaf.replace("proj", "bias")) for m, leaf in qkv),
                   hl.fused_qkv(per_head=False, transposed=False)),
        hl.HFParam(layer + "attn.c_proj.weight", (("layers/attn", "out_proj"),), hl.heads_in(transposed=False)),
        hl.HFParam(layer + "attn.c_proj.bias", (("layers/attn", "out_bias"),), hl.SAME),
        hl.HFParam(layer + "ln_2.weight", (("layers/ln_2", "scale"),), hl.SAME),
        hl.HFParam(layer + "ln_2.bias", (("layers/ln_2", "offset"),), hl.SAME),
        hl.HFParam(layer + "mlp.c_fc.weight", (("layers/mlp", "fc_in"),), hl.SAME),
        hl.HFParam(layer + "mlp.c_fc.bias", (("layers/mlp", "fc_in_bias"),), hl.SAME),
        hl.HFParam(layer + "mlp.c_proj.weight", (("layers/mlp", "fc_out"),), hl.SAME),
        hl.HFParam(layer + "mlp.c_proj.bias", (("layers/mlp", "fc_out_bias"),), hl.SAME),
        hl.HFParam("transformer.ln_f.weight", (("ln_f", "scale"),), hl.SAME),
        hl.HFParam("transformer.ln_f.bias", (("ln_f", "offset"),), hl.SAME),
    ]
    table += hl.untied_head(c.tie_embeddings)
    return table
