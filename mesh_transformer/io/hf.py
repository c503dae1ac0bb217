"""HuggingFace GPT-J checkpoints <-> our parameters.

One table (`_LAYER_MAP`, `_GLOBAL_MAP`) says which HF tensor is which of ours and how it is laid
out. Import reads safetensors (or a pytorch_model.bin through torch's weights-only unpickler);
export writes sharded safetensors plus `config.json`, converting one tensor at a time, so host
memory holds at most one output shard besides the source parameters.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from mesh_transformer.config import ConfigError, ModelConfig
from mesh_transformer.io.tokenizer import TOKENIZER_FILES

ROOT = "gptj"

# ours (module, leaf) <- HF name; `to_ours` converts an HF array [torch layout] to our layout.
# Shapes: D d_model, N heads, H head dim, F d_ff, V vocab. torch Linear weights are [out, in].
_LAYER_MAP: list[tuple[str, str, str]] = [
    # (our module under gptj/layers, our leaf, HF name under transformer.h.{i})
    ("ln_1", "scale", "ln_1.weight"),
    ("ln_1", "offset", "ln_1.bias"),
    ("attn", "q_proj", "attn.q_proj.weight"),
    ("attn", "k_proj", "attn.k_proj.weight"),
    ("attn", "v_proj", "attn.v_proj.weight"),
    ("attn", "out_proj", "attn.out_proj.weight"),
    ("mlp", "fc_in", "mlp.fc_in.weight"),
    ("mlp", "fc_in_bias", "mlp.fc_in.bias"),
    ("mlp", "fc_out", "mlp.fc_out.weight"),
    ("mlp", "fc_out_bias", "mlp.fc_out.bias"),
]
_GLOBAL_MAP: list[tuple[str, str, str]] = [
    ("embed", "embeddings", "transformer.wte.weight"),
    ("ln_f", "scale", "transformer.ln_f.weight"),
    ("ln_f", "offset", "transformer.ln_f.bias"),
    ("head", "lm_head", "lm_head.weight"),
    ("head", "lm_head_bias", "lm_head.bias"),
]


def _to_ours(leaf: str, x: np.ndarray, c: ModelConfig) -> np.ndarray:
    n, h = c.n_heads, c.head_dim
    if leaf in ("q_proj", "k_proj", "v_proj"):  # [N*H, D] -> [D, N, H]
        return x.T.reshape(c.d_model, n, h)
    if leaf == "out_proj":  # [D, N*H] -> [N, H, D]
        return x.T.reshape(n, h, c.d_model)
    if leaf in ("fc_in", "fc_out", "lm_head"):  # torch [out, in] -> [in, out]
        return x.T
    return x


def _to_hf(leaf: str, x: np.ndarray, c: ModelConfig) -> np.ndarray:
    if leaf in ("q_proj", "k_proj", "v_proj"):  # [D, N, H] -> [N*H, D]
        return x.reshape(c.d_model, -1).T
    if leaf == "out_proj":  # [N, H, D] -> [D, N*H]
        return x.reshape(-1, c.d_model).T
    if leaf in ("fc_in", "fc_out", "lm_head"):
        return x.T
    return x


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------

def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """ModelConfig from a GPT-J `config.json` dict."""
    if hf.get("model_type", "gptj") != "gptj":
        raise ConfigError(f"config.json: model_type is {hf.get('model_type')!r}, expected 'gptj'")
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ConfigError(f"config.json: activation_function {act!r} is not supported (GPT-J uses 'gelu_new')")
    d, n = hf["n_embd"], hf["n_head"]
    return ModelConfig(
        layers=hf["n_layer"], d_model=d, n_heads=n, n_vocab=hf["vocab_size"], seq=hf.get("n_positions", 2048),
        d_ff=hf.get("n_inner") or 4 * d, pe="rotary", pe_rotary_dims=hf.get("rotary_dim") or d // n,
        layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5), **overrides)


def config_to_hf(c: ModelConfig, torch_dtype: str = "float32") -> dict:
    if c.pe != "rotary" or c.norm != "layernorm" or c.n_heads * c.head_dim != c.d_model:
        raise ConfigError("only GPT-J models (pe='rotary', norm='layernorm', n_heads*d_head == d_model) "
                          "can be exported to HF GPTJForCausalLM")
    return {
        "architectures": ["GPTJForCausalLM"], "model_type": "gptj", "activation_function": "gelu_new",
        "n_embd": c.d_model, "n_head": c.n_heads, "n_layer": c.layers, "n_inner": c.ff_dim,
        "n_positions": c.seq, "rotary_dim": c.rotary_dims, "vocab_size": c.n_vocab,
        "layer_norm_epsilon": c.layer_norm_eps, "tie_word_embeddings": False,
        "bos_token_id": min(50256, c.n_vocab - 1), "eos_token_id": min(50256, c.n_vocab - 1),
        "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0, "initializer_range": 0.02,
        "use_cache": True, "torch_dtype": torch_dtype,
    }


# --------------------------------------------------------------------------------------------
# Import
# --------------------------------------------------------------------------------------------

def _tensor_reader(path: Path) -> Callable[[str], np.ndarray]:
    """name -> float32 numpy array, reading only that tensor where the format allows."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.exists() or single.exists():
        from safetensors import safe_open
        files = ({k: path / v for k, v in json.loads(index.read_text())["weight_map"].items()}
                 if index.exists() else None)

        def read(name):
            file = files.get(name) if files is not None else single
            if file is None:
                raise KeyError(name)
            with safe_open(file, framework="numpy") as f:
                return np.asarray(f.get_tensor(name), dtype=np.float32)
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


