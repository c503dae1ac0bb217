"""The HTTP server on loopback: the official openai client, the original /complete, batching, bad input.

The server runs in-process (uvicorn in a thread, bound to 127.0.0.1 on a free port) over the tiny
model and compiled Generator of tests/test_generate.py (4 rows, 32 slots, 4-token decode chunks).
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import pytest

from mesh_transformer.generate import SamplingOptions
from mesh_transformer.generate.batching import Sequence
from mesh_transformer.serve import Engine, create_app
from mesh_transformer.serve import engine as engine_module
from mesh_transformer.serve.engine import Request
from mesh_transformer.serve.openai import deltas
from tests.helpers import NEW, in_pieces
from tests.serving import KEY, LIMIT, client, engine, library_text, start_server, url, wait_idle  # noqa: F401


def test_openai_client_completion(client, gen, tiny):
    r = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=NEW, temperature=0)
    [expected] = library_text(gen, tiny, ["The quick brown"])
    assert r.choices[0].text == expected and r.object == "text_completion"
    assert r.usage.prompt_tokens == len(tiny.tokenizer.encode("The quick brown"))
    assert r.choices[0].finish_reason in ("length", "stop")
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_openai_client_stream_adds_up(client):
    kw = dict(model="tiny", prompt="Pack my box", max_tokens=NEW, temperature=0)
    whole = client.completions.create(**kw).choices[0]
    chunks = in_pieces(lambda: list(client.completions.create(stream=True, **kw)), len)
    assert len(chunks) > 1
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason


def test_a_stream_sends_each_update_its_reader_wakes_for(tiny):
    """`deltas` driven by hand, as the engine thread drives it: a delta for each update the reader
    wakes for, the updates made before it wakes as one, text that may begin a stop string held back
    until it does not, the stop string never sent."""
    ids = tiny.tokenizer.encode("The quick brown fox jumps over")
    assert [tiny.tokenizer.decode([i]) for i in ids[:10]] == \
        ["The", " quick", " b", "r", "ow", "n", " f", "ox", " jump", "s"]
    seq = Sequence([5], SamplingOptions(max_new_tokens=16, stop=(" jumps",)), 32, tiny.tokenizer)

    async def read():
        request = Request([seq], asyncio.get_running_loop())
        stream = deltas(request)
        got = []
        for updates in ([ids[0:2]], [ids[2:4], ids[4:6]], [ids[6:9]], [ids[9:11]]):
            for tokens in updates:
                seq.extend(tokens, None, None, None)
                request.notify()
            got.append(await anext(stream))
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        return got

    got = asyncio.run(read())
    assert [(d.text, d.lo, d.hi, d.finish_reason) for d in got] == [
        ("The quick", 0, 2, None), (" brown", 2, 6, None), (" fox", 6, 9, None), ("", 9, 9, "stop")]
    assert seq.text == "The quick brown fox" and seq.kept_tokens() == 8


def test_openai_client_stop_sequence(client):
    kw = dict(model="tiny", prompt="How vexingly", max_tokens=NEW, temperature=0)
    text = client.completions.create(**kw).choices[0].text
    stop = text[5:7]
    r = client.completions.create(stop=[stop, "never-seen"], **kw).choices[0]
    assert r.text == text[: text.index(stop)] and r.finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=stop, stream=True, **kw))
    assert streamed == r.text


def test_greedy_and_logprobs_match_hf_over_http(client, tiny):
    """Token-id prompts, no EOS in HF's output: the text and the chosen tokens' log p (fp32, 1e-4)."""
    for prompt in ([5, 6, 7, 8, 9], list(range(40, 52))):
        tokens, logprobs = tiny.hf_greedy(prompt, eos=True)
        if tiny.eos in tokens:
            tokens, logprobs = tokens[: tokens.index(tiny.eos)], logprobs[: tokens.index(tiny.eos)]
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW, temperature=0, logprobs=2).choices[0]
        assert r.text == tiny.tokenizer.decode(tokens)
        np.testing.assert_allclose(r.logprobs.token_logprobs[: len(tokens)], logprobs, atol=1e-4)
        assert all(len(alts) <= 2 for alts in r.logprobs.top_logprobs)
        assert r.logprobs.text_offset[0] == 0


def test_n_and_seed_give_reproducible_samples(client):
    kw = dict(model="tiny", prompt=["The quick", "Pack my"], max_tokens=8, temperature=1.0, top_p=0.9, n=2, seed=7)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices] and len(a.choices) == 4
    assert [c.index for c in a.choices] == [0, 1, 2, 3]


def test_64_concurrent_requests_share_batches(client, url, engine, gen, tiny):
    from openai import AsyncOpenAI

    words = ["quick", "brown", "fox", "lazy", "dog", "box", "five", "dozen"]
    prompts = [f"{words[i % 8]} {words[(i // 8) % 8]} {i}" for i in range(64)]
    expected = library_text(gen, tiny, prompts)
    before = engine.stats()["admissions"]

    async def run():
        async with AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120) as aclient:
            rs = await asyncio.gather(*[aclient.completions.create(model="tiny", prompt=p, max_tokens=NEW, temperature=0)
                                        for p in prompts])
        return [r.choices[0].text for r in rs]

    assert asyncio.run(run()) == expected
    assert engine.stats()["admissions"] - before < 64  # requests were prefilled together
    assert engine.stats()["active"] == 0 and engine.stats()["queued"] == 0


def test_admit_tokens_bounds_each_prefill(gen, tiny):
    """8 prompts waiting together, 10 tokens each (16 positions, bucketed): with admit_tokens 32 they
    join 2 at a time (4 rows x 16 would exceed it); with 8, below one prompt, each joins alone.
    Every answer is HF's greedy one."""
    prompts = [list(range(10 + i, 20 + i)) for i in range(8)]
    expected = [tiny.hf_greedy(p)[0] for p in prompts]
    for budget, groups in ((32, [2, 2, 2, 2]), (8, [1] * 8)):
        engine = Engine(gen, None, max_batch=8, chunk=4, admit_tokens=budget)
        sizes, admit = [], engine.batch.admit
        engine.batch.admit = lambda seqs: (sizes.append(len(seqs)), admit(seqs))[1]
        seqs = [engine.sequence(p, SamplingOptions(max_new_tokens=NEW, temperature=0.0), None) for p in prompts]
        request = engine.submit(seqs)  # all waiting before the engine starts
        engine.start()
        try:
            while not request.finished:
                request.updated.wait(timeout=60)
                request.updated.clear()
        finally:
            engine.stop()
        assert sizes == groups
        assert [s.tokens for s in seqs] == expected


