"""LoRA (with PEFT as the oracle), bf16 Adam moments, forgetful causal masking, packed segments."""
import dataclasses
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from helpers import (TINY, hf_logits, max_abs_diff, mesh, random_tokens, rounded_like_int8, tiny_config,
                     word_tokenizer)
from mesh_transformer import lora, parallel
from mesh_transformer.config import ConfigError, config_from_dict
from mesh_transformer.data import Dataset, segment_ids
from mesh_transformer.train.loop import RunOptions, TrainRun
from mesh_transformer.train.step import Trainer, fcm_keep

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

HF = dict(vocab_size=101, n_positions=64, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, bos_token_id=0,
          eos_token_id=0)
RANK, TARGETS = 4, ["q_proj", "v_proj", "fc_out"]


def gptj_config(model_dir, **train):
    return config_from_dict({"layers": 2, "d_model": 32, "n_heads": 4, "n_vocab": 101, "seq": 16, "pe_rotary_dims": 4,
                             "compute_dtype": "float32", "remat": "none", "lr": 1e-2, "end_lr": 1e-2, "warmup_steps": 0,
                             "anneal_steps": 10, "total_steps": 4, "per_replica_batch": 2, "model_dir": str(model_dir),
                             "train_set": "unused", "weight_decay": 0.1,
                             "lora": {"rank": RANK, "alpha": 8, "dropout": 0.0, "targets": TARGETS}, **train})


