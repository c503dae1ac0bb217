"""The parity tests would catch the bugs a user would otherwise report: each mutation below patches
one detail of the model in memory, and the same check `test_families.test_logits_match_hf` makes
(`helpers.parity_error` < PARITY_TOL) must then fail — by far, not by luck."""
from __future__ import annotations

import importlib

import pytest

from mesh_transformer.io import hf
from mesh_transformer.models import FAMILIES
from mesh_transformer.models import core, layers, mixtral
from tests.helpers import PARITY_TOL, make_hf_model, parity_error

_rotated, _project, _reduce = layers._rotated, layers.Attention._project, layers.reduce_mp
_within_window = layers.within_window
_rotary_call, _ln_init, _rms_init = layers.Rotary.__call__, layers.LayerNorm.__init__, layers.RMSNorm.__init__
_rotary_of_layer, _softcap = layers.Attention._rotary_of_layer, layers.softcap
_moe_call = layers.MoE.__call__
_mixtral_dense = mixtral.dense


def erf_gelu(mp):
    mp.setitem(layers.ACTIVATIONS, "gelu_new", layers.ACTIVATIONS["gelu"])


def other_rotary_pairing(mp):
    mp.setattr(layers, "_rotated", lambda x, pairing: _rotated(x, "half" if pairing == "interleaved" else "interleaved"))


