"""Every dp x mp layout (with and without ZeRO) computes what one device computes."""
import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from mesh_transformer.train.step import Trainer
from tests.helpers import TINY, layer_loop_bodies, max_abs_diff, mesh, random_tokens, tiny_config

LAYOUTS = [(8, 1), (1, 8), (2, 4), (4, 2)]
ACCUM, BATCH = 2, 8


@pytest.fixture(scope="module")
def reference():
    trainer = Trainer(tiny_config(per_replica_batch=BATCH, gradient_accumulation_steps=ACCUM), mesh(1, 1))
    state = trainer.init_state(0)
    batch = {"tokens": random_tokens((ACCUM, BATCH, 17), 250)}
    loss, grads = trainer.loss_and_grads(state.params, trainer.shard_batch(batch))
    return jax.device_get(state.params), batch, float(loss), jax.device_get(grads)


@pytest.mark.parametrize("zero", [False, True], ids=["megatron", "zero"])
@pytest.mark.parametrize("dp,mp", LAYOUTS, ids=[f"dp{d}xmp{m}" for d, m in LAYOUTS])
def test_loss_and_grads_match_single_device(reference, dp, mp, zero):
    params, batch, loss, grads = reference
    trainer = Trainer(tiny_config(per_replica_batch=BATCH // dp, gradient_accumulation_steps=ACCUM,
                                  cores_per_replica=mp, zero=zero), mesh(dp, mp))
    state = trainer.state_from_params(params)
    ours_loss, ours_grads = trainer.loss_and_grads(state.params, trainer.shard_batch(batch))
    assert abs(float(ours_loss) - loss) < 1e-5
    assert max_abs_diff(jax.device_get(ours_grads), grads) < 1e-6
    # Parameters really are split as the table says.
    q_proj = state.params["gptj/layers/attn"]["q_proj"]
    assert q_proj.sharding.spec == P(None, "dp" if zero else None, "mp", None)
    assert q_proj.addressable_shards[0].data.shape == (3, 64 // dp if zero else 64, 8 // mp, 8)


def test_train_step_matches_single_device(reference):
    params, batch, _, _ = reference
    states = []
    for dp, mp, zero in [(1, 1, False), (2, 4, True)]:
        trainer = Trainer(tiny_config(per_replica_batch=BATCH // dp, gradient_accumulation_steps=ACCUM,
                                      cores_per_replica=mp, zero=zero), mesh(dp, mp))
        state = trainer.state_from_params(params)
        for _ in range(3):
            state, metrics = trainer.step(state, trainer.shard_batch(batch))
        states.append((jax.device_get(state), {k: float(v) for k, v in metrics.items()}))
    (a, ma), (b, mb) = states
    # 3 Adam steps of lr 1e-3 move weights by up to 3e-3; float reassociation differs by far less.
    assert max_abs_diff(a.params, b.params) < 5e-5
    assert max_abs_diff(a.opt_state, b.opt_state) < 1e-6
    assert ma == pytest.approx(mb, rel=1e-5)


def _all_reduces(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.search(r"= \S+ all-reduce(-start)?\(", line)]


@pytest.mark.parametrize("dp,mp", [(1, 8), (2, 4)])
def test_one_all_reduce_of_the_residual_per_layer(dp, mp):
    """GPT-J's parallel residual: attention and MLP partial sums share one all-reduce per layer."""
    trainer = Trainer(tiny_config(cores_per_replica=mp, remat="none"), mesh(dp, mp))
    tokens = jax.ShapeDtypeStruct((2 * dp, 16), np.int32, sharding=NamedSharding(trainer.mesh, P("dp", None)))
    hlo = trainer.logits.lower(trainer.abstract_state.params, tokens).compile().as_text()
    [layer_body] = layer_loop_bodies(hlo, TINY["layers"])
    [residual_reduce] = _all_reduces(layer_body)
    assert "f32[2,16,64]" in residual_reduce  # [B_local, T, D]: the residual stream
    groups = re.search(r"replica_groups=\{(\{[\d,]+\})", residual_reduce).group(1)
    assert groups.count(",") + 1 == mp  # over the mp axis only
    assert len(_all_reduces(hlo)) == 2  # + the vocab-parallel embedding, once per forward


def test_a_one_device_forward_writes_no_all_reduce():
    """On a one-device mesh the model writes no collective (`parallel.manual._bound`): XLA:CPU keeps
    a one-device all-reduce as a copy of its operand (the LLaMA-shaped benchmark's step on one
    device: all-reduces 38 -> 25 ms a step, those left being shard_map's own in the backward)."""
    trainer = Trainer(tiny_config(cores_per_replica=1, remat="none"), mesh(1, 1))
    tokens = jax.ShapeDtypeStruct((2, 16), np.int32, sharding=NamedSharding(trainer.mesh, P("dp", None)))
    hlo = trainer.logits.lower(trainer.abstract_state.params, tokens).compile().as_text()
    assert layer_loop_bodies(hlo, TINY["layers"]) and _all_reduces(hlo) == []


def _compiled_bytes(trainer):
    compiled = trainer.step.lower(trainer.abstract_state, trainer.abstract_batch()).compile()
    return compiled.memory_analysis()


def _shard_bytes(abstract, shardings):
    return sum(int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize
               for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)))


def test_zero_splits_master_weights_and_optimizer_state_over_dp():
    sizes = {}
    for zero in (False, True):
        trainer = Trainer(tiny_config(zero=zero, layers=2, d_model=128, d_ff=512, n_vocab=256), mesh(8, 1))
        state_bytes = _shard_bytes(trainer.abstract_state, trainer.state_shardings)
        analysis = _compiled_bytes(trainer)
        batch_bytes = _shard_bytes(trainer.abstract_batch(), jax.tree.map(lambda a: a.sharding, trainer.abstract_batch()))
        assert analysis.argument_size_in_bytes == state_bytes + batch_bytes  # what the table says is what XLA holds
        sizes[zero] = state_bytes
    # Every matrix has an embed axis, so almost all of the state is split 8 ways.
    assert sizes[True] < sizes[False] / 7
