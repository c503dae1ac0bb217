"""Training on the devices of one host (or, with jax.distributed, of every host): `device_train.py`.

    run = TrainRun(config, RunOptions(...))   # mesh, sharded step, checkpoints, data, logging
    run.train()                               # resume or start, loop to total_steps, save

Start-up picks the first that applies:
  1. `model_dir` holds a complete checkpoint  -> resume it (params, optimizer, step, data position);
  2. `--tune-model-path CKPT` or `--hf DIR`   -> fine-tune from those weights with a fresh LR
     schedule (step 0); the optimizer state comes along from our checkpoints and from full
     mesh-transformer-jax v1 ones (Adam moments) unless `--fresh-opt`;
  3. otherwise                                -> random initialisation.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import shlex
import signal
import time
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

import jax
import numpy as np

from mesh_transformer import lora, parallel
from mesh_transformer.io.checkpoint import CheckpointManager, checkpoint_dir
from mesh_transformer.config import Config, ConfigError
from mesh_transformer.errors import UserError
from mesh_transformer.data import Dataset, DatasetError, Loader, Mixture, StreamMismatch
from mesh_transformer.train import preference
from mesh_transformer.train.metrics import MetricsLogger
from mesh_transformer.train.step import Trainer, TrainState

KEEP_LAST = 2  # newest checkpoints kept besides every keep_every-th step
OBJECTIVE_KEY = "objective"  # checkpoint extras: what the run trains (a PREFERENCE_KEYS key, "language_model")


class TrainingError(UserError, RuntimeError):
    """Training cannot go on (non-finite loss, missing data, ...); the last good checkpoint is intact."""


@dataclass(frozen=True)
class RunOptions:
    tune_model_path: Optional[str] = None  # our checkpoint dir to fine-tune from
    hf: Optional[str] = None  # HF model dir to fine-tune from (its family must match the config)
    fresh_opt: bool = False  # with tune_model_path: start with a new optimizer state
    log_dir: Optional[str] = None  # metrics.jsonl + TensorBoard; default logs/<name>
    tensorboard: bool = True
    stop_after: Optional[int] = None  # stop (and checkpoint) after this many steps of this process


def build_mesh(config: Config):
    return parallel.mesh_for(config.train)


def require_keys(config: Config, *keys: str) -> None:
    for key in keys:
        if not getattr(config.train, key):
            raise ConfigError(f"config key {key!r} must be set to train")


def open_datasets(config: Config) -> tuple[Dataset, dict[str, Dataset]]:
    """(train_set, {name: val_set}) of a config, each checked to hold sequences of at least `seq` tokens,
    to hold preference pairs exactly when the config trains on them (`dpo`, `cpo`, `orpo`, `reward`),
    unpaired examples exactly when it trains with `kto`, and labelled texts exactly when it trains a
    classifier on them (`classify`), with labels the classifier can take."""
    t = config.train
    weights = t.train_set if isinstance(t.train_set, dict) else {t.train_set: 1.0}
    check_distinct_parts(weights)
    parts = {path: Dataset.open(path) for path in weights}  # (a mixture's parts, each checked as a dataset)
    val = {name: Dataset.open(path) for name, path in t.val_set.items()}
    for path, ds in [*parts.items(), *zip(t.val_set.values(), val.values())]:
        if ds.seq < config.model.seq:
            raise ConfigError(f"config key 'seq': {config.model.seq} is longer than the sequences of "
                              f"{path} ({ds.seq} tokens)")
        if ds.classes or t.classify is not None:
            check_labelled_texts(config, path, ds)
            continue
        if ds.labels and t.preference != "kto":
            raise ConfigError(f"{path} holds unpaired examples ({{prompt, completion, label}} records): set the "
                              f"config key 'kto' (e.g. {{\"beta\": 0.1}}) to train on them"
                              + (f", not '{t.preference}'" if t.preference else ""))
        if ds.pairs and t.preference is None:
            raise ConfigError(f"{path} holds preference pairs: set the config key 'dpo' (e.g. {{\"beta\": 0.1}}), "
                              "'cpo', 'orpo' or (a reward model) 'reward' to train on them")
        if t.preference == "kto" and not ds.labels:
            raise ConfigError(f"config key 'kto': {path} holds no unpaired examples (create_finetune_dataset.py "
                              "makes them from {prompt, completion, label} records)"
                              + (": it holds preference pairs, for 'dpo', 'cpo', 'orpo' or 'reward'"
                                 if ds.pairs else ""))
        if t.preference is not None and not ds.pairs:
            raise ConfigError(f"config key '{t.preference}': {path} holds no preference pairs "
                              "(create_finetune_dataset.py makes them from {prompt, chosen, rejected} records)")
    if len(parts) == 1 and not isinstance(t.train_set, dict):
        return parts[t.train_set], val
    try:
        return Mixture(list(parts.values()), list(weights.values()), list(weights)), val
    except DatasetError as e:
        raise ConfigError(f"config key 'train_set': {e}") from None


def check_distinct_parts(weights: dict) -> None:
    """A mixture names each dataset once (two spellings of one path would be one part on Ray's
    driver, which makes paths absolute, and two here)."""
    from mesh_transformer.io import storage
    places = [p if storage.is_gcs(p) else os.path.realpath(p) for p in weights]
    same = [p for p, place in zip(weights, places) if places.count(place) > 1]
    if same:
        raise ConfigError(f"config key 'train_set': {' and '.join(map(repr, same))} name the same dataset; "
                          f"give each once, with the weight of all its names")


def check_labelled_texts(config: Config, path: str, ds: Dataset) -> None:
    """A classifier's data (`classify`): labelled texts whose labels its `problem_type` takes."""
    from mesh_transformer.train import classify
    t, labels = config.train, config.model.num_labels
    if not ds.classes:
        raise ConfigError(f"config key 'classify': {path} holds no labelled texts (create_finetune_dataset.py "
                          "--label-key label makes them from {text, label} records)")
    if t.classify is None:
        raise ConfigError(f"{path} holds labelled texts ({{text, label}} records): set num_labels and the config key "
                          f"'classify' (e.g. {{}}) to train a classifier on them"
                          + (f", not '{t.preference}'" if t.preference else ""))
    low, high = ds.index["label_range"]
    names, ours = ds.index.get("label_names"), config.model.label_names
    if names is not None and names != ours:
        raise ConfigError(f"config key 'label_names': {path} numbers its classes {json.dumps(names)}"
                          + (f", this config {json.dumps(ours)}: build it with --label-names {shlex.join(ours)}"
                             if ours is not None else f": set label_names {json.dumps(names)} (and num_labels "
                                                      f"{len(names)})"))
    problem, multi, key = classify.objective(config).problem_type, ds.multi_label, _problem_key(config)
    if multi != (problem == classify.MULTI_LABEL):
        raise ConfigError(f"{path} holds multi-label texts (a list of classes each): set the config key '{key}' to "
                          f"\"multi_label_classification\"" if multi else
                          f"config key '{key}': a multi-label classification trains on texts labelled with lists "
                          f"of classes, but {path} gives each text one label")
    if multi and ds.label_width != labels:
        raise ConfigError(f"config key 'num_labels': {labels} classes, but {path} has {ds.label_width} (set num_labels "
                          f"{ds.label_width}" + (f", or build it with --label-names naming all {labels} classes: the "
                                                 f"last ones no text has count too)" if ds.label_width < labels else ")"))
    if problem == classify.SINGLE_LABEL:
        if not ds.index["whole_labels"]:
            raise ConfigError(f"{path}: labels from {low:g} to {high:g}, not all class numbers (0, 1, ...): a "
                              f"regression's targets? (num_labels 1 trains one)")
        if high >= labels:
            raise ConfigError(f"config key 'num_labels': {labels} classes, but {path} has labels up to {high:g} "
                              f"(set num_labels {int(high) + 1})")