def make_hf(path, cls="GPTJ", seed=0, **kw):
    import transformers
    torch.manual_seed(seed)
    config = getattr(transformers, f"{cls}Config")(**kw)
    model = getattr(transformers, f"{cls}ForCausalLM" if cls != "GPT2" else "GPT2LMHeadModel")(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def run_training(config, hf_dir=None, stop_after=None, tune_model_path=None):
    run = TrainRun.__new__(TrainRun)  # TrainRun without opening config.train_set: an in-memory dataset
    run.config, run.options = config, RunOptions(hf=hf_dir and str(hf_dir), tensorboard=False, stop_after=stop_after,
                                                 tune_model_path=tune_model_path,
                                                 log_dir=str(config.train.model_dir) + "-logs")
    from mesh_transformer.train.loop import TrainHost
    run.host = TrainHost(config, run.options)
    run.trainer, run.ckpt, run.tokens_per_step = run.host.trainer, run.host.ckpt, run.host.tokens_per_step
    rows = random_tokens((32, 17), 101, seed=3)
    run.dataset, run.val_sets, run._interrupted = Dataset.from_arrays(rows, eos_id=100), {}, False
    run.tokenizer = "gpt2"
    state = run.train()
    return run, state


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A LoRA fine-tune (4 steps) of a random tiny HF GPT-J, through TrainRun with --hf."""
    root = tmp_path_factory.mktemp("lora")
    base = make_hf(root / "base", **HF)
    config = gptj_config(root / "run")
    run, state = run_training(config, root / "base")
    return dict(root=root, base=base, config=config, run=run, state=state)


def test_config_errors_name_the_key():
    cases = [({"targets": ["q_prj"]}, "lora.targets"), ({"rank": 0}, "lora.rank"), ({"rank": 100}, "lora.rank"),
             ({"use_rslora": "yes"}, "lora.use_rslora"),
             ({"ranks": 4}, "lora.ranks"), ({"dropout": 1.5}, "lora.dropout"), ({"targets": "all"}, "lora.targets")]
    for raw, key in cases:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            tiny_config(lora=raw)
    with pytest.raises(ConfigError, match="fcm_max_ratio"):
        tiny_config(fcm_max_ratio=1.0)
    mixture = {**{k: v for k, v in TINY.items() if k != "pe_rotary_dims"}, "family": "mixtral", "n_experts": 4,
               "experts_per_token": 2}
    with pytest.raises(ConfigError, match=r"lora\.dropout.*experts\.down_proj.*PEFT"):
        config_from_dict({**mixture, "lora": {"targets": ["q_proj", "experts.down_proj"], "dropout": 0.1}})
    with pytest.raises(ConfigError, match=r"lora\.targets.*'gate_up_proj'.*its experts: experts\.gate_up_proj, "
                                          r"experts\.down_proj"):
        config_from_dict({**mixture, "lora": {"targets": ["gate_up_proj"]}})
    with pytest.raises(ConfigError, match=r"lora\.rank.*experts\.gate_up_proj"):
        config_from_dict({**mixture, "d_ff": 6, "lora": {"targets": ["experts.gate_up_proj"], "rank": 8}})


def test_only_adapters_train_and_hold_optimizer_state(trained):
    tr, state = trained["run"].trainer, trained["state"]
    d, f, layers = 32, 128, 2
    adapter_params = layers * (2 * RANK * (d + d) + RANK * (f + d))  # q, v: [D, r] + [r, N*H]; fc_out [F, r] + [r, D]
    assert sum(x.size for x in jax.tree.leaves(state.params)) == adapter_params
    assert parallel.bytes_of(state.opt_state) == 2 * 4 * adapter_params + 4  # mu, nu in fp32 + the step count
    assert all(parallel.is_adapter(n) for v in state.params.values() for n in v)
    assert not any(parallel.is_adapter(n) for v in tr.base.values() for n in v)
    b = state.params["gptj/layers/attn"]["q_proj_lora_b"]
    assert float(jnp.abs(b).max()) > 0  # B starts at 0: the adapters did train


def test_merged_export_keeps_untargeted_weights_and_peft_export_matches(trained):
    from mesh_transformer.io import hf
    root = trained["root"]
    hf.checkpoint_to_hf(str(root / "run"), str(root / "merged"), dtype="fp32")
    import subprocess
    import sys
    script = str(Path(__file__).resolve().parents[1] / "to_hf_weights.py")
    cli = subprocess.run([sys.executable, script, "--input-ckpt", str(root / "run"), "--output-path",
                          str(root / "adapter"), "--peft"], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr[-2000:]
    base, merged = load_file(str(root / "base" / "model.safetensors")), load_file(str(root / "merged" / "model.safetensors"))
    changed = {k for k in base if not np.array_equal(base[k], merged[k])}
    assert changed == {f"transformer.h.{i}.{m}.weight" for i in range(2)
                       for m in ("attn.q_proj", "attn.v_proj", "mlp.fc_out")}  # norms, biases, k, head: bit-equal
    cfg = json.loads((root / "adapter" / lora.ADAPTER_CONFIG).read_text())
    assert cfg["base_model_name_or_path"] == str((root / "base").resolve()) and cfg["r"] == RANK

    import transformers
    tokens = random_tokens((8, 16), 101, seed=7)
    merged_model = transformers.AutoModelForCausalLM.from_pretrained(root / "merged").eval()
    fresh_base = transformers.AutoModelForCausalLM.from_pretrained(root / "base").eval()
    peft_model = peft.PeftModel.from_pretrained(fresh_base, str(root / "adapter")).eval()
    expected = hf_logits(merged_model, tokens)
    np.testing.assert_allclose(hf_logits(peft_model, tokens), expected, atol=1e-4)
    ours = trained["run"].trainer.logits(trained["state"].params, jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(ours), expected, atol=1e-4)


@pytest.mark.parametrize("change", [{"alpha": 16}, {"use_rslora": True}])
def test_resuming_at_another_lora_scale_is_refused(trained, change):
    """The adapters trained at alpha / r: resuming the run with another alpha or with rsLoRA (the same
    rank, so the shapes fit) is one error naming both scales, before anything is written."""
    from mesh_transformer.train.loop import TrainHost
    root = trained["root"]
    config = gptj_config(root / "run", lora={"rank": RANK, "alpha": 8, "dropout": 0.0, "targets": TARGETS, **change})
    host = TrainHost(config, RunOptions(hf=str(root / "base"), tensorboard=False, log_dir=str(root / "run-logs")))
    now = "4 (alpha 16, rank 4)" if "alpha" in change else "4 (alpha 8, rank 4, use_rslora)"
    with pytest.raises(ConfigError, match=rf"its step 4 trained LoRA adapters at scale 2 \(alpha 8, rank 4\); "
                                          rf"this config's lora gives {re.escape(now)}\. Resume with the same alpha"):
        host.start_state()


def test_lora_on_our_checkpoint_trains_like_lora_on_the_hf_model(trained, no_tokenizer):
    """--tune-model-path with LoRA: the base is read from our (full fine-tune style) checkpoint of the
    same HF model and referenced by path; losses and adapters equal the --hf run's, and the loading
    tools merge the adapters onto that base."""
    from mesh_transformer import loading, models
    from mesh_transformer.io import hf
    from mesh_transformer.train.metrics import read_metrics
    root = trained["root"]
    hf.hf_to_checkpoint(str(root / "base"), str(root / "base-ckpt"))
    config = gptj_config(root / "run-from-ckpt")
    run, state = run_training(config, tune_model_path=str(root / "base-ckpt"))
    loss = lambda c: [r["train/loss"] for r in read_metrics(str(c.train.model_dir) + "-logs/metrics.jsonl")]  # noqa: E731
    np.testing.assert_allclose(loss(config), loss(trained["config"]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(jax.device_get(trained["state"].params))):
        np.testing.assert_allclose(a, b, atol=1e-6)
    loaded = loading.load(ckpt=str(root / "run-from-ckpt"), dtype="float32", mp=1, dp=1, tokenizer="gpt2")
    tokens = random_tokens((8, 16), 101, seed=8)
    logits, _ = models.build(loaded.config).apply(loaded.params, jnp.asarray(tokens))
    ours = run.trainer.logits(state.params, jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(logits)[..., :101], np.asarray(ours), atol=1e-5)


@pytest.fixture
def no_tokenizer(monkeypatch):
    from mesh_transformer import loading
    monkeypatch.setattr(loading, "resolve_tokenizer", lambda *a: None)  # the tiny vocabulary has none


def test_loading_tools_merge_a_lora_checkpoint(trained, no_tokenizer):
    from mesh_transformer import loading, models
    root = trained["root"]
    loaded = loading.load(ckpt=str(root / "run"), dtype="float32", mp=1, dp=1, tokenizer="gpt2")
    tokens = random_tokens((8, 16), 101, seed=7)
    logits, _ = models.build(loaded.config).apply(loaded.params, jnp.asarray(tokens))
    ours = trained["run"].trainer.logits(trained["state"].params, jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(logits)[..., :101], np.asarray(ours), atol=1e-5)


# Resume is exact with LoRA, FCM and LoRA dropout: tests/test_device_train.py SIGKILLs a real
# device_train.py run after a checkpoint and resumes it (test_lora_kill_after_a_checkpoint_...).


@pytest.mark.parametrize("dp,mp,zero", [(2, 4, True)])
def test_sharded_lora_step_equals_single_device(dp, mp, zero, tmp_path):
    config = gptj_config(tmp_path, zero=zero, d_ff=64, n_heads=8, layers=1,
                         lora={"rank": RANK, "alpha": 8, "targets": "all-linear"}, fcm_max_ratio=0.3, per_replica_batch=1)
    batch = {"tokens": random_tokens((1, 4, 17), 101, seed=1)}
    results = []
    for shape in ((1, 1), (dp, mp)):
        c = gptj_config(tmp_path, zero=zero and shape != (1, 1), d_ff=64, n_heads=8, layers=1, lora=config.train.lora,
                        fcm_max_ratio=0.3, per_replica_batch=4 // shape[0])
        tr = Trainer(c, mesh(*shape))
        tr.base = tr.init_base(0)
        state, metrics = tr.step(tr.init_state(0), tr.shard_batch(batch))
        results.append((float(metrics["loss"]), jax.tree.map(np.asarray, state.params)))
    assert results[0][0] == pytest.approx(results[1][0], abs=1e-6)
    for x, y in zip(jax.tree.leaves(results[0][1]), jax.tree.leaves(results[1][1])):
        np.testing.assert_allclose(x, y, atol=2e-6)


def _assert_adapters_split_like_their_weight(tr):
    """A [L, *inputs, r] takes its weight's specs of the input axes, B [L, r, *outputs] those of the
    outputs; the rank axis is never split."""
    for module, leaves in tr.param_specs.items():
        for name, spec in leaves.items():
            weight = name.rsplit("_lora_", 1)[0]
            ndim, base_ndim = tr.abstract_state.params[module][name].ndim, tr.abstract_base[module][weight].ndim
            spec = tuple(spec) + (None,) * (ndim - len(spec))  # specs may leave trailing axes out
            base = tuple(tr.base_specs[module][weight])
            base = base + (None,) * (base_ndim - len(base))
            lead = 2 if weight.startswith("experts_") else 1  # [L, E] of a mixture's experts
            if name.endswith("_lora_a"):
                assert spec == base[:ndim - 1] + (None,), (name, spec, base)
            else:
                assert spec == base[:lead] + (None,) + base[len(base) - (ndim - lead - 1):], (name, spec, base)


MIXTURE = {"family": "mixtral", "n_kv_heads": 2, "n_experts": 4, "experts_per_token": 2, "router_aux_loss_coef": 0.1}
FAMILY_KEYS = {"gptj": {"pe_rotary_dims": 4}, "llama": {"family": "llama", "n_kv_heads": 2}, "mixtral": MIXTURE,
               "llama_int8": {"family": "llama", "n_kv_heads": 2}, "mixtral_int8": MIXTURE}
EXPERTS = ["q_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj"]
LORA = {"mixtral": {"targets": EXPERTS}, "llama_int8": {"targets": ["q_proj", "v_proj"], "quantize_base": "int8"},
        "mixtral_int8": {"targets": EXPERTS[1:], "quantize_base": "int8"}}


@pytest.mark.parametrize("family", sorted(FAMILY_KEYS))
def test_sharded_lora_gradients_equal_single_device(family):
    """Every adapter's gradient on dp2 x mp4 with ZeRO equals one device's, with B made non-zero
    first (at init B = 0, so A's gradient is exactly 0 and a wrongly scaled or unreduced A
    gradient would go unseen). llama: 2 kv heads replicated over 4 shards, k/v adapters included;
    mixtral: an adapter per expert (split over mp as its expert) beside attention's; _int8: the
    frozen base int8 (`quantize_base`: values and scales split over dp by ZeRO, gathered a layer at
    a time), adapted weights and others, a mixture's experts included."""
    from tests.helpers import max_abs_diff
    batch = {"tokens": random_tokens((2, 4, 17), 101, seed=1)}
    results = []
    for dp, mp, zero in ((1, 1, False), (2, 4, True)):
        c = config_from_dict({"layers": 2, "d_model": 32, "n_heads": 8, "d_ff": 64, "n_vocab": 101, "seq": 16,
                              "compute_dtype": "float32", "remat": "none", "per_replica_batch": 4 // dp,
                              "gradient_accumulation_steps": 2, "cores_per_replica": mp, "zero": zero,
                              "lora": {"rank": RANK, "alpha": 8, "targets": "all-linear", **LORA.get(family, {})},
                              **FAMILY_KEYS[family]})
        tr = Trainer(c, mesh(dp, mp))
        _assert_adapters_split_like_their_weight(tr)
        tr.base = tr.init_base(0)
        if not results:
            rng = np.random.RandomState(5)
            adapters = {m: {n: (rng.normal(0, 0.1, x.shape).astype(np.float32) if n.endswith("_lora_b") else np.asarray(x))
                            for n, x in leaves.items()} for m, leaves in jax.device_get(tr.init_state(0).params).items()}
        params = jax.device_put(adapters, tr.state_shardings.params)
        loss, grads = tr.loss_and_grads(params, tr.shard_batch(batch))
        results.append((float(loss), jax.device_get(grads)))
    (loss_1, grads_1), (loss_n, grads_n) = results
    assert abs(loss_1 - loss_n) < 1e-6
    a_grads = [g for leaves in grads_1.values() for n, g in leaves.items() if n.endswith("_lora_a")]
    assert a_grads and min(float(np.abs(g).max()) for g in a_grads) > 1e-4  # A's gradients are not trivially zero
    if family == "mixtral":
        assert {"experts_gate_lora_a", "experts_in_lora_b", "experts_out_lora_a"} <= set(grads_1["mixtral/layers/moe"])
    if family.endswith("int8"):
        assert tr.base[f"{c.model.family}/layers/attn"]["q_proj"].dtype == jnp.int8
    assert max_abs_diff(grads_1, grads_n) < 2e-6


@pytest.mark.parametrize("cls,kw,targets", [
    ("GPTJ", HF, ["q_proj", "k_proj", "out_proj", "fc_in"]),
    ("GPT2", dict(vocab_size=101, n_positions=32, n_embd=32, n_layer=2, n_head=4), ["c_attn", "c_proj"]),
    ("GPTNeoX", dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                     max_position_embeddings=32), ["query_key_value", "dense_4h_to_h"]),
    ("Llama", dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=40, max_position_embeddings=32), ["q_proj", "v_proj", "gate_proj", "down_proj"]),
    ("Qwen3", dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=12, intermediate_size=40, max_position_embeddings=32), ["k_proj", "o_proj", "up_proj"]),
    ("Phi3", dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=40, max_position_embeddings=32, pad_token_id=0, eos_token_id=2),
     ["qkv_proj", "gate_up_proj", "o_proj"]),
    ("Gemma2", dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=8, intermediate_size=40, max_position_embeddings=32, sliding_window=6),
     ["q_proj", "o_proj", "gate_proj", "down_proj"]),
    ("OPT", dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=48,
                 max_position_embeddings=32, pad_token_id=1), ["k_proj", "out_proj", "fc1"]),
    ("Mixtral", dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32),
     ["q_proj", "v_proj", "o_proj", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    ("Qwen2Moe", dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      moe_intermediate_size=16, shared_expert_intermediate_size=40, num_experts=4,
                      num_experts_per_tok=2, max_position_embeddings=32),
     ["q_proj", "v_proj", "gate_proj", "down_proj", "gate_up_proj"]),  # (gate_proj, down_proj: the shared expert's)
    ("Qwen3Moe", dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=12, moe_intermediate_size=16, num_experts=6, num_experts_per_tok=3, norm_topk_prob=False,
                      max_position_embeddings=32),
     ["k_proj", "experts.down_proj"]),
    ("GptOss", dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=8, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                    max_position_embeddings=32, swiglu_limit=1.0),  # gate and up interleaved in gate_up_proj
     ["q_proj", "o_proj", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
])
def test_imported_peft_adapter_gives_peft_logits(cls, kw, targets, tmp_path, no_tokenizer):
    """An adapter made by peft (B random, so it does something) on a random model: --lora-adapter
    gives PeftModel's logits; exporting it again (fused modules block-diagonal) gives them too, and
    reads back as the same adapters. A mixture's experts are PEFT's `target_parameters`. GPT-2's,
    Phi-3's and Mixtral's (each with fused modules) are rsLoRA adapters (alpha / sqrt(r))."""
    from mesh_transformer import loading, models
    base = make_hf(tmp_path / "base", cls, **kw)
    torch.manual_seed(1)
    experts = [t for t in targets if "experts" in t or t == "gate_up_proj" and cls.endswith("Moe")]  # (PEFT's targets)
    rslora = cls in ("GPT2", "Phi3", "Mixtral")
    lcfg = peft.LoraConfig(r=RANK, lora_alpha=12, target_modules=[t for t in targets if t not in experts],
                           target_parameters=experts or None, init_lora_weights=False, fan_in_fan_out=cls == "GPT2",
                           use_rslora=rslora)
    model = peft.get_peft_model(base, lcfg).eval()
    model.save_pretrained(tmp_path / "adapter")
    tokens = random_tokens((2, 12), 101, seed=2)
    expected = hf_logits(model, tokens)
    loaded = loading.load(hf=str(tmp_path / "base"), lora_adapter=str(tmp_path / "adapter"), dtype="float32",
                          mp=1, dp=1, tokenizer="gpt2")
    logits, _ = models.build(loaded.config).apply(loaded.params, jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(logits)[..., :101], expected, atol=1e-4)

    spec, adapters = lora.load_peft(str(tmp_path / "adapter"), loaded.config)
    assert (spec.use_rslora, spec.scale) == (rslora, 12 / (RANK ** 0.5 if rslora else RANK))
    lora.save_peft(adapters, loaded.config, spec, str(tmp_path / "again"))
    import transformers
    fresh = getattr(transformers, f"{cls}ForCausalLM" if cls != "GPT2" else "GPT2LMHeadModel").from_pretrained(tmp_path / "base")
    again = peft.PeftModel.from_pretrained(fresh.eval(), str(tmp_path / "again")).eval()
    np.testing.assert_allclose(hf_logits(again, tokens), expected, atol=1e-4)
    spec_again, adapters_again = lora.load_peft(str(tmp_path / "again"), loaded.config)
    assert (spec_again.rank, spec_again.scale, set(spec_again.targets)) == (spec.rank, spec.scale, set(spec.targets))
    assert max_abs_diff(adapters_again, adapters) == 0


