"""Generation against HF transformers' `generate` (greedy tokens, logprobs), sampling statistics, stopping.

Every test batches 4 prompts of at most 16 tokens with 16 new tokens, so all of them share one
compiled prefill and one compiled decode loop per mesh (session-scoped fixtures, also used by
tests/test_serve.py).
"""
from __future__ import annotations

import json
import math
import os
import re

import numpy as np
import pytest
import scipy.stats

import jax
import jax.numpy as jnp

from mesh_transformer import generate, kernels, loading
from mesh_transformer.generate import sampling
from mesh_transformer.generate.decode import fine_bucket, span_bucket
from mesh_transformer.io import hf
from mesh_transformer.generate import Generator, RowOptions, SamplingOptions
from tests.helpers import NEW, mesh

PROMPTS = [[5, 6, 7, 8, 9], [3, 4], list(range(20, 36)), [100, 42, 7, 250, 11, 12, 13]]


def greedy(**kw) -> SamplingOptions:
    return SamplingOptions(max_new_tokens=NEW, temperature=0.0, **kw)


def assert_matches_hf(tiny, seqs, prompts):
    for prompt, seq in zip(prompts, seqs):
        tokens, logprobs = tiny.hf_greedy(prompt)
        assert seq.tokens == tokens, f"prompt {prompt}"
        np.testing.assert_allclose(seq.logprobs, logprobs, atol=1e-4)
        assert seq.finish_reason == "length" and seq.truncated == 0


def test_loading_finds_the_tokenizer_beside_the_weights(tiny):
    model = loading.load(hf=str(tiny.path), mp=1, dp=1)
    assert model.config.compute_dtype == "bfloat16" and len(model.tokenizer) == len(tiny.tokenizer)
    assert model.tokenizer.encode("quick brown fox") == tiny.tokenizer.encode("quick brown fox")
    assert model.eos_token_ids == (tiny.eos,)  # its generation_config.json names the tokenizer's EOS only


def test_loading_adds_the_eos_ids_a_generation_config_lists(tiny, tmp_path):
    """A chat model's generation_config.json lists the ids that end its turns besides the tokenizer's
    EOS (Llama 3.1: [128001, 128008, 128009]); every tool stops at each of them."""
    from mesh_transformer.config import ConfigError
    for name in os.listdir(tiny.path):
        os.symlink(tiny.path / name, tmp_path / name)
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, tiny.eos, 9]}))
    model = loading.load(hf=str(tmp_path), mp=1, dp=1, dtype="float32")
    assert model.eos_token_ids == (tiny.eos, 7, 9)
    from mesh_transformer.evaluate.lm import MeshLM
    evaluated = MeshLM.from_loaded(model)  # eval_harness.py's generate_until stops there too, as HFLM's generate
    assert evaluated._sampling_options({"max_gen_toks": 4}, ["\n"]).eos_ids == (tiny.eos, 7, 9)
    assert loading.end_of_text_ids(tiny.tokenizer, [str(tmp_path / "none"), str(tmp_path)]) == (tiny.eos, 7, 9)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": list(range(20, 28))}))
    with pytest.raises(ConfigError, match="generation_config.json: eos_token_id lists 9 ids"):
        loading.end_of_text_ids(tiny.tokenizer, str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(ConfigError, match="generation_config.json: eos_token_id must be a token id or a list"):
        loading.end_of_text_ids(tiny.tokenizer, str(tmp_path))


def test_loading_a_training_checkpoint(tiny, gen, tmp_path):
    """--ckpt: config from the checkpoint, params restored onto the mesh, tokenizer checked against the vocabulary."""
    from mesh_transformer.io.checkpoint import CheckpointManager
    from mesh_transformer.config import Config, ConfigError, TrainConfig
    from mesh_transformer.train.step import TrainState

    config, params = hf.load_hf(tiny.path, compute_dtype="float32")
    with CheckpointManager(str(tmp_path / "run"), config=Config(config, TrainConfig())) as manager:
        manager.save(3, TrainState(jnp.zeros((), jnp.int32), jax.device_put(params), ()), wait=True)
    with pytest.raises(ConfigError, match="tokenizer 'gpt2' has 50257 tokens"):
        loading.load(ckpt=str(tmp_path / "run"), mp=1, dp=1)
    model = loading.load(ckpt=str(tmp_path / "run"), tokenizer=str(tiny.path), mp=1, dp=1, dtype="float32")
    assert model.config == config and model.name == "run"
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), model.params, params))


def test_greedy_matches_hf_generate(tiny, gen):
    """Prompts of 2..16 tokens in one left-padded batch: tokens equal, logprobs within 1e-4."""
    assert_matches_hf(tiny, gen.generate(PROMPTS, greedy(logprobs=0)), PROMPTS)


@pytest.mark.parametrize("matvec", [False, None], ids=["inputs_first", "default"])
def test_greedy_matches_hf_generate_on_dp2_mp4(tiny, matvec):
    """Weights inputs-first (Megatron's [in, heads, head] split over heads), and in the default
    layout: inputs-last ([heads, head, in]) where the kernels' dot products run, else inputs-first;
    q/k/v as one weight ([in, 3 x heads, head], each shard's q, k and v heads in turn) either way."""
    config, params = hf.load_hf(tiny.path, mp=4, compute_dtype="float32")
    sharded = Generator(config, params, mesh(2, 4), matvec=matvec)
    assert sharded.inputs_last == (matvec is None and kernels.dot_kernel(jnp.float32))
    spec = ("mp", None, None) if sharded.inputs_last else (None, "mp", None)
    assert sharded.params["gptj/layer_1/attn"]["qkv_proj"].sharding.spec == jax.sharding.PartitionSpec(*spec)
    assert_matches_hf(tiny, sharded.generate(PROMPTS, greedy(logprobs=0)), PROMPTS)


def test_greedy_matches_hf_with_weights_stored_inputs_last(tiny):
    """Generator(matvec=True): decode-layout weights ([outputs, inputs], as torch stores them) on mp=2."""
    config, params = hf.load_hf(tiny.path, mp=2, compute_dtype="float32")
    matvec = Generator(config, params, mesh(1, 2), matvec=True)
    assert matvec.params["gptj/layer_0/mlp"]["fc_in"].shape == (config.ff_dim, config.d_model)
    assert matvec.params["gptj/head"]["lm_head"].sharding.spec == jax.sharding.PartitionSpec("mp", None)
    assert matvec.params["gptj/layer_1/attn"]["out_proj"].sharding.spec == jax.sharding.PartitionSpec(None, "mp", None)
    assert_matches_hf(tiny, matvec.generate(PROMPTS, greedy(logprobs=0)), PROMPTS)


