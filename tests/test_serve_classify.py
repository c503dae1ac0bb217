"""POST /classify, /score and /rerank (vLLM's) on a served sequence classifier and reward model:
each text's (or pair's) scores are transformers' ForSequenceClassification logits (the oracle),
answered as vLLM answers them (softmax, a sigmoid for one label; raw with `use_activation:
false`), with the checkpoint's label names; a classifier's server generates nothing and holds no
KV cache, and says so on the routes that generate; device_serve.py serves one as a user starts it."""
from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys

import httpx
import jax
import numpy as np
import pytest
import torch

from mesh_transformer import loading
from mesh_transformer.config import ConfigError
from mesh_transformer.generate import SamplingOptions
from mesh_transformer.io import hf
from mesh_transformer.serve import Engine, create_app
from mesh_transformer.serve.classify import classifier
from tests.helpers import hf_classifier, one_device_env
from tests.serving import KEY, start_server
from tests.test_serve_process import ROOT, launch, wait_until_up

TEXTS = ["The quick brown fox", "Hello there", "a", "jumps over the lazy dog and the fox"]
NAMES = ["negative", "neutral", "positive"]
TOL = 1e-5
HEADERS = {"Authorization": f"Bearer {KEY}"}


def saved_classifier(tiny, path, labels: int, names=None):
    """The tiny GPT-J as transformers' GPTJForSequenceClassification (a random score head), saved to
    `path` with its tokenizer -> the torch model."""
    model = hf_classifier(tiny.torch, labels, path, names=names)
    tiny.tokenizer.save_pretrained(path)
    return model


def hf_scores(model, ids: list[int]) -> np.ndarray:
    """[labels]: transformers' logits for one text (alone: its last token is the last)."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def sigmoid(x):
    return 1 / (1 + np.exp(-np.asarray(x, np.float64)))


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.fixture(scope="module")
def sentiment(tiny, tmp_path_factory):
    """(directory, torch model, classifier Generator on one device): three named labels."""
    path = tmp_path_factory.mktemp("sentiment")
    model = saved_classifier(tiny, path, 3, NAMES)
    loaded = loading.load(hf=str(path), mp=1, dp=1, dtype="float32")
    return path, model, loaded.generator()


@pytest.fixture(scope="module")
def reward(tiny, tmp_path_factory):
    """(torch model, url): a reward model (one label) over dp 2 x mp 2, served."""
    path = tmp_path_factory.mktemp("reward")
    model = saved_classifier(tiny, path, 1)
    engine = Engine(loading.load(hf=str(path), mp=2, dp=2, dtype="float32").generator(), tiny.tokenizer).start()
    server, base = start_server(create_app(engine, model_name="rm", api_key=KEY))
    yield model, base
    server.should_exit = True


@pytest.fixture(scope="module")
def sentiment_url(sentiment, tiny):
    path, _, gen = sentiment
    engine = Engine(gen, tiny.tokenizer).start()
    server, base = start_server(create_app(engine, model_name="sentiment", api_key=KEY, labels=hf.label_names(path)))
    yield base
    server.should_exit = True


def classify(base: str, path: str = "/classify", **body) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, headers=HEADERS, timeout=60)


def test_probs_are_the_softmax_of_transformers_logits_with_the_checkpoints_labels(sentiment_url, sentiment, tiny):
    """Texts of different lengths in one request (right-padded in one pass): each one's probs are the
    softmax of transformers' logits, its label the likeliest class's name from config.json; token
    ids classify as their text does; SGLang's /v1/classify is the same route."""
    _, model, _ = sentiment
    ids = [tiny.tokenizer.encode(t) for t in TEXTS]
    r = classify(sentiment_url, model="sentiment", input=TEXTS)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["object"] == "list" and answer["id"].startswith("classify-") and answer["model"] == "sentiment"
    assert answer["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids)),
                               "completion_tokens": 0, "prompt_tokens_details": None}
    labels = set()
    for i, (d, p) in enumerate(zip(answer["data"], ids)):
        want = hf_scores(model, p)
        assert d["index"] == i and d["num_classes"] == 3 and d["label"] == NAMES[int(np.argmax(want))]
        np.testing.assert_allclose(d["probs"], softmax(want), atol=TOL)
        labels.add(d["label"])
    assert len(labels) > 1  # the head's classes differ across the texts: the labels are each text's own
    by_ids = classify(sentiment_url, "/v1/classify", input=ids).json()
    np.testing.assert_allclose([d["probs"] for d in by_ids["data"]], [d["probs"] for d in answer["data"]], atol=1e-6)
    for off in ({"use_activation": False}, {"activation": False}, {"use_activation": False, "activation": True}):
        raw = classify(sentiment_url, input=TEXTS[0], **off).json()["data"][0]  # (vLLM's older name too)
        np.testing.assert_allclose(raw["probs"], hf_scores(model, ids[0]), atol=TOL)


