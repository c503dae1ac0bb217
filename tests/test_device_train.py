"""device_train.py end to end, as a user runs it: subprocesses, real signals, real checkpoints."""
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest

from mesh_transformer import loading
from mesh_transformer.config import ConfigError, load_config
from mesh_transformer.data import Dataset, Loader, Mixture
from mesh_transformer.generate import Generator, SamplingOptions
from mesh_transformer.io.checkpoint import CheckpointManager
from mesh_transformer.train.loop import open_datasets, train_loader
from mesh_transformer.train.step import Trainer
from tests.helpers import make_hf_gptj, max_abs_diff, mesh, refusal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = dict(layers=2, d_model=32, n_heads=4, n_vocab=50257, seq=32, pe_rotary_dims=4, compute_dtype="float32",
             remat="none")
TRAIN = dict(cores_per_replica=2, tpu_size=8, per_replica_batch=2, warmup_steps=2, anneal_steps=20, lr=3e-3,
             end_lr=3e-4, total_steps=6, ckpt_every=2, name="test")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    for src, name in [("data/corpus/stories.txt", "train"), ("data/val/stories.txt", "val")]:
        subprocess.run([sys.executable, "create_finetune_dataset.py", src, name, "--output-dir", str(out), "--seq", "32"],
                       cwd=ROOT, check=True, capture_output=True)
    return out


def write_config(path, dataset, **overrides):
    config = {**MODEL, **TRAIN, "train_set": str(dataset / "train.index.json"),
              "val_set": {"held_out": str(dataset / "val.index.json")}, "model_dir": str(path / "ckpt"), **overrides}
    (path / "config.json").write_text(json.dumps(config))
    return path / "config.json"


def device_train(config, *args, wait=True, **kwargs):
    cmd = [sys.executable, "device_train.py", "--config", str(config), "--cpu-devices", "8", "--no-tensorboard",
           "--log-dir", str(config.parent / "logs"), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)
    if not wait:
        return proc
    out, _ = proc.communicate(timeout=600)
    return proc.returncode, out


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A random HF GPT-J with the tests' shapes, initialised at 0.2 so its loss is far from ln(50257)."""
    path = tmp_path_factory.mktemp("hf")
    return path, make_hf_gptj(path, vocab_size=50257, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64,
                              initializer_range=0.2)


def torch_first_batch_loss(config_path, torch_model) -> float:
    """The torch model's mean next-token loss on the first batch the run's loader yields."""
    import torch
    config = load_config(config_path)
    t, seq = config.train, config.model.seq
    global_batch = t.per_replica_batch * t.tpu_size // t.cores_per_replica
    loader = Loader(Dataset.open(t.train_set), global_batch, t.seed, accumulation=t.gradient_accumulation_steps)
    tokens = torch.tensor(loader.batch_at(0)["tokens"][..., : seq + 1].reshape(-1, seq + 1), dtype=torch.long)
    with torch.no_grad():
        logits = torch_model(tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), tokens[:, 1:].reshape(-1))
    assert abs(float(loss) - np.log(50257)) > 0.5  # a random init (loss ~ ln V) could not pass for it
    return float(loss)


def full_state(config_path, step):
    config = load_config(config_path)
    trainer = Trainer(config, mesh(1, 1))
    state, _ = CheckpointManager(config.train.model_dir, read_only=True).restore(
        step, abstract_state=trainer.abstract_state, target_shardings=trainer.state_shardings)
    return jax.device_get(state)

MATRICES = {"embeddings", "q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out", "lm_head"}  # decayed


def flat(tree) -> dict:
    return {f"{m}/{n}": np.asarray(v, np.float64) for m, leaves in tree.items() for n, v in leaves.items()}


def adam_moments(state):
    return tuple(flat(optax.tree_utils.tree_get(state.opt_state, name)) for name in ("mu", "nu"))