def rotary_on_half_the_dims(mp):
    mp.setattr(layers.Rotary, "__call__",
               lambda self, x, pos, inv_freq=None, magnitude=None: _rotary_call(self._replace(dims=self.dims // 2), x, pos))


def q_and_k_swapped(mp):
    swap = {"q": "k", "k": "q"}
    mp.setattr(layers.Attention, "_project", lambda self, h, which, *a, **k: _project(self, h, swap.get(which, which), *a, **k))


def row_parallel_bias_dropped(mp):
    for family in FAMILIES:  # each family's block calls reduce_mp by its own name (phi3 runs llama's block)
        module = importlib.import_module(f"mesh_transformer.models.{family}")
        if hasattr(module, "reduce_mp"):
            mp.setattr(module, "reduce_mp", lambda *outs: _reduce(*(o._replace(bias=None) for o in outs)))


def norm_epsilon_times_10(mp):
    mp.setattr(layers.LayerNorm, "__init__", lambda self, d, eps, name: _ln_init(self, d, eps * 10, name))
    mp.setattr(layers.RMSNorm, "__init__", lambda self, d, eps, name, **kw: _rms_init(self, d, eps * 10, name, **kw))


def window_one_wider(mp):
    mp.setattr(layers, "within_window", lambda ctx, window: _within_window(ctx, window + 1))


def every_layer_windowed(mp):  # Gemma's full-attention layers slide too
    mp.setattr(layers, "within_window", lambda ctx, window: _within_window(ctx._replace(windowed=True), window))


def one_rope_for_every_layer(mp):  # Gemma 3's sliding layers keep the full layers' rope base
    mp.setattr(layers.Attention, "_rotary_of_layer", lambda self, windowed: _rotary_of_layer(self, False))


def rotary_magnitude_ignored(mp):  # YaRN's attention factor left at 1
    mp.setattr(layers.Rotary, "magnitude", lambda self: 1.0)


def scores_not_soft_capped(mp):  # Gemma 2's attention scores (its logits stay capped)
    mp.setattr(layers, "softcap", lambda x, cap: x)
    mp.setattr(core, "softcap", _softcap)


def norm_scale_without_unit_offset(mp):
    mp.setattr(layers.RMSNorm, "__init__", lambda self, d, eps, name, **kw: _rms_init(
        self, d, eps, name, **{**kw, "unit_offset": False}))


def qk_norms_skipped(mp):
    mp.setattr(layers, "norm_heads", lambda q, k, *args: (q, k))


def residual_multiplier_ignored(mp):  # Granite's blocks join the stream unscaled
    mp.setattr(importlib.import_module("mesh_transformer.models.llama"), "residual", lambda c, y: y)


def qk_normed_per_head(mp):  # OLMo 2's q/k norms taken over each head's features, not all heads' at once
    import jax
    import jax.numpy as jnp

    from mesh_transformer import parallel

    class PerHead(layers.HeadsRMSNorm):  # (a subclass: Haiku names the methods of module classes)
        def __call__(self, x, query_heads_here):
            scale = parallel.param("scale", (self.heads, x.shape[3]), (self.axis, "head_dim"), layers.ONES)
            y = x.astype(jnp.float32)
            return (y * jax.lax.rsqrt(jnp.mean(y * y, -1, keepdims=True) + self.eps) * scale).astype(x.dtype)
    mp.setattr(layers, "HeadsRMSNorm", PerHead)


def _moe_spec_changed(mp, change):
    def call(self, h):
        self.spec = change(self.spec)
        return _moe_call(self, h)
    mp.setattr(layers.MoE, "__call__", call)


def expert_weights_renormalised_the_other_way(mp):  # Mixtral's not renormalised, Qwen3-MoE's renormalised
    _moe_spec_changed(mp, lambda spec: spec._replace(normalize=not spec.normalize))


def one_expert_fewer_per_token(mp):
    _moe_spec_changed(mp, lambda spec: spec._replace(top_k=spec.top_k - 1))


def shared_expert_ungated(mp):  # Qwen2-MoE's shared expert added whole, its sigmoid gate at 1
    def dense(equation, x, w, dtype=None):
        y = _mixtral_dense(equation, x, w, dtype)
        return y.at[:].set(1e4) if equation == "btd,dg->btg" else y
    mp.setattr(mixtral, "dense", dense)


MUTATIONS = [  # (mutation, the family case it must break)
    (erf_gelu, "gptj"), (erf_gelu, "gpt2"),
    (other_rotary_pairing, "gptj"), (other_rotary_pairing, "llama_gqa2_llama3_rope"),
    (rotary_on_half_the_dims, "gptj"), (rotary_on_half_the_dims, "gpt_neox_sequential"),
    (q_and_k_swapped, "gptj"), (q_and_k_swapped, "opt_projected"),
    (row_parallel_bias_dropped, "gptj"), (row_parallel_bias_dropped, "gpt2"),
    (norm_epsilon_times_10, "gptj"), (norm_epsilon_times_10, "llama_gqa2_llama3_rope"),
    (qk_norms_skipped, "qwen3_tied"), (window_one_wider, "mistral_window"),
    (qk_norms_skipped, "gemma3_local_rope"), (every_layer_windowed, "gemma2_softcap_window"),
    (one_rope_for_every_layer, "gemma3_local_rope"), (scores_not_soft_capped, "gemma2_softcap_window"),
    (norm_scale_without_unit_offset, "gemma_mqa"), (residual_multiplier_ignored, "granite_tied_bias"),
    (qk_normed_per_head, "olmo2_gqa"),
    (other_rotary_pairing, "phi_gqa_yarn"), (row_parallel_bias_dropped, "phi_gqa_yarn"),
    (rotary_magnitude_ignored, "qwen2"), (rotary_magnitude_ignored, "phi_gqa_yarn"),
    (one_rope_for_every_layer, "olmo3_window_yarn"), (window_one_wider, "olmo3_window_yarn"),
    (window_one_wider, "starcoder2_window"), (row_parallel_bias_dropped, "starcoder2_window"),
    (expert_weights_renormalised_the_other_way, "mixtral_window"),
    (expert_weights_renormalised_the_other_way, "qwen3_moe_tied"), (one_expert_fewer_per_token, "mixtral_window"),
    (qk_norms_skipped, "qwen3_moe_tied"), (shared_expert_ungated, "qwen2_moe_shared"),
]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            path = tmp_path_factory.mktemp(name)
            torch_model = make_hf_model(path, name)
            config, params = hf.load_hf(path, compute_dtype="float32", remat="none")
            assert parity_error(config, params, torch_model) < PARITY_TOL  # unpatched: passes
            made[name] = (config, params, torch_model)
        return made[name]
    return get


@pytest.mark.parametrize("mutate, case", MUTATIONS, ids=[f"{m.__name__}-{c}" for m, c in MUTATIONS])
def test_parity_check_fails_on_mutation(cases, mutate, case, monkeypatch):
    config, params, torch_model = cases(case)
    with monkeypatch.context() as mp:
        mutate(mp)
        error = parity_error(config, params, torch_model)
    assert error > 10 * PARITY_TOL, f"{mutate.__name__} on {case} changed the logits by only {error:.2e}"