def decode_args(g: Generator) -> tuple:
    """`Generator._decode`'s arguments for one compiled call: 2 rows, 32 slots, 4 steps."""
    return g.params, g.new_state(2, 32), np.int32(0), np.int32(4), 4, 32


@pytest.mark.parametrize("matvec", [False, True], ids=["inputs_first", "inputs_last"])
def test_decode_reads_weights_and_cache_in_place(tiny, matvec):
    """The compiled decode loop copies or transposes no weight and no layer's KV cache: each step
    reads them where they are (a copy per step would double a memory-bound step's traffic)."""
    config, params = hf.load_hf(tiny.path, compute_dtype="float32")
    g = Generator(config, params, mesh(1, 1), matvec=matvec)
    args = decode_args(g)
    hlo = g._decode.lower(*args).compile().as_text()
    state = args[1]
    matrices = [x for x in jax.tree.leaves(g.params) if x.ndim >= 2] + [state.cache.k[0], state.cache.v[0]]
    smallest = min(x.size for x in matrices)
    moved = [[int(d) for d in dims.split(",") if d] for dims in
             re.findall(r"= \w+\[([\d,]*)\]\{[^}]*\} (?:copy|transpose)\(", hlo)]
    assert moved, "the pattern should see the loop's small copies"
    assert [dims for dims in moved if math.prod(dims) >= smallest] == []


def test_two_level_argmax_equals_argmax_with_ties():
    rng = np.random.RandomState(0)
    logits = rng.randint(0, 4, (8, 384)).astype(np.float32)  # many ties: the first index wins
    logits[3] = -np.inf
    logits[3, 200] = 1.0
    np.testing.assert_array_equal(np.asarray(sampling.argmax(jnp.asarray(logits))), np.argmax(logits, -1))


def test_logprobs_only_when_asked(gen):
    plain, asked, *_ = gen.generate(PROMPTS, [greedy(), greedy(logprobs=2), greedy(), greedy()])
    assert plain.logprobs == [] and plain.top_logprobs == []
    assert len(asked.logprobs) == NEW and all(len(alts) == 2 for alts in asked.top_logprobs)
    assert all(lp <= 0 for lp in asked.logprobs)


def test_sampling_is_reproducible_per_row(gen):
    """A seed fixes a row's tokens whatever else is in the batch (and wherever the row is)."""
    opts = [SamplingOptions(max_new_tokens=NEW, temperature=1.0, seed=s) for s in (1, 2, 3, 1)]
    first = [s.tokens for s in gen.generate(PROMPTS[:3] + [PROMPTS[0]], opts)]
    again = [s.tokens for s in gen.generate([PROMPTS[1], PROMPTS[0], PROMPTS[3], PROMPTS[2]],
                                            [opts[1], opts[0], SamplingOptions(max_new_tokens=NEW, seed=9), opts[2]])]
    assert first[0] == first[3] == again[1]
    assert first[1] == again[0] and first[2] == again[3]
    assert first[0] != first[1]


def test_top_k_and_top_p_restrict_every_token_to_the_allowed_set(tiny, gen):
    """Through the whole pipeline: each sampled token is inside HF's top-k / nucleus for its prefix."""
    opts = [SamplingOptions(max_new_tokens=NEW, temperature=1.5, top_k=3, seed=s) for s in range(2)] + \
           [SamplingOptions(max_new_tokens=NEW, temperature=1.0, top_p=0.5, seed=s) for s in range(2)]
    prompt = PROMPTS[0]
    for opt, seq in zip(opts, gen.generate([prompt] * 4, opts)):
        logits = tiny.hf_logits(prompt + seq.tokens)[len(prompt) - 1:-1]  # the distribution each token came from
        for step, (row, token) in enumerate(zip(logits, seq.tokens)):
            order = np.argsort(-row)
            if opt.top_k:
                allowed = order[:opt.top_k]
            else:
                p = np.exp(row / opt.temperature - np.max(row / opt.temperature))
                p = p[order] / p.sum()
                allowed = order[: int(np.sum(np.cumsum(p) - p < opt.top_p))]
            assert token in allowed, f"step {step}: token {token} outside {allowed.tolist()}"


def expected_distribution(logits, temperature, top_k, top_p, min_p=0.0):
    z = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-z)
    keep = np.zeros(len(z), bool)
    keep[order[: top_k or len(z)]] = True
    p = np.where(keep, np.exp(z - z.max()), 0)
    p /= p.sum()
    mass_before = np.cumsum(p[order]) - p[order]
    nucleus = np.zeros(len(z), bool)
    nucleus[order[mass_before < top_p]] = True
    p = np.where(nucleus & (p >= min_p * p.max()), p, 0)
    return p / p.sum()


SMALL = np.array([2.0, 1.5, 1.4, 1.0, 0.5, 0.2, 0.0, -0.3, -1.0, -2.0, -np.inf, 0.1], np.float32)
BLOCKS = np.full(384, -np.inf, np.float32)  # 3 blocks of 128: exercises the two-level draw
BLOCKS[[3, 100, 127, 128, 200, 300, 301, 383]] = [1.0, 0.2, 1.4, 2.0, -0.5, 0.6, 1.1, 0.0]


@pytest.mark.parametrize("logits,temperature,top_k,top_p,min_p", [
    (SMALL, 1.0, 0, 1.0, 0.0), (SMALL, 0.7, 5, 1.0, 0.0), (SMALL, 1.3, 0, 0.8, 0.0), (SMALL, 0.9, 6, 0.7, 0.0),
    (SMALL, 1.2, 0, 1.0, 0.3), (BLOCKS, 1.0, 0, 1.0, 0.0), (BLOCKS, 0.8, 4, 0.9, 0.0)],
    ids=["plain", "top_k", "top_p", "both", "min_p", "blocks", "blocks_both"])
