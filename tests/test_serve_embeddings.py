"""POST /v1/embeddings through the official openai client and plain HTTP: a text's vector is
transformers' final hidden states (`base_model(...).last_hidden_state`, the oracle) pooled as the
server was started, and bad input is a 400 naming the input at fault."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch

from mesh_transformer.serve import create_app
from tests.serving import KEY, client, engine, start_server, url  # noqa: F401 - fixtures

TEXTS = ["The quick brown fox", "Hello there", "a"]
TOL = 1e-5


def hf_states(tiny, ids: list[int]) -> np.ndarray:
    """[T, D]: transformers' final hidden states of one text (after the final norm)."""
    with torch.no_grad():
        return tiny.torch.base_model(torch.tensor([ids])).last_hidden_state[0].numpy()


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def test_vectors_are_transformers_last_token_state_normalised(client, tiny):
    """The default (last token, L2-normalised) as the openai client asks for it (base64, decoded by
    the client), for strings and for token ids; `float` sends the same float32 values."""
    ids = [tiny.tokenizer.encode(t) for t in TEXTS]
    answer = client.embeddings.create(model="tiny", input=TEXTS)
    assert answer.model == "tiny" and [d.index for d in answer.data] == [0, 1, 2]
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(map(len, ids))
    for d, p in zip(answer.data, ids):
        assert len(d.embedding) == 32 and abs(np.linalg.norm(d.embedding) - 1) < 1e-6
        np.testing.assert_allclose(d.embedding, unit(hf_states(tiny, p)[-1]), atol=TOL)
    floats = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    assert [d.embedding for d in floats.data] == [d.embedding for d in answer.data]
    one = client.embeddings.create(model="tiny", input=TEXTS[1], dimensions=32)
    assert one.data[0].embedding == answer.data[1].embedding and one.usage.prompt_tokens == len(ids[1])


def test_requests_that_wait_together_share_one_pass(engine, tiny):
    """Eight requests of a text each, waiting while none runs: one pass of eight rows, each request
    answered its own text's vector (transformers' last state, normalised)."""
    import asyncio

    from mesh_transformer.serve.embeddings import embedder as passes
    embedder = passes(engine.gen, "last", True)
    ids = [tiny.tokenizer.encode(t) for t in TEXTS] + [[5, 6, 7], [9], [10, 11], [12, 13, 14, 15], [16]]

    async def together():
        return await asyncio.gather(*(embedder.run([p]) for p in ids))
    got = asyncio.run(together())
    assert embedder.passes == 1 and all(v.shape == (1, 32) for v in got)
    np.testing.assert_allclose(np.concatenate(got), [unit(hf_states(tiny, p)[-1]) for p in ids], atol=TOL)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_pooling_and_normalizing_are_the_servers_settings(engine, tiny, pooling):
    server, base = start_server(create_app(engine, model_name="tiny", api_key=KEY, embedding_pooling=pooling,
                                           embedding_normalize=False))
    try:
        r = httpx.post(f"{base}/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64"},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    finally:
        server.should_exit = True
    assert r.status_code == 200, r.text
    for d, text in zip(r.json()["data"], TEXTS):
        states = hf_states(tiny, tiny.tokenizer.encode(text))
        got = np.frombuffer(base64.b64decode(d["embedding"]), "<f4")
        np.testing.assert_allclose(got, states.mean(0) if pooling == "mean" else states[0], atol=TOL)


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, tiny):
    long = [(7 * i) % 250 + 1 for i in range(40)]  # past the 32-token context
    r = client.embeddings.create(model="tiny", input=[long], extra_body={"truncate_prompt_tokens": 10})
    np.testing.assert_allclose(r.data[0].embedding, unit(hf_states(tiny, long[-10:])[-1]), atol=TOL)
    assert r.usage.prompt_tokens == 10


