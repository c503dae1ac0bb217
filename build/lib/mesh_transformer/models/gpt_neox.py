"""GPT-NeoX / Pythia (Black et al. 2022): numerically `transformers.GPTNeoXForCausalLM`.

    parallel residual:   x = x + Attn(LN1(x)) + MLP(LN2(x))       (one all-reduce per layer)
    sequential residual: x = x + Attn(LN1(x));  x = x + MLP(LN2(x))

Rotary with rotate-half pairing on the first `rotary_pct` of each head's features; q, k and v come
from one fused, per-head interleaved `query_key_value` in HF (split here); biases everywhere;
exact-erf GELU by default; untied head without a bias.
"""
from __future__ import annotations

from dataclasses import dataclass

from mesh_transformer.config import ConfigError, ModelConfig, require
from mesh_transformer.models import hf_layout as hl
from mesh_transformer.models.core import StemSpec
from mesh_transformer.models.layers import ACTIVATIONS, MLP, Attention, AttentionSpec, MLPSpec, Rotary, norm, reduce_mp


@dataclass(frozen=True)
class GPTNeoXConfig(ModelConfig):
    family: str = "gpt_neox"
    rotary_pct: float = 0.25
    rope_theta: float = 10000.0
    parallel_residual: bool = True
    activation: str = "gelu"
    attention_bias: bool = True

    PE_CHOICES = ("rotary", "alibi", "none")

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.rotary_pct) if self.pe == "rotary" else 0

    def validate(self) -> None:
        super().validate()
        require(0 < self.rotary_pct <= 1, "rotary_pct", f"must be in (0, 1], got {self.rotary_pct}")
        require(self.pe != "rotary" or self.rotary_dims % 2 == 0 and self.rotary_dims > 0, "rotary_pct",
                f"gives {self.rotary_dims} rotary features of the {self.head_dim} in a head; it must be even and > 0")
        require(self.activation in ACTIVATIONS, "activation", f"must be one of {tuple(ACTIVATIONS)}, got {self.activation!r}")

    def attention(self) -> AttentionSpec:
        rotary = Rotary(self.rotary_dims, "half", self.rope_theta) if self.pe == "rotary" else None
        return AttentionSpec(self.d_model, self.n_heads, self.n_heads, self.head_dim, rotary, alibi=self.pe == "alibi",
                             qkv_bias=self.attention_bias, out_bias=self.attention_bias)

    def mlp(self) -> MLPSpec:
        return MLPSpec(self.d_model, self.ff_dim, self.activation)

    def stem(self) -> StemSpec:
        return StemSpec(final_norm="layernorm")

    @classmethod
    def from_hf_config(cls, hf: dict) -> "GPTNeoXConfig":
        rope = hf.get("rope_parameters") or {}
        kind = rope.get("rope_type", "default")
        if kind != "default" or hf.get("rope_scaling"):
            raise ConfigError(f"config.json: GPT-NeoX rope scaling {hf.get('rope_scaling') or kind!r} is not supported")
        return cls(layers=hf["num_hidden_layers"], d_model=hf["hidden_size"], n_heads=hf["num_attention_heads"],
                   n_vocab=hf["vocab_size"], seq=hf.get("max_position_embeddings", 2048), d_ff=hf["intermediate_size"],
                   rotary_pct=rope.get("partial_rotary_factor", hf.get("rotary_pct", 0.25)),
                   rope_theta=rope.get("rope_theta", hf.get("rotary_emb_base", 10000.0)),
                   parallel_residual=hf.get("use_parallel_residual", True), activation=hf.get("hidden_act", "gelu"),
                   attention_bias=hf.get("attention_bias", True), layer_norm_eps=hf.get("layer_norm_eps", 1e-5))

    def to_hf_config(self) -> dict:
        if self.pe != "rotary" or self.n_heads * self.head_dim != self.d_model:
            raise ConfigError("only pe='rotary' GPT-NeoX models with n_heads*d_head == d_model export to HF")
        return {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_size": self.d_model,
                "num_attention_heads": self.n_heads, "num_hidden_layers": self.layers,
                "intermediate_size": self.ff_dim, "vocab_size": self.n_vocab, "max_position_embeddings": self.seq,
                "rotary_pct": self.rotary_pct, "rotary_emb_base": self.rope_theta,
                "use_parallel_residual": self.parallel_residual, "hidden_act": self.activation,
                "attention_bias": self.attention_bias, "layer_norm_eps": self.layer_norm_eps,
                "tie_word_embeddings": False}


def block(c: GPTNeoXConfig, x, ctx, cache=None):
    """Parallel: x + Attn(LN1 x) + MLP(LN2 x), one all-reduce; sequential: two."""
    attn, cache = Attention(c.attention())(norm("layernorm", c.d_model, c.layer_norm_eps, "ln_1")(x), ctx, cache)
    if c.parallel_residual:
        return x + reduce_mp(attn, MLP(c.mlp())(norm("layernorm", c.d_model, c.layer_norm_eps, "ln_2")(x))), cache
    x = x + reduce_mp(attn)
    return x + reduce_mp(MLP(c.mlp())(norm("layernorm", c.d_model, c.layer_norm_eps, "ln_2")(x))), cache


def hf_table(c: GPTNeoXConfig) -> list[hl.HFParam]:
    layer = "gpt_neox.layers.{i}."
    qkv = (("layers/attn", "q_proj"), ("layers/attn", "k_proj"), ("layers/attn", "v_proj"))
    table = [
        hl.HFParam("gpt_neox.embed_in.weight", (("embed", "embeddings"),), hl.SAME),
        hl.HFParam(layer + "input_layernorm.weight", (("layers/ln_1", "scale"),), hl.SAME),
        hl.HFParam(layer + "input_layernorm.bias", (("layers/ln_1", "offset"),), hl.SAME),
        hl.HFParam(layer + "post_attention_layernorm.weight", (("layers/ln_2", "scale"),), hl.SAME),
        hl.HFParam(layer + "post_attention_layernorm.bias", (("layers/ln_2", "offset"),), hl.SAME),
        hl.HFParam(layer + "attention.query_key_value.weight", qkv, hl.fused_qkv(per_head=True, transposed=True)),
        hl.HFParam(layer + "attention.dense.weight", (("layers/attn", "out_proj"),), hl.heads_in()),
        hl.HFParam(layer + "mlp.dense_h_to_4h.weight", (("layers/mlp", "fc_in"),), hl.LINEAR),
        hl.HFParam(layer + "mlp.dense_h_to_4h.bias", (("layers/mlp", "fc_in_bias"),), hl.SAME),
        hl.HFParam(layer + "mlp.dense_4h_to_h.weight", (("layers/mlp", "fc_out"),), hl.LINEAR),
        hl.HFParam(layer + "mlp.dense_4h_to_h.bias", (("layers/mlp", "fc_out_bias"),), hl.SAME),
        hl.HFParam("gpt_neox.final_layer_norm.weight", (("ln_f", "scale"),), hl.SAME),
        hl.HFParam("gpt_neox.final_layer_norm.bias", (("ln_f", "offset"),), hl.SAME),
        hl.HFParam("embed_out.weight", (("head", "lm_head"),), hl.LINEAR),
    ]
    if c.attention_bias:
        table += [
            hl.HFParam(layer + "attention.query_key_value.bias",
                       tuple((m, leaf.replace("proj", "bias")) for m, leaf in qkv), hl.fused_qkv(True, True)),
            hl.HFParam(layer + "attention.dense.bias", (("layers/attn", "out_bias"),), hl.SAME),
        ]
    return table
