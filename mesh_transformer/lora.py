"""LoRA (Hu et al. 2021): frozen base weights plus trainable low-rank adapters, PEFT-compatible.

    "lora": {"rank": 8, "alpha": 16, "dropout": 0.0, "targets": ["q_proj", "v_proj"] | "all-linear",
             "use_rslora": false}

The adapters' output is scaled by alpha / rank, or with `use_rslora` (PEFT's name; rank-stabilized
LoRA, Kalajievski 2023) by alpha / sqrt(rank), which keeps the update's size as the rank grows.

Targets are the family's Hugging Face module names (what PEFT's `target_modules` means), resolved
through the family's HF table: `q_proj` of GPT-J is our `layers/attn/q_proj`, GPT-2's fused
`c_attn` is our q/k/v, GPT-NeoX's `query_key_value` likewise. "all-linear" is every linear layer but
the output head, as in PEFT. A targeted weight W [*inputs, *outputs] gets A [*inputs, r] and
B [r, *outputs] (leaves `<name>_lora_a`, `<name>_lora_b` beside it), declared with W's input and
output logical axes plus "lora_rank", which no rule table maps: the adapters shard like the weight
they adapt, under Megatron and ZeRO alike, and the rank axis is never split. A mixture's experts
are targeted by the names of PEFT's `target_parameters` ("experts.gate_up_proj",
"experts.down_proj", the family's `hf_experts`): an adapter per expert, A [E, *inputs, r] and
B [E, r, *outputs], which "all-linear" leaves out (as PEFT's).

This module holds what is LoRA-specific outside the model: the config, trainable/frozen split,
merging adapters into the base (sampling, serving, merged export) and PEFT's adapter format.
A fused HF module (one A shared by q/k/v in PEFT) exports as a block-diagonal adapter of rank
3r (`rank_pattern`/`alpha_pattern` keep the scale), which is exact; importing one copies A to q, k
and v and splits B, and importing such an export reads each part's block back.
"""
from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Optional, Sequence, Union

import numpy as np

from mesh_transformer import parallel
from mesh_transformer.config import ConfigError, ModelConfig, check_object

ALL_LINEAR = "all-linear"
KEYS = ("rank", "alpha", "dropout", "targets", "quantize_base", "use_rslora")
QUANTIZE_BASE = ("int8",)
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@dataclass(frozen=True)
class LoraConfig:
    rank: int
    alpha: float
    dropout: float
    targets: Union[str, tuple[str, ...]]
    quantize_base: Optional[str] = None  # "int8": the frozen base's matmul weights held as int8 + scales
    use_rslora: bool = False  # scale alpha / sqrt(rank) (rsLoRA) rather than alpha / rank

    @property
    def scale(self) -> float:
        return peft_scale(self.rank, self.alpha, self.use_rslora)

    @classmethod
    def from_dict(cls, raw: Any) -> "LoraConfig":
        """Parse the config's "lora" object; ConfigError naming `lora.<key>`."""
        check_object(raw, "lora", KEYS, "{rank, alpha, dropout, targets}")
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
        quantize_base = raw.get("quantize_base")
        if quantize_base is not None and quantize_base not in QUANTIZE_BASE:
            raise ConfigError(f"config key 'lora.quantize_base' must be one of {', '.join(QUANTIZE_BASE)} or null, "
                              f"got {json.dumps(quantize_base)}")
        use_rslora = raw.get("use_rslora", False)
        if not isinstance(use_rslora, bool):
            raise ConfigError(f"config key 'lora.use_rslora' must be true or false, got {json.dumps(use_rslora)}")
        return cls(rank, float(alpha), float(dropout), targets, quantize_base, use_rslora)

    def to_dict(self) -> dict:
        out = {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout,
               "targets": self.targets if isinstance(self.targets, str) else list(self.targets)}
        out |= {"quantize_base": self.quantize_base} if self.quantize_base else {}
        return out | ({"use_rslora": True} if self.use_rslora else {})


