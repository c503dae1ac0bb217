"""Speculative decoding by prompt lookup (`generate.lookup`, `Generator(speculate=k)`): the same
tokens as decoding one at a time (transformers' greedy, and our own for every sampling option),
in fewer passes of the model where the text repeats, and the drafts it checks.

The tiny model and prompts of tests/test_generate.py: 4 prompts of 2..16 tokens, 16 new tokens.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from mesh_transformer.generate import Generator, SamplingOptions, lookup
from mesh_transformer.generate.structured import Grammar
from mesh_transformer.io import hf
from mesh_transformer.serve import Engine
from tests.helpers import NEW, ONE_CASE_PER_FAMILY, mesh
from tests.test_generate import PROMPTS, assert_matches_hf, greedy

K, NGRAM = 4, 3


@pytest.fixture(scope="module")
def speculative(tiny):
    config, params = hf.load_hf(tiny.path, mp=1, compute_dtype="float32")
    return Generator(config, params, mesh(1, 1), speculate=K, speculate_rows=4)  # the whole batch of PROMPTS


def drafts(history: list[list[int]], k: int = 3, ngram: int = NGRAM) -> list[list[int]]:
    width = 16
    padded = np.array([h + [7] * (width - len(h)) for h in history], np.int32)  # 7s past a row's end: not its text
    out = lookup.propose(jnp.asarray(padded), jnp.array([len(h) for h in history], jnp.int32), k, ngram)
    return np.asarray(out).tolist()


def test_a_draft_follows_the_latest_earlier_occurrence_of_the_longest_tail():
    assert drafts([[1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3],  # (1 2 3) twice before: the later one's 7 5 1
                   [4, 5, 6, 5],  # no earlier (6 5), an earlier (5): 6 5, then the row ends
                   [2, 8, 3, 8, 2, 8],  # (2 8) at the start beats (8) after the 3
                   [1, 2, 3],  # nothing repeats
                   [7],  # the 7s past the row's one token are not its text
                   [5, 5, 5]]) == [  # a run: it follows itself
        [7, 5, 1], [6, 5, -1], [3, 8, 2], [-1, -1, -1], [-1, -1, -1], [5, -1, -1]]
    assert drafts([[1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]], ngram=1) == [[7, 5, 1]]  # (3) alone: the same, latest


def test_tokens_kept_are_appended_to_each_rows_history_after_its_prompt():
    tokens = jnp.array([[0, 0, 11, 12], [21, 22, 23, 24]], jnp.int32)
    history = lookup.prompts(tokens, jnp.array([2, 4], jnp.int32), 8)
    assert np.asarray(history).tolist() == [[11, 12, 0, 0, 0, 0, 0, 0], [21, 22, 23, 24, 0, 0, 0, 0]]
    history, length = lookup.record(history, jnp.array([2, 4], jnp.int32), jnp.array([[5, 6, -1], [7, 8, 9]]))
    assert np.asarray(history).tolist() == [[11, 12, 5, 6, 0, 0, 0, 0], [21, 22, 23, 24, 7, 8, 9, 0]]
    assert np.asarray(length).tolist() == [4, 7]


@pytest.fixture(scope="module")
def sharded(tiny):
    config, params = hf.load_hf(tiny.path, mp=4, compute_dtype="float32")
    return Generator(config, params, mesh(2, 4), speculate=K, speculate_rows=4)


@pytest.mark.parametrize("mesh_name", ["1x1", "dp2xmp4"])
@pytest.mark.parametrize("prompts", [PROMPTS, [PROMPTS[3]] * 4], ids=["mixed", "alike"])
def test_speculative_greedy_equals_transformers(tiny, speculative, sharded, mesh_name, prompts):
    """Tokens equal generate's and log p within 1e-4 in a batch of 4 rows: rows that keep different
    numbers of drafts (all keep the fewest), and rows that all keep theirs (fewer passes than
    tokens; on dp2 x mp4 the two shards' rows agree on one advance)."""
    gen = speculative if mesh_name == "1x1" else sharded
    passes = gen.row_passes
    assert_matches_hf(tiny, gen.generate(prompts, greedy(logprobs=0)), prompts)
    if prompts[0] == prompts[-1]:
        assert gen.row_passes - passes < len(prompts) * (NEW - 1 - 3)


def expected_passes(prompt: list[int], out: list[int], k: int, ngram: int, start: int = 1) -> int:
    """Passes of the model (after the first `start` tokens: the prefill's) that prompt lookup (the
    longest tail of up to `ngram` tokens, its latest earlier occurrence) takes to produce `out`,
    written out plainly."""
    history, done, passes = list(prompt) + out[:start], start, 0
    while done < len(out):
        draft = []
        for n in range(ngram, 0, -1):
            ends = [j for j in range(n - 1, len(history) - 1) if history[j - n + 1:j + 1] == history[-n:]]
            if len(history) > n and ends:
                draft = history[ends[-1] + 1:ends[-1] + 1 + k]
                break
        matched = 0
        while matched < len(draft) and done + matched < len(out) and draft[matched] == out[done + matched]:
            matched += 1
        kept = min(matched + 1, len(out) - done)
        history += out[done:done + kept]
        done += kept
        passes += 1
    return passes


def test_a_pass_keeps_the_drafted_tokens_the_model_chooses(tiny, speculative):
    """One pass per decode call (chunk 1): as many passes as drafting by hand over transformers'
    tokens predicts, fewer than the tokens where the output repeats itself."""
    counted = []
    for prompt in PROMPTS:
        [seq], passes = speculative.sequences([prompt], greedy()), speculative.row_passes
        calls = sum(1 for _ in speculative.stream([seq], chunk=1)) - 1
        expected, _ = tiny.hf_greedy(prompt)
        assert seq.tokens == expected
        assert calls == expected_passes(prompt, expected, K, NGRAM) == speculative.row_passes - passes, prompt
        counted.append(calls)
    assert min(counted) < NEW - 1 - 3  # one output's loop saves passes (the model repeats itself)


def test_speculation_is_for_calls_of_few_rows(tiny):
    """By default (speculate_rows 1) a batch of 4 decodes a token a pass, a lone prompt by drafts."""
    config, params = hf.load_hf(tiny.path, mp=1, compute_dtype="float32")
    gen = Generator(config, params, mesh(1, 1), speculate=K)
    assert_matches_hf(tiny, gen.generate(PROMPTS, greedy(logprobs=0)), PROMPTS)
    assert gen.row_passes == len(PROMPTS) * (NEW - 1)
    [alone] = gen.generate(PROMPTS[3:], greedy())
    assert alone.tokens == tiny.hf_greedy(PROMPTS[3])[0]
    assert gen.row_passes - len(PROMPTS) * (NEW - 1) == expected_passes(PROMPTS[3], alone.tokens, K, NGRAM) < NEW - 1


def test_a_row_drafts_from_the_tokens_it_made_among_more_rows(tiny):
    """A row that decoded beside another (a token a pass: more rows than `speculate_rows`) drafts
    from all of its text once alone: its history took those tokens too."""
    config, params = hf.load_hf(tiny.path, mp=1, compute_dtype="float32")
    gen = Generator(config, params, mesh(1, 1), speculate=K)
    seqs = gen.sequences([PROMPTS[3], PROMPTS[0]], [greedy(), SamplingOptions(max_new_tokens=4, temperature=0.0)])
    calls = sum(1 for _ in gen.stream(seqs, chunk=1)) - 1
    assert seqs[0].tokens == tiny.hf_greedy(PROMPTS[3])[0]
    assert calls == 3 + expected_passes(PROMPTS[3], seqs[0].tokens, K, NGRAM, start=4)
    assert gen.row_passes == 2 * 3 + calls - 3


def options_cases(tiny, reference: list[list[int]]) -> list[SamplingOptions]:
    sampled = dict(max_new_tokens=NEW, temperature=1.0, top_p=0.9, seed=11)
    return [SamplingOptions(**sampled, logprobs=2),
            greedy(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2),
            greedy(eos_token_id=reference[2][5], logit_bias=((reference[2][0], -100.0),), min_new_tokens=3),
            greedy(stop=(tiny.tokenizer.decode(reference[3][9:11]),), stop_token_ids=(tuple(reference[3][12:14]),)),
            SamplingOptions(max_new_tokens=NEW, temperature=0.0, grammar=Grammar.regex(r"(ab ){5}\.")),  # drafts would match
            SamplingOptions(**{**sampled, "seed": 5}, top_k=20, min_p=0.05)]


def test_every_sampling_option_decodes_as_one_token_at_a_time(tiny, gen, speculative):
    """Each request alone (so that it drafts): sampled rows (a token's draw depends on its seed and
    index only), penalties, logit bias, min_new_tokens, EOS, stop strings and stop sequences, a
    grammar (its row drafts nothing: its mask is one token ahead), log-probabilities: the same
    tokens, finish and text as decoding a token at a time, in fewer passes."""
    reference = [s.tokens for s in gen.generate(PROMPTS, greedy())]
    cases = list(zip(PROMPTS + PROMPTS[:2], options_cases(tiny, reference)))
    passes = speculative.row_passes
    ours = [speculative.generate([p], o, tiny.tokenizer)[0] for p, o in cases]
    theirs = [gen.generate([p], o, tiny.tokenizer)[0] for p, o in cases]
    for a, b in zip(ours, theirs):
        assert (a.tokens, a.finish_reason, a.text) == (b.tokens, b.finish_reason, b.text)
    np.testing.assert_allclose(ours[0].logprobs, theirs[0].logprobs, atol=1e-5)
    assert [[i for i, _ in top] for top in ours[0].top_logprobs] == [[i for i, _ in top] for top in theirs[0].top_logprobs]
    assert ours[3].finish_reason == ours[4].finish_reason == "stop"
    assert speculative.row_passes - passes < sum(len(s.tokens) - 1 for s in ours) - 3  # drafts were kept


def test_a_guided_row_drafts_nothing(tiny, speculative):
    """A grammar's mask is the next token's only (the host computes it from the tokens so far), so
    a row under one keeps a token a pass even where its text repeats and drafts would match."""
    options = SamplingOptions(max_new_tokens=NEW, temperature=0.0, grammar=Grammar.regex(r"(ab ){5}\."))
    [seq] = speculative.sequences([PROMPTS[0]], options, tiny.tokenizer)
    counts = [len(seq.tokens) for _ in speculative.stream([seq], chunk=4)]
    assert seq.text == "ab ab ab ab ab ." and counts == list(range(1, len(seq.tokens) + 1))


def test_a_speculative_server_answers_as_transformers(tiny):
    """An Engine over a speculating generator (its cache's rows have room for the drafts past the
    context): requests joining one batch at once, one with prompt and output filling the whole
    context; then a request alone, in fewer passes, as /metrics counts; then two behind one prefix,
    the second reading 7 of its tokens from the prefix cache's pool as it decodes (4-token blocks).
    Each gets transformers' greedy tokens. A batch-invariant one is refused (a request's passes
    would depend on whether it ran alone)."""
    config, params = hf.load_hf(tiny.path, mp=1, compute_dtype="float32")
    gen = Generator(config, params, mesh(1, 1), speculate=2, speculate_rows=4)
    with pytest.raises(ValueError, match="batch_invariant with a speculating generator"):
        Engine(gen, tiny.tokenizer, max_batch=4, batch_invariant=True)
    engine = Engine(gen, tiny.tokenizer, max_batch=4, chunk=4, prefix_block=4).start()
    metric = lambda name: engine.metrics.registry.get_sample_value(f"mesh_transformer_{name}_total")  # noqa: E731
    full = list(range(40, 56))
    prompts, new = PROMPTS[:3] + [full], [NEW] * 3 + [config.seq - len(full)]
    try:
        assert engine.batch.slots == config.seq + 2 and engine.context == config.seq
        seqs = [engine.sequence(p, SamplingOptions(max_new_tokens=n, temperature=0.0), None)
                for p, n in zip(prompts, new)]
        request = engine.submit(seqs)
        while not request.finished:
            request.updated.wait()
            request.updated.clear()
        tokens, passes = metric("generation_tokens"), metric("decode_row_passes")
        alone = engine.generate(PROMPTS[3], greedy())
        alone_tokens, alone_passes = metric("generation_tokens") - tokens, metric("decode_row_passes") - passes
        counted = engine.gen.row_passes - passes
        prefix, eight = list(range(60, 80)), SamplingOptions(max_new_tokens=8, temperature=0.0)
        behind = [engine.generate(prefix + tail, eight) for tail in ([5, 6], [7, 8, 9])]
    finally:
        engine.stop()
    assert [s.tokens for s in seqs] == [tiny.hf_greedy(p, n)[0] for p, n in zip(prompts, new)]
    assert len(seqs[3].tokens) == config.seq - len(full) and seqs[3].finish_reason == "length"
    assert tokens == sum(len(s.tokens) for s in seqs)
    assert alone.tokens == tiny.hf_greedy(PROMPTS[3])[0]
    assert alone_tokens == NEW and alone_passes == counted < NEW - 1 - 3
    assert [s.tokens for s in behind] == [tiny.hf_greedy(prefix + tail, 8)[0] for tail in ([5, 6], [7, 8, 9])]
    assert [s.cached_tokens for s in behind] == [0, 7]  # (a prefill computes 16 tokens at least)


@pytest.mark.parametrize("rows", [1, 2], ids=["speculate_rows1", "speculate_rows2"])
def test_a_speculating_servers_warm_up_compiles_what_its_traffic_decodes_with(tiny, monkeypatch, rows):
    """A call of 1 row drafts; of 2 rows, with --speculate-rows 1, never (its second row's drafts
    would cost compute: a request alone in row 1 once row 0's ended decodes a token a pass), with
    --speculate-rows 2 always: warm-up compiles a program for each rows bucket and window (16, 32
    and 34 slots), and no traffic after it compiles a decode program."""
    from mesh_transformer import host_memory
    monkeypatch.setattr(host_memory, "memory_maps", lambda: (0, 65530))  # the suite's own maps kept out
    config, params = hf.load_hf(tiny.path, mp=1, compute_dtype="float32")
    gen = Generator(config, params, mesh(1, 1), speculate=2, speculate_rows=rows)
    engine = Engine(gen, tiny.tokenizer, max_batch=2, chunk=4, prefix_cache_tokens=0)
    engine.warmup((16,))
    warmed = gen.compiled["decode"]
    assert warmed == 2 * 3
    engine.start()
    try:
        short, long = (engine.sequence(p, SamplingOptions(max_new_tokens=n, temperature=0.0), None)
                       for p, n in ((PROMPTS[0], 3), (PROMPTS[3], NEW)))
        request = engine.submit([short, long])  # rows 0 and 1; row 1 alone after 2 passes
        while not request.finished:
            request.updated.wait()
            request.updated.clear()
        passes = gen.row_passes
        alone = engine.generate(PROMPTS[3], greedy())
    finally:
        engine.stop()
    assert long.tokens == alone.tokens == tiny.hf_greedy(PROMPTS[3])[0]
    assert gen.compiled["decode"] == warmed
    assert gen.row_passes - passes < NEW - 1 - 3  # alone in row 0: it drafted


@pytest.mark.parametrize("case", ONE_CASE_PER_FAMILY)
def test_every_family_decodes_by_drafts_as_transformers(case, tmp_path):
    """A case of each family (sliding windows, soft caps, mixtures, GQA, ALiBi-free rope variants,
    learned positions): a prompt that repeats itself, so its passes check drafts from the first,
    gives transformers' greedy tokens."""
    from tests.helpers import hf_greedy, make_hf_model
    model = make_hf_model(tmp_path, case)
    config, params = hf.load_hf(tmp_path, mp=1, compute_dtype="float32")
    gen = Generator(config, params, mesh(1, 1), speculate=K)
    prompt = [5, 6, 7, 8, 9, 10] * 4
    [seq] = gen.generate([prompt], SamplingOptions(max_new_tokens=NEW, temperature=0.0))
    assert seq.tokens == hf_greedy(model, prompt, NEW)


def test_learned_positions_past_the_context_keep_nothing_of_the_drafts(tmp_path):
    """GPT-2's position table ends at the context; a pass near the end feeds drafts past it (kept
    never: the row ends on length first). They take the table's last row: transformers' tokens
    up to the context's last position (an index past the table read NaN, which reached the kept
    position's logits through the masked slots)."""
    from tests.helpers import hf_greedy, make_hf_model
    model = make_hf_model(tmp_path, "gpt2")
    config, params = hf.load_hf(tmp_path, mp=1, compute_dtype="float32")
    gen = Generator(config, params, mesh(1, 1), speculate=K)
    prompt = [5, 6, 7, 8] * 12 + [5, 6]  # 50 of its 64 positions: drafts from the first pass on
    assert config.seq == 64
    [seq] = gen.generate([prompt], SamplingOptions(max_new_tokens=config.seq - len(prompt), temperature=0.0))
    assert seq.tokens == hf_greedy(model, prompt, config.seq - len(prompt))
    assert gen.row_passes < len(seq.tokens) - 1
