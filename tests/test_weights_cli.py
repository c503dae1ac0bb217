"""from_hf_weights.py / to_hf_weights.py: HF -> our checkpoint -> HF is lossless, locally and on gs://."""
import json

import numpy as np
import pytest

import from_hf_weights
import to_hf_weights
from mesh_transformer.io.checkpoint import CheckpointManager
from tests.helpers import hf_logits, make_hf_gptj, make_hf_model, one_device_env, random_tokens, refusal, word_tokenizer


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


SPECIAL = {"bos_token_id": 3, "eos_token_id": [4, 5], "pad_token_id": 6}


def _special(directory) -> dict:
    return {k: v for k, v in json.load(open(f"{directory}/config.json")).items() if k in SPECIAL}


def test_export_names_the_special_tokens_of_the_model_it_came_from(tmp_path):
    """A Llama-shaped model whose bos/eos/pad are not LlamaConfig's defaults (1/2/none; Llama 3's
    are 128000 and 128001/128009) keeps them through import and export, and its generation config
    (the eos ids `generate` and vLLM stop on) comes back byte for byte. A checkpoint with no
    generation config (trained from scratch) takes the ids its kept tokenizer names."""
    from transformers import AutoModelForCausalLM
    make_hf_model(tmp_path / "hf", "llama_gqa2_llama3_rope", **SPECIAL)
    word_tokenizer(tmp_path / "hf")  # eos "w0" = 0; no bos, no pad
    assert from_hf_weights.main(["--input-hf", str(tmp_path / "hf"), "--output-ckpt", str(tmp_path / "ckpt")]) == 0
    assert to_hf_weights.main(["--input-ckpt", str(tmp_path / "ckpt"), "--output-path", str(tmp_path / "out"),
                               "--dtype", "fp32"]) == 0
    assert _special(tmp_path / "hf") == _special(tmp_path / "out") == SPECIAL
    generation = (tmp_path / "hf" / "generation_config.json").read_bytes()
    assert (tmp_path / "out" / "generation_config.json").read_bytes() == generation
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out").generation_config.eos_token_id == [4, 5]

    (tmp_path / "ckpt" / "generation_config.json").unlink()
    assert to_hf_weights.main(["--input-ckpt", str(tmp_path / "ckpt"), "--output-path", str(tmp_path / "out2"),
                               "--dtype", "fp32"]) == 0
    assert _special(tmp_path / "out2")["eos_token_id"] == 0  # the tokenizer's, not LlamaConfig's 2

    # A tokenizer that does not load costs its ids, not the export.
    (tmp_path / "ckpt" / "generation_config.json").write_bytes(generation)
    (tmp_path / "ckpt" / "tokenizer.json").write_text("{")
    with pytest.warns(UserWarning, match="the tokenizer beside the weights does not load"):
        assert to_hf_weights.main(["--input-ckpt", str(tmp_path / "ckpt"), "--output-path", str(tmp_path / "out3"),
                                   "--dtype", "fp32"]) == 0
    assert _special(tmp_path / "out3") == SPECIAL


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
    # at parse time (0 or less wrote one file per tensor)
    argv = ["--input-ckpt", "c", "--output-path", str(tmp_path / "o"), "--max-shard-gb", "0"]
    assert refusal(to_hf_weights.main, argv, capsys).endswith("error: --max-shard-gb must be above 0; got 0\n")
    assert not (tmp_path / "o").exists()


_PEAK_RSS = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL, "
             "stderr=subprocess.DEVNULL); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)")


def _export_peak_rss(ckpt_dir, out_dir) -> int:
    """Peak resident bytes of `to_hf_weights.py` run alone (a fresh interpreter is its only child)."""
    import os
    import subprocess
    import sys
    env = one_device_env()  # one CPU device, as a user runs it
    run = subprocess.run([sys.executable, "-c", _PEAK_RSS, sys.executable, "to_hf_weights.py", "--input-ckpt",
                          str(ckpt_dir), "--output-path", str(out_dir), "--dtype", "fp16"],
                         capture_output=True, text=True, env=env, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert run.returncode == 0, run.stderr
    return int(run.stdout)


def test_export_peak_memory_is_about_twice_the_parameters(tmp_path):
    """A 67M-parameter checkpoint with its optimizer state (3x the parameters on disk): the export's peak RSS
    above the same tool on a tiny checkpoint stays under 2.6x the float32 parameters (measured 2.0-2.3x
    over runs of the suite: the restore's read buffers plus the parameters; one fp16 tensor at a time
    after that). A second full copy of the weights (3x) or reading the Adam moments (4x) would exceed it."""
    import jax
    from mesh_transformer.train.step import Trainer
    from tests.helpers import mesh, tiny_config

    sizes = {}
    for name, shape in [("tiny", {}), ("big", {"layers": 4, "d_model": 1024, "n_heads": 16, "d_ff": 4096,
                                               "n_vocab": 8192, "seq": 64})]:
        config = tiny_config(**shape)
        state = Trainer(config, mesh(1, 1)).init_state(0)
        with CheckpointManager(str(tmp_path / name), config=config) as ckpt:
            ckpt.save(1, state, wait=True)
        sizes[name] = sum(x.nbytes for x in jax.tree.leaves(state.params))
        del state
    assert sizes["big"] > 250 * 2**20
    baseline = _export_peak_rss(tmp_path / "tiny", tmp_path / "tiny-hf")
    peak = _export_peak_rss(tmp_path / "big", tmp_path / "big-hf")
    assert peak - baseline < 2.6 * sizes["big"], (peak - baseline) / sizes["big"]
