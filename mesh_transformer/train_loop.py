"""Training on the devices of one host (or, with jax.distributed, of every host): `device_train.py`.

    run = TrainRun(config, RunOptions(...))   # mesh, sharded step, checkpoints, data, logging
    run.train()                               # resume or start, loop to total_steps, save

Start-up picks the first that applies:
  1. `model_dir` holds a complete checkpoint  -> resume it (params, optimizer, step, data position);
  2. `--tune-model-path CKPT` or `--hf DIR`   -> fine-tune from those weights with a fresh LR
     schedule (step 0); the optimizer state comes along from our checkpoints unless `--fresh-opt`;
  3. otherwise                                -> random initialisation.
"""
from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import jax
import numpy as np

from mesh_transformer import parallel
from mesh_transformer.checkpoint import CheckpointManager, checkpoint_dir
from mesh_transformer.config import Config, ConfigError
from mesh_transformer.data import Dataset, Loader
from mesh_transformer.metrics import MetricsLogger
from mesh_transformer.train_step import Trainer, TrainState

KEEP_LAST = 2  # newest checkpoints kept besides every keep_every-th step


class TrainingError(RuntimeError):
    """Training cannot go on (non-finite loss, missing data, ...); the last good checkpoint is intact."""


@dataclass(frozen=True)
class RunOptions:
    tune_model_path: Optional[str] = None  # our checkpoint dir to fine-tune from
    hf: Optional[str] = None  # HF GPT-J dir to fine-tune from
    fresh_opt: bool = False  # with tune_model_path: start with a new optimizer state
    log_dir: Optional[str] = None  # metrics.jsonl + TensorBoard; default logs/<name>
    tensorboard: bool = True
    stop_after: Optional[int] = None  # stop (and checkpoint) after this many steps of this process


def build_mesh(config: Config):
    t = config.train
    dp = t.tpu_size // t.cores_per_replica if t.tpu_size else None
    return parallel.make_mesh(t.cores_per_replica, dp)


