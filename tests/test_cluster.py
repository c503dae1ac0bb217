"""train.py's driver and Ray workers: 2 worker processes x 4 CPU devices form one dp=4 x mp=2 mesh.

One local Ray instance (loopback only) serves the module. The reference for every multi-host
number is the same config trained by `TrainRun` (device_train.py's loop) in this process, on its
8 simulated devices.
"""
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import time

import jax
import numpy as np
import pytest
import ray

import train as train_cli
from mesh_transformer.train import cluster
from mesh_transformer.io.checkpoint import CheckpointManager
from mesh_transformer.config import ConfigError, config_from_dict
from mesh_transformer.train.metrics import read_metrics
from mesh_transformer.train.loop import RunOptions, TrainRun
from mesh_transformer.train.step import Trainer
from tests.helpers import max_abs_diff, mesh, refusal

SEQ, VOCAB, STEPS = 32, 256, 8
# Across processes the all-reduces run over gloo, in another order than in one process: float32
# sums differ in the last bit (seen: losses up to 9e-8 relative, params up to 6e-8 after 8 steps).
LOSS_RTOL, PARAM_ATOL = 1e-6, 1e-6
COMPILE_CACHE = None  # set by the ray_local fixture
LOOPBACK_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
                "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
                "NO_PROXY": "127.0.0.1,localhost,::1", "no_proxy": "127.0.0.1,localhost,::1",
                "NO_GCE_CHECK": "true", "GCE_METADATA_HOST": "127.0.0.1:9", "GCE_METADATA_IP": "127.0.0.1:9"}


def write_dataset(directory, name, tokens) -> str:
    """A one-shard dataset on disk (what create_finetune_dataset.py writes); -> index path."""
    shard = f"{name}-00000.tokens.npy"
    np.save(directory / shard, tokens.astype(np.uint16))
    digest = hashlib.sha256((directory / shard).read_bytes()).hexdigest()
    index = {"format": "mesh-transformer-dataset", "version": 1, "name": name, "seq": tokens.shape[1] - 1,
             "dtype": "uint16", "eos_id": 0, "n_sequences": len(tokens), "has_mask": False,
             "shards": [{"tokens": shard, "mask": None, "n_sequences": len(tokens), "sha256": {"tokens": digest}}]}
    (directory / f"{name}.index.json").write_text(json.dumps(index))
    return str(directory / f"{name}.index.json")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("cluster-data")
    rng = np.random.default_rng(0)
    # 40 sequences, 8 per step: the 8-step run crosses an epoch boundary (reshuffle) at step 5.
    return {"train": write_dataset(d, "train", rng.integers(0, VOCAB, (40, SEQ + 1))),
            "val": write_dataset(d, "val", rng.integers(0, VOCAB, (16, SEQ + 1)))}


def make_config(data, model_dir, **overrides):
    return config_from_dict({
        "layers": 2, "d_model": 64, "n_heads": 4, "n_vocab": VOCAB, "seq": SEQ, "pe_rotary_dims": 8,
        "compute_dtype": "float32", "remat": "none", "cores_per_replica": 2, "tpu_size": 8, "per_replica_batch": 2,
        "warmup_steps": 2, "anneal_steps": 10, "lr": 3e-3, "end_lr": 3e-4, "total_steps": STEPS,
        "train_set": data["train"], "val_set": {"val": data["val"]}, "val_batches": 2, "val_every": 4,
        "ckpt_every": 2, "model_dir": str(model_dir), "name": "cluster-test", **overrides})


def options(tmp_path, **overrides):
    run = RunOptions(log_dir=str(tmp_path / "logs"), tensorboard=False, stop_after=overrides.pop("stop_after", None))
    # Every worker group compiles the same programs: a shared persistent cache makes restarts cheap.
    env = {"JAX_COMPILATION_CACHE_DIR": COMPILE_CACHE, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           **overrides.pop("worker_env", {})}
    return cluster.ClusterOptions(**{"local_hosts": 2, "startup_timeout": 240, "step_timeout": 60, "run": run,
                                     "worker_env": env, **overrides})