EXPERT_MODELS = {"Mixtral": {}, "GptOss": dict(head_dim=8, swiglu_limit=1.0)}  # (GPT-OSS: gate, up interleaved)


@pytest.mark.parametrize("cls, quantize_base", [("Mixtral", None), ("Mixtral", "int8"), ("GptOss", None)])
def test_expert_adapters_train_as_peft_autograd(cls, quantize_base, tmp_path, no_tokenizer):
    """A mixture with adapters on attention and on every expert (PEFT's `target_parameters`), B
    random: the training loss and every adapter's gradient equal torch autograd's through PeftModel
    (with the load-balancing loss, the adapters' gradients reaching the routers of later layers).
    torch's gradients go through the same import as PEFT's adapters: PEFT shares one A between an
    expert's gate and up, which ours holds twice, so its gradient is the sum of our two.
    int8: our base quantized from the float checkpoint (`quantize_base`), PEFT's on its weights
    rounded as int8 keeps them (every Linear and expert, per output; embedding and routers float),
    and rsLoRA adapters (`use_rslora`: alpha / sqrt(r))."""
    from mesh_transformer.config import Config, TrainConfig
    from mesh_transformer.io import hf
    kw = dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
              router_aux_loss_coef=0.05, **EXPERT_MODELS[cls])
    base = make_hf(tmp_path / "base", cls, **kw)
    base = rounded_like_int8(base) if quantize_base else base
    torch.manual_seed(1)
    model = peft.get_peft_model(base, peft.LoraConfig(r=RANK, lora_alpha=12, target_modules=["q_proj", "o_proj"],
                                                      target_parameters=["mlp.experts.gate_up_proj",
                                                                         "mlp.experts.down_proj"],
                                                      init_lora_weights=False, use_rslora=quantize_base is not None))
    model.save_pretrained(tmp_path / "adapter")
    tokens = random_tokens((2, 12), 101, seed=4)
    inputs, targets = (torch.tensor(t, dtype=torch.long) for t in (tokens[:, :-1], tokens[:, 1:]))
    out = model(input_ids=inputs, labels=targets, shift_labels=targets, output_router_logits=True)
    out.loss.backward()
    for p in model.parameters():  # the gradients, written as an adapter, read as ours
        if p.requires_grad:
            p.data.copy_(p.grad)
    model.save_pretrained(tmp_path / "grads")

    config, base_params = hf.load_hf(str(tmp_path / "base"))
    config = dataclasses.replace(config, router_aux_loss_coef=0.05, compute_dtype="float32", remat="none")
    spec, adapters = lora.load_peft(str(tmp_path / "adapter"), config)
    assert spec.use_rslora == (quantize_base is not None)
    _, expected = lora.load_peft(str(tmp_path / "grads"), config)
    tr = Trainer(Config(config, TrainConfig(per_replica_batch=2, lora={**spec.to_dict(), "quantize_base": quantize_base})),
                 mesh(1, 1))
    tr.set_base(base_params)
    loss, grads = tr.loss_and_grads(jax.device_put(adapters, tr.state_shardings.params),
                                    tr.shard_batch({"tokens": tokens[None]}))
    grads = jax.device_get(grads)
    assert abs(float(loss) - (out.loss - 0.05 * out.aux_loss).item()) < 1e-5
    moe = grads[f"{config.family}/layers/moe"]
    assert set(moe) == {f"experts_{w}_lora_{ab}" for w in ("gate", "in", "out") for ab in "ab"}
    moe["experts_gate_lora_a"] = moe["experts_in_lora_a"] = moe["experts_gate_lora_a"] + moe["experts_in_lora_a"]
    scale = max(float(np.abs(g).max()) for leaves in expected.values() for g in leaves.values())
    errors = {(m, n): float(np.abs(g - expected[m][n]).max()) for m, leaves in grads.items() for n, g in leaves.items()}
    assert max(errors.values()) < 1e-5 * scale, errors
    assert min(float(np.abs(g).max()) for leaves in expected.values() for g in leaves.values()) > 1e-3 * scale


