"""Weights, config and tokenizer for the tools that run a trained model (sample, serve, bench).

    parser = argparse.ArgumentParser(); loading.add_model_args(parser)
    model = loading.from_args(parser.parse_args())   # LoadedModel(config, params, tokenizer, mesh)

Sources: `--ckpt PATH` (our orbax checkpoint directory, local or gs://, config saved inside;
`--config` overrides it; or a mesh-transformer-jax v1 step or model directory, which needs
`--config`) or `--hf PATH` (a Hugging Face model directory of any supported family). The tokenizer comes from
`--tokenizer` if given, else from the weights' directory when tokenizer files were saved beside the
weights, else the bundled GPT-2 BPE. Generation ends at the tokenizer's EOS and at every EOS id a
`generation_config.json` beside the weights lists (`end_of_text_ids`). Parameters are placed on a ('dp', 'mp') mesh by the
MEGATRON table, ready for `generate.Generator`.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Optional

import jax
from jax.sharding import Mesh

from mesh_transformer import models, parallel
from mesh_transformer.config import Config, ConfigError, ModelConfig, config_from_dict, load_config
from mesh_transformer.io.tokenizer import GENERATION_CONFIG, TOKENIZER_FILES, read_generation_config



@dataclass
class LoadedModel:
    config: ModelConfig
    params: Any  # Haiku params placed by the MEGATRON table (--hf: in the compute dtype; --ckpt: float32 as saved)
    tokenizer: Any  # a Hugging Face tokenizer: encode / decode / eos_token_id
    mesh: Mesh
    name: str  # for logs and /v1/models: the directory's base name
    quantize: Optional[str] = None  # the generator's weights: None (the compute dtype) or "int8"
    eos_token_ids: tuple[int, ...] = ()  # what ends a generation (`end_of_text_ids`)

    def generator(self, matvec: Optional[bool] = None, adapters=None, slots: Optional[int] = None,
                  rank: Optional[int] = None, every_linear: bool = False, host: Optional[int] = None,
                  speculate: int = 0, lookup_ngram: Optional[int] = None, speculate_rows: int = 1):
        """A `generate.Generator` that takes over the weights: they stay on the devices once, in the
        compute dtype (or `quantize`d) and the generator's layout (`params` is None afterwards).
        `adapters`: [(name, PEFT adapter directory)] served beside the base, unmerged, in a bank of
        `slots` entries of `rank`, holding every linear layer with `every_linear`, the leaves of at
        most `host` of them kept in host memory (`lora.adapter_set`). `speculate`, `lookup_ngram`,
        `speculate_rows`: speculative decoding by prompt lookup (`generate.lookup`)."""
        from mesh_transformer.generate import Generator
        from mesh_transformer.generate.decode import LOOKUP_NGRAM
        bank = None
        if adapters or slots is not None or every_linear:
            from mesh_transformer import lora
            bank = lora.adapter_set(adapters or [], self.config, self.mesh.shape[parallel.MP], slots, rank,
                                    every_linear, host)
        params, self.params = self.params, None
        return Generator(self.config, params, self.mesh, matvec=matvec, donate=True, quantize=self.quantize,
                         adapters=bank, speculate=speculate, speculate_rows=speculate_rows,
                         lookup_ngram=LOOKUP_NGRAM if lookup_ngram is None else lookup_ngram)

    def as_token_classifier(self, tokens: list[str]) -> list[str]:
        """Make this language model a classifier whose scores are its logits of these tokens' (each
        a single token of the tokenizer; `models.core.score_from_lm_head`: two make one label, the
        second's logit minus the first's), in place -> the labels' names (the second token; or
        each token)."""
        from mesh_transformer.models.core import score_from_lm_head
        ids = []
        for token in tokens:
            encoded = list(self.tokenizer.encode(token, add_special_tokens=False))
            if len(encoded) != 1:
                raise ConfigError(f"--classifier-from-tokens: {token!r} is {len(encoded)} tokens to this tokenizer "
                                  f"({encoded}); each must be one")
            ids += encoded
        self.config, self.params = score_from_lm_head(self.config, self.params, ids)
        return tokens[1:] if len(tokens) == 2 else list(tokens)


COMPILE_CACHE_ENV = "MESH_TRANSFORMER_COMPILE_CACHE"


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The flags every tool that loads a model shares."""
    group = parser.add_argument_group("model")
    source = group.add_mutually_exclusive_group(required=True)
    source.add_argument("--ckpt", help="checkpoint directory written by training (local or gs://)")
    source.add_argument("--hf", help="Hugging Face model directory (config.json + safetensors/bin): GPT-J, "
                                     "GPT-NeoX/Pythia, LLaMA/Mistral/Qwen2/Qwen3/Granite, OLMo 2/3, Phi-1/1.5/2, Phi-3/Phi-4, "
                                     "StarCoder2, Gemma 1-3, "
                                     "Mixtral/Qwen2-MoE/Qwen3-MoE, GPT-2 or OPT")
    group.add_argument("--config", help="JSON config: overrides the checkpoint's; with --hf gives "
                                        "cores_per_replica and compute_dtype")
    group.add_argument("--tokenizer", help="'gpt2', a tokenizer directory, or a hub name "
                                           "(default: files beside the weights, else gpt2)")
    group.add_argument("--mp", type=int, help="model-parallel devices (default: the config's cores_per_replica, else 1)")
    group.add_argument("--dp", type=int, help="data-parallel replicas (default: all remaining devices)")
    group.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                       help="compute dtype (default: the config's; device_serve.py and eval_harness.py on a CPU "
                            "backend: float32)")
    group.add_argument("--quantize", choices=("int8",),
                       help="weight-only quantization of the matmul weights for sampling, serving and evaluation: "
                            "int8 values with a float32 scale per output (a byte a weight; default: none)")
    group.add_argument("--lora-adapter", metavar="DIR",
                       help="a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) to merge "
                            "into the weights at load")
    group.add_argument("--compile-cache", metavar="DIR", default=os.environ.get(COMPILE_CACHE_ENV),
                       help="keep compiled XLA programs in this directory: a later run with the "
                            f"same model, devices and shapes loads them instead of compiling (default: ${COMPILE_CACHE_ENV}, "
                            "else off)")


