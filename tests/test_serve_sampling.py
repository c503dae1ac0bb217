"""Sampling over HTTP equals sampling in the library: seeds, temperature, top-k/top-p, penalties,
logprobs and finish reasons, through /v1/completions (the official openai client) and /complete.

The oracle for every sampled text is `Generator.generate` on the same tiny model with the same
SamplingOptions (the server gives choice j of a request the seed `seed + j`); for log-probabilities
it is Hugging Face's `log_softmax` over the torch model's logits.
"""
from __future__ import annotations

import dataclasses

import httpx
import numpy as np
import pytest
import torch

from mesh_transformer.generate import SamplingOptions
from mesh_transformer.serve import Engine, create_app
from tests.test_serve import start_server

KEY = "sampling-key"
ROWS = 4  # the compiled batch of the shared `gen` fixture; the library oracle runs full batches


@pytest.fixture(scope="module")
def url(gen, tiny):
    engine = Engine(gen, tiny.tokenizer, max_batch=ROWS, chunk=4, max_queue=256).start()
    server, base = start_server(create_app(engine, model_name="tiny", api_key=KEY))
    yield base
    server.should_exit = True
    engine.stop()


@pytest.fixture(scope="module")
def client(url):
    from openai import OpenAI
    return OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


def library(gen, tiny, prompts: list[str], options: list[SamplingOptions]) -> list:
    """Sequences from Generator.generate, one row per (prompt, options), ROWS rows per call."""
    rows = [(tiny.tokenizer.encode(p), dataclasses.replace(o, eos_token_id=tiny.eos)) for p, o in zip(prompts, options)]
    out = []
    for i in range(0, len(rows), ROWS):
        group = rows[i:i + ROWS]
        padded = group + [group[0]] * (ROWS - len(group))
        seqs = gen.generate([ids for ids, _ in padded], [o for _, o in padded], tiny.tokenizer)
        out += seqs[: len(group)]
    return out


def test_n_choices_with_a_seed_are_the_librarys_per_row_seeded_samples(client, gen, tiny):
    prompts = ["The quick", "Pack my"]
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=12, temperature=1.0, n=3, seed=41)
    options = [SamplingOptions(max_new_tokens=12, temperature=1.0, seed=41 + j) for j in range(3)]
    expected = library(gen, tiny, [p for p in prompts for _ in range(3)], options * 2)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [s.text for s in expected]
    for k in range(2):  # the three choices of one prompt are three different samples
        assert len({c.text for c in r.choices[3 * k: 3 * k + 3]}) == 3


SETTINGS = [  # the last key of each changes the library's output for these prompts and seed (asserted below)
    {"temperature": 0.3},
    {"temperature": 1.5, "top_p": 0.5},
    {"temperature": 1.5, "top_k": 3},
    {"temperature": 1.5, "min_p": 0.3},
    {"temperature": 0.3, "frequency_penalty": 2.0},  # at 0.3 rows repeat tokens, so penalties bite
    {"temperature": 0.3, "presence_penalty": 2.0},
    {"temperature": 0.3, "repetition_penalty": 1.8},
]
PROMPTS = ["How vexingly", "def main", "The lazy dog", "0123"]
EXTENSIONS = ("top_k", "min_p", "repetition_penalty")  # vLLM's fields the openai client sends in extra_body


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_sampling_options_over_v1_completions_equal_the_librarys(client, gen, tiny, setting):
    r = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=16, seed=5,
                                  extra_body={k: v for k, v in setting.items() if k in EXTENSIONS},
                                  **{k: v for k, v in setting.items() if k not in EXTENSIONS})
    ours = library(gen, tiny, PROMPTS, [SamplingOptions(max_new_tokens=16, seed=5, **setting)] * len(PROMPTS))
    assert [c.text for c in r.choices] == [s.text for s in ours]
    # The last key matters: without it (same seed) the library's text is different.
    without = dict(list(setting.items())[:-1])
    baseline = library(gen, tiny, PROMPTS, [SamplingOptions(max_new_tokens=16, seed=5, **without)] * len(PROMPTS))
    assert [s.text for s in baseline] != [s.text for s in ours]


