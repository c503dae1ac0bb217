"""Decode: prefill prompts into a KV cache, then decode inside one compiled loop (`Generator`).

    gen = Generator(config, params, mesh)
    [out] = gen.generate([[15496, 995]], [SamplingOptions(max_new_tokens=32, temperature=0)])
    out.tokens, out.logprobs, out.finish_reason

A batch is a fixed set of rows sharing one `model.KVCache` (per layer k [B, N, H, S] and
v [B, N, S, H]), a shared write index and a per-row first valid slot. Requests join a batch
(`admit`: prefill, write the prompt's keys/values ending at the shared index, sample the first
token) and leave it (EOS, stop sequence, length, or the host retiring them) independently, so a
server can add requests while others decode (`Batch`, also what `generate` uses). Rows whose
prompts start with prefix-cache blocks can read those from the cache's pool instead of their own
slots (`SharedPrefix`, read once per step for all rows; see `admit` and `decode`).

Sharding is training's: parameters by the MEGATRON table (split into per-layer arrays, see
`models.core.unstack_layers`), the cache with heads over 'mp' and rows over 'dp', the model inside
`parallel.shard_map`. Each step all-gathers the last position's [B, V/mp] logits over 'mp' and
every mp shard samples the same token from the whole vocabulary.
One row per sequence is cheap next to the weights each step reads, and it keeps sampling exact:
top-p needs the sorted full distribution, which a vocab-parallel top-k only approximates.

With `speculate=k` a pass of the model checks k tokens each row drafts from its own text besides
its last one (`lookup`, `accept`): the same tokens in fewer passes where text repeats.

Compiles are bounded by buckets: batch rows, prompt length, cache slots and chunk length are
powers of two (`bucket`), so a new prompt length rarely means a new program.

Shape letters: B batch rows, T prompt tokens, S cache slots, K decode steps per call, V padded
vocabulary, L layers, N heads, H head dim.
"""
from __future__ import annotations

import collections
import functools
import gc
import logging
import math
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple, Optional, Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from mesh_transformer import host_memory, kernels, lora, models, parallel
from mesh_transformer.config import ConfigError, ModelConfig
from mesh_transformer.generate import lookup, structured
from mesh_transformer.generate.sampling import (EOS, LENGTH, MAX_EOS, MAX_LOGIT_BIAS, MAX_STOPS, RUNNING, STOP,
                                                STOP_TOKENS, TOP_LOGPROBS, RowOptions, SamplingOptions, choose,
                                                constrain, log_probs, penalize, steer, stop_hit, _none)
from mesh_transformer.models.core import KVCache, SharedPrefix, unstacked_modules
from mesh_transformer.models.layers import FUSED, dynamic_slice, update_slice

if TYPE_CHECKING:
    from mesh_transformer.generate.batching import Sequence
    from mesh_transformer.lora import AdapterSet
    from mesh_transformer.generate.prefix import Plan, PrefixCache

log = logging.getLogger(__name__)

