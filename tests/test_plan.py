"""The planner: parameter counts, the split of compiled per-device memory, ZeRO savings, the CLI."""
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from mesh_transformer import models
from mesh_transformer import plan as planner
from mesh_transformer.config import ConfigError, config_from_dict, load_config
from tests.helpers import refusal

ROOT = Path(__file__).resolve().parents[1]

# configs/6B_roto_256.json of the original (GPT-J-6B as trained on a v3-256).
GPTJ_6B = {
    "layers": 28, "d_model": 4096, "n_heads": 16, "n_vocab": 50400, "norm": "layernorm", "pe": "rotary",
    "pe_rotary_dims": 64, "seq": 2048, "cores_per_replica": 8, "per_replica_batch": 1,
    "gradient_accumulation_steps": 16, "warmup_steps": 3000, "anneal_steps": 300000, "lr": 1.2e-4,
    "end_lr": 1.2e-5, "weight_decay": 0.1, "total_steps": 350000, "tpu_size": 256,
    "bucket": "neo-models", "model_dir": "mesh_jax_pile_6B_rotary", "train_set": "pile.train.index",
    "val_set": {"pile": "pile.val.index"}, "val_batches": 100, "val_every": 500, "ckpt_every": 500,
    "keep_every": 10000, "name": "GPT3_6B_pile_rotary", "comment": "",
}
HF_GPTJ_6B_PARAMS = 6_050_882_784
MODEL_CARD_GPTJ_6B_PARAMS = 6_053_381_344

TINY = {"layers": 2, "d_model": 64, "n_heads": 4, "n_vocab": 100, "seq": 16, "cores_per_replica": 2,
        "per_replica_batch": 2, "gradient_accumulation_steps": 3}
DP, MP = 4, 2