def test_sampled_frequencies_match_the_truncated_softmax(logits, temperature, top_k, top_p, min_p):
    """20,000 draws (one per row, each its own seed) against the exact distribution: chi-square."""
    n = 20_000
    options = [SamplingOptions(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)] * n
    rows = RowOptions.stack(options, seeds=np.arange(n))
    tokens = np.asarray(jax.jit(sampling.choose)(jnp.tile(logits, (n, 1)), rows, jnp.zeros(n, jnp.int32)))
    counts = np.bincount(tokens, minlength=len(logits))
    p = expected_distribution(logits, temperature, top_k, top_p, min_p)
    assert np.all(counts[p == 0] == 0), "sampled a token outside the top-k / nucleus / min-p set"
    support = p > 0
    expected = n * p[support] / p[support].sum()
    assert scipy.stats.chisquare(counts[support], expected).pvalue > 1e-3
    assert np.max(np.abs(counts / n - p)) < 0.015


@pytest.fixture(params=["kernel", "bisection"])
def truncation(request, monkeypatch):
    """`sampling.top_k_top_p` by each way it finds thresholds: the CPU kernel, and bisection in XLA
    (where the kernels are not: accelerators, no compiler). -> a freshly jitted top_k_top_p (a new
    function each time, so no trace of the other way is reused)."""
    if request.param == "kernel" and not kernels.available():
        pytest.skip("the CPU kernels are not built here (no C++ compiler)")
    if request.param == "bisection":
        monkeypatch.setattr(kernels, "available", lambda: False)
    return jax.jit(lambda logits, top_k, top_p, min_p: sampling.top_k_top_p(logits, top_k, top_p, min_p))


def test_top_k_top_p_equals_a_full_sort(truncation):
    """The thresholds give exactly the sets sorting gives, ties (and -0.0 == 0.0) and -inf included."""
    rng = np.random.RandomState(0)
    n, vocab = 64, 40
    logits = (rng.randn(n, vocab) * rng.choice([0.3, 1.0, 4.0], (n, 1))).astype(np.float32)
    logits[:8] = np.round(logits[:8])  # ties
    logits[8:16, ::3] = -np.inf
    top_k = rng.choice([0, 1, 3, 8, 9, 20, 40], n).astype(np.int32)
    top_p = rng.choice([0.1, 0.5, 0.9, 0.99, 1.0], n).astype(np.float32)
    fast = np.asarray(truncation(logits, top_k, top_p, np.zeros(n, np.float32)))
    for row, k, p, got in zip(logits, top_k, top_p, fast):
        np.testing.assert_array_equal(np.isfinite(got), kept_by_sorting(row, int(k), float(p)),
                                      err_msg=f"top_k={k} top_p={p}")


def test_top_k_top_p_min_p_keep_what_transformers_keeps_over_a_gpt2_vocabulary(truncation):
    """50,257 tokens per row, flat and peaked rows, ties: the tokens left finite are those
    transformers' TopKLogitsWarper, TopPLogitsWarper and MinPLogitsWarper leave (in that order, as
    its `generate` applies them; run in float64), and where its top-p cuts through tokens of equal
    logits (by its sort's order), the rest of them too."""
    import torch
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    rng = np.random.RandomState(1)
    n, vocab = 16, 50257
    logits = (rng.randn(n, vocab) * np.array([0.5, 1.0, 3.0, 8.0] * 4)[:, None]).astype(np.float32)
    logits[2] = np.round(logits[2] * 4) / 4  # many ties
    logits[3, ::2] = -np.inf
    top_k = np.array([0, 0, 0, 0, 1, 40, 1000, 50256, 0, 0, 0, 0, 40, 1000, 5, 0], np.int32)
    top_p = np.array([0.9, 0.5, 0.95, 0.9, 1.0, 1.0, 1.0, 1.0, 0.1, 0.99, 0.7, 0.3, 0.9, 0.95, 0.5, 1.0], np.float32)
    min_p = np.array([0, 0, 0, 0, 0, 0.1, 0, 0, 0.05, 0, 0.1, 0, 0.2, 0, 0, 0.3], np.float32)
    ours = np.isfinite(np.asarray(truncation(logits, top_k, top_p, min_p)))
    for i in range(n):
        row = torch.from_numpy(logits[i:i + 1].astype(np.float64))
        if top_k[i]:
            row = TopKLogitsWarper(int(top_k[i]))(None, row)
        if top_p[i] < 1:
            row = TopPLogitsWarper(float(top_p[i]))(None, row)
        if min_p[i] > 0:
            row = MinPLogitsWarper(float(min_p[i]))(None, row)
        theirs = np.isfinite(row.numpy()[0])
        extra = ours[i] & ~theirs
        what = (f"row {i} (top_k {top_k[i]}, top_p {top_p[i]}, min_p {min_p[i]}): kept {ours[i].sum()}, "
                f"transformers {theirs.sum()}")
        assert not np.any(theirs & ~ours[i]), what
        assert np.all(logits[i][extra] == logits[i][theirs].min()), what
        assert i == 2 or not extra.any(), what  # only the row with ties



def test_on_cpu_the_thresholds_are_one_kernel_call_not_a_bisection_loop():
    """The compiled truncation calls `kernels.truncation_floor` and loops over nothing (the XLA way
    is two 32-step loops of masked sums over [B, V])."""
    if not kernels.available():
        pytest.skip("the CPU kernels are not built here (no C++ compiler)")
    logits = jax.ShapeDtypeStruct((64, 50257), jnp.float32)
    rows = jax.ShapeDtypeStruct((64,), jnp.int32), jax.ShapeDtypeStruct((64,), jnp.float32)
    hlo = jax.jit(sampling.top_k_top_p).lower(logits, *rows, rows[1]).compile().as_text()
    assert hlo.count(kernels.TRUNCATION_FLOOR[0]) == 1 and " while(" not in hlo


def kept_by_sorting(row, top_k, top_p):
    """Tokens top-k then top-p keep, by value: ties with the smallest kept value are kept too."""
    z = np.asarray(row, np.float64)
    floor = np.sort(z)[::-1][top_k - 1] if 0 < top_k < len(z) else -np.inf
    in_k = z >= floor
    if top_p >= 1:
        return in_k
    probs = np.where(in_k, np.exp(z - z.max()), 0)
    probs /= probs.sum()
    for value in np.unique(z[in_k]):  # ascending: the smallest value with less than top_p above it
        if probs[z > value].sum() < top_p:
            return z >= value


