"""Sampling: per-request options and small pure functions over [B, V] float32 logits.

Greedy, temperature, top-k, top-p and min-p (exact thresholds, no sort of the vocabulary: a CPU kernel),
HF's repetition and OpenAI's frequency/presence penalties, OpenAI's logit bias, a minimum length
before an end-of-text id may be chosen, a grammar's allowed tokens (`structured`), seeded per row so
results do not depend on the batch, stop sequences checked on device, log-probabilities only when a
row asks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np

from mesh_transformer import kernels
from mesh_transformer.generate.structured import Grammar, allowed

MAX_STOPS = 4  # stop sequences per request checked on device (OpenAI allows 4)
STOP_TOKENS = 8  # longest stop sequence (in tokens) checked on device; longer ones are checked as text
TOP_LOGPROBS = 5  # alternatives reported per token (OpenAI's completions limit)
MAX_EOS = 8  # end-of-text ids per request (a generation config's list: Llama 3.1 names 3, Gemma 2)
MAX_LOGIT_BIAS = 300  # logit_bias entries per request (OpenAI's limit)
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: each bias in [-100, 100]

RUNNING, EOS, STOP, LENGTH = 0, 1, 2, 3
FINISH_REASONS = {EOS: "stop", STOP: "stop", LENGTH: "length"}


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
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one (0 = none)
    repetition_penalty: float = 1.0  # CTRL/HF: seen tokens (prompt + output) get logit/p if > 0, logit*p if < 0
    frequency_penalty: float = 0.0  # OpenAI: logit -= count in output * this
    presence_penalty: float = 0.0  # OpenAI: logit -= this if in output
    seed: Optional[int] = None  # None = a fresh random seed
    eos_token_id: Optional[int | tuple[int, ...]] = None  # ends the row (returned, not part of the text); or several
    stop: tuple[str, ...] = ()  # text that ends the row (not part of the text)
    stop_token_ids: tuple[tuple[int, ...], ...] = ()  # token sequences that end the row on device
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit) pairs (OpenAI's)
    min_new_tokens: int = 0  # no end-of-text id is chosen before this many tokens (HF's; vLLM's min_tokens)
    logprobs: Optional[int] = None  # None: none; n: the chosen token's log p and the n most likely (n <= 5)
    grammar: Optional[Grammar] = None  # structured output: the text must match it (needs the tokenizer)

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
        need(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        need(self.repetition_penalty > 0, "repetition_penalty", "must be > 0")
        need(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]")
        need(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
        need(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer")
        need(self.logprobs is None or 0 <= self.logprobs <= TOP_LOGPROBS, "logprobs", f"must be in [0, {TOP_LOGPROBS}]")
        need(len(self.stop) <= MAX_STOPS, "stop", f"allows at most {MAX_STOPS} strings")
        need(len(self.stop_token_ids) <= MAX_STOPS, "stop_token_ids", f"allows at most {MAX_STOPS} sequences")
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        need(len(self.eos_ids) <= MAX_EOS and all(isinstance(t, (int, np.integer)) and t >= 0 for t in self.eos_ids),
             "eos_token_id", f"must be a token id or at most {MAX_EOS} of them")
        need(len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias", f"allows at most {MAX_LOGIT_BIAS} tokens")
        need(len({t for t, _ in self.logit_bias}) == len(self.logit_bias), "logit_bias", "names a token twice")
        need(all(isinstance(t, (int, np.integer)) and t >= 0 and -LOGIT_BIAS_RANGE <= b <= LOGIT_BIAS_RANGE
                 for t, b in self.logit_bias), "logit_bias",
             f"must map token ids to biases in [{-LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]")
        need(isinstance(self.min_new_tokens, int) and 0 <= self.min_new_tokens <= self.max_new_tokens,
             "min_new_tokens", f"must be an integer in [0, max_new_tokens={self.max_new_tokens}]")
        need(self.grammar is None or isinstance(self.grammar, Grammar), "grammar", "must be a structured.Grammar")

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The ids that end the row: none, one, or a generation config's several."""
        if self.eos_token_id is None:
            return ()
        return tuple(self.eos_token_id) if isinstance(self.eos_token_id, (tuple, list)) else (self.eos_token_id,)


