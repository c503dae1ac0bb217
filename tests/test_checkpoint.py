"""Checkpoints: cross-mesh restore, atomicity under kill -9, retention, clear errors, gs:// round trip."""
from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers import mesh, one_device_env, random_tokens, tiny_config
from mesh_transformer.io.checkpoint import CheckpointError, CheckpointManager
from mesh_transformer.train.step import Trainer

GLOBAL_BATCH = 8
SAVE_STEP = 2


def _config(mp: int, zero: bool = False, **overrides):
    dp = 8 // mp
    return tiny_config(cores_per_replica=mp, per_replica_batch=GLOBAL_BATCH // dp, zero=zero, **overrides)


def _numpy(tree):
    return jax.tree.map(np.asarray, tree)


def _assert_equal_trees(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two steps on dp1 x mp8, saved asynchronously; then a third step (donating the state) as reference."""
    directory = str(tmp_path_factory.mktemp("ckpt") / "run")
    config = _config(8)
    trainer = Trainer(config, mesh(1, 8))
    tokens = random_tokens((3, 1, GLOBAL_BATCH, config.model.seq + 1), config.model.n_vocab, seed=1)
    state = trainer.init_state(0)
    for i in range(SAVE_STEP):
        state, _ = trainer.step(state, trainer.shard_batch({"tokens": tokens[i]}))
    saved = _numpy(state)
    ckpt = CheckpointManager(directory, config=config, keep_last=2)
    ckpt.save(SAVE_STEP, state, {"train_loader": {"position": 16}})
    after, metrics = trainer.step(state, trainer.shard_batch({"tokens": tokens[SAVE_STEP]}))  # donates `state`
    ckpt.close()
    return dict(directory=directory, config=config, trainer=trainer, saved=saved, after=_numpy(after),
                loss=float(metrics["loss"]), next_tokens=tokens[SAVE_STEP])


# --------------------------------------------------------------------------------------------
# Restore onto other meshes
# --------------------------------------------------------------------------------------------

def _restore(directory, trainer):
    ckpt = CheckpointManager(directory, config=trainer.config, read_only=True)
    assert ckpt.latest_step() == SAVE_STEP
    state, extras = ckpt.restore(abstract_state=trainer.abstract_state, target_shardings=trainer.state_shardings)
    assert extras == {"train_loader": {"position": 16}}
    shardings_ok = jax.tree.map(lambda x, s: x.sharding == s, state, trainer.state_shardings)
    assert all(jax.tree.leaves(shardings_ok))
    return state


def _next_step(trained, trainer, state):
    state, metrics = trainer.step(state, trainer.shard_batch({"tokens": trained["next_tokens"]}))
    return _numpy(state), float(metrics["loss"])


def test_restore_on_the_saving_mesh_continues_bitwise(trained):
    trainer = trained["trainer"]
    state = _restore(trained["directory"], trainer)
    _assert_equal_trees(state, trained["saved"])
    after, loss = _next_step(trained, trainer, state)
    assert loss == trained["loss"]
    _assert_equal_trees(after, trained["after"])


@pytest.mark.parametrize("mp,zero,step_too", [(1, False, False), (1, True, True), (2, False, False),
                                             (2, True, False), (4, False, True), (4, True, False)])
def test_restore_onto_another_mesh(trained, mp, zero, step_too):
    trainer = Trainer(_config(mp, zero), mesh(8 // mp, mp))
    state = _restore(trained["directory"], trainer)
    _assert_equal_trees(state, trained["saved"])  # params, Adam moments and counters: bit for bit
    if step_too:  # a further step agrees with the one taken on the saving mesh up to reduction order
        after, loss = _next_step(trained, trainer, state)
        assert abs(loss - trained["loss"]) < 1e-6
        # Adam divides by sqrt(v): where a gradient is ~1e-8, a last-bit difference in the sum
        # moves the update by up to ~1e-3 * lr, so the new weights agree to 1e-5, not 1e-6.
        for x, y in zip(jax.tree.leaves(after), jax.tree.leaves(trained["after"])):
            np.testing.assert_allclose(x, y, rtol=0, atol=1e-5)


def test_restore_params_only(trained):
    trainer = Trainer(_config(2, zero=True), mesh(4, 2))
    ckpt = CheckpointManager(trained["directory"], config=trainer.config, read_only=True)
    params = ckpt.restore_params(abstract_params=trainer.abstract_state.params,
                                 target_shardings=trainer.state_shardings.params)
    _assert_equal_trees(params, trained["saved"].params)
    fresh = trainer.state_from_params(params)  # --fresh-opt: new optimizer state around restored weights
    assert int(fresh.step) == 0 and int(fresh.opt_state[1].count) == 0
    assert ckpt.extras() == {"train_loader": {"position": 16}}
    assert ckpt.saved_config()["d_model"] == trainer.config.model.d_model


# --------------------------------------------------------------------------------------------
# Errors: foreign, mismatched, corrupted
# --------------------------------------------------------------------------------------------

@pytest.fixture
def copy_of(trained, tmp_path):
    target = str(tmp_path / "copy")
    shutil.copytree(trained["directory"], target)
    return target


def _abstract(config, mp=8):
    trainer = Trainer(config, mesh(8 // mp, mp))
    return dict(abstract_state=trainer.abstract_state, target_shardings=trainer.state_shardings)


@pytest.fixture(scope="module")
def target8(trained):
    return _abstract(trained["config"])


def test_config_mismatch_is_named(trained, target8):
    ckpt = CheckpointManager(trained["directory"], config=_config(8, d_model=128), read_only=True)
    with pytest.raises(CheckpointError, match=r"step_2: saved for a different model: .*d_model: saved 64, config 128"):
        ckpt.restore(**target8)


def test_shape_mismatch_is_named(trained):
    ckpt = CheckpointManager(trained["directory"], read_only=True)  # no config to compare: shapes catch it
    with pytest.raises(CheckpointError, match=r"step_2/state: does not fit the target state: "
                                              r"params\.gptj/embed\.embeddings: saved \(256, 64\) float32, "
                                              r"expected \(256, 32\) float32"):
        ckpt.restore(**_abstract(_config(8, d_model=32)))


def _largest_data_file(directory):
    files = glob.glob(os.path.join(directory, f"step_{SAVE_STEP}", "state", "**", "d", "*"), recursive=True)
    return max(files, key=os.path.getsize)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's abandoned reads
def test_truncated_array_file(copy_of, target8, trained):
    path = _largest_data_file(copy_of)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    ckpt = CheckpointManager(copy_of, config=trained["config"], read_only=True)
    with pytest.raises(CheckpointError, match=rf"{copy_of}/step_2: cannot read state"):
        ckpt.restore(**target8)


def test_flipped_bit_is_caught_by_fingerprints(copy_of, target8, trained):
    path = _largest_data_file(copy_of)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    ckpt = CheckpointManager(copy_of, config=trained["config"], read_only=True)
    with pytest.raises(CheckpointError, match=rf"{copy_of}/step_2/state: 1 array\(s\) differ from what was saved"):
        ckpt.restore(**target8)


def test_missing_meta_is_foreign(copy_of, target8):
    shutil.rmtree(os.path.join(copy_of, "step_2", "meta"))
    with pytest.raises(CheckpointError, match=r"step_2: not a mesh-transformer-checkpoint \(no meta/metadata\)"):
        CheckpointManager(copy_of, read_only=True).restore(**target8)


def test_foreign_directories(tmp_path, target8, trained):
    v1 = tmp_path / "v1"
    (v1 / "step_100" / "shard_0").mkdir(parents=True)
    (v1 / "step_100" / "shard_0" / "0.npz").write_bytes(b"PK")
    (v1 / "meta.json").write_text('{"step": 100, "checkpoints": [100]}')
    with pytest.raises(CheckpointError, match=r"step_100: not a .*shard_0/: a mesh-transformer-jax v1 checkpoint"):
        CheckpointManager(str(v1), read_only=True).restore(**target8)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"empty: no complete checkpoint"):
        CheckpointManager(str(tmp_path / "empty"), read_only=True).restore(**target8)
    with pytest.raises(CheckpointError, match=r"step_7: no complete checkpoint for step 7 \(complete steps: \[2\]\)"):
        CheckpointManager(trained["directory"], read_only=True).restore(7, **target8)


def test_save_refuses_bad_input(tmp_path):
    ckpt = CheckpointManager(str(tmp_path / "run"), async_save=False)
    state = {"params": {"w": jax.numpy.ones((2, 2))}}
    with pytest.raises(CheckpointError, match=r"extras for step 1 must be JSON-serializable"):
        ckpt.save(1, state, {"loader": object()})
    ckpt.save(3, state)
    with pytest.raises(CheckpointError, match=r"cannot save step 3, the directory already holds step 3"):
        ckpt.save(3, state)


def test_async_save_owns_its_copy(tmp_path):
    """save() returns once the arrays are copied: freeing them (as a donating step does) is safe."""
    state = _small_state(seed=5, n=4096)
    expected = _numpy(state)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    ckpt = CheckpointManager(str(tmp_path / "run"))
    ckpt.save(1, state)
    jax.tree.map(lambda x: x.delete(), state)
    ckpt.wait()
    _assert_equal_trees(ckpt.restore(abstract_state=abstract)[0], expected)


# --------------------------------------------------------------------------------------------
# Retention
# --------------------------------------------------------------------------------------------

def _small_state(seed=0, n=16):
    mesh8 = jax.sharding.Mesh(np.array(jax.devices()), ("dp",))
    w = np.random.default_rng(seed).standard_normal((8, n), dtype=np.float32)
    return {"params": {"w": jax.device_put(w, NamedSharding(mesh8, P("dp")))}}


def test_retention_keeps_last_n_and_every_kth(tmp_path):
    directory = str(tmp_path / "run")
    state = _small_state()
    ckpt = CheckpointManager(directory, keep_last=2, keep_every=5)
    for step in range(1, 13):
        ckpt.save(step, state)
    ckpt.wait()
    assert ckpt.all_steps() == [5, 10, 11, 12]
    assert sorted(os.listdir(directory)) == ["step_10", "step_11", "step_12", "step_5"]  # nothing else left
    ckpt = CheckpointManager(directory, keep_last=2, keep_every=5)  # a restarted run continues the policy
    for step in range(13, 17):
        ckpt.save(step, state)
    ckpt.close()
    assert ckpt.all_steps() == [5, 10, 15, 16]


# --------------------------------------------------------------------------------------------
# Atomicity: a save killed with SIGKILL never becomes the latest checkpoint
# --------------------------------------------------------------------------------------------

_SAVER = """
import sys, jax, numpy as np
from mesh_transformer.io.checkpoint import CheckpointManager
directory, n = sys.argv[1], int(sys.argv[2])
def state(seed, n):
    w = np.random.default_rng(seed).standard_normal((8, n), dtype=np.float32)
    return {"params": {"w": jax.device_put(w)}}
ckpt = CheckpointManager(directory)
ckpt.save(1, state(1, 16), {"step": 1}, wait=True)
big = state(2, n)
print("saved 1", flush=True)
ckpt.save(2, big, {"step": 2}, wait=True)
print("saved 2", flush=True)
"""


def _kill_mid_save(directory: str, n: int, started) -> None:
    """Run _SAVER; SIGKILL it as soon as `started()` sees step 2 being written."""
    env = one_device_env()
    child = subprocess.Popen([sys.executable, "-c", _SAVER, directory, str(n)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert child.stdout.readline().strip() == "saved 1"
        deadline = time.time() + 120
        while not started() and child.poll() is None and time.time() < deadline:
            time.sleep(0.002)
        if child.poll() is None:  # (poll reaps a child that has exited: it cannot be signalled then)
            os.kill(child.pid, signal.SIGKILL)
        child.wait()
        assert "saved 2" not in child.stdout.read(), "the save finished before the kill: use a larger state"
        assert child.returncode == -signal.SIGKILL, f"the saver exited by itself ({child.returncode})"
    finally:
        if child.poll() is None:
            child.kill()


def _check_previous_survives(directory: str) -> None:
    expected = np.random.default_rng(1).standard_normal((8, 16), dtype=np.float32)
    target = _small_state(n=16)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), target)
    ckpt = CheckpointManager(directory)
    assert ckpt.all_steps() == [1] and ckpt.latest_step() == 1
    state, extras = ckpt.restore(abstract_state=abstract)
    np.testing.assert_array_equal(np.asarray(state["params"]["w"]), expected)
    assert extras == {"step": 1}
    ckpt.save(2, target, wait=True)  # the next save clears what the killed one left
    assert ckpt.all_steps() == [1, 2]


def test_killed_save_leaves_previous_checkpoint_local(tmp_path):
    directory = str(tmp_path / "run")
    _kill_mid_save(directory, 4_000_000, lambda: bool(glob.glob(f"{directory}/step_2.orbax-checkpoint-tmp*")))
    assert not os.path.exists(f"{directory}/step_2") and glob.glob(f"{directory}/step_2.orbax-checkpoint-tmp*")
    _check_previous_survives(directory)
    assert sorted(os.listdir(directory)) == ["step_1", "step_2"]


# --------------------------------------------------------------------------------------------
# gs:// against a local emulator (loopback only)
# --------------------------------------------------------------------------------------------

def _blobs(prefix: str, client=None) -> list[str]:
    bucket, _, key = prefix[len("gs://"):].partition("/")
    return sorted(b.name for b in (client or _client()).list_blobs(bucket, prefix=key))


def _client():
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    return storage.Client(project="test", credentials=AnonymousCredentials())


def test_gcs_round_trip(gcs_bucket):
    directory = f"{gcs_bucket}/roundtrip"
    state = _small_state(seed=3)
    with CheckpointManager(directory, keep_last=1) as ckpt:
        ckpt.save(10, state, {"train_loader": {"epoch": 1}})
        ckpt.save(20, _small_state(seed=4), {"train_loader": {"epoch": 2}})
    assert "roundtrip/step_20/commit_success.txt" in _blobs(directory)
    assert not [b for b in _blobs(directory) if b.startswith("roundtrip/step_10/")]  # pruned
    mesh42 = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    target = {"params": {"w": jax.ShapeDtypeStruct((8, 16), np.float32, sharding=NamedSharding(mesh42, P("b", "a")))}}
    ckpt = CheckpointManager(directory, read_only=True)
    assert ckpt.all_steps() == [20]
    restored, extras = ckpt.restore(abstract_state=target)
    _assert_equal_trees(restored, _numpy(_small_state(seed=4)))
    assert restored["params"]["w"].sharding == target["params"]["w"].sharding
    assert extras == {"train_loader": {"epoch": 2}}


def test_killed_save_leaves_previous_checkpoint_gcs(gcs_bucket):
    directory, client = f"{gcs_bucket}/killed", _client()  # one client: each look is one listing request
    _kill_mid_save(directory, 1_000_000, lambda: bool(_blobs(f"{directory}/step_2/", client)))
    left = _blobs(f"{directory}/step_2/")
    assert left and "killed/step_2/commit_success.txt" not in left  # partly written, never committed
    _check_previous_survives(directory)
    assert "killed/step_2/commit_success.txt" in _blobs(f"{directory}/step_2/")


_RETAINER = """
import sys, jax, numpy as np
from mesh_transformer.io.checkpoint import CheckpointManager
directory, n = sys.argv[1], int(sys.argv[2])
ckpt = CheckpointManager(directory, keep_last=2)
for step in range(1, 7):
    w = np.full((8, n), step, np.float32)
    ckpt.save(step, {"params": {"w": jax.device_put(w)}}, {"step": step}, wait=True)
    print("saved", step, flush=True)
"""


def test_retention_deletes_old_steps_only_after_the_new_one_commits(tmp_path):
    """keep_last=2 over 6 saves, watched from outside: the newest complete step never goes back and there
    are never fewer than 2 complete ones once 2 were saved; SIGKILLed as soon as step 4 is committed (before
    step 2 is pruned, or while it is), every step a restart lists restores, and its next save prunes."""
    directory = str(tmp_path / "run")
    env = one_device_env()
    child = subprocess.Popen([sys.executable, "-c", _RETAINER, directory, "400000"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    newest, snapshots = 0, 0
    try:
        deadline = time.time() + 300
        while child.poll() is None and time.time() < deadline:
            names = os.listdir(directory) if os.path.isdir(directory) else []
            complete = sorted(int(n[5:]) for n in names if n.startswith("step_") and n[5:].isdigit())
            if complete:
                assert complete[-1] >= newest, (names, newest)
                assert len(complete) >= min(2, complete[-1]), names
                newest, snapshots = complete[-1], snapshots + 1
            if newest >= 4:
                os.kill(child.pid, signal.SIGKILL)
                break
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert newest == 4 and child.returncode == -signal.SIGKILL and snapshots > 1
    target = {"params": {"w": jax.ShapeDtypeStruct((8, 400_000), np.float32,
                                                   sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))}}
    ckpt = CheckpointManager(directory, keep_last=2)
    steps = ckpt.all_steps()
    assert steps[-2:] == [3, 4] and set(steps) <= {2, 3, 4}
    for step in steps:
        state, extras = ckpt.restore(step, abstract_state=target)
        assert extras == {"step": step} and float(np.asarray(state["params"]["w"]).min()) == step
    ckpt.save(5, {"params": {"w": jax.device_put(np.full((8, 16), 5, np.float32))}}, wait=True)
    assert ckpt.all_steps() == [4, 5]