def test_penalties_follow_hf_and_openai_definitions():
    logits = jnp.array([[2.0, -1.0, 0.5, 3.0]])
    rows = RowOptions.stack([SamplingOptions(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)], [0])
    counts = jnp.array([[0, 2, 1, 0]])
    seen = jnp.array([[True, True, False, False]])
    out = np.asarray(sampling.penalize(logits, counts, seen, rows))
    # token 0: seen, positive -> /2; token 1: seen, negative -> *2, minus 2*0.5 + 0.25; token 2: 1*0.5 + 0.25
    np.testing.assert_allclose(out, [[1.0, -2.0 - 1.25, 0.5 - 0.75, 3.0]])


def test_repetition_penalty_in_generation(gen):
    """A huge repetition penalty makes greedy avoid every token of the prompt and of its own output."""
    seqs = gen.generate(PROMPTS, [greedy(repetition_penalty=1e4)] * 2 + [greedy()] * 2)
    for prompt, seq in zip(PROMPTS[:2], seqs[:2]):
        assert len(set(seq.tokens)) == NEW and not set(seq.tokens) & set(prompt)
    assert any(len(set(s.tokens)) < NEW for s in seqs[2:])  # without it, this model repeats itself


def test_eos_and_stop_tokens_end_rows_early(tiny, gen):
    reference = [s.tokens for s in gen.generate(PROMPTS, greedy())]
    eos_at = 3  # first position of that token in row 0's output
    eos = reference[0][eos_at]
    eos_at = reference[0].index(eos)
    stop = tuple(reference[1][5:7])
    stop_at = next(i for i in range(1, NEW) if tuple(reference[1][i - 1:i + 1]) == stop)
    # Several eos ids (a generation config's list): the first of them the row emits ends it.
    unused = next(t for t in range(len(tiny.tokenizer)) if t not in reference[2])
    several = (unused, reference[2][6], reference[2][4])
    several_at = min(reference[2].index(t) for t in several[1:])
    seqs = gen.generate(PROMPTS, [greedy(eos_token_id=eos), greedy(stop_token_ids=(stop,)),
                                  greedy(eos_token_id=several), greedy()], tokenizer=tiny.tokenizer)
    assert seqs[0].tokens == reference[0][: eos_at + 1] and seqs[0].finish_reason == "stop"
    assert seqs[1].tokens == reference[1][: stop_at + 1] and seqs[1].finish_reason == "stop"
    assert seqs[2].tokens == reference[2][: several_at + 1] and seqs[2].finish_reason == "stop"
    assert seqs[2].text == tiny.tokenizer.decode(reference[2][:several_at])  # the eos id is not text
    assert seqs[3].tokens == reference[3] and seqs[3].finish_reason == "length"
    with pytest.raises(ValueError, match="eos_token_id must be a token id or at most 8"):
        greedy(eos_token_id=tuple(range(9))).validate(64)


def test_logit_bias_and_min_new_tokens_continue_as_transformers_does(tiny, gen):
    """OpenAI's logit_bias is transformers' sequence_bias of single tokens (applied before the
    repetition penalty, as there), and min_new_tokens its MinNewTokensLengthLogitsProcessor: greedy
    continuations equal generate's with them, per row."""
    reference = [s.tokens for s in gen.generate(PROMPTS, greedy())]
    banned = {(t,): -100.0 for t in reference[0][:3]}  # its first three choices, ruled out
    boosted = {(reference[1][0],): -5.0, (97,): 7.5}  # a nudge, not a rule
    ends = [reference[2][1], reference[2][4]]  # would end the row at its second token
    options = [greedy(logit_bias=tuple((t, b) for (t,), b in banned.items())),
               greedy(logit_bias=tuple((t, b) for (t,), b in boosted.items()), repetition_penalty=1.3),
               greedy(eos_token_id=tuple(ends), min_new_tokens=6),
               greedy(eos_token_id=tuple(ends))]
    seqs = gen.generate(PROMPTS[:3] + PROMPTS[2:3], options)
    expected = [tiny.hf_greedy(PROMPTS[0], sequence_bias=banned)[0],
                tiny.hf_greedy(PROMPTS[1], sequence_bias=boosted, repetition_penalty=1.3)[0],
                tiny.hf_greedy(PROMPTS[2], eos_token_id=ends, min_new_tokens=6)[0],
                tiny.hf_greedy(PROMPTS[2], eos_token_id=ends)[0]]
    assert [s.tokens for s in seqs[:3]] == expected[:3]
    assert not set(seqs[0].tokens) & set(reference[0][:3]) and seqs[1].tokens != reference[1]
    assert len(seqs[2].tokens) > 6 and not set(seqs[2].tokens[:6]) & set(ends)
    assert seqs[3].tokens == reference[2][:2] == expected[3] and seqs[3].finish_reason == "stop"
    for bad, match in [(dict(logit_bias=((5, 101.0),)), r"logit_bias must map token ids to biases in \[-100, 100\]"),
                       (dict(logit_bias=((5, 1.0), (5, 2.0))), "logit_bias names a token twice"),
                       (dict(min_new_tokens=NEW + 1), "min_new_tokens must be an integer in")]:
        with pytest.raises(ValueError, match=match):
            greedy(**bad).validate(64)


def test_min_new_tokens_holds_stop_strings_back(tiny, gen):
    """vLLM's min_tokens: a stop string ends the text only where it ends after the first
    min_new_tokens tokens' text (an earlier occurrence does not count)."""
    tok = tiny.tokenizer
    prompts = [tok.encode(p) for p in ("The quick", "The quick", "The quick", "How vexingly")]
    [plain] = gen.generate(prompts, greedy(), tokenizer=tok)[:1]
    text, held = plain.text, len(tok.decode(plain.tokens[:6]))
    stop = next(c for c in text[:held] if text.find(c, held) >= 0)  # occurs before the 6th token and after
    # A stop that is the m-th token itself, with min_new_tokens m, does not count there (device and host agree).
    m = next(i for i in range(2, NEW) if plain.tokens[i - 1] != plain.tokens[i]
             and tok.encode(tok.decode(plain.tokens[i - 1:i])) == plain.tokens[i - 1:i])
    last, at_m = tok.decode(plain.tokens[m - 1:m]), len(tok.decode(plain.tokens[:m]))
    seqs = gen.generate(prompts, [greedy(stop=(stop,), min_new_tokens=6), greedy(stop=(stop,)),
                                  greedy(stop=(last,), min_new_tokens=m), greedy()], tokenizer=tok)
    assert seqs[0].text == text[:text.index(stop, held)] and seqs[0].finish_reason == "stop"
    assert seqs[1].text == text[:text.index(stop)] != seqs[0].text
    later = text.find(last, at_m - len(last) + 1)
    assert seqs[2].text == (text if later < 0 else text[:later]) and len(seqs[2].text) > at_m
    assert [s.stop_string for s in seqs] == [stop, stop, None if later < 0 else last, None]


