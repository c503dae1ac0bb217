"""GPT-OSS (OpenAI 2025, gpt-oss-20b and gpt-oss-120b): numerically `transformers.GptOssForCausalLM`.

    x = x + Attn(RMSNorm1(x));  x = x + sum_k w_k Expert_e(k)(RMSNorm2(x))     # two all-reduces per layer

Mixtral's block (`mixtral.block`) with three differences. Attention has biases on q/k/v/o and a
learned sink per head: one more score in each softmax that attends to nothing, so a head can
attend nowhere (`AttentionSpec.sinks`); layers alternate a 128-token sliding window and full
attention (`layer_types`), with YaRN rope over all of them. The router has a bias; its top k
logits' softmax weighs the chosen experts (the renormalised softmax over all of them, as
`MoESpec.normalize`). Each expert has biases and a clamped SwiGLU: gate capped at `swiglu_limit`, up
clipped to +-limit, gate sigmoid(`swiglu_alpha` gate) (up + 1) (`layers.clamped_swiglu`).

The HF layout holds each layer's experts stacked, inputs first, with gate and up interleaved
column by column (`gate_up_proj` [E, D, 2F]: gate, up, gate, up, ...); here they are the two
leaves Mixtral has, so int8 weights, the experts kernel and the splits over mp are Mixtral's.
The released checkpoints store the experts in MXFP4 (`io/mxfp4.py` dequantizes them on import).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from mesh_transformer.config import ModelConfig, require
from mesh_transformer.models import hf_layout as hl
from mesh_transformer.models.layers import AttentionSpec, MoESpec
from mesh_transformer.models.llama import (FULL, SLIDING, LlamaShaped, _positive, full_rotary, hf_attention, hf_rope,
                                           hf_rope_keys, hf_rope_parameters, hf_sliding_window, validate_rope)
from mesh_transformer.models.mixtral import block, validate_experts  # noqa: F401 (the family's block)


@dataclass(frozen=True)
class GptOssConfig(LlamaShaped, ModelConfig):
    family: str = "gpt_oss"
    n_experts: int = 32
    experts_per_token: int = 4
    router_aux_loss_coef: float = 0.0  # training: + coef x the load-balancing loss (HF: with output_router_logits)
    expert_parallel: bool = False  # the experts split over mp whole (n_experts / mp each), not each expert's d_ff
    n_kv_heads: Optional[int] = None  # default n_heads (no grouping)
    rope_theta: float = 150000.0
    rope_scaling: Optional[dict] = None  # HF's: {"rope_type": "yarn", "factor": 32.0, ...} in the released models
    attention_bias: bool = True  # biases on q/k/v/o_proj
    sliding_window: Optional[int] = None
    layer_types: Optional[list] = None  # the released models: sliding, full, sliding, full, ...
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    tie_embeddings: bool = False
    layer_norm_eps: float = 1e-5  # RMSNorm's epsilon

    PE_CHOICES = ("rotary",)
    shared_expert_d_ff = None  # (no shared expert: what `mixtral.block` asks)

    def validate(self) -> None:
        super().validate()
        self.validate_kv_heads_and_window()
        validate_experts(self)
        for key in ("swiglu_limit", "swiglu_alpha"):
            require(_positive(getattr(self, key)), key, f"must be a positive number, got {getattr(self, key)!r}")
        validate_rope(self)

    def attention(self) -> AttentionSpec:
        return AttentionSpec(self.d_model, self.n_heads, self.kv_heads, self.head_dim, full_rotary(self),
                             qkv_bias=self.attention_bias, out_bias=self.attention_bias, window=self.window, sinks=True)

    def moe(self) -> MoESpec:
        return MoESpec(self.d_model, self.ff_dim, self.n_experts, self.experts_per_token, normalize=True, bias=True,
                       glu_limit=float(self.swiglu_limit), glu_alpha=float(self.swiglu_alpha))

    @classmethod
    def from_hf_config(cls, hf: dict) -> "GptOssConfig":
        hf = hl.as_transformers_reads_it(hf)
        theta, scaling = hf_rope_keys(hf_rope(hf, "GPT-OSS"), hf, 150000.0)
        window, kinds = hf_sliding_window(hf)
        return cls(layers=hf["num_hidden_layers"], d_model=hf["hidden_size"], n_heads=hf["num_attention_heads"],
                   n_kv_heads=hf.get("num_key_value_heads"), d_head=hf.get("head_dim"), n_vocab=hf["vocab_size"],
                   seq=hf["max_position_embeddings"], d_ff=hf["intermediate_size"], n_experts=hf["num_local_experts"],
                   experts_per_token=hf["num_experts_per_tok"],
                   router_aux_loss_coef=hf["router_aux_loss_coef"] if hf.get("output_router_logits") else 0.0,
                   rope_theta=theta, rope_scaling=scaling, attention_bias=hf.get("attention_bias", True),
                   sliding_window=window, layer_types=kinds, swiglu_limit=hf["swiglu_limit"],
                   swiglu_alpha=hf["swiglu_alpha"], tie_embeddings=hf.get("tie_word_embeddings", False),
                   layer_norm_eps=hf["rms_norm_eps"])

    def to_hf_config(self) -> dict:
        kinds = self.windowed_layers() or (self.window is not None,) * self.layers
        return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": self.d_model,
                "num_attention_heads": self.n_heads, "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
                "num_hidden_layers": self.layers, "vocab_size": self.n_vocab, "max_position_embeddings": self.seq,
                "intermediate_size": self.ff_dim, "num_local_experts": self.n_experts,
                "num_experts_per_tok": self.experts_per_token, "hidden_act": "silu",
                "rope_parameters": hf_rope_parameters(self.rope_theta, self.rope_scaling),
                "rms_norm_eps": self.layer_norm_eps, "attention_bias": self.attention_bias,
                # (transformers builds the sliding mask whatever layer_types say: a window must be there)
                "sliding_window": self.sliding_window or self.seq,
                "layer_types": [SLIDING if on else FULL for on in kinds],
                "swiglu_limit": self.swiglu_limit, "swiglu_alpha": self.swiglu_alpha,
                "tie_word_embeddings": self.tie_embeddings, "output_router_logits": self.router_aux_loss_coef > 0,
                "router_aux_loss_coef": self.router_aux_loss_coef}


def _interleaved_halves() -> hl.Transform:
    """HF's gate_up_proj [E, D, 2F] (or its bias [E, 2F]), gate and up interleaved column by column,
    <-> our experts_gate and experts_in [E, D, F] (biases [E, F])."""
    return hl.Transform(lambda x, c: (x[..., 0::2], x[..., 1::2]),
                        lambda xs, c: np.stack(xs, axis=-1).reshape(*xs[0].shape[:-1], -1))


def hf_table(c: GptOssConfig) -> list[hl.HFParam]:
    layer = "model.layers.{i}."
    experts = layer + "mlp.experts."
    table = [
        hl.HFParam("model.embed_tokens.weight", (("embed", "embeddings"),), hl.SAME),
        hl.HFParam(layer + "input_layernorm.weight", (("layers/ln_1", "scale"),), hl.SAME),
        hl.HFParam(layer + "post_attention_layernorm.weight", (("layers/ln_2", "scale"),), hl.SAME),
        *hf_attention(layer, c.attention_bias),
        hl.HFParam(layer + "self_attn.sinks", (("layers/attn", "sinks"),), hl.SAME),
        hl.HFParam(layer + "mlp.router.weight", (("layers/moe", "router"),), hl.LINEAR),
        hl.HFParam(layer + "mlp.router.bias", (("layers/moe", "router_bias"),), hl.SAME),
        hl.HFParam(experts + "gate_up_proj", (("layers/moe", "experts_gate"), ("layers/moe", "experts_in")),
                   _interleaved_halves()),
        hl.HFParam(experts + "gate_up_proj_bias", (("layers/moe", "experts_gate_bias"), ("layers/moe", "experts_in_bias")),
                   _interleaved_halves()),
        hl.HFParam(experts + "down_proj", (("layers/moe", "experts_out"),), hl.SAME),
        hl.HFParam(experts + "down_proj_bias", (("layers/moe", "experts_out_bias"),), hl.SAME),
        hl.HFParam("model.norm.weight", (("ln_f", "scale"),), hl.SAME),
    ]
    if c.attention_bias:
        table.append(hl.HFParam(layer + "self_attn.o_proj.bias", (("layers/attn", "out_bias"),), hl.SAME))
    table += hl.untied_head(c.tie_embeddings)
    return table


def hf_experts(c: GptOssConfig) -> list[hl.HFExperts]:
    """The experts as transformers holds them (PEFT's `target_parameters`): gate_up_proj [E, D, 2F],
    gate and up interleaved; down_proj [E, F, D]."""
    experts = "model.layers.{i}.mlp.experts."
    return [hl.HFExperts(experts + "gate_up_proj", (("layers/moe", "experts_gate"), ("layers/moe", "experts_in")),
                         interleaved=True),
            hl.HFExperts(experts + "down_proj", (("layers/moe", "experts_out"),))]
