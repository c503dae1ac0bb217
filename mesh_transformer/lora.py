"""LoRA (Hu et al. 2021): frozen base weights plus trainable low-rank adapters, PEFT-compatible.

    "lora": {"rank": 8, "alpha": 16, "dropout": 0.0, "targets": ["q_proj", "v_proj"] | "all-linear"}

Targets are the family's Hugging Face module names (what PEFT's `target_modules` means), resolved
through the family's HF table: `q_proj` of GPT-J is our `layers/attn/q_proj`, GPT-2's fused
`c_attn` is our q/k/v, GPT-NeoX's `query_key_value` likewise. "all-linear" is every linear layer but
the output head, as in PEFT. A targeted weight W [*inputs, *outputs] gets A [*inputs, r] and
B [r, *outputs] (leaves `<name>_lora_a`, `<name>_lora_b` beside it), declared with W's input and
output logical axes plus "lora_rank", which no rule table maps: the adapters shard like the weight
they adapt, under Megatron and ZeRO alike, and the rank axis is never split.

This module holds what is LoRA-specific outside the model: the config, trainable/frozen split,
merging adapters into the base (sampling, serving, merged export) and PEFT's adapter format.
A fused HF module (one A shared by q/k/v in PEFT) exports as a block-diagonal adapter of rank
3r (`rank_pattern`/`alpha_pattern` keep the scale), which is exact; importing one copies A to q, k
and v and splits B.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from mesh_transformer import parallel
from mesh_transformer.config import ConfigError, ModelConfig

ALL_LINEAR = "all-linear"
KEYS = ("rank", "alpha", "dropout", "targets")
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@dataclass(frozen=True)
class LoraConfig:
    rank: int
    alpha: float
    dropout: float
    targets: Union[str, tuple[str, ...]]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_dict(cls, raw: Any) -> "LoraConfig":
        """Parse the config's "lora" object; ConfigError naming `lora.<key>`."""
        if not isinstance(raw, dict):
            raise ConfigError(f"config key 'lora' must be an object {{rank, alpha, dropout, targets}}, got {json.dumps(raw)}")
        unknown = sorted(set(raw) - set(KEYS))
        if unknown:
            raise ConfigError(f"config key 'lora.{unknown[0]}' is unknown (lora takes {', '.join(KEYS)})")
        rank, alpha = raw.get("rank", 8), raw.get("alpha", raw.get("rank", 8))
        dropout, targets = raw.get("dropout", 0.0), raw.get("targets", ALL_LINEAR)
        if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
            raise ConfigError(f"config key 'lora.rank' must be a positive integer, got {json.dumps(rank)}")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
            raise ConfigError(f"config key 'lora.alpha' must be a positive number, got {json.dumps(alpha)}")
        if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0 <= dropout < 1:
            raise ConfigError(f"config key 'lora.dropout' must be in [0, 1), got {json.dumps(dropout)}")
        if targets != ALL_LINEAR:
            if (not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets)):
                raise ConfigError(f"config key 'lora.targets' must be a non-empty list of module names or "
                                  f"{ALL_LINEAR!r}, got {json.dumps(targets)}")
            targets = tuple(targets)
        return cls(rank, float(alpha), float(dropout), targets)

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout,
                "targets": self.targets if isinstance(self.targets, str) else list(self.targets)}


# --------------------------------------------------------------------------------------------
# Targets: HF module names <-> our (module, leaf)
# --------------------------------------------------------------------------------------------

def hf_linears(model: ModelConfig) -> list:
    """The family's HF table entries that are linear layers with a matmul weight of ours: [HFParam]."""
    from mesh_transformer import models
    infos = models.build(model).infos
    out = []
    for entry in models.family(model.family).hf_table(model):
        if not entry.hf.endswith(".weight"):
            continue
        leaves = [infos.get(_path(model, m), {}).get(leaf) for m, leaf in entry.ours]
        if leaves and all(info is not None and info.inputs and not info.experts for info in leaves):
            out.append(entry)
    return out