def test_stop_strings_cut_the_text(tiny, gen):
    tok = tiny.tokenizer
    prompts = [tok.encode(p) for p in ("The quick", "Pack my box", "def main", "How vexingly")]
    plain = gen.generate(prompts, greedy(), tokenizer=tok)
    text = plain[0].text
    stop = text[6:8]
    cut = text.index(stop)
    overlapping = (text[cut:cut + 5], "never said", stop)  # two start where the text ends: the shorter ended it
    seqs = gen.generate(prompts, [greedy(stop=(stop,)), greedy(), greedy(stop=overlapping), greedy()], tokenizer=tok)
    assert seqs[0].text == text[:cut] and seqs[0].finish_reason == "stop"
    assert len(seqs[0].tokens) < NEW or cut + len(stop) > len(tok.decode(plain[0].tokens[:-1]))
    assert seqs[1].text == plain[1].text
    assert [s.stop_string for s in seqs] == [stop, None, None, None]
    prompts[2] = prompts[0]
    again = gen.generate(prompts, [greedy(), greedy(), greedy(stop=overlapping), greedy()], tokenizer=tok)[2]
    assert (again.text, again.stop_string) == (text[:cut], stop)


def test_a_stop_inside_a_longer_one_cuts_the_same_however_tokens_arrive(tiny):
    """Stops "quick brown fox" and "ick b": the second is complete first as the text grows (with
    " brown"), so it ends the text at its own start, whether the tokens arrive in one decode call or
    one at a time (the earliest start alone would cut at "quick" in one call, at "ick" one by one)."""
    from mesh_transformer.generate.batching import Sequence
    tok = tiny.tokenizer
    tokens = tok.encode("The quick brown fox jumps")
    stops = ("quick brown fox", "ick b")
    whole, one_by_one = (Sequence([1], greedy(stop=stops), 64, tok) for _ in range(2))
    whole.extend(tokens, [], [], [])
    streamed = ""
    for t in tokens:
        if not one_by_one.finished:
            one_by_one.extend([t], [], [], [])
            streamed += one_by_one.pop_text()
    for seq, shown in ((whole, whole.text), (one_by_one, streamed)):
        assert (shown, seq.stop_string, seq.finish_reason) == ("The qu", "ick b", "stop")
    assert whole.kept_tokens() == one_by_one.kept_tokens() == 2  # "The", " quick": the cut is inside the second
    # min_new_tokens 1: "The" ends within the first token's text and does not count; "The quick" ends the text
    held = Sequence([1], greedy(stop=("The", "The quick"), min_new_tokens=1), 64, tok)
    held.extend(tokens, [], [], [])
    assert (held.text, held.stop_string) == ("", "The quick")


