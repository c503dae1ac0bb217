"""The sharded training step: loss, gradient accumulation, AdamW, schedule — one jitted function.

    state = Trainer(config, mesh).init_state(seed)
    state, metrics = trainer.step(state, {"tokens": int32 [A, B, T+1], "mask": [A, B, T] (optional)})

A = gradient_accumulation_steps microbatches of B = per_replica_batch x dp sequences, scanned
inside the step. Master parameters and optimizer state are float32 (sharded by the Megatron
table, or by the ZeRO table when `zero` is set); the forward/backward pass runs in compute_dtype.
The loss is token-weighted over all microbatches, so k microbatches equal one k-times-larger
batch exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mesh_transformer.train import loss as losses
from mesh_transformer import models, parallel
from mesh_transformer.config import Config, TrainConfig

class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar; drives the learning-rate schedule
    params: Any  # float32 Haiku params
    opt_state: Any


def learning_rate(train: TrainConfig):
    """The original schedule: linear warmup to lr, then cosine to end_lr over anneal_steps."""
    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = jnp.minimum(step, train.warmup_steps) / max(train.warmup_steps, 1)
        if train.warmup_steps == 0:
            warm = jnp.ones_like(step)
        progress = jnp.clip(step - train.warmup_steps, 0, train.anneal_steps) / train.anneal_steps
        return warm * train.lr - (train.lr - train.end_lr) * (1 - jnp.cos(jnp.pi * progress)) / 2
    return schedule


def optimizer(train: TrainConfig, decay_mask) -> optax.GradientTransformation:
    """clip -> Adam -> decoupled weight decay on matrices (`decay_mask`: params tree of bools, from
    what each parameter declares: weights and embedding tables, not biases or norms); the step
    applies -lr(step)."""
    return optax.chain(
        optax.clip_by_global_norm(train.clip_norm),
        optax.scale_by_adam(b1=train.b1, b2=train.b2, eps=train.eps),
        optax.add_decayed_weights(train.weight_decay, mask=decay_mask),
    )


@dataclass
class Trainer:
    """Builds and holds the compiled, sharded step for one config on one mesh."""

    config: Config
    mesh: Mesh

    def __post_init__(self):
        m, t = self.config.model, self.config.train
        self.mp, self.dp = self.mesh.shape[parallel.MP], self.mesh.shape[parallel.DP]
        self.model = models.build(m, self.mp)
        self.model.check_mesh(self.mesh.shape, t.zero)
        self.rules = self.model.rules(t.zero, self.mp)
        self.optimizer = optimizer(t, parallel.decay_mask(self.model.infos))
        self.schedule = learning_rate(t)
        self.abstract_state = jax.eval_shape(self._init, jax.random.key(0))
        self.param_specs = self.model.param_specs(self.rules)
        opt_specs = optax.tree_map_params(self.optimizer, lambda _, spec: spec, self.abstract_state.opt_state,
                                          self.param_specs, transform_non_params=lambda _: P(),
                                          is_leaf=lambda x: isinstance(x, P))
        self.state_specs = TrainState(P(), self.param_specs, opt_specs)
        self.state_shardings = parallel.named(self.mesh, self.state_specs)
        self.batch_sharding = NamedSharding(self.mesh, P(None, parallel.DP, None))
        self._sharded_loss = parallel.shard_map(
            self._local_loss, self.mesh, self.rules,
            in_specs=(self.param_specs, P(parallel.DP, None), P(parallel.DP, None)),
            out_specs=(P(), P(), P()))
        self.init_state = jax.jit(self._init, out_shardings=self.state_shardings)
        self.step = jax.jit(self._step, in_shardings=(self.state_shardings, self.batch_sharding),
                            out_shardings=(self.state_shardings, None), donate_argnums=0)
        self._sharded_logits = parallel.shard_map(
            lambda p, tokens: self.model.apply(p, tokens)[0], self.mesh, self.rules,
            in_specs=(self.param_specs, P(parallel.DP, None)), out_specs=P(parallel.DP, None, parallel.MP))
        self.logits = jax.jit(self._logits, in_shardings=(self.state_shardings.params, NamedSharding(self.mesh, P(parallel.DP, None))))
        self.eval_sums = jax.jit(self._eval_sums, in_shardings=(self.state_shardings.params, self.batch_sharding))
        self.loss_and_grads = jax.jit(self._loss_and_grads, in_shardings=(self.state_shardings.params, self.batch_sharding),
                                      out_shardings=(None, self.state_shardings.params))

    # ---- pieces -------------------------------------------------------------------------------

    @property
    def global_batch(self) -> int:
        return self.config.train.per_replica_batch * self.dp

    def _init(self, rng) -> TrainState:
        if isinstance(rng, int):
            rng = jax.random.key(rng)
        params = self.model.init(rng)
        return TrainState(jnp.zeros((), jnp.int32), params, self.optimizer.init(params))

    def state_from_params(self, params) -> TrainState:
        """A fresh train state (step 0, new optimizer state) around given float32 params."""
        params = jax.device_put(jax.tree.map(lambda x: x.astype(jnp.float32), params), self.state_shardings.params)
        opt_state = jax.jit(self.optimizer.init, out_shardings=self.state_shardings.opt_state)(params)
        return TrainState(jax.device_put(jnp.zeros((), jnp.int32), self.state_shardings.step), params, opt_state)

    def _local_loss(self, params, tokens, mask):
        """Per-device: tokens [b, T+1], mask [b, T] -> global (objective sum, nll sum, token count)."""
        logits, _ = self.model.apply(params, tokens[:, :-1])
        sums = losses.cross_entropy_sums(logits, tokens[:, 1:], mask, self.config.train.z_loss)
        return tuple(parallel.psum_dp(s) for s in sums)

    def _microbatch_grads(self, params, tokens, mask):
        def objective(p):
            total, nll, count = self._sharded_loss(p, tokens, mask)
            return total, (nll, count)
        (_, (nll, count)), grads = jax.value_and_grad(objective, has_aux=True)(params)
        return grads, nll, count

    def _accumulate(self, params, batch):
        """Sum gradients over the A microbatches; return token-mean grads and mean nll."""
        tokens = batch["tokens"]
        mask = batch.get("mask")
        if mask is None:
            mask = jnp.ones(tokens[..., 1:].shape, jnp.float32)

        def body(carry, microbatch):
            grads, nll, count = self._microbatch_grads(params, *microbatch)
            carry = jax.tree.map(jnp.add, carry, (grads, nll, count))
            return carry, None

        zeros = (jax.tree.map(jnp.zeros_like, params), jnp.zeros(()), jnp.zeros(()))
        (grads, nll, count), _ = jax.lax.scan(body, zeros, (tokens, mask))
        count = jnp.maximum(count, 1.0)
        return jax.tree.map(lambda g: g / count, grads), nll / count

    def _loss_and_grads(self, params, batch):
        grads, loss = self._accumulate(params, batch)
        return loss, grads

    def _logits(self, params, tokens):
        """tokens [B, T] -> logits [B, T, n_vocab] float32 (padding dropped), sharded over dp and mp."""
        return self._sharded_logits(params, tokens)[..., : self.config.model.n_vocab]

    def _eval_sums(self, params, batch):
        """(nll sum, token count) of a batch shaped like a training batch ([A, B, T+1]); no update."""
        tokens = batch["tokens"].reshape(-1, batch["tokens"].shape[-1])
        mask = batch.get("mask")
        mask = jnp.ones(tokens[:, 1:].shape, jnp.float32) if mask is None else mask.reshape(tokens[:, 1:].shape)
        _, nll, count = self._sharded_loss(params, tokens, mask)
        return nll, count

    def eval_loss(self, params, batch) -> float:
        """Mean token negative log-likelihood of one batch."""
        nll, count = self.eval_sums(params, batch)
        return float(nll) / max(float(count), 1.0)

    def _step(self, state: TrainState, batch):
        grads, loss = self._accumulate(state.params, batch)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        lr = self.schedule(state.step)
        params = jax.tree.map(lambda p, u: p - lr * u, state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": lr}
        return TrainState(state.step + 1, params, opt_state), metrics

    # ---- helpers for callers ------------------------------------------------------------------

    def shard_batch(self, batch: dict) -> dict:
        """Host arrays [A, B_local, ...] (this process's slice of the batch) -> global sharded arrays."""
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(v))
                for k, v in batch.items()}

    def abstract_batch(self) -> dict:
        t = self.config.train
        shape = (t.gradient_accumulation_steps, self.global_batch, self.config.model.seq + 1)
        return {"tokens": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sharding)}