def logged(tmp_path, key="train/loss") -> dict:
    """{step: value} from metrics.jsonl (a replayed step keeps its last value)."""
    return {row["step"]: row[key] for row in read_metrics(tmp_path / "logs" / "metrics.jsonl") if key in row}


def final_params(config, model_dir):
    trainer = Trainer(config, mesh(1, 1))
    ckpt = CheckpointManager(str(model_dir), read_only=True)
    return jax.device_get(ckpt.restore_params(abstract_params=trainer.abstract_state.params,
                                              target_shardings=trainer.state_shardings.params))


@pytest.fixture(scope="module")
def ray_local(tmp_path_factory):
    global COMPILE_CACHE
    COMPILE_CACHE = str(tmp_path_factory.mktemp("jax-cache"))
    with pytest.MonkeyPatch.context() as mp:
        for key, value in LOOPBACK_ENV.items():
            mp.setenv(key, value)
        temp_dir = cluster.start_local_ray(2)
        try:
            yield
        finally:
            ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def two_hosts(ray_local, data, tmp_path_factory):
    """An uninterrupted 2-host run: its summary, logged losses and final params."""
    tmp = tmp_path_factory.mktemp("two-hosts")
    config = make_config(data, tmp / "ckpt")
    summary = cluster.ClusterRun(config, options(tmp)).train()
    return {"config": config, "summary": summary, "loss": logged(tmp), "val": logged(tmp, "val/loss_val"),
            "params": final_params(config, tmp / "ckpt")}


@pytest.fixture(scope="module")
def one_process(data, tmp_path_factory):
    """The same config trained by device_train.py's loop on this process's 8 devices."""
    tmp = tmp_path_factory.mktemp("one-process")
    config = make_config(data, tmp / "ckpt")
    state = TrainRun(config, RunOptions(log_dir=str(tmp / "logs"), tensorboard=False)).train()
    return {"loss": logged(tmp), "val": logged(tmp, "val/loss_val"), "params": jax.device_get(state.params)}


def test_two_hosts_train_like_one_process(two_hosts, one_process):
    s = two_hosts["summary"]
    assert (s.step, s.checkpoint, s.hosts, s.restarts, s.resumed_from) == (STEPS, STEPS, 2, 0, [0])
    assert sorted(two_hosts["loss"]) == list(range(1, STEPS + 1))
    steps = sorted(one_process["loss"])
    np.testing.assert_allclose([two_hosts["loss"][k] for k in steps], [one_process["loss"][k] for k in steps],
                               rtol=LOSS_RTOL)
    assert sorted(two_hosts["val"]) == sorted(one_process["val"]) == [4, 8]
    np.testing.assert_allclose(list(two_hosts["val"].values()), list(one_process["val"].values()), rtol=LOSS_RTOL)
    assert two_hosts["loss"][STEPS] < two_hosts["loss"][1] - 0.05  # it learned something
    assert max_abs_diff(two_hosts["params"], one_process["params"]) < PARAM_ATOL
    # The driver sends 8 rows x 33 uint16 tokens per step, all hosts together (no mask: all ones).
    assert s.bytes_per_step == 8 * 33 * 2


