"""Hugging Face checkpoints <-> our parameters, for every model family.

Each family declares its HF table once (`models/<family>.py`, `hf_table`): which HF tensor is which
of ours and the transform between the two layouts, both ways. Import reads safetensors tensor by
tensor (or a pytorch_model.bin through torch's weights-only unpickler); export writes sharded
safetensors plus `config.json`, converting one tensor at a time, so host memory holds at most one
output shard besides the source parameters. The family comes from config.json's `model_type`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np

from mesh_transformer import models
from mesh_transformer.config import ConfigError, ModelConfig
from mesh_transformer.models import hf_layout as hl
from mesh_transformer.io import mxfp4
from mesh_transformer.io.tokenizer import GENERATION_CONFIG, TOKENIZER_FILES, copy_model_files, read_generation_config

SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """Our config from a HF `config.json` dict (the family from its `model_type`; a
    ForSequenceClassification's label count, and its class names: `class_names`), then `overrides`
    (e.g. a training config's `seq` or `compute_dtype`)."""
    config = models.family_for_hf(hf.get("model_type")).config.from_hf_config(hf)
    return dataclasses.replace(config, **{"num_labels": hf_labels(hf), "label_names": class_names(hf),
                                          "problem_type": problem_type(hf), **overrides})


_CLASSIFIER = "ForSequenceClassification"


def hf_labels(hf: dict) -> int:
    """The label count of a HF classifier's config.json (its `id2label`'s, as transformers counts
    them; 2 where it names none, transformers' default); 0 for any other architecture."""
    if not any(name.endswith(_CLASSIFIER) for name in hf.get("architectures") or []):
        return 0
    return len(hf.get("id2label") or {}) or int(hf.get("num_labels", 2))


def label_names(path) -> Optional[list[str]]:
    """A HF classifier directory's class names (`class_names` of its config.json), read without its weights."""
    if not (Path(path) / "config.json").exists():
        raise ConfigError(f"{path}: no config.json (is this a HF model directory?)")
    try:
        return class_names(json.loads((Path(path) / "config.json").read_text()))
    except ConfigError as e:
        raise ConfigError(f"{path}/config.json: {e}") from None


def problem_type(hf: dict) -> Optional[str]:
    """What a HF classifier's outputs mean (its config's `problem_type`) where it says and its label
    count allows; None for another architecture, and where it does not say (transformers then
    tells from the labels it is given)."""
    from mesh_transformer.train import classify
    problem, labels = hf.get("problem_type"), hf_labels(hf)
    if not labels:
        return None
    try:  # (an unknown name, or one its label count cannot have: none)
        classify.check_problem_type(problem, labels, "problem_type", trains=False)
    except ConfigError:
        return None
    return problem


def class_names(hf: dict) -> Optional[list[str]]:
    """A HF classifier config's `id2label` as a list of names by class number; None for another
    architecture, and where the names are transformers' defaults (LABEL_i) or do not tell the
    classes apart (one empty, two alike)."""
    names = hf.get("id2label") or {}
    if not hf_labels(hf) or not names:
        return None
    try:
        names = [str(names[str(i)] if str(i) in names else names[i]) for i in range(len(names))]
    except KeyError:
        raise ConfigError(f"id2label must number its labels 0 to {len(names) - 1}, got {sorted(names)}") from None
    if names == [f"LABEL_{i}" for i in range(len(names))] or not all(names) or len(set(names)) != len(names):
        return None
    return names


def config_to_hf(c: ModelConfig, torch_dtype: str = "float32") -> dict:
    out = {**c.to_hf_config(), "initializer_range": 0.02, "use_cache": True, "torch_dtype": torch_dtype}
    if c.classifier:  # ForSequenceClassification of the same model_type, transformers' label names
        from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as CLASSES
        name = CLASSES.get(out["model_type"])
        if name is None:
            raise ConfigError(f"num_labels {c.num_labels}: transformers has no sequence classifier for model_type "
                              f"{out['model_type']!r}, so the classifier cannot be exported")
        labels = dict(enumerate(c.label_names or [f"LABEL_{i}" for i in range(c.num_labels)]))
        out.update(architectures=[name], id2label=labels, label2id={v: k for k, v in labels.items()})
        if c.problem_type is not None:
            out["problem_type"] = c.problem_type
    return out


def _our_path(c: ModelConfig, module: str) -> str:
    """Our module path of a table entry's module ("" = the family's root module)."""
    return f"{c.family}/{module}" if module else c.family


def _vocab_axes(c: ModelConfig) -> dict[tuple[str, str], list[int]]:
    """{(module, leaf): positions of its 'vocab' axes} (stacked layout)."""
    model = models.build(c)
    out = {}
    for module, leaves in model.infos.items():
        for leaf, info in leaves.items():
            ndim = model.abstract_params[module][leaf].ndim
            axes = [i for i, a in enumerate(models.core.parallel.leaf_axes(info, ndim)) if a == "vocab"]
            if axes:
                out[(module, leaf)] = axes
    return out


# --------------------------------------------------------------------------------------------
# Import
# --------------------------------------------------------------------------------------------

def _tensor_reader(path: Path) -> Callable[[str], np.ndarray]:
    """name -> float32 numpy array, reading only that tensor where the format allows."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.exists() or single.exists():
        from safetensors import safe_open
        if index.exists():
            files = {k: path / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        else:
            with safe_open(single, framework="numpy") as f:
                files = dict.fromkeys(f.keys(), single)

        def stored(name):  # as stored (uint8 stays uint8)
            with safe_open(files[name], framework="numpy") as f:
                if name not in f.keys():  # an index naming the wrong shard: missing, as before
                    raise KeyError(name)
                return f.get_tensor(name)

        def read(name):
            if name in files:
                return np.asarray(stored(name), dtype=np.float32)
            if name + "_blocks" in files or name + "_scales" in files:
                return _read_mxfp4(path, name, files, stored)
            raise KeyError(name)
        return read
    binary = path / "pytorch_model.bin"
    if binary.exists():
        try:
            import torch
        except ImportError:
            raise ConfigError(f"{binary}: reading pytorch_model.bin needs torch installed (or convert to safetensors)") from None
        state = torch.load(binary, map_location="cpu", weights_only=True)  # no arbitrary unpickling
        return lambda name: state[name].to(torch.float32).numpy()
    raise ConfigError(f"{path}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin found")


def _read_mxfp4(path: Path, name: str, files: dict, stored: Callable[[str], np.ndarray]) -> np.ndarray:
    """Tensor `name` of a checkpoint that stores it in MXFP4 (`name`_blocks and `name`_scales: the
    released GPT-OSS checkpoints' MoE experts), dequantized to the layout transformers' unquantized
    model holds it in (`mxfp4.as_parameter`), so the family's HF table reads it like any other."""
    missing = [name + part for part in ("_blocks", "_scales") if name + part not in files]
    if missing:
        raise ConfigError(f"{path}: MXFP4 tensor {name!r} lacks {missing[0]!r} (its blocks and scales come as a pair)")
    try:
        return mxfp4.as_parameter(stored(name + "_blocks"), stored(name + "_scales"))
    except ValueError as e:
        raise ConfigError(f"{path}: MXFP4 tensor {name!r}: {e}") from None


# Where a multimodal checkpoint keeps its text model's tensors: "model.*" and "lm_head.*" of the
# text-only model, under transformers 5's names, then under the names of the files first released
# (Gemma 3 4B-27B: "language_model.model.*").
_TEXT_MODEL_NAMES = (("model.", "model.language_model."), ("model.", "language_model.model."),
                     ("lm_head.", "lm_head."), ("lm_head.", "language_model.lm_head."))


def text_model(hf: dict) -> tuple[dict, tuple[tuple[str, str], ...]]:
    """(the config.json of the text model a HF config describes; (prefix, the checkpoint's prefix)
    pairs to find its tensors by, tried in order). A multimodal config (Gemma 3 4B-27B: `gemma3`
    with a `text_config`) gives its text model, completed with transformers' defaults for the keys
    the file leaves out; the vision tower is not read."""
    if "text_config" not in hf:
        return hf, (("", ""),)
    from transformers import AutoConfig
    try:
        text = AutoConfig.for_model(**hf).get_text_config().to_dict()
    except (ValueError, TypeError) as e:
        raise ConfigError(f"config.json: model_type {hf.get('model_type')!r} with a text_config: {e}") from None
    return text, _TEXT_MODEL_NAMES


_WITH_HEAD = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration", _CLASSIFIER)  # architectures with a head
_HEAD_NAMES = ("lm_head.", "embed_out.")  # the head's tensors (GPT-NeoX's: embed_out)


def headless(hf: dict) -> bool:
    """Whether a config.json describes a base model's checkpoint (`architectures`: GPTJModel,
    MistralModel ...: what sentence-transformers saves, and embedding models built on decoder LMs
    ship, E5-Mistral among them): its tensors lack the causal LM's prefix and it has no head."""
    names = hf.get("architectures") or []
    return bool(names) and not any(n.endswith(_WITH_HEAD) for n in names)


def load_hf(path: str | os.PathLike, mp: int = 1, **overrides) -> tuple[ModelConfig, dict]:
    """Read a HF model directory -> (our config, params as numpy float32, vocab padded for `mp`).
    A base model's checkpoint (`headless`) loads with a head of zeros: every logit is 0, so it
    embeds (its final hidden states are the checkpoint's) but does not generate; a warning says so.
    A ForSequenceClassification checkpoint loads as a classifier (`ModelConfig.num_labels`); a
    causal LM's loads as one where `overrides` set num_labels (a reward model's start), its score
    head drawn as transformers draws a new one (normal, std 0.02; seeded), with a warning."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise ConfigError(f"{path}: no config.json (is this a HF model directory?)")
    raw = json.loads(config_file.read_text())
    hf, renames = text_model(raw)
    labels = hf_labels(raw)
    config = config_from_hf(hf, **{"num_labels": labels, **overrides})
    if labels and config.num_labels != labels:
        raise ConfigError(f"{path}: a classifier of {labels} labels, but num_labels is {config.num_labels}")
    read = _tensor_reader(path)
    base = headless(raw)
    width = config.stem().hidden_size(config.d_model)  # of a head drawn or zeroed below
    if config.classifier and not labels:
        warnings.warn(f"{path}: a language model's checkpoint read as a classifier of {config.num_labels} "
                      f"label(s): its head is dropped and a new score head is drawn (train it)")
    if base:
        warnings.warn(f"{path}: a base model's checkpoint ({', '.join(raw['architectures'])}) has no language-model "
                      f"head: it loads with a head of zeros, so it embeds (POST /v1/embeddings) but does not generate")

    def get(name):
        for old, new in renames:
            if name.startswith(old):
                try:
                    return read(new + name[len(old):])
                except KeyError:
                    continue
        if name == hl.SCORE.hf and config.classifier and not labels:  # torch [labels, width]
            return np.random.default_rng(0).normal(0.0, 0.02, (config.num_labels, width)).astype(np.float32)
        if base and name.startswith(_HEAD_NAMES):  # [vocab, width] as a torch Linear stores it, or its bias
            return np.zeros((config.n_vocab, width) if name.endswith("weight") else (config.n_vocab,), np.float32)
        if base and "." in name:  # "transformer.h.0..." as GPTJModel names it: "h.0..."
            try:
                return read(name.split(".", 1)[1])
            except KeyError:
                pass
        raise ConfigError(f"{path}: tensor {name!r} is missing from the checkpoint")

    def ours(entry, i=None):  # the entry's leaves (of layer i), experts stacked
        if not entry.per_expert:
            return entry.transform.to_ours(get(entry.hf.format(i=i)), config)
        return _stacked(lambda e: entry.transform.to_ours(get(entry.hf.format(i=i, e=e)), config), config.n_experts)

    params: dict[str, dict[str, np.ndarray]] = {}
    for entry in models.family(config.family).hf_table(config):
        if entry.per_layer:
            values = _stacked(lambda i: ours(entry, i), config.layers)
        else:
            values = ours(entry)
        for (module, leaf), value in zip(entry.ours, values):
            params.setdefault(_our_path(config, module), {})[leaf] = value
    return config, pad_vocab(params, config, config.padded_vocab(mp))


def _stacked(part: Callable[[int], tuple], n: int) -> list[np.ndarray]:
    """part(0 .. n-1), each a tuple of arrays, stacked per position into [n, ...] arrays, each filled
    as its part is read: host memory holds the stack and one part (a list of the parts, then
    np.stack, held both: twice gpt-oss-20b's 51 GB of dequantized gate_up_proj)."""
    first = part(0)
    out = [np.empty((n, *x.shape), x.dtype) for x in first]
    for i in range(n):
        for stack, x in zip(out, first if i == 0 else part(i)):
            stack[i] = x
    return out


# sentence-transformers' pooling modes -> ours (`evaluate.scoring.POOLINGS`); its older configs
# set one `pooling_mode_*` key true instead of naming the mode
_ST_POOLINGS = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
_ST_LEGACY_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                   "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}


def embedding_pooling(path: str | os.PathLike) -> tuple[str, bool] | None:
    """(pooling, normalize) a sentence-transformers model directory declares: its modules.json's
    Pooling module's mode (`lasttoken` -> "last", `mean`, `cls`) and whether a Normalize module
    follows; None where the directory has no modules.json or no Pooling module in it. A mode this
    library does not pool by (max, weightedmean, mean_sqrt_len_tokens, several at once) is a
    ConfigError naming the file."""
    path = Path(path)
    listed = path / "modules.json"
    if not listed.exists():
        return None
    try:
        modules = json.loads(listed.read_text())
        kinds = {m["type"].rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ConfigError(f"{listed}: not sentence-transformers' list of modules ({type(e).__name__}: {e})") from None
    if "Pooling" not in kinds:
        return None
    pooling_file = path / kinds["Pooling"] / "config.json"
    try:
        settings = json.loads(pooling_file.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{pooling_file}: the Pooling module's settings do not read ({type(e).__name__}: {e})") from None
    mode = settings.get("pooling_mode") or [m for key, m in _ST_LEGACY_KEYS.items() if settings.get(key)] or "mean"
    mode = mode[0] if isinstance(mode, list) and len(mode) == 1 else mode
    if not isinstance(mode, str) or mode not in _ST_POOLINGS:
        raise ConfigError(f"{pooling_file}: pooling {mode!r} is not one this library runs (lasttoken, mean, cls): "
                          f"pass --embedding-pooling to choose one")
    return _ST_POOLINGS[mode], "Normalize" in kinds


def pad_vocab(params: dict, config: ModelConfig, padded: int) -> dict:
    """Zero-pad (or trim) every 'vocab' axis of `params` to `padded` entries."""
    out = {k: dict(v) for k, v in params.items()}
    for (module, leaf), axes in _vocab_axes(config).items():
        for axis in axes:
            out[module][leaf] = _fit(out[module][leaf], axis, padded)
    return out


def _fit(x, axis: int, size: int):
    if x.shape[axis] >= size:
        return np.take(x, np.arange(size), axis=axis)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return np.pad(x, pad)


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------

_DTYPES = {"fp32": np.float32, "float32": np.float32, "fp16": np.float16, "float16": np.float16,
           "bf16": "bfloat16", "bfloat16": "bfloat16"}


def _hf_tensors(params, config: ModelConfig, dtype) -> Iterator[tuple[str, Callable[[], np.ndarray]]]:
    """(HF name, thunk producing that tensor) in file order (globals before the first layer tensor,
    then layer by layer, then the rest); each thunk reads one slice of `params`."""
    vocab_axes = _vocab_axes(config)
    table = models.family(config.family).hf_table(config)

    def thunk(entry, i=None, e=None):
        def make():
            ours = []
            for module, leaf in entry.ours:
                x = params[_our_path(config, module)][leaf]
                x = x[i] if i is not None else x
                x = np.asarray(x[e] if e is not None else x, dtype=np.float32)
                for axis in vocab_axes.get((_our_path(config, module), leaf), ()):
                    x = _fit(x, axis - (i is not None), config.n_vocab)
                ours.append(x)
            return np.ascontiguousarray(entry.transform.to_hf(tuple(ours), config).astype(dtype))
        return make

    first_layer = next((k for k, e in enumerate(table) if e.per_layer), len(table))
    for entry in table[:first_layer]:
        if not entry.per_layer:
            yield entry.hf, thunk(entry)
    for i in range(config.layers):
        for entry in table:
            if entry.per_expert:
                for e in range(config.n_experts):
                    yield entry.hf.format(i=i, e=e), thunk(entry, i, e)
            elif entry.per_layer:
                yield entry.hf.format(i=i), thunk(entry, i)
    for entry in table[first_layer:]:
        if not entry.per_layer:
            yield entry.hf, thunk(entry)


def save_hf(params, config: ModelConfig, path: str | os.PathLike, dtype: str = "fp32",
            max_shard_bytes: int = 2 << 30) -> Path:
    """Write `params` as a HF model directory (config.json + sharded safetensors + index).

    `params` may hold numpy or (sharded) jax arrays; tensors are converted and written one shard
    at a time, never all at once.
    """
    from safetensors.numpy import save_file
    import ml_dtypes

    if dtype not in _DTYPES:
        raise ConfigError(f"dtype must be one of fp32, fp16, bf16; got {dtype!r}")
    np_dtype = ml_dtypes.bfloat16 if _DTYPES[dtype] == "bfloat16" else _DTYPES[dtype]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch_dtype = {np.float32: "float32", np.float16: "float16"}.get(np_dtype, "bfloat16")

    shards: list[dict[str, np.ndarray]] = [{}]
    files, weight_map, total = [], {}, 0

    def flush():
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shards[-1], str(path / name), metadata={"format": "pt"})
        files.append(name)
        for key in shards[-1]:
            weight_map[key] = name
        shards[-1] = {}

    shard_bytes = 0
    for name, thunk in _hf_tensors(params, config, np_dtype):
        tensor = thunk()
        if shards[-1] and shard_bytes + tensor.nbytes > max_shard_bytes:
            flush()
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += tensor.nbytes
        total += tensor.nbytes
    flush()
    n = len(files)
    renamed = {}
    for i, old in enumerate(files):
        new = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(path / old, path / new)
        renamed[old] = new
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {k: renamed[v] for k, v in weight_map.items()}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (path / "config.json").write_text(json.dumps(config_to_hf(config, torch_dtype), indent=2))
    return path


# --------------------------------------------------------------------------------------------
# Whole-directory conversions (from_hf_weights.py / to_hf_weights.py)
# --------------------------------------------------------------------------------------------



def hf_to_checkpoint(hf_dir: str, ckpt_dir: str, train=None) -> int:
    """Import a HF model directory as a params-only checkpoint (step 0) with its config, tokenizer and
    generation config.

    `train`: the TrainConfig to record beside the model (defaults otherwise). Returns the parameter count.
    """
    import jax
    from mesh_transformer.io.checkpoint import CheckpointManager
    from mesh_transformer.config import Config, TrainConfig

    model_config, params = load_hf(hf_dir)
    config = Config(model_config, train or TrainConfig())
    cpu = jax.devices("cpu")[0]
    params = jax.tree.map(lambda x: jax.device_put(x, cpu), params)
    with CheckpointManager(ckpt_dir, config=config, async_save=False) as ckpt:
        ckpt.save(0, {"params": params}, extras={"imported_from": str(hf_dir)}, wait=True)
    copy_model_files([hf_dir], ckpt_dir)
    return model_config.n_params()


def checkpoint_to_hf(ckpt_dir: str, out_dir: str, dtype: str = "fp16", step=None, max_shard_bytes: int = 2 << 30,
                     peft: bool = False) -> Path:
    """Export the params of a checkpoint (latest step by default) as a HF model directory.

    Parameters are restored unsharded on the host CPU once, then written tensor by tensor. A LoRA
    run's checkpoint exports merged (a plain HF model), or with `peft` as a PEFT adapter directory.
    """
    import jax
    from jax.sharding import SingleDeviceSharding
    from mesh_transformer.io.checkpoint import CheckpointError, CheckpointManager
    from mesh_transformer.config import config_from_dict

    ckpt = CheckpointManager(ckpt_dir, read_only=True)
    saved = ckpt.saved_config(step)
    if saved is None:
        raise CheckpointError(f"{ckpt_dir}: the checkpoint holds no config; cannot tell the model's shape")
    full = config_from_dict(saved)
    config = full.model
    if peft and full.train.lora is None:
        raise ConfigError(f"{ckpt_dir}: --peft needs a LoRA run's checkpoint (its config has no 'lora' key)")
    if full.train.lora is not None:
        from mesh_transformer import lora
        if peft:
            spec, ref = lora.LoraConfig.from_dict(full.train.lora), ckpt.extras(step).get(lora.BASE_KEY) or {}
            out = lora.save_peft(lora.restore_adapters(ckpt, full, step), config, spec, out_dir,
                                 base=ref.get("hf") or ref.get("ckpt"))
        else:
            out = save_hf(lora.restore_merged(ckpt, full, 1, step), config, out_dir, dtype=dtype,
                          max_shard_bytes=max_shard_bytes)
        _copy_model_files(ckpt_dir, out)
        return out
    cpu = SingleDeviceSharding(jax.devices("cpu")[0])
    # The vocabulary padding the checkpoint was saved with (it depends on the mp it trained with).
    shapes = ckpt.saved_shapes(step)
    abstract = {m: {n: jax.ShapeDtypeStruct(shapes.get(f"params.{m}.{n}", x.shape), x.dtype) for n, x in leaves.items()}
                for m, leaves in models.build(config).abstract_params.items()}
    params = ckpt.restore_params(step, abstract_params=abstract, target_shardings=jax.tree.map(lambda _: cpu, abstract),
                                 check_config=False)
    out = save_hf(params, config, out_dir, dtype=dtype, max_shard_bytes=max_shard_bytes)
    _copy_model_files(ckpt_dir, out)
    return out


def _copy_model_files(ckpt_dir: str, out: Path) -> None:
    """The tokenizer and generation config kept beside the checkpoint, then config.json's special
    tokens named from them (not the family's class defaults: Llama's 1/2 are '"' and '#' in Llama 3)."""
    copy_model_files([ckpt_dir], str(out))
    if (Path(out) / "config.json").exists():  # not for a PEFT adapter directory
        name_special_tokens(out)


def name_special_tokens(directory: str | os.PathLike) -> None:
    """Set config.json's bos/eos/pad ids from the tokenizer and generation config beside it."""
    config_file = Path(directory) / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **special_token_ids(directory)}, indent=2))


def special_token_ids(directory: str | os.PathLike) -> dict:
    """The bos/eos/pad ids a model directory's files set: its tokenizer's, overridden by its
    generation_config.json's (which may list several eos ids); ids neither sets are left out."""
    directory, ids = Path(directory), {}
    if any((directory / name).exists() for name in TOKENIZER_FILES):
        from transformers import AutoTokenizer
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(directory))
        except Exception as e:  # noqa: BLE001 - the export stands; only the tokenizer's ids are missing
            warnings.warn(f"{directory}: the tokenizer beside the weights does not load ({type(e).__name__}: {e}); "
                          f"config.json's special tokens come from {GENERATION_CONFIG} alone")
        else:
            ids.update({key: getattr(tokenizer, key, None) for key in SPECIAL_TOKENS})
    if (directory / GENERATION_CONFIG).exists():
        generation = read_generation_config(directory / GENERATION_CONFIG)
        ids.update({key: generation[key] for key in SPECIAL_TOKENS if generation.get(key) is not None})
    return {key: value for key, value in ids.items() if value is not None}
