"""The few-row CPU kernel (`mesh_transformer.kernels`): exact against a float64 product of the
(widened) weight at every shape the kernel's loops split unevenly, in bf16 and float32, inside
shard_map, under autodiff, and in a one-row bf16 decode, where it replaces XLA's products (the same
tokens as XLA's own path)."""
from __future__ import annotations

import functools
import logging
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mesh_transformer import kernels, loading, parallel
from mesh_transformer.generate import Batch, Generator, SamplingOptions
from mesh_transformer.generate.prefix import PrefixCache
from mesh_transformer.models import layers
from tests.helpers import NEW, make_hf_model, mesh

pytestmark = pytest.mark.skipif(kernels.compiler() is None, reason="no C++ compiler: the model runs XLA's products")


BF16 = kernels.KERNELS[jnp.dtype(jnp.bfloat16)].target


def case(rows, k, o, dtype=jnp.bfloat16, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = jnp.asarray(rng.randint(-127, 128, (k, o)) if dtype == jnp.int8 else rng.standard_normal((k, o)), dtype)
    exact = x.astype(np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
    return x, w, exact


# K: a multiple of the 8 weight rows per pass, 5 past one, fewer rows than parts; O: under one
# 16-wide vector, not a multiple of 16, more than one tile of the partial product (16,384 floats).
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.int8], ids=["bf16", "f32", "i8"])
@pytest.mark.parametrize("rows,k,o,n_parts", [(1, 64, 48, 1), (1, 37, 70, 2), (2, 130, 1000, 3), (3, 5, 9, 4),
                                              (4, 64, 16400, 2), (8, 3, 33, 2), (7, 21, 40, 1)])
def test_rows_times_weight_is_the_float32_product(rows, k, o, n_parts, dtype):
    x, w, exact = case(rows, k, o, dtype)
    y = jax.jit(lambda x, w: kernels.rows_times_weight(x, w, n_parts, blocked=False))(x, w)
    assert_float32_product(y, x, w, exact)


# Register-blocked: rows in blocks of 6 (1 row; 9 = 6 + 3; 13 = 6 + 6 + 1; 70, past the streamed
# kernel's 64), weight rows in blocks of 256 (300 = 256 + 44), columns in panels of 4 16-wide
# vectors (5: none, one at a time; 100 = 64 + 2 vectors + 4; 144 = 2 panels + 1 vector).
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.int8], ids=["bf16", "f32", "i8"])
@pytest.mark.parametrize("rows,k,o", [(1, 40, 5), (9, 300, 100), (13, 600, 64), (32, 256, 144), (70, 37, 200)])
def test_blocked_rows_times_weight_is_the_float32_product(rows, k, o, dtype):
    x, w, exact = case(rows, k, o, dtype)
    assert_float32_product(jax.jit(lambda x, w: kernels.rows_times_weight(x, w, blocked=True))(x, w), x, w, exact)


# bf16 rows times a bf16 weight (pair dot products where the CPU has AVX-512-BF16, else float32
# tiles of the widened rows). Blocked: rows in blocks of 6 (1; 5; 13 = 6 + 6 + 1; 70), K odd
# inside one block of 256 weight rows and past one (the last pair's second row zero), columns in
# panels of 64: under one 32-column pair chunk (20: the float32 tiles alone), one chunk and a
# vector (48), a panel, a chunk and 4 (100), and 2 panels (128). Streamed: passes of 8 weight rows
# (37, 301: a last pass of fewer), columns after the last 32 (20, 48, 100), more than one tile of
# the partial product (16,400).
@pytest.mark.parametrize("rows,k,o,blocked", [
    *[(*shape, True) for shape in [(1, 64, 20), (5, 37, 48), (13, 301, 100), (6, 513, 128), (70, 256, 64)]],
    *[(*shape, False) for shape in [(1, 64, 20), (5, 37, 48), (13, 301, 100), (1, 40, 16400)]]])
def test_bf16_rows_times_a_bf16_weight_is_the_float32_product(rows, k, o, blocked):
    x, w, _ = case(rows, k, o)
    x = jnp.asarray(x, jnp.bfloat16)
    wide = np.asarray(x.astype(jnp.float32))
    exact = wide.astype(np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
    y = jax.jit(lambda x, w: kernels.bf16_rows_times_weight(x, w, n_parts=3, blocked=blocked))(x, w)
    assert_float32_product(y, wide, w, exact)


# Inputs-last weights [O, K], 1-64 rows (groups of 4 and the 1-3 left: 5, 16, 63): K under one
# vector step (5), odd with a masked last step (37, 301), whole steps (64); O under one block of 4
# runs (1, 3), runs of uneven length (70: 18 + 18 + 18 + 16), more than one chunk of 256 weight rows
# (300 = 256 + 44, 1000). On a CPU with AMX (`kernels.amx`), bf16 from 4 rows with K a multiple of
# 32 runs as tile products: one group of 16 rows and less (4, 16), groups past it with the last
# padded (37, 64); whole passes of 64 weight rows, blocks of 16 left, and the last under 16 by the
# pair kernel (300 = 4 x 64 + 2 x 16 + 12, 130, 16).
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("rows,k,o", [(1, 64, 1), (2, 5, 3), (3, 37, 70), (4, 301, 300), (1, 1024, 1000),
                                      (5, 37, 70), (16, 64, 300), (63, 301, 33), (4, 96, 64), (37, 1024, 130),
                                      (64, 32, 16)])
def test_rows_dot_weight_is_the_float32_product(rows, k, o, dtype):
    if not kernels.dot_kernel(dtype):
        pytest.skip(f"no inputs-last {jnp.dtype(dtype).name} kernel on this CPU (AVX-512 / AVX-512-BF16)")
    x, w, _ = case(rows, k, o, dtype)
    x, w = jnp.asarray(x, dtype), w.T
    wide = np.asarray(x.astype(jnp.float32))
    exact = wide.astype(np.float64) @ np.asarray(w.T.astype(jnp.float32), np.float64)
    y = jax.jit(kernels.rows_dot_weight)(x, w)
    assert_float32_product(y, wide, w.T, exact)


def disassembled(library: str, function: str) -> list[list[tuple[int, str, str]]]:
    """(address, mnemonic, operands) of each function of `library` whose demangled name contains
    `function`, from objdump."""
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", library], capture_output=True, text=True,
                          check=True).stdout
    functions = []
    for block in text.split("\n\n"):
        lines = block.strip().splitlines()
        if lines and function in lines[0]:
            parsed = (re.match(r"\s+([0-9a-f]+):\s+(\S+)\s*(.*)$", line) for line in lines[1:])
            functions.append([(int(m[1], 16), m[2], m[3]) for m in parsed if m])
    return functions


