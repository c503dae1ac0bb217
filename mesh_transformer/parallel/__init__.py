"""How the model is split over a ('dp', 'mp') device mesh: one table, a few collectives.

Every parameter has logical axes (PARAM_AXES, keyed by the parameter's leaf name). A rule set maps
logical axes to mesh axes:

    logical axis   MEGATRON   ZERO      meaning
    vocab          mp         mp        vocab-parallel embedding, head and cross-entropy
    heads          mp         mp        column-parallel q/k/v, row-parallel out_proj
    mlp            mp         mp        column-parallel fc_in, row-parallel fc_out
    embed          -          dp        ZeRO: master weights and optimizer state split over dp
    batch          dp         dp        data parallelism

The model runs inside `jax.shard_map` (xmap's successor), so each device sees its local shards and
the only collectives are the ones written here: one psum over 'mp' of the residual update per
layer (GPT-J's parallel residual makes attention and MLP share it), vocab-parallel reductions in
the embedding and loss, and under ZeRO an all-gather over 'dp' of each parameter where it is used
(inside the layer scan, so one layer at a time). Outside `shard_map` the same model code runs
unsharded: every helper below is then the identity.
"""
from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mesh_transformer.config import ConfigError, ModelConfig

DP, MP = "dp", "mp"

# Logical axes of every parameter, by leaf name. Layer-stacked parameters get a leading
# (unsharded) 'layers' axis that is not listed here.
PARAM_AXES: dict[str, tuple[str, ...]] = {
    "embeddings": ("vocab", "embed"),
    "pos_embeddings": ("seq", "embed"),
    "scale": ("embed",),
    "offset": ("embed",),
    "q_proj": ("embed", "heads", "head_dim"),
    "k_proj": ("embed", "heads", "head_dim"),
    "v_proj": ("embed", "heads", "head_dim"),
    "out_proj": ("heads", "head_dim", "embed"),
    "fc_in": ("embed", "mlp"),
    "fc_in_bias": ("mlp",),
    "fc_out": ("mlp", "embed"),
    "fc_out_bias": ("embed",),
    "lm_head": ("embed", "vocab"),
    "lm_head_bias": ("vocab",),
}

# Decoding multiplies each weight by a vector or a few, once per token: XLA:CPU reads a weight
# fastest when the contracted (input) axes are its last ones, as torch's Linear stores them (25-35%
# faster than input axes first; with batches of 8+ rows it is the other way round).
# `generate.Generator(matvec=True)` keeps its weights that way: this many leading logical axes of
# each moved to the end (`inputs_last_order`).
INPUT_AXES: dict[str, int] = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "out_proj": 2, "fc_in": 1, "fc_out": 1,
                              "lm_head": 1}

MEGATRON: dict[str, Optional[str]] = {"vocab": MP, "heads": MP, "mlp": MP, "batch": DP}
ZERO: dict[str, Optional[str]] = {**MEGATRON, "embed": DP}


def rules_for(zero: bool) -> dict[str, Optional[str]]:
    return ZERO if zero else MEGATRON


# --------------------------------------------------------------------------------------------
# Mesh
# --------------------------------------------------------------------------------------------

def make_mesh(mp: int, dp: Optional[int] = None, devices=None) -> Mesh:
    """A ('dp', 'mp') mesh; mp devices of a replica are neighbours (fast links carry mp traffic)."""
    devices = list(jax.devices() if devices is None else devices)
    if dp is None:
        if len(devices) % mp:
            raise ConfigError(f"config key 'cores_per_replica': {mp} does not divide the {len(devices)} available devices")
        dp = len(devices) // mp
    if dp * mp > len(devices):
        raise ConfigError(f"a dp={dp} x mp={mp} mesh needs {dp * mp} devices, only {len(devices)} are available")
    devices = devices[: dp * mp]
    try:
        grid = mesh_utils.create_device_mesh((dp, mp), devices)
    except (AssertionError, NotImplementedError, ValueError):
        grid = np.array(devices).reshape(dp, mp)
    return Mesh(grid, (DP, MP))


def check_divisibility(config: ModelConfig, mesh: Mesh, zero: bool) -> None:
    """Raise a ConfigError naming the key when a sharded dimension does not split evenly."""
    mp, dp = mesh.shape[MP], mesh.shape[DP]
    checks = [("n_heads", config.n_heads, mp), ("d_ff", config.ff_dim, mp)]
    if zero:
        checks.append(("d_model", config.d_model, dp))
    for key, size, parts in checks:
        if size % parts:
            axis = "cores_per_replica (mp)" if parts == mp else "the data-parallel size (ZeRO)"
            raise ConfigError(f"config key {key!r}: {size} does not split over {axis} = {parts}")


# --------------------------------------------------------------------------------------------
# PartitionSpecs from the table
# --------------------------------------------------------------------------------------------

def leaf_axes(name: str, ndim: int) -> tuple[Optional[str], ...]:
    """Logical axes of a parameter leaf, with a leading None for a stacked 'layers' axis."""
    try:
        axes = PARAM_AXES[name]
    except KeyError:
        raise KeyError(f"parameter {name!r} has no entry in parallel.PARAM_AXES") from None
    return (None,) * (ndim - len(axes)) + axes


