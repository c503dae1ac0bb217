"""The transformer every family shares: embed -> L x block -> final norm -> head, and its KV cache.

    x = embed(tokens) [+ learned positions]          (StemSpec: tied or not, OPT's projections)
    for each layer:  x, kv = family.block(config, x, ctx, kv)
    logits = head(norm_f(x))

A family (one file in this folder) gives its config class, its `block` and its HF table; this
file does the rest the same way for all of them. For training, layers are stacked and scanned
(`hk.layer_stack`), so compile time does not grow with depth; with a KV cache (generation) they run
unrolled over per-layer parameters and caches (`unstack_layers`), because a scan slices each
layer's weights and cache out of the stack, and XLA:CPU copies such slices every decode step.

`Model` wraps the Haiku-transformed network with what the rest of the library needs from it:
abstract parameters, their `ParamInfo` (logical axes, recorded where each parameter is made), the
parameter count and FLOPs.
"""
from __future__ import annotations

import functools
import math
import dataclasses
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence

import haiku as hk
import jax
import jax.numpy as jnp

from mesh_transformer import parallel
from mesh_transformer.config import ConfigError, ModelConfig
from mesh_transformer.models import layers
from mesh_transformer.models.layers import (WEIGHT_PRODUCT, Context, Embedding, LMHead, dense, norm, normal, on_bits,
                                            softcap)

def _flash_attention_outputs(prim, *_, **__) -> bool:
    """Keep what cuDNN's flash-attention forward returns (the output and its softmax statistics: the
    backward's residuals), so the backward does not run the forward again (an H200: 13 ms of a
    540 ms 1B-LLaMA step)."""
    return prim.name.startswith("dot_product_attention_fwd")


REMAT_POLICIES = {
    "full": None,  # save nothing, recompute the layer in the backward pass
    # save the weight matmuls (dense() names them) and flash attention's outputs; recompute
    # attention's batched einsums and the element-wise work
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.save_from_both_policies(
            jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
            jax.checkpoint_policies.save_only_these_names(WEIGHT_PRODUCT)),
        _flash_attention_outputs),
}
STACKED = "layers"  # module of the scanned layers: parameters "<family>/layers/..." with a leading [L] axis


class StemSpec(NamedTuple):
    """How tokens become the residual stream and the stream becomes logits (per family)."""

    final_norm: Optional[str] = "layernorm"  # "layernorm", "rmsnorm", "rmsnorm+1" (Gemma) or None
    tied: bool = False  # the head is the embedding table
    head_bias: bool = False
    position_offset: int = 0  # learned positions (pe == "fixed"): rows kept before position 0 (OPT: 2)
    embed_proj: Optional[int] = None  # OPT: the table is this wide, projected in and out of d_model
    embed_scale: Optional[float] = None  # embeddings times this, in the compute dtype (Gemma: sqrt(d_model))
    scaled_embedding: bool = False  # HF scales inside its embedding module (Gemma's), so NEFTune's noise follows the scale
    logit_softcap: Optional[float] = None  # logits soft-capped to (-cap, cap) (Gemma 2)
    logit_divisor: Optional[float] = None  # logits divided by this (Granite's logits_scaling)

    def hidden_size(self, d_model: int) -> int:
        """The width of the final hidden states (`Transformer(hidden=True)`): OPT's projected width."""
        return self.embed_proj or d_model