def test_a_reward_model_answers_the_sigmoid_and_raw_rewards_over_dp_and_mp(reward, tiny):
    """One label (a reward model, as TRL trains and vLLM serves one), on dp 2 x mp 2: probs are the
    sigmoid of transformers' reward, `activation: false` the reward itself."""
    model, base = reward
    ids = [tiny.tokenizer.encode(t) for t in TEXTS]
    want = np.array([hf_scores(model, p) for p in ids])  # [N, 1]
    assert np.ptp(want) > 0.1
    sig = classify(base, input=TEXTS).json()["data"]
    assert all(d["num_classes"] == 1 and d["label"] == "LABEL_0" for d in sig)
    np.testing.assert_allclose([d["probs"] for d in sig], sigmoid(want), atol=TOL)
    raw = classify(base, input=TEXTS, use_activation=False).json()["data"]
    np.testing.assert_allclose([d["probs"] for d in raw], want, atol=TOL)


@pytest.mark.parametrize("problem, labels", [("multi_label_classification", 4), ("regression", 1)])
def test_probs_follow_the_checkpoints_problem_type_as_transformers_pipeline(problem, labels, tiny, tmp_path):
    """A classifier whose config.json says its problem_type: a multi-label one's probs are each
    class's own sigmoid (not the softmax over them), a regression's its raw output (not its
    sigmoid, as a reward model's config, saying none, has it), as vLLM reads problem_type and as
    transformers' text-classification pipeline scores."""
    import transformers
    model = saved_classifier(tiny, tmp_path, labels)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "problem_type": problem}))
    model.config.problem_type = problem
    loaded = loading.load(hf=str(tmp_path), mp=1, dp=1, dtype="float32")
    assert loaded.config.problem_type == problem
    engine = Engine(loaded.generator(), tiny.tokenizer).start()
    server, base = start_server(create_app(engine, model_name="tags", api_key=KEY))
    try:
        answer = classify(base, input=TEXTS).json()["data"]
    finally:
        server.should_exit = True
        engine.stop()
    pipe = transformers.pipeline("text-classification", model=model, tokenizer=tiny.tokenizer, top_k=None)
    for d, text in zip(answer, TEXTS):
        scores = {x["label"]: x["score"] for x in pipe([text])[0]}
        want = [scores[f"LABEL_{i}"] for i in range(labels)]
        np.testing.assert_allclose(d["probs"], want, atol=TOL)


PROMPT = "Q: fox?"
RESPONSES = [" a small animal", " the quick brown fox", " jumps over", " a"]