def module_name(entry) -> str:
    """"transformer.h.{i}.attn.q_proj.weight" -> "q_proj" (what PEFT's target_modules match)."""
    return entry.hf[: -len(".weight")].rsplit(".", 1)[-1]


def resolve(model: ModelConfig, lora: LoraConfig) -> list:
    """The HF entries `lora.targets` names (ConfigError naming lora.targets / lora.rank)."""
    linears = hf_linears(model)
    names = sorted({module_name(e) for e in linears})
    if lora.targets == ALL_LINEAR:
        chosen = [e for e in linears if e.ours[0][0] != "head"]
    else:
        for t in lora.targets:
            if t not in names:
                raise ConfigError(f"config key 'lora.targets': {t!r} is not a linear module of family "
                                  f"{model.family!r} (its modules: {', '.join(names)})")
        chosen = [e for e in linears if module_name(e) in lora.targets]
    from mesh_transformer import models
    params = models.build(model).abstract_params
    for e in chosen:
        for m, leaf in e.ours:
            x, info = params[_path(model, m)][leaf], models.build(model).infos[_path(model, m)][leaf]
            dims = x.shape[x.ndim - len(info.axes):]
            smallest = min(math.prod(dims[:info.inputs]), math.prod(dims[info.inputs:]))
            if lora.rank > smallest:
                raise ConfigError(f"config key 'lora.rank': {lora.rank} is larger than {module_name(e)}'s "
                                  f"smaller dimension ({smallest})")
    return chosen


def plan(model: ModelConfig, lora: Optional[LoraConfig]) -> Optional[parallel.LoRAPlan]:
    """The `parallel.LoRAPlan` the model runs with (None without LoRA)."""
    if lora is None:
        return None
    targets = frozenset((_module_key(model, m), leaf) for e in resolve(model, lora) for m, leaf in e.ours)
    return parallel.LoRAPlan(targets, lora.rank, lora.scale, lora.dropout)


def _path(model: ModelConfig, module: str) -> str:
    return f"{model.family}/{module}" if module else model.family


def _module_key(model: ModelConfig, module: str) -> str:
    return module.split("/")[-1] if module else model.family


# --------------------------------------------------------------------------------------------
# Trainable / frozen
# --------------------------------------------------------------------------------------------

def split(tree, enabled: bool = True):
    """A params-shaped tree -> (adapter leaves, every other leaf); without LoRA: (tree, {})."""
    if not enabled:
        return tree, {}
    def pick(keep):
        out = {m: {n: x for n, x in leaves.items() if parallel.is_adapter(n) == keep} for m, leaves in tree.items()}
        return {m: leaves for m, leaves in out.items() if leaves}
    return pick(True), pick(False)


def join(frozen, trainable):
    """The inverse of `split`: one params tree."""
    out = {m: dict(leaves) for m, leaves in frozen.items()}
    for m, leaves in trainable.items():
        out.setdefault(m, {}).update(leaves)
    return out


def merged(params, scale: float):
    """Params with adapters -> plain params: W + scale * A @ B for every adapted W (float32, host numpy
    or jax arrays; leading stacked-layer axes kept). Used at load time, so decoding costs nothing extra."""
    out = {}
    for module, leaves in params.items():
        out[module] = {}
        for name, x in leaves.items():
            if parallel.is_adapter(name):
                continue
            a, b = leaves.get(name + parallel.LORA_A), leaves.get(name + parallel.LORA_B)
            if a is not None:
                x = np.asarray(x, np.float32) + scale * _delta(np.asarray(a, np.float32), np.asarray(b, np.float32), x.ndim)
            out[module][name] = x
    return out


def _delta(a, b, ndim: int):
    """A [L.., *in, r] @ B [L.., r, *out] -> [L.., *in, *out] (the weight has `ndim` axes)."""
    lead = a.ndim + b.ndim - 2 - ndim
    r = a.shape[-1]
    out = np.matmul(a.reshape(*a.shape[:lead], -1, r), b.reshape(*b.shape[:lead], r, -1))
    return out.reshape(*a.shape[:-1], *b.shape[lead + 1:])


