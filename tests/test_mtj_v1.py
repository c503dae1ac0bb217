"""mesh-transformer-jax v1 checkpoints (the released GPT-J-6B's format): read, export, reshard, slim.

Checkpoints come from tests/v1_writer.py (written from the format spec) out of random HF GPT-J
models with 11 layers (layer_1 < layer_10 < layer_2 on disk), non-zero embedding and fc_out biases
split unequally over shards, and LayerNorm copies on shards >= 1 left at their init. The writer sets
the torch model to exactly the weights the files hold, so every comparison is against HF transformers.
"""
import copy
import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import resharding_example
import slim_model
import to_hf_weights
from mesh_transformer import loading, models, parallel
from mesh_transformer.io import hf, mtj_v1
from mesh_transformer.io.checkpoint import CheckpointError, CheckpointManager
from tests.helpers import hf_logits, random_tokens
from tests.v1_writer import random_moments, write_v1

LAYERS, VOCAB = 11, 304  # vocabulary: the tiny tokenizer's 300 tokens padded to split over 8 shards
HF_KWARGS = dict(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=LAYERS, n_head=8, rotary_dim=2,
                 initializer_range=0.2)
V1_CONFIG = dict(layers=LAYERS, d_model=32, n_heads=8, n_vocab=VOCAB, seq=32, pe_rotary_dims=2, norm="layernorm",
                 pe="rotary", cores_per_replica=8, tpu_size=8, lr=1e-4, total_steps=10, warmup_steps=1,
                 anneal_steps=5, per_replica_batch=1, gradient_accumulation_steps=1, weight_decay=0.1,
                 bucket=None, model_dir="unused", train_set="x.index", val_set={}, eval_harness_tasks=[],
                 val_batches=0, val_every=0, ckpt_every=0, keep_every=0, name="v1", wandb_project=None,
                 comment="the original's keys; training keys are not the reader's business", step_shift=0)
PROMPT = "The quick brown fox"


def _random_hf(layers: int):
    import torch
    from transformers import GPTJConfig, GPTJForCausalLM

    torch.manual_seed(layers)
    model = GPTJForCausalLM(GPTJConfig(**{**HF_KWARGS, "n_layer": layers})).eval()  # EOS 50256: never generated
    with torch.no_grad():  # HF inits biases and LayerNorms to 0/1: perturb them so parity covers them
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A random 11-layer HF GPT-J (eval, fp32) and a config file in the original's keys."""
    root = tmp_path_factory.mktemp("v1")
    (root / "config.json").write_text(json.dumps(V1_CONFIG))
    (root / "config_3.json").write_text(json.dumps({**V1_CONFIG, "layers": 3}))
    return _random_hf(LAYERS), root


@pytest.fixture(scope="module")
def make_v1(base, tiny):
    """(shards, dtype, full, layers) -> (step dir, oracle torch model, moments); written once per combination.

    3 layers (config_3.json) where compile time matters more than the layer order (generation)."""
    root = base[1]
    models = {LAYERS: base[0]}
    made = {}

    def make(shards, dtype="fp32", full=False, layers=LAYERS):
        key = (shards, dtype, full, layers)
        if key not in made:
            if layers not in models:
                models[layers] = _random_hf(layers)
            oracle = copy.deepcopy(models[layers])
            model_dir = root / f"run_{shards}_{dtype}_{'full' if full else 'slim'}_{layers}"
            moments = random_moments(oracle) if full else None
            write_v1(oracle, model_dir / "step_7", shards, dtype, moments=moments)
            (model_dir / "meta.json").write_text(json.dumps({"step": 7, "checkpoints": [5, 7], "aux": {"7": {}}}))
            tiny.tokenizer.save_pretrained(model_dir)
            made[key] = model_dir / "step_7", oracle, moments
        return made[key]
    return make


@pytest.fixture(scope="module")
def config_path(base):
    return str(base[1] / "config.json")


def _logits(params, config, mp, tokens):
    config = dataclasses.replace(config, compute_dtype="float32")
    return np.asarray(jax.jit(models.build(config, mp).apply)(params, tokens)[0])[..., :config.n_vocab]


def _open(step_dir, config_path):
    return mtj_v1.open_checkpoint(str(step_dir), config_path)[0]


# --------------------------------------------------------------------------------------------
# Reading: layout, logits, meshes
# --------------------------------------------------------------------------------------------