def peft_scale(rank: int, alpha: float, use_rslora: bool) -> float:
    """What an adapter of `rank` and `alpha` multiplies its output by, as PEFT computes it."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def _part_alpha(lora: LoraConfig, parts: int) -> float:
    """The alpha a fused module's block-diagonal export of `parts` rank-r blocks (rank parts x r)
    needs to keep the scale: parts x alpha, or sqrt(parts) x alpha with rsLoRA."""
    return lora.alpha * (math.sqrt(parts) if lora.use_rslora else parts)


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


def hf_experts(model: ModelConfig) -> list:
    """A mixture's stacked expert weights PEFT's `target_parameters` adapt: [HFExperts] ([] elsewhere)."""
    from mesh_transformer import models
    return models.family(model.family).hf_experts(model)


def resolve(model: ModelConfig, lora: LoraConfig) -> list:
    """The HF linear entries `lora.targets` names (ConfigError naming lora.targets / lora.rank / lora.dropout)."""
    return _resolve(model, lora)[0]


def _resolve(model: ModelConfig, lora: LoraConfig) -> tuple[list, list]:
    """(the HF linear entries, the mixture's `HFExperts`) `lora.targets` names."""
    # (a classifier's head is no target: it trains whole, `TRAINED_WHOLE`)
    linears, experts = [e for e in hf_linears(model) if e.ours[0][0] != "score"], hf_experts(model)
    names = sorted({module_name(e) for e in linears})
    if lora.targets == ALL_LINEAR:  # as PEFT's: linear layers only, so never the experts
        chosen, chosen_experts = [e for e in linears if e.ours[0][0] != "head"], []
    else:
        for t in lora.targets:
            if t not in names and t not in [e.target for e in experts]:
                also = f"; its experts: {', '.join(e.target for e in experts)}" if experts else ""
                raise ConfigError(f"config key 'lora.targets': {t!r} is not a linear module of family "
                                  f"{model.family!r} (its modules: {', '.join(names)}{also})")
        chosen = [e for e in linears if module_name(e) in lora.targets]
        chosen_experts = [e for e in experts if e.target in lora.targets]
    if chosen_experts and lora.dropout:
        raise ConfigError(f"config key 'lora.dropout': adapters on a mixture's experts ({chosen_experts[0].target}) "
                          f"take no dropout, as PEFT's target_parameters; set it to 0, got {lora.dropout}")
    from mesh_transformer import models
    built = models.build(model)
    for name, ours in [(module_name(e), e.ours) for e in chosen] + [(e.target, e.ours) for e in chosen_experts]:
        for m, leaf in ours:
            x, info = built.abstract_params[_path(model, m)][leaf], built.infos[_path(model, m)][leaf]
            dims = x.shape[x.ndim - len(info.axes) + (1 if info.experts else 0):]  # one expert's
            smallest = min(math.prod(dims[:info.inputs]), math.prod(dims[info.inputs:]))
            if lora.rank > smallest:
                raise ConfigError(f"config key 'lora.rank': {lora.rank} is larger than {name}'s "
                                  f"smaller dimension ({smallest})")
    return chosen, chosen_experts


def plan(model: ModelConfig, lora: Optional[LoraConfig]) -> Optional[parallel.LoRAPlan]:
    """The `parallel.LoRAPlan` the model runs with (None without LoRA)."""
    if lora is None:
        return None
    linears, experts = _resolve(model, lora)
    targets = frozenset((_module_key(model, m), leaf) for e in linears + experts for m, leaf in e.ours)
    return parallel.LoRAPlan(targets, lora.rank, lora.scale, lora.dropout)


def _path(model: ModelConfig, module: str) -> str:
    return f"{model.family}/{module}" if module else model.family


def _module_key(model: ModelConfig, module: str) -> str:
    return module.split("/")[-1] if module else model.family


# --------------------------------------------------------------------------------------------
# Trainable / frozen
# --------------------------------------------------------------------------------------------

# Leaves trained whole beside the adapters (PEFT's `modules_to_save`, which its SEQ_CLS task sets
# to the classifier's head): a classifier's score head, new and small, which LoRA would leave as drawn.
TRAINED_WHOLE = frozenset({"score"})
PEFT_HEADS = ("classifier", "score")  # PEFT's SEQ_CLS modules_to_save (transformers' names for the head)


def trained(name: str) -> bool:
    """Whether a leaf trains under LoRA: an adapter's factor, or a leaf trained whole."""
    return parallel.is_adapter(name) or name in TRAINED_WHOLE


def split(tree, enabled: bool = True):
    """A params-shaped tree -> (the leaves LoRA trains: adapters and `TRAINED_WHOLE`, every other
    leaf); without LoRA: (tree, {})."""
    if not enabled:
        return tree, {}
    def pick(keep):
        out = {m: {n: x for n, x in leaves.items() if trained(n) == keep} for m, leaves in tree.items()}
        return {m: leaves for m, leaves in out.items() if leaves}
    return pick(True), pick(False)


def join(frozen, trainable):
    """The inverse of `split`: one params tree."""
    out = {m: dict(leaves) for m, leaves in frozen.items()}
    for m, leaves in trainable.items():
        out.setdefault(m, {}).update(leaves)
    return out


def quantized_base(abstract, specs, infos):
    """The frozen base of a `quantize_base: int8` run, as abstract arrays and specs: each matmul
    weight [L.., *inputs, *outputs] int8 (its shape and spec) beside `<name>_scale`, float32
    [L.., *outputs] (the spec of those axes); embeddings, norms, biases and routers as they were."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    out_abstract, out_specs = {}, {}
    for m, leaves in abstract.items():
        out_abstract[m], out_specs[m] = {}, {}
        for n, x in leaves.items():
            out_abstract[m][n], out_specs[m][n] = x, specs[m][n]
            info = infos[m][n]
            if not info.inputs:
                continue
            lead = x.ndim - len(info.axes)
            kept = [i for i in range(x.ndim) if i - lead not in info.contracted]
            spec = tuple(specs[m][n]) + (None,) * (x.ndim - len(specs[m][n]))
            out_abstract[m][n] = jax.ShapeDtypeStruct(x.shape, jnp.int8)
            out_abstract[m][n + parallel.SCALE] = jax.ShapeDtypeStruct(tuple(x.shape[i] for i in kept), jnp.float32)
            out_specs[m][n + parallel.SCALE] = P(*(spec[i] for i in kept))
    return out_abstract, out_specs


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

SCORE_KEY = "base_model.model.score.weight"  # a SEQ_CLS adapter's head, trained whole (torch [labels, width])


def _peft_key(hf: str, i: Optional[int], which: str) -> str:
    name = hf.format(i=i) if i is not None else hf
    return f"base_model.model.{name[: -len('.weight')]}.lora_{which}.weight"


def _peft_expert_keys(chosen: list) -> dict:
    """{HFExperts: (i, "A" | "B") -> PEFT's tensor name}. PEFT wraps each targeted parameter of a
    module in a ParamWrapper, nested in the module's parameter order (the first innermost), so a
    parameter's adapter is named after the wrappers outside it: "...experts.base_layer.lora_A.weight"
    (gate_up_proj, when down_proj is targeted too), "...experts.lora_A.weight"."""
    def keys(entry, nesting):
        return lambda i, which: (f"base_model.model.{entry.hf.format(i=i).rsplit('.', 1)[0]}.{nesting}"
                                 f"lora_{which}.weight")
    return {e: keys(e, "base_layer." * (len(chosen) - 1 - k)) for k, e in enumerate(chosen)}


def save_peft(adapters, model: ModelConfig, lora: LoraConfig, out: str, base: Optional[str] = None) -> Path:
    """Write `adapters` (our adapter leaves, numpy/jax, stacked layers) in PEFT's format to `out`
    (a mixture's expert adapters as PEFT's `target_parameters`)."""
    from safetensors.numpy import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors, rank_pattern, alpha_pattern = {}, {}, {}
    chosen, experts = _resolve(model, lora)
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
            alpha_pattern[module_name(entry)] = _part_alpha(lora, parts)
    for entry, key in _peft_expert_keys(experts).items():
        for i in range(model.layers):
            parts = [(adapters[_path(model, m)][leaf + parallel.LORA_A], adapters[_path(model, m)][leaf + parallel.LORA_B])
                     for m, leaf in entry.ours]
            lora_a, lora_b = _experts_to_peft(entry, [(np.asarray(a, np.float32)[i], np.asarray(b, np.float32)[i])
                                               for a, b in parts], lora.rank)
            tensors[key(i, "A")], tensors[key(i, "B")] = lora_a, lora_b
        if len(entry.ours) > 1:
            rank_pattern[entry.target.rsplit(".", 1)[1]] = len(entry.ours) * lora.rank
            alpha_pattern[entry.target.rsplit(".", 1)[1]] = _part_alpha(lora, len(entry.ours))
    if model.classifier:  # trained whole: PEFT's modules_to_save, saved under the module's own name
        tensors[SCORE_KEY] = np.ascontiguousarray(np.asarray(adapters[_path(model, "score")]["score"], np.float32).T)
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "SEQ_CLS" if model.classifier else "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
              "lora_dropout": lora.dropout, "target_modules": sorted({module_name(e) for e in chosen}),
              "bias": "none", "fan_in_fan_out": _conv1d(model), "base_model_name_or_path": base,
              "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern, "inference_mode": True,
              "use_rslora": lora.use_rslora, "modules_to_save": list(PEFT_HEADS) if model.classifier else None,
              "init_lora_weights": True}
    if experts:
        config["target_parameters"] = [e.hf.split("{i}.", 1)[1] for e in experts]
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return out


def _experts_to_peft(entry, parts: list, r: int):
    """One layer's adapters of the leaves one HF expert tensor (`entry`) holds, [(A [E, in, r],
    B [E, r, out])] (the parts equally wide: gate and up) -> PEFT's (lora_A [E R, in], lora_B
    [parts x out, R E]) with R = parts x r, block-diagonal (part j: ranks j r .. (j+1) r, at the
    part's outputs: `HFExperts.outputs`). PEFT reads lora_A as [E, R, in] and lora_B as [out, R, E]."""
    experts = parts[0][0].shape[0]
    a = np.concatenate([a.reshape(experts, -1, r).transpose(0, 2, 1) for a, _ in parts], axis=1)  # [E, R, in]
    outs = [b.reshape(experts, r, -1) for _, b in parts]
    width = outs[0].shape[-1]
    b = np.zeros((experts, width * len(outs), len(parts) * r), np.float32)  # [E, out, R]
    for j, x in enumerate(outs):
        b[:, entry.outputs(j, width), j * r:(j + 1) * r] = x.transpose(0, 2, 1)
    return (np.ascontiguousarray(a.reshape(-1, a.shape[-1])),
            np.ascontiguousarray(b.transpose(1, 2, 0).reshape(b.shape[1], -1)))


def _experts_from_peft(entry, lora_a, lora_b, experts: int, blocks: int, r: int, where: str) -> list:
    """The inverse of `_experts_to_peft` for PEFT's one adapter of rank `blocks` x r over `parts`
    leaves: [(A [E, in, r], B [E, r, out_j])]. blocks 1: A shared by the parts (PEFT's own); blocks
    = parts: our block-diagonal export (ConfigError where B is not block-diagonal)."""
    rank, parts = blocks * r, len(entry.ours)
    try:
        a = lora_a.reshape(experts, rank, -1)  # [E, R, in]
        b = lora_b.reshape(lora_b.shape[0], rank, experts).transpose(2, 0, 1)  # [E, out, R]
    except ValueError:
        raise ConfigError(f"{where}: lora_A {lora_a.shape} / lora_B {lora_b.shape} are not rank {rank} adapters of "
                          f"{experts} experts") from None
    out, width = [], b.shape[1] // parts
    for j in range(parts):
        rows, cols = entry.outputs(j, width), slice(j * r, (j + 1) * r) if blocks > 1 else slice(0, r)
        if blocks > 1 and np.any(np.delete(b[:, rows], np.arange(j * r, (j + 1) * r), axis=2)):
            raise ConfigError(f"{where}: a rank_pattern adapter whose parts are not block-diagonal cannot be read "
                              f"at rank {r}")
        out.append((a[:, cols].transpose(0, 2, 1), b[:, rows, cols].transpose(0, 2, 1)))
    return out


def _blocks(cfg: dict, name: str, parts: int, lora: LoraConfig, where: Path) -> int:
    """How many rank-r blocks PEFT's adapter on `name` has: 1, or `parts` where `rank_pattern` /
    `alpha_pattern` give it parts x r at the adapter's scale (a fused module's block-diagonal export)."""
    rank = (cfg.get("rank_pattern") or {}).get(name, lora.rank)
    alpha = (cfg.get("alpha_pattern") or {}).get(name, lora.alpha)
    same_scale = math.isclose(peft_scale(rank, alpha, lora.use_rslora), lora.scale, rel_tol=1e-6)
    if rank == lora.rank and same_scale:
        return 1
    if parts > 1 and rank == parts * lora.rank and same_scale:
        return parts
    raise ConfigError(f"{where}: rank_pattern/alpha_pattern give {name!r} rank {rank}, alpha {alpha}: only a fused "
                      f"module's {parts} parts at {parts} x r and the adapter's scale (block-diagonal: alpha "
                      f"{_part_alpha(lora, parts):g}) are supported")


def peft_config(directory: str) -> dict:
    """A PEFT adapter directory's adapter_config.json, checked for what `load_peft` cannot represent
    (another PEFT type, DoRA, biases, `modules_to_save`) and for its weights file, before
    any weight is read (ConfigError naming the file)."""
    path = Path(directory)
    if not (path / ADAPTER_CONFIG).exists():
        raise ConfigError(f"{path}: no {ADAPTER_CONFIG} (is this a PEFT adapter directory? A LoRA run's checkpoint "
                          f"exports to one with to_hf_weights.py --peft)")
    cfg = json.loads((path / ADAPTER_CONFIG).read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"{path / ADAPTER_CONFIG}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_dora"):
        raise ConfigError(f"{path / ADAPTER_CONFIG}: use_dora (DoRA's magnitude vectors) is not supported: merge the "
                          f"adapter into the model with PEFT's merge_and_unload and load that model")
    if cfg.get("bias", "none") != "none":
        raise ConfigError(f"{path / ADAPTER_CONFIG}: bias {cfg.get('bias')!r} is not supported (only 'none')")
    if not set(cfg.get("modules_to_save") or ()) <= set(PEFT_HEADS):
        raise ConfigError(f"{path / ADAPTER_CONFIG}: modules_to_save {cfg['modules_to_save']!r} (whole modules trained "
                          f"beside the adapter) is not supported but for a classifier's head ({', '.join(PEFT_HEADS)}): "
                          f"merge the adapter into the model with PEFT's merge_and_unload and load that model")
    if not (path / ADAPTER_WEIGHTS).exists():
        raise ConfigError(f"{path}: no {ADAPTER_WEIGHTS}")
    return cfg


def load_peft(directory: str, model: ModelConfig, mp: int = 1) -> tuple[LoraConfig, dict]:
    """A PEFT LoRA adapter directory -> (our LoraConfig, adapter leaves as numpy float32, stacked).

    ConfigError for what cannot be represented here (`peft_config`; per-module ranks but a fused
    module's block-diagonal parts, targets the family does not have, tensors it would lose)."""
    from safetensors.numpy import load_file

    path = Path(directory)
    cfg = peft_config(directory)
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    expert_targets = _expert_targets(cfg.get("target_parameters") or [], model, path / ADAPTER_CONFIG)
    if targets == [ALL_LINEAR]:
        targets = ALL_LINEAR
        if expert_targets:
            raise ConfigError(f"{path / ADAPTER_CONFIG}: target_modules {ALL_LINEAR!r} with target_parameters is "
                              "not supported: name the linear modules")
    lora = LoraConfig.from_dict({"rank": cfg["r"], "alpha": cfg["lora_alpha"], "dropout": cfg.get("lora_dropout", 0.0),
                                 "targets": targets if targets == ALL_LINEAR else targets + expert_targets,
                                 "use_rslora": bool(cfg.get("use_rslora"))})
    chosen, experts = _resolve(model, lora)
    names = {module_name(e) for e in chosen} | {e.target.rsplit(".", 1)[1] for e in experts}
    for name in sorted(set(cfg.get("rank_pattern") or {}) | set(cfg.get("alpha_pattern") or {})):
        if name not in names:
            raise ConfigError(f"{path / ADAPTER_CONFIG}: rank_pattern/alpha_pattern key {name!r} is not a targeted "
                              f"module (supported: a fused module's name, as this project exports)")
    weights_file = path / ADAPTER_WEIGHTS
    tensors = load_file(str(weights_file))
    read: set = set()

    def tensor(key):
        read.add(key)
        try:
            return tensors[key].astype(np.float32)
        except KeyError:
            raise ConfigError(f"{weights_file}: tensor {key!r} is missing") from None

    out = {}
    for entry in chosen:
        layers = range(model.layers) if entry.per_layer else [None]
        blocks = _blocks(cfg, module_name(entry), len(entry.ours), lora, path / ADAPTER_CONFIG)
        per_layer = {(m, leaf): ([], []) for m, leaf in entry.ours}
        for i in layers:
            lora_a = tensor(_peft_key(entry.hf, i, "A"))  # [R, in]
            lora_b = tensor(_peft_key(entry.hf, i, "B"))  # [out, R]
            if len(entry.ours) == 1:
                bs = (lora_b.T,)
            else:
                bs = entry.transform.to_ours(lora_b.T if _conv1d(model) else lora_b, model)
            for j, ((m, leaf), b) in enumerate(zip(entry.ours, bs)):
                a = lora_a
                if blocks > 1:  # part j's ranks only; the others' must be zero
                    if np.any(np.delete(b, np.arange(j * lora.rank, (j + 1) * lora.rank), axis=0)):
                        raise ConfigError(f"{weights_file}: {module_name(entry)}'s rank_pattern adapter is not "
                                          f"block-diagonal over its parts, so it cannot be read at rank {lora.rank}")
                    a, b = a[j * lora.rank:(j + 1) * lora.rank], b[j * lora.rank:(j + 1) * lora.rank]
                per_layer[(m, leaf)][0].append(a.T)
                per_layer[(m, leaf)][1].append(b)
        for (m, leaf), (a_list, b_list) in per_layer.items():
            a, b = np.stack(a_list), np.stack(b_list)
            a, b = (a, b) if entry.per_layer else (a[0], b[0])
            out.setdefault(_path(model, m), {})[leaf + parallel.LORA_A] = a
            out.setdefault(_path(model, m), {})[leaf + parallel.LORA_B] = b
    for entry, key in _peft_expert_keys(experts).items():
        blocks = _blocks(cfg, entry.target.rsplit(".", 1)[1], len(entry.ours), lora, path / ADAPTER_CONFIG)
        layers = [_experts_from_peft(entry, tensor(key(i, "A")), tensor(key(i, "B")), model.n_experts, blocks, lora.rank,
                                     f"{weights_file}: {key(i, 'A')}") for i in range(model.layers)]
        for j, (m, leaf) in enumerate(entry.ours):
            out.setdefault(_path(model, m), {})[leaf + parallel.LORA_A] = np.stack([parts[j][0] for parts in layers])
            out.setdefault(_path(model, m), {})[leaf + parallel.LORA_B] = np.stack([parts[j][1] for parts in layers])
    # PEFT saves a targeted head's or embedding's own weight beside its adapter (`save_embedding_layers`,
    # "auto" when one is targeted): the base's, unless the vocabulary was resized, which shapes catch
    head = None
    if SCORE_KEY in tensors and cfg.get("modules_to_save"):  # a classifier's head trained whole (PEFT's SEQ_CLS)
        if not model.classifier:
            raise ConfigError(f"{weights_file}: a sequence classifier's adapter (its head, {SCORE_KEY!r}, trained "
                              f"whole) on a language model: load its base as a classifier, or merge the adapter into "
                              f"it with PEFT (AutoPeftModelForSequenceClassification, merge_and_unload)")
        head = tensor(SCORE_KEY).T  # [width, labels]
        if head.shape[1] != model.num_labels:
            raise ConfigError(f"{weights_file}: {SCORE_KEY!r} scores {head.shape[1]} labels, the model {model.num_labels}")
    unread = sorted(k for k in set(tensors) - read if not k.endswith(".base_layer.weight"))
    if unread:
        raise ConfigError(f"{weights_file}: {len(unread)} tensors are not LoRA factors of the targeted modules "
                          f"(e.g. {unread[0]!r}), which this adapter would lose")
    shaped = _reshape_like(out, model, lora, mp)
    if head is not None:
        shaped[_path(model, "score")] = {"score": head}
    return lora, shaped


class ServedAdapter(NamedTuple):
    """One PEFT adapter as the server holds it (`served_adapter`), ready for any entry of a bank.

    leaves: {module: {<weight>_lora_a: [(L,) *inputs, r], <weight>_lora_b: [(L,) r, *outputs]}}
    float32, its alpha / r folded into B (None: dropped from host memory, to be read from
    `directory` again: `serve.adapters`); targets: its `LoRAPlan` targets; serial: unique to this
    load (a prefix cache keys prompts by it, so blocks computed under one load serve only it)."""

    name: str
    directory: str
    rank: int
    targets: frozenset
    leaves: dict
    serial: int


_serials = itertools.count(1)


def prefix_key(adapter: Optional[ServedAdapter]) -> int:
    """What a prefix cache keys prompts run with `adapter` by: its serial (0: the base alone)."""
    return adapter.serial if adapter is not None else 0


def served_adapter(name: str, directory: str, model: ModelConfig, mp: int = 1) -> ServedAdapter:
    """A PEFT adapter directory -> the ServedAdapter of that name (ConfigError naming the adapter and
    its directory for one that cannot be served: see `load_peft`; a mixture's expert adapters)."""
    try:
        spec, leaves = load_peft(directory, model, mp)
    except (ConfigError, ValueError) as e:  # (a bare ValueError: shapes of another model's adapter)
        raise ConfigError(f"adapter {name!r} ({directory}): {e}") from None
    except Exception as e:  # noqa: BLE001 - unreadable files, a config without "r", a corrupt safetensors file
        raise ConfigError(f"adapter {name!r} ({directory}): cannot be read: {type(e).__name__}: {e}") from None
    if _resolve(model, spec)[1]:
        raise ConfigError(f"{directory}: adapter {name!r} adapts a mixture's experts (target_parameters), which "
                          f"served adapters do not support; merge it into the weights with --lora-adapter")
    scaled = {m: {n: x * spec.scale if n.endswith(parallel.LORA_B) else x for n, x in own.items()}
              for m, own in leaves.items()}
    return ServedAdapter(name, str(directory), spec.rank, plan(model, spec).targets, scaled, next(_serials))


class AdapterSet(NamedTuple):
    """PEFT adapters served over one base, unmerged (`generate.Generator(adapters=...)`).

    plan: the bank every row reads, its entry 0 the base alone (zeros) and entries 1 .. slots for
    adapters, each adapter's rank padded with zeros to the bank's, zeros where it leaves a targeted
    weight alone; adapters: the ones known at start, the first `slots` of them placed in entries
    1, 2, .. (a server places the others when requests name them: `serve.adapters`)."""

    plan: parallel.BankPlan
    adapters: tuple[ServedAdapter, ...]

    @property
    def slots(self) -> int:
        return self.plan.adapters - 1


def adapter_set(adapters: Sequence[tuple[str, str]], model: ModelConfig, mp: int = 1, slots: Optional[int] = None,
                rank: Optional[int] = None, every_linear: bool = False, host: Optional[int] = None) -> AdapterSet:
    """[(name, PEFT adapter directory)] -> the AdapterSet serving them: `slots` bank entries (default:
    one each), of `rank` (default: the largest adapter's), for the weights any of them adapts, and
    with `every_linear` every linear layer but the head (PEFT's "all-linear"; adapters loaded later
    may adapt any of those). With `host` (vLLM's --max-cpu-loras, at least `slots`) each adapter is
    read and checked, but only the first `host` keep their leaves (the others: `leaves` None, read
    again when named; `serve.adapters`). ConfigError naming what is at fault."""
    names = [name for name, _ in adapters]
    if len(set(names)) != len(names):
        raise ConfigError(f"adapter names must differ, got {', '.join(names)}")
    slots = len(adapters) if slots is None else slots
    if slots < 1:
        raise ConfigError(f"--max-loras: the bank needs at least one entry for adapters, got {slots}")
    if host is not None and host < slots:
        raise ConfigError(f"--max-cpu-loras ({host}) must be at least the bank's entries, --max-loras ({slots}; "
                          f"default: one per adapter named): the adapters in them are held in host memory too")
    loaded = tuple(a if host is None or i < host else a._replace(leaves=None)
                   for i, a in enumerate(served_adapter(name, directory, model, mp) for name, directory in adapters))
    if rank is None:  # as vLLM's --max-lora-rank where adapters come later; else the largest named
        rank = max([a.rank for a in loaded] + ([DEFAULT_SERVED_RANK] if every_linear or not loaded else []))
    targets = frozenset().union(*(a.targets for a in loaded))
    if every_linear:
        targets |= plan(model, LoraConfig(1, 1.0, 0.0, ALL_LINEAR)).targets
    bank = parallel.BankPlan(targets, slots + 1, rank)
    for a in loaded:
        check_fits(a, bank)
    return AdapterSet(bank, loaded)


DEFAULT_SERVED_RANK = 16  # vLLM's --max-lora-rank default, for a bank that starts without adapters


def check_fits(adapter: ServedAdapter, bank: parallel.BankPlan) -> None:
    """ConfigError unless `adapter` fits an entry of `bank`: its rank at most the bank's, and only
    weights the bank holds adapted."""
    if adapter.rank > bank.rank:
        raise ConfigError(f"adapter {adapter.name!r} ({adapter.directory}): rank {adapter.rank} is above the "
                          f"served adapters' largest rank, {bank.rank} (--max-lora-rank)")
    outside = sorted(f"{m}.{leaf}" for m, leaf in adapter.targets - bank.targets)
    if outside:
        raise ConfigError(f"adapter {adapter.name!r} ({adapter.directory}): it adapts {', '.join(outside)}, which "
                          f"the served bank does not hold (it holds what the adapters named at start adapt, and "
                          f"with runtime loading every linear layer but the head)")


def entry_shapes(model: ModelConfig, bank: parallel.BankPlan, mp: int = 1) -> dict:
    """{module: {<weight>_lora_a / _lora_b: shape}} of one adapter's leaves in `bank` (as
    `ServedAdapter.leaves`, at the bank's rank, layers stacked)."""
    from mesh_transformer import models
    shaped = models.build(model, mp, parallel.LoRAPlan(bank.targets, bank.rank, 1.0)).abstract_params
    return {m: {n: x.shape for n, x in own.items()} for m, own in split(shaped)[0].items()}


def bank_entry(adapter: Optional[ServedAdapter], shapes: dict) -> dict:
    """The leaves an entry of the bank holds for `adapter` (None: zeros, the base alone): `shapes`
    (`entry_shapes`) filled with its leaves, ranks padded with zeros, zeros where it adapts nothing."""
    out: dict = {}
    for m, own in shapes.items():
        for n, shape in own.items():
            x = adapter.leaves.get(m, {}).get(n) if adapter is not None else None
            out.setdefault(m, {})[n] = (np.zeros(shape, np.float32) if x is None
                                        else np.pad(x, [(0, want - have) for have, want in zip(x.shape, shape)]))
    return out


def parse_named(items: Sequence[str], flag: str) -> list[tuple[str, str]]:
    """["name=path", ...] (vLLM's --lora-modules) -> [(name, path)]; ConfigError naming `flag`."""
    out = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"{flag} takes NAME=PATH items, got {item!r}")
        out.append((name, path))
    return out