@pytest.mark.parametrize("family", [{"family": "llama", "n_kv_heads": 2},
                                    {"family": "mixtral", "n_kv_heads": 2, "n_experts": 4, "experts_per_token": 2}])
def test_int8_base_halves_the_step_inputs_without_a_float_copy(family):
    """`quantize_base: int8`: the compiled step's arguments (the frozen base, the adapters, their
    optimizer state and the batch) are about half of a bf16 base's; its temporaries hold no float
    copy of the base (each layer's weights are widened in the layer scan)."""
    compiled = {}
    for quantize in (None, "int8"):
        c = config_from_dict({"layers": 4, "d_model": 256, "n_heads": 4, "d_ff": 1024, "n_vocab": 250, "seq": 64,
                              "compute_dtype": "bfloat16", "remat": "none", "per_replica_batch": 2, **family,
                              "lora": {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"],
                                       "quantize_base": quantize}})
        tr = Trainer(c, mesh(1, 1))
        tr.base = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tr.abstract_base,
                               tr.base_shardings)
        state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tr.abstract_state,
                             tr.state_shardings)
        memory = tr.step.lower(state, tr.abstract_batch()).compile().memory_analysis()
        base = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tr.abstract_base))
        compiled[quantize] = (memory.argument_size_in_bytes, memory.temp_size_in_bytes, base)
    (args_16, temps_16, base_16), (args_8, temps_8, base_8) = compiled[None], compiled["int8"]
    tr.base = tr.init_base(0)  # an int8 base handed back to set_base is kept, not quantized again
    held = jax.device_get(tr.base)
    tr.set_base(held)
    assert max_abs_diff(jax.device_get(tr.base), held) == 0
    assert base_8 < 0.52 * base_16 and args_8 < 0.55 * args_16
    assert temps_8 < temps_16 + 0.25 * base_16  # a float copy of the base would add 1-2 x base_16