def test_first_tokens_are_handed_out_before_the_next_decode_call(gen, tiny):
    """The engine wakes an admitted request's handler as soon as the prefill gives its first token,
    not after the decode call that follows the admission (one step over every running row: 12 ms
    of a 16-request burst's time to first token for the serving GPT-J, 25 ms at 64 rows)."""
    engine = Engine(gen, None, max_batch=8, chunk=4)
    calls, step = [], engine.batch.step  # at each decode call: (woken yet, tokens the request has)
    engine.batch.step = lambda limit=None: (calls.append((request.updated.is_set(), len(seq.tokens))), step(limit))[1]
    seq = engine.sequence(list(range(10, 20)), SamplingOptions(max_new_tokens=NEW, temperature=0.0), None)
    request = engine.submit([seq])
    engine.start()
    try:
        deadline = time.monotonic() + 60
        while not request.finished and time.monotonic() < deadline:
            time.sleep(0.01)  # the event is never cleared: once set, it stays set
    finally:
        engine.stop()
    assert calls[0] == (True, 1)
    assert seq.tokens == tiny.hf_greedy(list(range(10, 20)))[0]


@pytest.mark.parametrize("gather", [2.0, 0.0], ids=["gathered", "as_they_come"])
def test_an_idle_engine_admits_a_burst_together(gen, tiny, monkeypatch, gather):
    """Requests that arrive one by one, each within the quiet time of the last, while nothing
    runs: with `gather` the engine waits for the burst and admits it as one group; without, the
    first joins alone, before the others arrive. Answers are HF's greedy ones either way."""
    monkeypatch.setattr(engine_module, "GATHER_QUIET", 1.0)  # arrivals 100 ms apart stay "together" on a busy CI
    prompts = [list(range(10 + i, 20 + i)) for i in range(4)]
    engine = Engine(gen, None, max_batch=8, chunk=4, gather=gather).start()
    sizes, admit = [], engine.batch.admit
    engine.batch.admit = lambda seqs: (sizes.append(len(seqs)), admit(seqs))[1]
    try:
        requests = []
        for p in prompts:
            requests.append(engine.submit([engine.sequence(p, SamplingOptions(max_new_tokens=NEW, temperature=0.0), None)]))
            time.sleep(0.1)
        for request in requests:
            while not request.finished:
                request.updated.wait(timeout=60)
                request.updated.clear()
    finally:
        engine.stop()
    if gather:
        assert sizes == [4]
    else:
        assert sizes[0] == 1 and sum(sizes) == 4
    assert [r.seqs[0].tokens for r in requests] == [tiny.hf_greedy(p)[0] for p in prompts]


