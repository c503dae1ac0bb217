"""device_serve.py started as a user starts it (README: `python device_serve.py --hf DIR --port 5000`,
key in $MESH_TRANSFORMER_API_KEY): a separate process on loopback, checked only over HTTP and through
the operating system's view of its socket."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import psutil
import pytest

from mesh_transformer import host_memory
from mesh_transformer.generate import SamplingOptions
from tests.helpers import one_device_env, refusal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "process-key"
SLOTS, MAX_BATCH, CHUNK, JOIN_CHUNK = 16, 2, 4, 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(hf_dir, *flags) -> tuple[subprocess.Popen, str]:
    """Start device_serve.py with one CPU device (as on a laptop) and the key in the environment."""
    port = free_port()
    env = one_device_env(MESH_TRANSFORMER_API_KEY=KEY)
    proc = subprocess.Popen([sys.executable, "device_serve.py", "--hf", str(hf_dir), "--port", str(port),
                             "--dtype", "float32", *flags], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, f"http://127.0.0.1:{port}"


def wait_until_up(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "device_serve.py did not start"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def servers(tiny):
    """Two servers started together: the batching flags (and a tool-call parser), and a 1 ms --timeout
    (every request expires; and speculative decoding's flags)."""
    started = [launch(tiny.path, "--max-batch", str(MAX_BATCH), "--chunk", str(CHUNK), "--join-chunk", str(JOIN_CHUNK),
                      "--slots", str(SLOTS), "--tool-call-parser", "hermes", "--embedding-pooling", "cls",
                      "--no-embedding-normalize"),
               launch(tiny.path, "--timeout", "0.001", "--speculate", "3", "--lookup-ngram", "2",
                      "--speculate-rows", "2")]
    try:
        for proc, url in started:
            wait_until_up(proc, url)
        yield started
    finally:
        for proc, _ in started:
            proc.terminate()
        for proc, _ in started:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def http(servers):
    _, url = servers[0]
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as client:
        yield client


def test_binds_loopback_only_by_default(servers):
    for proc, url in servers:
        port = int(url.rsplit(":", 1)[1])
        listening = [c.laddr for c in psutil.Process(proc.pid).net_connections("inet") if c.status == psutil.CONN_LISTEN]
        assert [(a.ip, a.port) for a in listening] == [("127.0.0.1", port)]


def test_key_from_the_environment_is_required(servers, http):
    _, url = servers[0]
    body = {"prompt": "hi", "max_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", json=body).status_code == 401
    assert httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.post(f"{url}/complete", json={"context": "hi"}).status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200  # health stays open for load balancers
    assert http.post("/v1/completions", json=body).status_code == 200


def test_lora_modules_are_served_by_name(tiny, tmp_path):
    """--lora-modules NAME=PATH (vLLM's flag): /v1/models lists the adapter, and a request naming it
    gets the library's answer with it, unmerged (a server of its own: the others keep the default,
    fused layout). With --enable-runtime-lora and --max-loras 1 a second adapter loads over HTTP and
    takes the one entry by turns."""
    pytest.importorskip("peft")
    from mesh_transformer import loading
    from tests.helpers import save_peft_adapters
    dirs = save_peft_adapters(tiny.path, type(tiny.torch), {"chat": (4, 32, ["q_proj", "fc_out"]),
                                                       "code": (2, 8, ["v_proj"])}, tmp_path)
    proc, url = launch(tiny.path, "--lora-modules", f"chat={dirs['chat']}", "--max-loras", "1",
                       "--enable-runtime-lora")
    try:
        gen = loading.load(hf=str(tiny.path), dtype="float32", mp=1, dp=1).generator(adapters=sorted(dirs.items()))
        ids = tiny.tokenizer.encode("The quick")
        options = SamplingOptions(max_new_tokens=6, temperature=0.0, eos_token_id=tiny.eos)
        expected = gen.generate([ids] * 3, options, tiny.tokenizer, adapters=[None, "chat", "code"])
        assert len({s.text for s in expected}) == 3
        wait_until_up(proc, url)
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as http:
            listed = http.get("/v1/models").json()["data"]
            assert [(m["id"], m["parent"]) for m in listed] == [(tiny.path.name, None), ("chat", tiny.path.name)]
            r = http.post("/v1/load_lora_adapter", json={"lora_name": "code", "lora_path": str(dirs["code"])})
            assert r.status_code == 200, r.text
            for model, seq in zip((tiny.path.name, "chat", "code", "chat"), expected + [expected[1]]):
                r = http.post("/v1/completions", json={"model": model, "prompt": "The quick", "max_tokens": 6,
                                                       "temperature": 0})
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == seq.text
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_slots_bound_the_context(http):
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": SLOTS})
    assert r.status_code == 400 and f"at most {SLOTS - 1}" in r.json()["error"]["message"]
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": SLOTS - 1 - 1}).status_code == 200


def test_max_batch_limits_the_rows_prefilled_together(http):
    """5 identical greedy sequences (finishing together) in 2 rows: admitted as 2 + 2 + 1."""
    before = http.get("/health").json()["admissions"]
    r = http.post("/v1/completions", json={"prompt": "The quick", "max_tokens": 6, "temperature": 0, "n": 5})
    assert r.status_code == 200 and len({c["text"] for c in r.json()["choices"]}) == 1
    assert http.get("/health").json()["admissions"] - before == 3


def stream_events(http, prompt, max_tokens) -> list[dict]:
    events = []
    with http.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                       "logprobs": 0, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:])["choices"][0])
    return events


