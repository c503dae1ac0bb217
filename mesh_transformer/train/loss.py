"""Vocab-parallel cross-entropy: the full logits are never gathered.

Each mp shard holds logits for V/mp vocabulary entries; the log-sum-exp and the target logit are
assembled with three [B, T]-sized reductions over 'mp' (max, sum of exponentials, target logit).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from mesh_transformer import parallel


def _exponentials(logits):
    """(exp(logits - peak) [B, T, V/mp], their sum over the whole vocabulary [B, T], the peak [B, T])."""
    # The max only stabilises exp(); logsumexp's gradient does not depend on it.
    peak = parallel.pmax_mp(jax.lax.stop_gradient(jnp.max(logits, axis=-1)))
    exps = jnp.exp(logits - peak[..., None])
    return exps, parallel.psum_mp(jnp.sum(exps, axis=-1)), peak


def log_normalizer(logits):
    """logits [B, T, V/mp] (float32) -> logsumexp over the whole vocabulary [B, T]."""
    _, total, peak = _exponentials(logits)
    return jnp.log(total) + peak


def target_logits(logits, targets):
    """The logit of each target token [B, T], wherever its vocabulary shard lives."""
    local_vocab = logits.shape[-1]
    local = targets - parallel.mp_index() * local_vocab
    here = (local >= 0) & (local < local_vocab)
    picked = jnp.take_along_axis(logits, jnp.clip(local, 0, local_vocab - 1)[..., None], axis=-1)[..., 0]
    return parallel.psum_mp(jnp.where(here, picked, 0.0))


@jax.custom_vjp
def normalizer_and_target(logits, targets):
    """(logsumexp over the whole vocabulary, the target's logit), each [B, T].

    Its backward is one element-wise pass over the logits: d/dlogits = g_lse * softmax + g_target *
    onehot(target), the one-hot compared in place. Differentiating the two functions above instead
    makes [B, T, V] zeros, scatters the target gradient into them and adds the softmax in further
    passes: on an H200 the 1B LLaMA's 128k vocabulary spent 28 ms of a 550 ms step there."""
    return log_normalizer(logits), target_logits(logits, targets)


def _keeps_exponentials() -> bool:
    """Whether the backward reads the forward's exponentials (a [B, T, V/mp] residual) rather than
    computing them again from the logits. A GPU recomputes them for free in its memory-bound pass
    (measured on an H200: 1.2% faster, 8.4 GB less than JAX's autodiff); a CPU's cores spend longer
    on the exponentials than on reading them (2.4x slower for [1024, 50257] float32 on two cores)."""
    return jax.default_backend() == "cpu"


def _normalizer_and_target_fwd(logits, targets):
    exps, total, peak = _exponentials(logits)
    lse = jnp.log(total) + peak
    # the target's index in this vocabulary shard, found here: the backward may be traced outside
    # the shard_map body that knows its 'mp' position
    local = targets - parallel.mp_index() * logits.shape[-1]
    kept = (exps, 1.0 / total) if _keeps_exponentials() else (logits, lse)
    return (lse, target_logits(logits, targets)), (kept, local)


def _normalizer_and_target_bwd(residuals, cotangents):
    (values, per_row), local = residuals
    g_lse, g_target = cotangents
    probs = values * per_row[..., None] if _keeps_exponentials() else jnp.exp(values - per_row[..., None])
    is_target = jax.lax.broadcasted_iota(jnp.int32, values.shape, values.ndim - 1) == local[..., None]
    d = g_lse[..., None] * probs + jnp.where(is_target, g_target[..., None], 0.0)
    return d.astype(values.dtype), None


normalizer_and_target.defvjp(_normalizer_and_target_fwd, _normalizer_and_target_bwd)


class TokenStats(NamedTuple):
    """What a loss reads of each position's logits [B, T, V/mp], each [B, T]: the log-sum-exp over
    the whole vocabulary, the target's logit and, where asked, log sum_v p(v)^2 (how peaked the
    next-token distribution is: WPO's weights)."""
    lse: jax.Array
    target: jax.Array
    log_sum_sq: Optional[jax.Array] = None

    @property
    def log_probs(self):
        """log p(target)."""
        return self.target - self.lse


def token_stats(logits, targets, sum_sq: bool = False) -> TokenStats:
    """logits [B, T, V/mp] float32, targets [B, T] int -> TokenStats: what the model runs on each
    chunk of tokens in training (`Model.apply(per_token=...)`), so that the logits are not kept."""
    lse, target = normalizer_and_target(logits, targets)
    return TokenStats(lse, target, log_normalizer(2 * logits) - 2 * lse if sum_sq else None)


def token_log_probs(logits, targets):
    """log p(target) for each position [B, T]."""
    return token_stats(logits, targets).log_probs


def cross_entropy_sums(logits, targets, mask, z_loss: float = 0.0):
    """`nll_sums` of logits [B, T, V/mp] float32 and targets [B, T] int."""
    return nll_sums(token_stats(logits, targets), mask, z_loss)


def nll_sums(stats: TokenStats, mask, z_loss: float = 0.0):
    """Sums over this device's tokens: (objective, negative log-likelihood, token count).

    mask [B, T] (1 = train on this token). objective = nll + z_loss * logsumexp^2 (PaLM's z-loss
    keeps the normaliser near 0).
    """
    nll = stats.lse - stats.target
    mask = mask.astype(jnp.float32)
    objective = nll + z_loss * jnp.square(stats.lse) if z_loss else nll
    return jnp.sum(objective * mask), jnp.sum(nll * mask), jnp.sum(mask)


# ------------------------------------------------------------------------------------------------
# The head and loss over chunks of tokens (the config's `loss_chunk`): [chunk, V/mp] logits at a
# time instead of [tokens, V/mp] logits, their exponentials and their gradient.
# ------------------------------------------------------------------------------------------------

def _in_chunks(x, chunk: int):
    """x [B, T, ...] -> [m, 1, chunk, ...]: its B*T tokens padded to m whole chunks."""
    flat = x.reshape(-1, *x.shape[2:])
    pad = -flat.shape[0] % chunk
    flat = jnp.pad(flat, ((0, pad),) + ((0, 0),) * (flat.ndim - 1))
    return flat.reshape(-1, 1, chunk, *x.shape[2:])


def _from_chunks(y, shape):
    """`_in_chunks`' inverse: [m, 1, chunk, ...] -> `shape` [B, T, ...], the padding dropped."""
    tokens = shape[0] * shape[1]
    return y.reshape(-1, *y.shape[3:])[:tokens].reshape(shape)


def _chunked(chunk: int, targets) -> bool:
    return 0 < chunk < targets.size


def stats_in_chunks(head, weights, x, targets, chunk: int, sum_sq: bool = False) -> TokenStats:
    """`token_stats` of the logits head(weights, x) (x [B, T, D], targets [B, T]), `chunk` tokens at a
    time (0: all at once), each chunk under `jax.checkpoint`: its backward computes the chunk's
    logits again (one more head product). What the preference objectives use: they differentiate
    the log-probabilities themselves."""
    if not _chunked(chunk, targets):
        return token_stats(head(weights, x), targets, sum_sq)
    weights, x = parallel.vary_alike(weights, x)  # (see `nll_sums_in_chunks`)
    step = jax.checkpoint(lambda pair: token_stats(head(weights, pair[0]), pair[1], sum_sq), prevent_cse=False)
    stats = jax.lax.map(step, (_in_chunks(x, chunk), _in_chunks(targets, chunk)))
    return jax.tree.map(lambda y: _from_chunks(y, targets.shape), stats)


def nll_sums_in_chunks(head, weights, x, targets, mask, z_loss: float, chunk: int):
    """`nll_sums` of the logits head(weights, x) (x [B, T, D], targets and mask [B, T]), `chunk`
    tokens at a time (0: all at once), the head's gradients computed in the same pass: the objective
    is a sum over tokens, so each chunk's share of the head's and the hidden states' gradients is
    known in the forward (for a unit cotangent, which the backward scales), and no chunk's logits
    are computed twice (as in Liger's fused linear cross-entropy). The NLL sum is a metric: not
    differentiated."""
    if not _chunked(chunk, targets):
        return nll_sums(token_stats(head(weights, x), targets), mask, z_loss)
    mask = mask.astype(jnp.float32)
    # alike over the mesh axes: each chunk's gradients stay this device's partial sums, summed
    # over 'dp' (the weights') and 'mp' (the hidden states') once, after the loop, by these
    # casts' transposes (a product casts its operands itself, inside the loop: once per chunk)
    weights, x = parallel.vary_alike(weights, x)
    objective, lse, target = _objective_in_chunks(head, z_loss, chunk, weights, x, targets, mask)
    nll = jax.lax.stop_gradient(lse - target)
    return objective, jnp.sum(nll * mask), jnp.sum(mask)


def _objective_sum(lse, target, mask, z_loss: float):
    return jnp.sum((lse - target + z_loss * jnp.square(lse)) * mask)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _objective_in_chunks(head, z_loss: float, chunk: int, weights, x, targets, mask):
    """(objective sum, lse [B, T], target logit [B, T]) of x [B, T, D]: without a backward, evaluation."""
    def one(inputs):
        xc, tc, mc = inputs
        lse, target = normalizer_and_target(head(weights, xc), tc)
        return _objective_sum(lse, target, mc, z_loss), lse, target
    objective, lse, target = jax.lax.map(one, tuple(_in_chunks(a, chunk) for a in (x, targets, mask)))
    return jnp.sum(objective), _from_chunks(lse, targets.shape), _from_chunks(target, targets.shape)


def _objective_in_chunks_fwd(head, z_loss, chunk, weights, x, targets, mask):
    def one(grads, inputs):
        xc, tc, mc = inputs
        logits, pullback = jax.vjp(head, weights, xc)
        lse, target = normalizer_and_target(logits, tc)
        # d objective / d logits = mask * ((1 + 2 z lse) softmax - onehot(target))
        local = tc - parallel.mp_index() * logits.shape[-1]
        is_target = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1) == local[..., None]
        probs = jnp.exp(logits - lse[..., None])
        d_logits = mc[..., None] * ((1 + 2 * z_loss * lse)[..., None] * probs - is_target)
        d_weights, d_x = pullback(d_logits.astype(logits.dtype))
        grads = jax.tree.map(lambda total, g: total + g.astype(jnp.float32), grads, d_weights)
        return grads, (_objective_sum(lse, target, mc, z_loss), lse, target, d_x)
    zeros = jax.tree.map(lambda w: parallel.vary(jnp.zeros(w.shape, jnp.float32), tuple(parallel.varying(w))), weights)
    grads, (objective, lse, target, d_x) = jax.lax.scan(one, zeros, tuple(_in_chunks(a, chunk)
                                                                          for a in (x, targets, mask)))
    out = (jnp.sum(objective), _from_chunks(lse, targets.shape), _from_chunks(target, targets.shape))
    grads = jax.tree.map(lambda total, w: total.astype(w.dtype), grads, weights)  # (rounded as autodiff's)
    return out, (grads, _from_chunks(d_x, x.shape))


def _objective_in_chunks_bwd(head, z_loss, chunk, residuals, cotangents):
    grads, d_x = residuals
    g = cotangents[0]  # lse's and the target logit's are zero: `nll_sums_in_chunks` stops them
    scaled = lambda d: (g * d.astype(jnp.float32)).astype(d.dtype)  # noqa: E731
    return jax.tree.map(scaled, grads), scaled(d_x), None, None


_objective_in_chunks.defvjp(_objective_in_chunks_fwd, _objective_in_chunks_bwd)
