"""Model options beyond HF's GPT-J (RMSNorm, learned absolute positions, no positions) and layers' own gradients."""
import re
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



@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-6), ("bfloat16", 2e-2)])
def test_attention_backward_is_autodiffs_with_one_reduction_over_the_outputs(dtype, tolerance):
    """`softmax_times_values`' own backward (flash attention's: P (dP - rowsum(dO * O))) gives
    autodiff's gradients of softmax-then-values, a causal mask's rows and a row that sees no key
    included; and its compiled gradient reduces over the probabilities only in the forward (the
    softmax's maximum and sum), not a third time as autodiff's backward does."""
    from mesh_transformer.models.layers import NEG, softmax_times_values
    b, kv, m, s, h = 2, 2, 6, 10, 4  # distinct sizes, so a reduction's operand names its axes
    keys = jax.random.split(jax.random.key(5), 3)
    scores = jax.random.normal(keys[0], (b, kv, m, s)) * 3
    visible = jnp.tril(jnp.ones((m, s), bool), k=s - m).at[0].set(False)  # row 0 sees no key
    scores = jnp.where(visible, scores, NEG)
    v = jax.random.normal(keys[1], (b, kv, s, h)).astype(dtype)
    weights = jax.random.normal(keys[2], (b, kv, m, h))

    def dense(x, v):
        p = jax.nn.softmax(x, axis=-1).astype(v.dtype)
        return jnp.sum(jnp.einsum("bkms,bksh->bkmh", p, v, preferred_element_type=jnp.float32) * weights)

    ours = jax.grad(lambda x, v: jnp.sum(softmax_times_values(x, v) * weights), argnums=(0, 1))
    got, want = ours(scores, v), jax.grad(dense, argnums=(0, 1))(scores, v)
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.max(np.abs(w)) > 0.1
        assert np.max(np.abs(g - w)) <= tolerance * np.max(np.abs(w))
    # a row that sees a key gives its masked scores no gradient (one that sees none averages all values)
    assert float(jnp.max(jnp.abs((got[0] * ~visible)[:, :, 1:]))) == 0.0

    def reductions_over_probabilities(f):
        text = jax.jit(f).lower(scores, v).as_text()
        return len(re.findall(rf"stablehlo\.reduce\(%\S+ init: %\S+\) .*: \(tensor<{b}x{kv}x{m}x{s}xf32>", text))
    assert reductions_over_probabilities(jax.grad(dense)) == 3
    assert reductions_over_probabilities(ours) == 2