class KVCache(NamedTuple):
    """Keys and values for decoding; sharded like activations (kv heads over mp).

    k: one [B, K, H, S] array per layer (a tuple of L), v: one [B, K, S, H] per layer, updated in
    place as layers run. These are the layouts attention's two matmuls (q.k^T, then weights.v)
    read, so no step transposes the cache. K is the kv heads (`ModelConfig.cache_heads`). Row b's
    tokens live in slots start[b] .. index-1 (prompts are left-padded to a shared length); the next
    tokens are written at slot `index`. `offset` [B] (decoding; None: 0): the tokens before a row's
    first slot that it reads from a `SharedPrefix` instead, so its slot `start` holds position offset.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    start: jax.Array  # [B] int32
    index: jax.Array  # [] int32
    offset: Optional[jax.Array] = None  # [B] int32

    K_SLOTS, V_SLOTS = 3, 2  # the slot axis of each k and v array

    @property
    def slots(self) -> int:
        return self.v[0].shape[self.V_SLOTS]

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, slots: int, start=0, mp: int = 1, local: bool = False):
        """An empty cache for `mp` shards: global shapes, or (`local`) one shard's."""
        heads, dtype = config.cache_heads(mp) // (mp if local else 1), jnp.dtype(config.compute_dtype)
        k = tuple(jnp.zeros((batch, heads, config.head_dim, slots), dtype) for _ in range(config.layers))
        v = tuple(jnp.zeros((batch, heads, slots, config.head_dim), dtype) for _ in range(config.layers))
        return cls(k, v, jnp.broadcast_to(jnp.asarray(start, jnp.int32), (batch,)), jnp.zeros((), jnp.int32))

    def along_slots(self, fn, *others: "KVCache", as_bits: bool = True) -> "KVCache":
        """The cache with each layer's k and v replaced by fn(array, *the same array of `others`,
        axis=its slot axis); start and index are kept. `fn` moves data (slices, updates, rolls,
        gathers): a 16-bit cache runs it on its bits (`layers.on_bits`), unless `as_bits` is
        False (`fn` is `layers.update_slice`, or takes care of 16-bit arrays itself)."""
        def each(arrays, axis):
            call = functools.partial(fn, axis=axis)
            return tuple(on_bits(call, *xs) if as_bits else call(*xs) for xs in arrays)
        k = each(zip(self.k, *(o.k for o in others)), self.K_SLOTS)
        v = each(zip(self.v, *(o.v for o in others)), self.V_SLOTS)
        return self._replace(k=k, v=v)


