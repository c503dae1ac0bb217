"""Checkpoints of the whole train state, on a local disk or gs://, restorable onto any mesh.

    ckpt = CheckpointManager(checkpoint_dir(config.train), keep_last=2, keep_every=config.train.keep_every,
                             config=config)                 # gs://{bucket}/{model_dir}, or model_dir
    ckpt.save(step, state, extras={"train_loader": loader.state()})   # async; ckpt.wait() blocks
    state, extras = ckpt.restore(abstract_state=trainer.abstract_state,
                                 target_shardings=trainer.state_shardings)  # latest complete step
    params = ckpt.restore_params(abstract_params=trainer.abstract_state.params,
                                 target_shardings=trainer.state_shardings.params)

Layout (orbax-checkpoint; one directory per step, arrays stored with their global shapes):

    <directory>/step_<N>/
        state/              TrainState (step, params, opt_state): OCDBT/zarr; every host writes the
                            shards it holds and any mesh reads back any slice
        meta/metadata       JSON {"format", "version", "step", "config", "fingerprints"}
        extras/metadata     JSON given by the caller (data-loader state, ...)
        commit_success.txt  written last; on gs:// it is what marks the step complete

A step becomes visible only when complete: locally orbax writes `step_<N>.orbax-checkpoint-tmp-*`
and renames it; on gs:// (no atomic rename) it writes `step_<N>/` and the commit file last. Restore
checks, before reading any array, that the directory is ours, that the model config matches and
that every shape and dtype matches the target; after reading, it compares a fingerprint of every
array with the one recorded at save time, because a flipped bit in a chunk file restores silently.
Every problem is a `CheckpointError` naming the path.
"""
from __future__ import annotations

import functools
import json
import os
import re
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import NamedSharding, PartitionSpec as P

from mesh_transformer.errors import UserError
from mesh_transformer.config import Config, ModelConfig, TrainConfig, config_from_dict

FORMAT, VERSION = "mesh-transformer-checkpoint", 1
STEP_PREFIX = "step"
STATE, META, EXTRAS = "state", "meta", "extras"
_COMMIT_FILE = "commit_success.txt"
_TMP_SUFFIX = ".orbax-checkpoint-tmp"


class CheckpointError(UserError, RuntimeError):
    """A checkpoint is missing, incomplete, foreign, corrupted, or does not fit the model."""


def checkpoint_dir(train: TrainConfig) -> str:
    """Where the original kept checkpoints: gs://{bucket}/{model_dir}, or model_dir when no bucket."""
    if not train.model_dir:
        raise CheckpointError("config key 'model_dir' is not set: nowhere to keep checkpoints")
    if train.bucket:
        return f"gs://{train.bucket}/{train.model_dir.strip('/')}"
    return train.model_dir