def test_clients_that_finished_together_are_admitted_together_when_they_come_back(gen, tiny):
    """Three requests finish in the same decode call; their clients' next requests come back 100 ms
    apart (far more than GATHER_QUIET): the idle engine waits for all three (as many as finished)
    and prefills them as one group. A lone request long after (past `gather`) is not held back."""
    prompts = [list(range(10 + i, 20 + i)) for i in range(3)]
    options = SamplingOptions(max_new_tokens=NEW, temperature=0.0)
    engine = Engine(gen, None, max_batch=8, chunk=4, gather=2.0).start()
    admitted, admit = [], engine.batch.admit  # (rows, when)
    engine.batch.admit = lambda seqs: (admitted.append((len(seqs), time.monotonic())), admit(seqs))[1]

    def wait(requests):
        for request in requests:
            while not request.finished:
                request.updated.wait(timeout=60)
                request.updated.clear()

    try:
        wait([engine.submit([engine.sequence(p, options, None)]) for p in prompts])  # 3 clients at once
        came_back = []
        for p in prompts:
            came_back.append(engine.submit([engine.sequence(p, options, None)]))
            time.sleep(0.1)
        wait(came_back)
        time.sleep(2.5)  # past `gather` after the last call: nothing is expected any more
        lone = engine.submit([engine.sequence(prompts[0], options, None)])
        wait([lone])
    finally:
        engine.stop()
    assert [rows for rows, _ in admitted] == [3, 3, 1]
    held = admitted[-1][1] - lone.submitted
    assert held < 1.0, f"a lone request waited {held:.2f} s for a burst that had already come back"
    assert [r.seqs[0].tokens for r in came_back] == [tiny.hf_greedy(p)[0] for p in prompts]


def test_original_complete_endpoint(url, gen, tiny):
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{url}/complete", json={"context": "Pack my box", "top_p": 0.9, "temp": 0.0, "length": NEW},
                   headers=headers)
    assert r.status_code == 200 and r.json() == {"completion": library_text(gen, tiny, ["Pack my box"])[0],
                                                 "prompt_truncated": 0}
    long = httpx.post(f"{url}/complete", json={"context": "fox " * 40, "temp": 0.0, "length": NEW}, headers=headers)
    assert long.status_code == 200 and long.json()["prompt_truncated"] > 0


BAD = [
    ("/v1/completions", b"{not json", "not valid JSON"),
    ("/v1/completions", {"max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, "max_tokens must be at most 31"),
    ("/v1/completions", {"prompt": ""}, "prompt must not be empty"),
    ("/v1/completions", {"prompt": []}, "prompt must not be empty"),
    ("/v1/completions", {"prompt": [99999]}, "token ids"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 2}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "min_p": 1.5}, "min_p must be in [0, 1]"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 10}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e", "f", "g", "h", "i"]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999": 1}}, "logit_bias: token id 99999 is not in"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [99999]}, "stop_token_ids: token ids must be in [0, 300)"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": list(range(1, 9))}, "stop_token_ids: at most 7 ids"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(t): 1 for t in range(301)}}, "at most 300 tokens"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "stream": True}, "stream is not supported with echo"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "max_tokens": -1}, "max_tokens must not be negative"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "max_tokens": 0, "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": [5] * 30, "echo": True, "max_tokens": 4}, "with echo, prompt + max_tokens (4)"),
    ("/v1/completions", [1, 2], "must be a JSON object"),
    ("/complete", {"temp": 0.5}, "context"),
    ("/complete", {"context": ""}, "context must not be empty"),
    ("/complete", {"context": "hi", "length": 0}, "max_tokens"),
]