@pytest.mark.parametrize("body, param, message", [
    ({"input": []}, "input", "input: must not be empty"),
    ({"input": ["ok", ""]}, "input[1]", "input[1]: must not be empty"),
    ({"input": [[1, 2], list(range(1, 41))]}, "input[1]", "input[1]: 40 tokens, more than the model's context of 32"),
    ({"input": [1, 2, 100000]}, "input", "input: token ids must be in [0, "),
    ({"input": "ok", "dimensions": 8}, "dimensions", "dimensions: this model's embeddings have 32 dimensions, got 8"),
    ({"input": "ok", "encoding_format": "int8"}, "encoding_format", "encoding_format: "),
    ({"input": "ok", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "truncate_prompt_tokens: "),
    ({"input": ["a", "b", "c"]}, "input", "input: at most 2 inputs per request, got 3"),  # (MAX_INPUTS: 2048)
])
def test_bad_input_is_a_400_naming_it(url, body, param, message, monkeypatch):
    from mesh_transformer.serve import embeddings
    monkeypatch.setattr(embeddings, "MAX_INPUTS", 2)
    r = httpx.post(f"{url}/v1/embeddings", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(message), error


def test_a_language_model_does_not_classify(url):
    """/classify (vLLM's) is a classifier's: a language model's server answers a 400 saying why
    (tests/test_serve_classify.py serves classifiers)."""
    r = httpx.post(f"{url}/classify", json={"input": "hi"}, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("this model is a language model (no score head): /classify needs")


@pytest.fixture(scope="module")
def sentence_models(tiny, tmp_path_factory):
    """The tiny GPT-J as two sentence-transformers models, saved by that library (a base model's
    checkpoint, modules.json, the Pooling module's config): {"last": last token then Normalize,
    "mean": mean, not normalised} -> directory."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules
    saved = {}
    for pooling, mode, normalize in (("last", "lasttoken", True), ("mean", "mean", False)):
        transformer = modules.Transformer(str(tiny.path))
        transformer.tokenizer.pad_token = transformer.tokenizer.eos_token  # it pads its batches
        parts = [transformer, modules.Pooling(32, pooling_mode=mode)] + ([modules.Normalize()] if normalize else [])
        saved[pooling] = tmp_path_factory.mktemp(f"sentence_{pooling}")
        SentenceTransformer(modules=parts, device="cpu").save(str(saved[pooling]))
    return saved


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_a_sentence_transformers_directory_serves_what_that_library_encodes(sentence_models, pooling):
    """device_serve.py --hf DIR of a sentence-transformers model: the base model loads (its head
    zeros), modules.json sets the pooling and normalisation unless flags say otherwise, and
    /v1/embeddings answers what `SentenceTransformer(DIR).encode` computes."""
    import argparse

    from openai import OpenAI
    from sentence_transformers import SentenceTransformer

    import device_serve
    from mesh_transformer import loading
    from mesh_transformer.serve import Engine
    path = sentence_models[pooling]
    flags = lambda pooling=None, normalize=None: argparse.Namespace(  # noqa: E731 - device_serve.py's
        hf=str(path), embedding_pooling=pooling, embedding_normalize=normalize)
    settings = device_serve.embedding_settings(flags())
    assert settings == {"embedding_pooling": pooling, "embedding_normalize": pooling == "last"}
    assert device_serve.embedding_settings(flags("cls", True)) == {"embedding_pooling": "cls",
                                                                   "embedding_normalize": True}
    with pytest.warns(UserWarning, match="has no language-model head"):
        model = loading.load(hf=str(path), mp=1, dp=1, dtype="float32")
    served = Engine(model.generator(), model.tokenizer, max_batch=2, chunk=2).start()
    server, base = start_server(create_app(served, model_name="sentence", api_key=KEY, **settings))
    try:
        sdk = OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=60)
        got = np.array([d.embedding for d in sdk.embeddings.create(model="sentence", input=TEXTS).data])
    finally:
        server.should_exit = True
        served.stop()
    want = SentenceTransformer(str(path), device="cpu").encode(TEXTS)
    np.testing.assert_allclose(got, want, atol=TOL)


def test_a_pooling_this_library_does_not_run_needs_the_flag(tmp_path):
    """A directory whose Pooling module takes the max: device_serve.py stops before loading weights,
    naming the file and the flag; with --embedding-pooling the flag's pooling is used."""
    import argparse
    import json

    import device_serve
    from mesh_transformer.config import ConfigError
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "max"}))
    (tmp_path / "modules.json").write_text(json.dumps([{"path": "1_Pooling", "type": "x.Pooling"}]))
    flags = lambda pooling: argparse.Namespace(hf=str(tmp_path), embedding_pooling=pooling,  # noqa: E731
                                               embedding_normalize=None)
    with pytest.raises(ConfigError, match=r"1_Pooling/config.json: pooling 'max' .*pass --embedding-pooling"):
        device_serve.embedding_settings(flags(None))
    assert device_serve.embedding_settings(flags("mean")) == {"embedding_pooling": "mean", "embedding_normalize": True}
