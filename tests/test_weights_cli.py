"""from_hf_weights.py / to_hf_weights.py: HF -> our checkpoint -> HF is lossless, locally and on gs://."""
import json

import numpy as np

import from_hf_weights
import to_hf_weights
from mesh_transformer.io.checkpoint import CheckpointManager
from tests.helpers import hf_logits, make_hf_gptj, random_tokens


def test_import_then_export_gives_identical_hf_logits(tmp_path):
    from transformers import GPTJForCausalLM
    torch_model = make_hf_gptj(tmp_path / "hf", vocab_size=250, n_embd=64, n_layer=2, n_head=8, rotary_dim=4)
    assert from_hf_weights.main(["--input-hf", str(tmp_path / "hf"), "--output-ckpt", str(tmp_path / "ckpt")]) == 0
    ckpt = CheckpointManager(str(tmp_path / "ckpt"), read_only=True)
    assert ckpt.all_steps() == [0] and not ckpt.holds_optimizer_state()
    assert ckpt.saved_config()["d_model"] == 64 and ckpt.saved_config()["n_vocab"] == 250
    assert to_hf_weights.main(["--input-ckpt", str(tmp_path / "ckpt"), "--output-path", str(tmp_path / "out"),
                               "--dtype", "fp32"]) == 0
    reloaded = GPTJForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = random_tokens((2, 12), 250, seed=5)
    np.testing.assert_array_equal(hf_logits(reloaded, tokens), hf_logits(torch_model, tokens))


def test_gcs_paths_both_ways(tmp_path, gcs_bucket):
    from transformers import GPTJForCausalLM
    from mesh_transformer.io import remote
    torch_model = make_hf_gptj(tmp_path / "hf")
    ckpt_dir, out_dir = f"{gcs_bucket}/weights/ckpt", f"{gcs_bucket}/weights/hf"
    assert from_hf_weights.main(["--input-hf", str(tmp_path / "hf"), "--output-ckpt", ckpt_dir]) == 0
    assert to_hf_weights.main(["--input-ckpt", ckpt_dir, "--output-path", out_dir, "--dtype", "fp32"]) == 0
    with remote.local_copy(out_dir) as local:
        assert json.load(open(f"{local}/config.json"))["model_type"] == "gptj"
        reloaded = GPTJForCausalLM.from_pretrained(local).eval()
        tokens = random_tokens((1, 7), 101, seed=6)
        np.testing.assert_array_equal(hf_logits(reloaded, tokens), hf_logits(torch_model, tokens))


def test_bad_inputs_exit_2_with_a_message(tmp_path, capsys):
    assert from_hf_weights.main(["--input-hf", str(tmp_path), "--output-ckpt", str(tmp_path / "c")]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert to_hf_weights.main(["--input-ckpt", str(tmp_path / "none"), "--output-path", str(tmp_path / "o")]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