def test_chunk_is_the_decode_steps_between_streamed_events(http, gen, tiny):
    """Text is streamed after the prefill's token, after the --join-chunk steps of the call right after
    the request joined, then after each --chunk of decode steps: every event but the last ends at 1 or
    1 + JOIN_CHUNK + k x CHUNK tokens (an event may carry several calls' tokens when the reader falls
    behind; with one chunk size for every call, 5 or 9 would be boundaries, not 3, 7 and 11)."""
    prompt = [5]
    [expected] = gen.generate([prompt], SamplingOptions(max_new_tokens=SLOTS - 2, temperature=0.0), tiny.tokenizer)
    assert tiny.eos not in expected.tokens
    boundaries = set()
    for _ in range(5):  # a loaded machine can merge events; a few streams show the boundaries
        events = stream_events(http, prompt, SLOTS - 2)
        counts = np.cumsum([len(e["logprobs"]["tokens"]) if e["logprobs"] else 0 for e in events])
        assert "".join(e["text"] for e in events) == expected.text and counts[-1] == SLOTS - 2
        assert events[-1]["finish_reason"] == "length"
        assert all(c == 1 or (c - 1 - JOIN_CHUNK) % CHUNK == 0 for c in counts[:-1]), counts
        boundaries |= set(counts[:-1].tolist())
        if len(boundaries) >= 2:
            break
    assert len(boundaries) >= 2, boundaries


