"""Parity with the reference implementation: HF transformers' GPTJForCausalLM (torch, fp32).

GPT-J's odd shapes beyond tests/test_families.py's case (rotary on 2 or 4 dimensions, 1, 3 and 5
layers, vocabularies of 101/250/517), at the same initialisation scale (0.2: attention and GELU far
from linear) and the same tolerance, a few times the measured float32 error."""
import json

import jax
import numpy as np
import pytest

from mesh_transformer.io import hf
from mesh_transformer import models
from mesh_transformer.config import ConfigError
from mesh_transformer.train.step import Trainer
from tests.helpers import PARITY_TOL, config_for, hf_logits, make_hf_gptj, mesh, random_tokens

# rotary_dim < head size, vocab not divisible by 8, odd layer counts, non-default d_ff.
PARITY_CASES = {
    "partial_rotary": dict(vocab_size=101, n_embd=32, n_layer=3, n_head=4, rotary_dim=4),
    "full_rotary_odd_vocab": dict(vocab_size=250, n_embd=64, n_layer=1, n_head=8, rotary_dim=8, n_inner=96),
    "five_layers": dict(vocab_size=517, n_embd=48, n_layer=5, n_head=8, rotary_dim=2, n_inner=64),
}


@pytest.fixture(scope="module", params=sorted(PARITY_CASES))
def hf_checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    torch_model = make_hf_gptj(path, initializer_range=0.2, **PARITY_CASES[request.param])
    return path, torch_model


def test_imported_logits_match_hf(hf_checkpoint):
    path, torch_model = hf_checkpoint
    config, params = hf.load_hf(path, compute_dtype="float32")
    tokens = random_tokens((2, 13), config.n_vocab, seed=1)
    ours, _ = jax.jit(models.build(config).apply)(params, tokens)
    ours = np.asarray(ours)[..., : config.n_vocab]
    np.testing.assert_allclose(ours, hf_logits(torch_model, tokens), atol=PARITY_TOL, rtol=0)
    assert np.all(np.isneginf(np.asarray(jax.jit(models.build(config).apply)(params, tokens)[0])[..., config.n_vocab:]))