def test_score_and_rerank_read_each_pair_as_one_text_as_vllm_does(reward, tiny):
    """/score of a prompt and its candidate responses (1:N, best-of-n with a reward model) and of N:N
    pairs, and /rerank of documents for a query: each pair is the second text after the first,
    encoded as one, scored as transformers scores that text (the sigmoid, or raw); /rerank sorts
    best first and keeps top_n."""
    model, base = reward
    want = np.array([hf_scores(model, tiny.tokenizer.encode(PROMPT + r))[0] for r in RESPONSES])
    assert len(set(np.argsort(-want)[:2])) == 2 and np.ptp(want) > 0.05
    r = classify(base, "/score", text_1=PROMPT, text_2=RESPONSES)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["object"] == "list" and answer["id"].startswith("score-") and answer["model"] == "rm"
    assert [(d["index"], d["object"]) for d in answer["data"]] == [(i, "score") for i in range(len(RESPONSES))]
    np.testing.assert_allclose([d["score"] for d in answer["data"]], sigmoid(want), atol=TOL)
    assert answer["usage"]["prompt_tokens"] == sum(len(tiny.tokenizer.encode(PROMPT + r)) for r in RESPONSES)
    firsts = ["a fox", "Hello", "x", "The dog"]
    raw = classify(base, "/v1/score", text_1=firsts, text_2=RESPONSES, use_activation=False).json()["data"]
    np.testing.assert_allclose([d["score"] for d in raw],
                               [hf_scores(model, tiny.tokenizer.encode(a + b))[0] for a, b in zip(firsts, RESPONSES)],
                               atol=TOL)
    ranked = classify(base, "/rerank", query=PROMPT, documents=RESPONSES, top_n=2).json()
    assert ranked["id"].startswith("rerank-") and ranked["usage"]["total_tokens"] == answer["usage"]["prompt_tokens"]
    assert [x["index"] for x in ranked["results"]] == list(np.argsort(-want)[:2])
    for x in ranked["results"]:
        assert x["document"] == {"text": RESPONSES[x["index"]]}
        assert abs(x["relevance_score"] - sigmoid(want[x["index"]])) < TOL
    every = classify(base, "/v2/rerank", query=PROMPT, documents=RESPONSES).json()["results"]
    assert [x["index"] for x in every] == list(np.argsort(-want))