def write_config(tmp_path, raw, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return str(path)


@pytest.mark.parametrize("overrides", [{}, {"pe": "fixed", "norm": "rmsnorm", "d_ff": 96, "d_head": 8}])
def test_n_params_counts_the_initialised_model(overrides):
    m = config_from_dict({**TINY, **overrides}).model
    params = jax.jit(models.build(m).init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    padding = (m.padded_vocab() - m.n_vocab) * (2 * m.d_model + 1)  # embedding rows, head columns, head bias
    assert padding > 0
    real = sum(x.size for x in jax.tree.leaves(params)) - padding
    assert m.n_params() == real


def test_6B_flops_per_token_is_the_published_formula():
    """PaLM (appendix B) for GPT-J-6B at seq 2048: 6 x (28 layers x (4 d^2 + 2 d d_ff) + d x 50,400) matmul
    FLOPs plus 3 x 28 x 2 x 2 x 2048 x 4096 for attention's QK^T and AV (forward and backward)."""
    matmul = 6 * (28 * (4 * 4096 * 4096 + 2 * 4096 * 16384) + 4096 * 50400)
    attention = 3 * 28 * 2 * 2 * 2048 * 4096
    assert (matmul, attention) == (35_061_497_856, 2_818_572_288)
    assert config_from_dict(GPTJ_6B).model.flops_per_token() == matmul + attention == 37_880_070_144


def test_a_sliding_window_counts_its_keys_not_the_context():
    """Mistral-7B's shape at seq 8,192 with its 4,096-token window: attention's term counts 4,096 keys."""
    mistral = dict(family="llama", layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336, n_vocab=32000,
                   seq=8192)
    full = config_from_dict(mistral).model.flops_per_token()
    windowed = config_from_dict({**mistral, "sliding_window": 4096}).model.flops_per_token()
    assert full - windowed == 3 * 32 * 2 * 2 * (8192 - 4096) * 4096 == 6_442_450_944


def test_per_layer_windows_count_each_layers_keys():
    """Gemma 3 1B at seq 8,192: 22 sliding layers see 512 keys, the 4 full ones all 8,192."""
    gemma = load_config("configs/gemma3_1b.json").model
    every_layer_full = dataclasses.replace(gemma, layer_types=None, sliding_window=None)
    n_heads_dims = 4 * 256
    assert every_layer_full.flops_per_token() - gemma.flops_per_token() == 3 * 22 * 2 * 2 * (8192 - 512) * n_heads_dims

def test_6B_counts_hf_and_explains_the_model_card():
    m = config_from_dict(GPTJ_6B).model
    assert m.n_params() == models.build(m, 8).n_params() == HF_GPTJ_6B_PARAMS
    # The original stored per-shard copies (mp=8): each LayerNorm (28 + final) 8 times, each layer's
    # fc_out bias 8 times (summed), and an 8-times per-shard bias on the embedding projection.
    shards, d = 8, m.d_model
    copies = (shards - 1) * (m.layers * 2 * d + 2 * d) + (shards - 1) * m.layers * d + shards * d
    assert copies == 2_498_560
    assert m.n_params() + copies == MODEL_CARD_GPTJ_6B_PARAMS


@pytest.fixture(scope="module")
def tiny_plans():
    config = config_from_dict(TINY)
    return {zero: planner.plan(config, DP, MP, zero) for zero in (False, True)}


@pytest.mark.parametrize("zero", [False, True])
def test_compiled_arguments_split_into_params_opt_state_batch(tiny_plans, zero):
    p = tiny_plans[zero]
    b, c = p.bytes_per_device, p.compiled
    assert b["params"] + b["opt_state"] + b["batch"] == c["argument_size_in_bytes"]
    assert b["params"] + b["opt_state"] == c["alias_size_in_bytes"]  # the donated TrainState is reused
    assert b["opt_state"] == 2 * b["params"] + 8  # Adam mu and nu, Adam's count and the step (int32)
    assert b["batch"] == 3 * 2 * (16 + 1) * 4  # [A, B/dp, T+1] int32 tokens on each device
    assert b["temporaries"] == c["temp_size_in_bytes"] > 0
    assert b["total"] == sum(v for k, v in b.items() if k != "total")


def test_megatron_params_per_device(tiny_plans):
    m = config_from_dict(TINY).model
    p = tiny_plans[False]
    d, f, v = m.d_model, m.ff_dim, m.padded_vocab(MP)
    split = m.layers * (4 * d * d + 2 * d * f + f) + 2 * d * v + v  # matrices, fc_in bias, vocab
    replicated = m.layers * (2 * d + d) + 2 * d  # LayerNorms and fc_out biases
    assert p.bytes_per_device["params"] == 4 * (split // MP + replicated)
    assert (p.n_params, p.dp, p.mp, p.zero) == (m.n_params(), DP, MP, False)
    assert p.tokens_per_step == 3 * 2 * DP * 16
    assert p.flops_per_token == m.flops_per_token()


def test_zero_divides_params_and_opt_state_by_dp(tiny_plans):
    state = {z: p.bytes_per_device["params"] + p.bytes_per_device["opt_state"] for z, p in tiny_plans.items()}
    ratio = state[False] / state[True]
    # Only the few vectors with no 'embed' axis (fc_in and lm_head biases) stay whole on every dp rank.
    assert 0.9 * DP < ratio <= DP
    assert tiny_plans[True].bytes_per_device["total"] < tiny_plans[False].bytes_per_device["total"]


def test_fits_and_table(tiny_plans):
    p = tiny_plans[False]
    assert p.fits(1) and not p.fits(p.bytes_per_device["total"] / planner.GiB / 2)
    out = p.to_json([16, 0.5])
    assert out["fits"] == {"16": True, "0.5": True}
    assert out["flops_per_step"] == p.flops_per_token * p.tokens_per_step
    text = planner.format_plan(p, "tiny.json", [16])
    assert "dp=4 x mp=2" in text and f"{p.n_params:,}" in text and "16 GiB: yes" in text


def test_cli_6B_plan_on_256_simulated_devices(tmp_path):
    path = write_config(tmp_path, GPTJ_6B)
    run = subprocess.run([sys.executable, "-m", "mesh_transformer.plan", "--config", path, "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert (out["n_params"], out["dp"], out["mp"], out["zero"]) == (HF_GPTJ_6B_PARAMS, 32, 8, False)
    assert out["flops_per_token"] == config_from_dict(GPTJ_6B).model.flops_per_token()
    b = out["bytes_per_device"]
    assert set(b) >= {"params", "opt_state", "temporaries", "total"} and all(isinstance(v, int) for v in b.values())
    # float32 master weights split 8 ways; the vocabulary padding and unsplit LayerNorms add ~0.05%.
    assert b["params"] == pytest.approx(4 * HF_GPTJ_6B_PARAMS / 8, rel=2e-3)
    assert b["opt_state"] == 2 * b["params"] + 8
    assert b["batch"] == 16 * 1 * 2049 * 4
    assert out["fits"] == {g: b["total"] <= int(g) * 2**30 for g in ("16", "32", "80")}


def test_main_replans_in_a_fresh_process_when_devices_are_missing(tmp_path, capfd):
    """This process has 8 devices; 256 need a subprocess. ZeRO splits the state over all of them."""
    path = write_config(tmp_path, GPTJ_6B)
    assert jax.device_count() < 256
    assert planner.main(["--config", path, "--zero", "--json"]) == 0
    out = json.loads(capfd.readouterr().out)
    b = out["bytes_per_device"]
    assert out["zero"] is True and out["dp"] * out["mp"] == 256
    assert b["params"] == pytest.approx(4 * HF_GPTJ_6B_PARAMS / 256, rel=5e-3)
    assert b["opt_state"] == 2 * b["params"] + 8


def test_a_fresh_process_short_of_devices_says_so_instead_of_starting_another(tmp_path, capsys, monkeypatch):
    """The fresh planner process must not start yet another one (a fork bomb took CI's memory)."""
    monkeypatch.setenv(planner.FRESH_ENV, "1")
    assert planner.main(["--config", write_config(tmp_path, GPTJ_6B)]) == 2
    assert "could not get 256 devices" in capsys.readouterr().err


@pytest.mark.parametrize("raw, flags, names", [
    ({**TINY, "n_head": 4}, [], "'n_head'"),  # unknown key
    ({**TINY, "n_heads": 2}, ["--mp", "4"], "'n_heads'"),  # 2 heads over mp=4
    ({**TINY, "tpu_size": 8}, ["--mp", "3"], "'tpu_size'"),  # no dp for 8 devices in groups of 3
    (TINY, ["--dp", "0"], "--dp"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, raw, flags, names):
    path = write_config(tmp_path, raw)
    assert planner.main(["--config", path, *flags]) == 2
    err = capsys.readouterr().err
    assert names in err and err.startswith("error: ") and err.count("\n") == 1


def test_plan_needs_the_devices(tiny_plans):
    with pytest.raises(ConfigError, match="needs 128 devices"):
        planner.plan(config_from_dict(TINY), 64, 2)


def test_cli_missing_config_exits_2_without_traceback(tmp_path):
    missing = str(tmp_path / "nope.json")
    run = subprocess.run([sys.executable, "-m", "mesh_transformer.plan", "--config", missing],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == f"error: config file not found: {missing}\n"


def test_a_device_memory_of_no_bytes_is_one_error_naming_the_flag(capsys):
    argv = ["--config", "/no/such/config.json", "--device-memory", "16", "--device-memory", "-1"]
    assert refusal(planner.main, argv, capsys).endswith("error: --device-memory must be above 0 GiB; got 16 -1\n")


def test_lora_plan_names_xla_cpus_float32_copy_of_a_bf16_base():
    """XLA:CPU multiplies bf16 in float32, converting the whole frozen base once a step: that copy
    (2x the bf16 base) is in the CPU temporaries, and is about all that separates them from float32's."""
    raw = dict(layers=2, d_model=256, n_heads=4, n_vocab=256, seq=8, pe_rotary_dims=16, remat="full",
               per_replica_batch=1, cores_per_replica=1, lora={"rank": 4, "alpha": 8, "targets": "all-linear"})
    low, full = (planner.plan(config_from_dict({**raw, "compute_dtype": d}), 1, 1) for d in ("bfloat16", "float32"))
    base = low.bytes_per_device["frozen_base"]
    assert low.cpu_upcast_bytes == 2 * base and full.cpu_upcast_bytes == 0
    assert low.bytes_per_device["temporaries"] >= low.cpu_upcast_bytes
    assert low.bytes_per_device["temporaries"] - low.cpu_upcast_bytes <= 1.1 * full.bytes_per_device["temporaries"]
    assert low.fits((low.bytes_per_device["total"] - low.cpu_upcast_bytes) / 2**30)
    # a classifier has no language-model head: its embedding table is gathered from, not widened
    clf = planner.plan(config_from_dict({**raw, "compute_dtype": "bfloat16", "n_vocab": 4096, "num_labels": 3,
                                         "classify": {}}), 1, 1)
    table = 4096 * 256 * 2
    assert clf.cpu_upcast_bytes == 2 * (clf.bytes_per_device["frozen_base"] - table)
    assert clf.cpu_upcast_bytes <= clf.bytes_per_device["temporaries"] < 2 * clf.bytes_per_device["frozen_base"]


def test_dpo_plan_counts_the_reference_and_its_forward():
    """Full DPO holds a frozen reference copy (compute dtype, sharded like the params) as an input of the
    step, counted apart; a microbatch is per_replica_batch pairs (twice the sequences); the reference's
    forward adds a third to the FLOPs per token. KTO holds the reference too; its microbatch is examples and
    their KL rows, which run forward only (policy and reference), so a step's FLOPs are a plain step's on
    as many rows, or 2/3 of them where the loss reads no KL row. ORPO (as CPO/SimPO) has no reference."""
    from mesh_transformer import parallel
    from mesh_transformer.train import preference
    from mesh_transformer.train.step import Trainer
    raw = {**TINY, "compute_dtype": "bfloat16"}
    plain, dpo, kto = (planner.plan(config_from_dict({**raw, **extra}), DP, MP)
                       for extra in ({}, {"dpo": {"beta": 0.1}}, {"kto": {}}))
    assert "reference" not in plain.bytes_per_device
    assert dpo.bytes_per_device["reference"] == kto.bytes_per_device["reference"] == plain.bytes_per_device["params"] // 2
    assert dpo.tokens_per_step == kto.tokens_per_step == 2 * plain.tokens_per_step
    assert dpo.flops_per_token == plain.flops_per_token * 4 // 3 and kto.flops_per_token == plain.flops_per_token
    # the objectives planned on the same model without compiling again: their forwards per two rows
    forwards = {key: planner._forwards_per_two_rows(preference.objective(config_from_dict({**raw, **extra}).train))
                for key, extra in {"plain": {}, "orpo": {"orpo": {"beta": 0.1}},
                                   "apo": {"kto": {"loss_type": "apo_zero_unpaired"}}}.items()}
    assert forwards == {"plain": 6, "orpo": 6, "apo": 4}
    orpo, lm = (Trainer(config_from_dict({**raw, **extra}), parallel.make_mesh(MP, DP)) for extra in ({"orpo": {"beta": 0.1}}, {}))
    assert not orpo.holds_reference and not orpo.base and orpo.global_batch == 2 * lm.global_batch


@pytest.mark.parametrize("objective", [None, "dpo", "cpo", "orpo", "kto"])
def test_dpo_flag_plans_the_configs_own_objective(objective):
    """--dpo on a config without an objective plans DPO; on one that sets DPO, CPO, ORPO or KTO it plans that
    one (ORPO keeps having no reference) rather than calling the two objectives a conflict."""
    raw = {**TINY, **({objective: {"beta": 0.2}} if objective else {})}
    args = planner._parser().parse_args(["--config", "c.json", "--dpo"])
    planned = planner._with_flags(config_from_dict(raw), args).train
    assert planned.preferences == ((objective or "dpo"),)
    assert getattr(planned, objective or "dpo") == ({"beta": 0.2} if objective else {})


def test_loss_chunk_flag_plans_the_head_and_loss_in_chunks(tmp_path, capsys):
    """--loss-chunk N plans the config with its loss_chunk set to N (0 turns a config's off): a
    4,096-token vocabulary over 1,024 tokens a device, in chunks of 128, holds less than the
    [1024, 4096] float32 logits' worth of temporaries fewer; a negative N is the key's one-line error."""
    path = write_config(tmp_path, {**TINY, "n_vocab": 4096, "seq": 256, "per_replica_batch": 4,
                                   "cores_per_replica": 1, "loss_chunk": 512})
    temporaries = {}
    for n in (0, 128):
        assert planner.main(["--config", path, "--dp", "1", "--mp", "1", "--loss-chunk", str(n), "--json"]) == 0
        temporaries[n] = json.loads(capsys.readouterr().out)["bytes_per_device"]["temporaries"]
    assert temporaries[0] - temporaries[128] > 1024 * 4096 * 4, temporaries
    assert planner.main(["--config", path, "--loss-chunk", "-1"]) == 2
    assert capsys.readouterr().err.startswith("error: config key 'loss_chunk': must be a whole number of tokens")
