"""Sparse mixture-of-experts transformers (Mixtral, Jiang et al. 2024; Qwen2-MoE, Qwen3-MoE): LLaMA's
block with its SwiGLU replaced by a router and `n_experts` SwiGLU experts, of which each token runs
the top `experts_per_token`: numerically `transformers.MixtralForCausalLM`, `Qwen2MoeForCausalLM`
and `Qwen3MoeForCausalLM`.

    x = x + Attn(RMSNorm1(x));  h = RMSNorm2(x)
    x = x + sum_k w_k SwiGLU_e(k)(h) [+ sigmoid(h g) SwiGLU_shared(h)]     # two all-reduces per layer

The router's softmax over all experts, its top k, renormalised over those k (Mixtral always;
Qwen2/3-MoE where `norm_topk_prob`). Qwen2-MoE adds a shared expert every token runs (width
`shared_expert_d_ff`), scaled by a sigmoid gate. Attention is LLaMA's: grouped-query, rotate-half
rotary with HF's `rope_scaling`, Qwen2's q/k/v biases, Qwen3's q/k norms, a sliding window in every
layer or in those `layer_types` marks. Each expert's width `d_ff` (Qwen's `moe_intermediate_size`)
splits over 'mp' as a dense MLP's does (`layers.MoE`), and so does the shared expert's; with
`expert_parallel` the experts split instead, n_experts / mp whole ones a shard. Every layer
is sparse: checkpoints with dense layers among them (`mlp_only_layers`, `decoder_sparse_step` > 1)
are not supported. Training adds `router_aux_loss_coef` x Switch Transformer's load-balancing loss over
every layer's tokens (`layers.RouterStats`), as transformers does with `output_router_logits`
(off by default, as there).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import haiku as hk
import jax
import jax.numpy as jnp

from mesh_transformer import parallel
from mesh_transformer.config import ConfigError, ModelConfig, require
from mesh_transformer.models import hf_layout as hl
from mesh_transformer.models.layers import (MLP, Attention, AttentionSpec, MLPSpec, MoE, MoESpec, RowParallel, dense,
                                            norm, normal, reduce_mp)
from mesh_transformer.models.llama import (FULL, SLIDING, LlamaShaped, full_rotary, hf_attention, hf_rope, hf_rope_keys,
                                           hf_sliding_window, validate_rope)

# HF's module names of the router and of expert e's gate / up / down projections, per model_type
HF_NAMES = {"mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts.{e}.", ("w1", "w3", "w2")),
            "qwen2_moe": ("mlp.gate", "mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj")),
            "qwen3_moe": ("mlp.gate", "mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj"))}
SHARED_GATE_AXIS = "shared_gate"  # the shared expert's gate's one output (replicated)


@dataclass(frozen=True)
class MixtralConfig(LlamaShaped, ModelConfig):
    family: str = "mixtral"
    n_experts: int = 8
    experts_per_token: int = 2
    norm_topk_prob: bool = True  # the chosen experts' weights renormalised to sum to 1 (Mixtral: always)
    router_aux_loss_coef: float = 0.0  # training: + coef x the load-balancing loss (HF: with output_router_logits)
    shared_expert_d_ff: Optional[int] = None  # Qwen2-MoE: a gated shared expert of this width every token runs
    expert_parallel: bool = False  # the experts split over mp whole (n_experts / mp each), not each expert's d_ff
    n_kv_heads: Optional[int] = None  # default n_heads (no grouping)
    rope_theta: float = 1e6
    rope_scaling: Optional[dict] = None  # HF's: {"rope_type": "linear" | "llama3" | "yarn", "factor": ..., ...}
    qkv_bias: bool = False  # Qwen2-MoE: biases on q/k/v_proj
    qk_norm: bool = False  # Qwen3-MoE: q_norm / k_norm over each head's head_dim, before rotary
    sliding_window: Optional[int] = None
    layer_types: Optional[list] = None
    tie_embeddings: bool = False
    layer_norm_eps: float = 1e-5  # RMSNorm's epsilon

    PE_CHOICES = ("rotary",)

    def validate(self) -> None:
        super().validate()
        self.validate_kv_heads_and_window()
        require(self.head_dim % 2 == 0, "d_head", f"rotary needs an even head size, got {self.head_dim}")
        validate_experts(self)
        require(self.shared_expert_d_ff is None or self.shared_expert_d_ff > 0, "shared_expert_d_ff",
                f"must be a positive width, got {self.shared_expert_d_ff!r}")
        validate_rope(self)

    def attention(self) -> AttentionSpec:
        return AttentionSpec(self.d_model, self.n_heads, self.kv_heads, self.head_dim, full_rotary(self), qkv_bias=self.qkv_bias,
                             qk_norm=self.layer_norm_eps if self.qk_norm else None, window=self.window)

    def moe(self) -> MoESpec:
        return MoESpec(self.d_model, self.ff_dim, self.n_experts, self.experts_per_token, self.norm_topk_prob)

    def shared_expert(self) -> Optional[MLPSpec]:
        return None if self.shared_expert_d_ff is None else MLPSpec(self.d_model, self.shared_expert_d_ff, "silu",
                                                                     gated=True, bias=False)

    @property
    def hf_model_type(self) -> str:
        """qwen2_moe with a shared expert or q/k/v biases, qwen3_moe with q/k norms or weights not
        renormalised (Mixtral always renormalises), else mixtral; a ConfigError where both Qwens'
        keys are set (no HF class has them all)."""
        qwen2 = self.shared_expert_d_ff is not None or self.qkv_bias
        if qwen2 and self.qk_norm:
            raise ConfigError("a mixture with a shared expert or q/k/v biases (Qwen2-MoE) and qk_norm (Qwen3-MoE) "
                              "has no HF class")
        return "qwen2_moe" if qwen2 else "qwen3_moe" if self.qk_norm or not self.norm_topk_prob else "mixtral"

    @classmethod
    def from_hf_config(cls, hf: dict) -> "MixtralConfig":
        kind = hf.get("model_type")
        hf = hl.as_transformers_reads_it(hf)
        rope = hf_rope(hf, {"mixtral": "Mixtral", "qwen2_moe": "Qwen2-MoE"}.get(kind, "Qwen3-MoE"))
        theta, scaling = hf_rope_keys(rope, hf, 1e6)
        qwen = kind in ("qwen2_moe", "qwen3_moe")
        if qwen and (hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1):
            raise ConfigError(f"config.json: {kind} with dense layers among the sparse ones (mlp_only_layers, "
                              "decoder_sparse_step > 1) is not supported: every layer must be sparse")
        window, kinds = hf_sliding_window(hf)
        return cls(layers=hf["num_hidden_layers"], d_model=hf["hidden_size"], n_heads=hf["num_attention_heads"],
                   n_kv_heads=hf.get("num_key_value_heads"), d_head=hf.get("head_dim"), n_vocab=hf["vocab_size"],
                   seq=hf["max_position_embeddings"], d_ff=hf["moe_intermediate_size" if qwen else "intermediate_size"],
                   n_experts=hf.get("num_local_experts") or hf["num_experts"],  # (Qwen3-MoE's file: num_experts)
                   experts_per_token=hf["num_experts_per_tok"], norm_topk_prob=hf["norm_topk_prob"] if qwen else True,
                   router_aux_loss_coef=hf["router_aux_loss_coef"] if hf.get("output_router_logits") else 0.0,
                   shared_expert_d_ff=hf.get("shared_expert_intermediate_size") if kind == "qwen2_moe" else None,
                   qkv_bias=kind == "qwen2_moe" and hf.get("qkv_bias", True),
                   rope_theta=theta, rope_scaling=scaling, qk_norm=kind == "qwen3_moe", sliding_window=window,
                   layer_types=kinds,
                   tie_embeddings=hf.get("tie_word_embeddings", False), layer_norm_eps=hf["rms_norm_eps"])

    def to_hf_config(self) -> dict:
        """MixtralForCausalLM, Qwen2MoeForCausalLM or Qwen3MoeForCausalLM, as `hf_model_type` picks."""
        kind = self.hf_model_type
        if kind == "mixtral" and self.windowed_layers():
            raise ConfigError("a Mixtral model with full and sliding layers (layer_types) has no HF class: "
                              "Mixtral slides in every layer (Qwen3-MoE, with qk_norm, has layer_types)")
        out = {"architectures": [{"mixtral": "Mixtral", "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe"}[kind]
                                 + "ForCausalLM"],
               "model_type": kind, "hidden_size": self.d_model, "num_attention_heads": self.n_heads,
               "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim, "num_hidden_layers": self.layers,
               "vocab_size": self.n_vocab, "max_position_embeddings": self.seq, "rope_theta": self.rope_theta,
               "rope_scaling": self.rope_scaling, "hidden_act": "silu", "rms_norm_eps": self.layer_norm_eps,
               "tie_word_embeddings": self.tie_embeddings, "num_experts_per_tok": self.experts_per_token,
               "output_router_logits": self.router_aux_loss_coef > 0, "router_aux_loss_coef": self.router_aux_loss_coef}
        if kind == "mixtral":
            return {**out, "intermediate_size": self.ff_dim, "num_local_experts": self.n_experts,
                    "sliding_window": self.window}
        kinds = self.windowed_layers() or (self.window is not None,) * self.layers
        out = {**out, "moe_intermediate_size": self.ff_dim, "intermediate_size": self.ff_dim,
               "num_experts": self.n_experts, "norm_topk_prob": self.norm_topk_prob, "decoder_sparse_step": 1,
               "mlp_only_layers": [], "use_sliding_window": self.window is not None, "sliding_window": self.window,
               "max_window_layers": 0, "layer_types": [SLIDING if on else FULL for on in kinds]}
        if kind == "qwen2_moe":
            if self.shared_expert_d_ff is None or not self.qkv_bias:
                raise ConfigError("a mixture exports as Qwen2-MoE only with both a shared expert (shared_expert_d_ff) "
                                  "and q/k/v biases (qkv_bias), as Qwen2MoeForCausalLM has them")
            return {**out, "shared_expert_intermediate_size": self.shared_expert_d_ff, "qkv_bias": True}
        return {**out, "attention_bias": False}


def validate_experts(c) -> None:
    """A mixture's keys: how many experts, how many run per token, the load-balancing loss's weight."""
    require(isinstance(c.n_experts, int) and c.n_experts > 0, "n_experts",
            f"must be a positive integer, got {c.n_experts!r}")
    require(isinstance(c.experts_per_token, int) and 0 < c.experts_per_token <= c.n_experts,
            "experts_per_token", f"must be in 1 .. n_experts={c.n_experts}, got {c.experts_per_token!r}")
    require(c.router_aux_loss_coef >= 0, "router_aux_loss_coef", f"must be >= 0, got {c.router_aux_loss_coef}")


def block(c: MixtralConfig, x, ctx, cache=None):
    """Pre-norm, sequential: x + Attn(RMSNorm(x)), then + MoE(RMSNorm(x)) [+ the gated shared expert]."""
    attn, cache = Attention(c.attention())(norm("rmsnorm", c.d_model, c.layer_norm_eps, "ln_1")(x), ctx, cache)
    x = x + reduce_mp(attn)
    h = norm("rmsnorm", c.d_model, c.layer_norm_eps, "ln_2")(x)
    experts = [MoE(c.moe())(h)]
    if c.shared_expert_d_ff is not None:
        experts.append(SharedExpert(c.shared_expert())(h))
    return x + reduce_mp(*experts), cache


class SharedExpert(hk.Module):
    """Qwen2-MoE's shared expert: sigmoid(h g) x SwiGLU(h), every token. Its partial sum over mp is
    scaled as it stands: the gate is the same on every shard."""

    def __init__(self, spec: MLPSpec, name: str = "shared_expert"):
        super().__init__(name=name)
        self.spec = spec

    def __call__(self, h) -> RowParallel:
        gate = parallel.weight("sigmoid_gate", (self.spec.d_model, 1), ("embed", SHARED_GATE_AXIS), 1,
                               normal(self.spec.init_std), h.dtype)
        scale = jax.nn.sigmoid(dense("btd,dg->btg", h, gate).astype(jnp.float32))
        out = MLP(self.spec, name="mlp")(h)
        return out._replace(partial=(out.partial * scale).astype(h.dtype))


def hf_table(c: MixtralConfig) -> list[hl.HFParam]:
    layer = "model.layers.{i}."
    router, expert, (gate, up, down) = HF_NAMES[c.hf_model_type]
    table = [
        hl.HFParam("model.embed_tokens.weight", (("embed", "embeddings"),), hl.SAME),
        hl.HFParam(layer + "input_layernorm.weight", (("layers/ln_1", "scale"),), hl.SAME),
        hl.HFParam(layer + "post_attention_layernorm.weight", (("layers/ln_2", "scale"),), hl.SAME),
        *hf_attention(layer, c.qkv_bias, c.qk_norm),
        hl.HFParam(layer + router + ".weight", (("layers/moe", "router"),), hl.LINEAR),
        # one HF tensor per expert ({e}): our [E, ...] leaf's slice e
        hl.HFParam(layer + expert + gate + ".weight", (("layers/moe", "experts_gate"),), hl.LINEAR),
        hl.HFParam(layer + expert + up + ".weight", (("layers/moe", "experts_in"),), hl.LINEAR),
        hl.HFParam(layer + expert + down + ".weight", (("layers/moe", "experts_out"),), hl.LINEAR),
        *([hl.HFParam(layer + "mlp.shared_expert_gate.weight", (("layers/shared_expert", "sigmoid_gate"),), hl.LINEAR),
           *[hl.HFParam(layer + f"mlp.shared_expert.{name}.weight", (("layers/shared_expert/mlp", ours),), hl.LINEAR)
             for name, ours in (("gate_proj", "gate"), ("up_proj", "fc_in"), ("down_proj", "fc_out"))]]
          if c.shared_expert_d_ff is not None else []),
        hl.HFParam("model.norm.weight", (("ln_f", "scale"),), hl.SAME),
    ]
    table += hl.untied_head(c.tie_embeddings)
    return table


def hf_experts(c: MixtralConfig) -> list[hl.HFExperts]:
    """The experts as transformers 5 holds them in memory, the same for the three classes (what
    PEFT's `target_parameters` adapt): gate_up_proj [E, 2F, D] (gate rows, then up's), down_proj
    [E, D, F]; in the order PEFT nests adapters on them (the module's parameter order)."""
    experts = "model.layers.{i}.mlp.experts."
    return [hl.HFExperts(experts + "gate_up_proj", (("layers/moe", "experts_gate"), ("layers/moe", "experts_in"))),
            hl.HFExperts(experts + "down_proj", (("layers/moe", "experts_out"),))]