@pytest.fixture(scope="module")
def plain():
    """A tiny model (no positions, so only attention carries context) and its params."""
    from mesh_transformer import models
    config = tiny_config(pe="none", pe_rotary_dims=None, layers=1).model
    model = models.build(config)
    apply = jax.jit(lambda p, t, keep=None: model.apply(p, t, key_keep=keep)[0])
    return apply, jax.jit(model.init)(jax.random.key(0))


def test_fcm_masks_what_it_says(plain):
    apply, params = plain
    tokens = random_tokens((4, 16), 250, seed=4)
    keep = np.asarray(fcm_keep(jax.random.key(0), (4, 16), 0.0, 0.0))
    assert keep.all()  # ratio 0: nothing masked, the same as plain training
    np.testing.assert_array_equal(apply(params, tokens, jnp.asarray(keep)), apply(params, tokens))
    keep = np.asarray(fcm_keep(jax.random.key(1), (64, 512), 0.5, 0.5))
    assert keep[:, 0].all() and abs(1 - keep.mean() - 0.5 * 511 / 512) < 0.01
    keep = np.asarray(fcm_keep(jax.random.key(2), (4, 16), 0.5, 0.5))
    other = np.where(keep, tokens, (tokens + 1) % 250)  # a masked key's token cannot matter to any other query
    a = np.asarray(apply(params, tokens, jnp.asarray(keep)))[..., :250]
    b = np.asarray(apply(params, other, jnp.asarray(keep)))[..., :250]
    np.testing.assert_allclose(a[keep], b[keep], atol=1e-5)
    assert np.abs(a[~keep] - b[~keep]).max() > 1e-3


