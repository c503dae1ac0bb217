"""Vocab-parallel cross-entropy: the full logits are never gathered.

Each mp shard holds logits for V/mp vocabulary entries; the log-sum-exp and the target logit are
assembled with three [B, T]-sized reductions over 'mp' (max, sum of exponentials, target logit).
The backward pass is written out (`custom_vjp`): d logits = g_lse * softmax + g_target * onehot,
one fused pass over the [B, T, V/mp] logits instead of autodiff's several.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mesh_transformer import parallel


def _local_targets(logits, targets):
    """Targets as indices into this shard's vocabulary slice, and whether they live here."""
    local = targets - parallel.mp_index() * logits.shape[-1]
    return local, (local >= 0) & (local < logits.shape[-1])


@jax.custom_vjp
def lse_and_target(logits, targets):
    """logits [B, T, V/mp] float32, targets [B, T] -> (logsumexp over the whole vocabulary, target logit), each [B, T]."""
    return _forward(logits, targets)[0]


def _forward(logits, targets):
    # The max only stabilises exp(); the gradient does not depend on it.
    peak = parallel.pmax_mp(jnp.max(logits, axis=-1))
    lse = jnp.log(parallel.psum_mp(jnp.sum(jnp.exp(logits - peak[..., None]), axis=-1))) + peak
    local, here = _local_targets(logits, targets)
    picked = jnp.take_along_axis(logits, jnp.clip(local, 0, logits.shape[-1] - 1)[..., None], axis=-1)[..., 0]
    target = parallel.psum_mp(jnp.where(here, picked, 0.0))
    return (lse, target), (logits, lse, targets)


def _backward(residuals, cotangents):
    logits, lse, targets = residuals
    g_lse, g_target = cotangents
    local, _ = _local_targets(logits, targets)
    onehot = jnp.arange(logits.shape[-1]) == local[..., None]
    d_logits = g_lse[..., None] * jnp.exp(logits - lse[..., None]) + jnp.where(onehot, g_target[..., None], 0.0)
    return d_logits, None


lse_and_target.defvjp(_forward, _backward)


def token_log_probs(logits, targets):
    """log p(target) for each position [B, T]."""
    lse, target = lse_and_target(logits, targets)
    return target - lse


def cross_entropy_sums(logits, targets, mask, z_loss: float = 0.0):
    """Sums over this device's tokens: (objective, negative log-likelihood, token count).

    logits [B, T, V/mp] float32, targets [B, T] int, mask [B, T] (1 = train on this token).
    objective = nll + z_loss * logsumexp^2 (PaLM's z-loss keeps the normaliser near 0).
    """
    lse, target = lse_and_target(logits, targets)
    nll = lse - target
    mask = mask.astype(jnp.float32)
    objective = nll + z_loss * jnp.square(lse) if z_loss else nll
    return jnp.sum(objective * mask), jnp.sum(nll * mask), jnp.sum(mask)