def test_resume_then_killed_worker_ends_as_if_uninterrupted(two_hosts, data, tmp_path):
    """Run 1 stops after 3 steps; run 2 (no --new) resumes there, loses worker 1 to SIGKILL just
    after asking for the step-6 checkpoint, restarts from the last complete one, and ends with
    the uninterrupted run's parameters: no step's data trained twice or skipped."""
    config = make_config(data, tmp_path / "ckpt")
    first = cluster.ClusterRun(config, options(tmp_path, new=True, stop_after=3)).train()
    assert (first.step, first.checkpoint) == (3, 3)

    niceness = []

    def kill_worker_1(run, step, values):
        if step == 4 and run.restarts == 0:
            niceness.append([os.getpriority(os.PRIO_PROCESS, pid) for pid in run.worker_pids])
        if step == 6 and run.restarts == 0:
            os.kill(run.worker_pids[1], signal.SIGKILL)

    summary = cluster.ClusterRun(config, options(tmp_path, max_restarts=2)).train(on_step=kill_worker_1)
    assert (summary.step, summary.checkpoint, summary.restarts) == (STEPS, STEPS, 1)
    assert summary.resumed_from[0] == 3 and summary.resumed_from[1] in (4, 6)  # 6 if its save finished in time
    assert "worker 1" in summary.failures[0] and "died" in summary.failures[0]
    # The hosts' workers run at this process's priority, not Ray's niceness 15 for workers.
    assert niceness == [[os.getpriority(os.PRIO_PROCESS, 0)] * 2]
    losses = logged(tmp_path)
    np.testing.assert_array_equal([losses[k] for k in range(1, STEPS + 1)],
                                  [two_hosts["loss"][k] for k in range(1, STEPS + 1)])
    assert max_abs_diff(final_params(config, tmp_path / "ckpt"), two_hosts["params"]) == 0.0


def test_hung_worker_is_detected_by_timeout_and_restarts_are_bounded(ray_local, data, tmp_path):
    config = make_config(data, tmp_path / "ckpt", val_every=0)
    opts = options(tmp_path, step_timeout=8, max_restarts=1, worker_env={cluster.TEST_HANG_ENV: "1:3"})
    run = cluster.ClusterRun(config, opts)
    with pytest.raises(cluster.ClusterError) as e:
        run.train()
    message = str(e.value)
    # Worker 0 waits in the step's collectives for worker 1, so neither answers; the timeout names both.
    assert "giving up after 1 restart(s) in a row without getting past step 2" in message
    assert "worker 1 (pid" in message and "did not finish step 3 within 8 s" in message
    assert run.restarts == 1 and run.resumed_from == [0, 2]  # restarted once, from the step-2 checkpoint
    # Both hangs were caught by the 8 s step timeout, the second too: start-up compiled the step, so the
    # first step after a restart is held to step_timeout, not startup_timeout.
    assert len(run.failures) == 2
    for failure in run.failures:
        assert "did not finish step 3 within 8 s" in failure
        assert 8.0 <= float(re.search(r"detected after ([0-9.]+) s", failure).group(1)) < 10.0


def test_worker_config_error_fails_fast_with_the_key(ray_local, data, tmp_path):
    config = make_config(data, tmp_path / "ckpt", tpu_size=16)  # the 2 hosts have 8 devices
    started = time.monotonic()
    with pytest.raises(cluster.ClusterError, match=r"worker [01] \(pid \d+ on 127.0.0.1\): setup: ConfigError: "
                                                   r"a dp=8 x mp=2 mesh needs 16 devices, only 8 are available"):
        cluster.ClusterRun(config, options(tmp_path, cpu_devices=8)).train()
    assert time.monotonic() - started < 120  # no restarts


def test_bad_coordinator_is_a_clear_start_up_error(ray_local, data, tmp_path):
    with socket.socket() as taken:  # the coordinator cannot listen on a port that is in use
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = "127.0.0.1:%d" % taken.getsockname()[1]
        expected = (rf"the workers could not start: worker 0 .*: setup: StartupError: "
                    rf"the JAX coordinator cannot listen on {address} on this host: Address already in use")
        with pytest.raises(cluster.ClusterError, match=expected):
            cluster.ClusterRun(make_config(data, tmp_path / "ckpt"), options(tmp_path, coordinator=address)).train()


def test_new_refuses_an_existing_model_dir_without_overwrite(data, tmp_path, capsys):
    model_dir = tmp_path / "ckpt"
    (model_dir / "step_2").mkdir(parents=True)
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(make_config(data, model_dir).to_json_dict()))
    assert train_cli.main(["--config", str(config_path), "--new"]) == 2
    err = capsys.readouterr().err
    assert f"error: {model_dir} is not empty" in err and "add --overwrite" in err
    cluster.prepare_model_dir(str(model_dir), new=False, overwrite=False)  # resuming leaves it alone
    assert (model_dir / "step_2").exists()
    cluster.prepare_model_dir(str(model_dir), new=True, overwrite=True)
    assert not model_dir.exists()