def test_streamed_text_adds_up_to_the_final_text(tiny, gen):
    tok = tiny.tokenizer
    seqs = gen.sequences([tok.encode(p) for p in ("The quick", "Pack", "def", "How")], greedy(), tok)
    pieces = [""] * 4
    for _ in gen.stream(seqs, chunk=NEW // 4):
        for i, s in enumerate(seqs):
            pieces[i] += s.pop_text()
    assert pieces == [s.text for s in seqs]


def test_long_prompts_are_cut_from_the_left_and_flagged(tiny, gen):
    """Context 32, 16 new tokens: a 40-token prompt keeps its last 16, like HF on those 16."""
    long_prompt = list(range(1, 41))
    seqs = gen.generate([long_prompt] + PROMPTS[1:], greedy())
    assert seqs[0].truncated == 24 and seqs[0].prompt == long_prompt[24:]
    assert seqs[0].tokens == tiny.hf_greedy(long_prompt[24:])[0]
    assert all(s.truncated == 0 for s in seqs[1:])


def test_bad_options_are_refused_with_the_field_name(gen):
    for bad, field in [(dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=32), "max_new_tokens"),
                       (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
                       (dict(top_k=-2), "top_k"), (dict(logprobs=9), "logprobs")]:
        with pytest.raises(ValueError, match=field):
            gen.sequences([[1, 2]], SamplingOptions(**{"max_new_tokens": 4, **bad}))
    with pytest.raises(ValueError, match="empty"):
        gen.sequences([[]], SamplingOptions(max_new_tokens=4))


def test_buckets_bound_the_compiled_shapes(gen):
    assert [generate.bucket(n) for n in (1, 16, 17, 100, 1000)] == [16, 16, 32, 128, 1024]
    assert [generate.bucket(n, 1) for n in (1, 3, 4, 5)] == [1, 4, 4, 8]
    assert [fine_bucket(n, grain=16) for n in (1, 16, 17, 100, 128, 133, 1133)] == [16, 16, 32, 112, 128, 160, 1280]
    gen.generate(PROMPTS, greedy())
    compiled = gen._admit._cache_size(), gen._decode._cache_size()
    for length in (9, 12, 16):  # new prompt lengths and options, same buckets: nothing recompiles
        gen.generate([[3] * length] * 4, SamplingOptions(max_new_tokens=NEW - length % 5, temperature=0.5, top_k=2))
    assert (gen._admit._cache_size(), gen._decode._cache_size()) == compiled


def test_near_the_memory_map_limit_compiled_programs_are_dropped_first(tiny, gen, monkeypatch, caplog):
    """Each XLA:CPU kernel of a compiled program holds memory maps, and a compile past the kernel's
    vm.max_map_count kills the process: near it, a new shape first drops the generator's programs
    (they compile again, with the same answers), and a server's warm-up stops instead."""
    from mesh_transformer import host_memory
    from mesh_transformer.serve import Engine
    model = loading.load(hf=str(tiny.path), mp=1, dp=1, dtype="float32")
    g = Generator(model.config, model.params, model.mesh)
    g.generate([[5, 6, 7]], greedy())
    g.generate([[1, 2], [3, 4], [5, 6]], greedy())  # 4 rows
    assert g._admit._cache_size() == 2
    two = [[5, 6, 7], [8, 9, 10]]  # 2 rows: new shapes
    expected = [s.tokens for s in gen.generate(two, greedy())]
    # A process near its limit (no room for one more program) whose programs, once dropped, free two
    # programs' maps: counts made up, as the real one falls by however much garbage (other tests'
    # programs too) the drop's collection finds
    maps, limit = {"held": 60_000}, 60_000 + host_memory.MAPS_PER_PROGRAM // 2
    monkeypatch.setattr(host_memory, "memory_maps", lambda: (maps["held"], limit))
    drop = Generator.drop_programs

    def drop_and_free(self):
        drop(self)
        maps["held"] -= 2 * host_memory.MAPS_PER_PROGRAM
    monkeypatch.setattr(Generator, "drop_programs", drop_and_free)
    assert [s.tokens for s in g.generate(two, greedy())] == expected
    assert g._admit._cache_size() == 1  # the two earlier prefills were dropped before this one compiled
    assert "vm.max_map_count" in caplog.text
    engine = Engine(g, None, max_batch=2, chunk=4, prefix_cache_tokens=0)
    before = set(g.shapes)
    engine.warmup((5,))
    assert set(g.shapes) == before and "warm-up stopped" in caplog.text


def test_warmup_compiles_first_the_decode_windows_its_prompts_use(gen, monkeypatch):
    """Warm-up stops near the process's limit of memory maps, so the decode windows that prompts of
    the warmed lengths take (20 tokens + a 4-step call: 32 slots) are compiled before the smaller
    ones (16: for shorter prompts), each for every row bucket."""
    from mesh_transformer import host_memory
    from mesh_transformer.serve import Engine
    monkeypatch.setattr(host_memory, "memory_maps", lambda: (0, 65530))  # the suite's own maps kept out
    windows, decode = [], gen.decode
    monkeypatch.setattr(gen, "decode", lambda state, steps, first=0, window=None, rows=None, limit=None, **kw: (
        windows.append((window, rows)), decode(state, steps, first, window, rows, limit, **kw))[1])
    engine = Engine(gen, None, max_batch=2, chunk=4, prefix_cache_tokens=0)
    engine.warmup((20,))
    assert windows[-4:] == [(32, 1), (32, 2), (16, 1), (16, 2)]


def test_decode_windows_start_where_their_cache_weighs_a_share_of_the_weights(tiny, gen, monkeypatch):
    """A decode call attends to at least `Generator.min_window(rows)` slots: the most (a power of
    two) whose keys and values, for the rows it computes, weigh WINDOW_SHARE of the weights a step
    reads. The tiny model's 151,040 bytes of weights (all but the untied embedding table) against
    512 bytes a slot (2 layers, k and v, 4 heads of 8, float32) leave the 16-slot bucket at the
    default 1/64; at 1/4 the floor is 64 slots for one row, 32 for two. A batch then decodes HF's
    greedy tokens with every call over at least its floor, and a server's warm-up compiles no
    window below it."""
    from mesh_transformer import host_memory, parallel
    from mesh_transformer.generate import decode as decoding
    from mesh_transformer.serve import Engine
    state = gen.new_state(2, 64)
    assert gen.slot_bytes == 512 == sum(x.nbytes for x in (*state.cache.k, *state.cache.v)) // (2 * 64)
    assert gen.weight_bytes == 151_040 == parallel.bytes_of(gen.params) - parallel.bytes_of(gen.params["gptj/embed"])
    assert [gen.min_window(rows) for rows in (1, 2, 4)] == [16, 16, 16]
    monkeypatch.setattr(decoding, "WINDOW_SHARE", 1 / 4)
    floors = {rows: gen.min_window(rows) for rows in (1, 2, 4)}
    assert floors == {1: 64, 2: 32, 4: 16}

    calls, decode = [], gen.decode
    monkeypatch.setattr(gen, "decode", lambda state, steps, first=0, window=None, rows=None, limit=None, **kw: (
        calls.append((window, rows)), decode(state, steps, first, window, rows, limit, **kw))[1])
    prompts, options = [[5, 6, 7, 8, 9], [11, 12, 13]], [greedy(), SamplingOptions(max_new_tokens=NEW - 4, temperature=0.0)]
    batch = generate.Batch(gen, 2, 64, chunk=4)  # (without the floor: 16-slot windows at first)
    seqs = [gen.sequences([p], o)[0] for p, o in zip(prompts, options)]
    batch.admit(seqs)
    while batch.active():
        batch.step()
    assert {rows for _, rows in calls} == {1, 2}  # the second row ends first
    assert all(window >= floors[rows] for window, rows in calls), calls
    for prompt, seq, o in zip(prompts, seqs, options):
        assert seq.tokens == tiny.hf_greedy(prompt, o.max_new_tokens)[0], f"prompt {prompt}"

    calls.clear()
    monkeypatch.setattr(host_memory, "memory_maps", lambda: (0, 65530))  # the suite's own maps kept out
    Engine(gen, None, max_batch=2, slots=64, chunk=4, prefix_cache_tokens=0).warmup((20,))
    assert calls[-3:] == [(32, 2), (64, 1), (64, 2)]  # after its prompts' own decoding
    assert all(window >= floors[rows] for window, rows in calls), calls


def test_decode_computes_only_the_rows_in_use(gen, monkeypatch):
    """3 requests in a 16-row batch decode 4 rows (bucketed), the same tokens a 4-row batch gives;
    batch-invariant, all 16 rows."""
    prompts, computed = [[5, 6, 7], [8, 9], [10, 11, 12, 13]], []
    decode = gen.decode
    monkeypatch.setattr(gen, "decode", lambda state, steps, first, window, rows, limit=None, **shared: (
        computed.append(rows), decode(state, steps, first, window, rows, limit, **shared))[1])

    def run(rows: int, invariant: bool = False):
        batch = generate.Batch(gen, rows, 64, chunk=4, batch_invariant=invariant)
        seqs = gen.sequences(prompts, greedy())
        batch.admit(seqs)
        computed.clear()
        while batch.active():
            batch.step()
        return [s.tokens for s in seqs], set(computed)

    fast, rows = run(16)
    assert rows == {4} and len(fast[0]) == NEW
    assert run(4) == (fast, {4})
    assert run(16, invariant=True)[1] == {16}


def test_admission_moves_only_the_running_rows_slots(tiny, gen, monkeypatch):
    """A prompt longer than the write index moves the running row's slots (its 16-slot span, not
    the 64-slot cache: `Generator.move`) to a bucketed index; both rows' greedy tokens still equal HF's."""
    batch = generate.Batch(gen, 4, 64, chunk=4)
    prompts = [[5, 6, 7, 8, 9], list(range(100, 122))]
    first, second = gen.sequences(prompts, [greedy(), SamplingOptions(max_new_tokens=8, temperature=0.0)])
    batch.admit([first])
    assert batch.index == 16  # 5 tokens, bucketed: prompts up to 16 tokens join without a move
    batch.step()  # the write index: 16 + 4
    moves, move = [], gen.move
    monkeypatch.setattr(gen, "move", lambda state, start, index, new: (
        moves.append((start, index, new)), move(state, start, index, new))[1])
    batch.admit([second])
    while batch.active():
        batch.step()
    assert moves == [(11, 20, 32)] and ("move", ("size", 16), ("slots", 64)) in gen.shapes
    for prompt, seq in zip(prompts, (first, second)):
        assert seq.tokens == tiny.hf_greedy(prompt, len(seq.tokens))[0], f"prompt {prompt}"


def test_a_long_span_moves_instead_of_rolling_the_cache(gen):
    """The slots of prompts behind a 1,000-token prefix (1,166 from the first row's start to the
    write index) move as a 1,280-slot span: bucketed to 2,048 they could not move inside a
    2,048-slot cache and admission rolled the whole cache (seconds at 64 rows)."""
    assert [span_bucket(n) for n in (5, 16, 17, 129, 1166, 1281)] == [16, 16, 32, 160, 1280, 1536]
    state = gen.new_state(2, 2048)
    moved = gen.move(state, 10, 1176, 1280)
    assert moved is not state and ("move", ("size", 1280), ("slots", 2048)) in gen.shapes
    assert int(moved.cache.index) == 104  # the new state's index moved by +104 as well


def test_a_span_that_cannot_move_in_one_piece_rolls_the_whole_cache(gen):
    """A running span bucketed to the whole cache (60 of 64 slots) cannot move by 2 inside it:
    `move` rolls every row's slots instead (positions, slot - start, do not change)."""
    state = gen.new_state(2, 64)
    k = [np.arange(x.size, dtype=np.float32).reshape(x.shape) for x in state.cache.k]
    state = state._replace(cache=state.cache._replace(k=tuple(jnp.asarray(x) for x in k)))
    rolled = gen.move(state, 0, 60, 62)
    assert ("roll", ("slots", 64)) in gen.shapes and int(rolled.cache.index) == 2
    assert list(np.asarray(rolled.cache.start)) == [2, 2]
    for before, after in zip(k, rolled.cache.k):
        np.testing.assert_array_equal(np.asarray(after), np.roll(before, 2, axis=-1))


def test_admission_writes_the_cache_in_place(gen, monkeypatch):
    """The compiled admission holds no second copy of the batch's cache: it relabels the cache
    (running rows moved first, `move`) and writes the new rows in place. A 64-row cache (2.1 GB)
    copied at every admission cost a behind-a-prefix admission of 16 prompts a quarter of its time
    on a CPU (3.4 GB of temporaries, which glibc then mmapped and page-faulted afresh each call)."""
    calls, admit = [], gen._admit
    monkeypatch.setattr(gen, "_admit", lambda *args: (calls.append(args), admit(*args))[1])
    batch = generate.Batch(gen, 16, 512, chunk=4)
    batch.admit(gen.sequences([[5, 6, 7], [8, 9]], greedy()))
    cache = sum(x.nbytes for x in (*batch.state.cache.k, *batch.state.cache.v))
    temp = admit.lower(*calls[0]).compile().memory_analysis().temp_size_in_bytes
    assert temp < cache / 4, (temp, cache)


def test_a_decode_call_stops_at_its_limit_with_the_same_program(tiny, gen):
    """`Batch.step(limit)` (the engine's short call after requests join): 1, then 2, then the whole
    chunk of 4 tokens per row from one compiled decode program; the tokens still equal HF's greedy."""
    batch = generate.Batch(gen, 2, 64, chunk=4)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    seqs = gen.sequences(prompts, greedy())
    batch.admit(seqs)
    lengths, programs = [], []
    for limit in (1, 2, None):
        batch.step(limit)
        lengths.append([len(s.tokens) for s in seqs])
        programs.append(gen._decode._cache_size())
    assert lengths == [[2, 2], [4, 4], [8, 8]] and programs[0] == programs[-1], (lengths, programs)
    while batch.active():
        batch.step()
    for prompt, seq in zip(prompts, seqs):
        assert seq.tokens == tiny.hf_greedy(prompt)[0], f"prompt {prompt}"


MARGIN = 0.12  # twice the largest log-p error allowed below: no 16-bit error can flip a wider choice


@pytest.fixture(scope="module")
def fp32_greedy(tiny, gen):
    """float32 greedy sequences (with log p) and HF's top-2 logit margin at each of their steps."""
    seqs = gen.generate(PROMPTS, greedy(logprobs=1))
    margins = []
    for prompt, seq in zip(PROMPTS, seqs):
        logits = tiny.hf_logits(prompt + seq.tokens)[len(prompt) - 1: len(prompt) + NEW - 1]
        top2 = np.sort(logits, axis=-1)[:, -2:]
        margins.append(top2[:, 1] - top2[:, 0])
    return seqs, margins


@pytest.mark.parametrize("dtype,bound", [("bfloat16", 0.06), ("float16", 0.01)])  # measured 0.028, 0.0037
def test_16_bit_inference_tracks_float32(tiny, fp32_greedy, dtype, bound):
    """The tools' default dtype: a 16-bit greedy row may leave the float32 path only at a step whose HF
    top-2 margin is under MARGIN (and most steps match); until it does, each chosen token's log p is within
    `bound` (bf16 keeps 8 bits of mantissa, fp16 11) but not bit-equal: the 16-bit path really ran."""
    seqs32, margins = fp32_greedy
    model = loading.load(hf=str(tiny.path), mp=1, dp=1, dtype=dtype)
    assert {x.dtype for x in jax.tree.leaves(model.params)} == {jnp.dtype(dtype)}
    seqs16 = Generator(model.config, model.params, model.mesh).generate(PROMPTS, greedy(logprobs=1))
    same = []
    for a, b, margin in zip(seqs32, seqs16, margins):
        k = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), NEW)
        assert k == NEW or margin[k] < MARGIN, (k, margin[k])
        same.append(k)
    assert sum(same) >= 2 * NEW, same  # measured: bf16 41 of 64 steps, fp16 all 64
    lp32 = np.concatenate([s.logprobs[:k] for s, k in zip(seqs32, same)])
    lp16 = np.concatenate([s.logprobs[:k] for s, k in zip(seqs16, same)])
    assert 0 < np.abs(lp16 - lp32).max() < bound