class RowOptions(NamedTuple):
    """SamplingOptions as per-row device arrays (all [B] unless noted)."""

    temperature: Any
    top_k: Any
    top_p: Any
    min_p: Any
    repetition_penalty: Any
    frequency_penalty: Any
    presence_penalty: Any
    seed: Any  # uint32
    max_new: Any
    eos: Any  # [B, MAX_EOS] ids that end the row, -1 = padding
    stops: Any  # [B, MAX_STOPS, STOP_TOKENS] right-aligned token ids, -1 = padding
    top_logprobs: Any  # alternatives wanted (0..TOP_LOGPROBS); -1 = no log-probabilities at all
    adapter: Any  # the row's entry in the generator's bank of LoRA adapters (0: the base alone)
    bias_ids: Any  # [B, MAX_LOGIT_BIAS] token ids whose logits get `bias`, -1 = padding
    bias: Any  # [B, MAX_LOGIT_BIAS] float32
    min_new: Any  # tokens before an eos id may be chosen
    guided: Any  # bool: the row's tokens come from its grammar's mask (`DecodeState.allowed`)

    @classmethod
    def stack(cls, options: Seq[SamplingOptions], seeds: Seq[int], adapters: Optional[Seq[int]] = None) -> "RowOptions":
        stops = np.full((len(options), MAX_STOPS, STOP_TOKENS), -1, np.int32)
        eos = np.full((len(options), MAX_EOS), -1, np.int32)
        bias_ids = np.full((len(options), MAX_LOGIT_BIAS), -1, np.int32)
        bias = np.zeros((len(options), MAX_LOGIT_BIAS), np.float32)
        for i, o in enumerate(options):
            usable = [s for s in o.stop_token_ids if 0 < len(s) <= STOP_TOKENS][:MAX_STOPS]
            for j, s in enumerate(usable):
                stops[i, j, STOP_TOKENS - len(s):] = s
            eos[i, :len(o.eos_ids)] = o.eos_ids
            for j, (token, value) in enumerate(o.logit_bias):
                bias_ids[i, j], bias[i, j] = token, value

        def col(name, dtype):
            return np.array([getattr(o, name) for o in options], dtype)
        return cls(col("temperature", np.float32), col("top_k", np.int32), col("top_p", np.float32),
                   col("min_p", np.float32), col("repetition_penalty", np.float32),
                   col("frequency_penalty", np.float32), col("presence_penalty", np.float32),
                   np.array(seeds, np.uint32), col("max_new_tokens", np.int32),
                   eos, stops,
                   np.array([-1 if o.logprobs is None else o.logprobs for o in options], np.int32),
                   np.array(adapters if adapters is not None else [0] * len(options), np.int32),
                   bias_ids, bias, col("min_new_tokens", np.int32),
                   np.array([o.grammar is not None for o in options], bool))


# --------------------------------------------------------------------------------------------
# Sampling: small pure functions over [B, V] float32 logits and per-row [B] options
# --------------------------------------------------------------------------------------------

def penalize(logits, counts, seen, rows: RowOptions):
    """Repetition (HF/CTRL, over prompt + output) and frequency/presence (OpenAI, output) penalties."""
    rep = rows.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    counts = counts.astype(jnp.float32)
    return logits - counts * rows.frequency_penalty[:, None] - (counts > 0) * rows.presence_penalty[:, None]


def steer(logits, rows: RowOptions, n_generated):
    """OpenAI's logit bias added; each row's eos ids made impossible while it has generated fewer
    than its `min_new` tokens (HF's MinNewTokensLengthLogitsProcessor)."""
    b = jnp.arange(logits.shape[0])[:, None]
    logits = logits.at[b, jnp.maximum(rows.bias_ids, 0)].add(jnp.where(rows.bias_ids >= 0, rows.bias, 0.0),
                                                               mode="drop")
    early = (n_generated < rows.min_new)[:, None] & (rows.eos >= 0)
    return logits.at[b, jnp.maximum(rows.eos, 0)].min(jnp.where(early, -jnp.inf, jnp.inf), mode="drop")


def constrain(logits, rows: RowOptions, words):
    """Guided rows' logits outside their grammar's allowed tokens (`words` [B, W] bitmasks) -> -inf."""
    keep = allowed(words, logits.shape[-1]) | ~rows.guided[:, None]
    return jnp.where(keep, logits, -jnp.inf)


def top_k_top_p(logits, top_k, top_p, min_p=None):
    """Keep each row's `top_k` largest logits (0 = all), then its nucleus of mass `top_p`, then those
    at least `min_p` times as likely as its most likely (0 or None = all); others -> -inf.

    logits [B, V] float32, top_k [B] int, top_p and min_p [B] float. Exact, ties at the threshold
    kept (HF's top-k keeps them too; its top-p those its sort puts first), without sorting the
    vocabulary (170 ms for [16, 50400] on CPU): each row's top-k/top-p threshold is an order key
    (`_order_key`) from `kernels.truncation_floor` on CPU, else by bisection. min_p (as HF's and
    vLLM's) is one more threshold, the row's largest logit + log(min_p): the most likely token is
    always kept, so the three filters keep the smallest of their sets in any order.
    """
    floor = (kernels.truncation_floor if kernels.available() else _floor_by_bisection)(logits, top_k, top_p)
    if min_p is not None:
        floor = jnp.maximum(floor, _order_key(logits.max(axis=-1) + jnp.log(min_p)))
    return jnp.where(_order_key(logits) >= floor[:, None], logits, -jnp.inf)


def _floor_by_bisection(logits, top_k, top_p):
    """`kernels.truncation_floor`'s thresholds in XLA: each found by bisection over the 2^32 float32
    values, 32 masked sums over [B, V] (a 64-row batch of a 50k vocabulary on 2 CPU cores: top-p
    47 ms, top-k 26 ms, against the kernel's 5-7 including its exponentials)."""
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
    return jnp.maximum(k_floor, p_floor)


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
        truncating = jnp.any(sampling & ((rows.top_k > 0) | (rows.top_p < 1) | (rows.min_p > 0)))
        filtered = jax.lax.cond(truncating, lambda: top_k_top_p(scaled, rows.top_k, rows.top_p, rows.min_p),
                                lambda: scaled)
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