@pytest.mark.parametrize("flags, message", [
    (("--local-hosts", "0"), "--local-hosts must be at least 1; got 0"),
    (("--cpu-devices", "-2"), "--cpu-devices must be at least 1; got -2"),
    (("--max-restarts", "-1"), "--max-restarts must be at least 0; got -1"),
    (("--step-timeout", "0"), "--step-timeout must be above 0 seconds; got 0"),
    (("--startup-timeout", "-5"), "--startup-timeout must be above 0 seconds; got -5"),
])
def test_a_flag_no_run_can_use_is_one_error_naming_it(flags, message, capsys):
    """Before the config is read or Ray starts (there is no config at this path)."""
    assert f"error: {message}\n" in refusal(train_cli.main, ["--config", "/no/such/config.json", *flags], capsys)


def test_the_driver_opens_a_mixture_by_absolute_paths(data, tmp_path, monkeypatch):
    """train.py's driver (which reads every batch and sends the rows to the hosts) opens a mixture
    given by relative paths as device_train.py does: the same parts, shares and stream."""
    from mesh_transformer.data import Loader, Mixture
    from mesh_transformer.train.loop import open_datasets
    monkeypatch.chdir(os.path.dirname(data["train"]))
    config = make_config(data, tmp_path / "ckpt", train_set={os.path.basename(data["train"]): 1,
                                                             os.path.basename(data["val"]): 1})
    run = cluster.ClusterRun(config, options(tmp_path))
    assert isinstance(run.dataset, Mixture) and run.dataset.epoch_shares() == [28, 28]
    assert sorted(run.config.train.train_set) == sorted([data["train"], data["val"]])  # absolute, for the workers
    here = open_datasets(config)[0]
    assert (Loader(run.dataset, 8, seed=0).batch_at(40)["tokens"] == Loader(here, 8, seed=0).batch_at(40)["tokens"]).all()
    twice = make_config(data, tmp_path / "ckpt", train_set={os.path.basename(data["train"]): 3,
                                                            "./" + os.path.basename(data["train"]): 1})
    with pytest.raises(ConfigError, match="name the same dataset"):  # not one part of weight 1, as a dict of
        cluster.ClusterRun(twice, options(tmp_path))                    # absolute paths would have it


def test_pack_batch_is_lossless_and_small():
    tokens = np.random.default_rng(0).integers(0, 50257, (2, 4, 40)).astype(np.int32)
    ones = np.ones((2, 4, 39), np.float32)
    packed = cluster.pack_batch({"tokens": tokens, "mask": ones}, seq=32)
    assert packed["tokens"].dtype == np.uint16 and "mask" not in packed  # an all-ones mask is not sent
    mask = (np.random.default_rng(1).random((2, 4, 39)) > 0.5).astype(np.float32)
    packed = cluster.pack_batch({"tokens": tokens, "mask": mask}, seq=32)
    assert packed["mask"].dtype == np.uint8
    for sent, original in [(packed, mask), (cluster.pack_batch({"tokens": tokens, "mask": ones}, seq=32), ones)]:
        back = cluster.unpack_batch(cluster.rows_of(sent, (1, 3)))
        np.testing.assert_array_equal(back["tokens"], tokens[:, 1:3, :33])
        np.testing.assert_array_equal(back["mask"], original[:, 1:3, :32])
        assert back["tokens"].dtype == np.int32 and back["mask"].dtype == np.float32
    weights = mask * 0.5  # not 0/1: kept as float32
    assert cluster.pack_batch({"tokens": tokens, "mask": weights}, seq=32)["mask"].dtype == np.float32
    segments = np.cumsum(tokens == 7, axis=-1).astype(np.uint16)  # packed examples reach the workers
    back = cluster.unpack_batch(cluster.pack_batch({"tokens": tokens, "mask": mask, "segments": segments}, seq=32))
    np.testing.assert_array_equal(back["segments"], segments[..., :33])
    assert back["segments"].dtype == np.int32
    labels = (np.arange(8).reshape(2, 4, 1) % 3 > 0).astype(np.float32)  # KTO's unpaired examples reach them too
    packed = cluster.pack_batch({"tokens": tokens, "mask": mask, "labels": labels}, seq=32)
    back = cluster.unpack_batch(cluster.rows_of(packed, (2, 4)))
    assert packed["labels"].dtype == np.uint8 and back["labels"].dtype == np.float32
    np.testing.assert_array_equal(back["labels"], labels[:, 2:4])