def test_layout_is_jax_flattening_order():
    leaves = mtj_v1.layout(28, full=False)
    assert len(leaves) == 287 and [b - a for a, b in mtj_v1.piece_bounds(287)] == [18] * 15 + [17]
    layers = [leaf.layer for leaf in leaves if leaf.layer is not None][::10]
    assert layers[:4] == [0, 1, 10, 11] and layers[-2:] == [8, 9]
    assert leaves[0].name.endswith("embedding_shard/~/linear/b") and leaves[2].name.endswith("layer_0/~/linear/w")
    assert leaves[-2].name.endswith("projection_shard/~/replicated_layer_norm/scale") and leaves[-1].name == "step"
    full = mtj_v1.layout(28, full=True)
    assert len(full) == 861 and full[0].name == "opt_state/adam/count" and full[1].section == "mu"
    assert [b - a for a, b in mtj_v1.piece_bounds(861)] == [54] * 13 + [53] * 3


@pytest.mark.parametrize("shards,dtype,dp,mp,zero", [
    (1, "fp32", 1, 1, False), (2, "bf16", 2, 4, False), (4, "fp16", 4, 2, True), (8, "fp32", 1, 8, False),
    (8, "bf16", 8, 1, True)])
def test_read_onto_any_mesh_gives_hf_logits(make_v1, config_path, shards, dtype, dp, mp, zero):
    step_dir, oracle, _ = make_v1(shards, dtype)
    ckpt = _open(step_dir, config_path)
    assert (ckpt.shards, ckpt.full, ckpt.step) == (shards, False, 7)
    mesh = parallel.make_mesh(mp, dp, jax.devices()[:dp * mp])
    params = mtj_v1.load_params(ckpt, mesh, zero=zero)
    layer_q = params["gptj/layers/attn"]["q_proj"]  # [L, D, N, H]: heads over mp, and D over dp with ZeRO
    assert layer_q.shape == (LAYERS, 32, 8, 4) and layer_q.sharding.spec == P(None, "dp" if zero else None, "mp", None)
    tokens = random_tokens((2, 11), VOCAB, seed=shards)
    np.testing.assert_allclose(_logits(params, ckpt.model, mp, tokens), hf_logits(oracle, tokens), atol=1e-4, rtol=0)


def test_bf16_checkpoint_holds_the_bf16_rounding_of_the_source(make_v1, base, config_path):
    """Stored bf16, read exactly: the weights differ from the fp32 source only by bf16 rounding."""
    step_dir, oracle, _ = make_v1(2, "bf16")
    source = base[0]
    for name, p in oracle.state_dict().items():
        if name.endswith("wte.weight") or "attn.bias" in name or "masked_bias" in name:
            continue
        want = source.state_dict()[name].numpy()
        np.testing.assert_allclose(p.numpy(), want, rtol=2 ** -8, atol=1e-30, err_msg=name)
    params = mtj_v1.load_params(_open(step_dir, config_path), parallel.make_mesh(1, 1, jax.devices()[:1]), "bfloat16")
    q = np.asarray(params["gptj/layers/attn"]["q_proj"][3], np.float32).reshape(32, 32).T
    np.testing.assert_array_equal(q, oracle.transformer.h[3].attn.q_proj.weight.detach().numpy())


def test_full_checkpoint_moments_map_to_ours(make_v1, config_path, tmp_path, base):
    """mu/nu in our layout equal the HF-named moments the writer started from (imported by hf.load_hf)."""
    step_dir, oracle, (mu_hf, nu_hf) = make_v1(4, "fp32", full=True)
    ckpt = _open(step_dir, config_path)
    assert ckpt.full and ckpt.scalar("opt_state/adam/count") == 7
    mesh = parallel.make_mesh(2, 4, jax.devices())
    params, mu, nu = mtj_v1.load_params(ckpt, mesh, moments=True)
    for moments, ours in ((mu_hf, mu), (nu_hf, nu)):
        expected = _as_ours(moments, base[0], tmp_path, mp=2)
        for module, leaves in expected.items():
            for name, x in leaves.items():
                np.testing.assert_array_equal(np.asarray(ours[module][name]), x, err_msg=f"{module}/{name}")
    tokens = random_tokens((1, 9), VOCAB)
    np.testing.assert_allclose(_logits(params, ckpt.model, 2, tokens), hf_logits(oracle, tokens), atol=1e-4, rtol=0)


def _as_ours(state_dict, like, tmp_path, mp):
    """A HF-named dict of arrays in our layout, through the HF importer (a model dir holding them)."""
    import torch
    holder = copy.deepcopy(like)
    holder.load_state_dict({k: torch.from_numpy(v) for k, v in state_dict.items()}, strict=False)
    holder.save_pretrained(tmp_path / "moments")
    return hf.load_hf(tmp_path / "moments", mp=mp)[1]