def desirable_examples(dataset: Dataset) -> tuple[int, int]:
    """(desirable, undesirable) unpaired examples an epoch of `dataset` trains on (KTO's; a mixture's
    parts each weighted by the share of an epoch it gives)."""
    parts = dataset.parts if isinstance(dataset, Mixture) else [dataset]
    shares = dataset.epoch_shares() if isinstance(dataset, Mixture) else [len(dataset) // 2]
    desirable = sum(share * part.read_labels(np.arange(0, len(part), 2)).mean()
                    for part, share in zip(parts, shares) if len(part))
    return int(round(desirable)), int(round(sum(shares) - desirable))


def train_loader(config: Config, dataset: Dataset, global_batch: int, state: Optional[dict] = None,
                 rows: Optional[tuple[int, int]] = None) -> Loader:
    """The training stream: shuffled by `seed`, `gradient_accumulation_steps` microbatches a step;
    `rows`: this process's rows of each batch (default: all)."""
    t = config.train
    try:
        return Loader(dataset, global_batch, t.seed, accumulation=t.gradient_accumulation_steps, rows=rows,
                      state=state or None, segments=uses_segments(config, dataset),
                      documents_apart=t.document_masking)
    except StreamMismatch as e:
        key = "seed" if e.key == "seed" else "train_set"
        raise ConfigError(f"config key '{key}': the checkpoint's place in its training data ({e}) is not a place "
                          f"in this config's stream; resume with the train_set and seed it was saved with, or start "
                          f"a new model_dir from it with --tune-model-path") from None


def uses_segments(config: Config, dataset: Dataset) -> bool:
    """Packed prompt/completion examples always stay apart; plain-text documents with `document_masking`;
    a preference pair's row, or a labelled text's, holds one example."""
    return bool((dataset.has_mask or config.train.document_masking) and not dataset.pairs and not dataset.classes)


def val_loader(dataset: Dataset, global_batch: int, rows: Optional[tuple[int, int]] = None,
               segments: bool = False) -> Loader:
    """A validation pass: the set in order, once, the last batch padded with mask-0 rows."""
    return Loader(dataset, global_batch, shuffle=False, repeat=False, rows=rows, segments=segments)


def due(step: int, every: int) -> bool:
    """Whether a `*_every` schedule (0 = never) fires at `step`."""
    return bool(every) and step % every == 0


def tokens_per_step(config: Config, global_batch: int) -> int:
    return config.train.gradient_accumulation_steps * global_batch * config.model.seq


def train_values(metrics: dict, step: int, seconds: float, config: Config, global_batch: int) -> dict:
    """What is logged for a step: the step's metrics plus rates and totals."""
    tokens = tokens_per_step(config, global_batch)
    return {**metrics, "steps_per_sec": 1.0 / seconds, "tokens_per_sec": tokens / seconds,
            "sequences_processed": step * tokens // config.model.seq, "tokens_processed": step * tokens}


def keep_tokenizer(directory: str, spec: str) -> None:
    """Save the training data's tokenizer beside the checkpoints, where sampling and serving look."""
    import tempfile

    from mesh_transformer.io import storage
    from mesh_transformer.io.tokenizer import TOKENIZER_FILES, load_tokenizer

    if jax.process_index() != 0 or storage.exists(storage.join(directory, "tokenizer.json")):
        return
    with tempfile.TemporaryDirectory() as tmp:
        load_tokenizer(spec).save_pretrained(tmp)
        for name in TOKENIZER_FILES:
            if os.path.exists(os.path.join(tmp, name)):
                with open(os.path.join(tmp, name), "rb") as f:
                    storage.write_bytes(storage.join(directory, name), f.read())


def keep_generation_config(directory: str, sources: list[str]) -> None:
    """Copy the generation_config.json of the model a run starts fine-tuning from (the first of
    `sources`, directories, that has one) beside the run's checkpoints, so an export names the same
    special tokens and a server stops at the same ids. Called once the weights were read."""
    from mesh_transformer.io import storage
    from mesh_transformer.io.tokenizer import GENERATION_CONFIG, read_generation_config

    if jax.process_index() != 0:
        return
    found = next((path for path in (storage.join(s, GENERATION_CONFIG) for s in sources) if storage.exists(path)), None)
    if found is not None:
        read_generation_config(found)  # a file that is not JSON fails the start, not the run's end
        storage.write_bytes(storage.join(directory, GENERATION_CONFIG), storage.read_bytes(found))


class TrainHost:
    """The part of a run that every host holds: mesh, compiled step, checkpoints, start-up, saving.

    `TrainRun` (device_train.py) feeds it batches from this process's loader; a Ray worker
    (`cluster.py`, train.py) feeds it the slices its driver sends. Both run exactly this code.
    Batches are this process's rows of the global batch (`batch_rows`), as host arrays.
    """

    def __init__(self, config: Config, options: RunOptions = RunOptions()):
        require_keys(config, "model_dir")
        t = config.train
        self.config, self.options = config, options
        self.trainer = Trainer(config, build_mesh(config))
        self.ckpt = CheckpointManager(checkpoint_dir(t), keep_last=KEEP_LAST, keep_every=t.keep_every, config=config)
        self.tokens_per_step = tokens_per_step(config, self.trainer.global_batch)
        self._saved_step: Optional[int] = None
        self.evaluator = None  # eval_harness_tasks (mesh_transformer.evaluate.training), checked now
        if t.eval_harness_tasks and t.eval_period:
            from mesh_transformer.evaluate.training import TrainingEvaluator
            self.evaluator = TrainingEvaluator(config, self.trainer)
        self._base_ref: Optional[dict] = None  # LoRA: where the frozen base came from (DPO: its reference)
        self._base_print: Optional[int] = None

    def _check_lora_scale(self) -> None:
        """A resumed LoRA run keeps its adapters' scale (alpha and use_rslora; a new rank fails the
        shape check): the adapters trained under it, and the exports read the latest step's config."""
        saved_lora = (self.ckpt.saved_config(self._saved_step) or {}).get("lora")
        if saved_lora is None:
            return
        was, now = lora.LoraConfig.from_dict(saved_lora), self.trainer.lora
        if was.rank == now.rank and not math.isclose(was.scale, now.scale, rel_tol=1e-9):
            def said(c):
                return f"{c.scale:g} (alpha {c.alpha:g}, rank {c.rank}{', use_rslora' if c.use_rslora else ''})"
            raise ConfigError(f"{self.ckpt.directory}: its step {self._saved_step} trained LoRA adapters at scale "
                              f"{said(was)}; this config's lora gives {said(now)}. Resume with the same alpha and "
                              f"use_rslora, or start a new model_dir with --tune-model-path {self.ckpt.directory}")

    def start_state(self) -> tuple[TrainState, dict]:
        """(state, loader state) to continue from; see the module docstring for the order.

        With LoRA the state holds the adapters; the frozen base is read from where the run's
        checkpoints say it came from (`lora.BASE_KEY` in their extras) and checked against the
        fingerprint recorded with it. DPO without LoRA keeps its reference (the weights the run
        started from) the same way."""
        tr, o = self.trainer, self.options
        if self.ckpt.latest_step() is not None:
            latest = self.ckpt.latest_step()
            saved_config = self.ckpt.saved_config(latest) or {}
            _check_same_classes(saved_config.get("label_names"), self.config, f"{self.ckpt.directory} (step {latest})")
            _check_same_problem(saved_config.get("problem_type"), self.config, self.ckpt.directory, latest)
            state, extras = self.ckpt.restore(abstract_state=tr.abstract_state, target_shardings=tr.state_shardings)
            self._saved_step = int(state.step)
            saved = extras.get(OBJECTIVE_KEY)  # (absent from checkpoints written before it was recorded)
            if saved is not None and saved != self.objective:
                raise ConfigError(f"{self.ckpt.directory}: its step {self._saved_step} trained with objective "
                                  f"{saved!r}, this config with {self.objective!r}; to switch, start a new "
                                  f"model_dir with --tune-model-path {self.ckpt.directory}")
            if tr.lora is not None:
                self._check_lora_scale()
            if tr.lora is not None or tr.holds_reference:
                where, fingerprint = self._frozen_keys()
                if tr.holds_reference and where not in extras:
                    what = self.config.train.preference.upper()
                    raise ConfigError(f"{self.ckpt.directory}: its step {self._saved_step} is not a {what} run's "
                                      f"(it names no reference model); start {what} in a new model_dir with "
                                      f"--tune-model-path {self.ckpt.directory}")
                self._load_base(extras.get(where), extras.get(fingerprint))
            return state, extras.get("train_loader") or {}
        if o.hf:
            from mesh_transformer.io import hf
            _check_same_classes(hf.label_names(o.hf), self.config, o.hf)  # (before reading the weights)
            hf_config, params = hf.load_hf(o.hf, mp=tr.mp, num_labels=self.config.model.num_labels)
            _check_same_architecture(hf_config, self.config, o.hf)
            self._base_ref = lora.base_reference(hf=o.hf)
            keep_generation_config(self.ckpt.directory, [o.hf])
            return tr.state_from_params(params), {}
        if o.tune_model_path:
            from mesh_transformer.io import mtj_v1
            v1_dir = mtj_v1.find(o.tune_model_path)
            started = self._tuned_state(v1_dir)
            keep_generation_config(self.ckpt.directory,
                                   mtj_v1.tokenizer_dirs(v1_dir) if v1_dir is not None else [o.tune_model_path])
            return started
        if tr.lora is not None or tr.holds_reference:  # a random base (or reference): reproducible from the seed,
            self._load_base(lora.base_reference(seed=self.config.train.seed))  # read as a resume reads it
        return tr.init_state(self.config.train.seed), {}

    @property
    def objective(self) -> str:
        """What the run trains: its preference objective's key, "classify", or "language_model"."""
        t = self.config.train
        return t.preference or ("classify" if t.classify is not None else "language_model")

    def _frozen_keys(self) -> tuple[str, str]:
        """The checkpoint extras naming the frozen weights and their fingerprint: LoRA's base, or DPO's reference."""
        if self.trainer.holds_reference:
            return preference.REFERENCE_KEY, preference.REFERENCE_FINGERPRINT_KEY
        return lora.BASE_KEY, lora.FINGERPRINT_KEY

    def _tuned_state(self, v1_dir: Optional[str]) -> tuple[TrainState, dict]:
        """The start of a fine-tune from `--tune-model-path`: ours, or the original's v1 format (in `v1_dir`)."""
        from mesh_transformer.io import mtj_v1
        tr, o = self.trainer, self.options
        if v1_dir is not None:  # the original's format: a full one carries its Adam moments over
            if tr.lora is not None or tr.preference is not None:
                what = "LoRA" if tr.lora is not None else self.config.train.preference.upper()
                raise ConfigError(f"{o.tune_model_path}: {what} on a "
                                  "mesh-transformer-jax v1 checkpoint: convert it first (to_hf_weights.py, then --hf)")
            v1 = mtj_v1.V1Checkpoint(v1_dir, self.config.model)
            return mtj_v1.train_state(v1, tr, moments=v1.full and not o.fresh_opt), {}
        source = CheckpointManager(o.tune_model_path, read_only=True)
        _check_same_classes((source.saved_config() or {}).get("label_names"), self.config, o.tune_model_path)
        if tr.lora is not None:
            step = source.latest_step()
            self._load_base(lora.base_reference(ckpt=o.tune_model_path, step=step))
            return tr.init_state(self.config.train.seed), {}  # fresh adapters on the base just read
        if tr.holds_reference:  # DPO's reference: the weights the run starts from
            self._base_ref = lora.base_reference(ckpt=o.tune_model_path, step=source.latest_step())
        if o.fresh_opt or not source.holds_optimizer_state():  # from_hf_weights.py writes params only
            params = source.restore_params(abstract_params=tr.abstract_state.params,
                                           target_shardings=tr.state_shardings.params, check_config=False)
            return tr.state_from_params(params), {}
        state, _ = source.restore(abstract_state=tr.abstract_state, target_shardings=tr.state_shardings,
                                  check_config=False)
        if tr.holds_reference:
            tr.set_base(state.params)
        return state._replace(step=jax.device_put(np.int32(0), tr.state_shardings.step)), {}

    def _load_base(self, ref: Optional[dict], expected: Optional[int] = None) -> None:
        """Read the LoRA base `ref` names onto the mesh (compute dtype); ConfigError if it changed.
        An int8 base (`quantize_base`) is read into host memory and quantized a leaf at a time, so
        the devices never hold the float base whole."""
        tr = self.trainer
        full = self.trainer.model.param_specs(self.trainer.rules)
        shardings = None if tr.quantize_base else parallel.named(tr.mesh, tr.frozen_part(full))
        tr.set_base(lora.base_params(ref, self.config.model, tr.mp, shardings=shardings))
        self._base_ref = ref
        if expected is not None and lora.fingerprint(tr.base) != expected:
            what = f"{self.config.train.preference.upper()} reference" if tr.holds_reference else "LoRA base"
            raise ConfigError(f"the {what} {ref} is not the one this run was trained on (its weights changed)")

    def batch_rows(self) -> tuple[int, int]:
        """[start, stop) of the global batch's rows (axis 1 of [A, B, T+1]) that this process feeds.

        Rows follow the dp axis; a process whose devices span several dp rows feeds all of them,
        and processes that share a dp row (mp wider than one host) feed the same rows.
        """
        tr = self.trainer
        shape = (1, tr.global_batch, 1)
        index = tr.batch_sharding.addressable_devices_indices_map(shape).values()
        starts = [i[1].start or 0 for i in index]
        stops = [tr.global_batch if i[1].stop is None else i[1].stop for i in index]
        return min(starts), max(stops)

    def compile(self, state: TrainState) -> None:
        """Compile the step (and the validation pass) now: the first real call then costs no more than any
        other, so a cluster driver can hold it to the ordinary step timeout."""
        tr, t, seq = self.trainer, self.config.train, self.config.model.seq

        def batch(accumulation: int) -> dict:
            return {**tr.abstract_batch(accumulation),
                    "mask": jax.ShapeDtypeStruct((accumulation, tr.global_batch, seq), np.float32,
                                                 sharding=tr.batch_sharding)}

        tr.step.lower(state, batch(t.gradient_accumulation_steps)).compile()  # jit keeps it for the real calls
        if t.val_every and t.val_set:
            tr.eval_values.lower(state.params, batch(1)).compile()

    def device_batch(self, batch: dict) -> dict:
        """Crop a loader batch to the model's sequence length and place it on the mesh."""
        seq = self.config.model.seq
        out = {"tokens": batch["tokens"][..., : seq + 1], "mask": batch["mask"][..., :seq]}
        if "segments" in batch:
            out["segments"] = batch["segments"][..., : seq + 1].astype(np.int32)
        if "labels" in batch:
            out["labels"] = batch["labels"]
        return self.trainer.shard_batch(out)

    def step(self, state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        """One optimizer step on this process's rows of a batch -> (new state, logged metrics).

        Raises TrainingError (without saving) when the loss is not finite.
        """
        state, metrics = self.trainer.step(state, self.device_batch(batch))
        loss = float(metrics["loss"])  # waits for the step
        if not math.isfinite(loss):
            self.ckpt.wait()  # a save already started holds a good (finite-loss) state: let it land
            raise TrainingError(f"loss is {loss} at step {int(state.step)}; stopping without saving "
                                f"(last good checkpoint: step {self.ckpt.latest_step()})")
        pairs = {f"train/{k}": float(metrics[k]) for k in self.trainer.metric_names  # DPO's; KTO's per-label
                 if k != "loss" and not math.isnan(float(metrics[k]))}           # means where the step has that label
        return state, {"train/loss": loss, **pairs, "grad_norm": float(metrics["grad_norm"]),
                       "learning_rate": float(metrics["lr"])}

    def val_losses(self, params, batches: Mapping[str, Iterable[dict]]) -> dict:
        """val/loss_<name> over the first val_batches batches (all when 0) of each stream, in order
        (with DPO: the preference loss, and val/<metric>_<name> for its other metrics)."""
        limit = self.config.train.val_batches or None
        out = {}
        for name, stream in batches.items():
            sums, count = dict.fromkeys(self.trainer.sum_names, 0.0), 0.0
            for batch in itertools.islice(stream, limit):
                batch_sums, batch_count = self.trainer.eval_values(params, self.device_batch(batch))
                sums = {k: v + float(batch_sums[k]) for k, v in sums.items()}
                count += float(batch_count)
            means = {k: float(v) for k, v in self.trainer.means(sums, max(count, 1.0)).items()}
            out.update({f"val/{k}_{name}": v for k, v in means.items() if not math.isnan(v)})
        return out

    def eval_metrics(self, params, tokenizer: str) -> dict:
        """eval/<task>/<metric> of eval_harness_tasks on `params` ({} when none are configured);
        `tokenizer`: the training data's (a spec `io.tokenizer.load_tokenizer` reads)."""
        return self.evaluator(params, tokenizer) if self.evaluator is not None else {}

    def save(self, state: TrainState, loader_state: dict) -> None:
        """Start an (async) checkpoint of `state` unless its step is saved already (e.g. a Ctrl-C
        right after a scheduled save); every process calls it with the same arguments."""
        step = int(state.step)
        if step != self._saved_step:
            extras = {"train_loader": loader_state, OBJECTIVE_KEY: self.objective}
            if self.trainer.lora is not None or self.trainer.holds_reference:  # the base (or DPO's reference)
                if self._base_print is None:                                      # by reference, not a copy
                    self._base_print = lora.fingerprint(self.trainer.base)
                where, fingerprint = self._frozen_keys()
                extras.update({where: self._base_ref, fingerprint: self._base_print})
            self.ckpt.save(step, state, extras=extras)
            self._saved_step = step


class TrainRun:
    """A whole run in this process (and its jax.distributed peers, if any): data, loop, logging."""

    def __init__(self, config: Config, options: RunOptions = RunOptions()):
        require_keys(config, "train_set", "model_dir")
        self.config, self.options = config, options
        self.host = TrainHost(config, options)
        self.trainer, self.ckpt, self.tokens_per_step = self.host.trainer, self.host.ckpt, self.host.tokens_per_step
        self.dataset, self.val_sets = open_datasets(config)
        self.tokenizer = self.dataset.index.get("tokenizer") or "gpt2"  # the data's, saved with checkpoints
        self._interrupted = False

    # ---- start-up -----------------------------------------------------------------------------

    def start_state(self) -> tuple[TrainState, dict]:
        return self.host.start_state()

    def loader(self, state: dict) -> Loader:
        return train_loader(self.config, self.dataset, self.trainer.global_batch, state, rows=self.host.batch_rows())

    # ---- the loop -----------------------------------------------------------------------------

    def train(self) -> TrainState:
        t = self.config.train
        state, loader_state = self.start_state()
        step = int(state.step)
        keep_tokenizer(self.ckpt.directory, self.tokenizer)
        logger = MetricsLogger(self.options.log_dir or f"logs/{t.name}", t.name, t.wandb_project,
                               self.config.to_json_dict(), tensorboard=self.options.tensorboard)
        logger.message(f"{t.name}: step {step} of {t.total_steps}, mesh dp={self.trainer.dp} x mp={self.trainer.mp}, "
                       f"{self.config.model.n_params():,} parameters, checkpoints in {self.ckpt.directory}")
        if isinstance(self.dataset, Mixture):
            logger.message(self.dataset.describe())
        if self.dataset.labels and not self.dataset.classes:  # KTO: how balanced the labels are, against the weights
            desirable, undesirable = desirable_examples(self.dataset)
            advice = self.trainer.preference.weight_advice(desirable, undesirable)
            if advice:
                logger.message(advice)
        previous = signal.signal(signal.SIGINT, self._on_interrupt)
        loader = self.loader(loader_state)
        steps_run = 0
        try:
            while step < t.total_steps and not self._interrupted:
                started = time.perf_counter()
                state, metrics = self.host.step(state, next(loader))
                step, steps_run = step + 1, steps_run + 1
                values = train_values(metrics, step, time.perf_counter() - started, self.config,
                                      self.trainer.global_batch)
                if due(step, t.val_every):
                    values.update(self.validate(state.params))
                if due(step, t.eval_period):
                    values.update(self.host.eval_metrics(state.params, self.tokenizer))
                logger.log(step, values)
                logger.progress(step, t.total_steps, values)
                finished = step >= t.total_steps or (self.options.stop_after and steps_run >= self.options.stop_after)
                if due(step, t.ckpt_every) or finished:
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
        return self.host.device_batch(batch)

    def validate(self, params) -> dict:
        """val/loss_<name> over the first val_batches batches of each val_set, in order."""
        loaders = {name: val_loader(dataset, self.trainer.global_batch, rows=self.host.batch_rows(),
                                    segments=uses_segments(self.config, dataset))
                   for name, dataset in self.val_sets.items()}
        try:
            return self.host.val_losses(params, loaders)
        finally:
            for loader in loaders.values():
                loader.close()

    def save(self, state: TrainState, loader: Loader) -> None:
        self.host.save(state, loader.state())

    def _on_interrupt(self, signum, frame):
        if self._interrupted:  # a second Ctrl-C: give up at once
            raise KeyboardInterrupt
        self._interrupted = True


def _check_same_classes(names: Optional[list], config: Config, source: str) -> None:
    """A classifier of classes (two or more) started from (or resumed at) weights whose classes
    `source` names `names`: the config names them alike, so no head trains under other class numbers
    than it learnt."""
    ours = config.model.label_names
    if names is None or names == ours or config.model.num_labels < 2:
        return
    raise ConfigError(f"config key 'label_names': {source} names its classes {json.dumps(names)}"
                      + (f", this config {json.dumps(ours)}: its score head would train under other class numbers"
                         if ours is not None else f": set label_names {json.dumps(names)}"))


def _check_same_problem(problem: Optional[str], config: Config, directory: str, step: int) -> None:
    """A classifier run resumed at `step` of `directory`, whose checkpoint recorded what its outputs
    mean (`problem`; absent before problem types were recorded): the config means the same."""
    ours = config.model.problem_type
    if problem is not None and ours is not None and problem != ours:
        raise ConfigError(f"config key '{_problem_key(config)}': {directory} (step {step}) trained a {problem}, "
                          f"this config a {ours}; to switch, start a new model_dir with --tune-model-path {directory}")


def _problem_key(config: Config) -> str:
    """The config key that says a classifier's problem type: `classify.problem_type` where given,
    else the model's `problem_type` (which a classify run fills when neither is given)."""
    return "classify.problem_type" if "problem_type" in (config.train.classify or {}) else "problem_type"


def _check_same_architecture(found, config: Config, source: str) -> None:
    ours, theirs = config.model.architecture(), found.architecture()
    for key in sorted(set(ours) | set(theirs)):
        if ours.get(key) != theirs.get(key):
            raise ConfigError(f"{source}: {key} is {theirs.get(key)!r} but the config says {ours.get(key)!r}")