def adam_count(state) -> int:
    return int(optax.tree_utils.tree_get(state.opt_state, "count"))


def final_params(config_path, step=None):
    config = load_config(config_path)
    trainer = Trainer(config, mesh(1, 1))
    ckpt = CheckpointManager(config.train.model_dir, read_only=True)
    params = ckpt.restore_params(step, abstract_params=trainer.abstract_state.params,
                                 target_shardings=trainer.state_shardings.params)
    return jax.device_get(params)


def metrics(config_path):
    with open(config_path.parent / "logs" / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def uninterrupted(dataset, tmp_path_factory):
    path = tmp_path_factory.mktemp("reference")
    config = write_config(path, dataset, val_every=3)
    code, out = device_train(config)
    assert code == 0, out
    return config, out


def test_trains_validates_checkpoints_and_logs(uninterrupted):
    config, out = uninterrupted
    rows = metrics(config)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[-1]["train/loss"] < rows[0]["train/loss"] - 0.3
    assert [r["step"] for r in rows if "val/loss_held_out" in r] == [3, 6]
    assert rows[-1]["tokens_processed"] == 6 * 8 * 32 and rows[0]["learning_rate"] == 0.0
    ckpt = CheckpointManager(load_config(config).train.model_dir, read_only=True)
    assert ckpt.all_steps() == [4, 6]  # ckpt_every 2, keep the last 2
    assert ckpt.extras()["train_loader"]["position"] == 6 * 8


def test_kill_during_checkpoint_save_then_resume_matches_uninterrupted(uninterrupted, dataset, tmp_path):
    reference_config, _ = uninterrupted
    config = write_config(tmp_path, dataset, val_every=3)
    ckpt_dir = str(tmp_path / "ckpt")
    proc = device_train(config, wait=False)
    deadline = time.time() + 300
    while not glob.glob(f"{ckpt_dir}/step_4.orbax-checkpoint-tmp*"):  # the step-4 save is being written
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ckpt = CheckpointManager(ckpt_dir, read_only=True)
    assert ckpt.all_steps() == [2]  # the half-written step 4 is never picked
    code, out = device_train(config)
    assert code == 0 and "step 2 of 6" in out, out
    ours, reference = final_params(config), final_params(reference_config)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(reference)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(dataset, tmp_path):
    config = write_config(tmp_path, dataset, lr=1e30, end_lr=1e30, warmup_steps=0, ckpt_every=1, total_steps=20)
    code, out = device_train(config)
    assert code == 2 and ("loss is nan" in out or "loss is inf" in out), out
    ckpt = CheckpointManager(str(tmp_path / "ckpt"), read_only=True)
    last_good = ckpt.latest_step()
    assert last_good is not None and f"last good checkpoint: step {last_good}" in out
    params = final_params(config, last_good)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))


def test_ctrl_c_saves_a_checkpoint(dataset, tmp_path):
    config = write_config(tmp_path, dataset, total_steps=10_000, ckpt_every=0)
    proc = device_train(config, wait=False)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 3/"):
            proc.send_signal(signal.SIGINT)
            break
    out = "".join(lines) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    steps = CheckpointManager(str(tmp_path / "ckpt"), read_only=True).all_steps()
    assert len(steps) == 1 and 3 <= steps[0] < 10_000 and f"interrupted: saving step {steps[0]}" in out