# --------------------------------------------------------------------------------------------
# Tools: to_hf_weights, loading (incl. gs://), resharding_example, slim_model, device_train
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shards,dtype,full", [(8, "bf16", False), (2, "fp32", True)])
def test_to_hf_weights_exports_the_source_model(make_v1, config_path, tmp_path, shards, dtype, full):
    from transformers import GPTJForCausalLM
    step_dir, oracle, _ = make_v1(shards, dtype, full)
    out = tmp_path / "hf"
    assert to_hf_weights.main(["--input-ckpt", str(step_dir), "--config", config_path, "--output-path", str(out),
                               "--dtype", "fp32", "--max-shard-gb", "0.0002", "--cpu", "--debug"]) == 0
    assert (out / "model.safetensors.index.json").exists() and (out / "tokenizer.json").exists()
    reloaded = GPTJForCausalLM.from_pretrained(out).eval()
    for name, p in oracle.state_dict().items():
        if not name.endswith(("attn.bias", "masked_bias")):
            np.testing.assert_array_equal(reloaded.state_dict()[name].numpy(), p.numpy(), err_msg=name)
    tokens = random_tokens((2, 10), VOCAB, seed=4)
    np.testing.assert_array_equal(hf_logits(reloaded, tokens), hf_logits(oracle, tokens))