def test_sharded_logits_match_hf(hf_checkpoint):
    """Same check through the model-parallel path (vocab padded to split over mp=8 / mp=4)."""
    path, torch_model = hf_checkpoint
    config, params = hf.load_hf(path, compute_dtype="float32", remat="none")
    mp = 8 if config.n_heads % 8 == 0 else 4
    trainer = Trainer(config_for(config, cores_per_replica=mp), mesh(8 // mp, mp))
    tokens = random_tokens((8 // mp * 2, 11), config.n_vocab, seed=2)
    state = trainer.state_from_params(params)
    np.testing.assert_allclose(np.asarray(trainer.logits(state.params, tokens)), hf_logits(torch_model, tokens),
                               atol=PARITY_TOL, rtol=0)


def test_export_loads_in_transformers_with_identical_logits(hf_checkpoint, tmp_path):
    from transformers import GPTJForCausalLM
    path, torch_model = hf_checkpoint
    config, params = hf.load_hf(path)
    hf.save_hf(params, config, tmp_path / "out", max_shard_bytes=20_000)  # force several shards + index
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    reloaded = GPTJForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = random_tokens((2, 9), config.n_vocab, seed=3)
    np.testing.assert_array_equal(hf_logits(reloaded, tokens), hf_logits(torch_model, tokens))


def test_export_dtypes(tmp_path):
    from safetensors import safe_open
    torch_model = make_hf_gptj(tmp_path / "src")
    config, params = hf.load_hf(tmp_path / "src")
    for dtype, expect in [("fp16", "float16"), ("bf16", "bfloat16")]:
        out = hf.save_hf(params, config, tmp_path / dtype, dtype=dtype)
        assert json.loads((out / "config.json").read_text())["torch_dtype"] == expect
        with safe_open(out / "model.safetensors", framework="numpy") as f:
            wte = f.get_tensor("transformer.wte.weight")
        assert str(wte.dtype) == expect and wte.shape == (101, 32)
        np.testing.assert_allclose(wte.astype(np.float32), torch_model.transformer.wte.weight.detach().numpy(), atol=1e-2)


def test_pytorch_bin_import_uses_weights_only_loader(tmp_path):
    import torch
    torch_model = make_hf_gptj(tmp_path / "st")
    (tmp_path / "bin").mkdir()
    torch_model.config.save_pretrained(tmp_path / "bin")
    torch.save(torch_model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    config, params = hf.load_hf(tmp_path / "bin", compute_dtype="float32")
    _, reference = hf.load_hf(tmp_path / "st", compute_dtype="float32")
    assert jax.tree.all(jax.tree.map(np.array_equal, params, reference))


def test_import_errors_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        hf.load_hf(tmp_path)
    make_hf_gptj(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="no model.safetensors"):
        hf.load_hf(tmp_path / "m")
    (tmp_path / "t5").mkdir()
    (tmp_path / "t5" / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(ConfigError, match="model_type 't5' is not supported .supported: gemma, gemma2, "
                                          "gemma3_text, gpt2, gpt_neox, gpt_oss, gptj, granite, llama, mistral, mixtral, olmo2, olmo3, opt, phi, phi3, "
                                          "qwen2, qwen2_moe, qwen3, qwen3_moe, starcoder2"):
        hf.load_hf(tmp_path / "t5")


ST_POOLING = "sentence_transformers.sentence_transformer.modules.pooling.Pooling"
ST_NORMALIZE = "sentence_transformers.models.Normalize"  # the older module path, as older models list it


@pytest.mark.parametrize("modules, pooling_config, expected", [
    ([ST_POOLING, ST_NORMALIZE], {"embedding_dimension": 8, "pooling_mode": "lasttoken"}, ("last", True)),
    ([ST_POOLING], {"pooling_mode": ["cls"]}, ("cls", False)),
    ([ST_POOLING, ST_NORMALIZE], {"word_embedding_dimension": 8, "pooling_mode_cls_token": False,  # the older keys
                                  "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False}, ("mean", True)),
    ([ST_POOLING], {"word_embedding_dimension": 8}, ("mean", False)),  # no mode set: sentence-transformers' default
    ([ST_NORMALIZE], None, None),  # no Pooling module
    (None, None, None),  # no modules.json
])
def test_sentence_transformers_pooling_is_read_from_modules_json(tmp_path, modules, pooling_config, expected):
    if modules is not None:
        (tmp_path / "modules.json").write_text(json.dumps(
            [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
            + [{"idx": i, "name": str(i), "path": f"{i}_{t.rsplit('.', 1)[1]}", "type": t}
               for i, t in enumerate(modules, 1)]))
    if pooling_config is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    assert hf.embedding_pooling(tmp_path) == expected


@pytest.mark.parametrize("files, message", [
    ({"modules.json": "{]"}, r"modules.json: not sentence-transformers' list of modules"),
    ({"modules.json": json.dumps([{"path": "1_Pooling", "type": ST_POOLING}])},
     r"1_Pooling/config.json: the Pooling module's settings do not read"),
    ({"modules.json": json.dumps([{"path": "1_Pooling", "type": ST_POOLING}]),
      "1_Pooling/config.json": json.dumps({"pooling_mode": "max"})},
     r"1_Pooling/config.json: pooling 'max' is not one this library runs \(lasttoken, mean, cls\): pass --embedding-pooling"),
    ({"modules.json": json.dumps([{"path": "1_Pooling", "type": ST_POOLING}]),
      "1_Pooling/config.json": json.dumps({"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True})},
     r"pooling \['max', 'mean'\] is not one this library runs"),
])
def test_sentence_transformers_pooling_errors_name_the_file(tmp_path, files, message):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=message):
        hf.embedding_pooling(tmp_path)
