"""Any checkpoint (ours, or the original's v1) -> a params-only checkpoint of ours, in a chosen dtype.

    config = convert.source_config("step_383500/", "configs/6B_roto_256.json")
    print(convert.memory_per_device(config.model, mesh, "bfloat16"))   # before loading anything
    convert.save_params(params, config, "gptj_slim", "bfloat16", source="step_383500/")
    before, after = convert.slim("gs://b/run", "gs://b/run_slim", None, "bfloat16")

What `resharding_example.py` and `slim_model.py` share. The checkpoint written is what
`from_hf_weights.py` writes: step 0, `{"params": ...}`, the config and the tokenizer files beside it;
every tool loads it (16-bit params are cast back to float32 for training).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from mesh_transformer.config import Config, ConfigError, ModelConfig, config_from_dict, load_config
from mesh_transformer.io import storage
from mesh_transformer.io.checkpoint import CheckpointError, CheckpointManager
from mesh_transformer.io.tokenizer import copy_model_files

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16",
          "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def dtype_name(dtype: str) -> str:
    """'bf16' / 'bfloat16' -> 'bfloat16' (the names ModelConfig.compute_dtype uses)."""
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ConfigError(f"dtype must be one of fp32, bf16, fp16; got {dtype!r}") from None


def source_config(path: str, config_path: Optional[str] = None) -> Config:
    """The config of a checkpoint: v1 -> from `config_path` (required); ours -> `config_path` if given,
    else the one saved inside."""
    from mesh_transformer.io import mtj_v1

    if mtj_v1.find(path) is not None:
        return mtj_v1.load_config(config_path, path)
    if config_path:
        return load_config(config_path)
    saved = CheckpointManager(path, read_only=True).saved_config()
    if saved is None:
        raise ConfigError(f"{path}: the checkpoint holds no config; pass --config")
    return config_from_dict(saved)


def memory_per_device(model: ModelConfig, mesh, dtype: str) -> dict[str, int]:
    """Bytes one device of `mesh` needs to sample from `model` in `dtype` (Megatron layout).

    params: its shard of the weights (vocabulary padded for the mesh); kv_cache_per_row: keys and
    values of one sequence of `seq` tokens (its heads' share); total: params + one row's cache.
    """
    import jax

    from mesh_transformer import models, parallel
    from mesh_transformer.plan import shard_bytes

    dtype = np.dtype(dtype_name(dtype))
    mp = mesh.shape[parallel.MP]
    network = models.build(model, mp)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, dtype), network.abstract_params)
    params = shard_bytes(abstract, parallel.named(mesh, network.param_specs(network.rules(False, mp), abstract)))
    kv = 2 * model.layers * model.seq * (model.cache_heads(mp) // mp) * model.head_dim * dtype.itemsize
    return {"params": params, "kv_cache_per_row": kv, "total": params + kv}


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def cast(params, dtype: str):
    """Every floating leaf in `dtype`, one leaf at a time (each source leaf can be freed after)."""
    import jax.numpy as jnp

    dtype = jnp.dtype(dtype_name(dtype))
    return {module: {name: x if x.dtype == dtype else x.astype(dtype) for name, x in leaves.items()}
            for module, leaves in params.items()}


def save_params(params, config: Config, out: str, dtype: str, source: str) -> None:
    """Write `params` (our tree, any mesh) as a params-only checkpoint of ours at step 0, in `dtype`,
    with `config` and the tokenizer and generation config found beside `source`."""
    from mesh_transformer.io import mtj_v1

    if storage.exists(out) and storage.isdir(out) and storage.list_files(out):
        raise CheckpointError(f"{out}: exists and is not empty; choose a new output directory")
    params = cast(params, dtype)
    with CheckpointManager(out, config=config, async_save=False) as ckpt:
        ckpt.save(0, {"params": params}, extras={"converted_from": str(source)}, wait=True)
    step_dir = mtj_v1.find(source)
    copy_model_files(mtj_v1.tokenizer_dirs(step_dir) if step_dir is not None else [str(source).rstrip("/")], out)


def checkpoint_bytes(path: str, step: Optional[int] = None) -> int:
    """Bytes on storage of one step: a v1 step's pieces, or our `step_<N>/` directory."""
    from mesh_transformer.io import mtj_v1

    step_dir = mtj_v1.find(path, step)
    if step_dir is None:
        manager = CheckpointManager(path, read_only=True)
        step = manager.latest_step() if step is None else step
        if step is None or step not in manager.all_steps():
            raise CheckpointError(f"{path}: no complete checkpoint{'' if step is None else f' for step {step}'}")
        step_dir = manager.step_path(step)
    return sum(storage.size(f) for f in storage.list_files(step_dir))


def load_on_host(path: str, config: Config, dtype: str, step: Optional[int] = None):
    """Our params tree of any checkpoint, on one CPU device, in `dtype` (optimizer state never read)."""
    import jax

    from mesh_transformer import models, parallel
    from mesh_transformer.io import mtj_v1

    mesh = parallel.make_mesh(1, 1, jax.devices("cpu")[:1])
    step_dir = mtj_v1.find(path, step)
    if step_dir is not None:
        return mtj_v1.load_params(mtj_v1.V1Checkpoint(step_dir, config.model), mesh, dtype_name(dtype))
    network = models.build(config.model, 1)
    shardings = parallel.named(mesh, network.param_specs(network.rules(False, 1)))
    params = CheckpointManager(path, read_only=True).restore_params(
        step, abstract_params=network.abstract_params, target_shardings=shardings, check_config=False)
    return cast(params, dtype)


def slim(src: str, dst: str, config_path: Optional[str], dtype: str = "bf16",
         step: Optional[int] = None) -> tuple[int, int]:
    """Drop the optimizer state of `src` (ours or v1), cast its params to `dtype`, write them to `dst`.

    Returns (bytes of the source step, bytes written).
    """
    config = source_config(src, config_path)
    before = checkpoint_bytes(src, step)
    params = load_on_host(src, config, dtype, step)
    save_params(params, config, dst, dtype, src)
    return before, checkpoint_bytes(dst)