@pytest.mark.parametrize("flags, message", [
    (("--port", "99999"), "--port must be in [1, 65535]; got 99999"),  # (uvicorn bound 99999 - 65536, logging 99999)
    (("--max-batch", "0"), "--max-batch must be at least 1; got 0"),
    (("--slots", "0"), "--slots must be at least 1; got 0"),
    (("--max-queue", "-1"), "--max-queue must be at least 0; got -1"),
    (("--warmup", "16", "0"), "--warmup must be at least 1; got 0"),
    (("--timeout", "0"), "--timeout must be above 0 and --drain-timeout at least 0 seconds; got 0 and 30"),
    (("--drain-timeout", "-1"), "--timeout must be above 0 and --drain-timeout at least 0 seconds; got 300 and -1"),
    (("--join-chunk", "0"), "--chunk and --join-chunk must be at least 1 decode step; got 8 and 0"),
    (("--admit-tokens", "0"), "--admit-tokens must be at least 1; got 0"),
    (("--speculate", "17"), "--speculate must be in [0, 16] draft tokens a step; got 17"),
    (("--speculate", "2", "--lookup-ngram", "0"), "--lookup-ngram must be in [1, 8] tokens; got 0"),
    (("--speculate", "2", "--speculate-rows", "0"), "--speculate-rows must be at least 1; got 0"),
    (("--speculate", "2", "--batch-invariant"), "--speculate and --batch-invariant exclude each other: a request's "
                                                "passes, and so its rounding, would depend on whether it ran alone "
                                                "and on its drafts"),
    (("--gather-ms", "-5"), "--gather-ms must be at least 0; got -5"),
    (("--prefix-cache-tokens", "8", "--prefix-block", "16"),
     "--prefix-cache-tokens must be 0 (off) or at least --prefix-block (16), and --prefix-block at least 1; "
     "got 8 and 16"),
    (("--max-loras", "0"), "--max-loras must be at least 1; got 0"),
    (("--max-lora-rank", "8"), "--max-lora-rank sizes the bank of served LoRA adapters: pass --lora-modules or "
                               "--enable-runtime-lora"),
    (("--lora-modules", "chat=x", "--max-loras", "2", "--max-cpu-loras", "1"),
     "--max-cpu-loras (1) must be at least the bank's entries, --max-loras (2): the adapters in them are held in "
     "host memory too"),
    (("--lora-modules", "a=x", "b=y", "--max-cpu-loras", "1"),
     "--max-cpu-loras (1) must be at least the bank's entries, --max-loras (2; default: one per --lora-modules "
     "adapter): the adapters in them are held in host memory too"),
    (("--lora-modules", "chat"), "--lora-modules takes NAME=PATH items, got 'chat'"),
    (("--lora-modules", "chat=x", "--lora-adapter", "y"),
     "--lora-adapter merges an adapter into the base and --lora-modules serves adapters made for the base: pass "
     "one (merge first with to_hf_weights.py to serve both)"),
    (("--lora-modules", "chat=/nowhere"), "--lora-modules chat=/nowhere: /nowhere: no adapter_config.json (is this "
                                          "a PEFT adapter directory? A LoRA run's checkpoint exports to one with "
                                          "to_hf_weights.py --peft)"),
])
def test_a_flag_no_server_runs_with_is_one_error_naming_it(flags, message, capsys, monkeypatch):
    """Checked before any model loads (there is none at this path), in this process: ranges and
    combinations of flags before the server's malloc settings (which would outlive the call), the
    adapters' files before the base."""
    import device_serve
    monkeypatch.setenv(host_memory.ENV, "system")  # the malloc settings left alone, should a check come after them
    err = refusal(device_serve.main, ["--hf", "/no/such/model", *flags], capsys)
    assert f"error: {message}\n" in err, err


def test_timeout_flag_answers_504(servers):
    _, url = servers[1]
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 8}, headers=headers, timeout=120)
    assert r.status_code == 504 and "timed out after 0.001 s" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/embeddings", json={"input": "hi"}, headers=headers, timeout=120)
    assert r.status_code == 504 and "timed out after 0.001 s" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/health").json()["speculate"] == {"draft_tokens": 3, "lookup_ngram": 2, "max_rows": 2,
                                                              "row_passes": 0}
    _, plain = servers[0]
    assert httpx.get(f"{plain}/health").json()["speculate"] is None


def test_embedding_flags_pool_the_first_state_unnormalised(http, tiny):
    """--embedding-pooling cls --no-embedding-normalize: a text's vector is transformers' first hidden
    state as it is. Texts may use the model's whole context (32), past the decode rows' --slots (16)."""
    import torch
    texts = [tiny.tokenizer.encode("Hello there"), list(range(1, 31))]
    r = http.post("/v1/embeddings", json={"input": texts})
    assert r.status_code == 200, r.text
    for got, ids in zip(r.json()["data"], texts):
        with torch.no_grad():
            want = tiny.torch.base_model(torch.tensor([ids])).last_hidden_state[0, 0].numpy()
        np.testing.assert_allclose(got["embedding"], want, atol=1e-5)


def test_tool_call_parser_flag_lets_auto_tool_choice_through(servers):
    """With --tool-call-parser, "auto" (the default with tools) passes; the tiny model's 32-token
    context is then what refuses the prompt that lists the tool. Without it, "auto" is refused."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "tools": [{"type": "function", "function": {"name": "now"}}]}
    params = []
    for _, url in servers:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert r.status_code == 400, r.text
        params.append(r.json()["error"]["param"])
    assert params == ["messages", "tool_choice"]