def test_to_hf_weights_fp16_from_a_model_dir(make_v1, config_path, tmp_path):
    from safetensors import safe_open
    step_dir, oracle, _ = make_v1(4, "fp16")
    out = tmp_path / "hf16"
    assert to_hf_weights.main(["--input-ckpt", str(step_dir.parent), "--config", config_path,
                               "--output-path", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float16"
    with safe_open(out / "model.safetensors", framework="numpy") as f:
        fc_out_bias = f.get_tensor("transformer.h.10.mlp.fc_out.bias")
    assert fc_out_bias.dtype == np.float16
    np.testing.assert_array_equal(fc_out_bias, oracle.transformer.h[10].mlp.fc_out.bias.detach().numpy().astype(np.float16))


def test_loading_a_v1_model_dir_on_gcs(make_v1, config_path, gcs_bucket, tiny):
    from mesh_transformer.io import storage
    step_dir, oracle, _ = make_v1(2, "bf16")
    remote = f"{gcs_bucket}/v1/gptj"
    for local in sorted(step_dir.parent.rglob("*")):
        if local.is_file():
            storage.write_bytes(f"{remote}/{local.relative_to(step_dir.parent)}", local.read_bytes())
    model = loading.load(ckpt=remote, config=config_path, mp=2, dp=1, dtype="float32")
    assert len(model.tokenizer) == len(tiny.tokenizer)  # read from gs:// (GPT-2's 50257 would not fit 304)
    tokens = random_tokens((1, 12), VOCAB, seed=7)
    np.testing.assert_allclose(_logits(model.params, model.config, 2, tokens), hf_logits(oracle, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("shards,mp", [(8, 1), (4, 2), (2, 4), (1, 8)])
def test_resharding_example_greedy_text_equals_hf(make_v1, config_path, tiny, tmp_path, capsys, shards, mp):
    import torch
    step_dir, oracle, _ = make_v1(shards, "fp32", layers=3)
    out = tmp_path / "ours"
    args = ["--input-ckpt", str(step_dir), "--config", config_path.replace("config.json", "config_3.json"), "--mp", str(mp), "--dtype", "fp32",
            "--prompt", PROMPT, "--max-new-tokens", "8", "--temperature", "0"]
    assert resharding_example.main(args + (["--output-ckpt", str(out)] if mp == 2 else [])) == 0
    captured = capsys.readouterr()
    prompt = tiny.tokenizer.encode(PROMPT)
    expected = oracle.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               do_sample=False, max_new_tokens=8, pad_token_id=tiny.eos, eos_token_id=None)
    assert captured.out == tiny.tokenizer.decode(expected[0, len(prompt):]) + "\n"
    assert f"mp={mp}" in captured.err and "each device needs" in captured.err
    if mp == 2:  # our params-only checkpoint of the resharded model loads like any other
        reloaded = loading.load(ckpt=str(out), dtype="float32")
        assert reloaded.mesh.shape[parallel.MP] == 2 and len(reloaded.tokenizer) == len(tiny.tokenizer)
        tokens = random_tokens((1, 9), VOCAB, seed=8)
        np.testing.assert_allclose(_logits(reloaded.params, reloaded.config, 2, tokens), hf_logits(oracle, tokens),
                                   atol=1e-4, rtol=0)


def test_memory_print_matches_the_placed_params(make_v1, config_path):
    from mesh_transformer.io import convert
    step_dir, _, _ = make_v1(8, "bf16")
    ckpt = _open(step_dir, config_path)
    mesh = parallel.make_mesh(4, 1, jax.devices()[:4])
    need = convert.memory_per_device(ckpt.model, mesh, "bf16")
    params = mtj_v1.load_params(ckpt, mesh, "bfloat16")
    on_device_0 = sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards
                      if s.device == mesh.devices.flat[0])
    assert need["params"] == on_device_0
    assert need["kv_cache_per_row"] == 2 * LAYERS * 32 * (8 // 4) * 4 * 2


def test_slim_round_trip(make_v1, config_path, tmp_path, capsys):
    """v1 full (fp32 + Adam) -> slim bf16 checkpoint of ours -> every tool reads it; then ours -> fp16."""
    step_dir, oracle, _ = make_v1(4, "fp32", full=True)
    out = tmp_path / "slim"
    assert slim_model.main(["--input-ckpt", str(step_dir), "--config", config_path, "--output-ckpt", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "KiB" in printed and "(bf16, params only)" in printed
    manager = CheckpointManager(str(out), read_only=True)
    assert manager.all_steps() == [0] and not manager.holds_optimizer_state()
    full_params = mtj_v1.load_params(_open(step_dir, config_path), parallel.make_mesh(1, 1, jax.devices()[:1]))
    slim = loading.load(ckpt=str(out), mp=1, dp=1, dtype="float32")
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(full_params)[0], jax.tree.leaves(slim.params)):
        assert b.dtype == np.float32  # stored bf16, cast back on restore
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a.astype(jax.numpy.bfloat16), np.float32), err_msg=str(path))
    out16 = tmp_path / "slim16"
    assert slim_model.main(["--input-ckpt", str(out), "--output-ckpt", str(out16), "--dtype", "fp16"]) == 0
    assert CheckpointManager(str(out16), read_only=True).saved_config()["n_vocab"] == VOCAB


def test_slim_model_original_flags(make_v1, base, tmp_path):
    """--config CFG [--ckpt-step N] [--f16]: the config's model_dir (meta.json names the steps) -> <model_dir>_slim_f16."""
    step_dir, oracle, _ = make_v1(2, "fp32", full=True)
    model_dir = tmp_path / "run"
    shutil.copytree(step_dir.parent, model_dir)
    config = tmp_path / "run.json"
    config.write_text(json.dumps({**V1_CONFIG, "model_dir": str(model_dir)}))
    assert slim_model.main(["--config", str(config), "--ckpt-step", "7", "--f16"]) == 0
    slim = loading.load(ckpt=f"{model_dir}_slim_f16", mp=1, dp=1, dtype="float32")
    tokens = random_tokens((1, 8), VOCAB, seed=9)
    np.testing.assert_allclose(_logits(slim.params, slim.config, 1, tokens), hf_logits(oracle, tokens), atol=2e-2, rtol=0)


@pytest.mark.parametrize("full,fresh_opt", [(True, False), (True, True), (False, False)])
def test_tune_model_path_from_v1(make_v1, tmp_path, base, full, fresh_opt):
    """device_train --tune-model-path V1: full -> Adam moments and count carry over (unless --fresh-opt)."""
    from mesh_transformer.config import config_from_dict
    from mesh_transformer.train.loop import RunOptions, TrainHost
    step_dir, oracle, moments = make_v1(2, "fp32", full=full)
    raw = {**{k: v for k, v in V1_CONFIG.items() if k not in ("comment", "step_shift", "bucket", "wandb_project")},
           "model_dir": str(tmp_path / "run"), "cores_per_replica": 2, "tpu_size": 4, "compute_dtype": "float32"}
    host = TrainHost(config_from_dict(raw), RunOptions(tune_model_path=str(step_dir), fresh_opt=fresh_opt))
    state, loader = host.start_state()
    assert int(state.step) == 0 and loader == {}
    adam = state.opt_state[1]
    assert int(adam.count) == (7 if full and not fresh_opt else 0)
    mu = np.asarray(adam.mu["gptj/layers/mlp"]["fc_in"][3])
    if full and not fresh_opt:
        np.testing.assert_array_equal(mu, moments[0]["transformer.h.3.mlp.fc_in.weight"].T)
    else:
        assert not mu.any()
    np.testing.assert_array_equal(np.asarray(state.params["gptj/layers/mlp"]["fc_out_bias"][10]),
                                  oracle.transformer.h[10].mlp.fc_out.bias.detach().numpy())


# --------------------------------------------------------------------------------------------
# Bad input: one clear error, nothing written
# --------------------------------------------------------------------------------------------

def _broken_copy(make_v1, tmp_path, how):
    step_dir, _, _ = make_v1(2, "bf16")
    broken = tmp_path / "broken" / "step_7"
    shutil.copytree(step_dir, broken)
    how(broken)
    return broken


BREAKAGES = {
    "missing piece": (lambda d: os.remove(d / "shard_1" / "5.npz"), "shard_1/5.npz: missing"),
    "truncated piece": (lambda d: os.truncate(d / "shard_0" / "3.npz", os.path.getsize(d / "shard_0" / "3.npz") // 2),
                        "shard_0/3.npz: not a readable .npz (truncated or corrupted?)"),
    "missing shard": (lambda d: shutil.rmtree(d / "shard_0"), "shard_0 is missing"),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_broken_checkpoint_is_one_error_and_nothing_written(make_v1, config_path, tmp_path, capsys, breakage):
    how, message = BREAKAGES[breakage]
    broken = _broken_copy(make_v1, tmp_path, how)
    out = tmp_path / "out"
    assert to_hf_weights.main(["--input-ckpt", str(broken), "--config", config_path, "--output-path", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob("out.tmp-*"))


@pytest.mark.parametrize("change,message", [
    ({"d_model": 48}, "linear/b (arr_0) of shard 0 has shape (32,), but the config gives (48,) per shard"),
    ({"layers": 12}, "holds 117 arrays in pieces of [8, 8, 8, 8, 8, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7], but a "
                     "12-layer model's slim checkpoint has 127"),
    ({"n_vocab": 303}, "config key 'n_vocab' = 303 does not split over 2"),
])
def test_config_that_disagrees_is_one_error_and_nothing_written(make_v1, tmp_path, capsys, change, message):
    step_dir, _, _ = make_v1(2, "bf16")
    config = tmp_path / "wrong.json"
    config.write_text(json.dumps({**V1_CONFIG, **change}))
    for tool, args in ((to_hf_weights, ["--output-path", str(tmp_path / "hf")]),
                       (slim_model, ["--output-ckpt", str(tmp_path / "slim")]),
                       (resharding_example, ["--mp", "1", "--output-ckpt", str(tmp_path / "ours"), "--prompt", "x"])):
        assert tool.main(["--input-ckpt", str(step_dir), "--config", str(config), *args]) == 2, tool.__name__
        lines = capsys.readouterr().err.strip().splitlines()  # resharding_example prints its memory need first
        assert message in lines[-1] and [line.startswith("error: ") for line in lines].count(True) == 1, lines
    assert not [p for p in tmp_path.iterdir() if p.name != "wrong.json"]


def test_v1_without_config_says_so(make_v1, tmp_path, capsys):
    step_dir, _, _ = make_v1(2, "bf16")
    assert to_hf_weights.main(["--input-ckpt", str(step_dir), "--output-path", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "is a mesh-transformer-jax v1 checkpoint" in err and "pass --config" in err
    assert not (tmp_path / "hf").exists()
    with pytest.raises(Exception, match="pass --config"):
        loading.load(ckpt=str(step_dir.parent), mp=1, dp=1)


def test_shape_error_names_leaf_shard_and_shapes(make_v1, config_path, tmp_path):
    """A piece whose array disagrees with the config (here shard 1 of layer 10's fc_in holds too many columns)."""
    step_dir, _, _ = make_v1(2, "fp32")
    broken = tmp_path / "step_7"
    shutil.copytree(step_dir, broken)
    ckpt = _open(broken, config_path)
    j = next(i for i, leaf in enumerate(ckpt.leaves) if leaf.name.endswith("layer_10/~/linear_4/w"))
    piece = next(i for i, (a, b) in enumerate(ckpt.pieces) if a <= j < b)
    path = broken / "shard_1" / f"{piece}.npz"
    arrays = dict(np.load(path))
    arrays[f"arr_{j - ckpt.pieces[piece][0]}"] = np.zeros((32, 80), np.float32)
    np.savez(path, **{f"arr_{i}": arrays[f"arr_{i}"] for i in range(len(arrays))})
    with pytest.raises(CheckpointError, match=r"shard_1/\d+\.npz: params/causal_transformer_shard/~/layer_10/~/linear_4/w "
                                              r"\(arr_\d+\) of shard 1 has shape \(32, 80\), but the config gives \(32, 64\)"):
        mtj_v1.load_params(_open(broken, config_path), parallel.make_mesh(1, 1, jax.devices()[:1]))

