import json

import pytest

from mesh_transformer.config import ConfigError, config_from_dict, load_config
from tests.helpers import TINY


@pytest.mark.parametrize("name", ["6B_roto_256", "example_config", "tiny_cpu"])
def test_shipped_configs_load_and_round_trip(name):
    config = load_config(f"configs/{name}.json")
    assert config_from_dict(config.to_json_dict()) == config


def test_6b_config_has_the_original_values():
    c = load_config("configs/6B_roto_256.json")
    assert (c.model.layers, c.model.d_model, c.model.n_heads, c.model.head_dim) == (28, 4096, 16, 256)
    assert (c.model.rotary_dims, c.model.ff_dim, c.model.n_vocab, c.model.seq) == (64, 16384, 50400, 2048)
    assert (c.train.cores_per_replica, c.train.tpu_size, c.train.gradient_accumulation_steps) == (8, 256, 16)
    assert c.model.n_params() == 6_050_882_784  # HF's count of GPT-J-6B


@pytest.mark.parametrize("overrides, message", [
    ({"n_head": 8}, "unknown config key 'n_head' (did you mean 'n_heads'?)"),
    ({"layers": "28"}, "config key 'layers' must be int, got \"28\" (str)"),
    ({"lr": True}, "config key 'lr' must be float"),
    ({"zero": 1}, "config key 'zero' must be bool"),
    ({"n_heads": 5}, "config key 'n_heads': 5 does not divide d_model=64"),
    ({"pe_rotary_dims": 16}, "config key 'pe_rotary_dims': 16 is larger than the head size d_model/n_heads=8"),
    ({"pe_rotary_dims": 3}, "config key 'pe_rotary_dims': must be a positive even number"),
    ({"norm": "batchnorm"}, "config key 'norm': must be one of"),
    ({"pe": "sinusoid"}, "config key 'pe': family 'gptj' supports"),
    ({"family": "t5"}, "config key 'family': 't5' is not a model family here (supported: gptj, gpt_neox, llama, gpt2, opt, phi3, gemma, mixtral, olmo2, phi, starcoder2, gpt_oss)"),
    ({"n_kv_heads": 2}, "config key 'n_kv_heads' does not apply to family 'gptj' (it is a key of llama, phi3, gemma, mixtral, olmo2, phi, starcoder2, gpt_oss)"),
    ({"remat": "some"}, "config key 'remat': must be one of"),
    ({"compute_dtype": "int8"}, "config key 'compute_dtype': must be one of"),
    ({"loss_chunk": -256}, "config key 'loss_chunk': must be a whole number of tokens, 0 for all at once, got -256"),
    ({"layers": 0}, "config key 'layers': must be positive, got 0"),
    ({"warmup_steps": -1}, "config key 'warmup_steps': must not be negative"),
    ({"tpu_size": 6, "cores_per_replica": 4}, "config key 'tpu_size': 6 devices cannot be split"),
    ({"val_set": {"pile": 3}}, "config key 'val_set': must map names to index paths"),
    ({"train_set": {"a.index.json": 0}}, "config key 'train_set': a mixture maps index paths to positive weights "
                                         '(e.g. {"chat.index.json": 3, "web.index.json": 1}), got {"a.index.json": 0}'),
    ({"train_set": {}}, "config key 'train_set': a mixture maps index paths to positive weights"),
    ({"train_set": {"a.index.json": "1"}}, 'got {"a.index.json": "1"}'),
    ({"train_set": ["a.index.json"]}, "config key 'train_set' must be str or dict or null, got [\"a.index.json\"] (list)"),
])
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        config_from_dict({**TINY, **overrides})
    assert message in str(e.value)


def test_missing_required_key_is_named():
    raw = dict(TINY)
    del raw["d_model"]
    with pytest.raises(ConfigError, match="missing required config key 'd_model'"):
        config_from_dict(raw)


def test_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"layers": 2,\n "d_model": }')
    with pytest.raises(ConfigError, match=r"bad.json: not valid JSON \(line 2"):
        load_config(bad)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.json")
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({**TINY, "warmup_step": 3}))
    with pytest.raises(ConfigError, match=r"typo.json: unknown config key 'warmup_step' \(did you mean 'warmup_steps'\?\)"):
        load_config(typo)


def test_legacy_keys_are_accepted_with_a_warning():
    with pytest.warns(UserWarning, match="'early_cast' is ignored"):
        config = config_from_dict({**TINY, "early_cast": True, "comment": "hi"})
    assert config.model.d_model == 64


def test_mesh_dependent_errors_name_the_key():
    from mesh_transformer.train.step import Trainer
    from tests.helpers import mesh, tiny_config
    with pytest.raises(ConfigError, match="config key 'n_heads': 4 does not split over cores_per_replica \\(mp\\) = 8"):
        Trainer(tiny_config(n_heads=4, cores_per_replica=8), mesh(1, 8))
    with pytest.raises(ConfigError, match="config key 'd_model': 60 does not split over the data-parallel size"):
        Trainer(tiny_config(d_model=60, n_heads=6, pe_rotary_dims=4, zero=True), mesh(8, 1))


def test_padded_vocab_is_mesh_independent_and_divisible():
    c = load_config("configs/6B_roto_256.json").model
    assert c.padded_vocab(1) == c.padded_vocab(8) == 50432
    assert c.padded_vocab(8) % 8 == 0
    assert c.padded_vocab(6) % 6 == 0 and c.padded_vocab(6) >= c.n_vocab