# --------------------------------------------------------------------------------------------
# PEFT's format: adapter_config.json + adapter_model.safetensors
# --------------------------------------------------------------------------------------------

def _peft_key(hf: str, i: Optional[int], which: str) -> str:
    name = hf.format(i=i) if i is not None else hf
    return f"base_model.model.{name[: -len('.weight')]}.lora_{which}.weight"


def save_peft(adapters, model: ModelConfig, lora: LoraConfig, out: str, base: Optional[str] = None) -> Path:
    """Write `adapters` (our adapter leaves, numpy/jax, stacked layers) in PEFT's format to `out`."""
    from safetensors.numpy import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors, rank_pattern, alpha_pattern = {}, {}, {}
    chosen = resolve(model, lora)
    for entry in chosen:
        layers = range(model.layers) if entry.per_layer else [None]
        parts = len(entry.ours)
        for i in layers:
            a_list, b_list = [], []
            for m, leaf in entry.ours:
                leaves = adapters[_path(model, m)]
                a = np.asarray(leaves[leaf + parallel.LORA_A], np.float32)
                b = np.asarray(leaves[leaf + parallel.LORA_B], np.float32)
                a, b = (a[i], b[i]) if i is not None else (a, b)
                b = _crop_vocab(b, model, m, leaf)
                a_list.append(a.reshape(-1, lora.rank).T)  # [r, in]
                b_list.append(b)
            lora_a = np.concatenate(a_list, axis=0)  # [parts * r, in]
            if parts == 1:
                lora_b = b_list[0].reshape(lora.rank, -1).T  # [out, r]
            else:  # block-diagonal: part j's B in rows j*r .. (j+1)*r of the rank axis
                rows = parts * lora.rank
                padded = []
                for j, b in enumerate(b_list):
                    z = np.zeros((rows, *b.shape[1:]), np.float32)
                    z[j * lora.rank:(j + 1) * lora.rank] = b
                    padded.append(z)
                lora_b = entry.transform.to_hf(tuple(padded), model)
                lora_b = lora_b.T if lora_b.shape[0] == rows and _conv1d(model) else lora_b
            tensors[_peft_key(entry.hf, i, "A")] = np.ascontiguousarray(lora_a)
            tensors[_peft_key(entry.hf, i, "B")] = np.ascontiguousarray(lora_b)
        if parts > 1:
            rank_pattern[module_name(entry)] = parts * lora.rank
            alpha_pattern[module_name(entry)] = parts * lora.alpha
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
              "lora_dropout": lora.dropout, "target_modules": sorted({module_name(e) for e in chosen}),
              "bias": "none", "fan_in_fan_out": _conv1d(model), "base_model_name_or_path": base,
              "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern, "inference_mode": True,
              "use_rslora": False, "modules_to_save": None, "init_lora_weights": True}
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return out