def test_fine_tune_from_hf_starts_from_those_weights_and_lowers_loss(dataset, hf_model, tmp_path):
    path, torch_model = hf_model
    config = write_config(tmp_path, dataset, total_steps=8, warmup_steps=0, lr=1e-2, val_every=8)
    code, out = device_train(config, "--hf", str(path))
    assert code == 0, out
    rows = metrics(config)
    assert rows[0]["learning_rate"] == pytest.approx(1e-2)  # fresh schedule, no warmup
    # Step 1's loss is computed before the update: the HF model's loss on the loader's first batch.
    assert rows[0]["train/loss"] == pytest.approx(torch_first_batch_loss(config, torch_model), rel=1e-5)
    assert rows[-1]["train/loss"] < rows[0]["train/loss"] - 1.0
    assert rows[-1]["val/loss_held_out"] < rows[0]["train/loss"]
    # The HF model's generation config is kept with the checkpoints; an export names its special
    # tokens (0, as make_hf_gptj sets them), not GPTJConfig's default 50256.
    kept = tmp_path / "ckpt" / "generation_config.json"
    assert kept.read_bytes() == (path / "generation_config.json").read_bytes()
    from mesh_transformer.io import hf
    hf.checkpoint_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "export"), dtype="fp32")
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (0, 0)


def test_bad_config_is_one_clear_line(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({**MODEL, "layres": 3}))
    code, out = device_train(tmp_path / "c.json")
    assert code == 2 and out.strip().endswith("unknown config key 'layres' (did you mean 'layers'?)"), out


def test_a_mixture_of_datasets_trains_in_its_proportions_and_resumes_only_with_them(dataset, tmp_path):
    """`train_set` as {index path: weight}: stories (plain text) and question/answer examples (masked,
    one example a row at most) three to one; each batch of 8 holds the parts in about that share
    (an epoch exactly), the checkpoint's loader position names the mixture, and a resume with
    other weights is one clear line, not a traceback; one dataset named twice (two spellings of its
    path) is refused."""
    subprocess.run([sys.executable, "create_finetune_dataset.py", "data/qa.jsonl", "qa", "--output-dir",
                    str(tmp_path / "data"), "--seq", "32"], cwd=ROOT, check=True, capture_output=True)
    stories, qa = str(dataset / "train.index.json"), str(tmp_path / "data" / "qa.index.json")
    config = write_config(tmp_path, dataset, train_set={stories: 3, qa: 1}, total_steps=4, val_every=4)
    code, out = device_train(config)
    assert code == 0, out
    rows = metrics(config)
    assert rows[-1]["train/loss"] < rows[0]["train/loss"] and "val/loss_held_out" in rows[-1]
    assert f"{stories} " in out and "(75%, " in out and f"{qa} " in out and "(25%, " in out  # the shares, said
    position = CheckpointManager(str(tmp_path / "ckpt"), read_only=True).extras()["train_loader"]
    sizes = [len(Dataset.open(path)) for path in (stories, qa)]
    assert [part[:2] for part in position["mixture"]] == [[sizes[0], 2327], [sizes[1], 775]]  # rows, an epoch's
    assert position["position"] == 4 * 8 and sum(sizes) == 2327 + 775
    loader = train_loader(load_config(config), Mixture([Dataset.open(stories), Dataset.open(qa)], [3, 1],
                                                       [stories, qa]), 8)
    masked = [int((b["mask"].reshape(8, -1).min(-1) == 0).sum()) for b in (next(loader) for _ in range(4))]
    loader.close()
    assert 0 < sum(masked) < 16  # the answers' rows (masked but for their answers) are a minority
    twice = {stories: 1, os.path.join(os.path.dirname(stories), ".", os.path.basename(stories)): 1}
    with pytest.raises(ConfigError, match=re.escape(f"config key 'train_set': {stories!r} and ")):  # name the same
        open_datasets(load_config(write_config(tmp_path, dataset, train_set=twice)))
    write_config(tmp_path, dataset, train_set={stories: 1, qa: 1}, total_steps=6)
    code, out = device_train(config)
    assert code == 2 and out.strip().splitlines()[-1].startswith(
        "error: config key 'train_set': the checkpoint's place in its training data (loader state has mixture="), out


