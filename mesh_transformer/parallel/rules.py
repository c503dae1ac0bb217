"""Logical axes -> mesh axes: the partition table, derived from what each parameter declares.

Every parameter is created by `parallel.param` / `parallel.weight` with its logical axes
(`("embed", "heads", "head_dim")`), and initialising a model records them by path (`ParamInfo`).
A rule set maps logical axes to mesh axes:

    logical axis   MEGATRON   ZERO      meaning
    vocab          mp         mp        vocab-parallel embedding, head and cross-entropy
    heads          mp         mp        column-parallel q (and k/v without GQA), row-parallel out_proj
    kv_heads       mp | -     mp | -    GQA keys/values: split when mp divides them, else replicated
    mlp            mp         mp        column-parallel fc_in, row-parallel fc_out
    expert_mlp     mp         mp        a mixture's experts: each expert's F splits over mp ...
    experts        -          -         ... or, with expert parallelism, the experts do (whole ones)
    embed          -          dp        ZeRO: master weights and optimizer state split over dp
    batch          dp         dp        data parallelism

Expert parallelism (`expert_parallel`, a mixture's key) swaps the last two rows: each mp shard
holds n_experts / mp whole experts and multiplies the token copies routed to them; the layer's
one all-reduce still sums its output.

Grouped-query attention with fewer kv heads than mp shards (`kv_heads` not split): every shard
holds all of k_proj/v_proj and computes only the one kv head its query heads share, which needs
mp to be a multiple of the kv-head count (so a group of query heads never straddles two kv heads).

Partition specs, divisibility checks (naming the config key), the weight-decay mask and the
inputs-last decode layout all come from the record, never from lists of names.
"""
from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Optional

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mesh_transformer.config import ConfigError
from mesh_transformer.parallel.mesh import DP, MP

Rules = Mapping[str, Optional[str]]

MEGATRON: dict[str, Optional[str]] = {"vocab": MP, "heads": MP, "kv_heads": MP, "mlp": MP, "expert_mlp": MP,
                                      "batch": DP}
ZERO: dict[str, Optional[str]] = {**MEGATRON, "embed": DP}

# The config key that sizes each shardable logical axis (for errors a user can act on).
AXIS_KEYS = {"heads": "n_heads", "kv_heads": "n_kv_heads", "mlp": "d_ff", "expert_mlp": "d_ff", "embed": "d_model",
             "vocab": "n_vocab", "experts": "n_experts"}


def rules_for(zero: bool, split_kv: bool = True, expert_parallel: bool = False) -> dict[str, Optional[str]]:
    """The table for a run: ZeRO or Megatron; `split_kv=False` replicates GQA kv heads over mp;
    `expert_parallel` splits a mixture's experts over mp, whole, instead of each expert's F."""
    rules = dict(ZERO if zero else MEGATRON)
    if not split_kv:
        rules["kv_heads"] = None
    if expert_parallel:
        rules["experts"], rules["expert_mlp"] = MP, None
    return rules


class ParamInfo(NamedTuple):
    """What a parameter declares where it is made: logical axes (without a stacked 'layers' axis),
    how many leading axes a matmul contracts (0: not a matmul weight), and whether it decays.
    `experts`: a mixture's weights, one matmul weight per expert [E, *inputs, *outputs] (`inputs`
    then counts the contracted axes after the experts axis); always stored inputs-first."""

    axes: tuple[str, ...]
    inputs: int = 0
    decay: bool = False
    experts: bool = False

    @property
    def contracted(self) -> tuple[int, ...]:
        """The logical axes a matmul contracts (after the experts axis of a mixture's weights)."""
        first = 1 if self.experts else 0
        return tuple(range(first, first + self.inputs))


def leaf_axes(info: ParamInfo, ndim: int) -> tuple[Optional[str], ...]:
    """Logical axes of a leaf, with a leading None for a stacked 'layers' axis."""
    return (None,) * (ndim - len(info.axes)) + tuple(info.axes)


def inputs_last_order(info: ParamInfo, ndim: int) -> tuple[int, ...]:
    """The axis permutation of a (maybe layer-stacked) weight that moves its input axes last."""
    lead, k = ndim - len(info.axes), info.inputs
    axes = list(range(ndim))
    return tuple(axes[:lead] + axes[lead + k:] + axes[lead:lead + k])


def stored_layout(info: ParamInfo, ndim: int, inputs_last: bool) -> tuple[tuple[int, ...], tuple[Optional[str], ...]]:
    """(axis permutation from the logical layout to the stored one, the stored leaf's logical axes)."""
    order = inputs_last_order(info, ndim) if inputs_last and info.inputs and not info.experts else tuple(range(ndim))
    axes = leaf_axes(info, ndim)
    return order, tuple(axes[i] for i in order)


class Layout(NamedTuple):
    """How the weights a model reads are stored. Training: as declared (the default). Decoding
    (`generate.Generator`) may store them `inputs_last` (each output a dot product of contiguous
    rows) and `fused`: the weights one input feeds stored as one, concatenated along their first
    output axis, so a layer makes one product where training makes several (q/k/v; SwiGLU's gate
    and up). Which leaves fuse is `models.layers.FUSED`; where they can, `split_alike`."""

    inputs_last: bool = False
    fused: bool = False


def split_alike(output_axes, rules: Rules) -> bool:
    """Whether leaves whose first output axes are `output_axes` can be stored fused: those axes
    split over the same mesh axis (or none), so each shard holds its own part of every leaf
    (GQA's replicated kv heads beside split query heads cannot)."""
    return len({rules.get(a) for a in output_axes}) == 1


def spec_for(axes, rules: Rules) -> P:
    return P(*(rules.get(a) if a else None for a in axes))


def param_specs(params, infos, rules: Rules, inputs_last: bool = False):
    """PartitionSpec tree for params (arrays or ShapeDtypeStructs) with their `infos` (same structure)."""
    return jax.tree.map(lambda x, info: spec_for(stored_layout(info, x.ndim, inputs_last)[1], rules),
                        params, infos, is_leaf=_is_info)


def named(mesh: Mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def decay_mask(infos):
    """True for the parameters weight decay applies to (matrices: weights and embedding tables)."""
    return jax.tree.map(lambda info: info.decay, infos, is_leaf=_is_info)


def check_divisibility(params, infos, mesh_sizes: Mapping[str, int], rules: Rules) -> None:
    """ConfigError naming the config key when a sharded dimension does not split evenly."""
    def check(x, info):
        for size, axis in zip(x.shape[x.ndim - len(info.axes):], info.axes):
            mesh_axis = rules.get(axis)
            parts = mesh_sizes.get(mesh_axis, 1) if mesh_axis else 1
            if size % parts:
                where = "cores_per_replica (mp)" if mesh_axis == MP else "the data-parallel size (ZeRO)"
                raise ConfigError(f"config key {AXIS_KEYS.get(axis, axis)!r}: {size} does not split over "
                                  f"{where} = {parts}")
    jax.tree.map(check, params, infos, is_leaf=_is_info)


def bytes_of(tree) -> int:
    import jax.numpy as jnp
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _is_info(x) -> bool:
    return isinstance(x, ParamInfo)