def hot_loops(code: list[tuple[int, str, str]]) -> list[tuple[int, int]]:
    """(multiply-adds, vector stores to the stack) of each innermost loop (a conditional jump back)
    of `code` with at least 16 multiply-adds."""
    loops = []
    for at, op, args in code:
        target = re.match(r"([0-9a-f]+) <", args)
        if op.startswith("j") and not op.startswith("jmp") and target and int(target[1], 16) < at:
            loops.append((int(target[1], 16), at))
    found = []
    for start, end in loops:
        if any(start <= s and e <= end and (s, e) != (start, end) for s, e in loops):
            continue  # not innermost
        body = [(op, args) for at, op, args in code if start <= at <= end]
        fmas = sum(op.startswith(("vfmadd", "vdpbf16ps")) for op, _ in body)
        spills = sum(op.startswith("vmov") and bool(re.match(r"%zmm\d+,.*\(%r[sb]p\)", args)) for op, args in body)
        if fmas >= 16:
            found.append((fmas, spills))
    return found


@pytest.mark.parametrize("dot", ["F32Dot", "PairsDot"])
def test_the_dot_kernels_inner_loops_keep_their_sums_in_registers(dot):
    """The inputs-last dot kernel's inner loops (4 weight rows times 4 rows of x: 16 multiply-adds a
    step, one loop fetching the next block's rows ahead and one not) keep their 16 sums in vector
    registers. With the whole steps and the masked last one in one loop body (and the rows fetched
    ahead a runtime count), GCC 12 stored all 16 to the stack at every step: half the speed
    (session 79). Read from the built library's disassembly."""
    if shutil.which("objdump") is None or not kernels.available():
        pytest.skip("no objdump, or no kernels built")
    functions = disassembled(str(kernels.build()), f"DotRows<(anonymous namespace)::{dot}>")
    if not functions:
        pytest.skip("this compiler inlined DotRows: no symbol to read")
    loops = [loop for code in functions for loop in hot_loops(code)]
    assert len(loops) >= 2 and all(spills == 0 for _, spills in loops), loops


def assert_float32_product(y, x, w, exact):
    assert y.dtype == jnp.float32 and y.shape == exact.shape
    scale = np.abs(x).astype(np.float64) @ np.abs(np.asarray(w.astype(jnp.float32), np.float64))
    err = np.abs(np.asarray(y, np.float64) - exact) / scale
    assert err.max() < 1e-6, err.max()  # float32 sums of k products: measured ~1e-7


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("groups,m,k,o", [((1, 16), 1, 64, 96), ((2, 3), 4, 37, 20), ((3, 1), 8, 96, 64)])
def test_grouped_rows_times_weight_is_each_groups_product(groups, m, k, o, dtype):
    """Attention's shapes: [B, kv heads] groups, query rows per kv head, head size or slots."""
    rng = np.random.RandomState(1)
    x = rng.standard_normal((*groups, m, k)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((*groups, k, o)), dtype)
    wide = np.asarray(w.astype(jnp.float32), np.float64)
    exact = np.einsum("...mk,...ko->...mo", x.astype(np.float64), wide)
    y = jax.jit(kernels.grouped_rows_times_weight)(x, w)
    scale = np.einsum("...mk,...ko->...mo", np.abs(x).astype(np.float64), np.abs(wide))
    assert y.shape == exact.shape and (np.abs(np.asarray(y, np.float64) - exact) / scale).max() < 1e-6


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.int8], ids=["bf16", "f32", "i8"])
@pytest.mark.parametrize("sizes,k,o", [((1, 0, 1, 0), 64, 96), ((3, 8, 0, 9, 1), 37, 150), ((40, 0, 25), 130, 70)],
                         ids=["decode", "streamed-and-blocked", "prefill"])
def test_expert_rows_times_weight_is_ragged_dot(sizes, k, o, dtype):
    """A mixture's grouped rows (zero-row experts skipped; groups of up to 8 rows streamed, more
    register-blocked) give the float64 product of each group with its expert's weight, what
    jax.lax.ragged_dot computes; layers.MoE runs it when not differentiated."""
    rng = np.random.RandomState(2)
    x = rng.standard_normal((sum(sizes), k)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((len(sizes), k, o)) * (40 if dtype == jnp.int8 else 1), dtype)
    wide = np.asarray(w.astype(jnp.float32), np.float64)
    expert = np.repeat(np.arange(len(sizes)), sizes)
    exact = np.einsum("mk,mko->mo", x.astype(np.float64), wide[expert])
    scale = np.einsum("mk,mko->mo", np.abs(x).astype(np.float64), np.abs(wide[expert]))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    y = jax.jit(kernels.expert_rows_times_weight)(x, w, group_sizes)
    assert y.shape == exact.shape and (np.abs(np.asarray(y, np.float64) - exact) / scale).max() < 1e-6
    ragged = np.asarray(jax.lax.ragged_dot(jnp.asarray(x), w.astype(jnp.float32), group_sizes), np.float64)
    # both are float32 sums in their own order: each within float32 rounding of the exact product,
    # so they agree to twice that, relative to |x| |w| (an absolute bound fails where int8-sized
    # weights cancel: 9.1027 against 9.1030 on an AVX2 CPU, rows of terms near 1,000)
    assert (np.abs(ragged - exact) / scale).max() < 1e-6
    assert (np.abs(np.asarray(y, np.float64) - ragged) / scale).max() < 2e-6
    hlo = jax.jit(layers.grouped_product).lower(x, w, group_sizes).as_text()
    assert kernels.EXPERTS[jnp.dtype(dtype)][0] in hlo  # the undifferentiated product takes it


