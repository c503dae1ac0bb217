"""Operating the server: Prometheus /metrics, input the tokenizer cannot encode (400 naming the
field), draining (503 for new work), and a real `device_serve.py` process that drains on SIGTERM
and exits 0."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mesh_transformer.serve import Engine, create_app
from tests.helpers import make_hf_gptj, one_device_env
from tests.serving import KEY, client, engine, start_server, url, wait_idle  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def scrape(url: str) -> dict:
    """{(sample name, frozenset(labels)): value} from GET /metrics (which needs no API key)."""
    r = httpx.get(f"{url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_metrics_count_requests_tokens_and_latencies(url, client, engine):
    wait_idle(engine)
    before = scrape(url)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0, n=2, seed=1)
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       temperature=0.5, top_p=0.9, seed=3, stream=True,
                                       stream_options={"include_usage": True})
    chat_usage = list(c)[-1].usage
    bad = httpx.post(f"{url}/v1/completions", headers=AUTH, json={"prompt": "hi", "temperature": -1})
    assert bad.status_code == 400
    after = scrape(url)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)
    assert delta("mesh_transformer_requests_total", endpoint="/v1/completions", status="200") == 1
    assert delta("mesh_transformer_requests_total", endpoint="/v1/completions", status="400") == 1
    assert delta("mesh_transformer_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    # every row ran to max_tokens (token-id prompts, no EOS or stop: finish_reason "length")
    assert [ch.finish_reason for ch in r.choices] == ["length"] * 4 and chat_usage.completion_tokens == 5
    assert delta("mesh_transformer_prompt_tokens_total") == 2 * (3 + 5) + chat_usage.prompt_tokens
    assert delta("mesh_transformer_generation_tokens_total") == 4 * 6 + 5
    assert delta("mesh_transformer_time_to_first_token_seconds_count") == 5  # one per sequence
    assert delta("mesh_transformer_inter_token_latency_seconds_count") == 4 * 5 + 4  # tokens after each first
    assert 0 < delta("mesh_transformer_time_to_first_token_seconds_sum") < 60
    assert value(after, "mesh_transformer_queue_depth") == 0 and value(after, "mesh_transformer_running_rows") == 0
    assert delta("mesh_transformer_prefix_cache_queries_total") == delta("mesh_transformer_prompt_tokens_total")
    assert value(after, "mesh_transformer_prefix_cache_hit_rate") == pytest.approx(  # hits: tests/test_serve_prefix.py
        value(after, "mesh_transformer_prefix_cache_hits_total") / value(after, "mesh_transformer_prefix_cache_queries_total"))


UNENCODABLE = [  # JSON allows lone UTF-16 surrogates; no tokenizer can encode them
    ("/v1/completions", '{"prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", '{"prompt": ["fine", "bad \\udc00"]}', "prompt[1]"),
    ("/v1/completions", '{"prompt": "hi", "stop": "\\ud800"}', "stop"),
    ("/v1/completions", '{"prompt": "hi", "stop": ["x", "\\ud83d"]}', "stop[1]"),
    ("/complete", '{"context": "a\\ud800b"}', "context"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi", "name": "\\ud800"}]}',
     "messages[0].name"),
]


@pytest.mark.parametrize("path,raw,param", UNENCODABLE, ids=[u[2] for u in UNENCODABLE])
def test_text_the_tokenizer_cannot_encode_is_a_400_naming_the_field(url, path, raw, param):
    r = httpx.post(f"{url}{path}", content=raw.encode(), headers=AUTH)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: character")
    assert "cannot be tokenized" in error["message"] and error["type"] == "invalid_request_error"


def test_a_draining_engine_answers_503_and_health_says_so(gen, tiny):
    idle = Engine(gen, tiny.tokenizer, max_batch=4, chunk=4)  # never started: only the refusal is under test
    server, base = start_server(create_app(idle))
    try:
        assert httpx.get(f"{base}/health").json()["status"] == "ok"
        idle.drain()
        for path, body in (("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "hi", "stream": True})):
            r = httpx.post(f"{base}{path}", json=body)
            assert r.status_code == 503 and r.json()["error"]["type"] == "server_shutting_down", r.text
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
        assert idle.stats()["queued"] == 0
    finally:
        server.should_exit = True


# --------------------------------------------------------------------------------------------
# A real device_serve.py process
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def long_model(tmp_path_factory, tiny):
    """A random GPT-J with a 2048-token context (the tiny tokenizer): long requests take seconds."""
    path = tmp_path_factory.mktemp("long_gptj")
    make_hf_gptj(path, vocab_size=len(tiny.tokenizer), n_positions=2048, n_embd=512, n_layer=4, n_head=8,
                 rotary_dim=8, bos_token_id=tiny.eos, eos_token_id=tiny.eos)
    tiny.tokenizer.save_pretrained(path)
    return path


def serve_process(model_dir, *args):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = one_device_env()  # one CPU device
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "device_serve.py"), "--hf", str(model_dir),
                             "--port", str(port), *args], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    while True:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "device_serve.py did not start"
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.TransportError:
            time.sleep(0.3)


class Stream:
    """A streamed completion read in a thread: its events, and whether the first has arrived."""

    def __init__(self, base: str, body: dict):
        self.events: list = []
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(base, body), daemon=True)
        self.thread.start()

    def _read(self, base, body):
        with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    self.events.append(data if data == "[DONE]" else json.loads(data))
                    self.started.set()

    def text(self) -> str:
        return "".join(c["text"] for e in self.events if isinstance(e, dict) for c in e.get("choices", []))


@pytest.mark.slow
def test_sigterm_drains_running_requests_refuses_new_ones_and_exits_0(long_model):
    proc, base = serve_process(long_model, "--max-batch", "2", "--drain-timeout", "2", "--warmup", "4")
    try:
        health = httpx.get(f"{base}/health").json()
        assert health["dtype"] == "float32"  # no --dtype on a CPU backend
        # ~2000 decode steps: longer than the drain timeout; 64 tokens finish well within it
        long = Stream(base, {"prompt": "The quick", "max_tokens": 2000, "temperature": 0})
        assert long.started.wait(60)
        short = Stream(base, {"prompt": "Pack my", "max_tokens": 64, "temperature": 0,
                              "stream_options": {"include_usage": True}})
        assert short.started.wait(60)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        refused = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_shutting_down"
        assert httpx.get(f"{base}/health").json()["status"] == "draining"
        assert proc.wait(timeout=60) == 0
        elapsed = time.monotonic() - sent
        long.thread.join(10), short.thread.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # the short request finished normally; the long one was ended when the drain timeout passed
    assert short.events[-1] == "[DONE]" and short.events[-2]["usage"]["completion_tokens"] == 64
    assert [c["finish_reason"] for e in short.events[:-2] for c in e["choices"]][-1] == "length"
    assert long.events[-1]["error"]["type"] == "server_shutting_down" and "[DONE]" not in long.events
    assert 2 <= elapsed < 20
    # warm-up compiled the decode windows from the floor (32 slots for one row, 16 for two: this
    # model's weights are light beside its cache) to the whole 2,048 and logged it
    warmed = re.search(r"warm-up took [\d.]+ s: (.*) programs compiled", proc.stderr.read())
    assert warmed and {kind: int(n) for n, kind in (p.split() for p in warmed[1].split(", "))}.get("decode") == 15
