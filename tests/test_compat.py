"""What earlier versions wrote keeps working: a checkpoint and a dataset written by the code before
model families (commit ce53e50, tests/data/), and a checkpoint trained with mp=3."""
from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from mesh_transformer import parallel
from mesh_transformer.config import config_from_dict
from mesh_transformer.data import Dataset, Loader, segment_ids
from mesh_transformer.io import hf
from mesh_transformer.io.checkpoint import CheckpointManager
from mesh_transformer.train.step import Trainer
from tests.helpers import hf_logits, mesh, random_tokens

DATA = Path(__file__).parent / "data"
OLD_CKPT = DATA / "ckpt_v0_gptj"


def test_checkpoint_written_before_model_families_restores_and_trains(tmp_path):
    """Its config has no `family` key (it means GPT-J); the whole train state restores onto another
    mesh, gives the logits recorded when it was written, and a step trains on."""
    config = config_from_dict(json.loads((OLD_CKPT / "config.json").read_text()))
    assert config.model.family == "gptj"
    trainer = Trainer(config, mesh(1, 4))  # written from dp2 x mp2
    ckpt = CheckpointManager(str(OLD_CKPT), read_only=True, config=config)
    state, extras = ckpt.restore(abstract_state=trainer.abstract_state, target_shardings=trainer.state_shardings)
    assert int(state.step) == 1 and extras["train_loader"]["position"] == 4
    probe = np.load(OLD_CKPT / "probe_tokens.npy")
    np.testing.assert_allclose(np.asarray(trainer.logits(state.params, probe)), np.load(OLD_CKPT / "expected_logits.npy"),
                               atol=2e-5, rtol=0)
    batch = {"tokens": random_tokens((1, 4, 17), config.model.n_vocab, seed=5)}
    state, metrics = trainer.step(state, trainer.shard_batch(batch))
    assert int(state.step) == 2 and np.isfinite(float(metrics["loss"]))


def test_dataset_written_before_model_families_loads():
    ds = Dataset.open(str(DATA / "dataset_v0" / "qa_v0.index.json"))
    tokens, mask = ds.read(np.arange(3))
    assert tokens.shape == (3, 33) and mask.shape == (3, 32)
    assert 0 < mask.sum() < mask.size  # prompt/completion: only completions are trained on
    assert ds.index["version"] == 1 and not ds.has_segments  # written before segments were stored:
    with Loader(ds, 3, shuffle=False, segments=True, prefetch=1) as loader:  # the EOS rule gives them
        np.testing.assert_array_equal(next(loader)["segments"][0], segment_ids(tokens, ds.eos_id))


def test_checkpoint_trained_with_mp3_exports_to_hf(tmp_path):
    """mp=3 pads the vocabulary to a multiple of 384, not 128: export reads the saved padding."""
    from transformers import GPTJForCausalLM
    config = config_from_dict(dict(layers=2, d_model=48, n_heads=6, n_vocab=200, seq=16, d_ff=96, pe_rotary_dims=4,
                                   compute_dtype="float32", cores_per_replica=3, model_dir=str(tmp_path / "run")))
    trainer = Trainer(config, parallel.make_mesh(3, 1, jax.devices()[:3]))
    state = trainer.init_state(0)
    assert state.params["gptj/embed"]["embeddings"].shape[0] == 384
    with CheckpointManager(config.train.model_dir, config=config, async_save=False) as ckpt:
        ckpt.save(0, state, wait=True)
    hf.checkpoint_to_hf(config.train.model_dir, tmp_path / "hf", dtype="fp32")
    exported = GPTJForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = random_tokens((3, 9), 200, seed=1)
    np.testing.assert_allclose(hf_logits(exported, tokens), np.asarray(trainer.logits(state.params, tokens)),
                               atol=2e-5, rtol=0)