def use_compile_cache(directory: Optional[str]) -> None:
    """JAX's persistent compilation cache in `directory` (None: leave it off). Every program is kept,
    however fast it compiled: a server's warm-up compiles dozens of shapes of a few seconds each."""
    if not directory:
        return
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def from_args(args: argparse.Namespace) -> LoadedModel:
    use_compile_cache(getattr(args, "compile_cache", None))
    return load(ckpt=args.ckpt, hf=args.hf, config=args.config, tokenizer=args.tokenizer,
                mp=args.mp, dp=args.dp, dtype=args.dtype, lora_adapter=getattr(args, "lora_adapter", None),
                quantize=getattr(args, "quantize", None))


def load(ckpt: Optional[str] = None, hf: Optional[str] = None, config: Optional[str] = None,
         tokenizer: Optional[str] = None, mp: Optional[int] = None, dp: Optional[int] = None,
         dtype: Optional[str] = None, lora_adapter: Optional[str] = None,
         quantize: Optional[str] = None) -> LoadedModel:
    """Exactly one of `ckpt` / `hf`; see the module docstring. LoRA adapters (a LoRA run's checkpoint,
    or a PEFT `lora_adapter`) are merged into the weights here, so decoding costs nothing extra;
    `quantize` ("int8") is what `LoadedModel.generator` makes of them."""
    loaded = _load(ckpt, hf, config, tokenizer, mp, dp, dtype, lora_adapter)
    loaded.quantize = quantize
    return loaded


def _load(ckpt, hf, config, tokenizer, mp, dp, dtype, lora_adapter) -> LoadedModel:
    if (ckpt is None) == (hf is None):
        raise ConfigError("give exactly one of --ckpt (a training checkpoint) or --hf (a Hugging Face directory)")
    if ckpt is not None:
        from mesh_transformer.io import mtj_v1
        step_dir = mtj_v1.find(ckpt)
        if step_dir is not None:  # the original's format: the model's shape comes from --config alone
            loaded = _load_v1(ckpt, step_dir, config, tokenizer, mp, dp, dtype)
            return _with_adapter(loaded, lora_adapter)
    override = load_config(config) if config else None
    if hf is not None:
        return _with_adapter(_load_hf(hf, override, tokenizer, mp, dp, dtype), lora_adapter)
    return _with_adapter(_load_ckpt(ckpt, override, tokenizer, mp, dp, dtype), lora_adapter)


