"""Read checkpoints of the original mesh-transformer-jax ("v1"; the released GPT-J-6B uses it).

    step_dir = mtj_v1.find("gs://bucket/gptj/step_383500")     # or a model dir whose meta.json names a step
    ckpt = mtj_v1.V1Checkpoint(step_dir, mtj_v1.load_config("configs/6B_roto_256.json").model)
    params = mtj_v1.load_params(ckpt, mesh, "bfloat16")             # our GPT-J tree, on the mesh (any dp x mp)
    mtj_v1.export_hf(ckpt, "./gpt-j-hf", "fp16")                              # leaf by leaf, any size

Layout (../shared/reference/mtj-v1-format.md): `step_N/shard_{s}/{i}.npz`, s = 0..mp-1, i = 0..15. Each
shard holds its slice of every leaf of the original's train state, flattened in jax's order (sorted dict
keys: opt_state, params, step; modules sorted as strings, so layer_1 < layer_10 < layer_2) and cut into 16
contiguous pieces, written with `np.savez` (members arr_0, arr_1, ...). A slim checkpoint holds P + 1
leaves per shard (params in bf16 or fp16, step), a full one 3P + 3 (Adam count, mu, nu, schedule count,
float32 params, step), P = 10 L + 6. bf16 is stored as 2-byte void ('V2') and relabelled here.

How shards combine into one leaf: q/k/v/fc_in and the head are split by output columns, out_proj and
fc_out by input rows, the embedding by vocabulary rows (`_SPLIT`); fc_out's bias and the embedding's
bias are per-shard terms of a psum, so the model uses their sum (`_SUM`); each shard keeps a LayerNorm
copy but only shard 0's is used (`_FIRST`). The embedding bias has no counterpart in GPT-J as HF (or
we) define it: it is added to every row of the embedding table.

Memory: pieces are read member by member (one leaf of one shard at a time); each leaf is built in
the target dtype and goes to the mesh (or the output file) as soon as it is whole, so the host holds
the leaf being built plus one shard's part of it, never the model. Layer-stacked leaves are written
into their device buffers one layer at a time, vocabulary-sized ones one shard's part at a time (and
so is the HF export wherever a part is a block of rows). Optimizer moments are read only when asked for.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
import zipfile
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from mesh_transformer.config import Config, ConfigError, ModelConfig, TrainConfig, config_from_dict
from mesh_transformer.io import storage
from mesh_transformer.io.checkpoint import CheckpointError
from mesh_transformer.io.tokenizer import copy_model_files

PIECES = 16  # files per shard (the original's checkpoint.py)
ROOT = "causal_transformer_shard/~/"
META = "meta.json"

# How a leaf's per-shard copies make the whole leaf: concatenated along `Kind.axis`; summed (psum
# terms); shard 0's (replicated LayerNorm copies, of which only shard 0's is used).
_SPLIT, _SUM, _FIRST = "split", "sum", "first"


@dataclass(frozen=True)
class Kind:
    """One of the original's parameters: where it lives in our tree and how its shards combine.

    `whole`: its shape with all shards combined, in the original's layout (hk.Linear w is [in, out]),
    as a function of (D, F, V).
    """

    v1: str  # under causal_transformer_shard/~/ (layers: under layer_i/~/)
    module: str  # ours, under gptj/ (layers: under gptj/layers/)
    leaf: str  # ours ("bias" of embed: folded into the embeddings)
    combine: str  # _SPLIT, _SUM or _FIRST
    whole: str  # axes letters of the combined shape, D d_model, F d_ff, V vocab
    axis: int = 0  # the axis _SPLIT concatenates along


_LAYER_KINDS = [
    Kind("linear/w", "attn", "q_proj", _SPLIT, "DD", 1),
    Kind("linear_1/w", "attn", "v_proj", _SPLIT, "DD", 1),
    Kind("linear_2/w", "attn", "k_proj", _SPLIT, "DD", 1),
    Kind("linear_3/w", "attn", "out_proj", _SPLIT, "DD", 0),
    Kind("linear_4/b", "mlp", "fc_in_bias", _SPLIT, "F", 0),
    Kind("linear_4/w", "mlp", "fc_in", _SPLIT, "DF", 1),
    Kind("linear_5/b", "mlp", "fc_out_bias", _SUM, "D"),
    Kind("linear_5/w", "mlp", "fc_out", _SPLIT, "FD", 0),
    Kind("replicated_layer_norm/offset", "ln_1", "offset", _FIRST, "D"),
    Kind("replicated_layer_norm/scale", "ln_1", "scale", _FIRST, "D"),
]
_GLOBAL_KINDS = [
    Kind("embedding_shard/~/linear/b", "embed", "bias", _SUM, "D"),
    Kind("embedding_shard/~/linear/w", "embed", "embeddings", _SPLIT, "VD", 0),
    Kind("projection_shard/~/linear/b", "head", "lm_head_bias", _SPLIT, "V", 0),
    Kind("projection_shard/~/linear/w", "head", "lm_head", _SPLIT, "DV", 1),
    Kind("projection_shard/~/replicated_layer_norm/offset", "ln_f", "offset", _FIRST, "D"),
    Kind("projection_shard/~/replicated_layer_norm/scale", "ln_f", "scale", _FIRST, "D"),
]
EMBED_BIAS = ("embed", "bias")


@dataclass(frozen=True)
class Leaf:
    """One flattened leaf of the original's train state, in file order."""

    name: str  # e.g. "params/causal_transformer_shard/~/layer_3/~/linear_4/w", "opt_state/adam/count"
    section: str  # "params", "mu", "nu" (Adam moments, shaped like params) or "scalar"
    kind: Optional[Kind] = None
    layer: Optional[int] = None


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------