class TrainRun:
    def __init__(self, config: Config, options: RunOptions = RunOptions()):
        t = config.train
        for key in ("train_set", "model_dir"):
            if not getattr(t, key):
                raise ConfigError(f"config key {key!r} must be set to train")
        self.config, self.options = config, options
        self.trainer = Trainer(config, build_mesh(config))
        self.ckpt = CheckpointManager(checkpoint_dir(t), keep_last=KEEP_LAST, keep_every=t.keep_every, config=config)
        self.dataset = Dataset.open(t.train_set)
        self.val_sets = {name: Dataset.open(path) for name, path in t.val_set.items()}
        for path, ds in [(t.train_set, self.dataset), *zip(t.val_set.values(), self.val_sets.values())]:
            if ds.seq < config.model.seq:
                raise ConfigError(f"config key 'seq': {config.model.seq} is longer than the sequences of "
                                  f"{path} ({ds.seq} tokens)")
        self.tokens_per_step = t.gradient_accumulation_steps * self.trainer.global_batch * config.model.seq
        self._interrupted = False

    # ---- start-up -----------------------------------------------------------------------------

    def start_state(self) -> tuple[TrainState, dict]:
        """(state, loader state) to continue from; see the module docstring for the order."""
        tr, o = self.trainer, self.options
        if self.ckpt.latest_step() is not None:
            state, extras = self.ckpt.restore(abstract_state=tr.abstract_state, target_shardings=tr.state_shardings)
            return state, extras.get("train_loader") or {}
        if o.hf:
            from mesh_transformer import hf
            hf_config, params = hf.load_hf(o.hf, mp=tr.mp)
            _check_same_architecture(hf_config, self.config, o.hf)
            return tr.state_from_params(params), {}
        if o.tune_model_path:
            source = CheckpointManager(o.tune_model_path, read_only=True)
            if o.fresh_opt:
                params = source.restore_params(abstract_params=tr.abstract_state.params,
                                               target_shardings=tr.state_shardings.params, check_config=False)
                return tr.state_from_params(params), {}
            state, _ = source.restore(abstract_state=tr.abstract_state, target_shardings=tr.state_shardings,
                                      check_config=False)
            return state._replace(step=jax.device_put(np.int32(0), tr.state_shardings.step)), {}
        return tr.init_state(self.config.train.seed), {}

    def loader(self, state: dict) -> Loader:
        t = self.config.train
        return Loader(self.dataset, self.trainer.global_batch, t.seed, accumulation=t.gradient_accumulation_steps,
                      process_index=jax.process_index(), process_count=jax.process_count(), state=state or None)

    # ---- the loop -----------------------------------------------------------------------------

    def train(self) -> TrainState:
        t = self.config.train
        state, loader_state = self.start_state()
        step = int(state.step)
        logger = MetricsLogger(self.options.log_dir or f"logs/{t.name}", t.name, t.wandb_project,
                               self.config.to_json_dict(), tensorboard=self.options.tensorboard)
        logger.message(f"{t.name}: step {step} of {t.total_steps}, mesh dp={self.trainer.dp} x mp={self.trainer.mp}, "
                       f"{self.config.model.n_params():,} parameters, checkpoints in {self.ckpt.directory}")
        previous = signal.signal(signal.SIGINT, self._on_interrupt)
        loader = self.loader(loader_state)
        steps_run = 0
        try:
            while step < t.total_steps and not self._interrupted:
                started = time.perf_counter()
                batch = self.device_batch(next(loader))
                state, metrics = self.trainer.step(state, batch)
                loss = float(metrics["loss"])  # waits for the step
                step, steps_run = step + 1, steps_run + 1
                if not math.isfinite(loss):
                    raise TrainingError(f"loss is {loss} at step {step}; stopping without saving "
                                        f"(last good checkpoint: step {self.ckpt.latest_step()})")
                values = self._train_values(metrics, loss, step, time.perf_counter() - started)
                if t.val_every and step % t.val_every == 0:
                    values.update(self.validate(state.params))
                logger.log(step, values)
                logger.progress(step, t.total_steps, values)
                finished = step >= t.total_steps or (self.options.stop_after and steps_run >= self.options.stop_after)
                if (t.ckpt_every and step % t.ckpt_every == 0) or finished:
                    self.save(state, loader)
                if finished:
                    break
            if self._interrupted:
                logger.message(f"interrupted: saving step {step}")
                self.save(state, loader)
        finally:
            signal.signal(signal.SIGINT, previous)
            loader.close()
            self.ckpt.wait()
            logger.close()
        return state

    def device_batch(self, batch: dict) -> dict:
        """Crop a loader batch to the model's sequence length and place it on the mesh."""
        seq = self.config.model.seq
        return self.trainer.shard_batch({"tokens": batch["tokens"][..., : seq + 1], "mask": batch["mask"][..., :seq]})

    def _train_values(self, metrics, loss: float, step: int, seconds: float) -> dict:
        return {"train/loss": loss, "grad_norm": float(metrics["grad_norm"]),
                "learning_rate": float(metrics["lr"]), "steps_per_sec": 1.0 / seconds,
                "tokens_per_sec": self.tokens_per_step / seconds,
                "sequences_processed": step * self.tokens_per_step // self.config.model.seq,
                "tokens_processed": step * self.tokens_per_step}

    def validate(self, params) -> dict:
        """val/loss_<name> over the first val_batches batches of each val_set, in order."""
        t = self.config.train
        out = {}
        for name, dataset in self.val_sets.items():
            loader = Loader(dataset, self.trainer.global_batch, shuffle=False, repeat=False,
                            process_index=jax.process_index(), process_count=jax.process_count())
            nll = count = 0.0
            with loader:
                for i, batch in enumerate(loader):
                    if t.val_batches and i >= t.val_batches:
                        break
                    batch_nll, batch_count = self.trainer.eval_sums(params, self.device_batch(batch))
                    nll, count = nll + float(batch_nll), count + float(batch_count)
            out[f"val/loss_{name}"] = nll / max(count, 1.0)
        return out

    def save(self, state: TrainState, loader: Loader) -> None:
        self.ckpt.save(int(state.step), state, extras={"train_loader": loader.state()})

    def _on_interrupt(self, signum, frame):
        if self._interrupted:  # a second Ctrl-C: give up at once
            raise KeyboardInterrupt
        self._interrupted = True


def _check_same_architecture(found, config: Config, source: str) -> None:
    ours = config.model
    for key in ("layers", "d_model", "n_heads", "n_vocab", "ff_dim", "rotary_dims"):
        if getattr(found, key) != getattr(ours, key):
            raise ConfigError(f"{source}: {key} is {getattr(found, key)} but the config says {getattr(ours, key)}")