def test_fine_tunes_start_from_the_weights_and_moments_asked_for(two_hosts, data, tmp_path):
    """train.py's --hf and --tune-model-path (RunOptions, as its flags set them) on 2 hosts: step 1's loss
    is the torch model's on the first batch; a tune from the 8-step run continues its Adam moments, or
    starts new ones with --fresh-opt."""
    import optax
    import torch

    from mesh_transformer.data import Dataset, Loader
    from tests.helpers import make_hf_gptj

    first_batch = Loader(Dataset.open(data["train"]), 8, 0).batch_at(0)["tokens"].reshape(-1, SEQ + 1)
    torch_model = make_hf_gptj(tmp_path / "hf", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                               n_positions=64, initializer_range=0.2)
    with torch.no_grad():
        tokens = torch.tensor(first_batch, dtype=torch.long)
        logits = torch_model(tokens[:, :-1]).logits.double()
        torch_loss = float(torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)))
    assert abs(torch_loss - np.log(VOCAB)) > 0.5  # not what a random init would give
    config = make_config(data, tmp_path / "hf-ckpt", total_steps=1, warmup_steps=0, ckpt_every=1, val_every=0)
    run = RunOptions(log_dir=str(tmp_path / "hf-logs"), tensorboard=False, hf=str(tmp_path / "hf"))
    cluster.ClusterRun(config, options(tmp_path, run=run)).train()
    [row] = read_metrics(tmp_path / "hf-logs" / "metrics.jsonl")
    assert row["train/loss"] == pytest.approx(torch_loss, rel=1e-5)

    # Restored optimizer state: mu = b1 mu_8 + (1 - b1) g, nu likewise, Adam's count 9; with fresh_opt (--fresh-opt)
    # mu = (1 - b1) g, count 1; g is the (clipped) gradient of the step-8 weights on the first batch.
    source = two_hosts["config"]
    tuned = {}
    for fresh in (False, True):
        model_dir = tmp_path / f"tune-{fresh}"
        config = make_config(data, model_dir, total_steps=1, warmup_steps=0, ckpt_every=1, val_every=0)
        run = RunOptions(log_dir=str(tmp_path / f"logs-{fresh}"), tensorboard=False,
                         tune_model_path=source.train.model_dir, fresh_opt=fresh)
        cluster.ClusterRun(config, options(tmp_path, run=run)).train()
        tuned[fresh] = str(model_dir)
    trainer = Trainer(config, mesh(4, 2))

    def restored(model_dir):
        state, _ = CheckpointManager(model_dir, read_only=True).restore(
            abstract_state=trainer.abstract_state, target_shardings=trainer.state_shardings)
        return state

    start = restored(source.train.model_dir)
    _, grads = trainer.loss_and_grads(start.params, trainer.shard_batch({"tokens": first_batch[None]}))
    grads = jax.device_get(grads)
    scale = min(1.0, config.train.clip_norm / float(optax.tree.norm(grads)))
    b1, b2 = config.train.b1, config.train.b2
    for fresh, count in ((False, STEPS + 1), (True, 1)):
        state = restored(tuned[fresh])
        assert int(optax.tree_utils.tree_get(state.opt_state, "count")) == count
        keep = 0.0 if fresh else 1.0
        for name in ("mu", "nu"):
            ours, before = (jax.device_get(optax.tree_utils.tree_get(s.opt_state, name)) for s in (state, start))
            for o, m, g in zip(jax.tree.leaves(ours), jax.tree.leaves(before), jax.tree.leaves(grads)):
                expected = (keep * b1 * m + (1 - b1) * scale * g if name == "mu"
                            else keep * b2 * m + (1 - b2) * (scale * g) ** 2)
                np.testing.assert_allclose(o, expected, rtol=1e-4, atol=1e-6 * np.abs(expected).max())