def _with_adapter(loaded: LoadedModel, adapter: Optional[str]) -> LoadedModel:
    """Merge a PEFT LoRA adapter into the loaded weights (W + alpha/r B A), keeping their dtype and placement."""
    if adapter is None:
        return loaded
    import numpy as np
    from mesh_transformer import lora

    mp = loaded.mesh.shape[parallel.MP]
    spec, adapters = lora.load_peft(adapter, loaded.config, mp)
    host = jax.tree.map(lambda x: np.asarray(x, np.float32), loaded.params)
    merged = lora.merged(lora.join(host, adapters), spec.scale)
    loaded.params = jax.tree.map(lambda m, x: jax.device_put(m.astype(x.dtype), x.sharding), merged, loaded.params)
    return loaded


def _mesh(mp: Optional[int], dp: Optional[int], train_mp: Optional[int]) -> Mesh:
    """--mp (else the config's cores_per_replica, else 1) x --dp (else every remaining device)."""
    return parallel.make_mesh(mp or train_mp or 1, dp)


def _load_hf(path, override: Optional[Config], tokenizer, mp, dp, dtype) -> LoadedModel:
    from mesh_transformer.io import hf

    mesh = _mesh(mp, dp, override.train.cores_per_replica if override else None)
    dtype = dtype or (override.model.compute_dtype if override else "bfloat16")
    config, params = hf.load_hf(path, mp=mesh.shape[parallel.MP], compute_dtype=dtype)
    model = models.build(config, mesh.shape[parallel.MP])
    model.check_mesh(mesh.shape, zero=False)
    params = jax.tree.map(lambda x: x.astype(jax.numpy.dtype(dtype)), params)  # cast before the transfer
    shardings = parallel.named(mesh, model.param_specs(model.rules(False, mesh.shape[parallel.MP]), params))
    return _loaded(config, jax.device_put(params, shardings), tokenizer, path, mesh, path)


def _load_ckpt(path, override: Optional[Config], tokenizer, mp, dp, dtype) -> LoadedModel:
    from mesh_transformer.io.checkpoint import CheckpointManager

    manager = CheckpointManager(path, read_only=True, config=override)
    if override is not None:
        full = override
    else:
        saved = manager.saved_config()
        if saved is None:
            raise ConfigError(f"{path}: the checkpoint holds no config; pass --config")
        full = config_from_dict(saved)
    config = full.model if dtype is None else dataclasses.replace(full.model, compute_dtype=dtype)
    mesh = _mesh(mp, dp, full.train.cores_per_replica)
    model = models.build(config, mesh.shape[parallel.MP])
    model.check_mesh(mesh.shape, zero=False)
    shardings = parallel.named(mesh, model.param_specs(model.rules(False, mesh.shape[parallel.MP])))
    if full.train.lora is not None:  # adapters + a reference to the base: merged here
        from mesh_transformer import lora
        params = lora.restore_merged(manager, full, mesh.shape[parallel.MP], shardings=shardings)
    else:
        params = manager.restore_params(abstract_params=model.abstract_params, target_shardings=shardings)
    return _loaded(config, params, tokenizer, path, mesh, path)


def _load_v1(path, step_dir, config_path, tokenizer, mp, dp, dtype) -> LoadedModel:
    """A mesh-transformer-jax v1 checkpoint, in the compute dtype, streamed onto the mesh leaf by leaf."""
    from mesh_transformer.io import mtj_v1

    full = mtj_v1.load_config(config_path, path)
    config = full.model if dtype is None else dataclasses.replace(full.model, compute_dtype=dtype)
    mesh = _mesh(mp, dp, full.train.cores_per_replica)
    models.build(config, mesh.shape[parallel.MP]).check_mesh(mesh.shape, zero=False)
    params = mtj_v1.load_params(mtj_v1.V1Checkpoint(step_dir, config), mesh, dtype=config.compute_dtype)
    return _loaded(config, params, tokenizer, mtj_v1.tokenizer_dirs(step_dir), mesh, path)