MIN_BUCKET = 16
# A decode call's window of the cache is at least the slots whose keys and values (of the rows it
# computes) weigh this share of the weights a step reads: below it a smaller window saves less
# than a percent or two of the step (the 4 x 512 GPT-J of 2,048 positions, 2 rows: 515 tok/s over
# 16 slots or 128, 504 over 256), while every window size is one more program to compile (1-3 s
# each on a 2-core CPU, mostly a fixed cost: sampling, the loop) and to hold under the process's
# limit of memory maps.
WINDOW_SHARE = 1 / 64
# XLA:CPU hands matmuls to YNNPACK by default. For the decode step's few-row float32 matmuls its
# own kernels are faster (bench/decode.py on the AVX2 EPYC, 200M GPT-J: 16 rows 145 -> 201 tok/s,
# one row 41 -> 43), while prefill's many-row matmuls are faster with YNNPACK (16 x 32 tokens:
# 671 vs 884 ms), so only the float32 decode program with inputs-first weights leaves it out (with
# inputs-last ones the kernels' dot products take 1-64 rows, and XLA's own product of more rows
# with such weights is many times slower than YNNPACK's: 4 rows of a tied head 944 against 54 ms;
# on the Zen 4 batch 16 / 64 decode measured the same either way). 16-bit decode keeps YNNPACK:
# XLA's own kernels take no bf16 operands, so without it every bf16 weight is converted to a
# float32 copy, hoisted out of the decode loop and held for the call (2x the weights' bytes).
DECODE_CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}
# Decode batches in 16-bit dtypes have at least 2 rows where XLA runs their products: with one,
# XLA:CPU turns each bf16 matmul into a conversion of the weights plus a float32 matvec (10x
# slower). A spare row costs little: decode reads every weight once per step whatever the batch.
# float32 keeps one row (XLA:CPU's matvec reads weights faster than its 2-row matmul), and so does
# bfloat16 on CPU where `kernels` built its bf16 product (which reads one row's weights at memory speed).
MIN_ROWS_16BIT = 2
# Speculative decoding (`Generator(speculate=k)`, `lookup`): at most this many draft tokens a step,
# drafted from the longest of a row's last LOOKUP_NGRAM .. 1 tokens seen before.
MAX_SPECULATE = 16
LOOKUP_NGRAM = 3
MAX_LOOKUP_NGRAM = 8  # (the lookup compares n shifted copies of the history for each n)


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """The power of two >= max(n, minimum): the shapes programs are compiled for."""
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def fine_bucket(n: int, per_octave: int = 4, grain: int = 8) -> int:
    """`per_octave` sizes per power of two, multiples of `grain` (..., 32, 40, 48, 56, 64, 80, 96, ...):
    the token lengths prompts are padded to (at most about 1/per_octave of a pass is padding, for a
    few more compiled shapes than powers of two alone: a 133-token prompt runs as 160, not 256)."""
    return round_up(max(n, 1), max(grain, bucket(n, 1) // (2 * per_octave)))


def weight_bytes_per_step(params, config: ModelConfig) -> int:
    """The bytes of `params` (a Generator's) one decode step reads: every weight once (a quantized
    one: its int8 values and scales), except an untied embedding table (one row per sequence), a
    tied one being the head's weight too, and of a mixture's experts only the k of E that one token
    runs (batch 1's least)."""
    untied_embed = any(module.startswith(f"{config.family}/head") for module in params)
    embed = parallel.bytes_of(params[f"{config.family}/embed"]) if untied_embed else 0
    experts = sum(parallel.bytes_of(x) for leaves in params.values() for n, x in leaves.items()
                  if n.startswith("experts_"))
    idle = experts - experts * config.experts_per_token // config.n_experts if experts else 0
    return parallel.bytes_of(params) - embed - idle


def computed_and_read(lengths: Seq[int], cached: Seq[int]) -> tuple[int, list[int]]:
    """An admission of prompts of these lengths, with `cached` of each in the prefix cache ->
    (the tokens its prefill computes per row, the first tokens of each prompt it reads from the
    pool instead; at most `cached`)."""
    t = prefill_width(max(n - c for n, c in zip(lengths, cached)))
    return t, [max(0, n - t) for n in lengths]


def prefill_width(uncached: int) -> int:
    """The tokens a prefill computes per row: the longest prompt part not read from the prefix
    cache, bucketed (4 sizes per power of two)."""
    return fine_bucket(uncached, grain=MIN_BUCKET)


def span_bucket(n: int) -> int:
    """The slot spans a cache move copies, and the write indices a batch moves to (`Batch.plan`):
    4 sizes per power of two, so the 1,166 slots of a prompt behind a 1,000-token prefix move as
    1,280 — as 2,048 they could not move at all in a 2,048-slot cache, and the whole cache rolled
    (seconds at 64 rows, every request waiting)."""
    return fine_bucket(n, grain=MIN_BUCKET)


# --------------------------------------------------------------------------------------------
# Decode state and the per-step update shared by prefill and decode
# --------------------------------------------------------------------------------------------

class DecodeState(NamedTuple):
    """Everything on device for one batch of rows. Per-row arrays are [B]."""

    cache: KVCache
    rows: RowOptions
    last: Any  # last sampled token: the next decode step's input
    done: Any  # bool; free rows are done
    n_generated: Any
    reason: Any  # RUNNING / EOS / STOP / LENGTH
    counts: Any  # [B, V] int32: each token's count in the output (frequency/presence penalties)
    seen: Any  # [B, V] bool: in the prompt or output (repetition penalty)
    recent: Any  # [B, STOP_TOKENS] last output tokens (stop sequences); -2 before any
    allowed: Any  # [B, W] int32: a guided row's allowed next tokens, a bit each (`structured`); the host writes it
    history: Any  # [B, C] int32: each row's prompt and output by position, for drafts (`lookup`; C = 0 without)
    length: Any  # [B] int32: how many of them are the row's
    passes: Any  # [B] int32: passes of the model the last decode call made while the row ran


class Emitted(NamedTuple):
    """Tokens produced by one step (leading [B]) or one decode call ([B, K]); token -1 = none."""

    token: Any
    logprob: Any  # log p(token) under the model (before penalties, temperature and truncation); NaN if no row asked
    top_ids: Any  # [..., TOP_LOGPROBS]
    top_logprobs: Any


def accept(state: DecodeState, logits, draft) -> tuple[DecodeState, Emitted, Any]:
    """Speculative decoding's check (`lookup`): logits [B, 1+k, V] of each row's last token and its
    k `draft` tokens [B, k] -> (the state after the tokens kept, Emitted [1+k, B], how many a
    row kept). Each row's sampling chooses a token at each position in turn, as one-at-a-time
    decoding would, while the tokens chosen so far are the draft's; every row then keeps as many as
    the running row that kept the fewest (its first token, and one more for each draft token
    chosen), as they share the write index. A row that finished on the way does not hold the others
    back (it keeps what it chose up to its end)."""
    per_position = jnp.swapaxes(logits, 0, 1)  # [1+k, B, V]
    drafted = jnp.concatenate([jnp.swapaxes(draft, 0, 1), jnp.full((1, draft.shape[0]), lookup.NO_DRAFT)])
    running = ~state.done

    def check(carry, at):
        probe, going, kept = carry
        logits, drafted = at
        probe, e = emit(probe, logits, going)
        kept = kept + going
        return (probe, going & ~probe.done & (e.token == drafted), kept), None

    zeros = jnp.zeros_like(state.n_generated)
    (probe, _, kept), _ = jax.lax.scan(check, (state, running, zeros), (per_position, drafted))
    held_back = running & ~probe.done  # a row that ended keeps its tokens up to its end whatever the rest keep
    fewest = jax.lax.pmin(jnp.min(jnp.where(held_back, kept, per_position.shape[0])), parallel.DP)

    def take(s, at):
        i, logits = at
        return emit(s, logits, ~s.done & running & (i < fewest))

    state, out = jax.lax.scan(take, state, (jnp.arange(per_position.shape[0]), per_position))
    return state, out, fewest


def _recorded(state: DecodeState, tokens) -> DecodeState:
    """`state` with each row's new tokens [B, n] (-1: none) after its history (`lookup.record`)."""
    history, length = lookup.record(state.history, state.length, tokens)
    return state._replace(history=history, length=length)


def emit(state: DecodeState, logits, active) -> tuple[DecodeState, Emitted]:
    """Sample a token for each `active` row from its full-vocabulary logits [B, V]; update the row.

    Work over [B, V] that no row asked for (bias, penalties, a grammar, top log-probs) is skipped
    (`lax.cond`). The bias comes before the penalties, as in transformers and vLLM (a repetition
    penalty scales it); a grammar's mask after them, so no penalty can bring back a token it forbids.
    """
    rows = state.rows
    steered = jnp.any(active[:, None] & (rows.bias_ids >= 0)) | jnp.any(active & (state.n_generated < rows.min_new))
    scores = jax.lax.cond(steered, lambda: steer(logits, rows, state.n_generated), lambda: logits)
    penalized = (rows.repetition_penalty != 1) | (rows.frequency_penalty != 0) | (rows.presence_penalty != 0)
    scores = jax.lax.cond(jnp.any(active & penalized), lambda: penalize(scores, state.counts, state.seen, rows),
                          lambda: scores)
    scores = jax.lax.cond(jnp.any(active & rows.guided), lambda: constrain(scores, rows, state.allowed),
                          lambda: scores)
    token = choose(scores, rows, state.n_generated)
    b = jnp.arange(token.shape[0])
    logprob, top_logprobs, top_ids = jax.lax.cond(
        jnp.any(rows.top_logprobs >= 0), lambda: log_probs(logits, token, rows.top_logprobs),
        lambda: _none(token))

    n_generated = state.n_generated + active
    recent = jnp.where(active[:, None], jnp.concatenate([state.recent[:, 1:], token[:, None]], 1), state.recent)
    why = jnp.where(jnp.any(token[:, None] == state.rows.eos, axis=-1), EOS,
                    jnp.where(stop_hit(recent, state.rows.stops) & (state.n_generated >= rows.min_new), STOP,
                              jnp.where(n_generated >= state.rows.max_new, LENGTH, RUNNING)))
    finished = active & (why != RUNNING)
    state = state._replace(
        last=jnp.where(active, token, state.last),
        done=state.done | finished,
        n_generated=n_generated,
        reason=jnp.where(finished, why, state.reason),
        counts=state.counts.at[b, token].add(active.astype(jnp.int32)),
        seen=state.seen.at[b, token].max(active),
        recent=recent)
    out = Emitted(jnp.where(active, token, -1), logprob, top_ids, top_logprobs)
    return state, out


KV_SPEC = P(parallel.DP, parallel.MP, None, None)  # each layer's k and v: rows over dp, heads over mp
POOL_SPEC = P(None, parallel.MP, None, None)  # the prefix cache's pool: one row, heads over mp
SHARED_SPEC = P(parallel.MP, None, None)  # a SharedPrefix's k and v: heads over mp


def shared_specs(layers: int) -> SharedPrefix:
    """PartitionSpecs of a SharedPrefix: k and v heads over 'mp', positions' rows over 'dp'."""
    return SharedPrefix((SHARED_SPEC,) * layers, (SHARED_SPEC,) * layers, P(parallel.DP, None))


def state_specs(layers: int) -> DecodeState:
    """PartitionSpecs: rows over 'dp'; the cache's heads over 'mp' as well."""
    row, row2, kv = P(parallel.DP), P(parallel.DP, None), (KV_SPEC,) * layers
    return DecodeState(
        cache=KVCache(kv, kv, row, P(), row),
        rows=RowOptions(**{**dict.fromkeys(RowOptions._fields, row), "eos": row2, "bias_ids": row2, "bias": row2,
                           "stops": P(parallel.DP, None, None)}),
        last=row, done=row, n_generated=row, reason=row, counts=row2, seen=row2, recent=row2, allowed=row2,
        history=row2, length=row, passes=row)


def _write_entry(bank: dict, updates: dict, entry):
    """Each bank leaf with its update (the same leaf with an adapters axis of size 1) written at `entry`."""
    out = {}
    for key, x in bank.items():
        update = updates[key].astype(x.dtype)
        at = next(d for d in range(x.ndim) if update.shape[d] == 1 < x.shape[d])  # the adapters axis
        out[key] = jax.lax.dynamic_update_slice(x, update, [entry if d == at else 0 for d in range(x.ndim)])
    return out


def _roll_cache(cache: KVCache, shift) -> KVCache:
    """Move every row's slots by `shift` (positions are slot - start, so they do not change): a
    copy of the whole cache (seconds for a 64-row cache on a CPU), for `Generator.move` only when
    the running rows' span cannot move in one piece."""
    rolled = cache.along_slots(lambda x, axis: jnp.roll(x, shift, axis))
    return rolled._replace(start=cache.start + shift, index=cache.index + shift)


def _move_slots(cache: KVCache, source, shift, size: int):
    """(One device's cache.) Move slots source .. source+size-1 of every row by `shift` (both spans
    inside the cache): the running rows' span, bucketed, instead of the whole cache (`_roll_cache`): 0.3 s instead of
    3-5 s for a 64-row, 2,048-slot cache of the 64M GPT-J when the span is 256 slots."""
    def move(x, axis):
        starts = [0] * x.ndim
        starts[axis] = source + shift
        return update_slice(x, jax.lax.dynamic_slice_in_dim(x, source, size, axis), starts)
    return cache.along_slots(move, as_bits=False)._replace(start=cache.start + shift, index=cache.index + shift)


def _window(cache: KVCache, rows: int, first_slot, window: int) -> KVCache:
    """(One device's cache.) Rows 0 .. rows-1 of `cache`, slots first_slot .. first_slot+window-1
    (a copy; the cache itself when that is all of it), relabelled so that the window starts at 0."""
    def window_of(x, axis):
        if (rows, window) == (x.shape[0], x.shape[axis]):
            return x  # the whole cache (first_slot is 0), decoded in place
        starts, sizes = [0] * x.ndim, [rows, *x.shape[1:]]
        starts[axis], sizes[axis] = first_slot, window
        return dynamic_slice(x, starts, sizes)
    view = cache.along_slots(window_of, as_bits=False)  # dynamic_slice: any dtype
    return view._replace(start=cache.start[:rows] - first_slot, index=cache.index - first_slot,
                         offset=cache.offset[:rows])


def _put_back(full: KVCache, decoded: KVCache, view_index, first_slot, steps: int) -> KVCache:
    """(One device's cache.) `full` updated with what a decode call of `steps` steps wrote into its
    `_window` (`decoded`, whose writes began at `view_index`): those slots only, in place."""
    rows, window = decoded.start.shape[0], decoded.slots
    if rows == full.start.shape[0] and window == full.slots:
        cache = decoded  # the window was the whole cache, updated in place
    else:
        span = min(steps, window)
        written = jnp.clip(view_index, 0, window - span)

        def put_back(whole, part, axis):
            starts = [0] * whole.ndim
            starts[axis] = first_slot + written
            return update_slice(whole, jax.lax.dynamic_slice_in_dim(part, written, span, axis), starts)
        cache = full.along_slots(put_back, decoded, as_bits=False)  # update_slice: in place, any dtype
    return cache._replace(start=full.start.at[:rows].set(decoded.start + first_slot),
                          index=decoded.index + first_slot, offset=full.offset)


def _write_rows(cache: KVCache, new: KVCache, row_ids, first_slot, in_place: bool = False) -> KVCache:
    """Write the W slots of each row of `new` ([n, ..., W, ...] per layer) into row row_ids[i] of
    `cache`, at slots first_slot .. first_slot+W-1. Rows `row_ids` >= the batch are skipped (they
    come last). A negative `first_slot` is left padding before slot 0: those slots wrap round to
    the end of the written span, slots W+first_slot .. W-1, which follow the row's last prompt
    slot: the row writes each of them before it attends to it.

    One contiguous copy per row and array (a loop of dynamic_update_slice), not a scatter of
    every (row, slot) pair: XLA:CPU runs a scatter one element at a time (a third of a 16-row
    admission behind a 1,000-token cached prefix went to it). `in_place` (one device's arrays, all
    the rows in `cache` and `new`): by `layers.update_slice` — XLA:CPU wrote a bfloat16 row on its
    bits at 0.8 GB/s (26 ms of a 16-row GPT-J admission's ~190).
    """
    start = jnp.maximum(first_slot, 0)
    new = jax.lax.cond(first_slot < 0, lambda n: n.along_slots(lambda x, axis: jnp.roll(x, first_slot, axis)),
                       lambda n: n, new)
    batch = cache.v[0].shape[0]

    def write_row(i, arrays):
        def put(x, rows, axis):
            at = [row_ids[i]] + [0] * (x.ndim - 1)
            at[axis] = start
            return update_slice(x, jax.lax.dynamic_slice_in_dim(rows, i, 1, 0), at, kernel=in_place)
        k, v = arrays
        return (tuple(put(x, r, KVCache.K_SLOTS) for x, r in zip(k, new.k)),
                tuple(put(x, r, KVCache.V_SLOTS) for x, r in zip(v, new.v)))

    k, v = jax.lax.fori_loop(0, jnp.sum(row_ids < batch), write_row, (cache.k, cache.v))
    return cache._replace(k=k, v=v)


def _store(pool: KVCache, new: KVCache, slots, in_place: bool = False, after: tuple = ()) -> KVCache:
    """The prefix cache's pool (one row of M slots per layer's k and v) with the positions of `new`
    ([n, ..., W, ...] per layer) stored at pool slots `slots` [n, W] (M or more: not stored).
    `in_place` (one device's arrays): by `kernels.put_slots`, one copy per run of consecutive slots —
    XLA:CPU scattered a 16-bit pool on its bits, and converted the whole pool there and back
    (a 16-row bfloat16 GPT-J admission: 200 ms, 133 without the prefix cache) — after the arrays
    `after` are computed."""
    kernel = in_place and kernels.available()

    def store(x, computed, axis):  # x [1, .., M, ..] <- computed [n, .., W, ..]
        if kernel:
            return kernels.put_slots(x, computed, slots, axis, after)
        where = (slice(None),) * (axis - 1) + (slots,)
        return x[0].at[where].set(jnp.moveaxis(computed, 0, axis - 1), mode="drop")[None]
    return pool.along_slots(store, new, as_bits=not kernel)


# --------------------------------------------------------------------------------------------
# Generator: the compiled functions for one model on one mesh
# --------------------------------------------------------------------------------------------

class Generator:
    """Compiled prefill/decode for `params` on `mesh`; token ids in, token ids out.

    `params`: Haiku params as training keeps them (layers stacked; numpy or jax; vocabulary padded
    for the mesh's mp). The generator keeps its own copy, cast to `config.compute_dtype`, split
    into per-layer arrays and placed by the MEGATRON table, built one leaf at a time. With
    `donate=True` each of the caller's jax arrays is deleted once converted, so the weights are held
    once on the devices (peak: the caller's params plus the largest leaf or fused group, q/k/v); the
    caller must not use them afterwards (`loading.LoadedModel.generator` does this).

    `matvec`: the weights' layout. Inputs-last (their `ParamInfo.inputs` axes last, as torch stores
    them) makes each output the dot product of two contiguous rows, which `kernels.rows_dot_weight`
    computes for 1-64 rows (a decode step's, a serving batch's) faster than any product of
    inputs-first weights: float32 with AVX-512, bf16 with AVX-512-BF16 (on a Zen 4, 1.3-1.7x the
    inputs-first kernels' products; bf16 batch-1 decode +42-70%). None (the default): inputs-last
    wherever those kernels run for the compute dtype, inputs-first elsewhere. True: inputs-last
    also for float32 without them (XLA's matrix-vector product: about 12% faster at batch 1, while
    its matmuls of 2 rows or more read such weights many times slower, a [2, 4096] x [4096, 8192]
    product 30x; `device_sample.py`, one row at a time). bf16 stays inputs-first without the
    kernels (XLA's bf16 products of such weights: 10-20x slower). False: inputs-first.

    `quantize="int8"`: weight-only quantization of every matmul weight (attention, MLP, a mixture's
    experts, head; not the embedding table or a router): int8 values with a float32 scale per
    output column, of each expert's weight for a mixture (the largest |w| of the column / 127,
    round to nearest), so decoding reads a byte a weight; activations, norms, the
    KV cache and the arithmetic stay in `config.compute_dtype` / float32; weights inputs-first.

    `fuse` (default True): each layer's q/k/v projections stored as one weight, and SwiGLU's gate
    and up as one (`models.layers.FUSED`; where their heads split alike over mp: not GQA's kv heads
    replicated over more shards than they number), so a step makes one product for each group.
    The decode layout only: training and checkpoints keep the leaves apart.

    `adapters` (a `lora.AdapterSet`): LoRA adapters served beside the base, unmerged, each request
    choosing one (its row's `RowOptions.adapter`, an entry of the bank: 1 .. slots; 0 the base
    alone), so one batch decodes rows of several fine-tunes together (`layers.dense` of a
    `parallel.AdapterBank`). The set's first adapters fill the entries; `write_adapter` replaces an
    entry's between calls (the bank's arrays are the programs' arguments: nothing recompiles).
    Weights are then not fused (an adapter of q alone would need the fused leaf's other parts padded).

    `speculate=k` (0: off): speculative decoding by prompt lookup (`lookup`): a pass of the model
    checks each row's last token and k tokens drafted from its own text, keeping the ones its
    sampling chooses, so the same tokens (up to float rounding) come out in fewer passes where text
    repeats. It applies to decode calls while at most `speculate_rows` rows run (default 1: a lone
    request; `decode`'s `running`): the rows share the cache's write index, so a pass keeps as many
    tokens as the row that kept the fewest, and over many rows the drafts' positions cost compute
    that rarely pays. `lookup_ngram`: the longest run of last tokens a draft looks up (at most
    MAX_LOOKUP_NGRAM).

    A classifier's (`ModelConfig.classifier`) Generator holds its weights for scoring passes
    (`evaluate.scoring.Scorer.classify`, the server's `/classify`) and decodes nothing: `new_state`
    and `new_pool`, where every generation starts, raise ConfigError.
    """

    QUANTIZE = ("int8",)

    def __init__(self, config: ModelConfig, params, mesh: Mesh, matvec: Optional[bool] = None, donate: bool = False,
                 quantize: Optional[str] = None, fuse: bool = True, adapters: Optional["AdapterSet"] = None,
                 speculate: int = 0, lookup_ngram: int = LOOKUP_NGRAM, speculate_rows: int = 1):
        if quantize not in (None, *self.QUANTIZE):
            raise ValueError(f"quantize must be one of {self.QUANTIZE} or None, got {quantize!r}")
        if not 0 <= speculate <= MAX_SPECULATE:
            raise ValueError(f"speculate: draft tokens a step must be 0 (off) .. {MAX_SPECULATE}, got {speculate}")
        if not 1 <= lookup_ngram <= MAX_LOOKUP_NGRAM or speculate_rows < 1:
            raise ValueError(f"lookup_ngram must be 1 .. {MAX_LOOKUP_NGRAM} and speculate_rows at least 1, got "
                             f"{lookup_ngram} and {speculate_rows}")
        self.speculate, self.lookup_ngram = speculate, lookup_ngram
        self.speculate_rows = speculate_rows if speculate else 0
        if config.classifier and adapters is not None:
            raise ConfigError(f"a classifier (num_labels {config.num_labels}) is served whole: LoRA adapters "
                              f"of it are not (merge one first)")
        self.config, self.mesh, self.quantize = config, mesh, quantize
        float32 = jnp.dtype(config.compute_dtype).itemsize >= 4
        one_row = float32 or (jnp.dtype(config.compute_dtype) == jnp.bfloat16 and kernels.available())
        self.min_rows = 1 if one_row else MIN_ROWS_16BIT
        on_cpu = mesh.devices.flat[0].platform == "cpu"
        dot = on_cpu and kernels.dot_kernel(config.compute_dtype)
        inputs_last = quantize is None and (dot if matvec is None else bool(matvec) and (float32 or dot))
        self.layout = parallel.Layout(inputs_last, fuse and adapters is None)
        self.adapters = adapters
        self.residents: list = [None] * (adapters.plan.adapters if adapters is not None else 1)  # entry -> ServedAdapter
        self.mp, self.dp = mesh.shape[parallel.MP], mesh.shape[parallel.DP]
        self.model = models.build(config, self.mp)
        self.model.check_mesh(mesh.shape, zero=False)
        self.vocab = config.padded_vocab(self.mp)
        self.rules = self.model.rules(False, self.mp)
        self.params = self._place(params, donate)
        if adapters is not None:
            self._place_bank(adapters)
        self.param_specs = jax.tree.map(lambda x: x.sharding.spec, self.params)
        self.weight_bytes = weight_bytes_per_step(self.params, config)
        itemsize = jnp.dtype(config.compute_dtype).itemsize
        self.slot_bytes = 2 * config.layers * config.cache_heads(self.mp) * config.head_dim * itemsize  # a row's
        self.specs = state_specs(config.layers)
        self.shapes: set[tuple] = set()  # programs compiled so far (see `_note`)
        self.compiled: collections.Counter = collections.Counter()  # programs compiled, by kind (never cleared)
        # passes of the model decode calls made, summed over the rows running in each (with
        # `speculate`, the tokens they emitted per row-pass are 1 + the drafted ones kept)
        self.row_passes = 0
        self.shardings = parallel.named(mesh, self.specs)
        kv = (KV_SPEC,) * config.layers
        prefill_specs = (self.param_specs, P(parallel.DP, None), P(parallel.DP), P(parallel.DP))
        self._prefill = parallel.shard_map(
            self._prefill_local, mesh, self.rules, in_specs=prefill_specs,
            out_specs=(P(parallel.DP, None), kv, kv), layout=self.layout)
        self._prefill_after = parallel.shard_map(  # after cached keys/values (prefix caching)
            self._prefill_local, mesh, self.rules, in_specs=prefill_specs + (kv, kv),
            out_specs=(P(parallel.DP, None), kv, kv), layout=self.layout)
        self._prefill_shared = parallel.shard_map(  # after a SharedPrefix of pool slots
            lambda p, tokens, start, adapter, offset, shared: self._prefill_local(p, tokens, start, adapter, offset=offset,
                                                                                  shared=shared),
            mesh, self.rules, in_specs=prefill_specs + (P(parallel.DP), shared_specs(config.layers)),
            out_specs=(P(parallel.DP, None), kv, kv), layout=self.layout)
        self._new_state = jax.jit(self._empty, static_argnums=(0, 1), out_shardings=self.shardings)
        self.pool_sharding = jax.sharding.NamedSharding(mesh, POOL_SPEC)
        self._new_pool = jax.jit(lambda slots: KVCache.zeros(self.config, 1, slots, mp=self.mp)._replace(
            start=None, index=None), static_argnums=0, out_shardings=self.pool_sharding)
        self._admit = jax.jit(self._admit_rows, out_shardings=(self.shardings, self.pool_sharding, None),
                              donate_argnums=(1, 2))
        self._decode = jax.jit(self._decode_steps, static_argnums=(4, 5, 6), static_argnames="speculating",
                               donate_argnums=1,
                               out_shardings=(self.shardings, None),
                               compiler_options=DECODE_CPU_OPTIONS if on_cpu and float32 and not inputs_last else None)
        self._retire = jax.jit(lambda s, m: s._replace(done=s.done | m), out_shardings=self.shardings,
                               donate_argnums=0)
        move = lambda cache, source, shift, size: parallel.shard_map(  # noqa: E731 - in place on each device
            lambda c, source, shift: _move_slots(c, source, shift, size), mesh, self.rules,
            in_specs=(self.specs.cache, P(), P()), out_specs=self.specs.cache)(cache, source, shift)
        self._move = jax.jit(lambda s, source, shift, size: s._replace(cache=move(s.cache, source, shift, size)),
                             static_argnums=3, donate_argnums=0, out_shardings=self.shardings)
        self._roll = jax.jit(lambda s, shift: s._replace(cache=_roll_cache(s.cache, shift)),
                             donate_argnums=0, out_shardings=self.shardings)

    def min_window(self, rows: int) -> int:
        """The fewest cache slots a decode call of `rows` rows attends to (a power of two, at least
        MIN_BUCKET): the most whose keys and values weigh at most WINDOW_SHARE of the weights a
        step reads. A server's first steps and short requests then share the programs of longer
        ones: a 4 x 512 GPT-J (GPT-2's vocabulary) of 2,048 positions compiles 11 decode programs
        for 1 and 2 rows (floors of 128 and 64 slots), not 16."""
        floor = int(self.weight_bytes * WINDOW_SHARE) // max(1, rows * self.slot_bytes)
        return max(MIN_BUCKET, 1 << max(0, floor.bit_length() - 1))

    @property
    def inputs_last(self) -> bool:
        return self.layout.inputs_last

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """The names of the LoRA adapters in the bank's entries now (none without `adapters`)."""
        return tuple(a.name for a in self.residents if a is not None)

    @property
    def bank(self) -> Optional[parallel.BankPlan]:
        return self.adapters.plan if self.adapters is not None else None

    def _place(self, params, donate: bool):
        """Per-layer params in the compute dtype and the decode layout (`self.layout`: inputs-last,
        fused), on the mesh by the Megatron table; with `donate`, each source array is deleted once
        converted (a fused group's once the group is)."""
        dtype, out = jnp.dtype(self.config.compute_dtype), {}
        for module, leaves in params.items():
            infos = self.model.infos[module]
            for name, parts in self._groups(leaves, infos):
                info, made = infos[parts[0]], []
                for new, i in unstacked_modules(module, self.config.layers):
                    leaf = self._fused([leaves[p] if i is None else leaves[p][i] for p in parts], info)
                    if self.quantize and info.inputs > 0:  # a matmul weight
                        values, scale = self._quantized(leaf, info)
                        out.setdefault(new, {}).update({name: values, name + parallel.SCALE: scale})
                        continue
                    made.append(self._convert(leaf, info, dtype))
                    out.setdefault(new, {})[name] = made[-1]
                for x in (leaves[p] for p in parts):
                    if donate and isinstance(x, jax.Array) and not any(m is x for m in made):  # x may be kept as is
                        x.delete()
        return out

    def _place_bank(self, adapters: "AdapterSet") -> None:
        """Add the bank's leaves (A [*inputs, N, r], B [N, r, *outputs] per targeted weight, per layer)
        to the params, zeros in the compute dtype and the decode layout, sharded like the weights
        they adapt; then fill entries 1, 2, .. with the set's first adapters."""
        dtype = jnp.dtype(self.config.compute_dtype)
        self._entry_shapes = lora.entry_shapes(self.config, adapters.plan, self.mp)
        placed = {}
        for module, leaf, info, shape in self._bank_leaves():
            for new, i in unstacked_modules(module, self.config.layers):
                one = shape if i is None else shape[1:]
                at = len(one) - 1 if leaf.endswith(parallel.LORA_A) else 0  # A [*inputs, N, r], B [N, r, *outputs]
                bank = np.zeros((*one[:at], adapters.plan.adapters, *one[at:]), np.float32)
                self.params[new][leaf] = placed[(new, leaf)] = self._convert(bank, info, dtype)
        self._bank_shardings = {k: x.sharding for k, x in placed.items()}
        self._write_bank = jax.jit(lambda bank, updates, entry: _write_entry(bank, updates, entry), donate_argnums=0,
                                   out_shardings=self._bank_shardings)  # its own cache
        for entry, adapter in enumerate(adapters.adapters[: adapters.slots], start=1):
            self.write_adapter(entry, adapter)
        if not adapters.adapters:
            self.write_adapter(1, None)  # compile the writer now, not mid-traffic

    def _bank_leaves(self):
        """(module, leaf, its bank ParamInfo, one entry's shape, layers stacked) for every bank leaf."""
        for module, own in self._entry_shapes.items():
            infos = self.model.infos[module]
            for leaf, shape in own.items():
                base = leaf[: -len(parallel.LORA_A)]
                info = parallel.bank_infos(infos[base])[0 if leaf.endswith(parallel.LORA_A) else 1]
                yield module, leaf, info, shape

    def write_adapter(self, entry: int, adapter) -> None:
        """Put `adapter` (a `lora.ServedAdapter`, or None: zeros) in bank entry `entry` (1 .. slots),
        in place. Between device calls: rows under the entry read the new adapter from the next one."""
        if self.adapters is None or not 1 <= entry < self.adapters.plan.adapters:
            raise ValueError(f"adapter entry {entry} is not one of this generator's bank "
                             f"(1 .. {self.adapters.plan.adapters - 1 if self.adapters else 0})")
        current = {key: self.params[key[0]][key[1]] for key in self._bank_shardings}  # donated: deleted once written
        written = self._write_bank(current, self._entry_values(adapter), np.int32(entry))
        for (new, leaf), x in written.items():
            self.params[new][leaf] = x
        self.residents[entry] = adapter

    def adapter_params(self, adapter) -> dict:
        """A bank of one entry holding `adapter` (a `lora.ServedAdapter`): {layer module: {bank leaf:
        array}}, placed as the bank is. With the base params and `adapter_bank(self.solo_bank, rows
        of zeros)` a program runs every row with `adapter`, reading nothing `write_adapter` donates
        (the prompt scorer's way, from another thread than the engine's)."""
        out: dict = {}
        for (new, leaf), x in self._entry_values(adapter).items():
            out.setdefault(new, {})[leaf] = jax.device_put(x, self._bank_shardings[(new, leaf)])
        return out

    @property
    def solo_bank(self) -> Optional[parallel.BankPlan]:
        """The plan of `adapter_params`' bank: the bank's targets and rank, one entry."""
        return self.bank._replace(adapters=1) if self.bank is not None else None

    def _entry_values(self, adapter) -> dict:
        """{(layer module, bank leaf): `adapter`'s values (None: zeros)} as one entry of the bank: an
        adapters axis of size 1, the compute dtype, the decode layout. ConfigError if it does not fit."""
        if adapter is not None:
            lora.check_fits(adapter, self.adapters.plan)
            if adapter.leaves is None:
                raise ValueError(f"adapter {adapter.name!r}: its weights are not in host memory (--max-cpu-loras "
                                 f"dropped them; `serve.adapters.AdapterSlots.get` reads them again)")
        values = lora.bank_entry(adapter, self._entry_shapes)
        dtype = jnp.dtype(self.config.compute_dtype)
        out = {}
        for module, leaf, info, _ in self._bank_leaves():
            x = values[module][leaf]
            for new, i in unstacked_modules(module, self.config.layers):
                one = x if i is None else x[i]
                at = one.ndim - 1 if leaf.endswith(parallel.LORA_A) else 0
                order, _ = parallel.stored_layout(info, one.ndim + 1, self.inputs_last)
                out[(new, leaf)] = np.expand_dims(one, at).astype(dtype).transpose(order)
        return out

    def adapter_key(self, entry: int) -> int:
        """What a prefix cache keys rows under bank entry `entry` by (`lora.prefix_key`)."""
        return lora.prefix_key(self.residents[entry])

    def _groups(self, leaves, infos) -> list[tuple[str, tuple[str, ...]]]:
        """[(stored leaf, the leaves it holds)]: one each, or with `layout.fused` the `FUSED` groups
        whose leaves this module has and whose output axes split alike."""
        groups = []
        if self.layout.fused:
            groups = [(name, parts) for name, parts in FUSED.items() if all(p in leaves for p in parts)
                      and parallel.split_alike([infos[p].axes[infos[p].inputs] for p in parts], self.rules)]
        taken = {p for _, parts in groups for p in parts}
        return groups + [(name, (name,)) for name in leaves if name not in taken]

    def _fused(self, xs: list, info):
        """Leaves -> one, concatenated along their first output axis shard by shard (each mp
        shard's part of every leaf, in turn); a single leaf as it is."""
        if len(xs) == 1:
            return xs[0]
        axis = xs[0].ndim - len(info.axes) + info.inputs
        mesh_axis = self.rules.get(info.axes[info.inputs])
        shards = self.mesh.shape[mesh_axis] if mesh_axis else 1
        xp = np if all(isinstance(x, np.ndarray) for x in xs) else jnp
        pieces = [xp.split(x, shards, axis=axis) for x in xs]
        return xp.concatenate([piece[s] for s in range(shards) for piece in pieces], axis=axis)

    def _convert(self, x, info, dtype):
        x = x if x.dtype == dtype else x.astype(dtype)  # numpy or jax
        order, axes = parallel.stored_layout(info, x.ndim, self.inputs_last)
        return self._put(x.transpose(order), axes)

    def _put(self, x, axes):
        """x on the mesh, its logical `axes` placed by the Megatron table."""
        return jax.device_put(x, jax.sharding.NamedSharding(self.mesh, parallel.spec_for(axes, self.rules)))

    def _quantized(self, x, info):
        """A weight [*inputs, *outputs] -> (int8 values, float32 scale [*outputs]), placed as the weight
        and its output axes are. Symmetric per output column: scale = max |w| / 127."""
        values, scale = parallel.quantize(x, info)
        axes = parallel.stored_layout(info, values.ndim, False)[1]
        kept = [i for i in range(values.ndim) if i not in info.contracted]  # a mixture's: the experts axis and outputs
        return self._put(values, axes), self._put(scale, tuple(axes[i] for i in kept))

    # ---- device functions ---------------------------------------------------------------------

    def _empty(self, batch: int, slots: int) -> DecodeState:
        vocab = self.vocab
        i32 = lambda fill=0: jnp.full((batch,), fill, jnp.int32)
        rows = RowOptions(temperature=jnp.zeros(batch), top_k=i32(), top_p=jnp.ones(batch), min_p=jnp.zeros(batch),
                          repetition_penalty=jnp.ones(batch), frequency_penalty=jnp.zeros(batch),
                          presence_penalty=jnp.zeros(batch), seed=jnp.zeros(batch, jnp.uint32), max_new=i32(1),
                          eos=jnp.full((batch, MAX_EOS), -1, jnp.int32),
                          stops=jnp.full((batch, MAX_STOPS, STOP_TOKENS), -1, jnp.int32),
                          top_logprobs=i32(-1), adapter=i32(),
                          bias_ids=jnp.full((batch, MAX_LOGIT_BIAS), -1, jnp.int32),
                          bias=jnp.zeros((batch, MAX_LOGIT_BIAS), jnp.float32), min_new=i32(),
                          guided=jnp.zeros(batch, bool))
        cache = KVCache.zeros(self.config, batch, slots, mp=self.mp)._replace(offset=i32())
        return DecodeState(cache, rows, i32(),
                           jnp.ones(batch, bool), i32(), i32(), jnp.zeros((batch, vocab), jnp.int32),
                           jnp.zeros((batch, vocab), bool), jnp.full((batch, STOP_TOKENS), -2, jnp.int32),
                           jnp.zeros((batch, structured.mask_words(vocab)), jnp.int32),
                           jnp.zeros((batch, min(self.config.seq, slots) if self.speculate else 0), jnp.int32),
                           i32(), i32())  # (a row's positions: below its slots, prompt and output in them)

    def speculates(self, running: int, rows: int) -> bool:
        """Whether a decode call of `rows` rows (from row 0), `running` of them running, drafts:
        while at most `speculate_rows` run, and only in calls of about that many rows (each
        computed row's drafts cost compute, running or not)."""
        return 0 < running <= self.speculate_rows and rows <= bucket(self.speculate_rows, 1)

    def _prefill_local(self, params, tokens, start, adapter, cached_k=None, cached_v=None, offset=None, shared=None):
        """tokens [n, T] left-padded -> (last logits [n, V], k, v: per layer [n, N, C+T, H] (k: H, C+T)).
        adapter [n]: each row's entry in the adapter bank (see `adapters`).

        cached_k/v: per layer [n, N, H, C] / [n, N, C, H], the keys and values of the C slots before
        the tokens (prefix caching; none: C = 0). start [n]: each row's first valid slot of the C+T.
        Or `shared` (a SharedPrefix, C = 0): the tokens before each row's T read once for all rows,
        offset [n] of them (the position of each row's first valid slot).
        """
        n, t = tokens.shape
        cache = KVCache.zeros(self.config, n, t, start, self.mp, local=True)._replace(offset=offset)
        if cached_k is not None:
            join = lambda cached, empty, axis: jnp.concatenate([cached, empty], axis)  # noqa: E731
            cache = KVCache(cached_k, cached_v, None, None).along_slots(join, cache)
            cache = cache._replace(start=start, index=jnp.int32(cached_v[0].shape[KVCache.V_SLOTS]))
        with parallel.adapter_bank(self.bank, adapter):
            logits, cache = self.model.apply(params, tokens, cache, last_only=True, shared=shared)
        return parallel.all_gather_mp(logits[:, -1]), cache.k, cache.v

    def _admit_rows(self, params, state: DecodeState, pool: Optional[KVCache], tokens, lengths, row_ids,
                    rows: RowOptions, index, read, write, offsets, allowed, shared_slots=None, shared_positions=None):
        """Prefill `tokens` [n, W] into rows `row_ids` [n] (n >= batch: dropped) ending at slot `index`.

        Rows still running must already write at `index` (`move`): the cache is relabelled, not
        copied, so the program updates it in place. Each new row's prompt fills slots
        index-length .. index-1 and its first token is sampled.
        Prefix caching (`pool` not None): read [n, C] are pool slots whose keys/values the first C
        of the W slots take (M, the pool's size: none), so only the last W-C tokens are computed;
        write [n, W] the pool slot each of the W slots' keys/values go to afterwards (M: none).
        offsets [n]: the first tokens of each prompt that its row reads from the pool while it decodes
        (a `SharedPrefix`) rather than from its own slots, which then start after them; with
        shared_slots [U] and shared_positions [n, U] (see `decode`), the prefill reads them that
        way too (once for all rows, not a gathered copy per row), and only the last W-C slots are
        written to the rows. allowed [n, W]: each guided row's grammar mask for its first token.
        """
        n, w = tokens.shape
        c = 0 if read is None else read.shape[1]
        batch = state.last.shape[0]
        shift = index - state.cache.index  # no row that is running sees it (see above)
        cache = state.cache._replace(start=state.cache.start + shift, index=index)
        if shared_slots is not None:
            shared = _shared_prefix(pool, shared_slots, shared_positions)
            logits, k, v = self._prefill_shared(params, tokens[:, c:], w - lengths + offsets - c, rows.adapter, offsets,
                                                shared)
            write = write[:, c:]
        elif c:
            gather = lambda x, axis: jnp.moveaxis(  # noqa: E731 - pool [1, .., M, ..] -> [n, .., C, ..]
                jnp.take(x[0], read, axis=axis - 1, mode="fill", fill_value=0), axis - 1, 0)
            cached = pool.along_slots(gather)
            logits, k, v = self._prefill_after(params, tokens[:, c:], w - lengths, rows.adapter, cached.k, cached.v)
        else:
            logits, k, v = self._prefill(params, tokens, w - lengths, rows.adapter)
        new = KVCache(k, v, None, None)
        if self.dp == 1:  # every row on every device: each writes its heads' rows (and pool slots) in place
            kv = KVCache(self.specs.cache.k, self.specs.cache.v, None, None)
            if pool is not None:
                pool_specs = KVCache((POOL_SPEC,) * len(k), (POOL_SPEC,) * len(v), None, None)
                # The store waits for the logits, which need every read of the pool above: XLA orders
                # ops by data only, a layer's new blocks do not depend on its read, and it copied
                # the whole pool twice to keep that read safe from the store in place (1 GB an
                # admission behind the serving benchmark's shared prefix).
                store = lambda pool, new, write, logits: _store(pool, new, write, in_place=True, after=(logits,))  # noqa: E731
                pool = parallel.shard_map(store, self.mesh, self.rules, in_specs=(pool_specs, kv, P(), P()),
                                          out_specs=pool_specs)(pool, new, write, logits)
            write_rows = parallel.shard_map(functools.partial(_write_rows, in_place=True), self.mesh, self.rules,
                                            in_specs=(self.specs.cache, kv, P(), P()), out_specs=self.specs.cache)
            cache = write_rows(cache, new, row_ids, index - new.slots)
        else:  # a prompt's row may live on another dp shard than the row (and pool replica) it goes to
            pool = None if pool is None else _store(pool, new, write)
            cache = _write_rows(cache, new, row_ids, index - new.slots)
        cache = cache._replace(start=cache.start.at[row_ids].set(index - lengths + offsets, mode="drop"),
                               offset=cache.offset.at[row_ids].set(offsets, mode="drop"))
        # The new rows' state [n] is made and sampled alone, then written into the batch's rows: a
        # first token costs n rows' sampling, not the batch's (a 64-row batch's [64, V] of it).
        valid = jnp.arange(w)[None, :] >= (w - lengths)[:, None]
        zeros = jnp.zeros(n, jnp.int32)
        admitted = DecodeState(
            None, rows, zeros, zeros.astype(bool), zeros, zeros + RUNNING, jnp.zeros((n, self.vocab), jnp.int32),
            jnp.zeros((n, self.vocab), bool).at[jnp.arange(n)[:, None], tokens].max(valid),
            jnp.full((n, STOP_TOKENS), -2, jnp.int32), allowed,
            lookup.prompts(tokens, lengths, state.history.shape[1]), lengths, zeros)
        admitted, first = emit(admitted, logits, row_ids < batch)
        admitted = _recorded(admitted, first.token[:, None])
        state = jax.tree.map(lambda x, new: x.at[row_ids].set(new, mode="drop"), state._replace(cache=None), admitted)
        return state._replace(cache=cache), pool, first

    def _emitted_buffer(self, tokens: int, batch: int) -> Emitted:
        out = Emitted(jnp.full((tokens, batch), -1, jnp.int32), jnp.zeros((tokens, batch)),
                      jnp.zeros((tokens, batch, TOP_LOGPROBS), jnp.int32), jnp.zeros((tokens, batch, TOP_LOGPROBS)))
        return jax.tree.map(lambda x: jax.lax.pcast(x, (parallel.DP,), to="varying"), out)

    def _decode_local(self, params, state: DecodeState, limit, steps: int, shared: Optional[SharedPrefix] = None,
                      speculating: bool = False):
        """Up to `limit` decode steps (`decode` keeps it <= `steps`, the emitted buffer's size),
        stopping early once no row anywhere is running; `speculating`: by drafts (`_speculate_local`)."""
        if speculating:
            return self._speculate_local(params, state, limit, steps, shared)
        batch = state.last.shape[0]
        out = self._emitted_buffer(steps, batch)

        def running(carry):
            i, s, _ = carry
            return (i < limit) & (jax.lax.psum(jnp.sum(~s.done), parallel.DP) > 0)

        def step(carry):
            i, s, out = carry
            with parallel.adapter_bank(self.bank, s.rows.adapter):
                logits, cache = self.model.apply(params, s.last[:, None], s.cache, shared=shared)
            s, e = emit(s._replace(cache=cache, passes=s.passes + ~s.done), parallel.all_gather_mp(logits[:, -1]),
                        ~s.done)
            if s.history.shape[1]:  # a speculating generator's call that does not draft: later drafts read these
                s = _recorded(s, e.token[:, None])
            return i + 1, s, jax.tree.map(lambda o, x: o.at[i].set(x), out, e)

        _, state, out = jax.lax.while_loop(running, step, (jnp.zeros((), jnp.int32), state, out))
        return state, out

    def _speculate_local(self, params, state: DecodeState, limit, steps: int, shared: Optional[SharedPrefix] = None):
        """`_decode_local` by drafts (`lookup`): each pass feeds every row its last token and k
        drafted ones, and all rows keep the tokens up to the first that any running row's sampling
        did not draft (and that one): the rows share the cache's write index. A pass where no
        running row has a draft is a plain step (the program holds both). Up to `limit` tokens a
        row, and up to k past it (the emitted buffer holds `steps` + k)."""
        k = self.speculate
        out = self._emitted_buffer(steps + k, state.last.shape[0])

        def running(carry):
            n, s, _ = carry
            return (n < limit) & (jax.lax.psum(jnp.sum(~s.done), parallel.DP) > 0)

        def forward(s, tokens):
            with parallel.adapter_bank(self.bank, s.rows.adapter):
                logits, cache = self.model.apply(params, tokens, s.cache, shared=shared)
            return parallel.all_gather_mp(logits), cache

        def check(s, draft):  # the last token and the drafts
            logits, cache = forward(s, jnp.concatenate([s.last[:, None], jnp.maximum(draft, 0)], axis=1))
            return (*accept(s._replace(cache=None, history=None), logits, draft), cache)

        def one(s, draft):  # no running row has a draft: a plain step
            logits, cache = forward(s, s.last[:, None])
            after, e = emit(s._replace(cache=None, history=None), logits[:, 0], ~s.done)
            e = jax.tree.map(lambda x, fill: jnp.concatenate([x[None], jnp.full((k, *x.shape), fill, x.dtype)]),
                             e, Emitted(-1, 0, 0, 0))
            return after, e, jnp.ones((), jnp.int32), cache

        def step(carry):
            n, s, out = carry
            draft = lookup.propose(s.history, s.length, k, self.lookup_ngram)
            draft = jnp.where(s.rows.guided[:, None], lookup.NO_DRAFT, draft)  # a grammar masks one token ahead
            drafting = jax.lax.psum(jnp.sum((draft[:, 0] >= 0) & ~s.done), parallel.DP) > 0
            after, e, kept, cache = jax.lax.cond(drafting, check, one, s, draft)
            s = _recorded(after._replace(cache=cache._replace(index=s.cache.index + kept), history=s.history,
                                         passes=s.passes + ~s.done), e.token.T)
            return n + kept, s, jax.tree.map(lambda o, x: jax.lax.dynamic_update_slice_in_dim(o, x, n, 0), out, e)

        _, state, out = jax.lax.while_loop(running, step, (jnp.zeros((), jnp.int32), state, out))
        return state, out

    def _decode_steps(self, params, state: DecodeState, first_slot, limit, steps: int, window: int,
                      rows: Optional[int] = None, pool: Optional[KVCache] = None, shared_slots=None,
                      shared_positions=None, speculating: bool = False):
        """Decode rows 0 .. rows-1 (default: all) in slots first_slot .. first_slot+window-1 only:
        attention reads `window` slots, not S, and a lone request in a big batch costs one row's
        matmuls, not B's (its logits alone are [B, V]). Rows >= `rows` must not be running.
        With a prefix-cache `pool`, the rows also read its slots `shared_slots` [U] (gathered once
        per call into a `SharedPrefix`) at positions `shared_positions` [B, U] (-1: not read).
        `speculating`: by drafts (`_speculate_local`)."""
        batch = state.last.shape[0]
        rows = rows or batch
        shared = None if pool is None else _shared_prefix(pool, shared_slots, shared_positions[:rows])
        shared_spec = () if shared is None else (shared_specs(len(shared.k)),)
        decode = parallel.shard_map(
            lambda p, s, first_slot, limit, *shared: self._decode_window(p, s, first_slot, limit, steps, window, rows,
                                                                         speculating, *shared),
            self.mesh, self.rules, in_specs=(self.param_specs, self.specs, P(), P()) + shared_spec,
            out_specs=(self.specs, Emitted(*([P(None, parallel.DP)] * 2), *([P(None, parallel.DP, None)] * 2))),
            layout=self.layout)
        state, out = decode(params, state, first_slot, limit, *(() if shared is None else (shared,)))
        pad = lambda x, fill: jnp.pad(x, [(0, 0), (0, batch - rows)] + [(0, 0)] * (x.ndim - 2),  # noqa: E731
                                      constant_values=fill)
        out = Emitted(pad(out.token, -1), pad(out.logprob, jnp.nan), pad(out.top_ids, 0), pad(out.top_logprobs, 0))
        return state, jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), out)  # [B, K, ...]

    def _decode_window(self, params, state: DecodeState, first_slot, limit, steps: int, window: int, rows: int,
                       speculating: bool, shared: Optional[SharedPrefix] = None):
        """(One device's part of `_decode_steps`.) Decode rows 0 .. rows-1 of `state` in a copy of
        their slots first_slot .. first_slot+window-1, then write the new slots back in place."""
        full = state.cache
        rows = min(rows, full.start.shape[0])  # under dp, `rows` is the whole batch: each shard's rows
        state = state._replace(passes=jnp.zeros_like(state.passes))
        view = _window(full, rows, first_slot, window)
        head = jax.tree.map(lambda x: x[:rows], state._replace(cache=None))
        part, out = self._decode_local(params, head._replace(cache=view), limit, steps, shared, speculating)
        cache = _put_back(full, part.cache, view.index, first_slot, steps + (self.speculate if speculating else 0))
        state = jax.tree.map(lambda whole, p: whole.at[:rows].set(p), state._replace(cache=None),
                             part._replace(cache=None))
        return state._replace(cache=cache), out

    # ---- host API ---------------------------------------------------------------------------

    def new_state(self, batch: int, slots: int) -> DecodeState:
        """Empty decode state of `batch` rows of `slots` cache slots (every generation starts here)."""
        self.check_generates()
        return self._new_state(batch, slots)

    def new_pool(self, slots: int) -> KVCache:
        """An empty prefix-cache pool of `slots` token slots (see `prefix.PrefixCache`)."""
        self.check_generates()
        return self._new_pool(slots)

    def check_generates(self) -> None:
        """ConfigError unless this model generates (a classifier does not)."""
        if self.config.classifier:
            raise ConfigError(f"a classifier (num_labels {self.config.num_labels}: a score head, no language-model "
                              f"head) does not generate: classify with it (evaluate.scoring, device_serve.py's "
                              f"POST /classify) or export it with to_hf_weights.py")

    def admit(self, state, prompts: Seq[Seq[int]], options: Seq[SamplingOptions], seeds: Seq[int],
              row_ids: Seq[int], index: int, prefix: Optional["PrefixCache"] = None, share_limit: int = 0,
              read_now: Seq[int] = (), adapters: Optional[Seq[int]] = None, masks: Optional[np.ndarray] = None):
        """Prefill `prompts` into rows `row_ids`, ending at cache slot `index` (the batch's new write index).

        With a `prefix` cache, prompt blocks found in it are read rather than computed and the
        prompts' new full blocks are stored in it. The computed part of each prompt is its last T
        tokens (T: the bucket of the longest part not found), the rest (C slots before them,
        bucketed) is read; that keeps each row's slots contiguous whatever its own hit.
        Sharing: when the pool slots the rows read, with those running rows read already (`read_now`),
        number at most `share_limit`, the rows keep reading them from the pool while they decode
        (see `decode`'s `shared`) instead of holding copies in their own slots.
        `adapters`: each prompt's entry in the adapter bank (default: 0, the base alone).
        `masks` [len(prompts), W]: the first token's grammar mask of each prompt with a grammar
        (`structured.first_masks`; rows without one ignore theirs).
        Returns (state, first tokens Emitted [B], done [B], reason [B], the pool slots each prompt's
        row reads while it decodes: its positions 0, 1, .. (none: empty), the tokens of each prompt
        read from the prefix cache rather than computed).
        """
        n = self.prefill_rows(len(prompts))
        adapters = list(adapters) if adapters is not None else [0] * len(prompts)
        self.check_adapters(adapters)
        plan = prefix.plan(prompts, [self.adapter_key(a) for a in adapters]) if prefix is not None else None
        cached = plan.cached if plan else [0] * len(prompts)
        t, reuse = computed_and_read([len(p) for p in prompts], cached)
        c = bucket(max(reuse)) if max(reuse) else 0
        w = c + t
        tokens = np.zeros((n, w), np.int32)
        lengths = np.ones(n, np.int32)
        for i, p in enumerate(prompts):
            tokens[i, w - len(p):] = p
            lengths[i] = len(p)
        batch = state.last.shape[0]
        ids = np.full(n, batch, np.int32)
        ids[: len(row_ids)] = row_ids
        allowed = structured.no_mask(n, self.vocab)
        if masks is not None:
            allowed[: len(prompts)] = masks
        pad = [options[0]] * (n - len(options))
        rows = RowOptions.stack(list(options) + pad, list(seeds) + [0] * len(pad), adapters + [0] * len(pad))
        read = write = pool = None
        offsets = np.zeros(n, np.int32)
        reads = [np.zeros(0, np.int32) for _ in prompts]
        shared = ()
        if prefix is not None:
            read, write = prefix_slots(plan, prefix.block, prefix.tokens, [len(p) for p in prompts], reuse, n, c, w)
            reading = [read[i, c - r:] for i, r in enumerate(reuse)]
            if any(reuse) and len(set(read_now).union(*map(set, reading))) <= share_limit:
                offsets[: len(reuse)], reads = reuse, reading
                shared = shared_layout(reads + [np.zeros(0, np.int32)] * (n - len(reads)), prefix.tokens)
            pool, prefix.pool = prefix.pool, None
        self._note("prefill", rows=n, tokens=t, cached=c, batch=batch, slots=state.cache.slots,
                   shared=len(shared[0]) if shared else 0)
        try:
            state, pool, first = self._admit(self.params, state, pool, tokens, lengths, ids, rows, np.int32(index),
                                             read, write, offsets, allowed, *shared)
        except BaseException:
            if prefix is not None:
                prefix.forget(plan)
            raise
        finally:
            if prefix is not None and prefix.pool is None:
                prefix.pool = pool
        first, done, reason = jax.device_get((first, state.done, state.reason))
        return state, _by_row(first, ids, batch), done, reason, reads, [int(r) for r in reuse[: len(prompts)]]

    def adapter_id(self, name: Optional[str]) -> int:
        """The bank entry holding the adapter called `name` (None: 0, the base); ValueError if none does."""
        if name is None:
            return 0
        for entry, adapter in enumerate(self.residents):
            if adapter is not None and adapter.name == name:
                return entry
        raise ValueError(f"adapter {name!r} is not loaded (this generator's adapters: "
                         f"{', '.join(self.adapter_names) or 'none'})")

    def check_adapters(self, adapters: Seq[int]) -> None:
        n = len(self.residents) - 1
        bad = [a for a in adapters if not 0 <= a <= n]
        if bad:
            raise ValueError(f"adapter {bad[0]} is not in this generator's bank (0 .. {n})")

    def prefill_rows(self, prompts: int) -> int:
        """The rows an admission of `prompts` prompts computes (bucketed, a multiple of dp)."""
        return round_up(bucket(prompts, 1), self.dp)

    def decode(self, state, steps: int, first_slot: int = 0, window: Optional[int] = None,
               rows: Optional[int] = None, limit: Optional[int] = None, shared=None, running: Optional[int] = None):
        """Up to `steps` decode steps -> (state, Emitted [B, steps], done [B], reason [B], write index);
        Emitted [B, steps + k] for a call that drafts (k = `speculate`: its last pass may keep k more).

        `limit` (default `steps`) stops the call after that many steps with the same compiled
        program: the engine takes short calls while requests are arriving (see `Batch.step`).

        Attention reads only slots first_slot .. first_slot+window-1 (default: all): they must hold
        every running row's tokens, the `steps` new ones and the k slots of a speculating pass's
        drafts after them. Only rows 0 .. rows-1 (default: all) are computed: no row beyond them may
        be running (`Batch` fills the lowest free rows first). `running`: how many rows are running
        (default: all of those): whether a speculating generator drafts (`speculates`).

        `shared`: (a prefix cache's pool, slots [U], positions [B, U]): every row also attends to
        the pool's slots `slots` (the pool's size: padding), slot u at position positions[b, u] of
        row b (-1: row b does not read it), before the tokens of its own slots (see `admit`).
        """
        window = window or state.cache.slots
        batch = state.last.shape[0]
        speculating = self.speculates(running if running is not None else rows or batch, rows or batch)
        rows = batch if rows is None or self.dp > 1 else max(rows, self.min_rows)  # dp: rows split evenly
        self._note("decode", batch=batch, rows=rows, slots=state.cache.slots, steps=steps, window=window,
                   shared=0 if shared is None else len(shared[1]), **({"speculating": speculating} if self.speculate else {}))
        limit = steps if limit is None else min(limit, steps)
        state, out = self._decode(self.params, state, np.int32(first_slot), np.int32(limit), steps, window, rows,
                                  *(shared or ()), speculating=speculating)
        out, done, reason, index, passes = jax.device_get((out, state.done, state.reason, state.cache.index,
                                                           state.passes))
        self.row_passes += int(passes.sum())
        return state, out, done, reason, int(index)

    def _note(self, program: str, **shape) -> None:
        """Log each new shape: a compile (seconds to minutes) happens on its first call. When the
        process is near its limit of memory maps, drop every program compiled so far first
        (`host_memory.memory_maps`: past the limit the compile would kill the process)."""
        key = (program, *sorted(shape.items()))
        if key not in self.shapes:
            if not host_memory.room_for_programs():
                self.drop_programs()
            self.shapes.add(key)
            self.compiled[program] += 1
            log.info("compiling %s for %s", program, ", ".join(f"{k}={v}" for k, v in shape.items()))

    def drop_programs(self) -> None:
        """Free every compiled program of this generator; each compiles again on its next use
        (seconds; loaded from the persistent compilation cache if one is set)."""
        maps = host_memory.memory_maps()
        for program in (self._decode, self._admit, self._move, self._roll, self._retire, self._new_state,
                        self._new_pool):
            program.clear_cache()
        gc.collect()  # the executables, and with them their kernels' memory maps
        log.warning("this process holds %s of its %s memory maps (vm.max_map_count), mostly compiled programs: "
                    "dropped this model's %d; they compile again when used. For room to keep more: "
                    "sudo sysctl -w vm.max_map_count=1048576", *(maps or ("?", "?")), len(self.shapes))
        self.shapes.clear()

    def move(self, state, first: int, index: int, new_index: int):
        """Move the slots running rows use (first .. index-1) so that the write index becomes
        `new_index`, copying that span (bucketed) rather than the whole cache; when the bucketed span
        cannot move in one piece, the whole cache rolls. Call it before `admit` while rows run."""
        slots = state.cache.slots
        size = min(span_bucket(index - first), slots)
        shift = new_index - index
        source = min(max(index - size, 0), slots - size)
        if shift == 0:
            return state
        if not 0 <= source + shift <= slots - size:
            self._note("roll", slots=slots)
            return self._roll(state, np.int32(shift))
        self._note("move", size=size, slots=slots)
        return self._move(state, np.int32(source), np.int32(shift), size)

    def warm_moves(self, state):
        """Compile `move` for every span bucket (each call moves nothing). The whole-cache roll is
        left to its first use: it compiles in a fraction of a second, while running it here would
        copy the whole cache (seconds, and twice the cache's memory at start-up)."""
        size = span_bucket(1)
        while size < state.cache.slots:
            self._note("move", size=size, slots=state.cache.slots)
            state = self._move(state, np.int32(0), np.int32(0), size)
            size = span_bucket(size + 1)
        return state

    def constrain(self, state, masks: np.ndarray):
        """`state` with each guided row's mask for its next token (masks [B, W]; `structured`)."""
        return state._replace(allowed=jax.device_put(masks, self.shardings.allowed))

    def retire(self, state, rows: Seq[int]):
        mask = np.zeros(state.last.shape[0], bool)
        mask[list(rows)] = True
        return self._retire(state, mask)

    def generate(self, prompts: Seq[Seq[int]], options: Seq[SamplingOptions] | SamplingOptions,
                 tokenizer=None, adapters: Optional[Seq[Optional[str]]] = None) -> list["Sequence"]:
        """Continue every prompt (token ids); one compiled decode loop runs to the end of the batch.
        `adapters`: each prompt's adapter by name (None: the base alone; see `adapters`)."""
        seqs = self.sequences(prompts, options, tokenizer, adapters)
        for _ in self.stream(seqs, chunk=None):
            pass
        return seqs

    def stream(self, seqs: Seq["Sequence"], chunk: Optional[int] = 16) -> Iterator[Seq["Sequence"]]:
        """Run `seqs` in one batch, yielding them after the prefill and after every `chunk` decode
        steps (None: a single decode call); read new text with `Sequence.pop_text`."""
        from mesh_transformer.generate.batching import Batch
        batch = Batch.for_sequences(self, seqs, chunk=chunk)
        batch.admit(seqs)
        yield seqs
        while batch.active():
            batch.step()
            yield seqs

    def sequences(self, prompts, options, tokenizer=None, adapters=None) -> list["Sequence"]:
        if isinstance(options, SamplingOptions):
            options = [options] * len(prompts)
        adapters = [None] * len(prompts) if adapters is None else list(adapters)
        if not len(options) == len(adapters) == len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(options)} SamplingOptions and {len(adapters)} adapters")
        ids = [self.adapter_id(name) for name in adapters]
        from mesh_transformer.generate.batching import Sequence
        return [Sequence(p, o, self.config.seq, tokenizer, adapter=a, lora=self.residents[a], vocab=self.vocab)
                for p, o, a in zip(prompts, options, ids)]


