"""Typed configuration, read from the original mesh-transformer-jax JSON keys.

A config file is one flat JSON object (as in the original `configs/*.json`). Each key belongs to
exactly one of the two dataclasses below; `load_config` routes keys, checks types and values, and
raises one `ConfigError` naming the offending key — never a traceback from inside JAX.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from mesh_transformer.errors import UserError

REMAT_POLICIES = ("none", "full", "dots")
ATTENTION_IMPLS = ("xla", "cudnn")  # how training computes attention (models/layers.py Attention)
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_FAMILY = "gptj"  # what every original config means

# Keys the original read that have no effect here; accepted (with a warning) so old configs load.
LEGACY_KEYS = {
    "comment": "free text",
    "early_cast": "parameters are always cast to compute_dtype before the forward pass",
    "val_batch_multiplier": "validation uses per_replica_batch",
    "noise_scale_alpha": "gradient-noise-scale statistics are not computed",
    "early_collect": "ZeRO gathers each layer inside the scan (see `zero`)",
    "eval_only": "use the evaluation tools instead",
}


class ConfigError(UserError, ValueError):
    """A config key is missing, unknown, of the wrong type, or inconsistent with another key."""



def canonical_rope_scaling(scaling: dict) -> dict:
    """HF's rope_scaling dict in one form: its kind under `rope_type` (older files: `type`, or both),
    no None values. Two configs whose dicts differ only so compute the same rotary."""
    out = {k: v for k, v in scaling.items() if v is not None and k not in ("rope_type", "type")}
    return {"rope_type": scaling.get("rope_type", scaling.get("type")), **out}

@dataclass(frozen=True)
class ModelConfig:
    """What every model family shares. Sizes are global (before any sharding).

    Each family (`mesh_transformer.models`) subclasses this with its own keys, its HF conversion and
    its block; `family` picks the subclass when a config is read.
    """

    layers: int
    d_model: int
    n_heads: int
    n_vocab: int
    seq: int
    family: str = DEFAULT_FAMILY
    d_head: Optional[int] = None  # default d_model // n_heads
    d_ff: Optional[int] = None  # default 4 * d_model
    pe: str = "rotary"  # position encoding; each family lists the ones it supports (PE_CHOICES)
    layer_norm_eps: float = 1e-5
    compute_dtype: str = "bfloat16"
    remat: str = "full"
    attention_impl: str = "xla"  # "cudnn": jax.nn.dot_product_attention, cuDNN flash attention on NVIDIA GPUs
    scan_layers: bool = True  # False: training and scoring run the stacked layers unrolled (compile time grows with depth)
    loss_chunk: int = 0  # > 0: training's vocabulary head and loss run this many tokens at a time (memory for compute)
    num_labels: int = 0  # 0: a language model; > 0: a classifier (HF's ForSequenceClassification; 1: a reward model)
    label_names: Optional[list] = None  # a classifier's class names by number (HF's id2label); default LABEL_i
    problem_type: Optional[str] = None  # what a classifier's outputs mean (HF's key): "single_label_classification",
    # "multi_label_classification" or "regression"; default by num_labels (1: regression)

    PE_CHOICES: typing.ClassVar[tuple[str, ...]] = ("rotary", "fixed", "none", "alibi")

    @property
    def head_dim(self) -> int:
        return self.d_head if self.d_head is not None else self.d_model // self.n_heads

    @property
    def ff_dim(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @property
    def kv_heads(self) -> int:
        """Key/value heads (fewer than n_heads with grouped-query attention)."""
        return self.n_heads

    def kv_split(self, mp: int) -> bool:
        """Whether the kv heads split over mp shards (else each shard computes the one it needs)."""
        return self.kv_heads % mp == 0

    def cache_heads(self, mp: int) -> int:
        """Heads of the KV cache over all mp shards: the kv heads, or one copy per shard when they do
        not split (the cache's head axis is always split over mp)."""
        return self.kv_heads if self.kv_split(mp) else mp

    def padded_vocab(self, mp: int = 1) -> int:
        """Vocabulary rounded up so the embedding and head split evenly over `mp` shards.

        A multiple of lcm(128, mp): the same for every power-of-two mp up to 128, so parameter
        shapes (and checkpoints) do not depend on the mesh. Padded rows are never sampled and
        never enter the loss.
        """
        multiple = math.lcm(128, mp)
        return -(-self.n_vocab // multiple) * multiple

    def windowed_layers(self) -> Optional[tuple[bool, ...]]:
        """Which layers attend within the family's sliding window, one bool per layer; None: every
        layer alike (all within the window where there is one)."""
        return None

    def n_params(self) -> int:
        """Unique trainable parameters (unpadded vocabulary), as HF counts them."""
        from mesh_transformer import models
        return models.build(self).n_params()

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6 x matmul params + causal-free attention (PaLM appendix B)."""
        from mesh_transformer import models
        return models.build(self).flops_per_token()

    def architecture(self) -> dict[str, Any]:
        """What fixes the meaning of the weights: every key but compute_dtype, remat, attention_impl,
        scan_layers, loss_chunk and a mixture's expert_parallel (how it runs, not what it computes),
        label_names and problem_type (what a classifier's outputs are called and mean),
        with defaults resolved; `seq` only with learned positions."""
        out = {k: v for k, v in dataclasses.asdict(self).items()
               if k not in ("compute_dtype", "remat", "attention_impl", "scan_layers", "loss_chunk", "expert_parallel",
                            "seq", "label_names", "problem_type")}
        out.update(d_head=self.head_dim, d_ff=self.ff_dim)
        if "n_kv_heads" in out and out["n_kv_heads"] is None:  # every family's default: no grouping
            out["n_kv_heads"] = self.n_heads
        if self.pe == "fixed":
            out["seq"] = self.seq
        if not self.num_labels:  # (a language model: what checkpoints written before classifiers record)
            out.pop("num_labels")
        if isinstance(out.get("rope_scaling"), dict):
            out["rope_scaling"] = canonical_rope_scaling(out["rope_scaling"])
        return out

    def validate(self) -> None:
        """Value checks (ConfigError naming the key); families add theirs."""
        for key in ("layers", "d_model", "n_heads", "n_vocab", "seq"):
            require(getattr(self, key) > 0, key, f"must be positive, got {getattr(self, key)}")
        if self.d_head is None:
            require(self.d_model % self.n_heads == 0, "n_heads", f"{self.n_heads} does not divide d_model={self.d_model}")
        else:
            require(self.d_head > 0, "d_head", f"must be positive, got {self.d_head}")
        require(self.d_ff is None or self.d_ff > 0, "d_ff", f"must be positive, got {self.d_ff}")
        require(self.pe in self.PE_CHOICES, "pe", f"family {self.family!r} supports {self.PE_CHOICES}, got {self.pe!r}")
        require(self.compute_dtype in DTYPES, "compute_dtype", f"must be one of {DTYPES}, got {self.compute_dtype!r}")
        require(self.remat in REMAT_POLICIES, "remat", f"must be one of {REMAT_POLICIES}, got {self.remat!r}")
        require(self.attention_impl in ATTENTION_IMPLS, "attention_impl",
                f"must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
        require(isinstance(self.scan_layers, bool), "scan_layers", f"must be true or false, got {self.scan_layers!r}")
        require(isinstance(self.loss_chunk, int) and not isinstance(self.loss_chunk, bool) and self.loss_chunk >= 0,
                "loss_chunk", f"must be a whole number of tokens, 0 for all at once, got {self.loss_chunk!r}")
        require(self.layer_norm_eps > 0, "layer_norm_eps", "must be positive")
        require(isinstance(self.num_labels, int) and self.num_labels >= 0, "num_labels",
                f"must be 0 (a language model) or the classifier's label count (1: a reward model), "
                f"got {self.num_labels!r}")
        names = self.label_names
        if names is not None:
            require(self.classifier, "label_names", "names a classifier's classes: set num_labels too")
            require(isinstance(names, list) and len(names) == self.num_labels
                    and all(isinstance(n, str) and n for n in names) and len(set(names)) == len(names),
                    "label_names", f"must be a list of {self.num_labels} different names, one per class "
                                   f"(num_labels), got {json.dumps(names)}")
        if self.problem_type is not None:
            from mesh_transformer.train import classify
            require(self.classifier, "problem_type", "says what a classifier's outputs mean: set num_labels too")
            classify.check_problem_type(self.problem_type, self.num_labels, "problem_type", trains=False)

    @property
    def classifier_problem(self) -> Optional[str]:
        """What a classifier's outputs mean (transformers' problem_type): `problem_type`, else a
        regression for one output and a single-label classification for more; None for a language model."""
        if not self.classifier:
            return None
        return self.problem_type or ("regression" if self.num_labels == 1 else "single_label_classification")

    @property
    def classifier(self) -> bool:
        """A sequence classifier (or reward model): a score head of `num_labels` outputs in place of
        the language-model head, read at each row's last token."""
        return self.num_labels > 0


@dataclass(frozen=True)
class TrainConfig:
    """How to train: mesh, batch, optimizer, schedule, storage, logging."""

    cores_per_replica: int = 1  # model-parallel size (mesh axis 'mp')
    tpu_size: Optional[int] = None  # total devices; default: all visible devices
    per_replica_batch: int = 1
    gradient_accumulation_steps: int = 1
    warmup_steps: int = 0
    anneal_steps: int = 1
    lr: float = 1e-4
    end_lr: float = 1e-5
    weight_decay: float = 0.1
    total_steps: int = 1
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    clip_norm: float = 1.0
    z_loss: float = 0.0
    zero: bool = False
    seed: int = 0
    bucket: Optional[str] = None
    model_dir: Optional[str] = None
    train_set: Optional[Union[str, dict]] = None  # an index path, or {index path: weight}: a mixture (data.Mixture)
    val_set: dict = field(default_factory=dict)
    val_batches: int = 0
    val_every: int = 0
    ckpt_every: int = 0
    keep_every: int = 0
    name: str = "mesh-transformer"
    wandb_project: Optional[str] = None
    eval_harness_tasks: list = field(default_factory=list)  # lm-eval task names run during training
    eval_every: Optional[int] = None  # steps between those evaluations; default val_every (0 = never)
    eval_include_path: Optional[str] = None  # a folder of task YAMLs the task names may refer to
    lora: Optional[dict] = None  # {"rank", "alpha", "dropout", "targets"}: train adapters only (mesh_transformer.lora)
    dpo: Optional[dict] = None  # {"beta", "loss_type", ...}: train on preference pairs with DPO (train/preference.py)
    cpo: Optional[dict] = None  # {"beta", "loss_type", "cpo_alpha", "simpo_gamma", ...}: CPO / SimPO, no reference
    orpo: Optional[dict] = None  # {"beta"}: ORPO, no reference
    kto: Optional[dict] = None  # {"beta", "desirable_weight", "undesirable_weight", "loss_type"}: KTO, unpaired data
    reward: Optional[dict] = None  # {"center_rewards_coefficient"}: a reward model (num_labels 1) on pairs
    classify: Optional[dict] = None  # {"problem_type"}: a classifier (num_labels > 0) on labelled texts (train/classify.py)
    bf16_optimizer: bool = False  # Adam moments in bfloat16 (the original v2's key)
    fcm_max_ratio: float = 0.0  # forgetful causal masking: mask up to this fraction of keys (training only)
    fcm_min_ratio: float = 0.0
    neftune_noise_alpha: Optional[float] = None  # NEFTune: noise on the token embeddings (training only; HF's key)
    document_masking: bool = False  # plain text: documents packed in a row do not attend to each other

    @property
    def eval_period(self) -> int:
        """Steps between runs of eval_harness_tasks: eval_every, else val_every (0 = never)."""
        return self.val_every if self.eval_every is None else self.eval_every

    @property
    def preferences(self) -> tuple[str, ...]:
        """The keys of the preference objectives set ("dpo", "cpo", "orpo", "kto", "reward"; `validate` allows one)."""
        return tuple(key for key in PREFERENCE_KEYS if getattr(self, key) is not None)

    @property
    def preference(self) -> Optional[str]:
        """The preference objective's key when one is set, else None."""
        return next(iter(self.preferences), None)

    @property
    def rows_per_replica(self) -> int:
        """Sequences a dp replica takes a microbatch: per_replica_batch, or with a preference objective
        (where the batch counts pairs, or KTO's examples, as TRL's does) twice that: each pair's chosen
        and rejected, each example's row and KL row."""
        return self.per_replica_batch * (2 if self.preference is not None else 1)


# the objectives on preference data (train/preference.py), one at most: on pairs, and KTO on unpaired examples
PREFERENCE_KEYS = ("dpo", "cpo", "orpo", "kto", "reward")


@dataclass(frozen=True)
class Config:
    model: ModelConfig
    train: TrainConfig

    def to_json_dict(self) -> dict:
        """The flat original-style dict; `config_from_dict(c.to_json_dict()) == c`."""
        out = {**dataclasses.asdict(self.model), **dataclasses.asdict(self.train)}
        if not self.model.num_labels:  # a language model's config as versions before classifiers wrote it
            out.pop("num_labels")
        return {k: v for k, v in out.items() if v is not None}


_TRAIN_KEYS = {f.name for f in dataclasses.fields(TrainConfig)}


def model_class(family: str) -> type[ModelConfig]:
    """The ModelConfig subclass of a family (ConfigError naming the supported ones)."""
    from mesh_transformer import models
    return models.config_class(family)


def load_config(path: str | Path) -> Config:
    """Read a JSON config file; errors name the file and the key at fault."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}") from None
    try:
        return config_from_dict(raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def config_from_dict(raw: dict[str, Any]) -> Config:
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a JSON object, got {type(raw).__name__}")
    family = raw.get("family", DEFAULT_FAMILY)
    if not isinstance(family, str):
        raise ConfigError(f"config key 'family' must be str, got {json.dumps(family)}")
    model_cls = model_class(family)
    model_keys = {f.name for f in dataclasses.fields(model_cls)}
    sections: dict[type, dict[str, Any]] = {model_cls: {}, TrainConfig: {}}
    for key, value in raw.items():
        if key in LEGACY_KEYS:
            if key != "comment":
                warnings.warn(f"config key {key!r} is ignored: {LEGACY_KEYS[key]}", stacklevel=3)
            continue
        cls = model_cls if key in model_keys else TrainConfig if key in _TRAIN_KEYS else None
        if cls is None:
            raise ConfigError(_unknown_key(key, family, model_keys))
        sections[cls][key] = _check_type(key, value, _field_types(cls)[key])
    for cls, given in sections.items():
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.name not in given and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ConfigError(f"missing required config key {missing[0]!r}")
    config = Config(model_cls(**sections[model_cls]), TrainConfig(**sections[TrainConfig]))
    validate(config)
    if config.train.classify is not None and config.model.problem_type is None:  # the model's outputs mean what
        from mesh_transformer.train import classify                                # it trains them to (as
        trained = classify.objective(config).problem_type                          # transformers' loss records it)
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, problem_type=trained))
    return config


def _unknown_key(key: str, family: str, model_keys: set[str]) -> str:
    from mesh_transformer import models
    elsewhere = [f for f in models.FAMILIES if key in {x.name for x in dataclasses.fields(models.config_class(f))}]
    if elsewhere:
        return f"config key {key!r} does not apply to family {family!r} (it is a key of {', '.join(elsewhere)})"
    hint = difflib.get_close_matches(key, sorted(model_keys | _TRAIN_KEYS | set(LEGACY_KEYS)), n=1)
    return f"unknown config key {key!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")


def _field_types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_type(key: str, value: Any, annotation: Any) -> Any:
    allowed = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else (annotation,)
    for t in allowed:
        if t is type(None) and value is None:
            return None
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t in (str, bool, dict, list) and type(value) is t:
            return value
    names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
    raise ConfigError(f"config key {key!r} must be {names}, got {json.dumps(value)} ({type(value).__name__})")


def check_object(raw: Any, key: str, keys: typing.Sequence[str], shape: str) -> dict:
    """A config key whose value is an object of `keys` (e.g. "lora", "dpo"): ConfigError naming the key
    when it is not an object (`shape` says what it should look like) or naming `key.<name>` when it
    holds a key not among `keys`."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config key {key!r} must be an object {shape}, got {json.dumps(raw)}")
    unknown = sorted(set(raw) - set(keys))
    if unknown:
        raise ConfigError(f"config key '{key}.{unknown[0]}' is unknown ({key} takes {', '.join(keys)})")
    return raw


def require(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"config key {key!r}: {message}")


def validate(config: Config) -> None:
    """Value checks that do not depend on the device count (see `parallel.check_divisibility` for those)."""
    m, t = config.model, config.train
    m.validate()
    for key in ("cores_per_replica", "per_replica_batch", "gradient_accumulation_steps", "anneal_steps", "total_steps"):
        require(getattr(t, key) > 0, key, f"must be positive, got {getattr(t, key)}")
    for key in ("warmup_steps", "val_batches", "val_every", "ckpt_every", "keep_every", "z_loss", "weight_decay"):
        require(getattr(t, key) >= 0, key, f"must not be negative, got {getattr(t, key)}")
    require(t.eval_every is None or t.eval_every >= 0, "eval_every", f"must not be negative, got {t.eval_every}")
    require(all(isinstance(x, str) and x for x in t.eval_harness_tasks), "eval_harness_tasks",
            "must be a list of lm-eval task names")
    require(t.lr >= 0 and t.end_lr >= 0, "lr", "learning rates must not be negative")
    require(0 <= t.b1 < 1 and 0 <= t.b2 < 1, "b1", "Adam betas must be in [0, 1)")
    require(t.clip_norm > 0, "clip_norm", "must be positive")
    if t.tpu_size is not None:
        require(t.tpu_size % t.cores_per_replica == 0, "tpu_size",
                 f"{t.tpu_size} devices cannot be split into model-parallel groups of cores_per_replica={t.cores_per_replica}")
    require(all(isinstance(v, str) for v in t.val_set.values()), "val_set", "must map names to index paths")
    if isinstance(t.train_set, dict):
        require(bool(t.train_set) and all(
            isinstance(p, str) and p and isinstance(w, (int, float)) and not isinstance(w, bool) and 0 < w < float("inf")
            for p, w in t.train_set.items()), "train_set",
            f"a mixture maps index paths to positive weights (e.g. {{\"chat.index.json\": 3, \"web.index.json\": 1}}), "
            f"got {json.dumps(t.train_set)}")
    require(0 <= t.fcm_min_ratio <= t.fcm_max_ratio < 1, "fcm_max_ratio" if t.fcm_max_ratio < t.fcm_min_ratio
            or t.fcm_max_ratio >= 1 else "fcm_min_ratio",
            f"need 0 <= fcm_min_ratio <= fcm_max_ratio < 1, got {t.fcm_min_ratio} and {t.fcm_max_ratio}")
    require(t.neftune_noise_alpha is None or (isinstance(t.neftune_noise_alpha, (int, float))
                                              and not isinstance(t.neftune_noise_alpha, bool)
                                              and 0 < t.neftune_noise_alpha < float("inf")),
            "neftune_noise_alpha", f"must be a positive number (NEFTune's alpha, e.g. 5) or null, "
                                   f"got {t.neftune_noise_alpha!r}")
    require(not (m.classifier and t.eval_harness_tasks), "eval_harness_tasks",
            f"a classifier (num_labels {m.num_labels}) neither generates nor scores text: lm-eval's tasks do not run on it")
    if t.lora is not None:
        from mesh_transformer import lora
        lora.resolve(m, lora.LoraConfig.from_dict(t.lora))
    require(t.classify is None or t.preference is None, "classify",
            f"trains a classifier on labelled texts: not with '{t.preference}'")
    if t.preference is not None:
        from mesh_transformer.train import preference
        require(len(t.preferences) == 1, t.preferences[-1],
                f"one preference objective at most: {' and '.join(t.preferences)} are both set")
        preference.objective(t)
        if t.preference == "reward":
            require(m.num_labels == 1, "num_labels", f"'reward' trains a reward model, a classifier of one output: "
                                                     f"set num_labels 1, got {m.num_labels}")
        else:
            require(not m.classifier, "num_labels",
                    f"a classifier ({m.num_labels} labels) trains with 'reward' or 'classify' only, "
                    f"not '{t.preference}'")
        for key in ("fcm_max_ratio", "z_loss", "neftune_noise_alpha"):  # of the language-model loss, which it replaces
            require(not getattr(t, key), key, f"applies to the language-model loss only; with '{t.preference}' "
                                              f"set it to {'null' if key == 'neftune_noise_alpha' else 0}")
    if t.classify is not None:
        from mesh_transformer.train import classify
        classify.ClassifyConfig.from_dict(t.classify, m)
        for key in ("fcm_max_ratio", "z_loss", "neftune_noise_alpha"):
            require(not getattr(t, key), key, f"applies to the language-model loss only; with 'classify' "
                                              f"set it to {'null' if key == 'neftune_noise_alpha' else 0}")
