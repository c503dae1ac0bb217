"""Model families: one shared transformer core (`core.py`, `layers.py`), one file per family.

    model = models.build(config, mp)      # Model: init/apply, abstract_params, infos, n_params ...
    models.FAMILIES["llama"].config       # the family's config class (from_hf_config, to_hf_config)

A family is its config class, its `block(config, x, ctx, cache)` and its HF table (`hf_layout`).
Adding one is one file plus one line in `_FAMILY_MODULES`.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import json
from typing import Callable, NamedTuple

from mesh_transformer.config import ConfigError, ModelConfig
from mesh_transformer.models import core, hf_layout


class Family(NamedTuple):
    name: str
    config: type  # its ModelConfig subclass
    block: Callable  # (config, x [B, T, D], ctx, cache) -> (x, cache)
    hf_table: Callable  # config -> list[hf_layout.HFParam]
    hf_model_types: tuple[str, ...]  # config.json model_type values it reads
    hf_experts: Callable = lambda config: []  # config -> list[hf_layout.HFExperts] (mixtures: PEFT's targets)


# family name -> (module, HF model_types it imports)
_FAMILY_MODULES = {
    "gptj": ("gptj", ("gptj",)),
    "gpt_neox": ("gpt_neox", ("gpt_neox",)),
    "llama": ("llama", ("llama", "mistral", "qwen2", "qwen3", "granite")),
    "gpt2": ("gpt2", ("gpt2",)),
    "opt": ("opt", ("opt",)),
    "phi3": ("phi3", ("phi3",)),
    "gemma": ("gemma", ("gemma", "gemma2", "gemma3_text")),
    "mixtral": ("mixtral", ("mixtral", "qwen2_moe", "qwen3_moe")),
    "olmo2": ("olmo2", ("olmo2", "olmo3")),
    "phi": ("phi", ("phi",)),
    "starcoder2": ("starcoder2", ("starcoder2",)),
    "gpt_oss": ("gpt_oss", ("gpt_oss",)),
}


@functools.cache
def _load(name: str) -> Family:
    module_name, hf_types = _FAMILY_MODULES[name]
    module = importlib.import_module(f"mesh_transformer.models.{module_name}")
    config_cls = next(v for v in vars(module).values()
                      if isinstance(v, type) and issubclass(v, ModelConfig) and v is not ModelConfig
                      and v.__module__ == module.__name__)
    experts = getattr(module, "hf_experts", None)
    return Family(name, config_cls, module.block, hf_layout.for_config(module.hf_table), hf_types,
                  *([experts] if experts else []))


FAMILIES = tuple(_FAMILY_MODULES)


def family(name: str) -> Family:
    if name not in _FAMILY_MODULES:
        raise ConfigError(f"config key 'family': {name!r} is not a model family here (supported: {', '.join(FAMILIES)})")
    return _load(name)


def config_class(name: str) -> type:
    return family(name).config


def family_for_hf(model_type) -> Family:
    """The family that reads a HF config.json's `model_type` (ConfigError naming the supported ones)."""
    for name, (_, hf_types) in _FAMILY_MODULES.items():
        if model_type in hf_types:
            return _load(name)
    supported = sorted(t for _, types in _FAMILY_MODULES.values() for t in types)
    raise ConfigError(f"config.json: model_type {model_type!r} is not supported (supported: {', '.join(supported)})")


_MODELS: dict[tuple, core.Model] = {}


def build(config: ModelConfig, mp: int = 1, lora=None) -> core.Model:
    """The family's network for `config`, vocabulary padded for `mp` shards (one per config, mp and
    `lora`, a `parallel.LoRAPlan` adding adapters)."""
    key = (json.dumps({"cls": type(config).__name__, **dataclasses.asdict(config)}, sort_keys=True), mp, lora)
    if key not in _MODELS:
        _MODELS[key] = core.build(config, family(config.family).block, mp, lora)
    return _MODELS[key]