class CheckpointManager:
    """Save, list and restore train-state checkpoints under one directory.

    keep_last: how many of the newest steps to keep (None: keep every step).
    keep_every: also keep every step that is a multiple of it (0: none), like the original.
    config: when given, saved with each step and compared with the saved one on restore.
    read_only: for processes that only restore (sampling, serving, export): they never write or
        delete, so they can watch a directory a trainer is writing to.
    """

    def __init__(self, directory: str, *, keep_last: Optional[int] = None, keep_every: int = 0,
                 config: Optional[Config] = None, async_save: bool = True, read_only: bool = False):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be at least 1 (or None to keep every step), got {keep_last}")
        if keep_every < 0:
            raise ValueError(f"keep_every must not be negative, got {keep_every}")
        directory = str(directory).rstrip("/")
        self.directory = directory if "://" in directory else os.path.abspath(directory)  # orbax needs absolute
        self.config = config
        self._root = epath.Path(self.directory)
        self._pending: Optional[int] = None  # step of an async save not yet known to be complete
        self.read_only = read_only
        self._swept = read_only  # incomplete steps left by killed saves: deleted once, by the writer
        self._metas: dict[int, dict] = {}  # complete steps never change
        options = ocp.CheckpointManagerOptions(
            step_prefix=STEP_PREFIX, preservation_policy=_retention(keep_last, keep_every),
            enable_async_checkpointing=async_save, read_only=read_only, create=not read_only)
        # No zstd: float weights shrink ~8% and saving gets ~3x slower on the host CPU (bench/checkpoint_io.py).
        handlers = {STATE: ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_compression=False),
                    META: ocp.JsonCheckpointHandler(), EXTRAS: ocp.JsonCheckpointHandler()}
        self._mgr = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    # ---- listing ------------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Complete checkpoints, oldest first (an async save in flight is not listed until done)."""
        self._settle()
        return sorted(s for s in self._mgr.all_steps() if s != self._pending)

    def latest_step(self) -> Optional[int]:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def reload(self) -> None:
        """Re-read the directory: a reader sees steps a trainer finished after it opened the directory."""
        self._settle()
        self._mgr.reload()

    def step_path(self, step: int) -> str:
        return f"{self.directory}/{STEP_PREFIX}_{step}"

    # ---- saving -------------------------------------------------------------------------------

    def save(self, step: int, state, extras: Optional[Mapping[str, Any]] = None, *, wait: bool = False) -> None:
        """Start writing `state` (any pytree of jax.Arrays, normally a TrainState) as step `step`.

        Returns once the arrays are copied off the devices, so the caller may donate or
        overwrite `state` at once; the files are written in the background (`wait()` blocks).
        Call on every host with the same arguments.
        """
        if self.read_only:
            raise CheckpointError(f"{self.directory}: opened read_only, cannot save step {step}")
        extras = _json_copy(extras or {}, f"extras for step {step}")
        self.wait()
        latest = self.latest_step()
        if latest is not None and step <= latest:
            raise CheckpointError(f"{self.step_path(step)}: cannot save step {step}, the directory already "
                                  f"holds step {latest}; use a new model_dir to start a different run")
        self._sweep_incomplete()
        meta = {"format": FORMAT, "version": VERSION, "step": int(step),
                "config": self.config.to_json_dict() if self.config is not None else None,
                "fingerprints": fingerprints(state)}
        args = ocp.args.Composite(**{STATE: ocp.args.PyTreeSave(state), META: ocp.args.JsonSave(meta),
                                     EXTRAS: ocp.args.JsonSave(extras)})
        try:
            self._mgr.save(step, args=args, force=True)
        except Exception as e:  # noqa: BLE001 - orbax raises many types; all mean "not saved"
            raise CheckpointError(f"{self.step_path(step)}: saving failed: {e}") from e
        self._pending = step
        if wait:
            self.wait()

    def wait(self) -> None:
        """Block until the last save is complete on storage (and old steps are pruned)."""
        step, self._pending = self._pending, None
        try:
            self._mgr.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            where = self.directory if step is None else self.step_path(step)
            raise CheckpointError(f"{where}: saving failed: {e}") from e

    def close(self) -> None:
        self.wait()
        self._mgr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- restoring ----------------------------------------------------------------------------

    def restore(self, step: Optional[int] = None, *, abstract_state, target_shardings=None,
                check_config: bool = True):
        """(state, extras) of `step` (default: the latest), each array placed with its target sharding.

        abstract_state: tree of ShapeDtypeStructs (e.g. `trainer.abstract_state`).
        target_shardings: matching tree of Shardings (e.g. `trainer.state_shardings`); may be
            omitted when the ShapeDtypeStructs carry shardings. The mesh may differ from the one
            the checkpoint was written from: arrays are stored with their global shapes.
        """
        step = self._resolve(step)
        self._check_meta(step, check_config)
        target = _with_shardings(abstract_state, target_shardings)
        self._check_shapes(step, _flatten(target), _flatten(self._saved_tree(step)))
        restored = self._read(step, **{STATE: _pytree_restore(target), EXTRAS: ocp.args.JsonRestore()})
        self._check_fingerprints(step, restored[STATE])
        return restored[STATE], dict(restored[EXTRAS] or {})

    def restore_params(self, step: Optional[int] = None, *, abstract_params, target_shardings=None,
                       check_config: bool = True):
        """Only the parameters of `step` (fine-tuning, `--fresh-opt`, sampling): no optimizer state read."""
        step = self._resolve(step)
        self._check_meta(step, check_config)
        target = _with_shardings(abstract_params, target_shardings)
        saved = _flatten(self._saved_tree(step))
        as_saved = _saved_float_dtypes(target, saved, "params.")  # e.g. bf16 params written by slim_model.py
        wanted = {f"params.{k}": v for k, v in _flatten(as_saved).items()}
        self._check_shapes(step, wanted, saved, subset=True)
        params = self._read(step, **{STATE: _pytree_restore({"params": as_saved}, partial=True)})[STATE]["params"]
        self._check_fingerprints(step, {"params": params})
        return jax.tree.map(lambda x, t: x if x.dtype == t.dtype else x.astype(t.dtype), params, target)

    def holds_optimizer_state(self, step: Optional[int] = None) -> bool:
        """Whether `step` is a whole train state, not only parameters (as weight imports write)."""
        step = self._resolve(step)
        return any(k.startswith("opt_state") for k in _flatten(self._saved_tree(step)))

    def extras(self, step: Optional[int] = None) -> dict:
        """The JSON extras of `step` alone (cheap: reads no arrays)."""
        step = self._resolve(step)
        self._check_meta(step, check_config=False)
        return dict(self._read(step, **{EXTRAS: ocp.args.JsonRestore()})[EXTRAS] or {})

    def saved_shapes(self, step: Optional[int] = None) -> dict[str, tuple[int, ...]]:
        """{"params.gptj/embed.embeddings": shape, ...}: every saved array's global shape (reads no arrays)."""
        return {k: tuple(v.shape) for k, v in _flatten(self._saved_tree(self._resolve(step))).items()}

    def saved_config(self, step: Optional[int] = None) -> Optional[dict]:
        """The flat config dict saved with `step` (None when the saver passed no config)."""
        return self._meta(self._resolve(step))["config"]

    # ---- internals ----------------------------------------------------------------------------

    def _settle(self) -> None:
        if self._pending is not None and not self._mgr.is_saving_in_progress():
            self.wait()

    def _resolve(self, step: Optional[int]) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointError(f"{self.directory}: no complete checkpoint{self._describe_dir()}")
            return steps[-1]
        if step not in steps:
            raise CheckpointError(f"{self.step_path(step)}: no complete checkpoint for step {step} "
                                  f"(complete steps: {steps or 'none'})")
        return step

    def _describe_dir(self) -> str:
        """Why a directory holds nothing restorable, when that can be told."""
        if not self._root.exists():
            return " (the directory does not exist)"
        if (self._root / "meta.json").exists():
            return (" (it holds meta.json: a mesh-transformer-jax v1 checkpoint with per-shard .npz files, "
                    "which this format does not read)")
        incomplete = [p.name for p in self._root.iterdir() if _incomplete_step(p) is not None]
        return f" (incomplete, ignored: {', '.join(sorted(incomplete))})" if incomplete else ""

    def _read(self, step: int, **items):
        try:
            return self._mgr.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # noqa: BLE001 - tensorstore/orbax/json errors all mean "unreadable"
            raise CheckpointError(f"{self.step_path(step)}: cannot read {', '.join(items)}: "
                                  f"{type(e).__name__}: {_first_lines(e)}") from e

    def _meta(self, step: int) -> dict:
        if step not in self._metas:
            self._metas[step] = self._read_meta(step)
        return self._metas[step]

    def _read_meta(self, step: int) -> dict:
        path = self.step_path(step)
        if not (self._root / f"{STEP_PREFIX}_{step}" / META / "metadata").exists():
            hint = (" (it holds shard_0/: a mesh-transformer-jax v1 checkpoint)"
                    if (self._root / f"{STEP_PREFIX}_{step}" / "shard_0").exists() else "")
            raise CheckpointError(f"{path}: not a {FORMAT} (no {META}/metadata){hint}")
        meta = self._read(step, **{META: ocp.args.JsonRestore()})[META]
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CheckpointError(f"{path}: not a {FORMAT} ({META}/metadata has format "
                                  f"{meta.get('format') if isinstance(meta, dict) else meta!r})")
        if meta.get("version", 0) > VERSION:
            raise CheckpointError(f"{path}: written by a newer version ({meta['version']} > {VERSION}) of this format")
        return meta

    def _check_meta(self, step: int, check_config: bool) -> None:
        meta = self._meta(step)
        if check_config and self.config is not None and meta.get("config") is not None:
            diffs = config_differences(meta["config"], self.config.model)
            if diffs:
                raise CheckpointError(f"{self.step_path(step)}: saved for a different model: " + "; ".join(diffs))

    def _saved_tree(self, step: int):
        try:
            return self._mgr.item_metadata(step)[STATE].tree
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{self.step_path(step)}/{STATE}: unreadable array metadata: "
                                  f"{type(e).__name__}: {_first_lines(e)}") from e

    def _check_shapes(self, step: int, expected: Mapping[str, Any], saved: Mapping[str, Any],
                      subset: bool = False) -> None:
        problems = [f"{k}: missing" for k in expected if k not in saved]
        if not subset:
            problems += [f"{k}: in the checkpoint but not in the target state" for k in saved if k not in expected]
        for k, want in expected.items():
            got = saved.get(k)
            if got is not None and _shape_dtype(got) != _shape_dtype(want):
                problems.append(f"{k}: saved {' '.join(map(str, _shape_dtype(got)))}, "
                                f"expected {' '.join(map(str, _shape_dtype(want)))}")
        if problems:
            more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
            raise CheckpointError(f"{self.step_path(step)}/{STATE}: does not fit the target state: "
                                  + "; ".join(problems[:8]) + more)

    def _check_fingerprints(self, step: int, tree) -> None:
        recorded = self._meta(step)["fingerprints"]
        bad = [k for k, v in fingerprints(tree).items() if recorded.get(k) != v]
        if bad:
            raise CheckpointError(f"{self.step_path(step)}/{STATE}: {len(bad)} array(s) differ from what was "
                                  f"saved (corrupted files?): {', '.join(bad[:8])}")

    def _sweep_incomplete(self) -> None:
        """Delete step directories left by saves that were killed (once, in the writing process)."""
        if self._swept:
            return
        self._swept = True
        if jax.process_index() != 0 or not self._root.exists():
            return
        for path in self._root.iterdir():
            if _incomplete_step(path) is not None:
                path.rmtree()