def inputs_last_order(name: str, ndim: int) -> tuple[int, ...]:
    """The axis permutation of a parameter leaf (maybe layer-stacked) that moves its INPUT_AXES last."""
    lead, k = ndim - len(PARAM_AXES[name]), INPUT_AXES.get(name, 0)
    axes = list(range(ndim))
    return tuple(axes[:lead] + axes[lead + k:] + axes[lead:lead + k])


def stored_layout(name: str, ndim: int, inputs_last: bool) -> tuple[tuple[int, ...], tuple[Optional[str], ...]]:
    """(axis permutation from the logical layout to the stored one, the stored leaf's logical axes)."""
    order = inputs_last_order(name, ndim) if inputs_last else tuple(range(ndim))
    axes = leaf_axes(name, ndim)
    return order, tuple(axes[i] for i in order)


class InputsLast(NamedTuple):
    """A weight as stored with its first `inputs` logical axes moved last; `model.dense` reads it."""

    array: jax.Array
    inputs: int


def spec_for(axes, rules: Mapping[str, Optional[str]]) -> P:
    return P(*(rules.get(a) if a else None for a in axes))


def param_specs(params, rules: Mapping[str, Optional[str]]):
    """PartitionSpec tree for a Haiku params dict (arrays or ShapeDtypeStructs)."""
    return {mod: {name: spec_for(leaf_axes(name, leaf.ndim), rules) for name, leaf in leaves.items()}
            for mod, leaves in params.items()}


def named(mesh: Mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


# --------------------------------------------------------------------------------------------
# Inside shard_map: local shapes and collectives
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Manual:
    axis_sizes: Mapping[str, int]
    rules: Mapping[str, Optional[str]]
    inputs_last: bool = False  # weights stored inputs-last (see INPUT_AXES)


_state = threading.local()


def _current() -> Optional[_Manual]:
    return getattr(_state, "manual", None)


@contextlib.contextmanager
def manual_axes(mesh: Mesh, rules: Mapping[str, Optional[str]], inputs_last: bool = False):
    """Mark code as running inside shard_map over `mesh`, with parameters laid out by `rules`
    (and stored inputs-last if `inputs_last`)."""
    previous = _current()
    _state.manual = _Manual(dict(mesh.shape), dict(rules), inputs_last)
    try:
        yield
    finally:
        _state.manual = previous


def shard_map(fn: Callable, mesh: Mesh, rules, in_specs, out_specs, inputs_last: bool = False) -> Callable:
    """`jax.shard_map` whose body knows its mesh (so `param`, `psum_mp`, ... act on shards)."""
    def body(*args):
        with manual_axes(mesh, rules, inputs_last):
            return fn(*args)
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True)


def param(name: str, shape: tuple[int, ...], init, cast_to=None):
    """A float32 Haiku parameter of global `shape`, as the local shard this device computes with.

    Its logical axes come from PARAM_AXES[name]. Axes mapped to 'mp' stay split (Megatron);
    axes mapped to 'dp' (ZeRO) are stored split and all-gathered here, where they are used.
    `cast_to` (the compute dtype) is applied first, so the gather moves half-width values and
    only the layer in flight exists in compute precision. Weights stored inputs-last (decoding)
    come back as `InputsLast`, for `model.dense`.
    """
    manual = _current()
    if manual is None:
        value = hk.get_parameter(name, shape, jnp.float32, init=init)
        return value if cast_to is None else value.astype(cast_to)
    inputs_last = manual.inputs_last and name in INPUT_AXES
    order, axes = stored_layout(name, len(shape), inputs_last)
    shape = tuple(shape[i] for i in order)
    mesh_axes = [manual.rules.get(a) for a in axes]
    stored = tuple(size // (manual.axis_sizes[m] if m else 1) for size, m in zip(shape, mesh_axes))
    value = hk.get_parameter(name, stored, jnp.float32, init=init)
    if cast_to is not None:
        value = value.astype(cast_to)
    for dim, mesh_axis in enumerate(mesh_axes):
        if mesh_axis == DP and manual.axis_sizes[DP] > 1:
            value = jax.lax.all_gather(value, DP, axis=dim, tiled=True)
    return InputsLast(value, INPUT_AXES[name]) if inputs_last else value


def _bound(axis: str) -> bool:
    # Size-1 axes count too: shard_map tracks values as varying over them, and XLA drops the op.
    manual = _current()
    return manual is not None and axis in manual.axis_sizes


def psum_mp(x):
    """Sum the partial results of row-parallel layers over the model-parallel shards."""
    return jax.lax.psum(x, MP) if _bound(MP) else x


def all_gather_mp(x, axis: int = -1):
    """Concatenate the mp shards of `x` along `axis`; every shard gets the same whole array."""
    return jax.lax.all_gather(x, MP, axis=axis, tiled=True, to="invarying") if _bound(MP) else x


def pmax_mp(x):
    return jax.lax.pmax(x, MP) if _bound(MP) else x


def mp_index():
    """This device's position along 'mp' (0 outside shard_map)."""
    return jax.lax.axis_index(MP) if _bound(MP) else 0


def psum_dp(x):
    return jax.lax.psum(x, DP) if _bound(DP) else x


def bytes_of(tree) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