def load_hf(path: str | os.PathLike, mp: int = 1, **overrides) -> tuple[ModelConfig, dict]:
    """Read a HF GPT-J directory -> (ModelConfig, params as numpy float32, vocab padded for `mp`)."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise ConfigError(f"{path}: no config.json (is this a HF model directory?)")
    config = config_from_hf(json.loads(config_file.read_text()), **overrides)
    read = _tensor_reader(path)

    def get(name, leaf):
        try:
            return _to_ours(leaf, read(name), config)
        except KeyError:
            raise ConfigError(f"{path}: tensor {name!r} is missing from the checkpoint") from None

    params: dict[str, dict[str, np.ndarray]] = {}
    for module, leaf, name in _LAYER_MAP:
        stacked = np.stack([get(f"transformer.h.{i}.{name}", leaf) for i in range(config.layers)])
        params.setdefault(f"{ROOT}/layers/{module}", {})[leaf] = stacked
    for module, leaf, name in _GLOBAL_MAP:
        params.setdefault(f"{ROOT}/{module}", {})[leaf] = get(name, leaf)
    return config, pad_vocab(params, config.padded_vocab(mp))


def pad_vocab(params: dict, padded: int) -> dict:
    """Zero-pad (or trim) the vocabulary axis of embedding and head to `padded` entries."""
    def fit(x, axis):
        size = x.shape[axis]
        if size >= padded:
            return np.take(x, np.arange(padded), axis=axis)
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, padded - size)
        return np.pad(x, pad)
    out = {k: dict(v) for k, v in params.items()}
    out[f"{ROOT}/embed"]["embeddings"] = fit(out[f"{ROOT}/embed"]["embeddings"], 0)
    out[f"{ROOT}/head"]["lm_head"] = fit(out[f"{ROOT}/head"]["lm_head"], 1)
    out[f"{ROOT}/head"]["lm_head_bias"] = fit(out[f"{ROOT}/head"]["lm_head_bias"], 0)
    return out


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------

_DTYPES = {"fp32": np.float32, "float32": np.float32, "fp16": np.float16, "float16": np.float16,
           "bf16": "bfloat16", "bfloat16": "bfloat16"}


def _hf_tensors(params, config: ModelConfig, dtype) -> Iterator[tuple[str, Callable[[], np.ndarray]]]:
    """(HF name, thunk producing that tensor) in file order; each thunk reads one slice of `params`."""
    v = config.n_vocab

    def convert(module, leaf, index=None, vocab_axis=None):
        def thunk():
            x = params[module][leaf]
            x = np.asarray(x[index] if index is not None else x, dtype=np.float32)
            if vocab_axis is not None:
                x = np.take(x, np.arange(v), axis=vocab_axis)
            return np.ascontiguousarray(_to_hf(leaf, x, config).astype(dtype))
        return thunk

    vocab_axes = {"embeddings": 0, "lm_head": 1, "lm_head_bias": 0}
    for module, leaf, name in _GLOBAL_MAP[:1]:
        yield name, convert(f"{ROOT}/{module}", leaf, vocab_axis=0)
    for i in range(config.layers):
        for module, leaf, name in _LAYER_MAP:
            yield f"transformer.h.{i}.{name}", convert(f"{ROOT}/layers/{module}", leaf, index=i)
    for module, leaf, name in _GLOBAL_MAP[1:]:
        yield name, convert(f"{ROOT}/{module}", leaf, vocab_axis=vocab_axes.get(leaf))


def save_hf(params, config: ModelConfig, path: str | os.PathLike, dtype: str = "fp32",
            max_shard_bytes: int = 2 << 30) -> Path:
    """Write `params` as a HF GPT-J directory (config.json + sharded safetensors + index).

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
    """Import a HF GPT-J directory as a params-only checkpoint (step 0) with its config and tokenizer.

    `train`: the TrainConfig to record beside the model (defaults otherwise). Returns the parameter count.
    """
    import jax
    from mesh_transformer.io import storage
    from mesh_transformer.io.checkpoint import CheckpointManager
    from mesh_transformer.config import Config, TrainConfig

    model_config, params = load_hf(hf_dir)
    config = Config(model_config, train or TrainConfig())
    cpu = jax.devices("cpu")[0]
    params = jax.tree.map(lambda x: jax.device_put(x, cpu), params)
    with CheckpointManager(ckpt_dir, config=config, async_save=False) as ckpt:
        ckpt.save(0, {"params": params}, extras={"imported_from": str(hf_dir)}, wait=True)
    for name in TOKENIZER_FILES:
        source = Path(hf_dir) / name
        if source.exists():
            storage.write_bytes(storage.join(ckpt_dir, name), source.read_bytes())
    return model_config.n_params()