# --------------------------------------------------------------------------------------------
# Retention, config comparison
# --------------------------------------------------------------------------------------------

def _retention(keep_last: Optional[int], keep_every: int):
    cm = ocp.checkpoint_managers
    if keep_last is None:
        return cm.LatestN(None)  # keeps every step
    policies = [cm.LatestN(keep_last)] + ([cm.EveryNSteps(keep_every)] if keep_every else [])
    return cm.AnyPreservationPolicy(policies)


def config_differences(saved: Mapping[str, Any], model: ModelConfig) -> list[str]:
    """'key: saved X, config Y' for each architecture key that differs."""
    try:
        saved_model = config_from_dict(dict(saved)).model
    except Exception as e:  # noqa: BLE001 - an unreadable saved config is itself a difference
        return [f"the saved config does not load: {e}"]
    ours, theirs = model.architecture(), saved_model.architecture()
    return [f"{k}: saved {theirs.get(k)!r}, config {ours.get(k)!r}"
            for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k)]


# --------------------------------------------------------------------------------------------
# Fingerprints: a 32-bit hash of each array's bits, independent of how it is sharded
# --------------------------------------------------------------------------------------------

_MIX1, _MIX2 = 0x9E3779B9, 0x85EBCA6B
_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _leaf_fingerprint(x: jax.Array) -> jax.Array:
    """sum over elements of mix(bits ^ f(global index)) mod 2^32: exact, so any shard order agrees."""
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    elif x.dtype.itemsize == 8:
        pair = jax.lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]
        bits = pair[..., 0] ^ (pair[..., 1] * jnp.uint32(_MIX1))
    else:
        bits = jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize]).astype(jnp.uint32)
    index = jnp.zeros(x.shape, jnp.uint32)
    for dim, stride in enumerate(_strides(x.shape)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, x.shape, dim) * jnp.uint32(stride % 2**32)
    h = (bits ^ (index * jnp.uint32(_MIX1))) * jnp.uint32(_MIX2)
    return jnp.sum(h ^ (h >> 15), dtype=jnp.uint32)