@pytest.mark.parametrize("family", [dict(), dict(family="gpt2", pe="fixed")])
def test_packed_row_loss_is_the_sum_of_its_examples(family, tmp_path):
    """Three prompt/completion examples packed in one row by create_finetune_dataset (the first's
    prompt holds the EOS id), read with their stored segments: the row's loss sums equal the three
    examples' computed one by one (positions restart; no attention across)."""
    from mesh_transformer.data import BuildConfig, Loader, build_dataset
    from mesh_transformer.train.step import Trainer as T
    examples = [("w5 w0 w6", "w7 w8"), ("w9 w10", "w11 w12 w13 w14 w15 w16"), ("w17", "w18 w0 w19")]
    with open(tmp_path / "qa.jsonl", "w") as f:
        for p, c in examples:
            f.write(json.dumps({"in_text": p, "out_text": c}) + "\n")
    index = build_dataset(BuildConfig(str(tmp_path / "qa.jsonl"), "qa", str(tmp_path / "ds"), seq=24,
                                      tokenizer=word_tokenizer(tmp_path / "tok"), preserve_data_order=True))
    with Loader(Dataset.open(index), 1, shuffle=False, segments=True, prefetch=1) as loader:
        batch = {k: v.astype(np.int32) if k != "mask" else v for k, v in next(loader).items()}
    eos = 0
    config = config_from_dict({**{k: v for k, v in TINY.items() if not family or k != "pe_rotary_dims"},
                               "seq": 24, "layers": 1, **family})
    tr = T(config, mesh(1, 1))
    state = tr.init_state(0)
    packed = tr.eval_sums(state.params, batch)
    nll = count = 0.0
    for p, c in examples:
        p, c = [int(w[1:]) for w in p.split()], [int(w[1:]) for w in c.split()] + [eos]
        tokens = np.r_[p, c, np.full(25 - len(p) - len(c), eos)].astype(np.int32)
        m = ((np.arange(24) >= len(p) - 1) & (np.arange(24) < len(p) + len(c) - 1)).astype(np.float32)
        one = tr.eval_sums(state.params, {"tokens": tokens[None, None], "mask": m[None, None]})
        nll, count = nll + float(one[0]), count + float(one[1])
    assert float(packed[1]) == count == 2 + 6 + 3 + 3  # completions and their EOS
    assert float(packed[0]) == pytest.approx(nll, rel=1e-5)
    by_eos = tr.eval_sums(state.params, {**batch, "segments": segment_ids(batch["tokens"], eos).astype(np.int32)})
    plain = tr.eval_sums(state.params, {"tokens": batch["tokens"], "mask": batch["mask"]})
    for other in (by_eos, plain):  # the EOS rule cuts the first example; without segments examples see each other
        assert abs(float(other[0]) - nll) > 1e-3


def test_bf16_optimizer_keeps_moments_in_bf16():
    """Both Adam moments stored in bfloat16; the update is Adam's (computed in float32) to bf16 precision."""
    from mesh_transformer.train.step import optimizer
    params = {"m": {"w": jnp.linspace(-1, 1, 64).reshape(8, 8)}}
    grads = {"m": {"w": jnp.cos(jnp.arange(64.0)).reshape(8, 8)}}
    mask = {"m": {"w": True}}
    low, full = (optimizer(tiny_config(bf16_optimizer=b).train, mask) for b in (True, False))
    s_low, s_full = low.init(params), full.init(params)
    assert {x.dtype for x in jax.tree.leaves((s_low[1].mu, s_low[1].nu))} == {jnp.dtype(jnp.bfloat16)}
    assert parallel.bytes_of(s_low) < parallel.bytes_of(s_full) * 0.6
    for _ in range(3):
        u_low, s_low = low.update(grads, s_low, params)
        u_full, s_full = full.update(grads, s_full, params)
    np.testing.assert_allclose(u_low["m"]["w"], u_full["m"]["w"], rtol=2e-2, atol=1e-3)
