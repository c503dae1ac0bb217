"""Vocab-parallel cross-entropy: the full logits are never gathered.

Each mp shard holds logits for V/mp vocabulary entries; the log-sum-exp and the target logit are
assembled with three [B, T]-sized reductions over 'mp' (max, sum of exponentials, target logit).
"""
from __future__ import annotations

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


def token_log_probs(logits, targets):
    """log p(target) for each position [B, T]."""
    lse, target = normalizer_and_target(logits, targets)
    return target - lse


def log_sum_sq_probs(logits):
    """log sum_v p(v)^2 for each position [B, T]: how peaked the next-token distribution is (WPO)."""
    return log_normalizer(2 * logits) - 2 * log_normalizer(logits)


def cross_entropy_sums(logits, targets, mask, z_loss: float = 0.0):
    """Sums over this device's tokens: (objective, negative log-likelihood, token count).

    logits [B, T, V/mp] float32, targets [B, T] int, mask [B, T] (1 = train on this token).
    objective = nll + z_loss * logsumexp^2 (PaLM's z-loss keeps the normaliser near 0).
    """
    lse, target = normalizer_and_target(logits, targets)
    nll = lse - target
    mask = mask.astype(jnp.float32)
    objective = nll + z_loss * jnp.square(lse) if z_loss else nll
    return jnp.sum(objective * mask), jnp.sum(nll * mask), jnp.sum(mask)
