"""The model family a benchmark runs (`--family`), as our config and as its transformers twin.

Every family's benchmark shape is the same few numbers (layers, d_model, heads, vocabulary); what a
family adds is its own shape convention, chosen as the family's released models have it:

- gptj: rotary on a quarter of each head (as the 6B: 64 of 256 dims);
- llama: grouped-query attention with a quarter as many key/value heads as query heads (Llama 3),
  SwiGLU width 8/3 x d_model rounded up to a multiple of 256 (Llama's `multiple_of`), untied head;
- phi3: Phi-4's grouped-query attention (a quarter as many key/value heads) and SwiGLU width
  3.5 x d_model rounded up to a multiple of 256;
- gemma: Gemma 3's: half as many key/value heads, GeGLU width 4 x d_model, sandwich norms, q/k
  norms, five sliding layers (512 tokens, rope base 10k) to each full one (rope base 1M), the last
  layer full;
- gemma2: Gemma 2's: half as many key/value heads, GeGLU width 4 x d_model, sandwich norms,
  attention scores soft-capped at 50 and logits at 30, every other layer sliding over 4,096 tokens;
- mixtral: Mixtral's: a quarter as many key/value heads, 8 SwiGLU experts of width 3.5 x d_model,
  2 per token;
- gpt_oss: gpt-oss-20b's: an eighth as many key/value heads, 32 experts of width d_model (biases,
  clamped SwiGLU), 4 per token, attention sinks, a 128-token window in every other layer, YaRN;
- phi: Phi-1.5's: rotary on half of each head, MLP width 4 x d_model;
- starcoder2: StarCoder2's: a quarter as many key/value heads, MLP width 4 x d_model, biases,
  LayerNorms, tied head;
- gpt_neox, gpt2, opt: their defaults (ours mirror HF's).

`hf_model` builds the transformers model of a config through the library's own export mapping
(`io.hf.config_to_hf`), so both sides train or decode the same architecture, with dropout off.
"""
from __future__ import annotations

FAMILIES = ("gptj", "llama", "gpt_neox", "gpt2", "opt", "phi", "phi3", "starcoder2", "gemma", "gemma2",
            "mixtral", "gpt_oss")


def add_arg(parser, default: str = "gptj") -> None:
    parser.add_argument("--family", choices=FAMILIES, default=default,
                        help="model family (shape conventions: bench/families.py)")


def add_shape_args(parser, vocab: int) -> None:
    """--family and the benchmark model's shape: --layers, --d-model, --heads, --vocab."""
    add_arg(parser)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=vocab)


def family_keys(family: str, d_model: int, heads: int, layers: int) -> dict:
    """Config keys beyond layers/d_model/heads/vocab that make `family`'s usual shape (with the
    config's own "family" where a benchmark family is a variant of one: gemma2 is a gemma)."""
    d_head = d_model // heads
    if family == "gptj":
        return {"pe_rotary_dims": max(2, d_head // 4)}
    if family == "llama":
        return {"n_kv_heads": max(1, heads // 4), "d_ff": -(-8 * d_model // 3 // 256) * 256}
    if family == "phi":
        return {"rotary_pct": 0.5}
    if family == "starcoder2":
        return {"n_kv_heads": max(1, heads // 4)}
    if family == "phi3":
        return {"n_kv_heads": max(1, heads // 4), "d_ff": -(-7 * d_model // 2 // 256) * 256}
    if family == "gemma":
        return {"n_kv_heads": max(1, heads // 2), "d_ff": 4 * d_model, "sandwich_norms": True, "qk_norm": True,
                "query_pre_attn_scalar": d_head, "rope_theta": 1e6, "rope_local_theta": 1e4, "sliding_window": 512,
                "layer_types": ["sliding_attention" if (i + 1) % 6 and i != layers - 1 else "full_attention"
                                for i in range(layers)]}
    if family == "gemma2":
        return {"family": "gemma", "n_kv_heads": max(1, heads // 2), "d_ff": 4 * d_model, "sandwich_norms": True,
                "query_pre_attn_scalar": d_head, "attn_softcap": 50.0, "logit_softcap": 30.0, "sliding_window": 4096,
                "layer_types": ["full_attention" if i % 2 else "sliding_attention" for i in range(layers)]}
    if family == "mixtral":
        return {"n_kv_heads": max(1, heads // 4), "d_ff": 7 * d_model // 2, "n_experts": 8, "experts_per_token": 2}
    if family == "gpt_oss":
        return {"n_kv_heads": max(1, heads // 8), "d_ff": d_model, "n_experts": 32, "experts_per_token": 4,
                "sliding_window": 128, "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                                                       for i in range(layers)],
                "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 4096}}
    return {}


def hf_model(model_config, seed: int = 0):
    """The transformers (torch, fp32) model of our `model_config`, randomly initialised, dropout off."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from mesh_transformer.io.hf import config_to_hf

    hf = config_to_hf(model_config)
    hf.pop("torch_dtype", None)
    hf.pop("architectures", None)
    config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    for key, value in config.to_dict().items():  # every family's dropout knobs, whatever their names
        if key.endswith(("pdrop", "dropout")) and isinstance(value, float):
            setattr(config, key, 0.0)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
