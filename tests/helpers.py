"""Small builders shared by the tests (tiny configs, meshes, random HF GPT-J checkpoints)."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from mesh_transformer import parallel
from mesh_transformer.config import Config, ModelConfig, TrainConfig, config_from_dict

TINY = dict(layers=3, d_model=64, n_heads=8, n_vocab=250, seq=16, d_ff=128, pe_rotary_dims=4,
            compute_dtype="float32", remat="full", lr=1e-3, warmup_steps=0, anneal_steps=10, total_steps=10)


def tiny_config(**overrides) -> Config:
    return config_from_dict({**TINY, **overrides})


def config_for(model: ModelConfig, **train) -> Config:
    return Config(model, TrainConfig(**train))


def mesh(dp: int, mp: int):
    return parallel.make_mesh(mp, dp, jax.devices()[: dp * mp])


def random_tokens(shape, vocab, seed=0):
    return np.random.RandomState(seed).randint(0, vocab, shape).astype(np.int32)


def make_hf_gptj(path, seed=0, **kwargs):
    """Save a random tiny `GPTJForCausalLM` to `path`; return the (eval-mode, fp32) torch model."""
    import torch
    from transformers import GPTJConfig, GPTJForCausalLM

    defaults = dict(vocab_size=101, n_positions=64, n_embd=32, n_layer=3, n_head=4, rotary_dim=4,
                    bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    model = GPTJForCausalLM(GPTJConfig(**{**defaults, **kwargs})).eval()
    with torch.no_grad():  # HF initialises biases and LayerNorms to 0/1; perturb them so parity covers them
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def hf_logits(model, tokens) -> np.ndarray:
    import torch
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def max_abs_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


replace = dataclasses.replace
