"""OPT (Zhang et al. 2022): numerically `transformers.OPTForCausalLM`.

    pre-norm:  x = x + Attn(LN1(x));  x = x + MLP(LN2(x))
    post-norm: x = LN1(x + Attn(x));  x = LN2(x + MLP(x))        (opt-350m)

Learned positions stored after 2 extra rows (HF's offset), ReLU, biases everywhere, tied
embeddings; when `word_embed_proj_dim` differs from d_model the embedding table is that wide and
projected in (`project_in`) and out (`project_out`) of the residual stream.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mesh_transformer.config import ConfigError, ModelConfig, require
from mesh_transformer.models import hf_layout as hl
from mesh_transformer.models.core import StemSpec
from mesh_transformer.models.layers import ACTIVATIONS, MLP, Attention, AttentionSpec, MLPSpec, norm, reduce_mp

POSITION_OFFSET = 2


@dataclass(frozen=True)
class OPTConfig(ModelConfig):
    family: str = "opt"
    pe: str = "fixed"
    pre_norm: bool = True  # HF's do_layer_norm_before
    word_embed_proj_dim: Optional[int] = None  # default d_model
    activation: str = "relu"

    PE_CHOICES = ("fixed", "alibi", "none")

    @property
    def embed_proj(self) -> Optional[int]:
        """The embedding width when it is not d_model (then projected in and out)."""
        w = self.word_embed_proj_dim
        return w if w is not None and w != self.d_model else None

    def validate(self) -> None:
        super().validate()
        require(self.activation in ACTIVATIONS, "activation", f"must be one of {tuple(ACTIVATIONS)}, got {self.activation!r}")
        require(self.word_embed_proj_dim is None or self.word_embed_proj_dim > 0, "word_embed_proj_dim", "must be positive")

    def attention(self) -> AttentionSpec:
        return AttentionSpec(self.d_model, self.n_heads, self.n_heads, self.head_dim, None, alibi=self.pe == "alibi",
                             qkv_bias=True, out_bias=True)

    def mlp(self) -> MLPSpec:
        return MLPSpec(self.d_model, self.ff_dim, self.activation)

    def stem(self) -> StemSpec:
        return StemSpec(final_norm="layernorm" if self.pre_norm else None, tied=True,
                        position_offset=POSITION_OFFSET, embed_proj=self.embed_proj)

    @classmethod
    def from_hf_config(cls, hf: dict) -> "OPTConfig":
        for key, want in (("enable_bias", True), ("layer_norm_elementwise_affine", True), ("_remove_final_layer_norm", False)):
            if hf.get(key, want) != want:
                raise ConfigError(f"config.json: OPT option {key}={hf.get(key)} is not supported")
        if not hf.get("tie_word_embeddings", True):
            raise ConfigError("config.json: OPT with untied embeddings is not supported")
        return cls(layers=hf["num_hidden_layers"], d_model=hf["hidden_size"], n_heads=hf["num_attention_heads"],
                   n_vocab=hf["vocab_size"], seq=hf.get("max_position_embeddings", 2048), d_ff=hf["ffn_dim"],
                   pre_norm=hf.get("do_layer_norm_before", True), word_embed_proj_dim=hf.get("word_embed_proj_dim"),
                   activation=hf.get("activation_function", "relu"))

    def to_hf_config(self) -> dict:
        if self.pe != "fixed" or self.n_heads * self.head_dim != self.d_model or self.layer_norm_eps != 1e-5:
            raise ConfigError("only pe='fixed' OPT models with n_heads*d_head == d_model and layer_norm_eps 1e-5 "
                              "export to HF")
        return {"architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": self.d_model,
                "num_attention_heads": self.n_heads, "num_hidden_layers": self.layers, "ffn_dim": self.ff_dim,
                "vocab_size": self.n_vocab, "max_position_embeddings": self.seq, "do_layer_norm_before": self.pre_norm,
                "word_embed_proj_dim": self.word_embed_proj_dim or self.d_model,
                "activation_function": self.activation, "tie_word_embeddings": True}


def block(c: OPTConfig, x, ctx, cache=None):
    """Sequential, pre- or post-norm."""
    ln_1 = norm("layernorm", c.d_model, c.layer_norm_eps, "ln_1")
    attn, cache = Attention(c.attention())(ln_1(x) if c.pre_norm else x, ctx, cache)
    x = x + reduce_mp(attn)
    x = x if c.pre_norm else ln_1(x)
    ln_2 = norm("layernorm", c.d_model, c.layer_norm_eps, "ln_2")
    x = x + reduce_mp(MLP(c.mlp())(ln_2(x) if c.pre_norm else x))
    return (x if c.pre_norm else ln_2(x)), cache


def hf_table(c: OPTConfig) -> list[hl.HFParam]:
    root, layer = "model.decoder.", "model.decoder.layers.{i}."
    table = [
        hl.HFParam(root + "embed_tokens.weight", (("embed", "embeddings"),), hl.SAME),
        *([hl.HFParam(root + "embed_positions.weight", (("embed", "pos_embeddings"),), hl.SAME)] if c.pe == "fixed" else []),
        *([hl.HFParam(root + "project_in.weight", (("", "project_in"),), hl.LINEAR)] if c.embed_proj else []),
        *(hl.HFParam(layer + f"self_attn.{p}_proj.weight", (("layers/attn", f"{p}_proj"),), hl.heads_out()) for p in "qkv"),
        *(hl.HFParam(layer + f"self_attn.{p}_proj.bias", (("layers/attn", f"{p}_bias"),), hl.head_bias()) for p in "qkv"),
        hl.HFParam(layer + "self_attn.out_proj.weight", (("layers/attn", "out_proj"),), hl.heads_in()),
        hl.HFParam(layer + "self_attn.out_proj.bias", (("layers/attn", "out_bias"),), hl.SAME),
        hl.HFParam(layer + "self_attn_layer_norm.weight", (("layers/ln_1", "scale"),), hl.SAME),
        hl.HFParam(layer + "self_attn_layer_norm.bias", (("layers/ln_1", "offset"),), hl.SAME),
        hl.HFParam(layer + "fc1.weight", (("layers/mlp", "fc_in"),), hl.LINEAR),
        hl.HFParam(layer + "fc1.bias", (("layers/mlp", "fc_in_bias"),), hl.SAME),
        hl.HFParam(layer + "fc2.weight", (("layers/mlp", "fc_out"),), hl.LINEAR),
        hl.HFParam(layer + "fc2.bias", (("layers/mlp", "fc_out_bias"),), hl.SAME),
        hl.HFParam(layer + "final_layer_norm.weight", (("layers/ln_2", "scale"),), hl.SAME),
        hl.HFParam(layer + "final_layer_norm.bias", (("layers/ln_2", "offset"),), hl.SAME),
    ]
    if c.pre_norm:
        table += [hl.HFParam(root + "final_layer_norm.weight", (("ln_f", "scale"),), hl.SAME),
                  hl.HFParam(root + "final_layer_norm.bias", (("ln_f", "offset"),), hl.SAME)]
    if c.embed_proj:
        table.append(hl.HFParam(root + "project_out.weight", (("", "project_out"),), hl.LINEAR))
    return table