def test_logit_bias_over_v1_completions_equals_the_librarys(client, gen, tiny):
    """OpenAI's {"token id": bias}: the greedy tokens it rules out never come, a boost takes over."""
    plain = library(gen, tiny, PROMPTS, [SamplingOptions(max_new_tokens=8, temperature=0)] * len(PROMPTS))
    ruled_out = {s.tokens[0] for s in plain}
    bias = {**{str(t): -100 for t in ruled_out}, "97": 4.5}
    r = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=8, temperature=0, logit_bias=bias)
    options = SamplingOptions(max_new_tokens=8, temperature=0, logit_bias=tuple((int(t), b) for t, b in bias.items()))
    ours = library(gen, tiny, PROMPTS, [options] * len(PROMPTS))
    assert [c.text for c in r.choices] == [s.text for s in ours]
    assert not any(ruled_out & set(s.tokens) for s in ours) and [s.text for s in ours] != [s.text for s in plain]


def test_original_complete_endpoint_passes_temp_top_k_top_p_and_length(url, gen, tiny):
    """/complete has no seed: a very hot temperature with top_k=1, or with a tiny nucleus, must still be
    the greedy text; at temp 0 it is greedy whatever top_p says; `length` is the token count."""
    headers = {"Authorization": f"Bearer {KEY}"}
    [greedy] = library(gen, tiny, ["Pack my box"], [SamplingOptions(max_new_tokens=10, temperature=0.0)])
    assert len(greedy.tokens) == 10
    hot = library(gen, tiny, ["Pack my box"] * ROWS, [SamplingOptions(max_new_tokens=10, temperature=50.0, seed=s)
                                                       for s in range(ROWS)])
    assert all(s.text != greedy.text for s in hot)  # so only top_k / top_p can bring it back
    for body in ({"temp": 50.0, "top_p": 1.0, "top_k": 1}, {"temp": 50.0, "top_p": 1e-6}, {"temp": 0.0, "top_p": 0.9}):
        r = httpx.post(f"{url}/complete", json={"context": "Pack my box", "length": 10, **body}, headers=headers,
                       timeout=120)
        assert r.status_code == 200 and r.json()["completion"] == greedy.text, body


def hf_top_logprobs(tiny, prompt: list[int], tokens: list[int], k: int) -> list[dict]:
    """{decoded token: log p} of the k most likely next tokens at each generated position, from torch."""
    with torch.no_grad():
        logits = tiny.torch(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: len(prompt) + len(tokens) - 1]
    values, ids = torch.log_softmax(logits.double(), -1).topk(k, -1)
    return [{tiny.tokenizer.decode([i]): v for i, v in zip(row_ids.tolist(), row.tolist())}
            for row_ids, row in zip(ids, values)]


@pytest.mark.parametrize("k", [1, 5])
def test_top_logprobs_are_hfs_log_softmax_top_k(client, tiny, k):
    prompt = tiny.tokenizer.encode("The quick brown")
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=k).choices[0]
    tokens, chosen = tiny.hf_greedy(prompt, new=12)
    assert r.logprobs.tokens == [tiny.tokenizer.decode([t]) for t in tokens]
    expected = hf_top_logprobs(tiny, prompt, tokens, k)
    assert len(r.logprobs.top_logprobs) == len(expected) == 12
    for ours, theirs in zip(r.logprobs.top_logprobs, expected):
        assert list(ours) == list(theirs)  # the same tokens, most likely first (byte pieces decoding to
        # the same text collapse into one key the same way on both sides)
        np.testing.assert_allclose(list(ours.values()), list(theirs.values()), atol=1e-4)
    np.testing.assert_allclose(r.logprobs.token_logprobs, chosen, atol=1e-4)


def test_finish_reasons_are_exact(client, tiny):
    kw = {"model": "tiny", "prompt": "How vexingly", "max_tokens": 12, "temperature": 0}
    r = client.completions.create(**kw)
    full = r.choices[0]
    assert (full.finish_reason, r.usage.completion_tokens) == ("length", 12)
    stop = next(full.text[i:i + 2] for i in range(3, len(full.text)) if full.text[i:i + 2].isprintable()
                and "\ufffd" not in full.text[i:i + 2])
    stopped = client.completions.create(stop=[stop], **kw).choices[0]
    assert (stopped.finish_reason, stopped.text) == ("stop", full.text[: full.text.index(stop)])