def test_lora_on_two_hosts_equals_one_process(ray_local, data, tmp_path):
    """A LoRA fine-tune (--hf base, all-linear adapters, LoRA dropout) through train.py on 2 Ray hosts:
    step 1's loss is the torch base model's (B starts at 0), every step's loss and the final adapters
    equal device_train.py's loop in one process, and the checkpoint holds the adapters alone."""
    import torch

    from mesh_transformer import parallel
    from mesh_transformer.data import Dataset, Loader
    from tests.helpers import make_hf_gptj
    torch_model = make_hf_gptj(tmp_path / "hf", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                               n_positions=64, initializer_range=0.2)
    first = torch.tensor(Loader(Dataset.open(data["train"]), 8, 0).batch_at(0)["tokens"].reshape(-1, SEQ + 1),
                         dtype=torch.long)
    with torch.no_grad():
        torch_loss = float(torch.nn.functional.cross_entropy(torch_model(first[:, :-1]).logits.double().reshape(
            -1, VOCAB), first[:, 1:].reshape(-1)))
    lora = {"rank": 4, "alpha": 8, "dropout": 0.1, "targets": "all-linear"}
    results = {}
    for where in ("cluster", "process"):
        config = make_config(data, tmp_path / f"{where}-ckpt", total_steps=3, ckpt_every=3, val_every=0, lora=lora)
        run = RunOptions(log_dir=str(tmp_path / f"{where}-logs"), tensorboard=False, hf=str(tmp_path / "hf"))
        if where == "cluster":
            cluster.ClusterRun(config, options(tmp_path, run=run)).train()
        else:
            TrainRun(config, run).train()
        losses = {r["step"]: r["train/loss"] for r in read_metrics(tmp_path / f"{where}-logs" / "metrics.jsonl")
                  if "train/loss" in r}
        results[where] = losses, final_params(config, tmp_path / f"{where}-ckpt")
    (cluster_loss, cluster_params), (process_loss, process_params) = results["cluster"], results["process"]
    assert sorted(cluster_loss) == [1, 2, 3]
    assert cluster_loss[1] == pytest.approx(torch_loss, rel=1e-5)
    for step in cluster_loss:
        assert cluster_loss[step] == pytest.approx(process_loss[step], rel=LOSS_RTOL)
    assert cluster_loss[3] != cluster_loss[1]
    assert all(parallel.is_adapter(n) for leaves in cluster_params.values() for n in leaves)
    assert max_abs_diff(cluster_params, process_params) < PARAM_ATOL


def test_eval_harness_tasks_on_two_hosts_match_eval_harness_on_the_checkpoint(ray_local, data, tmp_path):
    """train.py with eval_harness_tasks: every host runs the task on the current params (its forward
    passes span both), the driver logs eval/<task>/<metric> once, and the numbers are what
    eval_harness.py's model gives on the checkpoint saved at that step."""
    from pathlib import Path

    from mesh_transformer import loading
    from mesh_transformer.evaluate import harness
    from mesh_transformer.evaluate.lm import MeshLM
    from tests.eval_tasks import train_tokenizer, write_tasks

    tasks_dir = write_tasks(tmp_path / "tasks")
    tokenizer = train_tokenizer(tmp_path / "tokenizer")
    index = json.loads(Path(data["train"]).read_text())
    with_tokenizer = Path(data["train"]).with_name("train-tokenizer.index.json")
    with_tokenizer.write_text(json.dumps({**index, "tokenizer": str(tmp_path / "tokenizer")}))
    config = make_config({"train": str(with_tokenizer), "val": data["val"]}, tmp_path / "ckpt",
                         n_vocab=len(tokenizer), total_steps=1, warmup_steps=0, ckpt_every=1, val_every=0,
                         eval_harness_tasks=["tiny_lambada"], eval_every=1, eval_include_path=str(tasks_dir))
    cluster.ClusterRun(config, options(tmp_path)).train()
    rows = [r for r in read_metrics(tmp_path / "logs" / "metrics.jsonl") if any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in rows] == [1]
    logged = {k: v for k, v in rows[0].items() if k.startswith("eval/")}
    assert set(logged) == {"eval/tiny_lambada/acc", "eval/tiny_lambada/perplexity"}
    lm = MeshLM.from_loaded(loading.load(ckpt=str(tmp_path / "ckpt"), mp=2, dp=1, dtype="float32",
                                         tokenizer=str(tmp_path / "tokenizer")))
    again = harness.metrics(harness.run(lm, ["tiny_lambada"], harness.task_manager(tasks_dir, ["tiny_lambada"]),
                                        bootstrap_iters=0))
    assert logged.keys() == again.keys()
    for key, value in again.items():
        assert logged[key] == pytest.approx(value, rel=1e-4), key