def checkpoint_to_hf(ckpt_dir: str, out_dir: str, dtype: str = "fp16", step=None, max_shard_bytes: int = 2 << 30) -> Path:
    """Export the params of a checkpoint (latest step by default) as a HF GPT-J directory.

    Parameters are restored unsharded on the host CPU once, then written tensor by tensor.
    """
    import jax
    from jax.sharding import SingleDeviceSharding
    from mesh_transformer.models import core as gptj
    from mesh_transformer.io import storage
    from mesh_transformer.io.checkpoint import CheckpointError, CheckpointManager
    from mesh_transformer.config import config_from_dict

    ckpt = CheckpointManager(ckpt_dir, read_only=True)
    saved = ckpt.saved_config(step)
    if saved is None:
        raise CheckpointError(f"{ckpt_dir}: the checkpoint holds no config; cannot tell the model's shape")
    config = config_from_dict(saved).model
    cpu = SingleDeviceSharding(jax.devices("cpu")[0])
    abstract = jax.eval_shape(lambda: gptj.build(config).init(jax.random.key(0), jax.numpy.zeros((1, 1), "int32")))
    params = ckpt.restore_params(step, abstract_params=abstract, target_shardings=jax.tree.map(lambda _: cpu, abstract),
                                 check_config=False)
    out = save_hf(params, config, out_dir, dtype=dtype, max_shard_bytes=max_shard_bytes)
    for name in TOKENIZER_FILES:
        source = storage.join(ckpt_dir, name)
        if storage.exists(source):
            (out / name).write_bytes(storage.read_bytes(source))
    return out
