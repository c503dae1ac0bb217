"""Prefix caching: prompts sharing a start with earlier ones read its keys/values instead of computing
them, with the same outputs as without the cache (GPT-J and a GQA LLaMA on mp=2), LRU-bounded,
reported by /health and /metrics."""
from __future__ import annotations

import httpx
import numpy as np
import pytest

from mesh_transformer.generate import Batch, SamplingOptions
from mesh_transformer.generate.prefix import PrefixCache
from tests.helpers import mesh, random_tokens
from tests.serving import client, engine, url, wait_idle  # noqa: F401

BLOCK = 4  # small blocks: the tiny models' contexts are 32 and 64 tokens


@pytest.fixture(scope="module")
def llama_gen(tmp_path_factory):
    """A random tiny LLaMA with 4 query and 2 kv heads (the pool is sized by kv heads), on mp=2."""
    from mesh_transformer.generate import Generator
    from mesh_transformer.io import hf
    from tests.helpers import make_hf_model
    path = tmp_path_factory.mktemp("llama_gqa")
    make_hf_model(path, "llama_gqa2_llama3_rope")
    config, params = hf.load_hf(path, compute_dtype="float32", remat="none")
    return Generator(config, hf.pad_vocab(params, config, config.padded_vocab(2)), mesh(1, 2))


@pytest.fixture(scope="module")
def window_gen(tmp_path_factory):
    """A random tiny Mistral whose 16-token sliding window is shorter than a shared prefix, on mp=2."""
    from mesh_transformer.generate import Generator
    from mesh_transformer.io import hf
    from tests.helpers import make_hf_model
    path = tmp_path_factory.mktemp("mistral_window")
    make_hf_model(path, "mistral_window", sliding_window=16)
    config, params = hf.load_hf(path, compute_dtype="float32", remat="none")
    assert config.window == 16
    return Generator(config, hf.pad_vocab(params, config, config.padded_vocab(2)), mesh(1, 2))


@pytest.fixture(scope="module")
def sinks_gen(tmp_path_factory):
    """A random tiny GPT-OSS (attention sinks, a 16-token window in one layer of two), on mp=2."""
    from mesh_transformer.generate import Generator
    from mesh_transformer.io import hf
    from tests.helpers import make_hf_model
    path = tmp_path_factory.mktemp("gpt_oss")
    make_hf_model(path, "gpt_oss_window_yarn", sliding_window=16)
    config, params = hf.load_hf(path, compute_dtype="float32", remat="none")
    assert config.window == 16 and config.windowed_layers() == (True, False)
    return Generator(config, hf.pad_vocab(params, config, config.padded_vocab(2)), mesh(1, 2))


@pytest.fixture(scope="module")
def gptj_dp2_gen(tmp_path_factory):
    """A random tiny GPT-J with a 96-token context (room for a prefix longer than one prefill), on dp=2."""
    from mesh_transformer.generate import Generator
    from mesh_transformer.io import hf
    from tests.helpers import make_hf_gptj
    path = tmp_path_factory.mktemp("gptj_96")
    make_hf_gptj(path, n_positions=96)
    config, params = hf.load_hf(path, compute_dtype="float32", remat="none")
    return Generator(config, hf.pad_vocab(params, config, config.padded_vocab(1)), mesh(2, 1))


def one_by_one(gen, prompts, options, prefix):
    """Each prompt run alone (with its options) through a 2-row Batch, so later prompts can hit what
    earlier ones stored."""
    batch = Batch(gen, 2, gen.config.seq, 4, prefix)
    out = []
    for p, o in zip(prompts, options):
        [seq] = gen.sequences([p], o)
        batch.admit([seq])
        while batch.active():
            batch.step()
        out.append(seq)
    return out