def shared_layout(reads: Seq[np.ndarray], pool_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The pool slots rows read (reads[b]: row b's, at its positions 0, 1, ..) -> (slots [U]: each
    once, bucketed with `pool_size` = none; positions [B, U]: slot u's position in row b, -1 if
    row b does not read it), `decode`'s and the admission's `shared`."""
    used = np.unique(np.concatenate(list(reads) + [np.zeros(0, np.int32)])).astype(np.int32)
    slots = np.full(bucket(len(used)), pool_size, np.int32)
    slots[: len(used)] = used
    positions = np.full((len(reads), len(slots)), -1, np.int32)
    for b, row in enumerate(reads):
        positions[b, np.searchsorted(used, row)] = np.arange(len(row))
    return slots, positions


def _shared_prefix(pool: KVCache, slots, positions) -> SharedPrefix:
    """The pool's slots `slots` [U] (the pool's size: none, zeros) as a SharedPrefix read at `positions`."""
    take = lambda x, axis: jnp.take(x[0], slots, axis=axis - 1, mode="fill", fill_value=0)  # noqa: E731
    gathered = pool.along_slots(take)
    return SharedPrefix(gathered.k, gathered.v, positions)


def _by_row(emitted: Emitted, row_ids: np.ndarray, batch: int) -> Emitted:
    """Tokens emitted for rows `row_ids` [n] (ids >= batch: none) -> Emitted [batch] (-1: no token)."""
    kept = row_ids < batch
    def spread(x, fill):
        out = np.full((batch,) + x.shape[1:], fill, x.dtype)
        out[row_ids[kept]] = x[kept]
        return out
    return Emitted(spread(emitted.token, -1), *(spread(x, 0) for x in emitted[1:]))


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def prefix_slots(plan: "Plan", block: int, size: int, lengths: Seq[int], reuse: Seq[int], n: int, c: int, w: int):
    """The pool slots an admission reads and writes -> (read [n, c], write [n, w]); `size` (the pool's
    slot count) where none.

    Row i's prompt fills the last lengths[i] of the w slots (token j at slot w - length + j); its
    first reuse[i] tokens are read (they end at slot c - 1), and the tokens of `plan.new[i]`'s blocks
    are written from where the prefill left them.
    """
    read = np.full((n, c), size, np.int32)
    write = np.full((n, w), size, np.int32)
    for i, (length, r) in enumerate(zip(lengths, reuse)):
        if r:
            j = np.arange(r)
            read[i, c - r:] = np.asarray(plan.found[i], np.int32)[j // block] * block + j % block
        for number, slot in plan.new[i]:
            first = w - length + number * block
            write[i, first:first + block] = slot * block + np.arange(block)
    return read, write