def _strides(shape) -> list[int]:
    return [int(np.prod(shape[d + 1:], dtype=np.int64)) for d in range(len(shape))]


def fingerprints(tree) -> dict[str, int]:
    """{path: 32-bit fingerprint} of every array in `tree`, computed where the arrays live."""
    flat = _flatten(tree)
    leaves = [jnp.asarray(x) for x in flat.values()]
    meshes = {x.sharding.mesh for x in leaves if isinstance(x.sharding, NamedSharding)}
    replicated = NamedSharding(meshes.pop(), P()) if len(meshes) == 1 else None
    values = _fingerprint_fn(replicated)(leaves)
    return {k: int(np.asarray(v.addressable_data(0))) for k, v in zip(flat, values)}


@functools.lru_cache(maxsize=16)
def _fingerprint_fn(out_sharding):
    # Replicated outputs, so every host can read them (multi-process runs).
    return jax.jit(lambda xs: [_leaf_fingerprint(x) for x in xs], out_shardings=out_sharding)


# --------------------------------------------------------------------------------------------
# Trees keyed by dotted paths ("params.gptj/embed.embeddings", "opt_state.1.mu...") as orbax names them
# --------------------------------------------------------------------------------------------

def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _flatten(tree) -> dict[str, Any]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {".".join(_key_name(k) for k in path): leaf for path, leaf in leaves}