FAMILY = "gptj"  # the original's only model


def _model_keys() -> set[str]:
    from mesh_transformer import models
    return {f.name for f in dataclasses.fields(models.config_class(FAMILY))}


def load_config(path: Optional[str], checkpoint: str = "the checkpoint") -> Config:
    """The model keys of an original JSON config (local or gs://); training keys are not checked.

    `train` keeps only what the config's training keys give when they are valid here (else defaults).
    """
    if not path:
        raise ConfigError(f"{checkpoint} is a mesh-transformer-jax v1 checkpoint, which does not record the "
                          "model's shape: pass --config with the JSON config it was trained with "
                          "(e.g. configs/6B_roto_256.json for GPT-J-6B)")
    try:
        raw = json.loads(storage.read_text(path))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a config must be a JSON object")
    if raw.get("family", FAMILY) != FAMILY:
        raise ConfigError(f"{path}: config key 'family': v1 checkpoints hold {FAMILY!r} models, got {raw['family']!r}")
    try:
        model = config_from_dict({k: v for k, v in raw.items() if k in _model_keys()}).model
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    _check_v1_model(model, path)
    return Config(model, _train_keys(raw))


def _train_keys(raw: dict) -> TrainConfig:
    """The config's training keys when they are all valid here, else only where the checkpoints live
    and the shard count (what the tools need)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the original's keys we ignore: not this reader's business
        try:
            return config_from_dict(raw).train
        except ConfigError:
            pass
    kept = {k: raw[k] for k, t in (("cores_per_replica", int), ("bucket", str), ("model_dir", str))
            if isinstance(raw.get(k), t) and not isinstance(raw.get(k), bool)}
    if kept.get("cores_per_replica", 1) < 1:
        kept.pop("cores_per_replica")
    return TrainConfig(**kept)


def _check_v1_model(m: ModelConfig, path: str) -> None:
    """The original's GPT-J layers: LayerNorm, rotary, d_head = d_model / n_heads, d_ff = 4 d_model."""
    if m.norm != "layernorm":
        raise ConfigError(f"{path}: config key 'norm': only 'layernorm' v1 checkpoints can be read, got {m.norm!r}")
    if m.pe != "rotary":
        raise ConfigError(f"{path}: config key 'pe': only 'rotary' v1 checkpoints can be read, got {m.pe!r}")
    if m.head_dim * m.n_heads != m.d_model:
        raise ConfigError(f"{path}: config key 'd_head': the original's layers use d_model / n_heads = "
                          f"{m.d_model // m.n_heads}, got {m.head_dim}")
    if m.ff_dim != 4 * m.d_model:
        raise ConfigError(f"{path}: config key 'd_ff': the original's layers use 4 * d_model = {4 * m.d_model}, "
                          f"got {m.ff_dim}")


# --------------------------------------------------------------------------------------------
# Finding a checkpoint
# --------------------------------------------------------------------------------------------

def _shard_piece(step_dir: str, shard: int, piece: int) -> str:
    return storage.join(step_dir, f"shard_{shard}", f"{piece}.npz")


def find(path: str, step: Optional[int] = None) -> Optional[str]:
    """The v1 step directory `path` names, or None when `path` is not a v1 checkpoint.

    `path`: a step directory (…/step_N, holding shard_0/0.npz) or a model directory whose meta.json
    lists its checkpoints (the latest is taken, or `step`).
    """
    path = str(path).rstrip("/")
    if storage.exists(_shard_piece(path, 0, 0)) or any(
            storage.isdir(storage.join(path, f"shard_{s}")) for s in (0, 1)):  # incomplete ones too: say what is missing
        return path
    meta_path = storage.join(path, META)
    if not storage.exists(meta_path):
        return None
    try:
        meta = json.loads(storage.read_text(meta_path))
        steps = [int(s) for s in meta["checkpoints"]]
    except (ValueError, KeyError, TypeError):
        return None  # some other meta.json
    if step is None:
        if not steps:
            raise CheckpointError(f"{meta_path}: lists no checkpoints")
        step = steps[-1]
    step_dir = storage.join(path, f"step_{step}")
    if not storage.exists(_shard_piece(step_dir, 0, 0)):
        raise CheckpointError(f"{step_dir}/shard_0/0.npz: missing (the step {meta_path} names"
                              f"{'' if step in steps else ' was asked for but is not listed there'}; "
                              f"listed: {steps})")
    return step_dir


