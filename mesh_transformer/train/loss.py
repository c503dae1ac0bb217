"""Vocab-parallel cross-entropy: the full logits are never gathered.

Each mp shard holds logits for V/mp vocabulary entries; the log-sum-exp and the target logit are
assembled with three [B, T]-sized reductions over 'mp' (max, sum of exponentials, target logit).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mesh_transformer import parallel


def log_normalizer(logits):
    """logits [B, T, V/mp] (float32) -> logsumexp over the whole vocabulary [B, T]."""
    # The max only stabilises exp(); logsumexp's gradient does not depend on it.
    peak = parallel.pmax_mp(jax.lax.stop_gradient(jnp.max(logits, axis=-1)))
    total = parallel.psum_mp(jnp.sum(jnp.exp(logits - peak[..., None]), axis=-1))
    return jnp.log(total) + peak


def target_logits(logits, targets):
    """The logit of each target token [B, T], wherever its vocabulary shard lives."""
    local_vocab = logits.shape[-1]
    local = targets - parallel.mp_index() * local_vocab
    here = (local >= 0) & (local < local_vocab)
    picked = jnp.take_along_axis(logits, jnp.clip(local, 0, local_vocab - 1)[..., None], axis=-1)[..., 0]
    return parallel.psum_mp(jnp.where(here, picked, 0.0))


def token_log_probs(logits, targets):
    """log p(target) for each position [B, T]."""
    return target_logits(logits, targets) - log_normalizer(logits)


def log_sum_sq_probs(logits):
    """log sum_v p(v)^2 for each position [B, T]: how peaked the next-token distribution is (WPO)."""
    return log_normalizer(2 * logits) - 2 * log_normalizer(logits)


def cross_entropy_sums(logits, targets, mask, z_loss: float = 0.0):
    """Sums over this device's tokens: (objective, negative log-likelihood, token count).

    logits [B, T, V/mp] float32, targets [B, T] int, mask [B, T] (1 = train on this token).
    objective = nll + z_loss * logsumexp^2 (PaLM's z-loss keeps the normaliser near 0).
    """
    lse = log_normalizer(logits)
    nll = lse - target_logits(logits, targets)
    mask = mask.astype(jnp.float32)
    objective = nll + z_loss * jnp.square(lse) if z_loss else nll
    return jnp.sum(objective * mask), jnp.sum(nll * mask), jnp.sum(mask)