def _shape_dtype(x) -> tuple:
    return tuple(x.shape), np.dtype(x.dtype)


def _saved_float_dtypes(target, saved: Mapping[str, Any], prefix: str):
    """`target` with each floating leaf's dtype replaced by the saved one (read as saved, cast afterwards,
    so fingerprints compare what was written)."""
    def as_saved(path, t):
        got = saved.get(prefix + ".".join(_key_name(k) for k in path))
        if got is None or np.dtype(got.dtype) == np.dtype(t.dtype) or not (
                jnp.issubdtype(got.dtype, jnp.floating) and jnp.issubdtype(t.dtype, jnp.floating)):
            return t
        return jax.ShapeDtypeStruct(t.shape, got.dtype, sharding=t.sharding)
    return jax.tree_util.tree_map_with_path(as_saved, target)


def _pytree_restore(target, partial: bool = False):
    """Restore args placing each array as its ShapeDtypeStruct says; `partial`: skip other arrays."""
    return ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                  partial_restore=partial)


def _with_shardings(abstract, shardings):
    if shardings is None:
        missing = [k for k, a in _flatten(abstract).items() if getattr(a, "sharding", None) is None]
        if missing:
            raise ValueError(f"no target sharding for {missing[0]}: pass target_shardings")
        return abstract
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------

def _incomplete_step(path: epath.Path) -> Optional[int]:
    """The step of a directory left by an unfinished save, else None."""
    match = re.fullmatch(rf"{STEP_PREFIX}_(\d+)({re.escape(_TMP_SUFFIX)}.*)?", path.name)
    if match is None:
        return None
    if match.group(2):
        return int(match.group(1))
    if str(path).startswith("gs://") and path.is_dir() and not (path / _COMMIT_FILE).exists():
        return int(match.group(1))
    return None


def _json_copy(value: Mapping[str, Any], what: str) -> dict:
    """A deep copy through JSON: later changes by the caller cannot reach an async save."""
    try:
        return json.loads(json.dumps(dict(value)))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{what} must be JSON-serializable: {e}") from None


def _first_lines(error: Exception, n: int = 3) -> str:
    return " ".join(str(error).strip().splitlines()[:n])