def _count_shards(step_dir: str) -> int:
    if storage.is_gcs(step_dir):
        names = {f[len(step_dir) + 1:].split("/")[0] for f in storage.list_files(step_dir)}
    else:
        names = set(os.listdir(step_dir))
    found = sorted(int(m.group(1)) for n in names if (m := re.fullmatch(r"shard_(\d+)", n)))
    missing = sorted(set(range(max(found) + 1)) - set(found))
    if missing:
        raise CheckpointError(f"{step_dir}: shard_{missing[0]} is missing (found shard_{', shard_'.join(map(str, found))})")
    return len(found)


# --------------------------------------------------------------------------------------------
# The flattened layout
# --------------------------------------------------------------------------------------------

def param_leaves(layers: int, section: str = "params") -> list[Leaf]:
    """The P = 10 L + 6 parameter leaves in jax's flattening order (modules sorted as strings)."""
    named = [(ROOT + k.v1, k, None) for k in _GLOBAL_KINDS]
    named += [(f"{ROOT}layer_{i}/~/{k.v1}", k, i) for i in range(layers) for k in _LAYER_KINDS]
    named.sort(key=lambda n: tuple(n[0].rsplit("/", 1)))  # (module, param), as haiku's params dict flattens
    return [Leaf(f"{section}/{name}", section, kind, layer) for name, kind, layer in named]


def layout(layers: int, full: bool) -> list[Leaf]:
    """Every leaf of a shard: slim = params + step; full = Adam count, mu, nu, schedule count, params, step."""
    params = param_leaves(layers) + [Leaf("step", "scalar")]
    if not full:
        return params
    return ([Leaf("opt_state/adam/count", "scalar")] + param_leaves(layers, "mu") + param_leaves(layers, "nu")
            + [Leaf("opt_state/schedule/count", "scalar")] + params)


def piece_bounds(n_leaves: int) -> list[tuple[int, int]]:
    """[start, stop) of each of the 16 pieces: the first n % 16 pieces hold one leaf more."""
    k, m = divmod(n_leaves, PIECES)
    return [(i * k + min(i, m), (i + 1) * k + min(i + 1, m)) for i in range(PIECES)]


def _dims(m: ModelConfig) -> dict[str, int]:
    return {"D": m.d_model, "F": m.ff_dim, "V": m.n_vocab}


def whole_shape(kind: Kind, m: ModelConfig) -> tuple[int, ...]:
    dims = _dims(m)
    return tuple(dims[a] for a in kind.whole)


def shard_shape(kind: Kind, m: ModelConfig, shards: int) -> tuple[int, ...]:
    shape = list(whole_shape(kind, m))
    if kind.combine == _SPLIT:
        shape[kind.axis] //= shards
    return tuple(shape)


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------

def _as_numeric(x: np.ndarray) -> np.ndarray:
    """bf16 comes back from np.load as 2-byte void ('V2'): relabel it (no copy)."""
    if x.dtype == np.dtype("V2"):
        import ml_dtypes
        return x.view(ml_dtypes.bfloat16)
    return x


_VOCAB_LEAVES = ("embeddings", "lm_head", "lm_head_bias")
_CHUNK_BYTES = 16 << 20  # rows converted at a time when a bias is added


def _along(x: np.ndarray, axis: int, start: int, stop: int) -> np.ndarray:
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, stop)
    return x[tuple(index)]