@pytest.mark.parametrize("sizes", [(3, 0, 9, 1), (300, 0, 20)], ids=["few-rows", "deeper-than-a-block"])
def test_a_differentiated_grouped_product_gives_ragged_dots_gradients(sizes):
    """Training's path: the experts kernel blocked for every group (forward, and the rows' gradient
    on the transposed weights) and the weight-gradient kernel (zeros for an expert no row chose)
    give what XLA's ragged_dot and its transpose give."""
    rng = np.random.RandomState(3)
    rows = jnp.asarray(rng.standard_normal((sum(sizes), 40)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((len(sizes), 40, 70)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((sum(sizes), 70)), jnp.float32)
    group_sizes = jnp.asarray(sizes, jnp.int32)

    def loss(product, a, b):
        return jnp.sum(product(a, b, group_sizes) * g)
    ours = jax.jit(jax.value_and_grad(functools.partial(loss, layers.grouped_product), argnums=(0, 1)))(rows, w)
    xla = jax.value_and_grad(functools.partial(loss, jax.lax.ragged_dot), argnums=(0, 1))(rows, w)
    np.testing.assert_allclose(float(ours[0]), float(xla[0]), rtol=1e-5)
    for mine, theirs in zip(ours[1], xla[1]):
        np.testing.assert_allclose(np.asarray(mine), np.asarray(theirs), rtol=0, atol=1e-3)
    assert not np.any(np.asarray(ours[1][1])[1])  # expert 1 chose no row
    hlo = jax.jit(jax.grad(functools.partial(loss, layers.grouped_product), argnums=1)).lower(rows, w).as_text()
    assert kernels.EXPERT_WEIGHT_GRADIENT[0] in hlo


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_dense_uses_the_kernel_where_it_is_faster_than_xla(dtype):
    """bf16 1-8 rows streamed, or where the CPU has AVX-512-BF16 1-64 rows as pair products
    (without it, from 9 rows YNNPACK's bf16 products are faster); float32 2-8 rows
    streamed (one row is XLA's matrix-vector product, as fast), 9-31 XLA's, 32-64 blocked (a
    serving batch's decode step), more XLA's (prefill, YNNPACK); float16 never."""
    if dtype == jnp.float32:
        streamed, blocked, pairs = [2, 4, 5, 8], [32, 64], []
    elif kernels.bf16_pairs():
        streamed, blocked, pairs = [], [], [1, 2, 4, 5, 8, 9, 16, 31, 32, 64]
    else:
        streamed, blocked, pairs = [1, 2, 4, 5, 8], [], []
    x, w, _ = case(80, 32, 24, dtype)
    target = kernels.KERNELS[jnp.dtype(dtype)].target
    hlo = lambda rows, w: jax.jit(lambda x, w: layers.dense("btk,ko->bto", x, w)).lower(  # noqa: E731
        jnp.asarray(x[:rows, None], dtype), w).as_text()
    texts = {rows: hlo(rows, w) for rows in [1, 2, 4, 5, 8, 9, 16, 31, 32, 64, 65, 80]}
    runs = {rows: re.search(rf'{target}.*blocked = (true|false)', text) for rows, text in texts.items()}
    assert [rows for rows, found in runs.items() if found and found[1] == "false"] == streamed
    assert [rows for rows, found in runs.items() if found and found[1] == "true"] == blocked
    assert [rows for rows, text in texts.items() if kernels.BF16_ROWS.target in text] == pairs
    assert not any(k.target in hlo(1, w.astype(jnp.float16)) for k in (*kernels.KERNELS.values(), kernels.BF16_ROWS))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_inputs_last_weights_and_a_tied_head_use_the_dot_kernel_for_1_to_64_rows(dtype):
    """Weights stored inputs-last (`parallel.InputsLast`, Generator(matvec=True)) and a tied
    embedding table ("btd,vd->btv") multiply 1-64 rows through `rows_dot_weight` where it runs here;
    more rows (a prefill), or a float16 table, stay XLA's."""
    x, w, exact = case(66, 40, 24, dtype)
    x, table = jnp.asarray(x, dtype), w.T
    target = kernels.DOT[jnp.dtype(dtype)].target
    dense = lambda x, w: layers.dense("btk,ko->bto", x, parallel.InputsLast(w, 1), jnp.float32)  # noqa: E731
    head = lambda x, w: layers.product("btd,vd->btv", x, w)  # noqa: E731
    want = [1, 2, 4, 5, 16, 64] if kernels.dot_kernel(dtype) else []
    for f in (dense, head):
        lowered = {rows: jax.jit(f).lower(x[:rows, None], table).as_text() for rows in (1, 2, 4, 5, 16, 64, 65)}
        assert [rows for rows, text in lowered.items() if target in text] == want
        y = np.asarray(jax.jit(f)(x[:4, None], table), np.float64)[:, 0]
        scale = np.abs(np.asarray(x[:4].astype(jnp.float32), np.float64)) @ np.abs(np.asarray(w.astype(jnp.float32), np.float64))
        exact = np.asarray(x[:4].astype(jnp.float32), np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
        assert (np.abs(y - exact) / scale).max() < 1e-6
    assert target not in jax.jit(head).lower(x[:1, None].astype(jnp.float16), table.astype(jnp.float16)).as_text()


@pytest.mark.parametrize("rows,dtype", [(2, jnp.bfloat16), (32, jnp.float32)])
def test_a_differentiated_product_is_xlas_and_gives_the_einsums_gradients(rows, dtype):
    """Training runs XLA's products forward as backward (the same summation on every mesh and batch
    split); the same product not differentiated runs the kernel."""
    x, w, _ = case(rows, 40, 24, dtype)
    x = jnp.asarray(x, dtype)
    loss = lambda x, w: jnp.sum(jnp.sin(layers.product("...k,ko->...o", x, w)))  # noqa: E731
    einsum = lambda x, w: jnp.sum(jnp.sin(jnp.einsum("bk,ko->bo", x, w, preferred_element_type=jnp.float32)))  # noqa: E731
    target = (kernels.BF16_ROWS if kernels.pairs_apply(x, w) else kernels.KERNELS[jnp.dtype(dtype)]).target
    assert target in jax.jit(loss).lower(x, w).as_text()
    assert target not in jax.jit(jax.grad(loss, (0, 1))).lower(x, w).as_text()
    got, want = jax.grad(loss, (0, 1))(x, w), jax.grad(einsum, (0, 1))(x, w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-2, atol=1e-2)


def test_a_mixture_decodes_and_trains_on_the_experts_kernels_not_xlas_ragged_dot():
    """A Mixtral-shaped model: its training step on dp1 x mp2 and a decode step (one token over a
    KV cache) compile to the experts kernels (forward; in training the weights' gradient too), and
    neither multiplies every row by every expert (XLA:CPU's ragged_dot: a per-expert mask of the
    rows, pred[E, M, ...])."""
    from mesh_transformer import models
    from mesh_transformer.config import config_from_dict
    from mesh_transformer.models.core import KVCache, unstack_layers
    from mesh_transformer.train.step import Trainer
    config = config_from_dict(dict(family="mixtral", layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=16,
                                   n_experts=4, experts_per_token=2, n_vocab=64, seq=16, compute_dtype="float32",
                                   per_replica_batch=2, cores_per_replica=2, router_aux_loss_coef=0.01))
    trainer = Trainer(config, mesh(1, 2))
    state = trainer.init_state(0)
    step = trainer.step.lower(state, trainer.abstract_batch()).compile().as_text()
    model = models.build(config.model)
    params = model.init(jax.random.key(0))
    decode_params = unstack_layers(params, config.model.layers)  # (decoding runs layers unrolled)
    cache = KVCache.zeros(config.model, 2, 8)
    decode = jax.jit(model.apply).lower(decode_params, jnp.zeros((2, 1), jnp.int32), cache).compile().as_text()
    experts = kernels.EXPERTS[jnp.dtype(jnp.float32)][0]
    for text in (step, decode):
        assert experts in text
        assert not re.search(r"pred\[4,\d+,(32|16)\]", text)  # ragged_dot's per-expert masks
    assert kernels.EXPERT_WEIGHT_GRADIENT[0] in step
    ragged = jax.jit(lambda r, w, g: jax.lax.ragged_dot(r, w, g)).lower(
        jnp.zeros((4, 32)), jnp.zeros((4, 32, 16)), jnp.ones(4, jnp.int32)).compile().as_text()
    assert re.search(r"pred\[4,\d+,(32|16)\]", ragged)  # (what the pattern finds in XLA's own)


def test_the_kernel_runs_on_each_shard_of_a_column_parallel_weight():
    x, w, exact = case(1, 64, 96)
    m = mesh(2, 4)

    def local(x, w):
        with parallel.manual_axes(m, {}):
            return layers.product("...k,ko->...o", x, w)

    f = jax.jit(jax.shard_map(local, mesh=m, in_specs=(P(), P(None, parallel.MP)), out_specs=P(None, parallel.MP)))
    assert BF16 in f.lower(x, w).as_text()
    np.testing.assert_allclose(np.asarray(f(x, w)), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,rows,case,matvec", [("bfloat16", 1, "gptj", False), ("bfloat16", 16, "gptj", False),
                                                    ("float32", 32, "llama_gqa2_llama3_rope", False),
                                                    ("bfloat16", 1, "gptj", True), ("float32", 3, "gpt2", True),
                                                    ("float32", 2, "gpt_oss_window_yarn", False)])
def test_decode_runs_the_kernels_with_xla_paths_tokens(tiny, tmp_path, monkeypatch, dtype, rows, case, matvec):
    """A one-row bf16 GPT-J decode (no spare row; streamed products, fused attention over the
    bf16 cache, one call a layer), a 16-row one (bf16 pair products where the CPU has them), a
    32-row float32 LLaMA one (register-blocked products; two query heads per kv head), and
    with weights stored inputs-last (`matvec`) a one-row bf16 GPT-J and a 3-row float32 GPT-2 one
    (its tied head too: dot products where the CPU has them), and a 2-row GPT-OSS one (its sinks in
    the fused attention's softmax) call the kernels and decode the same greedy tokens, with log p
    within float32 rounding, as XLA's own products of the same weights."""
    if case != "gptj":  # the tiny GPT-J's tokenizer beside a tiny model of this case
        tiny.tokenizer.save_pretrained(tmp_path)
        make_hf_model(tmp_path, case, vocab_size=len(tiny.tokenizer), bos_token_id=tiny.eos, eos_token_id=tiny.eos)
    model = loading.load(hf=str(tiny.path if case == "gptj" else tmp_path), mp=1, dp=1, dtype=dtype)
    options = SamplingOptions(max_new_tokens=NEW, temperature=0.0, logprobs=1)
    prompts = [[5 + r % 7, 6, 7 + r, 8, 9] for r in range(rows)]
    g = Generator(model.config, model.params, model.mesh, matvec=matvec)
    assert g.min_rows == 1
    assert g.inputs_last == (matvec and (dtype == "float32" or kernels.dot_kernel(dtype)))
    ours = g.generate(prompts, options)
    state = g.new_state(rows, 32)
    hlo = g._decode.lower(g.params, state, np.int32(0), np.int32(4), 4, 32).as_text()
    product, attention = kernels.KERNELS[jnp.dtype(dtype)], kernels.ATTENTION[jnp.dtype(dtype)][0]
    if g.inputs_last:
        assert (kernels.DOT[jnp.dtype(dtype)].target in hlo) == kernels.dot_kernel(dtype)
    elif kernels.pairs_apply(jnp.zeros((rows, 8), dtype), jnp.zeros((8, 8), dtype)):
        assert kernels.BF16_ROWS.target in hlo and product.target not in hlo
    elif product.runs(rows):
        assert re.search(rf'{product.target}.*blocked = {"true" if rows > product.streamed[1] else "false"}', hlo)
    # attention over the cache: one fused call a layer (the kernel's decode path), no products of XLA's
    assert hlo.count(f"@{attention}(") == model.config.layers
    assert kernels.GROUPED[jnp.dtype(dtype)].target not in hlo
    monkeypatch.setattr(kernels, "applies", lambda x, w: False)  # every product back to XLA's
    monkeypatch.setattr(kernels, "grouped_applies", lambda x, w: False)
    monkeypatch.setattr(kernels, "dot_applies", lambda x, w: False)  # (attention stays fused: see below)
    xla = Generator(model.config, model.params, model.mesh).generate(prompts, options)
    assert [s.tokens for s in ours] == [s.tokens for s in xla]
    np.testing.assert_allclose([s.logprobs for s in ours], [s.logprobs for s in xla], atol=1e-3)


def test_without_a_compiler_the_model_falls_back_to_xla_with_a_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(kernels, "compiler", lambda: None)
    with pytest.raises(RuntimeError, match=r"no C\+\+ compiler"):
        kernels.build(out_dir=tmp_path)
    monkeypatch.setattr(kernels, "_state", {})
    with caplog.at_level(logging.WARNING, logger="mesh_transformer.kernels"):
        assert not kernels.available()
    assert "no C++ compiler" in caplog.text and "using XLA's products" in caplog.text


def test_a_source_that_does_not_compile_is_named_in_the_error(tmp_path):
    bad = tmp_path / "broken_kernel.cc"
    bad.write_text("this is not C++\n")
    with pytest.raises(RuntimeError, match="could not compile broken_kernel.cc"):
        kernels.build(sources=[bad], out_dir=tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.so"))  # nothing half-written left in the cache


def test_a_built_library_is_reused_and_a_new_source_rebuilt(tmp_path):
    """The build cache's key, on a one-function source (the kernels' own take a minute to compile
    twice; the session builds them once): same sources -> the same file, untouched; a changed
    source -> another library, which loads and runs."""
    import ctypes
    source = tmp_path / "answer.cc"
    source.write_text('extern "C" int Answer() { return 41; }\n')
    first = kernels.build(sources=[source], out_dir=tmp_path / "out")
    stamp = first.stat().st_mtime_ns
    assert kernels.build(sources=[source], out_dir=tmp_path / "out") == first and first.stat().st_mtime_ns == stamp
    source.write_text('extern "C" int Answer() { return 42; }\n')
    second = kernels.build(sources=[source], out_dir=tmp_path / "out")
    assert second != first and first.exists()
    assert (ctypes.cdll.LoadLibrary(str(first)).Answer(), ctypes.cdll.LoadLibrary(str(second)).Answer()) == (41, 42)


def attention_case(b, kv, g, t, hd, s, u, unwritten=0, seed=0):
    """Random q [B, K, G*T, H], a prompt's own keys/values [B, K, H, S] / [B, K, S, H] under a causal,
    left-padded mask [B, T, S] (row 0's first two positions see no key; the last `unwritten` slots,
    a cache's tail, none), and u shared slots (some not read, none by the last row), as
    `kernels.attention` takes them."""
    rng = np.random.RandomState(seed)
    q = rng.standard_normal((b, kv, g * t, hd)).astype(np.float32) * 2
    k, v = rng.standard_normal((b, kv, hd, s)).astype(np.float32), rng.standard_normal((b, kv, s, hd)).astype(np.float32)
    slot, position = np.arange(s), np.arange(t) + s - unwritten - t
    mask = (slot[None, None] <= position[None, :, None]) & (slot[None, None] >= rng.randint(0, 4, b)[:, None, None])
    mask[0, :2] = False
    shared = None
    if u:
        used = np.where(rng.rand(b, u) < 0.8, np.arange(u), -1).astype(np.int32)
        used[-1] = -1
        shared = (rng.standard_normal((kv, hd, u)).astype(np.float32), rng.standard_normal((kv, u, hd)).astype(np.float32),
                  used)
    return q, k, v, mask, shared


def random_sinks(kv: int, g: int, seed: int = 1):
    """[K, G] sink scores about as large as the cases' scores."""
    return np.random.RandomState(seed).standard_normal((kv, g)).astype(np.float32) * 2


def softmax_attention(q, k, v, mask, shared=None, weights_dtype=None, sinks=None):
    """The float64 oracle: one softmax over the shared slots' and the row's own scores, a masked score
    float32's lowest (so a query that sees no key weighs every key the same, as XLA's softmax), its
    probabilities rounded to `weights_dtype` where given; with `sinks` [K, G], one more score per
    query head in the softmax, whose value is zero."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, kv, m, hd = q.shape
    neg = float(np.finfo(np.float32).min)
    scores = np.where(mask[:, None, np.arange(m) % mask.shape[1]], np.einsum("bkmh,bkhs->bkms", q, k) / np.sqrt(hd), neg)
    values = v
    if shared is not None:
        shared_k, shared_v, used = (np.asarray(x, np.float64) for x in shared)
        theirs = np.einsum("bkmh,khu->bkmu", q, shared_k) / np.sqrt(hd)
        scores = np.concatenate([np.where((used >= 0)[:, None, None], theirs, neg), scores], -1)
        values = np.concatenate([np.broadcast_to(shared_v, (b,) + shared_v.shape), v], 2)
    if sinks is not None:
        sink = np.asarray(sinks, np.float64)[:, np.arange(m) // mask.shape[1]]  # [K, M]: each row's head's
        scores = np.concatenate([scores, np.broadcast_to(sink[None, :, :, None], (b, kv, m, 1))], -1)
        values = np.concatenate([values, np.zeros((b, kv, 1, hd))], 2)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights = weights / weights.sum(-1, keepdims=True)
    if weights_dtype is not None:
        weights = np.asarray(jnp.asarray(weights, jnp.float32).astype(weights_dtype).astype(jnp.float32), np.float64)
    return np.einsum("bkms,bksh->bkmh", weights, values)


# (B, K, G, T, H, S, U[, unwritten]): grouped queries with no shared slots, one query head per kv
# head behind more shared slots than a key tile (256), a head size no vector width divides, more
# query rows than a task's (48) and shared slots that are not a multiple of the tile; then the
# decode path's few query rows (at most 16 a task): one position of one query head per kv head
# (GPT-J's decode), of 4 behind shared slots with a cache tail not yet written, 2 heads at 3
# positions, and 16 heads over more slots than a tile with most of them unwritten; last a GPT-J
# batch-16 step whose keys and values the kernel fetches ahead (its cache, 8.4 MB in bf16 and 16.8
# in float32, at least attention.cc's kPrefetchFrom).
ATTENTION_CASES = [(2, 2, 4, 37, 64, 50, 0), (3, 2, 1, 130, 64, 130, 300), (1, 1, 3, 5, 24, 7, 3),
                   (2, 3, 2, 70, 80, 100, 65), (2, 3, 1, 1, 64, 70, 0), (3, 2, 4, 1, 24, 40, 30, 13),
                   (2, 2, 2, 3, 64, 20, 0), (1, 1, 16, 1, 32, 300, 0, 250), (16, 16, 1, 1, 64, 128, 0, 40)]


@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("shape", ATTENTION_CASES)
def test_attention_is_one_softmax_over_the_shared_and_own_keys(dtype, shape, sinks):
    """`kernels.attention` (the fused CPU attention of a prefill or a decode step) against float64
    softmax attention on the same (rounded) inputs, with queries that see no key at all, and with
    GPT-OSS's sinks (then such a query attends to nothing: 0). The decode path rounds its
    probabilities to the cache's type before the values' product, as XLA's path."""
    q, k, v, mask, shared = attention_case(*shape)
    sinks = random_sinks(shape[1], shape[2]) if sinks else None
    few = q.shape[2] <= kernels.ATTENTION_FEW_ROWS
    rounded = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    args = [rounded(q), rounded(k), rounded(v), mask] + ([rounded(shared[0]), rounded(shared[1]), shared[2]] if shared
                                                         else [None, None, None])
    out = np.asarray(jax.jit(kernels.attention)(*args, sinks))
    wide = lambda x: np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))  # noqa: E731
    rounded_weights = few and dtype != jnp.float32
    attend = lambda v, shared_v: softmax_attention(  # noqa: E731
        wide(q), wide(k), v, mask, shared and (wide(shared[0]), shared_v, shared[2]),
        weights_dtype=dtype if rounded_weights else None, sinks=sinks)
    want = attend(wide(v), shared and wide(shared[1]))
    # A probability whose float32 and float64 values straddle a bf16 rounding boundary rounds to
    # neighbours one unit (2^-8 of it) apart: at most 2^-8 of sum(p |v|) between the two.
    bound = 2.0 ** -8 * attend(np.abs(wide(v)), shared and np.abs(wide(shared[1]))) if rounded_weights else 0.0
    assert out.shape == q.shape and out.dtype == np.float32
    assert (np.abs(out - want) <= bound + 1e-5).all()


ISA_CHECK = """
import numpy as np, jax, jax.numpy as jnp
from mesh_transformer import kernels
rng = np.random.RandomState(0)
for rows, k, o, dtype, blocked in [(1, 37, 70, jnp.bfloat16, False), (5, 64, 130, jnp.float32, False),
                                   (8, 19, 40, jnp.bfloat16, False), (13, 300, 90, jnp.float32, True),
                                   (7, 20, 37, jnp.bfloat16, True), (3, 40, 70, jnp.int8, False),
                                   (11, 70, 90, jnp.int8, True)]:
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = jnp.asarray(rng.randint(-127, 128, (k, o)) if dtype == jnp.int8 else rng.standard_normal((k, o)), dtype)
    wide = np.asarray(w.astype(jnp.float32), np.float64)
    y = np.asarray(jax.jit(lambda x, w: kernels.rows_times_weight(x, w, 2, blocked))(x, w), np.float64)
    assert (np.abs(y - x @ wide) / (np.abs(x) @ np.abs(wide))).max() < 1e-6, (rows, k, o)
assert not kernels.bf16_pairs()  # a forced instruction set has no pair products: float32 tiles
assert not kernels.dot_kernel(jnp.float32) and not kernels.dot_kernel(jnp.bfloat16)  # nor inputs-last dot products
for rows, k, o, blocked in [(13, 301, 100, True), (5, 37, 48, None), (2, 37, 48, False)]:
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, o)), jnp.bfloat16)
    wx, wide = (np.asarray(a.astype(jnp.float32), np.float64) for a in (x, w))
    y = np.asarray(kernels.bf16_rows_times_weight(x, w, blocked=blocked), np.float64)
    assert (np.abs(y - wx @ wide) / (np.abs(wx) @ np.abs(wide))).max() < 1e-6, (rows, k, o)
for dtype in (jnp.bfloat16, jnp.float32):
    x = rng.standard_normal((2, 3, 4, 21)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((2, 3, 21, 50)), dtype)
    wide = np.asarray(w.astype(jnp.float32), np.float64)
    y = np.asarray(kernels.grouped_rows_times_weight(x, w), np.float64)
    assert (np.abs(y - x @ wide) / (np.abs(x) @ np.abs(wide))).max() < 1e-6
from tests.test_kernels import ATTENTION_CASES, attention_case, random_sinks, softmax_attention
for shape in ATTENTION_CASES:
    q, k, v, mask, shared = attention_case(*shape)
    for sinks in (None, random_sinks(shape[1], shape[2])):
        out = kernels.attention(q, k, v, mask, *(shared or (None, None, None)), sinks)
        assert np.abs(np.asarray(out) - softmax_attention(q, k, v, mask, shared, sinks=sinks)).max() < 1e-5, shape
print("ok")
"""


PAIRS_CHECK = """
import jax, jax.numpy as jnp
from mesh_transformer import kernels
from tests.test_kernels import test_rows_dot_weight_is_the_float32_product
assert not kernels.amx() and kernels.dot_kernel(jnp.bfloat16)
for rows, k, o in [(16, 64, 300), (37, 1024, 130)]:
    test_rows_dot_weight_is_the_float32_product(rows, k, o, jnp.bfloat16)
print("ok")
"""


def test_an_amx_cpu_runs_its_bf16_products_on_amx_and_the_pair_products_without():
    """Where /proc/cpuinfo lists amx_bf16, the inputs-last bf16 products run as AMX tile products
    (the exact bf16 products summed in float32: `test_rows_dot_weight_is_the_float32_product`), and
    with $MESH_TRANSFORMER_KERNEL_ISA=avx512bf16 as AVX-512-BF16 pair products, giving the same."""
    if not kernels.dot_kernel(jnp.bfloat16):
        pytest.skip("no AVX-512-BF16 on this CPU: neither path runs")
    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
    assert kernels.amx() == ("amx_bf16" in flags and "amx_tile" in flags)
    env = {**os.environ, "MESH_TRANSFORMER_KERNEL_ISA": "avx512bf16"}
    done = subprocess.run([sys.executable, "-c", PAIRS_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
def test_the_narrower_instruction_set_paths_give_the_same_products(isa):
    """AVX-512 without bf16 pair products, the AVX2 path (the AVX2 EPYC's) and the portable one,
    forced on this CPU in a fresh process (the kernel picks its path once per process)."""
    env = {**os.environ, "MESH_TRANSFORMER_KERNEL_ISA": isa}
    done = subprocess.run([sys.executable, "-c", ISA_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


BLOCKS = [  # (size, starts) of a block of a [2, 3, 7, 6] array
    ((2, 3, 7, 2), (0, 0, 0, 4)),  # new slots of every row (a decode step's keys)
    ((2, 3, 7, 1), (0, 0, 0, 5)),  # one token's keys, slots last: runs of one element
    ((2, 3, 2, 6), (0, 0, 9, 0)),  # past the end: clamped (values)
    ((2, 3, 2, 6), (0, 0, -3, 0)),  # negative: from the end
    ((1, 3, 5, 6), (1, 0, 2, 0)),  # one row (an admitted prompt)
    ((1, 2, 7, 3), (1, 1, 0, 2)),  # a block inside every axis
    ((2, 3, 7, 6), (0, 0, 0, 0)),  # the whole array
    ((2, 0, 7, 6), (0, 0, 0, 0)),  # nothing
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("size,starts", BLOCKS)
def test_update_slice_is_dynamic_update_slice(dtype, size, starts):
    """The same array as XLA's dynamic-update-slice (a start past the end or before 0 as lax takes
    it), also when the old array is still read afterwards (XLA then gives the call a copy to write)."""
    rng = np.random.RandomState(2)
    x = jnp.asarray(rng.standard_normal((2, 3, 7, 6)), dtype)
    update = jnp.asarray(rng.standard_normal(size), dtype)
    ours, old = jax.jit(lambda x, u, s: (kernels.update_slice(x, u, list(s)), x * 1))(x, update, np.int32(starts))
    want = jax.lax.dynamic_update_slice(x, update, starts)
    assert ours.dtype == x.dtype and np.array_equal(np.asarray(ours, np.float32), np.asarray(want, np.float32))
    assert np.array_equal(np.asarray(old, np.float32), np.asarray(x, np.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("size,starts", BLOCKS)
def test_slice_is_dynamic_slice(dtype, size, starts):
    x = jnp.asarray(np.random.RandomState(3).standard_normal((2, 3, 7, 6)), dtype)
    ours = jax.jit(lambda x, s: kernels.slice(x, list(s), size))(x, np.int32(starts))
    want = jax.lax.dynamic_slice(x, starts, size)
    assert ours.dtype == x.dtype and ours.shape == size
    assert np.array_equal(np.asarray(ours, np.float32), np.asarray(want, np.float32))


def test_large_block_copies_split_over_threads_give_lax_arrays():
    """Copies of a MiB or more are split over the pool's threads by runs (here 3 x 7 x 33 runs of
    700 floats: an uneven split), a slice and an update alike; and runs of one float."""
    rng = np.random.RandomState(5)
    x = jnp.asarray(rng.standard_normal((4, 7, 40, 1000)), jnp.float32)
    starts, sizes = (1, 0, 5, 250), (3, 7, 33, 700)
    update = jnp.asarray(rng.standard_normal(sizes), jnp.float32)
    ours = jax.jit(lambda x: kernels.slice(x, starts, sizes))(x)
    assert np.array_equal(np.asarray(ours), np.asarray(jax.lax.dynamic_slice(x, starts, sizes)))
    ours = jax.jit(lambda x, u: kernels.update_slice(x, u, starts))(x, update)
    assert np.array_equal(np.asarray(ours), np.asarray(jax.lax.dynamic_update_slice(x, update, starts)))
    # one token into keys stored slots last: 2 MiB of 4-byte runs, split over the threads mid-axis
    keys = jnp.asarray(rng.standard_normal((128, 16, 256, 3)), jnp.float32)
    token = jnp.asarray(rng.standard_normal((128, 16, 256, 1)), jnp.float32)
    ours = jax.jit(lambda x, u: kernels.update_slice(x, u, (0, 0, 0, 2)))(keys, token)
    assert np.array_equal(np.asarray(ours), np.asarray(jax.lax.dynamic_update_slice(keys, token, (0, 0, 0, 2))))


PUT_SLOTS = [  # slots [4, 6] of an M = 40 axis: a run; dropped (M, past it, negative) and out of order;
    np.int32([[8, 9, 10, 11, 12, 13], [39, 40, 2, 1, 0, -1],  # two runs; two positions at slot 10 and 11
              [20, 21, 30, 31, 32, 45], [10, 11, 100, 40, 3, 4]]),
]


def _put_slots_reference(x, update, slots, axis):
    """Position by position, row by row: a slot two positions take ends with the later one's."""
    out = np.array(x, np.float32)
    for i, row in enumerate(slots):
        for p, slot in enumerate(row):
            if 0 <= slot < x.shape[axis]:
                out[(slice(None),) * axis + (slot,)] = np.take(np.asarray(update[i], np.float32), p, axis=axis - 1)
    return out


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("shape,axis,update", [((1, 3, 5, 40), 3, (4, 3, 5, 6)), ((1, 3, 40, 5), 2, (4, 3, 6, 5)),
                                               ((1, 16, 64, 4096), 3, (8, 16, 64, 200))],
                         ids=["keys", "values", "split_over_threads"])
def test_put_slots_writes_each_position_at_its_slot(dtype, shape, axis, update):
    """A prefix pool's keys (slots last) and values (slots before the head axis) take an
    admission's positions at their slots, in place; the old array stays readable when still used.
    The last case writes 6.5 MB (float32), split over the pool's threads by the axes before the slots."""
    rng = np.random.RandomState(6)
    x = jnp.asarray(rng.standard_normal(shape), dtype)
    u = jnp.asarray(rng.standard_normal(update), dtype)
    slots = PUT_SLOTS[0] if update[0] == 4 else np.int32([np.arange(200) + 210 * i for i in range(8)])
    ours, old = jax.jit(lambda x, u, s: (kernels.put_slots(x, u, s, axis), x * 1))(x, u, slots)
    assert ours.dtype == x.dtype
    assert np.array_equal(np.asarray(ours, np.float32), _put_slots_reference(x, u, slots, axis))
    assert np.array_equal(np.asarray(old, np.float32), np.asarray(x, np.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=["bf16", "f16", "f32"])
def test_take_rows_is_take(dtype):
    """Rows of a table (ids of any shape, the first and last rows included; past either end: the
    nearest row), and `layers.take_rows`' gradient (XLA's gather, differentiated) unchanged."""
    table = jnp.asarray(np.random.RandomState(4).standard_normal((11, 2, 5)), dtype)
    ids = np.int32([[0, 10, 3], [3, -2, 14]])
    ours = jax.jit(kernels.take_rows)(table, ids)
    want = jnp.take(table, ids, axis=0, mode="clip")
    assert ours.dtype == table.dtype and ours.shape == (2, 3, 2, 5)
    assert np.array_equal(np.asarray(ours, np.float32), np.asarray(want, np.float32))
    inside = np.int32([[0, 10, 3], [3, 3, 7]])
    assert np.array_equal(np.asarray(jax.jit(layers.take_rows)(table, inside), np.float32),
                          np.asarray(table[inside], np.float32))
    grad = jax.grad(lambda t: jnp.sum(layers.take_rows(t, inside).astype(jnp.float32) ** 2))(table)
    want_grad = jax.grad(lambda t: jnp.sum(jnp.take(t, inside, axis=0).astype(jnp.float32) ** 2))(table)
    assert np.array_equal(np.asarray(grad, np.float32), np.asarray(want_grad, np.float32))


def _buffer_making_lines(hlo: str):
    """The instructions of a compiled program's own computations (entry, loop bodies, branches),
    not those inside fusions: each of them makes a buffer (a fusion's inner ops make none)."""
    own = False
    for line in hlo.splitlines():
        if line and not line[0].isspace():  # a computation's header, its closing brace, the module
            own = not re.match(r"%(fused_computation|wrapped_\S*computation)", line)
        elif own:
            yield line


@pytest.mark.parametrize("dtype,batch,rows,window", [
    ("float32", 1, 1, 200), ("bfloat16", 1, 1, 200), ("bfloat16", 4, 4, 200),
    ("float32", 8, 2, 64), ("bfloat16", 8, 2, 64),  # a serving batch's call: its first rows, a window of slots
])
def test_the_decode_loop_writes_each_cache_in_place_and_reads_it_where_it_is(tiny, dtype, batch, rows, window):
    """Every array the size of a layer's KV cache in the compiled decode call is that cache: the new
    slots are written by `kernels.update_slice` (the result aliases the cache) and the attention reads
    it through bitcasts. With XLA's dynamic-update-slice, one row in float32 copied each cache four
    times a step, and bf16 made three cache-sized fusions (a 1,000-token context decoded at half
    the short-context speed); a call over a window of a bf16 batch's slots copied every layer's keys
    putting the window back (a 16-row call in a 64-row batch: 605-635 tok/s instead of 1,545-1,659).
    Nor is the embedding table copied: a bf16 table's rows are taken by `kernels.take_rows` (XLA
    gathered them from a copy of the table made once per call)."""
    model = loading.load(hf=str(tiny.path), mp=1, dp=1, dtype=dtype)
    g = Generator(model.config, model.params, model.mesh)
    slots = 200
    state = g.new_state(batch, slots)
    size, table = state.cache.k[0].size, g.params["gptj/embed"]["embeddings"].size
    assert size not in {x.size for x in jax.tree.leaves(g.params)}
    hlo = g._decode.lower(g.params, state, np.int32(0), np.int32(4), 4, window, rows).compile().as_text()

    def made(size):
        return [(op, line.strip()) for line in _buffer_making_lines(hlo)
                for dims, op in re.findall(r"= \w+\[([\d,]*)\]\{[^}]*\} ([\w-]+)\(", line)
                if math.prod(int(d) for d in dims.split(",") if d) == size]
    caches = made(size)
    assert {op for op, _ in caches} <= {"custom-call", "bitcast", "get-tuple-element", "parameter"}, \
        [line[:160] for _, line in caches]
    writes = [line for op, line in caches if op == "custom-call"]
    assert writes and all(f'custom_call_target="{kernels.UPDATE_SLICE[0]}"' in line for line in writes)
    assert {op for op, _ in made(table)} <= {"bitcast", "get-tuple-element", "parameter"}, \
        [line[:160] for _, line in made(table)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_admission_writes_each_row_and_pool_slot_in_place(tiny, dtype, monkeypatch):
    """A one-dp-shard admission writes each new row into the cache by `kernels.update_slice`, and
    its prompts' blocks into the prefix cache's pool by `kernels.put_slots`: no other array the
    size of a layer's cache or pool is made (XLA:CPU wrote a bfloat16 row over float32 copies of
    the whole cache, 16 rows x 8 arrays of 134 MB for the serving GPT-J, then on the cache's bits
    at 0.8 GB/s; it stored prompts in a bfloat16 pool on its bits, converting the whole pool there
    and back)."""
    model = loading.load(hf=str(tiny.path), mp=1, dp=1, dtype=dtype)
    g = Generator(model.config, model.params, model.mesh)
    calls, admit = [], g._admit
    monkeypatch.setattr(g, "_admit", lambda *args: (calls.append(args), admit(*args))[1])
    batch = Batch(g, 8, 200, chunk=4, prefix=PrefixCache(g, 368, 16))  # no other array is its size
    prompts = [list(range(5, 25)), list(range(40, 67))]  # a full block each to store (context: 32)
    options = SamplingOptions(max_new_tokens=4, temperature=0.0)
    batch.admit(g.sequences(prompts, options))
    assert [batch.prefix.cached_tokens(p[:17]) for p in prompts] == [16, 16]
    # Then prompts behind those blocks: their prefill reads the pool (a shared prefix) before the
    # admission stores their own blocks there in place (XLA copied the pool twice for that).
    batch.admit(g.sequences([p[:16] + list(range(90, 102)) for p in prompts], options))
    assert len(calls) == 2 and len(calls[1]) == len(calls[0]) + 2  # the second took the shared slots to read
    for call in calls:
        hlo = admit.lower(*call).compile().as_text()
        for size, target in ((batch.state.cache.k[0].size, kernels.UPDATE_SLICE[0]),
                             (batch.prefix.pool.k[0].size, kernels.PUT_SLOTS[0])):
            made = [(op, line.strip()) for line in _buffer_making_lines(hlo)
                    for dims, op in re.findall(r"= \w+\[([\d,]*)\]\{[^}]*\} ([\w-]+)\(", line)
                    if math.prod(int(d) for d in dims.split(",") if d) == size]
            assert {op for op, _ in made} <= {"custom-call", "bitcast", "get-tuple-element", "parameter"}, \
                [line[:160] for _, line in made]
            assert any(f'custom_call_target="{target}"' in line for _, line in made)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prefill_attends_by_one_kernel_call_per_layer(tiny, dtype):
    """A prefill's attention is `kernels.attention`, once per layer, and its prompts' greedy
    tokens, prefill and decode steps (whose attention is the kernel's decode path), are XLA's
    path's (`Attention._attend_block`, the kernels off for attention alone)."""
    model = loading.load(hf=str(tiny.path), mp=1, dp=1, dtype=dtype)
    g = Generator(model.config, model.params, model.mesh)
    target = kernels.ATTENTION[jnp.dtype(dtype)][0]
    prompts = [list(range(3, 30)), list(range(40, 52))]
    calls, admit = [], g._admit
    g._admit = lambda *args: (calls.append(args), admit(*args))[1]
    options = SamplingOptions(max_new_tokens=NEW, temperature=0.0)
    ours = [s.tokens for s in g.generate(prompts, options)]
    hlo = admit.lower(*calls[0]).compile().as_text()
    assert hlo.count(f'custom_call_target="{target}"') == model.config.layers
    xla = Generator(model.config, model.params, model.mesh)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layers.Attention, "_fused_on_cpu", lambda *args: False)
        assert [s.tokens for s in xla.generate(prompts, options)] == ours


def test_the_package_data_ships_every_kernel_source_and_header():
    """An installed (non-editable) package builds the kernels from the files pyproject.toml ships:
    every source and header the build reads must match its package-data patterns."""
    import fnmatch
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["mesh_transformer.kernels"]
    for path in (*kernels.SOURCES, *kernels.HEADERS):
        assert any(fnmatch.fnmatch(path.name, p) for p in patterns), f"{path.name} is not in the package data"