def test_bad_requests_get_a_clear_4xx_and_the_server_stays_up(url):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as http:
        for path, body, message in BAD:
            r = http.post(path, content=body if isinstance(body, bytes) else json.dumps(body))
            assert r.status_code == 400, (body, r.status_code, r.text)
            assert message in r.json()["error"]["message"], (body, r.text)
        r = http.post("/v1/completions", content=json.dumps({"prompt": "x" * (2 * LIMIT)}))
        assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}).status_code == 401
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_a_generation_configs_eos_ids_end_requests_as_the_tokenizers_does(gen, tiny, client):
    """Chat models end a turn with a token only their generation_config.json names (Llama 3's
    <|eot_id|>, Gemma's <end_of_turn>); an engine given those ids (`LoadedModel.eos_token_ids`, as
    device_serve.py does) stops there like vLLM, the id not in the text, unless `ignore_eos` or
    before vLLM's `min_tokens`. A request's own `stop_token_ids` (vLLM's) end it the same way."""
    from openai import OpenAI
    prompt = "The quick brown"
    reference = gen.generate([tiny.tokenizer.encode(prompt)] * 4, SamplingOptions(max_new_tokens=NEW, temperature=0.0))[0].tokens
    turn_end = reference[3]
    ends = reference.index(turn_end)
    served = Engine(gen, tiny.tokenizer, max_batch=4, chunk=4, eos_token_ids=(tiny.eos, turn_end)).start()
    server, base = start_server(create_app(served))
    try:
        api = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
        kw = dict(model="tiny", prompt=prompt, max_tokens=NEW, temperature=0)
        r = api.completions.create(**kw).choices[0]
        assert r.text == tiny.tokenizer.decode(reference[:ends]) and r.finish_reason == "stop"
        r = api.completions.create(extra_body={"ignore_eos": True}, **kw).choices[0]
        assert r.text == tiny.tokenizer.decode(reference) and r.finish_reason == "length"
        later = gen.generate([tiny.tokenizer.encode(prompt)] * 4, SamplingOptions(
            max_new_tokens=NEW, temperature=0.0, eos_token_id=(tiny.eos, turn_end), min_new_tokens=ends + 2),
            tokenizer=tiny.tokenizer)[0]
        assert len(later.tokens) > ends + 2
        r = api.completions.create(extra_body={"min_tokens": ends + 2}, **kw).choices[0]
        assert r.text == later.text and r.finish_reason == later.finish_reason
        for extra in ({"stop_token_ids": [turn_end]}, {"stop_token_ids": [turn_end], "ignore_eos": True}):
            r = client.completions.create(extra_body=extra, **kw).choices[0]  # the tokenizer's EOS only
            assert r.text == tiny.tokenizer.decode(reference[:ends]) and r.finish_reason == "stop"
    finally:
        server.should_exit = True
        served.stop()


def test_full_queue_answers_503_and_slow_requests_504(gen, tiny, engine):
    idle = Engine(gen, tiny.tokenizer, max_batch=4, chunk=4, max_queue=2)  # never started: nothing drains
    server, base = start_server(create_app(idle))
    try:
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "n": 3, "max_tokens": 2})
        assert r.status_code == 503 and "queue full" in r.json()["error"]["message"]
        idle.submit(idle.batch.gen.sequences([[1], [2]], SamplingOptions(max_new_tokens=2)))  # fill the queue
        r = httpx.post(f"{base}/complete", json={"context": "hi", "length": 2})
        assert r.status_code == 503 and r.json() == {"error": "queue full, try again later"}  # the original's answer
    finally:
        server.should_exit = True
    slow, slow_url = start_server(create_app(engine, timeout=0.001))
    try:
        r = httpx.post(f"{slow_url}/v1/completions", json={"prompt": "hi", "max_tokens": NEW})
        assert r.status_code == 504 and "timed out" in r.json()["error"]["message"]
        r = httpx.post(f"{slow_url}/complete", json={"context": "hi", "length": NEW})
        assert r.status_code == 504
    finally:
        slow.should_exit = True
    wait_idle(engine)  # timed-out rows are retired
