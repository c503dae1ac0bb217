"""Model options beyond HF's GPT-J: RMSNorm, learned absolute positions, no positions."""
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mesh_transformer import models
from mesh_transformer.models.layers import RMSNorm, take_rows
from mesh_transformer.train.step import Trainer
from tests.helpers import max_abs_diff, mesh, random_tokens, tiny_config


def _init_apply(**overrides):
    config = tiny_config(remat="none", **overrides).model
    model = models.build(config)
    params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    return config, params, jax.jit(lambda p, t: model.apply(p, t)[0])


def test_rmsnorm_has_no_offset_and_normalises_by_rms():
    config, params, _ = _init_apply(norm="rmsnorm")
    assert set(params["gptj/ln_f"]) == {"scale"}
    x = jax.random.normal(jax.random.key(1), (2, 3, 64)) * 3 + 1
    norm = hk.without_apply_rng(hk.transform(lambda x: RMSNorm(64, config.layer_norm_eps, name="n")(x)))
    f = jax.jit(lambda x: norm.apply({"n": {"scale": jnp.full((64,), 2.0)}}, x))
    expected = 2.0 * x / np.sqrt(np.mean(np.square(x), -1, keepdims=True) + config.layer_norm_eps)
    np.testing.assert_allclose(f(x), expected, rtol=1e-5)


@pytest.mark.parametrize("pe, order_matters", [("rotary", True), ("fixed", True), ("none", False)])
def test_position_encodings(pe, order_matters):
    """Without positions, one causal attention layer sees its prefix as a set: permuting it leaves the
    last position's logits alone; rotary or learned positions make the order matter."""
    config, params, apply = _init_apply(pe=pe, layers=1, **({"pe_rotary_dims": None} if pe != "rotary" else {}))
    assert ("gptj/embed" in params and "pos_embeddings" in params["gptj/embed"]) == (pe == "fixed")
    tokens = random_tokens((1, 12), 250, seed=3)
    permuted = tokens.copy()
    permuted[0, :11] = tokens[0, :11][::-1]
    last, last_permuted = apply(params, tokens)[0, -1, :250], apply(params, permuted)[0, -1, :250]
    assert (float(jnp.max(jnp.abs(last - last_permuted))) > 1e-3) == order_matters


@pytest.mark.parametrize("options", [{"norm": "rmsnorm"}, {"pe": "fixed", "pe_rotary_dims": None}])
def test_options_shard_like_the_default(options):
    tokens = {"tokens": random_tokens((1, 4, 17), 250, seed=4)}
    single = Trainer(tiny_config(per_replica_batch=4, **options), mesh(1, 1))
    state = single.init_state(0)
    loss, grads = single.loss_and_grads(state.params, single.shard_batch(tokens))
    sharded = Trainer(tiny_config(per_replica_batch=2, cores_per_replica=4, zero=True, **options), mesh(2, 4))
    loss2, grads2 = sharded.loss_and_grads(sharded.state_from_params(jax.device_get(state.params)).params,
                                           sharded.shard_batch(tokens))
    assert abs(float(loss) - float(loss2)) < 1e-5
    assert max_abs_diff(jax.device_get(grads), jax.device_get(grads2)) < 1e-6


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_take_rows_is_jnp_take_with_its_gradient(dtype):
    """Embedding rows of a 16-bit table are gathered as integers (so XLA:CPU makes no float32 copy
    of the table): the same rows, and the same gradient (repeated ids add up), as jnp.take."""
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.normal(size=(10, 4)), dtype)
    ids = jnp.array([[3, 3, 9], [0, 9, 1]])
    weights = jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32)
    assert (take_rows(table, ids) == jnp.take(table, ids, axis=0)).all()
    loss = lambda take: lambda t: (take(t, ids).astype(jnp.float32) * weights).sum()  # noqa: E731
    ours = jax.grad(loss(take_rows))(table)
    theirs = jax.grad(loss(lambda t, i: jnp.take(t, i, axis=0)))(table)
    assert ours.dtype == table.dtype and (ours == theirs).all() and float(jnp.abs(ours[3]).sum()) > 0