class SharedPrefix(NamedTuple):
    """Keys and values several decoding rows share (a prefix-cache block chain), read once per step
    for all of them instead of once per row from copies in each row's own slots.

    k: one [K, H, U] array per layer, v: one [K, U, H]; positions [B, U] int32: the position each
    of the U slots holds in row b's sequence, -1 where row b does not read it (the attention mask).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    positions: jax.Array


class Transformer(hk.Module):
    def __init__(self, config: ModelConfig, block: Callable, padded_vocab: int):
        super().__init__(name=config.family)
        self.config, self.block, self.padded_vocab = config, block, padded_vocab

    def __call__(self, tokens, cache: Optional[KVCache] = None, last_only: bool = False, segments=None,
                 key_keep=None, logit_positions=None, shared: Optional[SharedPrefix] = None, routers: bool = False,
                 embed_noise: Optional[float] = None, hidden: bool = False, on_head: Optional[Callable] = None):
        """tokens [B, T] (int) -> (logits [B, T, V/mp] float32, this shard's vocabulary slice; new cache).

        Without a cache the T tokens are positions 0..T-1 under a causal mask (training). With a
        cache they go into slots cache.index .. index+T-1 and attend to every earlier valid slot.
        `last_only` computes logits for the last position only ([B, 1, V/mp]; prefill);
        `logit_positions` [B, K] (int) for those positions only ([B, K, V/mp]; scoring the end of a
        prompt: the vocabulary head is most of a small model's work). `shared` (with a cache):
        keys and values before each row's own slots that rows share (see `SharedPrefix`).
        Training only: `segments` [B, T] (int) keeps packed examples apart (a token attends to its
        own segment, positions restart at each); `key_keep` [B, T] (bool) drops the keys it marks
        False from every query's view (forgetful causal masking). `routers` (training): a third item
        returned, the mixture layers' `layers.RouterStats` summed over layers (for the
        load-balancing loss). `embed_noise` (training): NEFTune's alpha, noise on the token
        embeddings (`layers.neftune`), drawn from the rng per dp shard, the same on every mp shard.
        `hidden`: the final hidden states [B, T, D] (float, every mp shard holds all of D) in place
        of the logits: what HF's base model returns as `last_hidden_state` (after the final norm and
        OPT's `project_out`), what embeddings pool.
        `on_head` (training a language model): what it returns of (head, weights, x) takes the
        logits' place, where head(weights, x [b, t, D]) -> logits [b, t, V/mp] is the output head
        as a pure function (`lm_head`) and x the final hidden states [B, T, D]: so a loss can run the
        head over chunks of tokens and never hold all the logits (`train.loss`).
        """
        c, stem = self.config, self.config.stem()
        ctx = _context(tokens.shape, cache, segments, key_keep, shared)._replace(attention=c.attention_impl)
        dtype = jnp.dtype(c.compute_dtype)
        embedding = Embedding(self.padded_vocab, stem.embed_proj or c.d_model,
                              width_axis="embed_proj" if stem.embed_proj else "embed")
        x = embedding(tokens, dtype)
        if embed_noise and not stem.scaled_embedding:  # on what HF's input embedding module returns
            x = _neftune(x, embed_noise)
        if stem.embed_scale is not None:
            x = x * jnp.asarray(stem.embed_scale, dtype)
        if embed_noise and stem.scaled_embedding:
            x = _neftune(x, embed_noise)
        if stem.embed_proj:
            x = dense("btp,pd->btd", x, parallel.weight("project_in", (stem.embed_proj, c.d_model),
                                                         ("embed_proj", "embed"), 1, normal(0.02), dtype))
        if c.pe == "fixed":
            x = x + embedding.positions(ctx.positions, c.seq, c.d_model, dtype, stem.position_offset)

        windowed = c.windowed_layers()
        if cache is None and routers:
            x, stats = scanned_layers(c, self.block, x, ctx, windowed, routers=True)
        elif cache is None:
            x = scanned_layers(c, self.block, x, ctx, windowed)
        else:
            new_k, new_v = [], []
            for i in range(c.layers):
                with hk.name_scope(unstacked(i)):
                    layer = (cache.k[i], cache.v[i]) + ((shared.k[i], shared.v[i]) if shared else ())
                    layer_ctx = ctx if windowed is None else ctx._replace(windowed=windowed[i])
                    x, (k, v) = self.block(c, x, layer_ctx, layer)
                new_k.append(k)
                new_v.append(v)
            cache = cache._replace(k=tuple(new_k), v=tuple(new_v), index=cache.index + tokens.shape[1])
        if stem.final_norm:
            x = norm(stem.final_norm, c.d_model, c.layer_norm_eps, "ln_f")(x)
        x = x[:, -1:] if last_only else x
        if logit_positions is not None:
            x = jnp.take_along_axis(x, logit_positions[..., None], axis=1)
        if stem.embed_proj:
            x = dense("btd,dp->btp", x, parallel.weight("project_out", (c.d_model, stem.embed_proj),
                                                         ("embed", "embed_proj"), 1, normal(0.02), x.dtype))
        if hidden:
            return x, cache
        if c.classifier:
            logits = score_head(x, c.num_labels)
            return (logits, cache, stats) if routers else (logits, cache)
        head, weights = lm_head(c, self.padded_vocab, embedding, x.dtype)
        out = on_head(head, weights, x) if on_head is not None else head(weights, x)
        return (out, cache, stats) if routers else (out, cache)


def lm_head(c: ModelConfig, padded_vocab: int, embedding: Embedding, dtype) -> tuple[Callable, tuple]:
    """(head, weights), head(weights, x [b, t, D]) -> local logits [b, t, V/mp] float32 a pure
    function (the weights read here, in the calling module): the tied or own projection, Granite's
    divisor, Gemma 2's soft cap."""
    stem = c.stem()
    project, weights = embedding.projection(dtype, c.n_vocab) if stem.tied else LMHead(
        c.d_model, padded_vocab, c.n_vocab, stem.head_bias).projection(dtype)
    return functools.partial(_head, project, stem.logit_divisor, stem.logit_softcap), weights


def _head(project: Callable, divisor: Optional[float], cap: Optional[float], weights, x):
    logits = project(weights, x)
    if divisor is not None:
        logits = logits / divisor
    return softcap(logits, cap)


def score_head(x, labels: int):
    """A classifier's head (HF's `score`, a Linear with no bias): x [B, T, D] -> [B, T, labels]
    float32, the whole of it on every mp shard. A sequence's scores are its last token's
    (`last_token_scores`)."""
    with hk.name_scope("score"):
        w = parallel.weight("score", (x.shape[-1], labels), ("embed", "labels"), 1, normal(0.02), x.dtype)
    return dense("btd,dl->btl", x, w, jnp.float32)


def score_from_lm_head(c: ModelConfig, params: dict, token_ids: Sequence[int]) -> tuple[ModelConfig, dict]:
    """A language model's config and params (stacked, numpy or jax) -> a classifier whose scores
    are its logits of `token_ids` at the last token (vLLM's `classifier_from_token`: a yes/no
    reranker or judge served as a classifier). Two tokens make one label, the second's logit minus
    the first's: its sigmoid is the second token's probability among the two (Qwen3-Reranker's
    P("yes") against "no"). More make a label each, its token's logit: their softmax is each
    token's probability among them. The head's rows are copied into the score head (divided by a
    Granite's `logits_scaling`); a head with a bias or soft-capped logits (Gemma 2) has no such
    linear reading: ConfigError."""
    import numpy as np

    stem = c.stem()
    if c.classifier:
        raise ConfigError(f"the model is a classifier already (num_labels {c.num_labels})")
    if stem.head_bias or stem.logit_softcap is not None:
        raise ConfigError(f"family {c.family!r}: its logits are not a linear reading of the last hidden state "
                          f"({'a bias on the head' if stem.head_bias else 'soft-capped logits'}), so its tokens' "
                          f"logits cannot become a score head")
    if len(token_ids) < 2 or len(set(token_ids)) != len(token_ids):
        raise ConfigError(f"classifier tokens: two or more different tokens, got ids {list(token_ids)}")
    bad = [t for t in token_ids if not 0 <= t < c.n_vocab]
    if bad:
        raise ConfigError(f"classifier tokens: ids {bad} are outside the vocabulary of {c.n_vocab}")
    out = {m: dict(leaves) for m, leaves in params.items()}
    ids = np.asarray(token_ids)  # (the tokens' rows alone leave the devices)
    rows = np.asarray(out[f"{c.family}/embed"]["embeddings"][ids]).T if stem.tied else \
        np.asarray(out.pop(f"{c.family}/head")["lm_head"][:, ids])  # [width, tokens]
    rows = rows.astype(np.float32)
    score = rows[:, 1:] - rows[:, :1] if len(token_ids) == 2 else rows
    if stem.logit_divisor is not None:
        score = score / stem.logit_divisor
    out[f"{c.family}/score"] = {"score": score}
    return dataclasses.replace(c, num_labels=score.shape[1]), out


def last_token_scores(scores, last):
    """A classifier's outputs [B, T, L] at each row's last token `last` [B] -> [B, L] (HF's
    ForSequenceClassification pools so: the last token that is not padding)."""
    return jnp.take_along_axis(scores, last[:, None, None], axis=1)[:, 0]


def _neftune(x, alpha: float):
    """`layers.neftune` on the token embeddings x, drawn per dp shard (the same on every mp shard)."""
    return layers.neftune(x, alpha, jax.random.fold_in(hk.next_rng_key(), parallel.dp_index()))


def scanned_layers(c: ModelConfig, family_block: Callable, x, ctx: Context, windowed: Optional[tuple[bool, ...]],
                   routers: bool = False):
    """The layers stacked and scanned (training, scoring); `windowed` (per layer, or None: the same
    in all) goes in as each layer's `ctx.windowed`. `routers`: -> (x, the mixture layers'
    `RouterStats` summed over layers)."""
    def block(x, *flags):
        with layers.routers_recorded() as seen:
            x = family_block(c, x, ctx if windowed is None else ctx._replace(windowed=flags[0]))[0]
        if not routers:
            return (x, None) if flags else x
        return x, jax.tree.map(lambda *a: sum(a), *seen)

    if c.remat != "none":
        block = hk.remat(block, policy=REMAT_POLICIES[c.remat])
    per_layer = windowed is not None or routers  # (a per-layer input: the scan then collects per-layer outputs)
    # scan_layers=False unrolls the scan (parameters stay stacked): no while loop, so XLA need not
    # copy each layer's saved activations into [L, ...] stacks for the backward
    unroll = 1 if c.scan_layers else c.layers
    stack = hk.layer_stack(c.layers, with_per_layer_inputs=per_layer, unroll=unroll, name=STACKED)(block)
    if not per_layer:
        return stack(x)
    x, stats = stack(x, jnp.asarray(windowed if windowed is not None else (False,) * c.layers))
    return (x, jax.tree.map(lambda a: a.sum(0), stats)) if routers else x


def _context(shape, cache: Optional[KVCache], segments=None, key_keep=None,
             shared: Optional[SharedPrefix] = None) -> Context:
    """Positions, mask [B, 1, 1, T, S] and key positions for `shape` = (B, T) new tokens.

    segments [B, T]: positions count from each segment's first token and attention stays inside a
    segment, so a packed row computes what its examples would one by one. key_keep [B, T]: keys
    that no query may attend to where False.
    """
    batch, t = shape
    if cache is None:
        mask = jnp.tril(jnp.ones((t, t), dtype=bool))[None]  # [1, T, S]
        if segments is None:
            positions = jnp.broadcast_to(jnp.arange(t), shape)
        else:
            positions = segment_positions(segments)
            mask = mask & (segments[:, :, None] == segments[:, None, :])
        if key_keep is not None:
            mask = mask & key_keep[:, None, :]
        return Context(positions, mask[:, None, None], positions, causal=segments is None and key_keep is None)
    slots = cache.index + jnp.arange(t)  # [T]
    offset = 0 if cache.offset is None else cache.offset[:, None]
    positions = jnp.maximum(slots[None, :] - cache.start[:, None], 0) + offset
    keys = jnp.arange(cache.slots)  # [S]
    mask = (keys[None, None, :] <= slots[None, :, None]) & (keys[None, None, :] >= cache.start[:, None, None])
    return Context(positions, mask[:, None, None], keys[None, :] - cache.start[:, None] + offset, cache.index,
                   shared_positions=None if shared is None else shared.positions)


def segment_positions(segments):
    """segments [B, T] -> [B, T] int32: each token's position inside its segment (0 at its first token)."""
    t = jnp.arange(segments.shape[1])
    first = jnp.concatenate([jnp.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], axis=1)
    return (t - jax.lax.cummax(jnp.where(first, t, 0), axis=1)).astype(jnp.int32)


def unstacked(i: int) -> str:
    """Name scope of layer i when layers run unrolled (parameters "<family>/layer_{i}/...")."""
    return f"layer_{i}"


def unstacked_modules(module: str, layers: int) -> list[tuple[str, Optional[int]]]:
    """[(per-layer module name, layer index)] for a stacked module, [(module, None)] for others."""
    root, _, rest = module.partition(f"/{STACKED}/")
    return [(f"{root}/{unstacked(i)}/{rest}", i) for i in range(layers)] if rest else [(module, None)]


def unstack_layers(params, layers: int, convert=lambda path, x: x):
    """Scanned parameters -> the per-layer ones the unrolled (KV-cache) model reads.

    "gptj/layers/attn" [L, ...] becomes "gptj/layer_0/attn" ... "gptj/layer_{L-1}/attn"; other
    modules are kept. `convert((stacked module, leaf), array)` makes each output leaf (e.g. casts
    and places it), one at a time.
    """
    return {new: {name: convert((module, name), x if i is None else x[i]) for name, x in leaves.items()}
            for module, leaves in params.items() for new, i in unstacked_modules(module, layers)}


# --------------------------------------------------------------------------------------------
# Model: the transformed network and what is derived from its parameters' declarations
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Model:
    """A family's network for `config`, vocabulary padded for `mp` shards.

    init(rng, tokens) -> params (layers stacked); apply(params, tokens, cache=None, last_only=False)
    -> (logits, cache); with a cache, `params` are per-layer (`unstack_layers`).
    """

    config: ModelConfig
    mp: int
    transformed: hk.Transformed
    lora: Optional[parallel.LoRAPlan] = None  # adapters on the weights it targets (their leaves end _lora_a/_lora_b)

    def init(self, rng, tokens=None):
        tokens = jnp.zeros((1, min(8, self.config.seq)), jnp.int32) if tokens is None else tokens
        return self.transformed.init(rng, tokens)

    def apply(self, params, tokens, cache: Optional[KVCache] = None, last_only: bool = False, *,
              segments=None, key_keep=None, logit_positions=None, shared: Optional[SharedPrefix] = None, rng=None,
              routers: bool = False, embed_noise: Optional[float] = None, hidden: bool = False,
              on_head: Optional[Callable] = None):
        """`rng`: LoRA dropout and NEFTune draw from it (None: neither). `routers` (training, no cache):
        also return the mixture layers' `layers.RouterStats`. `embed_noise`: NEFTune's alpha (needs `rng`).
        `hidden`: the final hidden states in place of the logits (embeddings). `on_head`: a loss of
        the output head and the hidden states in the logits' place (`Transformer`)."""
        return self.transformed.apply(params, rng, tokens, cache, last_only, segments, key_keep, logit_positions,
                                      shared, routers, embed_noise, hidden, on_head)

    @functools.cached_property
    def _declared(self):
        with parallel.recording() as record:
            params = jax.eval_shape(self.init, jax.random.key(0))
        return params, parallel.infos_for(params, record, STACKED)

    @property
    def abstract_params(self):
        """ShapeDtypeStructs of the (stacked, float32) parameters; nothing is allocated."""
        return self._declared[0]

    @property
    def infos(self):
        """`parallel.ParamInfo` of every parameter (same tree as `abstract_params`)."""
        return self._declared[1]

    def infos_like(self, params):
        """The ParamInfo tree matching `params`: stacked ones, or the per-layer ones generation reads."""
        if set(params) == set(self.infos):
            return self.infos
        return {new: dict(leaves) for module, leaves in self.infos.items()
                for new, _ in unstacked_modules(module, self.config.layers)}

    def param_specs(self, rules, params=None, inputs_last: bool = False):
        """PartitionSpecs of `params` (default: the stacked abstract ones) under `rules`."""
        params = self.abstract_params if params is None else params
        return parallel.param_specs(params, self.infos_like(params), rules, inputs_last)

    def rules(self, zero: bool, mp: int):
        """The partition table for this model on `mp` shards (kv heads replicated when they do not
        split; a mixture's experts split whole where its config asks for expert parallelism)."""
        return parallel.rules_for(zero, self.config.kv_split(mp), getattr(self.config, "expert_parallel", False))

    def check_mesh(self, mesh_shape, zero: bool) -> None:
        """ConfigError naming the key when this model does not split over a {'dp': .., 'mp': ..} mesh."""
        c, mp = self.config, mesh_shape[parallel.MP]
        if not c.kv_split(mp) and mp % c.kv_heads:
            from mesh_transformer.config import ConfigError
            raise ConfigError(f"config key 'n_kv_heads': {c.kv_heads} kv heads neither split over nor divide "
                              f"cores_per_replica (mp) = {mp}")
        parallel.check_divisibility(self.abstract_params, self.infos, dict(mesh_shape), self.rules(zero, mp))

    def n_params(self) -> int:
        """Unique parameters, unpadded vocabulary (what HF counts)."""
        return sum(self._unpadded_size(x, info) for x, info in _pairs(self.abstract_params, self.infos))

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6 x matmul parameters (a tied head counts as one) + attention
        scores and mixing, 2 x 2 x keys x N x H per layer forward, x 3 for training (PaLM appendix
        B; keys: seq, or a shorter sliding window in the layers that have one)."""
        c = self.config
        matmuls = sum(self._unpadded_size(x, info) * self._active_share(info)
                      for x, info in _pairs(self.abstract_params, self.infos)
                      if info.inputs or layers.EXPERT_SCORES in info.axes)
        if c.stem().tied:
            matmuls += c.n_vocab * (c.stem().embed_proj or c.d_model)
        window, windowed = c.attention().window, c.windowed_layers() or (True,) * c.layers
        keys = sum(window if window and on else c.seq for on in windowed)
        attention = 2 * 2 * keys * c.n_heads * c.head_dim
        return round(6 * matmuls + 3 * attention)

    def _active_share(self, info) -> float:
        """The share of a weight a token multiplies: of a mixture's experts [E, ...], the top k of E
        (its router [D, E] runs whole)."""
        c = self.config
        return c.experts_per_token / c.n_experts if info.experts else 1

    def _unpadded_size(self, x, info) -> int:
        axes = parallel.leaf_axes(info, x.ndim)
        return math.prod(self.config.n_vocab if a == "vocab" else n for a, n in zip(axes, x.shape))


def _pairs(params, infos):
    return [(x, infos[m][n]) for m, leaves in params.items() for n, x in leaves.items()]


def build(config: ModelConfig, block: Callable, mp: int = 1, lora: Optional[parallel.LoRAPlan] = None) -> Model:
    padded = config.padded_vocab(mp)
    def forward(tokens, cache=None, last_only=False, segments=None, key_keep=None, logit_positions=None,
                shared=None, routers=False, embed_noise=None, hidden=False, on_head=None):
        with parallel.lora_plan(lora):
            return Transformer(config, block, padded)(tokens, cache, last_only, segments, key_keep, logit_positions,
                                                      shared, routers, embed_noise, hidden, on_head)
    transformed = hk.transform(forward)
    return Model(config, mp, transformed, lora)