@pytest.mark.parametrize("matvec", [False, None], ids=["inputs_first", "default"])
def test_decode_leaves_its_matmuls_to_xla_on_cpu(tiny, matvec):
    """The float32 decode program over inputs-first weights is compiled without XLA:CPU's YNNPACK dot
    fusion (slower for a decode step's few rows: `decode.DECODE_CPU_OPTIONS`); the same function
    compiled with the defaults would use it. 16 rows: up to 8 the weight products are the few-row
    kernel's (`kernels`). Over inputs-last weights (the default where `kernels.dot_kernel` runs) the
    weight products are the dot kernel's and the program keeps the defaults (XLA's own product of
    more rows with such weights is many times slower than YNNPACK's)."""
    model = loading.load(hf=str(tiny.path), mp=1, dp=1, dtype="float32")
    gen = Generator(model.config, model.params, model.mesh, matvec=matvec)
    args = (gen.params, gen.new_state(16, 32), np.int32(0), np.int32(4), 4, 32)
    ours = gen._decode.lower(*args).compile().as_text()
    if gen.inputs_last:
        assert kernels.DOT[jnp.dtype(jnp.float32)].target in ours and "ynn_fusion" in ours  # the defaults kept
        return
    default = jax.jit(gen._decode_steps, static_argnums=(4, 5, 6)).lower(*args).compile().as_text()
    assert "ynn_fusion" in default
    assert "ynn_fusion" not in ours and re.search(r"\bdot\(", ours)


