"""The sharded training step: loss, gradient accumulation, AdamW, schedule — one jitted function.

    state = Trainer(config, mesh).init_state(seed)
    state, metrics = trainer.step(state, {"tokens": int32 [A, B, T+1], "mask": [A, B, T] (optional)})

A = gradient_accumulation_steps microbatches of B = per_replica_batch x dp sequences (with a
preference objective, that many pairs or KTO examples: twice the rows), scanned inside the step. Master parameters and
optimizer state are float32 (sharded by the Megatron table, or by the ZeRO table when `zero` is
set); the forward/backward pass runs in compute_dtype.
The loss is token-weighted over all microbatches (with a preference objective, pair-weighted; with
"classify", a classifier on labelled texts, text-weighted, the batch's "labels" [A, B, 1], a multi-label one's [A, B, num_labels]), so k
microbatches equal one k-times-larger batch exactly (but with KTO, whose KL estimate is each
microbatch's own, as TRL's is).
"""
from __future__ import annotations

import functools

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mesh_transformer.train import classify
from mesh_transformer.train import loss as losses
from mesh_transformer.train import preference
from mesh_transformer import lora, models, parallel
from mesh_transformer.config import Config, ConfigError, TrainConfig

def fcm_keep(key, shape, min_ratio: float, max_ratio: float, segments=None):
    """Forgetful causal masking (Liu et al. 2022, arXiv 2210.13432; EasyLM's): [B, T] bool, False for
    keys no query may attend to. Each row draws a ratio in [min_ratio, max_ratio] and drops each key
    with that probability; a row's (or segment's) first token is always kept, so every query sees one."""
    ratio_key, drop_key = jax.random.split(key)
    ratio = jax.random.uniform(ratio_key, (shape[0], 1), minval=min_ratio, maxval=max_ratio)
    keep = jax.random.uniform(drop_key, shape) >= ratio
    first = jnp.zeros(shape, bool).at[:, 0].set(True)
    if segments is not None:
        first = first | jnp.concatenate([jnp.zeros_like(first[:, :1]), segments[:, 1:] != segments[:, :-1]], axis=1)
    return keep | first


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar; drives the learning-rate schedule
    params: Any  # float32 Haiku params: all of them, or with LoRA only the adapters
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
    applies -lr(step). `bf16_optimizer`: both Adam moments are stored in bfloat16 (half the
    optimizer memory; the update itself is computed in float32)."""
    return optax.chain(
        optax.clip_by_global_norm(train.clip_norm),
        scale_by_adam(train.b1, train.b2, train.eps, jnp.bfloat16 if train.bf16_optimizer else jnp.float32),
        optax.add_decayed_weights(train.weight_decay, mask=decay_mask),
    )


def scale_by_adam(b1: float, b2: float, eps: float, moments_dtype) -> optax.GradientTransformation:
    """optax.scale_by_adam with both moments stored in `moments_dtype` (optax casts only the first);
    the update is computed in float32. With float32 it is optax's own."""
    if jnp.dtype(moments_dtype) == jnp.float32:
        return optax.scale_by_adam(b1=b1, b2=b2, eps=eps)

    def init(params):
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, moments_dtype), params)
        return optax.ScaleByAdamState(jnp.zeros((), jnp.int32), zeros, zeros)

    def update(grads, state, params=None):
        count = optax.safe_increment(state.count)
        mu = jax.tree.map(lambda m, g: b1 * m.astype(jnp.float32) + (1 - b1) * g, state.mu, grads)
        nu = jax.tree.map(lambda v, g: b2 * v.astype(jnp.float32) + (1 - b2) * g * g, state.nu, grads)
        c1, c2 = 1 - b1 ** count.astype(jnp.float32), 1 - b2 ** count.astype(jnp.float32)
        updates = jax.tree.map(lambda m, v: (m / c1) / (jnp.sqrt(v / c2) + eps), mu, nu)
        cast = lambda t: jax.tree.map(lambda x: x.astype(moments_dtype), t)  # noqa: E731
        return updates, optax.ScaleByAdamState(count, cast(mu), cast(nu))
    return optax.GradientTransformation(init, update)