@pytest.mark.parametrize("path, body, param, message", [
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1",
     "text_1: one text, or one for each of text_2's 3; got 2"),
    ("/score", {"text_1": "a", "text_2": []}, "text_2", "text_2: must not be empty"),
    ("/score", {"text_1": "a", "text_2": ["ok", " fox" * 20]}, "text_2[1]",
     "text_2[1]: 41 tokens, more than the model's context of 32"),
    ("/rerank", {"query": "a", "documents": []}, "documents", "documents: must not be empty"),
    ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n", "top_n: "),
])
def test_bad_pairs_are_a_400_naming_them(reward, path, body, param, message):
    r = classify(reward[1], path, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(message), error


def test_score_needs_one_label(sentiment_url):
    for path, body in (("/score", {"text_1": "a", "text_2": "b"}), ("/v1/rerank", {"query": "a", "documents": ["b"]})):
        r = classify(sentiment_url, path, **body)
        assert r.status_code == 400
        assert r.json()["error"]["message"] == (f"{path} scores pairs with a classifier of one label (a reward model "
                                                f"or reranker); this one has 3: use /classify")


def test_int8_weights_classify_as_transformers_on_the_weights_int8_keeps(sentiment, tiny):
    """`--quantize int8` (every matmul weight, the score head's too, int8 per output column): the
    scores are transformers' on those rounded weights (`rounded_like_int8`), not merely near the
    float ones."""
    from mesh_transformer.evaluate.scoring import Scorer
    from tests.helpers import rounded_like_int8
    path, model, _ = sentiment
    ids = [tiny.tokenizer.encode(t) for t in TEXTS]
    gen = loading.load(hf=str(path), mp=2, dp=1, dtype="float32", quantize="int8").generator()
    got = Scorer.for_generator(gen).classify(ids)
    rounded = rounded_like_int8(model)
    np.testing.assert_allclose(got, [hf_scores(rounded, p) for p in ids], atol=TOL)
    assert np.abs(got - [hf_scores(model, p) for p in ids]).max() > 10 * TOL  # (the rounding shows)


def test_requests_that_wait_together_share_one_pass(sentiment, tiny):
    """Six requests of a text each, waiting while none runs: one pass, each answered its own text's scores."""
    _, model, gen = sentiment
    passes = classifier(gen)
    ids = [tiny.tokenizer.encode(t) for t in TEXTS] + [[5, 6, 7], [9]]

    async def together():
        return await asyncio.gather(*(passes.run([p]) for p in ids))
    got = asyncio.run(together())
    assert passes.passes == 1 and all(v.shape == (1, 3) for v in got)
    np.testing.assert_allclose(np.concatenate(got), [hf_scores(model, p) for p in ids], atol=TOL)


def test_a_classifiers_engine_holds_no_kv_cache_and_its_server_refuses_to_generate(sentiment, sentiment_url, tiny):
    """Its engine adds no device buffer to the weights (no batch, no cache, no prefix pool); the routes
    that generate answer a 400 pointing to /classify (Anthropic's in its error shape)."""
    _, _, gen = sentiment
    before = sum(x.nbytes for x in jax.live_arrays())
    engine = Engine(gen, tiny.tokenizer, max_batch=16)
    assert sum(x.nbytes for x in jax.live_arrays()) == before and engine.stats()["active"] == 0
    with pytest.raises(ConfigError, match="does not generate: classify with it"):
        engine.sequence([1, 2], SamplingOptions(max_new_tokens=2), None)
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.post(f"{sentiment_url}{path}", json={"model": "sentiment", **body}, headers=HEADERS, timeout=60)
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert f"num_labels 3: a score head, no language-model head): it does not generate, so {path}" in message
        assert "POST /classify" in message
        assert (r.json().get("type") == "error") == (path == "/v1/messages")  # Anthropic's shape there


@pytest.mark.parametrize("body, param, message", [
    ({"input": []}, "input", "input: must not be empty"),
    ({"input": [[1, 2], list(range(1, 41))]}, "input[1]", "input[1]: 40 tokens, more than the model's context of 32"),
    ({"input": "ok", "activation": "yes"}, "activation", "activation: "),
])
def test_bad_input_is_a_400_naming_it(sentiment_url, body, param, message):
    r = classify(sentiment_url, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(message), error


def test_device_serve_serves_a_classifier_checkpoint_for_classify(sentiment, tiny):
    """`device_serve.py --hf DIR` of a GPTJForSequenceClassification directory, warmed up: /classify
    answers transformers' probabilities and config.json's label names."""
    path, model, _ = sentiment
    proc, base = launch(path, "--warmup", "8")
    try:
        wait_until_up(proc, base)
        r = httpx.post(f"{base}/classify", json={"input": TEXTS}, headers={"Authorization": "Bearer process-key"},
                       timeout=60)
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    assert r.status_code == 200, r.text
    for d, text in zip(r.json()["data"], TEXTS):
        want = hf_scores(model, tiny.tokenizer.encode(text))
        assert d["label"] == NAMES[int(np.argmax(want))]
        np.testing.assert_allclose(d["probs"], softmax(want), atol=TOL)
    assert proc.returncode == 0, out


def test_the_tools_say_a_classifier_does_not_generate(sentiment, capsys):
    """device_sample.py in one line; the evaluator (eval_harness.py's) before any task runs."""
    import device_sample
    from mesh_transformer.evaluate.lm import MeshLM
    with pytest.raises(ConfigError, match=r"num_labels 3\) neither generates nor scores text: lm-eval's tasks need"):
        MeshLM.from_generator(sentiment[2], None)
    assert device_sample.main(["--hf", str(sentiment[0]), "--dtype", "float32", "--prompt", "x",
                               "--max-new-tokens", "4"]) == 2
    assert capsys.readouterr().err.startswith("error: a classifier (num_labels 3: a score head, no language-model "
                                              "head) does not generate: classify with it")


# --------------------------------------------------------------------------------------------
# A language model served as a classifier of some of its tokens' logits (--classifier-from-tokens)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["qwen3_tied", "llama_gqa2_llama3_rope", "granite_tied_bias", "opt_projected"])
def test_a_language_model_classifies_by_its_tokens_logits(case, tmp_path):
    """Tied and untied heads, Granite's divided logits, OPT's projected width: two tokens score the
    second's logit minus the first's, three a label each, as transformers' causal LM's logits at
    each prompt's last token (prompts of three lengths in one pass, on mp 2)."""
    from mesh_transformer.evaluate.scoring import Scorer
    from mesh_transformer.generate import Generator
    from mesh_transformer.models.core import score_from_lm_head
    from tests.helpers import make_hf_model, mesh, random_tokens
    torch_model = make_hf_model(tmp_path, case)
    config, params = hf.load_hf(tmp_path, mp=2, compute_dtype="float32", remat="none")
    prompts = [list(row[:n]) for row, n in zip(random_tokens((3, 9), config.n_vocab, seed=1), (3, 6, 9))]
    with torch.no_grad():
        logits = np.array([torch_model(torch.tensor([p])).logits[0, -1].numpy() for p in prompts])
    for ids, want in (([4, 7], logits[:, 7:8] - logits[:, 4:5]), ([4, 7, 11], logits[:, [4, 7, 11]])):
        classifier, scored = score_from_lm_head(config, params, ids)
        assert classifier.num_labels == want.shape[1] and f"{config.family}/head" not in scored
        got = Scorer.for_generator(Generator(classifier, scored, mesh(1, 2))).classify(prompts)
        np.testing.assert_allclose(got, want, atol=TOL, err_msg=case)


@pytest.mark.parametrize("overrides, message", [
    ({"family": "gptj"}, "family 'gptj': its logits are not a linear reading of the last hidden state (a bias on "
                         "the head)"),
    ({"family": "gemma", "logit_softcap": 30.0}, "(soft-capped logits)"),
    ({"family": "llama", "ids": [3]}, "classifier tokens: two or more different tokens, got ids [3]"),
    ({"family": "llama", "ids": [3, 3]}, "two or more different tokens, got ids [3, 3]"),
    ({"family": "llama", "ids": [3, 16]}, "classifier tokens: ids [16] are outside the vocabulary of 16"),
])
def test_tokens_that_cannot_make_a_score_head_are_one_clear_error(overrides, message):
    from mesh_transformer.config import config_from_dict
    from mesh_transformer.models.core import score_from_lm_head
    ids = overrides.pop("ids", [1, 2])
    config = config_from_dict({"layers": 1, "d_model": 8, "n_heads": 1, "n_vocab": 16, "seq": 8, **overrides}).model
    with pytest.raises(ConfigError, match=re.escape(message)):
        score_from_lm_head(config, {}, ids)


def test_device_serve_reranks_with_a_language_models_yes_no_tokens(tiny, tmp_path):
    """`device_serve.py --hf DIR --classifier-from-tokens a b` on a Qwen3 causal LM: /score and
    /rerank answer the sigmoid of transformers' logit of 'b' minus that of 'a' at each pair's last
    token, and /classify names the label 'b'; a flag token of several tokens is one error line."""
    from tests.helpers import make_hf_model
    model = make_hf_model(tmp_path, "qwen3_tied", vocab_size=len(tiny.tokenizer))
    tiny.tokenizer.save_pretrained(tmp_path)
    no, yes = (tiny.tokenizer.encode(t) for t in ("a", "b"))
    bad = subprocess.run([sys.executable, "device_serve.py", "--hf", str(tmp_path), "--classifier-from-tokens",
                          "a", "quick"], cwd=ROOT, env=one_device_env(), capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith(
        "error: --classifier-from-tokens: 'quick' is "), bad.stderr
    proc, base = launch(tmp_path, "--classifier-from-tokens", "a", "b")
    try:
        wait_until_up(proc, base)
        scores = httpx.post(f"{base}/score", json={"text_1": PROMPT, "text_2": RESPONSES},
                            headers={"Authorization": "Bearer process-key"}, timeout=60).json()["data"]
        label = httpx.post(f"{base}/classify", json={"input": PROMPT}, headers={"Authorization": "Bearer process-key"},
                           timeout=60).json()["data"][0]["label"]
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    with torch.no_grad():
        last = [model(torch.tensor([tiny.tokenizer.encode(PROMPT + r)])).logits[0, -1].numpy() for r in RESPONSES]
    assert [len(no), len(yes)] == [1, 1] and label == "b"
    np.testing.assert_allclose([d["score"] for d in scores], [sigmoid(x[yes[0]] - x[no[0]]) for x in last], atol=TOL)
    assert proc.returncode == 0, out