def _expert_targets(target_parameters: list, model: ModelConfig, where: Path) -> list:
    """PEFT's `target_parameters` (each a parameter path or a suffix of one, as PEFT matches them) ->
    our targets ("experts.gate_up_proj", ...); ConfigError for one that names none of the experts."""
    experts, out = hf_experts(model), []
    for name in target_parameters:
        hits = [e for e in experts if e.hf.format(i=0) == name or e.hf.format(i=0).endswith("." + name)]
        if not hits:
            known = ", ".join(e.hf.split("{i}.", 1)[1] for e in experts) or "none"
            raise ConfigError(f"{where}: target_parameters {name!r} is not an expert weight of family "
                              f"{model.family!r} (its: {known})")
        out += [e.target for e in hits if e.target not in out]
    return out


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
        raise ConfigError(f"this checkpoint names no base (LoRA) or reference (DPO) model ({ref!r})")
    if "hf" in ref:
        from mesh_transformer.io import hf
        # (a reward model's head, drawn here, is the run's: trained whole, it is restored with the adapters)
        found, params = hf.load_hf(ref["hf"], mp=mp, num_labels=model.num_labels)
        if found.architecture() != model.architecture():
            raise ConfigError(f"{ref['hf']}: its architecture is not the config's (a LoRA base or DPO reference "
                              "is the model the config describes)")
        return params if shardings is None else _place(params, shardings)
    if "ckpt" in ref:
        import jax
        from mesh_transformer.io.checkpoint import CheckpointManager
        abstract = models.build(model, mp).abstract_params
        host = shardings is None
        if host:
            cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
            shardings = jax.tree.map(lambda _: cpu, abstract)
        params = CheckpointManager(ref["ckpt"], read_only=True).restore_params(
            ref.get("step"), abstract_params=abstract, target_shardings=shardings, check_config=False)
        return jax.device_get(params) if host else params  # host numpy, as the other sources give it
    import jax
    # jitted, as a run's first random init is (Trainer.init_state / init_base): eager init differs in the last bit
    params = jax.jit(models.build(model, mp).init)(jax.random.key(ref["init"]))
    return jax.device_get(params) if shardings is None else _place(params, shardings)


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