def _loaded(config: ModelConfig, params, tokenizer: Optional[str], weights_dir, mesh: Mesh, path) -> LoadedModel:
    tok = resolve_tokenizer(tokenizer, weights_dir, config)
    return LoadedModel(config, params, tok, mesh, _name(path), eos_token_ids=end_of_text_ids(tok, weights_dir))


def end_of_text_ids(tokenizer, weights_dir) -> tuple[int, ...]:
    """The tokenizer's EOS, then the eos ids of the first generation_config.json found in `weights_dir`
    (local or gs://; or a list of directories). Chat models end a turn with a token of their own that
    only the generation config names (Llama 3's <|eot_id|>, Gemma's <end_of_turn>), as vLLM reads it."""
    from mesh_transformer.generate import MAX_EOS
    from mesh_transformer.io import storage

    ids = [tokenizer.eos_token_id] if getattr(tokenizer, "eos_token_id", None) is not None else []
    for directory in _directories(weights_dir):
        path = storage.join(directory, GENERATION_CONFIG)
        if storage.exists(path):
            generation = read_generation_config(path)
            try:
                listed = generation.get("eos_token_id")
                listed = [] if listed is None else [int(i) for i in (listed if isinstance(listed, list) else [listed])]
            except (ValueError, TypeError, AttributeError) as e:
                raise ConfigError(f"{path}: eos_token_id must be a token id or a list of them ({e})") from None
            ids += listed
            break
    unique = tuple(dict.fromkeys(int(i) for i in ids))
    if len(unique) > MAX_EOS:
        raise ConfigError(f"{path}: eos_token_id lists {len(unique)} ids with the tokenizer's; at most {MAX_EOS} are supported")
    return unique


def _directories(weights_dir) -> list[str]:
    """`weights_dir` as a list of directories: one, or the list given."""
    return [str(weights_dir)] if isinstance(weights_dir, (str, os.PathLike)) else [str(d) for d in weights_dir]


def resolve_tokenizer(spec: Optional[str], weights_dir, config: ModelConfig):
    """`spec`, else tokenizer files in `weights_dir` (local or gs://; or the first of a list of
    directories that has some), else GPT-2 BPE; checked against the vocabulary."""
    from mesh_transformer.io.tokenizer import load_tokenizer

    if spec is None and weights_dir is not None:
        beside = next((d for d in _directories(weights_dir) if _tokenizer_files(d)), None)
        if beside is not None:
            with _local_tokenizer_dir(beside) as local:
                tok = load_tokenizer(local)
            return _check_vocab(tok, beside, config)
    return _check_vocab(load_tokenizer(spec or "gpt2"), spec or "gpt2", config)


def _tokenizer_files(directory: str) -> list[str]:
    from mesh_transformer.io import storage
    return [f for f in TOKENIZER_FILES if storage.exists(storage.join(directory, f))]


@contextlib.contextmanager
def _local_tokenizer_dir(directory: str):
    """`directory`, or a temporary local copy of its tokenizer files when it is on gs://."""
    from mesh_transformer.io import storage

    if not storage.is_gcs(directory):
        yield directory
        return
    with tempfile.TemporaryDirectory(prefix="mesh-transformer-tokenizer-") as tmp:
        for name in _tokenizer_files(directory):
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(storage.read_bytes(storage.join(directory, name)))
        yield tmp


def _check_vocab(tok, spec: str, config: ModelConfig):
    if len(tok) > config.n_vocab:
        raise ConfigError(f"tokenizer {spec or 'gpt2'!r} has {len(tok)} tokens but the model's vocabulary "
                          f"(n_vocab) is {config.n_vocab}; pass the matching --tokenizer")
    return tok


def _name(path) -> str:
    return os.path.basename(str(path).rstrip("/")) or str(path)