def _interleave(even, odd):
    """Rows [k, ...] and [k, ...] -> [2k, ...], alternating: even[0], odd[0], even[1], ..."""
    return jnp.stack([even, odd], axis=1).reshape(-1, *even.shape[1:])


class _WithBase:
    """A jitted function of (..., base) called without its last argument: the trainer's frozen base."""

    def __init__(self, fn, trainer: "Trainer"):
        self.fn, self.trainer = fn, trainer

    def __call__(self, *args):
        return self.fn(*args, self.trainer.base)

    def lower(self, *args):
        return self.fn.lower(*args, self.trainer.base)


@dataclass
class Trainer:
    """Builds and holds the compiled, sharded step for one config on one mesh."""

    config: Config
    mesh: Mesh

    def __post_init__(self):
        m, t = self.config.model, self.config.train
        self.mp, self.dp = self.mesh.shape[parallel.MP], self.mesh.shape[parallel.DP]
        self.lora = lora.LoraConfig.from_dict(t.lora) if t.lora is not None else None
        self.preference = preference.objective(t)  # DPO, CPO, ORPO or KTO on preference data, or None
        self.needs_reference = self.preference is not None and self.preference.needs_reference
        # DPO's reference without LoRA: a frozen copy of every weight, held (and passed) as the base is.
        self.holds_reference = self.needs_reference and self.lora is None
        self.classify = classify.objective(self.config)  # a classifier on labelled texts, or None
        objective = self.preference or self.classify
        self.metric_names = objective.metrics if objective is not None else ("loss",)
        self.sum_names = objective.sums if objective is not None else ("loss",)  # what adds up
        if m.classifier and t.preference != "reward" and self.classify is None:
            raise ConfigError(f"num_labels {m.num_labels}: a classifier trains on preference pairs as a reward model "
                              f"(config key 'reward') or on labelled texts (config key 'classify')")
        self.model = models.build(m, self.mp, lora.plan(m, self.lora))
        self.model.check_mesh(self.mesh.shape, t.zero)
        self.rules = self.model.rules(t.zero, self.mp)
        # With LoRA the state holds the adapters only; the frozen base lives apart (`self.base`), in
        # the compute dtype, with no gradient and no optimizer state. Without LoRA `base` is {}.
        trainable_infos, _ = self.split(self.model.infos)
        self.optimizer = optimizer(t, parallel.decay_mask(trainable_infos))
        self.schedule = learning_rate(t)
        self.abstract_state = jax.eval_shape(self._init, jax.random.key(0))
        self.param_specs, self.base_specs = self.split(self.model.param_specs(self.rules))
        compute = jnp.dtype(m.compute_dtype)
        if self.holds_reference:
            self.base_specs = self.param_specs
        self.abstract_base = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, compute),
                                          self.frozen_part(self.model.abstract_params))
        self.quantize_base = self.lora is not None and self.lora.quantize_base is not None
        if self.quantize_base:  # int8 matmul weights + float32 scales (QLoRA's idea at 8 bits)
            self.abstract_base, self.base_specs = lora.quantized_base(self.abstract_base, self.base_specs,
                                                                      self.split(self.model.infos)[1])
        full_specs = lora.join(self.base_specs, self.param_specs)  # the policy's (with LoRA: base and adapters)
        self.base_shardings = parallel.named(self.mesh, self.base_specs)
        self.base = {}
        opt_specs = optax.tree_map_params(self.optimizer, lambda _, spec: spec, self.abstract_state.opt_state,
                                          self.param_specs, transform_non_params=lambda _: P(),
                                          is_leaf=lambda x: isinstance(x, P))
        self.state_specs = TrainState(P(), self.param_specs, opt_specs)
        self.state_shardings = parallel.named(self.mesh, self.state_specs)
        self.batch_sharding = NamedSharding(self.mesh, P(None, parallel.DP, None))
        row = P(parallel.DP, None)
        self._sharded_loss = parallel.shard_map(
            self._local_loss, self.mesh, self.rules,
            in_specs=(full_specs, row, row, row, row, P()), out_specs=(P(), P(), P()))
        self._sharded_pairs = parallel.shard_map(
            self._local_pairs, self.mesh, self.rules,
            in_specs=(full_specs, full_specs, row, row, row, P(), P()), out_specs=(P(), P(), P()))
        self._sharded_texts = parallel.shard_map(
            self._local_texts, self.mesh, self.rules,
            in_specs=(full_specs, row, row, row, P()), out_specs=(P(), P(), P()))
        self.init_state = jax.jit(self._init, out_shardings=self.state_shardings)
        self.init_base = jax.jit(self._init_base, out_shardings=self.base_shardings)
        bs = self.base_shardings
        self.step = _WithBase(jax.jit(self._step, in_shardings=(self.state_shardings, self.batch_sharding, bs),
                                      out_shardings=(self.state_shardings, None), donate_argnums=0), self)
        self._sharded_logits = parallel.shard_map(
            lambda p, tokens: self.model.apply(p, tokens)[0], self.mesh, self.rules,
            in_specs=(full_specs, row), out_specs=P(parallel.DP, None, parallel.MP))
        self.logits = _WithBase(jax.jit(self._logits, in_shardings=(self.state_shardings.params,
                                                                     NamedSharding(self.mesh, row), bs)), self)
        self.eval_values = _WithBase(jax.jit(self._eval_values, in_shardings=(self.state_shardings.params,
                                                                              self.batch_sharding, bs)), self)
        self.loss_and_grads = _WithBase(jax.jit(self._loss_and_grads, in_shardings=(
            self.state_shardings.params, self.batch_sharding, bs), out_shardings=(None, self.state_shardings.params)), self)

    def split(self, tree):
        """A params-shaped tree -> (trainable part, frozen part); without LoRA (tree, {})."""
        return lora.split(tree, self.lora is not None)

    def frozen_part(self, tree):
        """What of a params-shaped tree the base holds: LoRA's frozen weights, DPO's whole reference
        (without LoRA), else nothing."""
        return tree if self.holds_reference else self.split(tree)[1]

    # ---- pieces -------------------------------------------------------------------------------

    @property
    def global_batch(self) -> int:
        """Rows (sequences) of a microbatch over the whole mesh; with DPO, two per pair."""
        return self.config.train.rows_per_replica * self.dp

    def _init(self, rng) -> TrainState:
        if isinstance(rng, int):
            rng = jax.random.key(rng)
        params, _ = self.split(self.model.init(rng))
        return TrainState(jnp.zeros((), jnp.int32), params, self.optimizer.init(params))

    def _init_base(self, rng):
        """A random frozen base (LoRA on a randomly initialised model: tests, benchmarks)."""
        if isinstance(rng, int):
            rng = jax.random.key(rng)
        # the plain model's init (no adapters drawn from the stream): the base `lora.base_params({"init": seed})` reads
        frozen = self.frozen_part(models.build(self.config.model, self.mp).init(rng))
        if self.quantize_base:
            return {m: {n: x for name, leaf in leaves.items() for n, x in self._base_leaf(m, name, leaf).items()}
                    for m, leaves in frozen.items()}
        return jax.tree.map(lambda x, a: x.astype(a.dtype), frozen, self.abstract_base)

    def _base_leaf(self, module: str, name: str, x) -> dict:
        """One frozen leaf as the base holds it: {name: x in the compute dtype}, or with
        `quantize_base` a matmul weight's {name: int8 values, name_scale: float32 scale}."""
        a = self.abstract_base[module][name]
        if a.dtype != jnp.int8:
            return {name: x.astype(a.dtype)}
        values, scale = parallel.quantize(x, self.model.infos[module][name])
        return {name: values, name + parallel.SCALE: scale}

    def set_base(self, params) -> None:
        """Hold `params`' frozen part (numpy or jax, any dtype) as the base: compute dtype (int8 matmul
        weights with `quantize_base`, converted a leaf at a time on the device), sharded."""
        _, frozen = self.split(params) if any(parallel.is_adapter(n) for v in params.values() for n in v) else ({}, params)
        if not self.quantize_base:
            frozen = {m: {n: frozen[m][n] for n in leaves} for m, leaves in self.abstract_base.items()}
            # a copy: DPO's reference is read from the params the state holds, and the step donates those
            self.base = jax.device_put(jax.tree.map(lambda x, a: np.asarray(x).astype(a.dtype)
                                                    if isinstance(x, np.ndarray) else jnp.array(x, a.dtype, copy=True),
                                                    frozen, self.abstract_base), self.base_shardings)
            return
        self.base = {}
        for m, leaves in self.abstract_base.items():
            self.base[m] = {}
            for n in leaves:
                if n.endswith(parallel.SCALE) and n[: -len(parallel.SCALE)] in leaves:
                    continue
                kept = (n, n + parallel.SCALE) if leaves[n].dtype == jnp.int8 else (n,)
                out = {k: self.base_shardings[m][k] for k in kept}
                if frozen[m][n].dtype == jnp.int8:  # quantized already (a base this trainer holds)
                    self.base[m].update(jax.device_put({k: frozen[m][k] for k in kept}, out))
                    continue
                self.base[m].update(jax.jit(functools.partial(self._base_leaf, m, n), out_shardings=out)(frozen[m][n]))

    def state_from_params(self, params) -> TrainState:
        """A fresh train state (step 0, new optimizer state) around given float32 params. With LoRA,
        `params` are the base's (they become `self.base`) and the adapters start fresh (A random, B 0)
        from the config's seed; a classifier's head, trained whole beside them, starts as `params` hold
        it. With DPO and no LoRA they are also the reference (held apart as `self.base`)."""
        if self.lora is not None or self.holds_reference:
            self.set_base(params)
        if self.lora is not None:
            state = self.init_state(self.config.train.seed)
            whole = {m: {n: params[m][n] for n in leaves if not parallel.is_adapter(n) and n in params.get(m, {})}
                     for m, leaves in state.params.items()}  # a classifier's head: trained whole, from `params`
            whole = {m: leaves for m, leaves in whole.items() if leaves}
            if not whole:
                return state
            params = lora.join(state.params, whole)
        params = jax.device_put(jax.tree.map(lambda x: x.astype(jnp.float32), params), self.state_shardings.params)
        opt_state = jax.jit(self.optimizer.init, out_shardings=self.state_shardings.opt_state)(params)
        return TrainState(jax.device_put(jnp.zeros((), jnp.int32), self.state_shardings.step), params, opt_state)

    def policy(self, params, base):
        """The weights being trained, whole: with LoRA the base joined to the adapters."""
        return lora.join(base, params) if self.lora is not None else params

    def _reference(self, params, base):
        """DPO's reference: with LoRA the base with its adapters off (zero), else the frozen copy."""
        if self.lora is not None:
            return lora.join(base, jax.tree.map(jnp.zeros_like, jax.lax.stop_gradient(params)))
        return base

    def _local_loss(self, params, tokens, mask, segments, key_keep, rng):
        """Per-device: tokens [b, T+1], mask [b, T], segments [b, T+1] or None, key_keep [b, T] or None
        -> global (objective sum, {"loss": nll sum}, token count). A target in another segment than
        the token before it is not trained (it would not be predicted with the examples one by one)."""
        inputs = segments[:, :-1] if segments is not None else None
        if segments is not None:
            mask = mask * (segments[:, 1:] == inputs)
        noise = self.config.train.neftune_noise_alpha if rng is not None else None  # (evaluation: no rng, no noise)
        nll_sums = functools.partial(losses.nll_sums_in_chunks, targets=tokens[:, 1:], mask=mask,
                                     z_loss=self.config.train.z_loss, chunk=self.config.model.loss_chunk)
        out = self.model.apply(params, tokens[:, :-1], segments=inputs, key_keep=key_keep, rng=rng,
                               routers=self._balance > 0, embed_noise=noise, on_head=nll_sums)
        total, nll, count = (parallel.psum_dp(s) for s in out[0])
        return self._with_balance_loss(total, out, count), {"loss": nll}, count

    @property
    def _balance(self) -> float:
        return getattr(self.config.model, "router_aux_loss_coef", 0.0)

    def _with_balance_loss(self, total, out, count):
        """A mixture's objective sum plus its load-balancing loss over the batch, weighted as the mean
        (over trained tokens, or pairs) the sum becomes; `out`: the model's outputs, routers included."""
        if self._balance <= 0:
            return total
        routers = jax.tree.map(parallel.psum_dp, out[2])
        return total + self._balance * routers.balance_loss() * count

    def _local_pairs(self, policy, reference, tokens, mask, labels, rng, nll_scale):
        """Per-device preference objective: rows alternate a pair's chosen and rejected completion
        (or an unpaired example's row and its KL row; tokens [b, T+1], mask [b, T] on the completion's
        tokens, labels [b, 1] or None) -> global (loss sum, metric sums, pair count). `reference` is read
        only by an objective that `needs_reference` (DPO, KTO); `nll_scale`: the whole step's
        (`preference.nll_scale`)."""
        if self.preference.kl_rows is not None:
            return self._local_kto(policy, reference, tokens, mask, labels, rng)
        if self.preference.reads_rewards:
            return self._local_rewards(policy, tokens, mask, rng)
        out = self._next_tokens(policy, tokens, sum_sq=self.preference.needs_sum_sq, rng=rng,
                                routers=self._balance > 0)
        reference_logps = self._log_probs(reference, tokens) if self.needs_reference else None
        total, sums, count = self.preference.pair_sums(out[0].log_probs, reference_logps, mask, out[0].log_sum_sq,
                                                       parallel.psum_dp, nll_scale)  # (labels: KTO's only)
        return self._with_balance_loss(total, out, count), sums, count  # added to the mean over pairs, as TRL adds it

    def _next_tokens(self, params, tokens, sum_sq: bool = False, **apply):
        """The model on tokens [b, T+1] but the last -> its outputs, with `losses.TokenStats` [b, T]
        of each next token in place of the logits (`sum_sq`: with WPO's log sum p^2), computed
        `loss_chunk` tokens at a time where the config says so (`losses.stats_in_chunks`)."""
        stats = functools.partial(losses.stats_in_chunks, targets=tokens[:, 1:], chunk=self.config.model.loss_chunk,
                                  sum_sq=sum_sq)
        return self.model.apply(params, tokens[:, :-1], on_head=stats, **apply)

    def _log_probs(self, params, tokens, **apply):
        """log p of each next token of tokens [b, T+1] -> [b, T] (a reference model's, KTO's KL rows)."""
        return self._next_tokens(params, tokens, **apply)[0].log_probs

    def _local_rewards(self, policy, tokens, mask, rng):
        """`_local_pairs` of a reward model: each row's reward is its score at its last token
        (`preference.last_tokens`)."""
        out = self.model.apply(policy, tokens[:, :-1], rng=rng, routers=self._balance > 0)
        rewards = models.core.last_token_scores(out[0], preference.last_tokens(mask))[:, 0]
        total, sums, count = self.preference.pair_sums(rewards, None, mask, reduce=parallel.psum_dp)
        return self._with_balance_loss(total, out, count), sums, count

    def _local_texts(self, policy, tokens, mask, labels, rng):
        """Per-device classification of labelled texts (tokens [b, T+1], mask [b, T] on each text's
        tokens, labels [b, label_width]) -> global (loss sum, metric sums, text count): each text's scores are
        the score head's at its last token (`classify.last_positions`)."""
        out = self.model.apply(policy, tokens[:, :-1], rng=rng, routers=self._balance > 0)
        scores = models.core.last_token_scores(out[0], classify.last_positions(mask))
        total, sums, count = self.classify.text_sums(scores, labels, classify.counted(mask), parallel.psum_dp)
        return self._with_balance_loss(total, out, count), sums, count

    def _local_kto(self, policy, reference, tokens, mask, labels, rng):
        """`_local_pairs` of rows that alternate an example's and its KL row (KTO): the KL rows get no
        gradient, so they run apart with no backward, and not at all where the loss reads none
        (`kl_rows` "unread"); a mixture's balance loss is the examples' rows' (as TRL's)."""
        out = self._next_tokens(policy, tokens[0::2], rng=rng, routers=self._balance > 0)
        own = (out[0].log_probs, self._log_probs(reference, tokens[0::2]))
        if self.preference.kl_rows == "read":
            kl_rng = None if rng is None else jax.random.fold_in(rng, 1)
            kl = (self._log_probs(jax.lax.stop_gradient(policy), tokens[1::2], rng=kl_rng),
                  self._log_probs(reference, tokens[1::2]))
        else:
            kl = tuple(jnp.zeros_like(x) for x in own)
        logps, reference_logps = (_interleave(a, b) for a, b in zip(own, kl))
        total, sums, count = self.preference.pair_sums(logps, reference_logps, mask, None, parallel.psum_dp,
                                                       labels=labels[:, 0])
        return self._with_balance_loss(total, out, count), sums, count

    def _objective_sums(self, params, base, micro, nll_scale=None):
        """(objective sum, {metric: sum}, count) of one microbatch: the language-model loss over
        trained tokens, or a preference objective's loss over pairs (`nll_scale`: the step's, for
        its NLL term; `preference.nll_scale`)."""
        policy = self.policy(params, base)
        tokens, mask, segments, key_keep, rng, labels = micro
        if self.classify is not None:
            if labels is None:
                raise ValueError("'classify' trains on labelled texts: the batch has no \"labels\"")
            return self._sharded_texts(policy, tokens, mask, labels, rng)
        if self.preference is None:
            return self._sharded_loss(policy, tokens, mask, segments, key_keep, rng)
        if self.preference.needs_labels and labels is None:
            raise ValueError(f"'{self.config.train.preference}' trains on labelled rows: the batch has no \"labels\"")
        reference = self._reference(params, base) if self.needs_reference else policy  # (unread)
        return self._sharded_pairs(policy, reference, tokens, mask, labels, rng, nll_scale)

    def _nll_scale(self, mask):
        """A preference objective's pairs per NLL token over all of `mask` (a step's rows), else None."""
        return preference.nll_scale(self.preference, mask) if self.preference is not None else None

    def _microbatch_grads(self, params, base, micro, nll_scale=None):
        def objective(p):
            total, sums, count = self._objective_sums(p, base, micro, nll_scale)
            return total, (sums, count)
        (_, (sums, count)), grads = jax.value_and_grad(objective, has_aux=True)(params)
        return grads, sums, count

    def _microbatches(self, batch, step):
        """The step's inputs per microbatch: (tokens, mask, segments, key_keep, rng, labels), each with a
        leading [A] axis (None where unused). Randomness (FCM, LoRA dropout, NEFTune) is seeded by (seed, step): a resumed
        run draws exactly what the uninterrupted one did."""
        t = self.config.train
        tokens = batch["tokens"]
        mask = batch.get("mask")
        mask = jnp.ones(tokens[..., 1:].shape, jnp.float32) if mask is None else mask
        segments = batch.get("segments")
        a = tokens.shape[0]
        keys = jax.random.split(jax.random.fold_in(jax.random.key(t.seed), step), a)
        key_keep = None
        if t.fcm_max_ratio > 0:
            key_keep = jax.vmap(lambda k, s: fcm_keep(k, tokens.shape[1:2] + (tokens.shape[2] - 1,), t.fcm_min_ratio,
                                                       t.fcm_max_ratio, s))(keys, None if segments is None else segments[..., :-1])
        dropout = self.lora is not None and self.lora.dropout > 0
        rng = keys if dropout or t.neftune_noise_alpha else None
        if rng is not None:
            rng = jax.vmap(lambda k: jax.random.fold_in(k, 1))(rng)
        return tokens, mask, segments, key_keep, rng, batch.get("labels")

    def _accumulate(self, params, batch, base, step):
        """Sum gradients over the A microbatches; return the mean grads and metrics (per trained
        token, or with a preference objective per pair)."""
        micros = self._microbatches(batch, step)
        nll_scale = self._nll_scale(micros[1])

        def body(carry, micro):
            grads, sums, count = self._microbatch_grads(params, base, micro, nll_scale)
            carry = jax.tree.map(jnp.add, carry, (grads, sums, count))
            return carry, None

        zeros = (jax.tree.map(jnp.zeros_like, params), {k: jnp.zeros(()) for k in self.sum_names}, jnp.zeros(()))
        (grads, sums, count), _ = jax.lax.scan(body, zeros, micros)
        count = jnp.maximum(count, 1.0)
        return jax.tree.map(lambda g: g / count, grads), self.means(sums, count)

    def means(self, sums: dict, count) -> dict:
        """{metric: value} from sums over `count` trained tokens (or pairs): each sum's mean, or a
        preference objective's own (`Objective.means`)."""
        if self.preference is None:
            return {k: v / count for k, v in sums.items()}  # (the language model's, a classifier's)
        return self.preference.means(sums, count)

    def _loss_and_grads(self, params, batch, base):
        grads, means = self._accumulate(params, batch, base, 0)
        return means["loss"], grads

    def _logits(self, params, tokens, base):
        """tokens [B, T] -> logits [B, T, n_vocab] float32 (padding dropped), sharded over dp and mp."""
        return self._sharded_logits(self.policy(params, base), tokens)[..., : self.config.model.n_vocab]

    def _eval_values(self, params, batch, base):
        """({sum: value}, count) of a batch shaped like a training batch ([A, B, T+1]): the nll
        summed over trained tokens (with a preference objective, its `sums` over pairs; `means` turns
        them into its metrics); no update, no FCM, no dropout."""
        tokens = batch["tokens"].reshape(-1, batch["tokens"].shape[-1])
        mask = batch.get("mask")
        mask = jnp.ones(tokens[:, 1:].shape, jnp.float32) if mask is None else mask.reshape(tokens[:, 1:].shape)
        segments = batch.get("segments")
        segments = None if segments is None else segments.reshape(tokens.shape)
        labels = batch.get("labels")
        labels = None if labels is None else labels.reshape(-1, labels.shape[-1])
        _, sums, count = self._objective_sums(params, base, (tokens, mask, segments, None, None, labels),
                                              self._nll_scale(mask))
        return sums, count

    def eval_sums(self, params, batch):
        """(loss sum, count) of a batch: summed token nll and trained tokens (with DPO: the summed
        preference loss and pairs)."""
        sums, count = self.eval_values(params, batch)
        return sums["loss"], count

    def eval_loss(self, params, batch) -> float:
        """Mean token negative log-likelihood of one batch."""
        nll, count = self.eval_sums(params, batch)
        return float(nll) / max(float(count), 1.0)

    def _step(self, state: TrainState, batch, base):
        grads, means = self._accumulate(state.params, batch, base, state.step)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        lr = self.schedule(state.step)
        params = jax.tree.map(lambda p, u: p - lr * u, state.params, updates)
        metrics = {**means, "grad_norm": optax.tree.norm(grads), "lr": lr}
        return TrainState(state.step + 1, params, opt_state), metrics

    # ---- helpers for callers ------------------------------------------------------------------

    def shard_batch(self, batch: dict) -> dict:
        """Host arrays [A, B_local, ...] (this process's slice of the batch) -> global sharded arrays."""
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(v))
                for k, v in batch.items()}

    def abstract_batch(self, accumulation: int | None = None) -> dict:
        """A step's batch as shapes (`accumulation` microbatches, default the config's): tokens, and
        labels where the objective reads them (KTO)."""
        shape = (accumulation or self.config.train.gradient_accumulation_steps, self.global_batch)
        out = {"tokens": jax.ShapeDtypeStruct((*shape, self.config.model.seq + 1), jnp.int32, sharding=self.batch_sharding)}
        if self.classify is not None or (self.preference is not None and self.preference.needs_labels):
            width = self.classify.label_width if self.classify is not None else 1
            out["labels"] = jax.ShapeDtypeStruct((*shape, width), jnp.float32, sharding=self.batch_sharding)
        return out