def load_peft(directory: str, model: ModelConfig, mp: int = 1) -> tuple[LoraConfig, dict]:
    """A PEFT LoRA adapter directory -> (our LoraConfig, adapter leaves as numpy float32, stacked).

    ConfigError for what cannot be represented here: another PEFT type, rsLoRA, DoRA, biases,
    per-module ranks on unfused modules, targets the family does not have."""
    from safetensors.numpy import load_file

    path = Path(directory)
    if not (path / ADAPTER_CONFIG).exists():
        raise ConfigError(f"{path}: no {ADAPTER_CONFIG} (is this a PEFT adapter directory?)")
    cfg = json.loads((path / ADAPTER_CONFIG).read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"{path / ADAPTER_CONFIG}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key in ("use_rslora", "use_dora"):
        if cfg.get(key):
            raise ConfigError(f"{path / ADAPTER_CONFIG}: {key} is not supported")
    if cfg.get("bias", "none") != "none":
        raise ConfigError(f"{path / ADAPTER_CONFIG}: bias {cfg.get('bias')!r} is not supported (only 'none')")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ConfigError(f"{path / ADAPTER_CONFIG}: rank_pattern/alpha_pattern are not supported")
    targets = cfg["target_modules"]
    targets = [targets] if isinstance(targets, str) else list(targets)
    if targets == [ALL_LINEAR]:
        targets = ALL_LINEAR
    lora = LoraConfig.from_dict({"rank": cfg["r"], "alpha": cfg["lora_alpha"], "dropout": cfg.get("lora_dropout", 0.0),
                                 "targets": targets})
    weights_file = path / ADAPTER_WEIGHTS
    if not weights_file.exists():
        raise ConfigError(f"{path}: no {ADAPTER_WEIGHTS}")
    tensors = load_file(str(weights_file))
    out = {}
    for entry in resolve(model, lora):
        layers = range(model.layers) if entry.per_layer else [None]
        per_layer = {(m, leaf): ([], []) for m, leaf in entry.ours}
        for i in layers:
            try:
                lora_a = tensors[_peft_key(entry.hf, i, "A")].astype(np.float32)  # [r, in]
                lora_b = tensors[_peft_key(entry.hf, i, "B")].astype(np.float32)  # [out, r]
            except KeyError as e:
                raise ConfigError(f"{weights_file}: tensor {e.args[0]!r} is missing") from None
            if len(entry.ours) == 1:
                bs = (lora_b.T,)
            else:
                bs = entry.transform.to_ours(lora_b.T if _conv1d(model) else lora_b, model)
            for (m, leaf), b in zip(entry.ours, bs):
                per_layer[(m, leaf)][0].append(lora_a.T)
                per_layer[(m, leaf)][1].append(b)
        for (m, leaf), (a_list, b_list) in per_layer.items():
            a, b = np.stack(a_list), np.stack(b_list)
            a, b = (a, b) if entry.per_layer else (a[0], b[0])
            out.setdefault(_path(model, m), {})[leaf + parallel.LORA_A] = a
            out.setdefault(_path(model, m), {})[leaf + parallel.LORA_B] = b
    shaped = _reshape_like(out, model, lora, mp)
    return lora, shaped


def _reshape_like(adapters, model: ModelConfig, lora: LoraConfig, mp: int):
    """Give each adapter leaf the shape our model declares (heads split out, vocabulary padded)."""
    from mesh_transformer import models
    abstract = split(models.build(model, mp, plan(model, lora)).abstract_params)[0]
    out = {}
    for m, leaves in adapters.items():
        out[m] = {}
        for n, x in leaves.items():
            want = abstract[m][n].shape
            if n.endswith(parallel.LORA_B) and math.prod(x.shape) != math.prod(want):  # vocabulary padding
                flat = x.reshape(*x.shape[:-1], -1)
                pad = [(0, 0)] * (flat.ndim - 1) + [(0, want[-1] - flat.shape[-1])]
                x = np.pad(flat, pad)
            out[m][n] = x.reshape(want)
    return out


def _crop_vocab(b, model: ModelConfig, module: str, leaf: str):
    if module == "head" and b.shape[-1] != model.n_vocab:
        return b[..., : model.n_vocab]
    return b


def _conv1d(model: ModelConfig) -> bool:
    """GPT-2 stores its linear layers as Conv1D [in, out] (PEFT's fan_in_fan_out)."""
    return model.family == "gpt2"


# --------------------------------------------------------------------------------------------
# The base a LoRA run adapts: recorded by reference in each checkpoint
# --------------------------------------------------------------------------------------------

BASE_KEY, FINGERPRINT_KEY = "lora_base", "lora_base_fingerprint"


def base_reference(hf: Optional[str] = None, ckpt: Optional[str] = None, step: Optional[int] = None,
                   seed: Optional[int] = None) -> dict:
    """What a checkpoint records about its base: {"hf": dir} | {"ckpt": dir, "step": n} | {"init": seed}."""
    def where(path):
        return path if "://" in str(path) else str(Path(path).resolve())
    if hf is not None:
        return {"hf": where(hf)}
    if ckpt is not None:
        return {"ckpt": where(ckpt), "step": step}
    return {"init": seed}


def base_params(ref: dict, model: ModelConfig, mp: int = 1, shardings=None):
    """Read the base `ref` points to -> plain params (no adapters; numpy float32, or placed by `shardings`)."""
    from mesh_transformer import models
    if not isinstance(ref, dict) or not ({"hf", "ckpt", "init"} & set(ref)):
        raise ConfigError(f"this LoRA checkpoint names no base model ({BASE_KEY} = {ref!r})")
    if "hf" in ref:
        from mesh_transformer.io import hf
        found, params = hf.load_hf(ref["hf"], mp=mp)
        if found.architecture() != model.architecture():
            raise ConfigError(f"{ref['hf']}: the LoRA base's architecture is not the config's")
        return params if shardings is None else _place(params, shardings)
    if "ckpt" in ref:
        import jax
        from mesh_transformer.io.checkpoint import CheckpointManager
        abstract = models.build(model, mp).abstract_params
        if shardings is None:
            cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
            shardings = jax.tree.map(lambda _: cpu, abstract)
        return CheckpointManager(ref["ckpt"], read_only=True).restore_params(
            ref.get("step"), abstract_params=abstract, target_shardings=shardings, check_config=False)
    import jax
    params = models.build(model, mp).init(jax.random.key(ref["init"]))
    return params if shardings is None else _place(params, shardings)


def _place(params, shardings):
    import jax
    return jax.tree.map(lambda x, s: jax.device_put(np.asarray(x, np.float32), s), params, shardings)


def fingerprint(base) -> int:
    """One 32-bit number for a whole base (float32 view of each leaf), to notice a changed base on resume."""
    import zlib
    import jax
    import jax.numpy as jnp
    from mesh_transformer.io.checkpoint import fingerprints
    prints = fingerprints(jax.tree.map(lambda x: jnp.asarray(x).astype(jnp.float32), base))
    return zlib.crc32(json.dumps(sorted(prints.items())).encode())


def from_train(train) -> Optional[LoraConfig]:
    """The LoraConfig of a TrainConfig (None without the "lora" key)."""
    return LoraConfig.from_dict(train.lora) if train.lora is not None else None


def restore_merged(manager, config, mp: int, step: Optional[int] = None, shardings=None):
    """A LoRA training checkpoint -> plain float32 params with the adapters merged in (W + scale A B).

    `manager`: a CheckpointManager on the run; `config`: its Config. Returns numpy params, or placed
    by `shardings` (a params-shaped tree of shardings)."""
    import jax
    from mesh_transformer import models
    spec = from_train(config.train)
    ref = manager.extras(step).get(BASE_KEY)
    base = base_params(ref, config.model, mp)
    adapters = restore_adapters(manager, config, step)
    merged_params = merged(join(jax.tree.map(np.asarray, base), adapters), spec.scale)
    if shardings is None:
        return merged_params
    del models
    return _place(merged_params, shardings)


def restore_adapters(manager, config, step: Optional[int] = None):
    """The adapter leaves of a LoRA training checkpoint, as numpy float32 (shapes as saved)."""
    import jax
    from mesh_transformer import models
    spec = from_train(config.train)
    shapes = manager.saved_shapes(step)
    abstract = split(models.build(config.model, 1, plan(config.model, spec)).abstract_params)[0]
    abstract = {m: {n: jax.ShapeDtypeStruct(shapes.get(f"params.{m}.{n}", x.shape), x.dtype) for n, x in leaves.items()}
                for m, leaves in abstract.items()}
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    adapters = manager.restore_params(step, abstract_params=abstract, target_shardings=jax.tree.map(lambda _: cpu, abstract),
                                      check_config=False)
    return jax.tree.map(np.asarray, adapters)
