"""Inside `jax.shard_map`: parameters as local shards, and the few collectives the model writes.

The model runs inside `shard_map` (xmap's successor), so each device sees its local shards and the
only collectives are the ones written here: a psum over 'mp' of each row-parallel result,
vocab-parallel reductions in the embedding and loss, and under ZeRO an all-gather over 'dp' of each
parameter where it is used (inside the layer scan, so one layer at a time). Outside `shard_map` the
same model code runs unsharded: every helper below is then the identity.
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
from jax.sharding import Mesh

from mesh_transformer.parallel.mesh import DP, MP
from mesh_transformer.parallel.rules import Layout, ParamInfo, Rules, split_alike, stored_layout


@dataclass(frozen=True)
class _Manual:
    axis_sizes: Mapping[str, int]
    rules: Rules
    layout: Layout = Layout()  # how the weights are stored (decoding's may differ from training's)


_state = threading.local()


def _current() -> Optional[_Manual]:
    return getattr(_state, "manual", None)


@contextlib.contextmanager
def manual_axes(mesh: Mesh, rules: Rules, layout: Layout = Layout()):
    """Mark code as running inside shard_map over `mesh`, with parameters placed by `rules` and
    stored as `layout` says."""
    previous = _current()
    _state.manual = _Manual(dict(mesh.shape), dict(rules), layout)
    try:
        yield
    finally:
        _state.manual = previous


def shard_map(fn: Callable, mesh: Mesh, rules: Rules, in_specs, out_specs, layout: Layout = Layout()) -> Callable:
    """`jax.shard_map` whose body knows its mesh (so `param`, `psum_mp`, ... act on shards) and how
    its weights are stored."""
    def body(*args):
        with manual_axes(mesh, rules, layout):
            return fn(*args)
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=_writes_collectives(mesh.shape))


# --------------------------------------------------------------------------------------------
# Parameters: declared with their logical axes, recorded by path while a model is initialised
# --------------------------------------------------------------------------------------------

@contextlib.contextmanager
def recording():
    """Collect {"module path/leaf name": ParamInfo} of every parameter created inside.

    Inside a layer stack Haiku names modules relative to the stack ("attn" for "gptj/layers/attn");
    `infos_for` resolves that.
    """
    previous = getattr(_state, "record", None)
    _state.record = record = {}
    try:
        yield record
    finally:
        _state.record = previous


def infos_for(params, record: Mapping[str, ParamInfo], stacked: str):
    """The ParamInfo tree matching a Haiku params dict, from a `recording()` record.

    `stacked` is the layer stack's module name: "gptj/layers/attn" was recorded as "attn".
    """
    def info(module: str, name: str) -> ParamInfo:
        for key in (f"{module}/{name}", f"{module.partition(f'/{stacked}/')[2]}/{name}"):
            if key in record:
                return record[key]
        raise KeyError(f"parameter {module}/{name} was not declared with parallel.param/weight")
    return {module: {name: info(module, name) for name in leaves} for module, leaves in params.items()}


class LoRAPlan(NamedTuple):
    """Which matmul weights get low-rank adapters while a LoRA model runs (see `mesh_transformer.lora`).

    targets: {(module name, leaf)}, the module being the last part of its Haiku path ("attn", "mlp",
    "head", or the family's root for OPT's projections); scale = alpha / rank.
    """

    targets: frozenset
    rank: int
    scale: float
    dropout: float = 0.0


class LoRAWeight(NamedTuple):
    """A frozen weight [*inputs, *outputs] with its adapter: W + scale * A @ B, with A [*inputs, r] and
    B [r, *outputs] sharded like W's input and output axes (the rank axis is never split).
    `layers.dense` computes x W + scale * (dropout(x) A) B, never the merged weight."""

    base: jax.Array
    a: jax.Array
    b: jax.Array
    scale: float
    dropout: float = 0.0


@contextlib.contextmanager
def lora_plan(plan: Optional[LoRAPlan]):
    """While active, `weight` adds adapters to the weights `plan` targets (None: no adapters)."""
    previous = getattr(_state, "lora", None)
    _state.lora = plan
    try:
        yield
    finally:
        _state.lora = previous


class BankPlan(NamedTuple):
    """Several LoRA adapters served at once over one base (`generate.Generator(adapters=...)`).

    targets: {(module name, leaf)} any adapter adapts (as `LoRAPlan`'s); adapters: the bank's size,
    its entry 0 the base alone (zeros); rank: the largest adapter's (smaller ones padded with zeros).
    """

    targets: frozenset
    adapters: int
    rank: int


class AdapterBank(NamedTuple):
    """A frozen weight [*inputs, *outputs] with a bank of N adapters, A [*inputs, N, r] and
    B [N, r, *outputs] (each adapter's alpha / r folded into its B; entry 0 zeros, the base alone),
    and each batch row's entry `rows` [B]: row b computes x W + (x A_e) B_e for e = rows[b] (the
    batched multi-LoRA of Punica, Chen et al. 2023, and vLLM). `layers.dense` reads it."""

    base: jax.Array
    a: jax.Array
    b: jax.Array
    rows: jax.Array


@contextlib.contextmanager
def adapter_bank(plan: Optional[BankPlan], rows=None):
    """While active, `weight` pairs the weights `plan` targets with their bank of adapters, each
    batch row reading entry `rows` [B] (this shard's rows). None: no bank."""
    previous = getattr(_state, "bank", None)
    _state.bank = None if plan is None else (plan, rows)
    try:
        yield
    finally:
        _state.bank = previous


def bank_infos(info: ParamInfo) -> tuple[ParamInfo, ParamInfo]:
    """The ParamInfos of a bank's A [*inputs, N, r] and B [N, r, *outputs] for a weight declared
    with `info`: matmul weights of their own (A's outputs, B's inputs the "adapters" and "lora_rank"
    axes, which no rule maps), with the weight's axes, so they shard like it and take the decode
    layout (inputs-last) the weights take."""
    axes, k = info.axes, info.inputs
    return (ParamInfo((*axes[:k], "adapters", "lora_rank"), k, False),
            ParamInfo(("adapters", "lora_rank", *axes[k:]), 2, False))


LORA_A, LORA_B = "_lora_a", "_lora_b"  # leaf-name suffixes of the two factors


def is_adapter(leaf: str) -> bool:
    return leaf.endswith(LORA_A) or leaf.endswith(LORA_B)


class InputsLast(NamedTuple):
    """A weight as stored with its `inputs` leading logical axes moved last; `layers.dense` reads it."""

    array: jax.Array
    inputs: int


class Quantized(NamedTuple):
    """A matmul weight quantized for decoding (`Generator(quantize="int8")`): int8 values [*inputs,
    *outputs] and a float32 scale per output [*outputs], W = values * scale; `layers.dense` reads it
    (a mixture's: values [E, *inputs, *outputs], scale [E, *outputs]; `layers.grouped_product`).
    Stored as two leaves, the weight's name holding the values and `name + SCALE` the scale."""

    values: jax.Array
    scale: jax.Array


SCALE = "_scale"  # leaf-name suffix of a quantized weight's scale


def quantize(w, info: ParamInfo):
    """A matmul weight [L.., *inputs, *outputs] (a mixture's [L.., E, *inputs, *outputs]) -> (int8
    values of its shape, float32 scale [L.., (E,) *outputs]): symmetric per output column, scale =
    the column's largest |w| / 127, values = w / scale rounded to nearest (w = values x scale)."""
    lead = w.ndim - len(info.axes)
    contracted = tuple(lead + i for i in info.contracted)
    w = jnp.asarray(w, jnp.float32)
    absmax = jnp.max(jnp.abs(w), axis=contracted, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / 127.0, 1.0)
    values = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
    return values, jnp.squeeze(scale, contracted)


def param(name: str, shape: tuple[int, ...], axes: tuple[str, ...], init, cast_to=None, *, decay: bool = False):
    """A float32 Haiku parameter of global `shape` with logical `axes`, as the local shard this
    device computes with. Biases, norms (decay=False) and embedding tables (decay=True).

    Axes mapped to 'mp' stay split (Megatron); axes mapped to 'dp' (ZeRO) are stored split and
    all-gathered here, where they are used. `cast_to` (the compute dtype) is applied first, so the
    gather moves half-width values and only the layer in flight exists in compute precision.
    """
    return _declare(name, shape, ParamInfo(tuple(axes), 0, decay), init, cast_to)


def weight(name: str, shape: tuple[int, ...], axes: tuple[str, ...], inputs: int, init, cast_to=None):
    """A matmul weight [*input axes, *output axes] (`inputs` leading axes are contracted): decays,
    and may be stored inputs-last for decoding, in which case it comes back as `InputsLast`.
    Under a `lora_plan` that targets it, it comes back as a `LoRAWeight`; under an `adapter_bank`
    that targets it, as an `AdapterBank`."""
    w = _declare(name, shape, ParamInfo(tuple(axes), inputs, True), init, cast_to)
    return _with_adapter(w, name, shape, axes, inputs, cast_to)


def expert_weights(name: str, shape: tuple[int, ...], axes: tuple[str, ...], inputs: int, init, cast_to=None):
    """A mixture's per-expert matmul weights [E, *inputs, *outputs] (`inputs` axes contracted): decay,
    stored inputs-first (the experts kernel's layout), and quantized for decoding as a weight per
    expert (int8 values, a float32 scale per expert and output: `Quantized`). Under a `lora_plan`
    that targets them, a `LoRAWeight` with an adapter per expert: A [E, *inputs, r], B [E, r, *outputs]."""
    w = _declare(name, shape, ParamInfo(tuple(axes), inputs, True, experts=True), init, cast_to)
    return _with_adapter(w, name, shape, axes, inputs, cast_to, experts=True)


def _with_adapter(w, name: str, shape, axes, inputs: int, cast_to, experts: bool = False):
    """`w`, or `w` with its adapter where the `lora_plan` targets it (a mixture's: one per expert, the
    leading experts axis kept on A and B), or with its bank where an `adapter_bank` targets it."""
    key = (hk.experimental.current_name().split("/")[-1], name)
    bank = getattr(_state, "bank", None)
    if bank is not None and not experts and key in bank[0].targets:
        return _with_bank(w, name, shape, axes, inputs, cast_to, *bank)
    plan = getattr(_state, "lora", None)
    if plan is None or key not in plan.targets:
        return w
    lead = (shape[0],) if experts else ()  # [E]
    shape, axes = shape[len(lead):], axes[len(lead):]
    lead_axes = ("experts",) * len(lead)
    r, fan_in = plan.rank, math.prod(shape[:inputs])
    # PEFT's init: A ~ kaiming_uniform(a=sqrt(5)) = U(+-1/sqrt(fan_in)), B = 0 (the adapter starts as a no-op).
    a = _declare(name + LORA_A, (*lead, *shape[:inputs], r),
                 ParamInfo((*lead_axes, *axes[:inputs], "lora_rank"), inputs, True, experts=experts),
                 hk.initializers.RandomUniform(-1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in)), cast_to)
    b = _declare(name + LORA_B, (*lead, r, *shape[inputs:]),
                 ParamInfo((*lead_axes, "lora_rank", *axes[inputs:]), 1, True, experts=experts),
                 hk.initializers.Constant(0.0), cast_to)
    return LoRAWeight(w, a, b, plan.scale, plan.dropout)


def _with_bank(w, name: str, shape, axes, inputs: int, cast_to, plan: BankPlan, rows) -> AdapterBank:
    info_a, info_b = bank_infos(ParamInfo(tuple(axes), inputs, True))
    n, r = plan.adapters, plan.rank
    a = _declare(name + LORA_A, (*shape[:inputs], n, r), info_a, hk.initializers.Constant(0.0), cast_to)
    b = _declare(name + LORA_B, (n, r, *shape[inputs:]), info_b, hk.initializers.Constant(0.0), cast_to)
    return AdapterBank(w, a, b, rows)


def _declare(name: str, shape, info: ParamInfo, init, cast_to):
    if len(shape) != len(info.axes):
        raise ValueError(f"parameter {name!r}: shape {shape} but logical axes {info.axes}")
    record = getattr(_state, "record", None)
    if record is not None:
        record[f"{hk.experimental.current_name()}/{name}"] = info
    manual = _current()
    if manual is None:
        value = hk.get_parameter(name, shape, jnp.float32, init=init)
        return value if cast_to is None else value.astype(cast_to)
    inputs_last = manual.layout.inputs_last and info.inputs > 0 and not info.experts
    order, axes = stored_layout(info, len(shape), inputs_last)
    shape = tuple(shape[i] for i in order)
    mesh_axes = [manual.rules.get(a) for a in axes]
    stored = tuple(size // (manual.axis_sizes[m] if m else 1) for size, m in zip(shape, mesh_axes))
    value = hk.get_parameter(name, stored, jnp.float32, init=init)
    if value.dtype == jnp.int8:  # quantized (inputs-first): the Generator's, or a LoRA run's frozen base
        kept = [i for i in range(len(stored)) if i not in info.contracted]
        scale = hk.get_parameter(name + SCALE, tuple(stored[i] for i in kept), jnp.float32,
                                 init=hk.initializers.Constant(1.0))
        return Quantized(_gathered(value, mesh_axes, manual), _gathered(scale, [mesh_axes[i] for i in kept], manual))
    if cast_to is not None:
        value = value.astype(cast_to)
    value = _gathered(value, mesh_axes, manual)
    return InputsLast(value, info.inputs) if inputs_last else value


def _gathered(value, mesh_axes, manual: _Manual):
    """A stored shard with its ZeRO-split ('dp') axes all-gathered."""
    for dim, mesh_axis in enumerate(mesh_axes):
        if mesh_axis == DP and manual.axis_sizes[DP] > 1:
            value = jax.lax.all_gather(value, DP, axis=dim, tiled=True)
    return value


def fused(output_axes) -> bool:
    """Whether the weights whose first output axes are `output_axes` are stored as one here (the
    decode layout's `fused`; see `Layout`): the model then asks for the fused leaf."""
    manual = _current()
    return manual is not None and manual.layout.fused and split_alike(output_axes, manual.rules)


# --------------------------------------------------------------------------------------------
# Collectives (identities outside shard_map)
# --------------------------------------------------------------------------------------------

def _writes_collectives(axis_sizes: Mapping[str, int]) -> bool:
    """Whether the model writes collectives on a mesh of these axes: over more than one device,
    size-1 axes included (shard_map tracks values as varying over them and checks it). A one-device
    mesh runs unchecked and writes none: XLA:CPU keeps a one-device all-reduce as a copy of its
    operand."""
    return math.prod(axis_sizes.values()) > 1


def _bound(axis: str) -> bool:
    """Whether a collective over `axis` is written here (inside shard_map, `_writes_collectives`)."""
    manual = _current()
    return manual is not None and axis in manual.axis_sizes and _writes_collectives(manual.axis_sizes)


def varying(x) -> frozenset:
    """The mesh axes a value varies over inside shard_map (empty outside)."""
    manual = getattr(jax.typeof(x), "manual_axis_type", None)
    return manual.varying if manual is not None else frozenset()


def vary(x, axes: tuple):
    """x cast to vary over `axes` too (inside shard_map): the transpose of the cast is the sum over
    those axes that the gradient of a product with a value varying over them owes."""
    missing = tuple(a for a in axes if a not in varying(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def vary_alike(*trees):
    """Every leaf of `trees` cast to vary over every axis any of them varies over (`vary`)."""
    axes = tuple(sorted(frozenset().union(*(varying(x) for x in jax.tree.leaves(trees)))))
    return jax.tree.map(lambda x: vary(x, axes), trees)


def psum_mp(x):
    """Sum the partial results of row-parallel layers over the model-parallel shards."""
    return jax.lax.psum(x, MP) if _bound(MP) else x


def all_gather_mp(x, axis: int = -1):
    """Concatenate the mp shards of `x` along `axis`; every shard gets the same whole array.
    With one shard a sum over it (the same array): XLA:CPU runs a one-device all-gather as copies
    of `x` (two of a serving batch's logits per decode step), a one-device all-reduce as one."""
    if not _bound(MP):
        return x
    if _current().axis_sizes[MP] == 1:
        return jax.lax.psum(x, MP)
    return jax.lax.all_gather(x, MP, axis=axis, tiled=True, to="invarying")


def pmax_mp(x):
    return jax.lax.pmax(x, MP) if _bound(MP) else x


def mp_index():
    """This device's position along 'mp' (0 outside shard_map)."""
    return jax.lax.axis_index(MP) if _bound(MP) else 0


def mp_size() -> int:
    """The number of model-parallel shards (1 outside shard_map)."""
    manual = _current()
    return manual.axis_sizes.get(MP, 1) if manual is not None else 1


def dp_index():
    """This device's position along 'dp' (0 outside shard_map)."""
    return jax.lax.axis_index(DP) if _bound(DP) else 0


def psum_dp(x):
    return jax.lax.psum(x, DP) if _bound(DP) else x