def test_dpo_on_two_hosts_equals_one_process(ray_local, data, tmp_path):
    """DPO (full fine-tuning, its reference the seeded initial weights) through train.py on 2 Ray hosts:
    every step's loss and reward accuracy, the validation's pair metrics and the final weights equal
    device_train.py's loop in one process; the checkpoint names the reference."""
    from mesh_transformer.data import BuildConfig, build_dataset
    from mesh_transformer.train import preference
    from tests.helpers import word_tokenizer
    rng = np.random.default_rng(1)
    words = lambda n: " ".join(f"w{i}" for i in rng.integers(1, VOCAB, n))  # noqa: E731
    records = [{"prompt": words(12), "chosen": " " + words(int(rng.integers(3, 12))),
                "rejected": " " + words(int(rng.integers(3, 12)))} for _ in range(20)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    index = build_dataset(BuildConfig(str(tmp_path / "pairs.jsonl"), "pairs", str(tmp_path / "data"), seq=SEQ,
                                      tokenizer=word_tokenizer(tmp_path / "tok", VOCAB)))
    results = {}
    for where in ("cluster", "process"):
        config = make_config(data, tmp_path / f"{where}-ckpt", total_steps=3, ckpt_every=3, val_every=3,
                             train_set=index, val_set={"val": index}, per_replica_batch=1, dpo={"beta": 0.5})
        run = RunOptions(log_dir=str(tmp_path / f"{where}-logs"), tensorboard=False)
        if where == "cluster":
            cluster.ClusterRun(config, options(tmp_path, run=run)).train()
        else:
            TrainRun(config, run).train()
        rows = {r["step"]: r for r in read_metrics(tmp_path / f"{where}-logs" / "metrics.jsonl")}
        results[where] = rows, final_params(config, tmp_path / f"{where}-ckpt")
    (cluster_rows, cluster_params), (process_rows, process_params) = results["cluster"], results["process"]
    assert sorted(cluster_rows) == [1, 2, 3] and cluster_rows[1]["train/loss"] == pytest.approx(np.log(2), abs=1e-4)
    for step, row in cluster_rows.items():
        for key in ("train/loss", "train/rewards/accuracies", "train/rewards/margins"):
            assert row[key] == pytest.approx(process_rows[step][key], rel=LOSS_RTOL, abs=1e-6), (step, key)
    assert cluster_rows[3]["val/rewards/accuracies_val"] == process_rows[3]["val/rewards/accuracies_val"]
    # (as the rewards: a loss of beta x sequence log-probs of ~40, float32's spacing there 4e-6, compared absolutely)
    assert cluster_rows[3]["val/loss_val"] == pytest.approx(process_rows[3]["val/loss_val"], rel=LOSS_RTOL, abs=1e-6)
    assert max_abs_diff(cluster_params, process_params) < PARAM_ATOL
    extras = CheckpointManager(str(tmp_path / "cluster-ckpt"), read_only=True).extras(3)
    assert extras[preference.REFERENCE_KEY] == {"init": 0}
