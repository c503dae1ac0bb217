"""The training step: schedule, optimizer, loss mask, z-loss, accumulation, and that it learns."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mesh_transformer.train import loss as losses
from mesh_transformer import parallel
from mesh_transformer.train.step import Trainer, learning_rate
from tests.helpers import max_abs_diff, mesh, random_tokens, tiny_config


def test_schedule_is_the_original_warmup_cosine():
    train = tiny_config(lr=1e-3, end_lr=1e-4, warmup_steps=10, anneal_steps=100).train
    lr = learning_rate(train)
    assert float(lr(0)) == 0.0
    assert float(lr(5)) == pytest.approx(5e-4)
    assert float(lr(10)) == pytest.approx(1e-3)
    assert float(lr(60)) == pytest.approx(1e-3 - 0.9e-3 * 0.5, rel=1e-5)  # halfway down the cosine
    assert float(lr(110)) == pytest.approx(1e-4, rel=1e-5)
    assert float(lr(10_000)) == pytest.approx(1e-4, rel=1e-5)


def test_weight_decay_only_on_matrices():
    trainer = Trainer(tiny_config(), mesh(1, 1))
    mask = parallel.decay_mask(trainer.model.infos)
    decayed = sorted(f"{m}/{n}" for m, leaves in mask.items() for n, on in leaves.items() if on)
    assert decayed == ["gptj/embed/embeddings", "gptj/head/lm_head", "gptj/layers/attn/k_proj",
                       "gptj/layers/attn/out_proj", "gptj/layers/attn/q_proj", "gptj/layers/attn/v_proj",
                       "gptj/layers/mlp/fc_in", "gptj/layers/mlp/fc_out"]


def test_vocab_parallel_cross_entropy_matches_dense():
    logits = jax.random.normal(jax.random.key(0), (2, 5, 11)) * 3
    targets = jnp.array([[0, 3, 10, 4, 4], [1, 2, 3, 9, 7]])
    mask = jnp.array([[1, 1, 1, 0, 1], [1, 0, 1, 1, 1]], jnp.float32)
    total, nll, count = losses.cross_entropy_sums(logits, targets, mask, z_loss=1e-2)
    logp = jax.nn.log_softmax(logits)
    dense_nll = -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
    lse = jax.nn.logsumexp(logits, -1)
    assert float(count) == 8
    assert float(nll) == pytest.approx(float(jnp.sum(dense_nll * mask)), rel=1e-6)
    assert float(total) == pytest.approx(float(jnp.sum((dense_nll + 1e-2 * lse**2) * mask)), rel=1e-6)


def test_loss_mask_excludes_tokens():
    trainer = Trainer(tiny_config(per_replica_batch=2), mesh(1, 1))
    state = trainer.init_state(0)
    tokens = random_tokens((1, 2, 17), 250)
    mask = np.ones((1, 2, 16), np.float32)
    mask[:, :, :8] = 0
    loss_a, _ = trainer.loss_and_grads(state.params, trainer.shard_batch({"tokens": tokens, "mask": mask}))
    full, _ = trainer.loss_and_grads(state.params, trainer.shard_batch({"tokens": tokens}))
    logits = np.asarray(trainer.logits(state.params, tokens[0, :, :-1]))
    logp = jax.nn.log_softmax(logits)
    nll = -np.take_along_axis(np.asarray(logp), tokens[0, :, 1:, None], -1)[..., 0]
    assert float(loss_a) == pytest.approx(nll[:, 8:].mean(), rel=1e-5)
    assert float(full) == pytest.approx(nll.mean(), rel=1e-5)


def test_accumulating_k_microbatches_equals_one_big_batch():
    tokens = random_tokens((4, 2, 17), 250, seed=4)
    mask = (np.random.RandomState(5).rand(4, 2, 16) > 0.3).astype(np.float32)  # uneven token counts
    results = []
    for accum, batch in [(4, 2), (1, 8)]:
        trainer = Trainer(tiny_config(per_replica_batch=batch, gradient_accumulation_steps=accum), mesh(1, 1))
        state = trainer.init_state(0)
        shaped = {"tokens": tokens.reshape(accum, batch, 17), "mask": mask.reshape(accum, batch, 16)}
        loss, grads = trainer.loss_and_grads(state.params, trainer.shard_batch(shaped))
        state, _ = trainer.step(state, trainer.shard_batch(shaped))
        results.append((float(loss), jax.device_get(grads), jax.device_get(state.params)))
    (loss_a, grads_a, params_a), (loss_b, grads_b, params_b) = results
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    assert max_abs_diff(grads_a, grads_b) < 1e-7
    assert max_abs_diff(params_a, params_b) < 1e-6


def test_clipping_and_metrics():
    trainer = Trainer(tiny_config(clip_norm=1e-3, lr=1e-2), mesh(1, 1))
    state = trainer.init_state(0)
    before = jax.device_get(state.params)
    batch = trainer.shard_batch({"tokens": random_tokens((1, 1, 17), 250)})
    state, metrics = trainer.step(state, batch)
    assert float(metrics["grad_norm"]) > 1e-3  # the raw norm is reported, pre-clip
    assert float(metrics["lr"]) == pytest.approx(1e-2)
    assert int(state.step) == 1
    assert max_abs_diff(jax.device_get(state.params), before) > 0


def test_tiny_model_overfits_one_batch():
    """100 steps on one fixed batch drive the loss from ~ln(250)=5.5 to under 0.5."""
    trainer = Trainer(tiny_config(lr=3e-3, per_replica_batch=4, cores_per_replica=2, remat="none",
                                  warmup_steps=5, anneal_steps=100, end_lr=3e-3, weight_decay=0.0), mesh(4, 2))
    state = trainer.init_state(0)
    batch = trainer.shard_batch({"tokens": random_tokens((1, 16, 17), 250, seed=7)})
    losses_seen = []
    for _ in range(100):
        state, metrics = trainer.step(state, batch)
        losses_seen.append(float(metrics["loss"]))
    assert losses_seen[0] > 5.0
    assert losses_seen[-1] < 0.5
    assert float(trainer.eval_loss(state.params, batch)) < 0.5


def test_bfloat16_compute_tracks_float32():
    batch = {"tokens": random_tokens((1, 4, 17), 250)}
    losses_by_dtype = {}
    for dtype in ("float32", "bfloat16"):
        trainer = Trainer(tiny_config(compute_dtype=dtype, per_replica_batch=4), mesh(1, 1))
        state = trainer.init_state(0)
        loss, grads = trainer.loss_and_grads(state.params, trainer.shard_batch(batch))
        assert jax.tree.leaves(grads)[0].dtype == jnp.float32  # master gradients stay fp32
        losses_by_dtype[dtype] = float(loss)
    assert losses_by_dtype["bfloat16"] == pytest.approx(losses_by_dtype["float32"], abs=2e-2)
