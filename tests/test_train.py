"""The training step: schedule, optimizer, loss mask, z-loss, accumulation, and that it learns."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mesh_transformer.train import loss as losses
from mesh_transformer import parallel
from mesh_transformer.train.step import Trainer, learning_rate
from tests.helpers import TINY, layer_loop_bodies, max_abs_diff, mesh, random_tokens, tiny_config


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


@pytest.mark.parametrize("keeps_exponentials", [True, False], ids=["cpu-way", "gpu-way"])
@pytest.mark.parametrize("mp", [1, 2])
def test_vocab_parallel_cross_entropy_gradient_is_the_dense_one(mp, keeps_exponentials, monkeypatch):
    """The loss's own backward (one pass: g_lse * softmax + g_target * onehot) equals autodiff of the
    dense formula, with the vocabulary split over mp shards and the gradient taken outside shard_map,
    as the train step takes it; the same for token_log_probs (DPO's and KTO's). Both ways of getting
    the softmax: from the forward's exponentials (a CPU's) or computed again (a GPU's)."""
    from jax.sharding import PartitionSpec as P
    monkeypatch.setattr(losses, "_keeps_exponentials", lambda: keeps_exponentials)
    logits = jax.random.normal(jax.random.key(1), (2, 5, 12)) * 3
    targets = jnp.array([[0, 3, 11, 4, 6], [1, 2, 7, 9, 5]])  # in both halves of the vocabulary
    mask = jnp.array([[1, 1, 1, 0, 1], [1, 0, 1, 1, 1]], jnp.float32)
    weights = jax.random.normal(jax.random.key(2), (2, 5))

    def dense(x):
        lse = jax.nn.logsumexp(x, -1)
        nll = lse - jnp.take_along_axis(x, targets[..., None], -1)[..., 0]
        return jnp.sum((nll + 1e-2 * lse ** 2) * mask) + jnp.sum(-nll * weights)

    def local(x):
        total = losses.cross_entropy_sums(x, targets, mask, z_loss=1e-2)[0]
        return total + jnp.sum(losses.token_log_probs(x, targets) * weights)

    sharded = parallel.shard_map(local, mesh(1, mp), parallel.MEGATRON, in_specs=(P(None, None, "mp"),),
                                 out_specs=P())
    value, grad = jax.value_and_grad(sharded)(logits)
    want_value, want_grad = jax.value_and_grad(dense)(logits)
    assert float(value) == pytest.approx(float(want_value), rel=1e-6)
    assert float(jnp.max(jnp.abs(grad - want_grad))) < 1e-6
    assert float(jnp.max(jnp.abs(want_grad))) > 0.1


def test_unscanned_layers_train_as_the_scanned_ones_without_their_loops():
    """scan_layers=false unrolls the layer scan (on an H200 XLA then no longer copies each layer's
    saved activations into [L, ...] stacks): the same loss and gradients, the parameters still
    stacked, and the compiled step has no while loop over the layers, forward or backward."""
    tokens = random_tokens((1, 4, 17), 250, seed=3)
    loops, results = {}, {}
    for scan in (True, False):
        trainer = Trainer(tiny_config(per_replica_batch=4, cores_per_replica=2, remat="dots", scan_layers=scan),
                          mesh(1, 2))
        state = trainer.init_state(0)
        batch = trainer.shard_batch({"tokens": tokens})
        results[scan] = jax.device_get(trainer.loss_and_grads(state.params, batch))
        hlo = trainer.loss_and_grads.lower(state.params, batch).compile().as_text()
        loops[scan] = len(layer_loop_bodies(hlo, TINY["layers"]))
    (loss_scanned, grads_scanned), (loss_unrolled, grads_unrolled) = results[True], results[False]
    assert float(loss_unrolled) == pytest.approx(float(loss_scanned), rel=1e-6)
    assert max_abs_diff(grads_unrolled, grads_scanned) < 1e-6
    assert jax.tree.map(np.shape, grads_unrolled) == jax.tree.map(np.shape, grads_scanned)
    assert loops == {True: 2, False: 0}


@pytest.mark.parametrize("dp,mp", [(1, 1), (2, 2)])
def test_loss_in_token_chunks_trains_as_all_at_once_in_less_memory(dp, mp):
    """`loss_chunk`: the vocabulary head and cross-entropy run 96 tokens at a time (1024 / dp a device
    here, not a multiple: the last chunk is padded), each chunk's share of the head's gradients
    computed as it goes. The loss (with z-loss) and gradients are all-at-once's, also where the
    weights' gradient is summed over 'dp' and the hidden states' over 'mp'; the compiled step's
    temporaries shrink by more than a device's [1024 / dp, 4096 / mp] float32 logits: what a
    128k-262k vocabulary at long context needs (the logits, their exponentials and their gradient
    were each that size)."""
    tokens = random_tokens((1, 8, 129), 4000, seed=3)
    results, temps = {}, {}
    for chunk in (0, 96):
        trainer = Trainer(tiny_config(n_vocab=4000, seq=128, per_replica_batch=8 // dp, cores_per_replica=mp,
                                      z_loss=1e-2, loss_chunk=chunk), mesh(dp, mp))
        state = trainer.init_state(0)
        batch = trainer.shard_batch({"tokens": tokens})
        results[chunk] = jax.device_get(trainer.loss_and_grads(state.params, batch))
        temps[chunk] = trainer.loss_and_grads.lower(state.params, batch).compile().memory_analysis().temp_size_in_bytes
    (loss, grads), (chunked_loss, chunked_grads) = results[0], results[96]
    assert float(chunked_loss) == pytest.approx(float(loss), rel=1e-6)
    assert max_abs_diff(chunked_grads, grads) < 1e-6
    assert temps[0] - temps[96] > 1024 // dp * 4096 // mp * 4, temps


def _loop_bodies(hlo: str) -> dict:
    """{while-loop body computation: its lines} of compiled HLO text."""
    computations, current = {}, None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            current = computations.setdefault(header.group(1), [])
        elif current is not None:
            current.append(line)
    return {name: computations[name] for name in re.findall(r"body=%?([\w.\-]+)", hlo)}


@pytest.mark.parametrize("objective", [{}, {"dpo": {"beta": 0.1}}], ids=["lm", "dpo"])
def test_loss_chunk_loops_reduce_only_per_token_values(objective):
    """On dp 2 x mp 2 the loops over chunks of tokens reduce over the mesh only each chunk's [1, 96]
    log-sum-exp and target logit: the head's gradient (over 'dp') and the hidden states' (over 'mp')
    are summed once, after the loop, not once per chunk — the language-model loss's (its gradients
    computed in the forward) and DPO's (each chunk's logits computed again in the backward) alike."""
    trainer = Trainer(tiny_config(n_vocab=4000, seq=128, per_replica_batch=4, cores_per_replica=2, loss_chunk=96,
                                  **objective), mesh(2, 2))
    state = trainer.init_state(0)
    if trainer.needs_reference:
        trainer.base = trainer.init_base(1)
    batch = trainer.shard_batch({"tokens": random_tokens((1, 8, 129), 4000, seed=3)})
    hlo = trainer.loss_and_grads.lower(state.params, batch).compile().as_text()
    reduced = {name: re.findall(r"= (\(?f32\[[^=]*?) all-reduce\(", "\n".join(lines))
               for name, lines in _loop_bodies(hlo).items()}
    chunk_loops = {name: shapes for name, shapes in reduced.items() if any("[1,96]" in s for s in shapes)}
    assert len(chunk_loops) >= (1 if not objective else 3), reduced  # forward (and DPO's reference, backward)
    for name, shapes in chunk_loops.items():
        assert all(re.fullmatch(r"\(?(f32\[1,96\]\{1,0\}(, )?)+\)?", s) for s in shapes), (name, shapes)


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


# ---- the optimizer, against independent references ---------------------------------------------

def original_gpt3_schedule(step, warmup_steps, anneal_steps, peak_lr, end_lr):
    """mesh-transformer-jax `util.gpt3_schedule`, transcribed in float64."""
    warmup_pct = np.clip(step, 0, warmup_steps) / warmup_steps
    anneal_pct = np.clip(step - warmup_steps, 0, anneal_steps) / anneal_steps
    return warmup_pct * peak_lr - (peak_lr - end_lr) * (1 - np.cos(np.pi * anneal_pct)) / 2


@pytest.mark.parametrize("warmup,anneal,lr,end_lr", [(10, 100, 1e-3, 1e-4), (3000, 300_000, 1.2e-4, 1.2e-5), (1, 7, 0.5, 0.0)])
def test_schedule_curve_is_the_originals(warmup, anneal, lr, end_lr):
    """Warmup, the whole cosine and after it: linear decay, a shifted cosine or a missing end_lr would differ."""
    schedule = learning_rate(tiny_config(lr=lr, end_lr=end_lr, warmup_steps=warmup, anneal_steps=anneal).train)
    points = sorted({0, 1, warmup // 3, warmup - 1, warmup, warmup + 1, *(warmup + anneal * f // 8 for f in range(1, 8)),
                     warmup + anneal - 1, warmup + anneal, warmup + anneal + 1, 2 * (warmup + anneal) + 5})
    ours = np.array([float(schedule(s)) for s in points])
    np.testing.assert_allclose(ours, original_gpt3_schedule(np.array(points), warmup, anneal, lr, end_lr),
                               rtol=2e-6, atol=1e-12 * lr)


def adam_state(opt_state):
    import optax
    return optax.tree_utils.tree_get(opt_state, "mu"), optax.tree_utils.tree_get(opt_state, "nu")


def flat(tree) -> dict:
    return {f"{m}/{n}": np.asarray(v, np.float64) for m, leaves in tree.items() for n, v in leaves.items()}


# Every optimizer key away from its default, so a key that does not reach optax shows up in the update.
ADAMW = {"lr": 2e-2, "end_lr": 5e-3, "warmup_steps": 2, "anneal_steps": 4, "b1": 0.5, "b2": 0.8, "eps": 1e-4,
         "weight_decay": 0.3, "z_loss": 1e-3, "per_replica_batch": 2}
MATRICES = {"gptj/embed/embeddings", "gptj/head/lm_head", "gptj/layers/attn/q_proj", "gptj/layers/attn/k_proj",
            "gptj/layers/attn/v_proj", "gptj/layers/attn/out_proj", "gptj/layers/mlp/fc_in", "gptj/layers/mlp/fc_out"}


@pytest.mark.parametrize("clip_norm", [1e-3, 1e3], ids=["clipped", "unclipped"])
def test_adamw_steps_match_a_float64_reference(clip_norm):
    """Three steps of clip -> Adam(b1, b2, eps) -> decoupled decay on matrices -> -lr(step), written out in
    numpy from the gradients the library computes at each step's parameters."""
    config = tiny_config(**ADAMW, clip_norm=clip_norm)
    t = config.train
    trainer = Trainer(config, mesh(1, 1))
    state = trainer.init_state(0)
    batch = trainer.shard_batch({"tokens": random_tokens((1, 2, 17), 250, seed=3)})
    p = flat(jax.device_get(state.params))
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    for step in range(3):
        _, grads = trainer.loss_and_grads(state.params, batch)
        g = flat(jax.device_get(grads))
        norm = np.sqrt(sum(np.sum(x**2) for x in g.values()))
        assert (norm > clip_norm) == (clip_norm == 1e-3)
        scale = min(1.0, clip_norm / norm)
        lr = original_gpt3_schedule(step, t.warmup_steps, t.anneal_steps, t.lr, t.end_lr)
        for k in p:
            m[k] = t.b1 * m[k] + (1 - t.b1) * scale * g[k]
            v[k] = t.b2 * v[k] + (1 - t.b2) * (scale * g[k]) ** 2
            update = (m[k] / (1 - t.b1 ** (step + 1))) / (np.sqrt(v[k] / (1 - t.b2 ** (step + 1))) + t.eps)
            p[k] = p[k] - lr * (update + (t.weight_decay * p[k] if k in MATRICES else 0))
        state, metrics = trainer.step(state, batch)
        assert float(metrics["lr"]) == pytest.approx(lr, rel=1e-6)
        assert float(metrics["grad_norm"]) == pytest.approx(norm, rel=1e-5)
        mu, nu = (flat(jax.device_get(x)) for x in adam_state(state.opt_state))
        if step == 0 and scale < 1:  # clipping shows in the first moment: mu = (1 - b1) clip_norm g / |g|
            mu_norm = np.sqrt(sum(np.sum(x**2) for x in mu.values()))
            assert mu_norm == pytest.approx((1 - t.b1) * clip_norm, rel=1e-5)
        for k in p:  # the step's own backward pass may round differently from loss_and_grads'
            np.testing.assert_allclose(mu[k], m[k], rtol=1e-5, atol=1e-6 * np.abs(m[k]).max(), err_msg=k)
            np.testing.assert_allclose(nu[k], v[k], rtol=1e-5, atol=1e-6 * np.abs(v[k]).max(), err_msg=k)
        ours = flat(jax.device_get(state.params))
        for k in p:  # the decay term alone is ~lr x 6e-3; allowed: 1e-5 lr plus float32 rounding of p, per step
            tolerance = 1e-5 * t.lr + (step + 1) * np.finfo(np.float32).eps * np.abs(p[k])
            assert np.all(np.abs(ours[k] - p[k]) <= tolerance), f"{k} after step {step + 1}"


# One step's weight decay is lr x wd x p on every matrix and nothing else, whatever the layout: the same
# step with weight_decay 0 and 0.3 from the same parameters differs by exactly that. eps 1e-3 keeps Adam
# from magnifying float noise in near-zero gradients (g / (|g| + eps)), so layouts agree far more closely
# than the decay moves the weights.
DECAY_LAYOUTS = [(1, 1, False), (2, 4, False), (2, 4, True)]
DECAY_LR, DECAY_WD = 1e-2, 0.3


@pytest.fixture(scope="module")
def decay_runs():
    """{(dp, mp, zero, wd): (params after 1 step, after 3 steps)} from shared initial parameters."""
    batch = {"tokens": random_tokens((2, 8, 17), 250, seed=11)}
    runs, initial = {}, None
    for dp, mp, zero in DECAY_LAYOUTS:
        for wd in (0.0, DECAY_WD):
            trainer = Trainer(tiny_config(per_replica_batch=8 // dp, gradient_accumulation_steps=2, cores_per_replica=mp,
                                          zero=zero, weight_decay=wd, eps=1e-3, lr=DECAY_LR, end_lr=DECAY_LR),
                              mesh(dp, mp))
            if initial is None:
                initial = jax.device_get(trainer.init_state(0).params)
            state = trainer.state_from_params(initial)
            after = []
            for _ in range(3):
                state, _ = trainer.step(state, trainer.shard_batch(batch))
                after.append(flat(jax.device_get(state.params)))
            runs[dp, mp, zero, wd] = (after[0], after[2])
    return flat(initial), runs


@pytest.mark.parametrize("dp,mp,zero", DECAY_LAYOUTS, ids=["1x1", "dp2xmp4", "dp2xmp4-zero"])
def test_weight_decay_is_exactly_lr_wd_p_on_matrices_only(decay_runs, dp, mp, zero):
    initial, runs = decay_runs
    without, with_decay = runs[dp, mp, zero, 0.0][0], runs[dp, mp, zero, DECAY_WD][0]
    assert set(initial) > MATRICES
    for name, p in initial.items():
        moved = without[name] - with_decay[name]
        if name in MATRICES:  # the effect is ~3e-3 x 0.02; rounding of p - lr x update is ~1e-9
            np.testing.assert_allclose(moved, DECAY_LR * DECAY_WD * p, rtol=0, atol=2e-8, err_msg=name)
            assert np.abs(moved).max() > 1e-5, name
        else:  # biases and norms: bit-identical
            np.testing.assert_array_equal(moved, 0, err_msg=name)


@pytest.mark.parametrize("dp,mp,zero", DECAY_LAYOUTS[1:], ids=["dp2xmp4", "dp2xmp4-zero"])
def test_sharded_steps_match_one_device_far_below_weight_decay(decay_runs, dp, mp, zero):
    """3 steps: layouts agree to 1e-6 (measured 2e-7) while weight decay alone moves every matrix by > 1e-4."""
    initial, runs = decay_runs
    reference, sharded = runs[1, 1, False, DECAY_WD][1], runs[dp, mp, zero, DECAY_WD][1]
    no_decay = runs[1, 1, False, 0.0][1]
    decay_effect = min(np.abs(reference[k] - no_decay[k]).max() for k in MATRICES)
    worst = max(np.abs(reference[k] - sharded[k]).max() for k in initial)
    assert decay_effect > 1e-4
    assert worst < 1e-6


def _dot_operand_types(lowered_text: str) -> list[tuple[str, str]]:
    """Element types of (lhs, rhs) of every dot_general in a lowered (StableHLO) program."""
    return re.findall(r"dot_general.*: \(tensor<[\dx]*x(\w+)>, tensor<[\dx]*x(\w+)>\)", lowered_text)


@pytest.fixture(scope="module")
def by_compute_dtype():
    batch = {"tokens": random_tokens((1, 4, 17), 250)}
    out = {}
    for dtype in ("float32", "bfloat16"):
        trainer = Trainer(tiny_config(compute_dtype=dtype, per_replica_batch=4), mesh(1, 1))
        state = trainer.init_state(0)
        sharded = trainer.shard_batch(batch)
        loss, grads = trainer.loss_and_grads(state.params, sharded)
        out[dtype] = float(loss), grads, trainer.loss_and_grads.lower(state.params, sharded).as_text()
    return out


def test_bfloat16_compute_is_in_the_program_and_close_to_float32(by_compute_dtype):
    loss32, _, program32 = by_compute_dtype["float32"]
    loss16, grads16, program16 = by_compute_dtype["bfloat16"]
    assert jax.tree.leaves(grads16)[0].dtype == jnp.float32  # master gradients stay fp32
    assert set(_dot_operand_types(program32)) == {("f32", "f32")}
    # Forward: the 6 projections and 2 attention einsums of the (scanned) layer, and the head.
    assert _dot_operand_types(program16).count(("bf16", "bf16")) >= 9
    assert loss16 != loss32  # measured 2.2e-4 apart
    assert abs(loss16 - loss32) < 2e-3


def test_bfloat16_activation_runs_in_float32(by_compute_dtype):
    """The MLP's activation (GPT-J's tanh-GELU) takes float32 and is rounded once: on bfloat16 XLA:CPU
    rounds after each of its operations (`layers.MLP._in`)."""
    *_, program16 = by_compute_dtype["bfloat16"]
    tanh = re.findall(r"stablehlo\.tanh %\S+ : tensor<[\dx]*x(\w+)>", program16)
    assert tanh and set(tanh) == {"f32"}, tanh


def test_bfloat16_backward_matmuls_run_in_bfloat16(by_compute_dtype):
    """All but the head bias's gradient, a row of ones times the float32 logit gradients (a sum)."""
    *_, program16 = by_compute_dtype["bfloat16"]
    vocab = tiny_config().model.padded_vocab(1)
    matmuls = "\n".join(line for line in program16.splitlines() if f"-> tensor<1x{vocab}xf32>" not in line)
    assert ("f32", "f32") not in _dot_operand_types(matmuls)


def test_head_bias_gradient_is_a_matmul_not_a_sum_over_tokens(by_compute_dtype):
    """XLA:CPU sums [tokens, 50k] logit gradients 80x slower than it multiplies them by a row of
    ones (`layers.add_bias`): no reduction in the step may end in a vocabulary-sized vector."""
    _, _, program32 = by_compute_dtype["float32"]
    vocab = tiny_config().model.padded_vocab(1)
    reductions = re.findall(r"stablehlo\.reduce\(.*-> tensor<(\d+)xf32>", program32)
    assert str(vocab) not in reductions
    assert re.search(rf"dot_general.*tensor<1x{vocab}xf32>", program32)


def test_z_loss_adds_its_gradient_and_not_its_value():
    """grads(z) - grads(0) = d/dparams of z x mean(logsumexp(logits)^2), through the dense logits."""
    tokens = random_tokens((1, 2, 17), 250, seed=2)
    z = 1e-2
    results = {}
    for z_loss in (0.0, z):
        trainer = Trainer(tiny_config(z_loss=z_loss, per_replica_batch=2), mesh(1, 1))
        params = trainer.init_state(0).params
        loss, grads = trainer.loss_and_grads(params, trainer.shard_batch({"tokens": tokens}))
        results[z_loss] = float(loss), flat(jax.device_get(grads))

    def z_term(p):
        return z * jnp.mean(jax.nn.logsumexp(trainer.logits(p, tokens[0, :, :-1]), axis=-1) ** 2)
    expected = flat(jax.device_get(jax.grad(z_term)(params)))
    assert results[z][0] == pytest.approx(results[0.0][0], rel=1e-6)  # the reported loss is the plain NLL
    scale = max(np.abs(g).max() for g in expected.values())
    assert scale > 1e-3
    for k, g in expected.items():  # a difference of two float32 gradients: error relative to their scale
        np.testing.assert_allclose(results[z][1][k] - results[0.0][1][k], g, rtol=0, atol=1e-4 * scale, err_msg=k)


def test_remat_policies_change_the_program_not_the_gradients():
    batch = {"tokens": random_tokens((1, 4, 17), 250)}
    programs, grads = {}, {}
    for remat in ("none", "dots", "full"):
        trainer = Trainer(tiny_config(remat=remat, per_replica_batch=4), mesh(1, 1))
        params, sharded = trainer.init_state(0).params, trainer.shard_batch(batch)
        compiled = trainer.loss_and_grads.lower(params, sharded).compile()
        programs[remat] = (len(re.findall(r" dot\(", compiled.as_text())), compiled.memory_analysis().temp_size_in_bytes)
        grads[remat] = jax.device_get(trainer.loss_and_grads(params, sharded)[1])
    (dots_none, temp_none), (dots_dots, temp_dots), (dots_full, temp_full) = (programs[k] for k in ("none", "dots", "full"))
    # 'dots' saves the weight matmuls and recomputes only attention's two batched einsums; 'full' recomputes
    # more; what is kept for the backward pass shrinks in the same order.
    assert dots_dots == dots_none + 2 and dots_full > dots_dots
    assert temp_none > temp_dots > temp_full
    # to float32 rounding: the programs fuse differently (6e-8 seen at LLVM level 1, under 1e-8 at level 2)
    assert max_abs_diff(grads["none"], grads["dots"]) < 2e-7
    assert max_abs_diff(grads["none"], grads["full"]) < 2e-7


def test_neftune_noise_is_hfs_on_the_embeddings_in_training_only():
    """NEFTune (`neftune_noise_alpha`, HF's key): the noise is uniform in ±alpha/sqrt(T·width), the
    bound and distribution of HF's own hook (run on the same shape); a training step's loss moves
    with it, the same on one device and split over mp=2 (every mp shard draws the same noise) and
    again at the same step; evaluation sees none. With a preference objective, or not positive: refused."""
    import scipy.stats
    import torch
    from transformers.integrations.neftune import neftune_post_forward_hook
    from mesh_transformer.config import ConfigError
    from mesh_transformer.models import layers

    alpha, shape = 5.0, (4, 64, 64)
    bound = alpha / np.sqrt(shape[1] * shape[2])
    embedding = torch.nn.Embedding(2, 2).train()
    embedding.neftune_noise_alpha = alpha
    theirs = neftune_post_forward_hook(embedding, None, torch.zeros(shape)).numpy().ravel()
    ours = np.asarray(layers.neftune(jnp.zeros(shape), alpha, jax.random.key(3))).ravel()
    for noise in (theirs, ours):
        assert 0.999 * bound < np.abs(noise).max() <= bound
        assert scipy.stats.kstest(noise, scipy.stats.uniform(-bound, 2 * bound).cdf).pvalue > 1e-3

    tokens = random_tokens((1, 2, 17), 250, seed=8)
    results = {}
    for name, alpha_, layout in (("plain", None, (1, 1)), ("noisy", 5.0, (1, 1)), ("noisy mp2", 5.0, (1, 2))):
        trainer = Trainer(tiny_config(per_replica_batch=2, neftune_noise_alpha=alpha_), mesh(*layout))
        params = trainer.init_state(0).params
        batch = trainer.shard_batch({"tokens": tokens})
        results[name] = (float(trainer.loss_and_grads(params, batch)[0]), float(trainer.loss_and_grads(params, batch)[0]),
                         trainer.eval_loss(params, {"tokens": tokens}))
    (plain, _, plain_eval), (noisy, again, noisy_eval), (split, _, split_eval) = results.values()
    assert noisy == again and abs(split - noisy) < 1e-5 and abs(noisy - plain) > 1e-4
    assert plain_eval == pytest.approx(noisy_eval, abs=1e-6) and split_eval == pytest.approx(plain_eval, abs=1e-5)
    for bad, match in (({"neftune_noise_alpha": 0}, "neftune_noise_alpha.*positive"),
                       ({"neftune_noise_alpha": 5, "dpo": {}}, "neftune_noise_alpha.*language-model loss only")):
        with pytest.raises(ConfigError, match=match):
            tiny_config(**bad)
