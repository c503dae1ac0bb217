"""Generation: prefill prompts into a KV cache, then decode inside one compiled loop.

    gen = Generator(config, params, mesh)
    [out] = gen.generate([[15496, 995]], [SamplingOptions(max_new_tokens=32, temperature=0)])
    out.tokens, out.logprobs, out.finish_reason

A batch is a fixed set of rows sharing one `model.KVCache` (per layer k [B, N, H, S] and
v [B, N, S, H]), a shared write index and a per-row first valid slot. Requests join a batch
(`admit`: prefill, write the prompt's keys/values ending at the shared index, sample the first
token) and leave it (EOS, stop sequence, length, or the host retiring them) independently, so a
server can add requests while others decode (`Batch`, also what `generate` uses).

Sharding is training's: parameters by the MEGATRON table (split into per-layer arrays, see
`model.unstack_layers`), the cache with heads over 'mp' and rows over 'dp', the model inside
`parallel.shard_map`. Each step all-gathers the last position's [B, V/mp] logits over 'mp' and
every mp shard samples the same token from the whole vocabulary.
One row per sequence is cheap next to the weights each step reads, and it keeps sampling exact:
top-p needs the sorted full distribution, which a vocab-parallel top-k only approximates.

Compiles are bounded by buckets: batch rows, prompt length, cache slots and chunk length are
powers of two (`bucket`), so a new prompt length rarely means a new program.

Shape letters: B batch rows, T prompt tokens, S cache slots, K decode steps per call, V padded
vocabulary, L layers, N heads, H head dim.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import secrets
import time
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Optional, Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from mesh_transformer.models import core as gptj
from mesh_transformer import parallel
from mesh_transformer.config import ModelConfig

log = logging.getLogger(__name__)

MAX_STOPS = 4  # stop sequences per request checked on device (OpenAI allows 4)
STOP_TOKENS = 8  # longest stop sequence (in tokens) checked on device; longer ones are checked as text
TOP_LOGPROBS = 5  # alternatives reported per token (OpenAI's completions limit)
MIN_BUCKET = 16
# Decode batches in 16-bit dtypes have at least 2 rows: with one, XLA:CPU turns each bf16 matmul
# into a conversion of the weights plus a float32 matvec (10x slower). A spare row costs little:
# decode reads every weight once per step whatever the batch. (float32 keeps one row: XLA:CPU's
# matvec reads weights faster than its 2-row matmul.)
MIN_ROWS_16BIT = 2

RUNNING, EOS, STOP, LENGTH = 0, 1, 2, 3
FINISH_REASONS = {EOS: "stop", STOP: "stop", LENGTH: "length"}


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """The power of two >= max(n, minimum): the shapes programs are compiled for."""
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


# --------------------------------------------------------------------------------------------
# Per-request options
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SamplingOptions:
    """How to continue one prompt. Defaults: plain sampling at temperature 1 from the full distribution."""

    max_new_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = no limit
    top_p: float = 1.0  # nucleus: smallest set of tokens with this much probability
    repetition_penalty: float = 1.0  # CTRL/HF: seen tokens (prompt + output) get logit/p if > 0, logit*p if < 0
    frequency_penalty: float = 0.0  # OpenAI: logit -= count in output * this
    presence_penalty: float = 0.0  # OpenAI: logit -= this if in output
    seed: Optional[int] = None  # None = a fresh random seed
    eos_token_id: Optional[int] = None  # ends the row (the token is returned, not part of the text)
    stop: tuple[str, ...] = ()  # text that ends the row (not part of the text)
    stop_token_ids: tuple[tuple[int, ...], ...] = ()  # token sequences that end the row on device
    logprobs: Optional[int] = None  # None: none; n: the chosen token's log p and the n most likely (n <= 5)

    def validate(self, context: int) -> None:
        """Raise ValueError naming the first bad field; `context` is the model's sequence length."""
        def need(ok, name, what):
            if not ok:
                raise ValueError(f"{name} {what}, got {getattr(self, name)!r}")
        need(isinstance(self.max_new_tokens, int) and 1 <= self.max_new_tokens < context, "max_new_tokens",
             f"must be an integer in [1, {context - 1}] (the context is {context} tokens)")
        need(0 <= self.temperature < float("inf"), "temperature", "must be >= 0")
        need(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "must be an integer >= 0")
        need(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(self.repetition_penalty > 0, "repetition_penalty", "must be > 0")
        need(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]")
        need(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
        need(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer")
        need(self.logprobs is None or 0 <= self.logprobs <= TOP_LOGPROBS, "logprobs", f"must be in [0, {TOP_LOGPROBS}]")
        need(len(self.stop) <= MAX_STOPS, "stop", f"allows at most {MAX_STOPS} strings")
        need(len(self.stop_token_ids) <= MAX_STOPS, "stop_token_ids", f"allows at most {MAX_STOPS} sequences")
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")


class RowOptions(NamedTuple):
    """SamplingOptions as per-row device arrays (all [B] unless noted)."""

    temperature: Any
    top_k: Any
    top_p: Any
    repetition_penalty: Any
    frequency_penalty: Any
    presence_penalty: Any
    seed: Any  # uint32
    max_new: Any
    eos: Any  # -1 = none
    stops: Any  # [B, MAX_STOPS, STOP_TOKENS] right-aligned token ids, -1 = padding
    top_logprobs: Any  # alternatives wanted (0..TOP_LOGPROBS); -1 = no log-probabilities at all

    @classmethod
    def stack(cls, options: Seq[SamplingOptions], seeds: Seq[int]) -> "RowOptions":
        stops = np.full((len(options), MAX_STOPS, STOP_TOKENS), -1, np.int32)
        for i, o in enumerate(options):
            usable = [s for s in o.stop_token_ids if 0 < len(s) <= STOP_TOKENS][:MAX_STOPS]
            for j, s in enumerate(usable):
                stops[i, j, STOP_TOKENS - len(s):] = s

        def col(name, dtype):
            return np.array([getattr(o, name) for o in options], dtype)
        return cls(col("temperature", np.float32), col("top_k", np.int32), col("top_p", np.float32),
                   col("repetition_penalty", np.float32), col("frequency_penalty", np.float32),
                   col("presence_penalty", np.float32), np.array(seeds, np.uint32),
                   col("max_new_tokens", np.int32),
                   np.array([-1 if o.eos_token_id is None else o.eos_token_id for o in options], np.int32), stops,
                   np.array([-1 if o.logprobs is None else o.logprobs for o in options], np.int32))


# --------------------------------------------------------------------------------------------
# Sampling: small pure functions over [B, V] float32 logits and per-row [B] options
# --------------------------------------------------------------------------------------------

def penalize(logits, counts, seen, rows: RowOptions):
    """Repetition (HF/CTRL, over prompt + output) and frequency/presence (OpenAI, output) penalties."""
    rep = rows.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    counts = counts.astype(jnp.float32)
    return logits - counts * rows.frequency_penalty[:, None] - (counts > 0) * rows.presence_penalty[:, None]


def top_k_top_p(logits, top_k, top_p):
    """Keep each row's `top_k` largest logits (0 = all), then its nucleus of mass `top_p`; others -> -inf.

    logits [B, V] float32, top_k [B] int, top_p [B] float. Exact, ties at the threshold kept (as in
    HF), without sorting the vocabulary (170 ms for [16, 50400] on CPU): each threshold is found by
    bisection over the 2^32 float32 values (`_order_key`), 32 masked sums over [B, V] (5 ms).
    """
    key = _order_key(logits)
    none = 0 * top_k + jnp.iinfo(jnp.int32).min  # no threshold, laid out like top_k (varying in shard_map)
    by_k = (top_k > 0) & (top_k < logits.shape[-1])

    def kth_largest():  # the largest t with count(key >= t) >= k: one below the smallest t with fewer
        fewer = _smallest(lambda t: jnp.sum(key >= t[:, None], axis=-1) < top_k)
        return jnp.where(by_k, fewer - 1, none)
    k_floor = jax.lax.cond(jnp.any(by_k), kth_largest, lambda: none)
    in_k = key >= k_floor[:, None]
    by_p = top_p < 1

    def nucleus_floor():  # the smallest t with mass(key > t) < top_p: mass before the kept ones < top_p
        probs = jax.nn.softmax(jnp.where(in_k, logits, -jnp.inf), axis=-1)
        floor = _smallest(lambda t: jnp.sum(jnp.where(key > t[:, None], probs, 0), axis=-1) < top_p)
        return jnp.where(by_p, floor, none)
    p_floor = jax.lax.cond(jnp.any(by_p), nucleus_floor, lambda: none)
    return jnp.where(key >= jnp.maximum(k_floor, p_floor)[:, None], logits, -jnp.inf)


def _order_key(x):
    """int32 keys ordered as the float32 values `x` are (-inf lowest; -0.0 and 0.0 the same)."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _smallest(holds):
    """Per row, the smallest int32 t for which `holds(t)` [B] is true (it must be monotone in t and
    true at the largest int32), by bisection: 32 evaluations."""
    info = jnp.iinfo(jnp.int32)
    anchor = holds(jnp.full((1,), info.max, jnp.int32))  # [B], laid out as the bounds must be
    lo, hi = jnp.where(anchor, info.min, info.min), jnp.where(anchor, info.max, info.max)

    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
        ok = holds(mid)
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)
    return jax.lax.fori_loop(0, 32, halve, (lo, hi))[1]


def row_keys(seed, n_generated):
    """One PRNG key per row from its seed and position in its output: results do not depend on the batch."""
    return jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(seed, n_generated)


def argmax(logits, block: int = 128):
    """jnp.argmax(logits [B, V], -1) in two levels: the best block of `block`, then the best in it.
    (XLA:CPU's one-level argmax over 50k logits takes 14x longer.) Ties go to the lowest index."""
    b, vocab = logits.shape
    if vocab % block or vocab <= block:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    blocks = logits.reshape(b, vocab // block, block)
    which = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)
    return (which * block + jnp.argmax(blocks[jnp.arange(b), which], axis=-1)).astype(jnp.int32)


def choose(logits, rows: RowOptions, n_generated):
    """Next token per row [B]: argmax where temperature == 0, else a sample of the filtered softmax."""
    greedy = argmax(logits)
    sampling = rows.temperature > 0

    def sample():
        scaled = logits / jnp.where(sampling, rows.temperature, 1.0)[:, None]
        truncating = jnp.any(sampling & ((rows.top_k > 0) | (rows.top_p < 1)))
        filtered = jax.lax.cond(truncating, lambda: top_k_top_p(scaled, rows.top_k, rows.top_p), lambda: scaled)
        drawn = categorical(row_keys(rows.seed, n_generated), filtered)
        return jnp.where(sampling, drawn.astype(jnp.int32), greedy)

    return jax.lax.cond(jnp.any(sampling), sample, lambda: greedy)


def categorical(keys, logits, block: int = 128):
    """One exact draw per row from softmax(logits [B, V]), with about 2*sqrt(V) random numbers, not V.

    Two levels: a block of `block` tokens by its total probability (logsumexp), then a token in
    it. Gumbel noise for 50k logits per row per step costs more than the model on a CPU.
    """
    b, vocab = logits.shape
    if vocab % block or vocab <= block:
        return jax.vmap(jax.random.categorical)(keys, logits)
    pairs = jax.vmap(jax.random.split)(keys)
    blocks = logits.reshape(b, vocab // block, block)
    which = jax.vmap(jax.random.categorical)(pairs[:, 0], jax.nn.logsumexp(blocks, axis=-1))
    inner = jax.vmap(jax.random.categorical)(pairs[:, 1], blocks[jnp.arange(b), which])
    return which * block + inner


def stop_hit(recent, stops):
    """Whether each row's last tokens end with one of its stop sequences. recent [B, STOP_TOKENS]."""
    match = (stops == -1) | (stops == recent[:, None, :])  # [B, MAX_STOPS, STOP_TOKENS]
    real = jnp.any(stops != -1, axis=-1)
    return jnp.any(real & jnp.all(match, axis=-1), axis=-1)


# --------------------------------------------------------------------------------------------
# Decode state and the per-step update shared by prefill and decode
# --------------------------------------------------------------------------------------------

class DecodeState(NamedTuple):
    """Everything on device for one batch of rows. Per-row arrays are [B]."""

    cache: gptj.KVCache
    rows: RowOptions
    last: Any  # last sampled token: the next decode step's input
    done: Any  # bool; free rows are done
    n_generated: Any
    reason: Any  # RUNNING / EOS / STOP / LENGTH
    counts: Any  # [B, V] int32: each token's count in the output (frequency/presence penalties)
    seen: Any  # [B, V] bool: in the prompt or output (repetition penalty)
    recent: Any  # [B, STOP_TOKENS] last output tokens (stop sequences); -2 before any


class Emitted(NamedTuple):
    """Tokens produced by one step (leading [B]) or one decode call ([B, K]); token -1 = none."""

    token: Any
    logprob: Any  # log p(token) under the model (before penalties, temperature and truncation); NaN if no row asked
    top_ids: Any  # [..., TOP_LOGPROBS]
    top_logprobs: Any


def emit(state: DecodeState, logits, active) -> tuple[DecodeState, Emitted]:
    """Sample a token for each `active` row from its full-vocabulary logits [B, V]; update the row.

    Work over [B, V] that no row asked for (penalties, top log-probs) is skipped (`lax.cond`).
    """
    rows = state.rows
    penalized = (rows.repetition_penalty != 1) | (rows.frequency_penalty != 0) | (rows.presence_penalty != 0)
    scores = jax.lax.cond(jnp.any(penalized), lambda: penalize(logits, state.counts, state.seen, rows), lambda: logits)
    token = choose(scores, rows, state.n_generated)
    b = jnp.arange(token.shape[0])
    logprob, top_logprobs, top_ids = jax.lax.cond(
        jnp.any(rows.top_logprobs >= 0), lambda: log_probs(logits, token, rows.top_logprobs),
        lambda: _none(token))

    n_generated = state.n_generated + active
    recent = jnp.where(active[:, None], jnp.concatenate([state.recent[:, 1:], token[:, None]], 1), state.recent)
    why = jnp.where(token == state.rows.eos, EOS,
                    jnp.where(stop_hit(recent, state.rows.stops), STOP,
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


def log_probs(logits, token, top_wanted):
    """log p(token) [B] and the TOP_LOGPROBS most likely tokens' log p and ids [B, TOP_LOGPROBS]
    (computed if some row wants them: top_wanted [B] > 0) under the model's distribution `logits` [B, V]."""
    log_norm = jax.nn.logsumexp(logits, axis=-1)
    logprob = logits[jnp.arange(token.shape[0]), token] - log_norm

    def top():
        values, ids = jax.lax.top_k(logits, TOP_LOGPROBS)
        return values - log_norm[:, None], ids.astype(jnp.int32)
    return logprob, *jax.lax.cond(jnp.any(top_wanted > 0), top, lambda: _none(token)[1:])


def _none(token):
    """What `log_probs` gives when not computed: NaN [B], zeros [B, TOP_LOGPROBS] (float and int),
    laid out like `token` (varying over the same mesh axes inside shard_map)."""
    zero = 0 * token
    top = zero[:, None] + jnp.zeros((1, TOP_LOGPROBS), jnp.int32)
    return zero.astype(jnp.float32) + jnp.nan, top.astype(jnp.float32), top


KV_SPEC = P(parallel.DP, parallel.MP, None, None)  # each layer's k and v: rows over dp, heads over mp


def state_specs(layers: int) -> DecodeState:
    """PartitionSpecs: rows over 'dp'; the cache's heads over 'mp' as well."""
    row, row2, kv = P(parallel.DP), P(parallel.DP, None), (KV_SPEC,) * layers
    return DecodeState(
        cache=gptj.KVCache(kv, kv, row, P()),
        rows=RowOptions(*([row] * 9), P(parallel.DP, None, None), row),
        last=row, done=row, n_generated=row, reason=row, counts=row2, seen=row2, recent=row2)


def _roll_cache(cache: gptj.KVCache, shift):
    """Move every row's slots by `shift` (positions are slot - start, so they do not change)."""
    rolled = jax.lax.cond(shift != 0, lambda: cache.along_slots(lambda x, axis: jnp.roll(x, shift, axis)),
                          lambda: cache)
    return rolled._replace(start=cache.start + shift, index=cache.index + shift)


# --------------------------------------------------------------------------------------------
# Generator: the compiled functions for one model on one mesh
# --------------------------------------------------------------------------------------------

class Generator:
    """Compiled prefill/decode for `params` on `mesh`; token ids in, token ids out.

    `params`: Haiku params as training keeps them (layers stacked; numpy or jax; vocabulary padded
    for the mesh's mp). The generator keeps its own copy, cast to `config.compute_dtype`, split
    into per-layer arrays and placed by the MEGATRON table, built one leaf at a time (peak memory
    is the caller's params plus the largest leaf); drop the caller's copy to free it.

    `matvec`: store the weights inputs-last (`parallel.INPUT_AXES`), for decoding one or two rows
    at a time: on CPU, batch-1 decode runs about 12% faster (matrix-vector products read such
    weights faster), batch-16 decode about 12% slower (bench/decode.py). float32 only: 16-bit decode
    runs matmuls of at least 2 rows (`MIN_ROWS_16BIT`), which read weights faster inputs-first.
    """

    def __init__(self, config: ModelConfig, params, mesh: Mesh, matvec: bool = False):
        parallel.check_divisibility(config, mesh, zero=False)
        self.config, self.mesh = config, mesh
        self.min_rows = 1 if jnp.dtype(config.compute_dtype).itemsize >= 4 else MIN_ROWS_16BIT
        self.inputs_last = matvec and self.min_rows == 1  # 2-row matmuls read weights faster inputs-first
        self.mp, self.dp = mesh.shape[parallel.MP], mesh.shape[parallel.DP]
        self.model = gptj.build(config, self.mp)
        self.vocab = config.padded_vocab(self.mp)
        self.rules = parallel.MEGATRON
        self.params = self._place(params)
        self.param_specs = jax.tree.map(lambda x: x.sharding.spec, self.params)
        self.specs = state_specs(config.layers)
        self.shapes: set[tuple] = set()  # programs compiled so far (see `_note`)
        self.shardings = parallel.named(mesh, self.specs)
        kv = (KV_SPEC,) * config.layers
        self._prefill = parallel.shard_map(
            self._prefill_local, mesh, self.rules,
            in_specs=(self.param_specs, P(parallel.DP, None), P(parallel.DP)),
            out_specs=(P(parallel.DP, None), kv, kv), inputs_last=self.inputs_last)
        self._new_state = jax.jit(self._empty, static_argnums=(0, 1), out_shardings=self.shardings)
        self._admit = jax.jit(self._admit_rows, out_shardings=(self.shardings, None), donate_argnums=1)
        self._decode = jax.jit(self._decode_steps, static_argnums=(3, 4), donate_argnums=1,
                               out_shardings=(self.shardings, None))
        self._retire = jax.jit(lambda s, m: s._replace(done=s.done | m), out_shardings=self.shardings,
                               donate_argnums=0)

    def _place(self, params):
        """Per-layer params in the compute dtype (weights inputs-last with `matvec`), on the mesh by
        the MEGATRON table."""
        dtype = jnp.dtype(self.config.compute_dtype)

        def convert(name, x):
            x = x if x.dtype == dtype else x.astype(dtype)  # numpy or jax
            order, axes = parallel.stored_layout(name, x.ndim, self.inputs_last)
            sharding = jax.sharding.NamedSharding(self.mesh, parallel.spec_for(axes, self.rules))
            return jax.device_put(x.transpose(order), sharding)
        return gptj.unstack_layers(params, self.config.layers, convert)

    # ---- device functions ---------------------------------------------------------------------

    def _empty(self, batch: int, slots: int) -> DecodeState:
        vocab = self.vocab
        i32 = lambda fill=0: jnp.full((batch,), fill, jnp.int32)
        rows = RowOptions(jnp.zeros(batch), i32(), jnp.ones(batch), jnp.ones(batch), jnp.zeros(batch),
                          jnp.zeros(batch), jnp.zeros(batch, jnp.uint32), i32(1), i32(-1),
                          jnp.full((batch, MAX_STOPS, STOP_TOKENS), -1, jnp.int32), i32(-1))
        return DecodeState(gptj.KVCache.zeros(self.config, batch, slots), rows, i32(),
                           jnp.ones(batch, bool), i32(), i32(), jnp.zeros((batch, vocab), jnp.int32),
                           jnp.zeros((batch, vocab), bool), jnp.full((batch, STOP_TOKENS), -2, jnp.int32))

    def _prefill_local(self, params, tokens, start):
        """tokens [n, T] left-padded, start [n] = T - length -> (last logits [n, V], k, v: per layer [n, N, T, H])."""
        empty = gptj.KVCache.zeros(self.config, tokens.shape[0], tokens.shape[1], start, self.mp)
        logits, cache = self.model.apply(params, tokens, empty, last_only=True)
        return parallel.all_gather_mp(logits[:, -1]), cache.k, cache.v

    def _admit_rows(self, params, state: DecodeState, tokens, lengths, row_ids, rows: RowOptions, index):
        """Prefill `tokens` [n, T] into rows `row_ids` [n] (n >= batch: dropped) ending at slot `index`.

        The whole batch first moves to `index` (a roll of the cache; positions do not change), then
        each new row's prompt fills slots index-length .. index-1 and its first token is sampled.
        """
        n, t = tokens.shape
        batch, slots = state.last.shape[0], state.cache.slots
        cache = _roll_cache(state.cache, index - state.cache.index)
        logits, k, v = self._prefill(params, tokens, t - lengths)
        target = index - t + jnp.arange(t)
        target = jnp.where(target >= 0, target, slots)  # left padding beyond slot 0 is dropped

        def put(x, new, axis):  # new's T slots into x's rows row_ids at slots target
            where = (row_ids[:, None],) + (slice(None),) * (axis - 1) + (target[None, :],)
            return x.at[where].set(jnp.moveaxis(new, axis, 1), mode="drop")
        cache = cache.along_slots(put, gptj.KVCache(k, v, None, None))
        cache = cache._replace(start=cache.start.at[row_ids].set(index - lengths, mode="drop"))
        set_rows = lambda x, new: x.at[row_ids].set(new, mode="drop")
        valid = jnp.arange(t)[None, :] >= (t - lengths)[:, None]
        prompt_seen = jnp.zeros((n, self.vocab), bool).at[jnp.arange(n)[:, None], tokens].max(valid)
        state = DecodeState(
            cache, jax.tree.map(set_rows, state.rows, rows), state.last, set_rows(state.done, False),
            set_rows(state.n_generated, 0), set_rows(state.reason, RUNNING), set_rows(state.counts, 0),
            set_rows(state.seen, prompt_seen), set_rows(state.recent, -2))
        full = jnp.full((batch, self.vocab), -jnp.inf).at[row_ids].set(logits, mode="drop")
        active = jnp.zeros(batch, bool).at[row_ids].set(True, mode="drop")
        return emit(state, full, active)

    def _decode_local(self, params, state: DecodeState, steps: int):
        """Up to `steps` decode steps, stopping early once no row anywhere is running."""
        batch = state.last.shape[0]
        out = Emitted(jnp.full((steps, batch), -1, jnp.int32), jnp.zeros((steps, batch)),
                      jnp.zeros((steps, batch, TOP_LOGPROBS), jnp.int32), jnp.zeros((steps, batch, TOP_LOGPROBS)))
        out = jax.tree.map(lambda x: jax.lax.pcast(x, (parallel.DP,), to="varying"), out)

        def running(carry):
            i, s, _ = carry
            return (i < steps) & (jax.lax.psum(jnp.sum(~s.done), parallel.DP) > 0)

        def step(carry):
            i, s, out = carry
            logits, cache = self.model.apply(params, s.last[:, None], s.cache)
            s, e = emit(s._replace(cache=cache), parallel.all_gather_mp(logits[:, -1]), ~s.done)
            return i + 1, s, jax.tree.map(lambda o, x: o.at[i].set(x), out, e)

        _, state, out = jax.lax.while_loop(running, step, (jnp.zeros((), jnp.int32), state, out))
        return state, out

    def _decode_steps(self, params, state: DecodeState, first_slot, steps: int, window: int):
        """Decode in slots first_slot .. first_slot+window-1 only: attention reads `window` slots, not S."""
        decode = parallel.shard_map(
            lambda p, s: self._decode_local(p, s, steps), self.mesh, self.rules,
            in_specs=(self.param_specs, self.specs),
            out_specs=(self.specs, Emitted(*([P(None, parallel.DP)] * 2), *([P(None, parallel.DP, None)] * 2))),
            inputs_last=self.inputs_last)
        full = state.cache
        view = full.along_slots(lambda x, axis: jax.lax.dynamic_slice_in_dim(x, first_slot, window, axis))
        view = view._replace(start=full.start - first_slot, index=full.index - first_slot)
        state, out = decode(params, state._replace(cache=view))
        c = state.cache
        put_back = lambda whole, part, axis: jax.lax.dynamic_update_slice_in_dim(whole, part, first_slot, axis)  # noqa: E731
        cache = full.along_slots(put_back, c)
        cache = cache._replace(start=c.start + first_slot, index=c.index + first_slot)
        return state._replace(cache=cache), jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), out)  # [B, K, ...]

    # ---- host API ---------------------------------------------------------------------------

    def new_state(self, batch: int, slots: int) -> DecodeState:
        return self._new_state(batch, slots)

    def admit(self, state, prompts: Seq[Seq[int]], options: Seq[SamplingOptions], seeds: Seq[int],
              row_ids: Seq[int], index: int):
        """Prefill `prompts` into rows `row_ids`, ending at cache slot `index` (the batch's new write index).

        Returns (state, first tokens Emitted [B], done [B], reason [B]).
        """
        n = _round_up(bucket(len(prompts), 1), self.dp)
        t = bucket(max(len(p) for p in prompts))
        tokens = np.zeros((n, t), np.int32)
        lengths = np.ones(n, np.int32)
        for i, p in enumerate(prompts):
            tokens[i, t - len(p):] = p
            lengths[i] = len(p)
        batch = state.last.shape[0]
        ids = np.full(n, batch, np.int32)
        ids[: len(row_ids)] = row_ids
        pad = [options[0]] * (n - len(options))
        rows = RowOptions.stack(list(options) + pad, list(seeds) + [0] * len(pad))
        self._note("prefill", rows=n, tokens=t, batch=batch, slots=state.cache.slots)
        state, first = self._admit(self.params, state, tokens, lengths, ids, rows, np.int32(index))
        first, done, reason = jax.device_get((first, state.done, state.reason))
        return state, first, done, reason

    def decode(self, state, steps: int, first_slot: int = 0, window: Optional[int] = None):
        """Up to `steps` decode steps -> (state, Emitted [B, steps], done [B], reason [B], write index).

        Attention reads only slots first_slot .. first_slot+window-1 (default: all): they must hold
        every running row's tokens and the `steps` new ones.
        """
        window = window or state.cache.slots
        self._note("decode", batch=state.last.shape[0], slots=state.cache.slots, steps=steps, window=window)
        state, out = self._decode(self.params, state, np.int32(first_slot), steps, window)
        out, done, reason, index = jax.device_get((out, state.done, state.reason, state.cache.index))
        return state, out, done, reason, int(index)

    def _note(self, program: str, **shape) -> None:
        """Log each new shape: a compile (seconds to minutes) happens on its first call."""
        key = (program, *sorted(shape.items()))
        if key not in self.shapes:
            self.shapes.add(key)
            log.info("compiling %s for %s", program, ", ".join(f"{k}={v}" for k, v in shape.items()))

    def retire(self, state, rows: Seq[int]):
        mask = np.zeros(state.last.shape[0], bool)
        mask[list(rows)] = True
        return self._retire(state, mask)

    def generate(self, prompts: Seq[Seq[int]], options: Seq[SamplingOptions] | SamplingOptions,
                 tokenizer=None) -> list["Sequence"]:
        """Continue every prompt (token ids); one compiled decode loop runs to the end of the batch."""
        seqs = self.sequences(prompts, options, tokenizer)
        for _ in self.stream(seqs, chunk=None):
            pass
        return seqs

    def stream(self, seqs: Seq["Sequence"], chunk: Optional[int] = 16) -> Iterator[Seq["Sequence"]]:
        """Run `seqs` in one batch, yielding them after the prefill and after every `chunk` decode
        steps (None: a single decode call); read new text with `Sequence.pop_text`."""
        batch = Batch.for_sequences(self, seqs, chunk=chunk)
        batch.admit(seqs)
        yield seqs
        while batch.active():
            batch.step()
            yield seqs

    def sequences(self, prompts, options, tokenizer=None) -> list["Sequence"]:
        if isinstance(options, SamplingOptions):
            options = [options] * len(prompts)
        if len(options) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(options)} SamplingOptions")
        return [Sequence(p, o, self.config.seq, tokenizer) for p, o in zip(prompts, options)]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# --------------------------------------------------------------------------------------------
# One request on the host: prompt, output so far, text and stop strings
# --------------------------------------------------------------------------------------------

class Sequence:
    """A prompt and its continuation as it arrives.

    The prompt is cut from the left to fit `context - max_new_tokens` (`truncated` says how many
    tokens went). With a tokenizer, stop strings end the sequence and `pop_text` gives the text
    that is final so far (never a partial stop string or a partial UTF-8 character).
    """

    def __init__(self, prompt: Seq[int], options: SamplingOptions, context: int, tokenizer=None,
                 deadline: Optional[float] = None):
        options.validate(context)
        if len(prompt) == 0:
            raise ValueError("the prompt is empty (it needs at least one token)")
        keep = context - options.max_new_tokens
        self.truncated = max(0, len(prompt) - keep)
        self.prompt = [int(t) for t in prompt[self.truncated:]]
        self.tokenizer = tokenizer
        if tokenizer is not None and options.stop:
            extra = tuple(tuple(tokenizer.encode(s)) for s in options.stop)
            options = dataclasses.replace(options, stop_token_ids=options.stop_token_ids + extra)
        self.options = options
        self.seed = options.seed % 2**32 if options.seed is not None else secrets.randbits(32)
        self.deadline = deadline
        self.tokens: list[int] = []
        self.logprobs: list[float] = []  # with options.logprobs set: log p of each token
        self.top_logprobs: list[list[tuple[int, float]]] = []  # and the options.logprobs most likely (id, log p)
        self.finish_reason: Optional[str] = None
        self.cancelled = False
        self._text_end: Optional[int] = None  # where a stop string cut the text
        self._sent = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def extend(self, tokens, logprobs, top_ids, top_logprobs) -> None:
        """Append emitted tokens (already filtered to real ones), and their log-probabilities if the
        options asked for them; check stop strings."""
        self.tokens.extend(int(t) for t in tokens)
        if self.options.logprobs is not None:
            n_top = self.options.logprobs
            self.logprobs.extend(float(lp) for lp in logprobs)
            self.top_logprobs.extend([(int(i), float(p)) for i, p in zip(ids[:n_top], lps[:n_top])]
                                     for ids, lps in zip(top_ids, top_logprobs))
        if self.tokenizer is not None and self.options.stop and tokens is not None and len(tokens):
            cut = _find_stop(self._decoded(), self.options.stop)
            if cut is not None:
                self._text_end = cut
                self.finish_reason = "stop"

    def finish(self, reason: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason

    def _text_tokens(self) -> list[int]:
        eos = self.options.eos_token_id  # EOS ends a row, so it can only be the last token
        return self.tokens[:-1] if self.tokens and self.tokens[-1] == eos else self.tokens

    def _decoded(self) -> str:
        return self.tokenizer.decode(self._text_tokens())

    @property
    def text(self) -> str:
        """The completion text (without EOS or the stop string); needs a tokenizer."""
        text = self._decoded()
        if self._text_end is None and self.finished and self.options.stop:
            self._text_end = _find_stop(text, self.options.stop)  # a device-side stop-token hit
        return text if self._text_end is None else text[: self._text_end]

    def pop_text(self) -> str:
        """Text that became final since the last call (for streaming)."""
        text = self.text
        end = len(text)
        if not self.finished:
            end = len(text.rstrip("\ufffd"))  # an incomplete UTF-8 character may still complete
            for s in self.options.stop:  # hold back what could be the start of a stop string
                for k in range(min(len(s) - 1, end), 0, -1):
                    if text[:end].endswith(s[:k]):
                        end -= k
                        break
        delta = text[self._sent:max(end, self._sent)]
        self._sent = max(end, self._sent)
        return delta

    def kept_tokens(self) -> int:
        """How many output tokens make up `text` (tokens after a stop string's start are dropped)."""
        if self._text_end is None or self.tokenizer is None:
            return len(self._text_tokens())
        for i in range(len(self.tokens)):
            if len(self.tokenizer.decode(self.tokens[: i + 1])) > self._text_end:
                return i + (len(self.tokenizer.decode(self.tokens[:i])) < self._text_end)
        return len(self.tokens)


def _find_stop(text: str, stops: Seq[str]) -> Optional[int]:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


# --------------------------------------------------------------------------------------------
# Batch: the host side of one DecodeState (which sequence is in which row)
# --------------------------------------------------------------------------------------------

class Batch:
    """Rows of one DecodeState, filled and emptied as sequences come and go.

    All rows share the cache's write index. A group of prompts can join when, after moving the
    batch to a new index I (a cache roll), every prompt fits in slots [I - length, I) and every
    row still running has room for its remaining tokens in [I, S).
    """

    def __init__(self, generator: Generator, rows: int, slots: int, chunk: Optional[int] = 16):
        self.gen = generator
        self.size, self.slots = _round_up(max(rows, generator.min_rows), generator.dp), slots
        self.chunk = chunk
        self.state = generator.new_state(self.size, slots)
        self.rows: list[Optional[Sequence]] = [None] * self.size
        self.start = [0] * self.size  # first valid slot of each row (host copy)
        self.index = 0
        self._retire: set[int] = set()

    @classmethod
    def for_sequences(cls, gen: Generator, seqs: Seq[Sequence], chunk: Optional[int]) -> "Batch":
        """A batch just big enough for `seqs` all at once (bucketed shapes)."""
        longest = max(len(s.prompt) for s in seqs)
        new = bucket(max(s.options.max_new_tokens for s in seqs))
        return cls(gen, bucket(len(seqs), 1), bucket(longest + new), chunk or new)

    def active(self) -> list[int]:
        return [r for r, s in enumerate(self.rows) if s is not None]

    def free(self) -> list[int]:
        return [r for r, s in enumerate(self.rows) if s is None]

    def plan(self, seqs: Seq[Sequence]) -> Optional[int]:
        """The write index after admitting `seqs`, or None if they do not fit now."""
        if not seqs or len(seqs) > len(self.free()):
            return None
        active = self.active()
        longest = max(len(s.prompt) for s in seqs)
        need = max([s.options.max_new_tokens - 1 for s in seqs] +
                   [self.rows[r].options.max_new_tokens - len(self.rows[r].tokens) for r in active])
        if active and self.index >= longest and self.index + need <= self.slots:
            return self.index  # no move needed
        in_use = self.index - min(self.start[r] for r in active) if active else 0
        index = max(longest, in_use)
        return index if index + need <= self.slots else None

    def admit(self, seqs: Seq[Sequence]) -> list[Sequence]:
        """Prefill `seqs` into free rows if they fit now (see `plan`); returns those already finished.

        Raises ValueError if they do not fit.
        """
        index = self.plan(seqs)
        if index is None:
            raise ValueError("these sequences do not fit in the batch now (check `plan` first)")
        self.start = [s + index - self.index for s in self.start]
        rows = self.free()[: len(seqs)]
        self.state, first, done, reason = self.gen.admit(
            self.state, [s.prompt for s in seqs], [s.options for s in seqs], [s.seed for s in seqs], rows, index)
        self.index = index
        for r, s in zip(rows, seqs):
            self.rows[r] = s
            self.start[r] = index - len(s.prompt)
        return self._absorb(jax.tree.map(lambda x: x[:, None], first), done, reason)

    def step(self) -> list[Sequence]:
        """Retire cancelled or timed-out rows, then one decode call; returns the sequences that finished."""
        now = time.monotonic()
        for r in self.active():
            s = self.rows[r]
            if s.cancelled or (s.deadline is not None and now > s.deadline):
                s.finish("cancelled" if s.cancelled else "timeout")
        finished = self._absorb(None, None, None)
        if not self.active():
            return finished
        self.state, out, done, reason, self.index = self.gen.decode(self.state, self.chunk, *self._window())
        return finished + self._absorb(out, done, reason)

    def _window(self) -> tuple[int, int]:
        """(first slot, size): the bucketed span of slots the running rows use in the next decode call."""
        first = min(self.start[r] for r in self.active())
        need = max(self.rows[r].options.max_new_tokens - len(self.rows[r].tokens) for r in self.active())
        size = min(bucket(self.index + min(self.chunk, need) - first), self.slots)
        return min(first, self.slots - size), size

    def _absorb(self, out: Optional[Emitted], done, reason) -> list[Sequence]:
        """Hand emitted tokens [B, K] to their sequences; free the rows of finished ones."""
        finished, stopped_here = [], []
        for r in self.active():
            s = self.rows[r]
            if out is not None:
                keep = out.token[r] >= 0
                if keep.any():
                    s.extend(out.token[r][keep], out.logprob[r][keep], out.top_ids[r][keep], out.top_logprobs[r][keep])
            if done is not None and done[r]:
                s.finish(FINISH_REASONS[int(reason[r])])
            elif s.finished:  # a stop string, a timeout or a cancel: the device does not know yet
                stopped_here.append(r)
            else:
                continue
            finished.append(s)
            self.rows[r] = None
        if stopped_here:
            self.state = self.gen.retire(self.state, stopped_here)
        return finished