def test_bad_flags_are_one_clear_line_before_training(dataset, tmp_path, capsys):
    """A device count or sample length no run can use stops at once, naming the flag: --sample-tokens
    past the context is found before the steps, not after them."""
    import device_train as script
    for flags, message in ((["--cpu-devices", "-3"], "--cpu-devices must be at least 1; got -3"),
                           (["--sample-tokens", "0"], "--sample-tokens must be at least 1; got 0")):
        assert f"error: {message}\n" in refusal(script.parse_args, ["--config", "c.json", *flags], capsys)
    code, out = device_train(write_config(tmp_path, dataset), "--sample", "The", "--sample-tokens", "32")
    assert code == 2 and out.strip().endswith("error: --sample-tokens 32: at most 31 for this model (its context is "
                                              "32 tokens, the prompt's included)"), out
    assert not (tmp_path / "ckpt").exists()


def test_fine_tune_an_imported_checkpoint_then_sample_from_it(dataset, hf_model, tmp_path):
    """from_hf_weights.py (params only) -> device_train --tune-model-path -> device_sample.py --ckpt."""
    path, torch_model = hf_model
    subprocess.run([sys.executable, "from_hf_weights.py", "--input-hf", str(path),
                    "--output-ckpt", str(tmp_path / "imported")], cwd=ROOT, check=True, capture_output=True)
    config = write_config(tmp_path, dataset, total_steps=3, warmup_steps=0)
    code, out = device_train(config, "--tune-model-path", str(tmp_path / "imported"))
    assert code == 0 and "step 0 of 3" in out, out
    assert metrics(config)[0]["train/loss"] == pytest.approx(torch_first_batch_loss(config, torch_model), rel=1e-5)
    assert os.path.exists(tmp_path / "ckpt" / "tokenizer.json")  # kept beside the checkpoints for the tools
    sample = subprocess.run([sys.executable, "device_sample.py", "--ckpt", str(tmp_path / "ckpt"), "--prompt",
                             "Snow had fallen", "--temperature", "0", "--max-new-tokens", "8", "--dtype", "float32"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert sample.returncode == 0, sample.stderr
    completion, status = sample.stdout.rstrip("\n").rsplit("\n", 1)
    assert status == "[8 tokens, finish: length]"
    # The same checkpoint (step 3, not the imported weights) generating in this process.
    model = loading.load(ckpt=str(tmp_path / "ckpt"), mp=1, dp=1, dtype="float32")
    [seq] = Generator(model.config, model.params, model.mesh).generate(
        [model.tokenizer.encode("Snow had fallen")], SamplingOptions(max_new_tokens=8, temperature=0.0),
        tokenizer=model.tokenizer)
    assert len(seq.tokens) == 8 and completion == seq.text


def test_fresh_opt_drops_exactly_the_restored_moments(uninterrupted, dataset, tmp_path):
    """One step from the reference run's step-6 state (params + Adam moments), with and without --fresh-opt:
    the same gradient g enters both, so mu differs by b1 x mu_6 and nu by b2 x nu_6; Adam's count restarts
    at 1 or continues at 7, and each run's update is AdamW with its own moments."""
    source_config, _ = uninterrupted
    source = load_config(source_config).train.model_dir
    states = {}
    for fresh in (False, True):
        run_dir = tmp_path / ("fresh" if fresh else "restored")
        run_dir.mkdir()
        config = write_config(run_dir, dataset, total_steps=1, warmup_steps=0, ckpt_every=1)
        code, out = device_train(config, "--tune-model-path", source, *(["--fresh-opt"] if fresh else []))
        assert code == 0, out
        states[fresh] = full_state(config, 1)
    start = full_state(source_config, 6)
    t = load_config(source_config).train
    (mu6, nu6), (mu_r, nu_r), (mu_f, nu_f) = (adam_moments(s) for s in (start, states[False], states[True]))
    assert (adam_count(states[False]), adam_count(states[True])) == (7, 1)
    for k in mu6:
        np.testing.assert_allclose(mu_r[k] - mu_f[k], t.b1 * mu6[k], rtol=1e-5, atol=1e-6 * np.abs(mu6[k]).max(), err_msg=k)
        np.testing.assert_allclose(nu_r[k] - nu_f[k], t.b2 * nu6[k], rtol=1e-5, atol=1e-6 * np.abs(nu6[k]).max(), err_msg=k)
    p6 = flat(start.params)
    for fresh, (mu, nu), count in [(False, (mu_r, nu_r), 7), (True, (mu_f, nu_f), 1)]:
        ours = flat(states[fresh].params)
        for k, p in p6.items():
            update = (mu[k] / (1 - t.b1**count)) / (np.sqrt(nu[k] / (1 - t.b2**count)) + t.eps)
            decay = t.weight_decay * p if k.rsplit("/", 1)[1] in MATRICES else 0
            error = np.abs(ours[k] - (p - t.lr * (update + decay)))  # allowed: 1e-5 lr + float32 rounding of p
            assert np.all(error <= 1e-5 * t.lr + 2.4e-7 * np.abs(p)), f"{k} fresh={fresh}: {error.max()}"
    assert max_abs_diff(states[False].params, states[True].params) > 1e-4  # the moments made a difference


def read_tensorboard_scalars(directory) -> dict:
    """{tag: {step: value}} from every TFRecord event file under `directory`, checking each record's CRCs."""
    import struct

    from tensorboardX.crc32c import crc32c
    from tensorboardX.proto.event_pb2 import Event

    def masked(data: bytes) -> int:
        crc = crc32c(data)
        return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    scalars: dict = {}
    files = glob.glob(f"{directory}/**/events.out.tfevents.*", recursive=True)
    assert files, f"no event files under {directory}"
    for path in files:
        data = open(path, "rb").read()
        at = 0
        while at < len(data):
            header = data[at: at + 8]
            (length,), (header_crc,) = struct.unpack("<Q", header), struct.unpack("<I", data[at + 8: at + 12])
            payload = data[at + 12: at + 12 + length]
            (payload_crc,) = struct.unpack("<I", data[at + 12 + length: at + 16 + length])
            assert header_crc == masked(header) and payload_crc == masked(payload), f"{path}: corrupt record at {at}"
            event = Event.FromString(payload)
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
            at += 16 + length
    return scalars


def test_tensorboard_plot_and_sample_outputs(dataset, tmp_path):
    """TensorBoard events hold what metrics.jsonl holds; --plot writes a real PNG; --sample prints the
    completions the final weights give in-process with the same options."""
    import struct

    import matplotlib.image

    config = write_config(tmp_path, dataset, total_steps=4, ckpt_every=4, val_every=2)
    prompts = ["Snow had fallen", "The old man"]
    cmd = [sys.executable, "device_train.py", "--config", str(config), "--cpu-devices", "8", "--log-dir",
           str(tmp_path / "logs"), "--plot", str(tmp_path / "loss.png"), "--sample-tokens", "12",
           *[a for p in prompts for a in ("--sample", p)]]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = metrics(config)
    scalars = read_tensorboard_scalars(tmp_path / "logs" / "tensorboard")
    for key in ("train/loss", "learning_rate", "grad_norm", "val/loss_held_out"):
        logged = {r["step"]: r[key] for r in rows if key in r}
        assert sorted(scalars[key]) == sorted(logged) and len(logged) >= 2, key
        np.testing.assert_allclose([scalars[key][s] for s in sorted(logged)], [logged[s] for s in sorted(logged)],
                                   rtol=1e-6)  # stored as float32
    png = (tmp_path / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert struct.unpack(">II", png[16:24]) == (840, 480)  # 7 x 4 inches at 120 dpi
    pixels = matplotlib.image.imread(tmp_path / "loss.png")
    assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 10  # axes, curves, labels: not blank
    assert f"loss curves: {tmp_path / 'loss.png'}" in run.stdout

    model = loading.load(ckpt=str(tmp_path / "ckpt"), mp=2, dp=4, dtype="float32")
    options = [SamplingOptions(max_new_tokens=12, temperature=0.7, top_p=0.9, seed=i,
                               eos_token_id=model.tokenizer.eos_token_id) for i in range(len(prompts))]
    expected = Generator(model.config, model.params, model.mesh).generate(
        [model.tokenizer.encode(p) for p in prompts], options, tokenizer=model.tokenizer)
    for prompt, seq in zip(prompts, expected):
        assert f"\n>>> {prompt}{seq.text}\n" in run.stdout + "\n"


@pytest.mark.parametrize("quantize_base", [None, "int8"])
def test_lora_kill_after_a_checkpoint_then_resume_matches_uninterrupted(quantize_base, dataset, hf_model, tmp_path):
    """LoRA on an HF base with FCM, LoRA dropout and document masking: SIGKILL once a checkpoint is
    on disk, resume (base re-read from the checkpoint's reference), and the adapters, optimizer state
    and losses of the steps after it equal an uninterrupted run's. int8: the base quantized as it is
    read, at the start and again on resume (its fingerprint the same)."""
    path, _ = hf_model
    lora = dict(lora={"rank": 4, "alpha": 8, "dropout": 0.1, "targets": ["q_proj", "v_proj", "fc_out"],
                      **({"quantize_base": quantize_base} if quantize_base else {})},
                fcm_max_ratio=0.3, fcm_min_ratio=0.1, document_masking=True, total_steps=10, warmup_steps=0,
                lr=1e-2, cores_per_replica=1, tpu_size=2)
    reference = write_config(tmp_path_factory_dir(tmp_path, "reference"), dataset, **lora)
    config = write_config(tmp_path_factory_dir(tmp_path, "killed"), dataset, **lora)
    straight = device_train(reference, "--hf", str(path), wait=False)  # side by side with the killed run
    ckpt_dir = str(config.parent / "ckpt")
    proc = device_train(config, "--hf", str(path), wait=False)
    deadline = time.time() + 300
    while not glob.glob(f"{ckpt_dir}/step_2") or glob.glob(f"{ckpt_dir}/step_2.orbax-checkpoint-tmp*"):
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    out = straight.communicate(timeout=600)[0]
    assert straight.returncode == 0, out
    killed_at = CheckpointManager(ckpt_dir, read_only=True).all_steps()[-1]
    assert 2 <= killed_at < 10  # the run really was cut short
    code, out = device_train(config, "--hf", str(path), "--sample", "Snow had fallen", "--sample-tokens", "8")
    assert code == 0 and f"step {killed_at} of 10" in out, out
    # --sample decodes with the adapters merged into the base, as the saved checkpoint loads
    model = loading.load(ckpt=ckpt_dir, mp=1, dp=2, dtype="float32")
    [expected] = Generator(model.config, model.params, model.mesh).generate(
        [model.tokenizer.encode("Snow had fallen")], [SamplingOptions(
            max_new_tokens=8, temperature=0.7, top_p=0.9, seed=0, eos_token_id=model.tokenizer.eos_token_id)],
        tokenizer=model.tokenizer)
    assert f"\n>>> Snow had fallen{expected.text}\n" in out + "\n", out[-2000:]
    ours, theirs = full_state(config, 10), full_state(reference, 10)
    assert set(ours.params) == set(theirs.params) and all("lora" in n for m in ours.params.values() for n in m)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # metrics.jsonl is appended to: the killed run's steps past its checkpoint, then the resumed run's
    losses = lambda rows: {r["step"]: r["train/loss"] for r in rows}  # noqa: E731  (last one wins)
    assert losses(metrics(config)) == losses(metrics(reference)) and len(losses(metrics(config))) == 10


def tmp_path_factory_dir(tmp_path, name):
    (tmp_path / name).mkdir()
    return tmp_path / name