@pytest.mark.parametrize("model", ["gptj", "llama_gqa_mp2"])
def test_prefix_cache_changes_no_output(model, gen, llama_gen):
    """Greedy and seeded sampling (with a repetition penalty: the prompt's tokens count even where they
    were read from the cache) give the same tokens and log-probabilities with the cache as without."""
    g = gen if model == "gptj" else llama_gen
    vocab, context = g.config.n_vocab, g.config.seq
    shared = random_tokens((1, context // 2 - 3), vocab, seed=1)[0].tolist()
    tails = [random_tokens((1, n), vocab, seed=10 + n)[0].tolist() for n in (2, 5, 1, 3)]
    prompts = [shared + tails[0], shared + tails[1], shared[:9] + tails[2], shared + tails[0] + tails[3]]
    new = context // 2 - 4
    greedy = SamplingOptions(max_new_tokens=new, temperature=0.0, logprobs=2)
    sampled = SamplingOptions(max_new_tokens=new, temperature=0.9, top_p=0.95, seed=7, repetition_penalty=1.3,
                              logprobs=0)
    options = [greedy, sampled, greedy, sampled]
    plain = one_by_one(g, prompts, options, None)
    prefix = PrefixCache(g, 64 * BLOCK, BLOCK)
    cached = one_by_one(g, prompts, options, prefix)
    # prompts 2 and 4 found the shared prompt's full blocks, prompt 3 its first 2 (its 10th token is new)
    assert prefix.hits == 2 * (len(shared) // BLOCK * BLOCK) + 2 * BLOCK
    for a, b in zip(plain, cached):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)
        assert a.top_logprobs == [[(i, pytest.approx(p, abs=2e-5)) for i, p in row] for row in b.top_logprobs]


def staggered(gen, prompts, options, prefix, share=True, pool_pressure=None):
    """prompts[0] alone (it stores the shared blocks), then the others joining a 4-row batch one
    decode call apart (then `pool_pressure`, while they run) -> (sequences, the pool slots the running
    rows read and the window's size once all have joined)."""
    batch = Batch(gen, 4, gen.config.seq, 2, prefix, share_prefix=share)
    seqs = [gen.sequences([p], o)[0] for p, o in zip(prompts, options)]
    batch.admit(seqs[:1])
    while batch.active():
        batch.step()
    for seq in seqs[1:]:
        batch.admit([seq])
        batch.step()
    shared, window = len(batch._shared_slots()), batch._window()[1]
    if pool_pressure:
        batch.admit(gen.sequences([pool_pressure], options[0]))
    while batch.active():
        batch.step()
    return seqs, shared, window


@pytest.mark.parametrize("model", ["gptj_dp2", "llama_gqa_mp2", "mistral_window_mp2", "gpt_oss_sinks_mp2"])
def test_rows_reading_the_pool_decode_as_with_their_own_copies(model, gptj_dp2_gen, llama_gen, window_gen, sinks_gen):
    """Rows behind one cached prefix read its blocks from the pool as they decode, all rows at once
    (`SharedPrefix`): the same tokens and log-probabilities as rows holding copies of it and as no
    prefix cache at all, with fewer own slots to attend to; the blocks stay pinned while read and
    are released after; a prompt that needs room meanwhile evicts only blocks no row reads. With a
    sliding window shorter than the prefix, each query sees only the prefix slots in its window;
    with attention sinks, each head's sink joins the one softmax over the prefix's slots and the row's."""
    g = {"gptj_dp2": gptj_dp2_gen, "llama_gqa_mp2": llama_gen, "mistral_window_mp2": window_gen,
         "gpt_oss_sinks_mp2": sinks_gen}[model]
    vocab, context = g.config.n_vocab, g.config.seq
    shared = random_tokens((1, (context - 24) // BLOCK * BLOCK), vocab, seed=2)[0].tolist()
    tails = [random_tokens((1, n), vocab, seed=20 + n)[0].tolist() for n in (2, 5, 3, 1)]
    prompts = [shared + t for t in tails]
    greedy = SamplingOptions(max_new_tokens=10, temperature=0.0, logprobs=1)
    sampled = SamplingOptions(max_new_tokens=10, temperature=0.9, seed=3, repetition_penalty=1.3, logprobs=0)
    options = [greedy, sampled, greedy, sampled]
    other = random_tokens((1, len(prompts[0])), vocab, seed=99)[0].tolist()  # no block in common
    plain, _, _ = staggered(g, prompts, options, None)
    copies, none_read, copied_window = staggered(g, prompts, options, PrefixCache(g, 64 * BLOCK, BLOCK), share=False)
    room = len(shared) // BLOCK + 1  # the shared blocks and one more
    prefix = PrefixCache(g, room * BLOCK, BLOCK)
    reading, read, window = staggered(g, prompts, options, prefix, pool_pressure=other)
    assert none_read == 0 and read >= len(shared) - 16 and window < copied_window
    for a, b, c in zip(plain, copies, reading):
        assert a.tokens == b.tokens == c.tokens
        np.testing.assert_allclose(c.logprobs, a.logprobs, atol=2e-5)
        np.testing.assert_allclose(c.logprobs, b.logprobs, atol=2e-5)
    assert prefix.evictions > 0 and prefix.stats()["shared_tokens"] == 0  # every reader ended: nothing pinned
    read_blocks = -(-read // BLOCK)
    assert prefix.cached_tokens(prompts[1]) >= read_blocks * BLOCK  # never evicted while read
    longest = random_tokens((1, room * BLOCK), vocab, seed=98)[0].tolist()
    assert len(prefix.plan([longest]).new[0]) == room  # unpinned, every block is the LRU's to give again


def test_table_evicts_least_recently_used_leaves_first(gen):
    """3 blocks of room: a new prompt evicts the oldest chain's leaf before its root, so the root still
    hits; a block every prompt of one admission needs is stored once; `forget` frees what a failed
    admission reserved."""
    cache = PrefixCache(gen, 3 * BLOCK + 1, BLOCK)
    assert cache.tokens == 3 * BLOCK
    a, b = list(range(1, 10)), list(range(100, 109))  # 2 full blocks each (+1 token)
    first = cache.plan([a, a])
    assert first.cached == [0, 0] and [len(n) for n in first.new] == [2, 0]  # the second chains through the first
    assert cache.plan([a]).cached == [8]
    second = cache.plan([b])  # 1 free block, then evicts a's leaf (a's root was touched after it)
    assert second.cached == [0] and len(second.new[0]) == 2 and cache.evictions == 1
    assert cache.plan([a]).cached == [BLOCK]
    assert cache.stats()["cached_tokens"] == 3 * BLOCK
    cache.forget(second)
    assert cache.plan([b]).cached == [0] and cache.stats()["cached_tokens"] == 3 * BLOCK


def test_served_prefix_hits_in_health_and_metrics(client, url, engine, tiny):
    """The default server cache (16-token blocks): a 20-token prompt sent twice hits 16 tokens the
    second time, with the same answer; /health and /metrics count it."""
    wait_idle(engine)
    before = httpx.get(f"{url}/health").json()["prefix_cache"]
    prompt = random_tokens((1, 20), tiny.tokenizer.vocab_size, seed=5)[0].tolist()
    first, again = (client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, logprobs=1)
                    .choices[0].logprobs for _ in range(2))
    assert again.tokens == first.tokens
    np.testing.assert_allclose(again.token_logprobs, first.token_logprobs, atol=2e-5)
    after = httpx.get(f"{url}/health").json()["prefix_cache"]
    assert after["block_tokens"] == 16 and after["capacity_tokens"] > 0
    assert after["hit_tokens"] - before["hit_tokens"] == 16
    assert after["queried_tokens"] - before["queried_tokens"] == 40
    metrics = httpx.get(f"{url}/metrics").text
    hits = float(metrics.split("\nmesh_transformer_prefix_cache_hits_total ")[1].split()[0])
    assert hits == after["hit_tokens"]


def test_warmup_compiles_prefills_behind_a_cached_prefix(llama_gen, monkeypatch):
    """`Engine.warmup(shared_prefix=P)` compiles what prompts of P shared tokens plus a warmed length
    take: the first one (nothing cached yet), then 1 and 2 at a time reading the cached blocks. Those
    requests then compile nothing (a compile stalls every running row for seconds). (The test
    process's own memory maps, which the whole suite's programs fill, are kept out of it: warm-up
    stops near their limit, see tests/test_generate.py.)"""
    from mesh_transformer import host_memory
    from mesh_transformer.serve import Engine
    monkeypatch.setattr(host_memory, "memory_maps", lambda: (0, 65530))
    engine = Engine(llama_gen, None, max_batch=2, chunk=4, prefix_cache_tokens=64 * BLOCK, prefix_block=BLOCK)
    engine.warmup((5,), shared_prefix=8 * BLOCK)
    compiled = set(llama_gen.shapes)
    vocab = llama_gen.config.n_vocab
    shared = random_tokens((1, 8 * BLOCK), vocab, seed=3)[0].tolist()
    options = SamplingOptions(max_new_tokens=3, temperature=0.0)
    hits = engine.batch.prefix.hits
    for n, seed in ((1, 4), (1, 5), (2, 6)):
        own = random_tokens((n, 5), vocab, seed=seed).tolist()
        engine.batch.admit(llama_gen.sequences([shared + tail for tail in own], options))
        while engine.batch.active():
            engine.batch.step()
    assert engine.batch.prefix.hits - hits == 3 * 8 * BLOCK  # the 2nd, 3rd and 4th prompt read the prefix
    assert set(llama_gen.shapes) == compiled, set(llama_gen.shapes) - compiled