def test_one_shard_decode_copies_no_logits_to_gather_them(gen):
    """With mp = 1 the logits' gather over the model-parallel shards is a one-device all-reduce
    (none at all on a one-device mesh): XLA:CPU's one-device all-gather wanted the logits column-major, so every
    step copied them into that layout and gathered them (a 64-row serving batch of the LLaMA-shaped
    benchmark model: 1.3 of 25 ms, and 1.3 more in the copies after it)."""
    assert gen.mp == 1
    hlo = gen._decode.lower(gen.params, gen.new_state(16, 32), np.int32(0), np.int32(4), 4, 32).compile().as_text()
    assert "all-gather" not in hlo
    assert f"f32[16,{gen.vocab}]{{1,0}}" in hlo and f"f32[16,{gen.vocab}]{{0,1}}" not in hlo


def test_an_admission_samples_its_own_rows_only(gen, monkeypatch):
    """Two prompts joining an 8-row batch: their first tokens are sampled from [2, V] logits (the
    admission made the batch's [8, V] and sampled every row: a 64-row serving batch's first token
    of one request at top-p 0.95 took 37 ms, now 13), and land in their rows with -1 elsewhere."""
    calls, admit = [], gen._admit
    monkeypatch.setattr(gen, "_admit", lambda *args: (calls.append(args), admit(*args))[1])
    options = SamplingOptions(max_new_tokens=4, temperature=0.7, top_p=0.9, seed=1)
    _, first, *_ = gen.admit(gen.new_state(8, 64), PROMPTS[1:3], [options] * 2, [1, 2], [5, 2], 32)
    assert list(first.token[[0, 1, 3, 4, 6, 7]]) == [-1] * 6 and min(first.token[[5, 2]]) >= 0
    program = admit.lower(*calls[0]).as_text()
    assert f"tensor<2x{gen.vocab}xf32>" in program and f"tensor<8x{gen.vocab}xf32>" not in program


def test_bf16_decode_holds_no_float32_copy_of_a_weight_or_the_cache(tiny):
    """16-bit decode keeps XLA:CPU's YNNPACK path and gathers embedding rows as integers, so its
    compiled program makes no float32 array the size of a weight: without either, XLA:CPU converts
    each bf16 weight (and the embedding table a gather reads) to float32, hoisted out of the loop
    and held for the call — twice the weights' bytes again (an 8-layer 200M model: 823 MB of
    temporaries at one row instead of 111). Nor the size of a layer's cache: the new keys and values
    are written as 16-bit integers (`layers.write_slots`) and a one-row attention's query row is
    doubled so that YNNPACK reads the bf16 cache; otherwise XLA:CPU converted every layer's cache to
    float32 each step, for the update and for the one-row matmuls (removing those copies made
    bench/decode.py's GPT-J 6-29% faster in bf16 at 16 rows on the AVX-512 EPYC)."""
    model = loading.load(hf=str(tiny.path), mp=1, dp=1, dtype="bfloat16")
    g = Generator(model.config, model.params, model.mesh)
    args = decode_args(g)
    compiled = g._decode.lower(*args).compile()
    weights = {x.size for x in jax.tree.leaves(g.params) if x.ndim >= 2 and x.dtype == jnp.bfloat16}
    f32 = {math.prod(int(d) for d in dims.split(",")) for dims in re.findall(r"= f32\[([\d,]+)\]", compiled.as_text())}
    assert weights and not weights & f32, sorted(weights & f32)
    cache = args[1].cache
    assert cache.k[0].dtype == jnp.bfloat16 and cache.k[0].size not in f32, (cache.k[0].shape, sorted(f32))