def _converted(part: np.ndarray, dtype, row_bias: Optional[np.ndarray]) -> np.ndarray:
    """part in `dtype` (+ row_bias on every row, added in float32 a few MB of rows at a time)."""
    if row_bias is None:
        return part.astype(dtype, copy=False)
    out = np.empty(part.shape, dtype)
    rows = max(1, _CHUNK_BYTES // max(1, part[0].size * 4))
    for a in range(0, len(part), rows):
        out[a:a + rows] = part[a:a + rows].astype(np.float32) + row_bias
    return out


def padded_shape(kind: "Kind", m: ModelConfig, padded_vocab: Optional[int]) -> tuple[int, ...]:
    """The whole shape, its vocabulary axis (the split axis of vocabulary leaves) padded."""
    shape = list(whole_shape(kind, m))
    if padded_vocab is not None and kind.leaf in _VOCAB_LEAVES:
        shape[kind.axis] = padded_vocab
    return tuple(shape)


class V1Checkpoint:
    """A v1 step directory, checked against a model config before any array is read.

    Opening lists the shards, opens every piece's zip directory and compares its member count with
    the layout the config implies (slim or full), so a missing or truncated piece, or a config with
    another layer count, is a CheckpointError before anything is written.
    """

    def __init__(self, step_dir: str, model: ModelConfig):
        self.step_dir, self.model = str(step_dir).rstrip("/"), model
        self.shards = _count_shards(self.step_dir)
        for key, size in (("n_vocab", model.n_vocab), ("n_heads", model.n_heads)):
            if size % self.shards:
                raise CheckpointError(f"{self.step_dir}: has {self.shards} shards, but config key {key!r} = {size} "
                                      f"does not split over {self.shards} (is the config the one it was trained with?)")
        counts = [[self._member_count(s, i) for i in range(PIECES)] for s in range(self.shards)]
        self.full = self._slim_or_full(counts[0])
        for s, row in enumerate(counts[1:], 1):
            if row != counts[0]:
                i = next(i for i in range(PIECES) if row[i] != counts[0][i])
                raise CheckpointError(f"{_shard_piece(self.step_dir, s, i)}: holds {row[i]} arrays, but "
                                      f"shard_0/{i}.npz holds {counts[0][i]}")
        self.leaves = layout(model.layers, self.full)
        self.pieces = piece_bounds(len(self.leaves))

    @property
    def step(self) -> Optional[int]:
        match = re.search(r"step_(\d+)$", self.step_dir)
        return int(match.group(1)) if match else None

    def _member_count(self, shard: int, piece: int) -> int:
        path = _shard_piece(self.step_dir, shard, piece)
        with self._open(path) as npz:
            return len(npz.files)

    @contextlib.contextmanager
    def _open(self, path: str):
        """np.load of one piece (lazy: members are read when indexed)."""
        try:
            f = storage.open(path, "rb")
        except (FileNotFoundError, OSError) as e:
            if not storage.exists(path):
                raise CheckpointError(f"{path}: missing (a v1 checkpoint has {PIECES} pieces, 0.npz .. "
                                      f"{PIECES - 1}.npz, in every shard_N/)") from None
            raise CheckpointError(f"{path}: cannot open: {e}") from None
        try:
            try:
                npz = np.load(f, allow_pickle=False)
            except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
                raise CheckpointError(f"{path}: not a readable .npz (truncated or corrupted?): {e}") from None
            with npz:
                yield npz
        finally:
            f.close()

    def _slim_or_full(self, counts: Sequence[int]) -> bool:
        total, p = sum(counts), 10 * self.model.layers + 6
        for full in (False, True):
            n = len(layout(self.model.layers, full))
            if total == n and list(counts) == [b - a for a, b in piece_bounds(n)]:
                return full
        raise CheckpointError(
            f"{self.step_dir}/shard_0: holds {total} arrays in pieces of {list(counts)}, but a "
            f"{self.model.layers}-layer model's slim checkpoint has {p + 1} and its full one {3 * p + 3}: "
            f"does config key 'layers' match the checkpoint?")

    # ---- streaming --------------------------------------------------------------------------

    def stream(self, sections: Sequence[str] = ("params",), dtype=np.float32, padded_vocab: Optional[int] = None,
               whole: Callable[[Leaf], bool] = lambda leaf: True) -> Iterator[tuple[Leaf, np.ndarray]]:
        """(leaf, whole array in the original's layout, params in `dtype`, moments in float32) for every leaf of `sections`, in file order.

        The embedding bias is not yielded: it is added to every row of the embedding table (in
        float32; it arrives first, 'b' < 'w'). The moments' embedding bias has no counterpart and is
        dropped. Vocabulary axes are zero-padded to `padded_vocab` when given. Adam moments of summed
        leaves are per-shard copies (each shard's term gets the whole gradient): shard 0's is taken.
        Each array is built in place from one shard's part at a time. Leaves for which `whole(leaf)` is
        false come as an iterator of parts instead (see `_parts`; not padded), to be consumed at once.
        """
        embed_bias: Optional[np.ndarray] = None
        for piece, (start, stop) in enumerate(self.pieces):
            wanted = [(j - start, leaf) for j, leaf in enumerate(self.leaves[start:stop], start)
                      if leaf.section in sections]
            if not wanted:
                continue
            with contextlib.ExitStack() as stack:
                files = [stack.enter_context(self._open(_shard_piece(self.step_dir, s, piece)))
                         for s in range(self.shards)]
                for member, leaf in wanted:
                    if (leaf.kind.module, leaf.kind.leaf) == EMBED_BIAS:
                        if leaf.section == "params":
                            embed_bias = next(self._parts(leaf, files, member, piece, np.float32))[1]
                        continue
                    params = leaf.section == "params"
                    row_bias = embed_bias if leaf.kind.leaf == "embeddings" and params else None
                    leaf_dtype = dtype if params else np.float32
                    parts = self._parts(leaf, files, member, piece, leaf_dtype, row_bias)
                    yield leaf, (self._combine(leaf, parts, leaf_dtype, padded_vocab) if whole(leaf) else parts)

    def scalar(self, name: str) -> int:
        """A 0-d leaf of shard 0 ("step", "opt_state/adam/count")."""
        j = next(j for j, leaf in enumerate(self.leaves) if leaf.name == name)
        piece = next(i for i, (a, b) in enumerate(self.pieces) if a <= j < b)
        with self._open(_shard_piece(self.step_dir, 0, piece)) as npz:
            return int(self._member(npz, j - self.pieces[piece][0], piece, 0, Leaf(name, "scalar"), ()))

    def _member(self, npz, member: int, piece: int, shard: int, leaf: Leaf, shape) -> np.ndarray:
        path = _shard_piece(self.step_dir, shard, piece)
        try:
            x = _as_numeric(npz[f"arr_{member}"])
        except (KeyError, ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
            raise CheckpointError(f"{path}: cannot read arr_{member} ({leaf.name}): {e}") from None
        if tuple(x.shape) != tuple(shape):
            raise CheckpointError(f"{path}: {leaf.name} (arr_{member}) of shard {shard} has shape {tuple(x.shape)}, "
                                  f"but the config gives {tuple(shape)} per shard ({self.shards} shards): "
                                  f"does --config match the checkpoint?")
        return x

    def _parts(self, leaf: Leaf, files, member: int, piece: int, dtype,
               row_bias: Optional[np.ndarray] = None) -> Iterator[tuple[int, np.ndarray]]:
        """(offset along `leaf.kind.axis`, part in `dtype`) of a leaf, one shard's part at a time;
        summed and first-copy leaves come as one part at offset 0."""
        kind = leaf.kind
        per_shard = shard_shape(kind, self.model, self.shards)
        combine = _FIRST if leaf.section != "params" and kind.combine == _SUM else kind.combine
        if combine == _FIRST:
            yield 0, self._member(files[0], member, piece, 0, leaf, per_shard).astype(dtype)
        elif combine == _SUM:
            total = np.zeros(per_shard, np.float32)
            for s, npz in enumerate(files):
                total += self._member(npz, member, piece, s, leaf, per_shard)
            yield 0, total.astype(dtype, copy=False)
        else:
            for s, npz in enumerate(files):
                part = self._member(npz, member, piece, s, leaf, per_shard)
                yield s * per_shard[kind.axis], _converted(part, dtype, row_bias)
                del part

    def _combine(self, leaf: Leaf, parts: Iterator[tuple[int, np.ndarray]], dtype,
                 padded_vocab: Optional[int] = None) -> np.ndarray:
        """The whole leaf from its parts (vocabulary axis zero-padded to `padded_vocab`)."""
        kind = leaf.kind
        if kind.combine != _SPLIT:
            return next(parts)[1]
        shape = padded_shape(kind, self.model, padded_vocab)
        out = np.empty(shape, dtype)
        for start, part in parts:
            _along(out, kind.axis, start, start + part.shape[kind.axis])[...] = part
            del part
        if kind.leaf in _VOCAB_LEAVES:
            _along(out, kind.axis, self.model.n_vocab, shape[kind.axis])[...] = 0  # the padding
        return out

    def nbytes(self) -> int:
        """Bytes of all pieces (the checkpoint's size on disk)."""
        return sum(storage.size(_shard_piece(self.step_dir, s, i)) for s in range(self.shards) for i in range(PIECES))


def open_checkpoint(path: str, config_path: Optional[str], step: Optional[int] = None) -> tuple[V1Checkpoint, Config]:
    """(checkpoint, config) of a v1 step or model directory; `config_path` is required."""
    step_dir = find(path, step)
    if step_dir is None:
        raise CheckpointError(f"{path}: not a mesh-transformer-jax v1 checkpoint (no shard_0/0.npz, no meta.json)")
    config = load_config(config_path, path)
    return V1Checkpoint(step_dir, config.model), config


# --------------------------------------------------------------------------------------------
# Our layout
# --------------------------------------------------------------------------------------------

def our_module(kind: Kind, layer: Optional[int]) -> str:
    """Our module of a leaf: "gptj/layers/attn" (layer-stacked) or "gptj/embed"."""
    return f"{FAMILY}/layers/{kind.module}" if layer is not None else f"{FAMILY}/{kind.module}"


def to_ours(kind: Kind, x: np.ndarray, m: ModelConfig) -> np.ndarray:
    """A combined leaf in the original's layout -> ours (vocabulary not yet padded)."""
    if kind.leaf in ("q_proj", "k_proj", "v_proj"):  # [D, N*H] -> [D, N, H]
        return x.reshape(m.d_model, m.n_heads, m.head_dim)
    if kind.leaf == "out_proj":  # [N*H, D] -> [N, H, D]
        return x.reshape(m.n_heads, m.head_dim, m.d_model)
    return x


# --------------------------------------------------------------------------------------------
# Onto a mesh
# --------------------------------------------------------------------------------------------

class _TreeOnMesh:
    """A params-shaped tree filled one leaf (or one layer of a layer-stacked leaf) at a time.

    A stacked leaf [L, ...] is allocated on the devices and each layer written into it in place
    (donated), so neither the host nor the devices ever hold a second copy of it.
    """

    def __init__(self, abstract, shardings, dtype, what: str):
        self.abstract, self.shardings, self.dtype, self.what = abstract, shardings, np.dtype(dtype), what
        self.out: dict = {module: {} for module in abstract}
        self.layers_done: dict = {}

    def put(self, module: str, leaf: str, x: np.ndarray, layer: Optional[int]) -> None:
        import jax

        try:
            target, sharding = self.abstract[module][leaf], self.shardings[module][leaf]
        except KeyError:
            raise CheckpointError(f"{self.what}: {module}/{leaf} has no place in the model") from None
        want = tuple(target.shape[1:] if layer is not None else target.shape)
        if tuple(x.shape) != want:
            raise CheckpointError(f"{self.what}: {module}/{leaf} is {tuple(x.shape)}, the model needs {want}")
        x = x.astype(self.dtype, copy=False)
        if layer is None:
            self.out[module][leaf] = jax.device_put(x, sharding)
            return
        buf = self.out[module].get(leaf)
        if buf is None:
            buf = _zeros(tuple(target.shape), self.dtype, sharding)
        row = jax.device_put(x, _drop_leading_axis(sharding))
        self.out[module][leaf] = _set_layer(buf, row, np.int32(layer))
        self.layers_done.setdefault((module, leaf), set()).add(layer)

    def put_parts(self, module: str, leaf: str, parts: Iterator[tuple[int, np.ndarray]], axis: int) -> None:
        """A (not layer-stacked) leaf from its parts along `axis`, each written into the leaf's device
        buffer in place as it comes; the rest (vocabulary padding) stays zero."""
        import jax
        from jax.sharding import NamedSharding, PartitionSpec as P

        target, sharding = self.abstract[module][leaf], self.shardings[module][leaf]
        buf = _zeros(tuple(target.shape), self.dtype, sharding)
        for start, part in parts:
            if part.ndim != target.ndim or start + part.shape[axis] > target.shape[axis] or any(
                    p != t for i, (p, t) in enumerate(zip(part.shape, target.shape)) if i != axis):
                raise CheckpointError(f"{self.what}: {module}/{leaf}: a part {tuple(part.shape)} at {start} "
                                      f"does not fit {tuple(target.shape)}")
            row = jax.device_put(part.astype(self.dtype, copy=False), NamedSharding(sharding.mesh, P()))
            buf = _set_slice_fn(axis)(buf, row, np.int32(start))
            del part, row
            _trim_host_heap()
        self.out[module][leaf] = buf

    def result(self):
        for module, leaves in self.abstract.items():
            for leaf, target in leaves.items():
                if leaf not in self.out[module]:
                    raise CheckpointError(f"{self.what}: {module}/{leaf} was not found")
                done = self.layers_done.get((module, leaf))
                if done is not None and len(done) != target.shape[0]:
                    missing = sorted(set(range(target.shape[0])) - done)
                    raise CheckpointError(f"{self.what}: {module}/{leaf} of layer {missing[0]} was not found")
        return self.out


def _drop_leading_axis(sharding):
    from jax.sharding import NamedSharding, PartitionSpec as P
    return NamedSharding(sharding.mesh, P(*tuple(sharding.spec)[1:]))


@functools.lru_cache(maxsize=64)
def _zeros_fn(shape, dtype, sharding):
    import jax
    import jax.numpy as jnp
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def _zeros(shape, dtype, sharding):
    return _zeros_fn(shape, np.dtype(dtype), sharding)()


@functools.cache
def _set_layer_fn():
    import jax
    return jax.jit(lambda buf, row, i: jax.lax.dynamic_update_index_in_dim(buf, row, i, 0), donate_argnums=0)


@functools.cache
def _set_slice_fn(axis: int):
    import jax
    return jax.jit(lambda buf, part, start: jax.lax.dynamic_update_slice_in_dim(buf, part, start, axis),
                   donate_argnums=0)


def _set_layer(buf, row, i):
    return _set_layer_fn()(buf, row, i)


def load_params(ckpt: V1Checkpoint, mesh, dtype="float32", moments: bool = False, zero: bool = False):
    """Our params tree (and, with `moments`, Adam's mu and nu trees, float32) placed on `mesh` by the
    model's partition table (ZeRO's with `zero`).

    Returns params, or (params, mu, nu) with `moments` (a full checkpoint is needed for those).
    """
    from mesh_transformer import models, parallel

    if moments and not ckpt.full:
        raise CheckpointError(f"{ckpt.step_dir}: a slim checkpoint holds no optimizer state")
    mp = mesh.shape[parallel.MP]
    model = models.build(ckpt.model, mp)
    abstract = model.abstract_params
    shardings = parallel.named(mesh, model.param_specs(model.rules(zero, mp)))
    sections = ("mu", "nu", "params") if moments else ("params",)
    trees = {s: _TreeOnMesh(abstract, shardings, dtype if s == "params" else np.float32, f"{ckpt.step_dir} ({s})")
             for s in sections}

    def whole(leaf: Leaf) -> bool:  # vocabulary-sized leaves go to the devices one shard's part at a time
        return leaf.layer is not None or leaf.kind.combine != _SPLIT

    for leaf, x in ckpt.stream(sections, dtype, ckpt.model.padded_vocab(mp), whole):
        module, tree = our_module(leaf.kind, leaf.layer), trees[leaf.section]
        if whole(leaf):
            tree.put(module, leaf.kind.leaf, to_ours(leaf.kind, x, ckpt.model), leaf.layer)
        else:
            tree.put_parts(module, leaf.kind.leaf, x, leaf.kind.axis)
        del x
        _trim_host_heap()
    if not moments:
        return trees["params"].result()
    return trees["params"].result(), trees["mu"].result(), trees["nu"].result()


@functools.cache
def _libc_malloc_trim():
    import ctypes
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to do
        return None


def _trim_host_heap() -> None:
    """Give freed leaf buffers back to the OS. Parts of a few tens of MB come from glibc's heap (its
    mmap threshold grows to 32 MB once such a buffer is freed), which keeps them resident otherwise
    (measured: 80 MB more at the head of a 0.8 GB model, a tenth of it)."""
    trim = _libc_malloc_trim()
    if trim is not None:
        trim(0)


def train_state(ckpt: V1Checkpoint, trainer, moments: bool):
    """A TrainState at step 0 for `trainer` (fine-tuning): the checkpoint's params and, with `moments`,
    its Adam moments and Adam step count (the bias correction goes on from there); else a fresh optimizer."""
    import jax
    import optax
    from mesh_transformer.train.step import TrainState

    if not moments:
        return trainer.state_from_params(load_params(ckpt, trainer.mesh, np.float32, zero=trainer.config.train.zero))
    params, mu, nu = load_params(ckpt, trainer.mesh, np.float32, moments=True, zero=trainer.config.train.zero)
    count = ckpt.scalar("opt_state/adam/count")
    shardings = trainer.state_shardings.opt_state
    opt_state = []
    for abstract, sharding in zip(trainer.abstract_state.opt_state, shardings):
        if isinstance(abstract, optax.ScaleByAdamState):
            opt_state.append(optax.ScaleByAdamState(jax.device_put(np.int32(count), sharding.count), mu, nu))
        elif jax.tree.leaves(abstract):
            raise CheckpointError(f"{ckpt.step_dir}: the optimizer's {type(abstract).__name__} has state "
                                  "a v1 checkpoint does not hold; use --fresh-opt")
        else:
            opt_state.append(abstract)
    step = jax.device_put(np.int32(0), trainer.state_shardings.step)
    return TrainState(step, params, type(trainer.abstract_state.opt_state)(opt_state))


# --------------------------------------------------------------------------------------------
# To Hugging Face, leaf by leaf
# --------------------------------------------------------------------------------------------

_SAFETENSORS_DTYPES = {"fp32": ("F32", np.float32, "float32"), "fp16": ("F16", np.float16, "float16"),
                       "bf16": ("BF16", "bfloat16", "bfloat16")}


_HF_SHAPES = {"embeddings": "VD", "lm_head": "VD", "lm_head_bias": "V", "q_proj": "DD", "k_proj": "DD",
              "v_proj": "DD", "out_proj": "DD", "fc_in": "FD", "fc_in_bias": "F", "fc_out": "DF",
              "fc_out_bias": "D", "scale": "D", "offset": "D"}  # GPTJForCausalLM's tensors, by our leaf


def _hf_table(m: ModelConfig):
    from mesh_transformer import models
    return models.family(FAMILY).hf_table(m)


def _hf_plan(m: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor of GPTJForCausalLM, in the family table's order (layers expanded)."""
    dims = _dims(m)
    table = _hf_table(m)
    first = next(k for k, p in enumerate(table) if p.per_layer)
    last = max(k for k, p in enumerate(table) if p.per_layer)

    def shape(p):
        return tuple(dims[a] for a in _HF_SHAPES[p.ours[0][1]])
    plan = [(p.hf, shape(p)) for p in table[:first]]
    plan += [(p.hf.format(i=i), shape(p)) for i in range(m.layers) for p in table[first:last + 1]]
    return plan + [(p.hf, shape(p)) for p in table[last + 1:]]


def _hf_entry(m: ModelConfig, module: str, leaf: str, layer: Optional[int]):
    """(HF name, table entry) of our leaf `module`/`leaf` ("gptj/layers/attn", "q_proj") of `layer`."""
    under_root = module.split("/", 1)[1]
    entry = next(p for p in _hf_table(m) if p.ours[0] == (under_root, leaf))
    return (entry.hf.format(i=layer) if entry.per_layer else entry.hf), entry


class SafetensorsWriter:
    """safetensors files whose tensors may arrive in any order: headers are written first (the plan
    fixes every offset), each tensor is written at its offset when it comes, one in memory at a time."""

    def __init__(self, directory: str, plan: list[tuple[str, tuple[int, ...]]], dtype: str,
                 max_shard_bytes: int = 2 << 30):
        self.code, np_dtype, _ = _SAFETENSORS_DTYPES[dtype]
        if np_dtype == "bfloat16":
            import ml_dtypes
            np_dtype = ml_dtypes.bfloat16
        self.np_dtype, self.directory = np.dtype(np_dtype), directory
        groups, size = [[]], 0
        for name, shape in plan:
            n = int(np.prod(shape)) * self.np_dtype.itemsize
            if groups[-1] and size + n > max_shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append((name, shape, n))
            size += n
        self.files = ["model.safetensors"] if len(groups) == 1 else [
            f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
        self.where: dict[str, tuple[str, int, tuple[int, ...]]] = {}  # name -> (file, byte offset, shape)
        self.pending = {name for name, _ in plan}
        self.rows_left = {name: shape[0] for name, shape in plan}
        for file, group in zip(self.files, groups):
            self._start(file, group)
        if len(self.files) > 1:
            index = {"metadata": {"total_size": sum(n for g in groups for *_, n in g)},
                     "weight_map": {name: file for file, g in zip(self.files, groups) for name, *_ in g}}
            with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)

    def _start(self, file: str, group) -> None:
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, n in group:
            header[name] = {"dtype": self.code, "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        start = 8 + len(raw)
        with open(os.path.join(self.directory, file), "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            f.truncate(start + offset)
        for name, shape, _ in group:
            self.where[name] = (file, start + header[name]["data_offsets"][0], shape)

    def write(self, name: str, x: np.ndarray, start: int = 0) -> None:
        """Rows [start, start + len(x)) of tensor `name` (default: the whole tensor)."""
        file, offset, shape = self.where[name]
        if tuple(x.shape[1:]) != tuple(shape[1:]) or start + len(x) > shape[0]:
            raise CheckpointError(f"{name}: rows {start}..{start + len(x)} of shape {tuple(x.shape[1:])} do not fit "
                                  f"{tuple(shape)}")
        x = x.astype(self.np_dtype, copy=False)
        rows = max(1, _CHUNK_BYTES // max(1, x[0].nbytes)) if x.ndim > 1 else len(x)
        with open(os.path.join(self.directory, file), "r+b") as f:
            f.seek(offset + start * (x[0].nbytes if x.ndim > 1 else x.itemsize))
            for a in range(0, len(x), rows):  # a transposed view is made contiguous a few MB at a time
                f.write(np.ascontiguousarray(x[a:a + rows]).reshape(-1).view(np.uint8).data)
        self.rows_left[name] -= len(x)
        if not self.rows_left[name]:
            self.pending.discard(name)

    def close(self) -> None:
        if self.pending:
            raise CheckpointError(f"{self.directory}: never received {sorted(self.pending)[0]}")


# HF tensors that are the transpose of the original's (torch Linear weights [out, in], hk.Linear [in, out]).
_HF_TRANSPOSED = {"q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out", "lm_head"}


def _hf_rows(kind: Kind) -> bool:
    """Whether each shard's part of this leaf is a block of whole rows of the HF tensor."""
    if kind.combine != _SPLIT:
        return False
    return kind.axis == (1 if kind.leaf in _HF_TRANSPOSED else 0)


def export_hf(ckpt: V1Checkpoint, out_dir: str, dtype: str = "fp16", max_shard_bytes: int = 2 << 30,
              progress=None) -> str:
    """Write a v1 checkpoint as a HF GPT-J directory (config.json + safetensors), one leaf at a time.

    Written into a temporary sibling directory that replaces `out_dir` only when complete.
    `progress(hf_name)` is called after each tensor. Returns `out_dir`.
    """
    import shutil
    import tempfile

    from mesh_transformer.io import hf

    if dtype not in _SAFETENSORS_DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(_SAFETENSORS_DTYPES)}; got {dtype!r}")
    m = ckpt.model
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=os.path.basename(out_dir.rstrip("/")) + ".tmp-")
    try:
        writer = SafetensorsWriter(tmp, _hf_plan(m), dtype, max_shard_bytes)
        for leaf, x in ckpt.stream(("params",), writer.np_dtype, whole=lambda leaf: not _hf_rows(leaf.kind)):
            name, entry = _hf_entry(m, our_module(leaf.kind, leaf.layer), leaf.kind.leaf, leaf.layer)
            if _hf_rows(leaf.kind):  # each shard's part is a block of rows of the HF tensor: written as it comes
                for start, part in x:
                    writer.write(name, part.T if leaf.kind.leaf in _HF_TRANSPOSED else part, start)
                    del part
            else:
                writer.write(name, entry.transform.to_hf((to_ours(leaf.kind, x, m),), m))
            del x
            _trim_host_heap()
            if progress:
                progress(name)
        writer.close()
        config = hf.config_to_hf(m, _SAFETENSORS_DTYPES[dtype][2])
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        copy_model_files(tokenizer_dirs(ckpt.step_dir), tmp)
        hf.name_special_tokens(tmp)
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def tokenizer_dirs(step_dir: str) -> list[str]:
    """Where tokenizer files of a v1 checkpoint may be: the step directory, then its model directory."""
    parent = storage.dirname(step_dir.rstrip("/"))
    return [step_dir] + ([parent] if parent and re.search(r"step_\d+$", step_dir.rstrip("/")) else [])
