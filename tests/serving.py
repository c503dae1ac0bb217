"""What the serving tests share: an in-process server on loopback over the tiny model.

Import the fixtures into a test module (`from tests.serving import engine, url, client`): each
module gets its own Engine (4 rows, 4-token decode chunks) over the session's compiled Generator,
served by uvicorn in a thread on a free 127.0.0.1 port with API key `KEY`.
"""
from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

from mesh_transformer.generate import SamplingOptions
from mesh_transformer.serve import PLAIN_TEMPLATE, Engine, create_app
from tests.helpers import NEW

KEY = "test-key"
LIMIT = 4096

# Two tools in chat's form, for the APIs that render tools (chat, Responses, Messages)
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"enum": [1, 2, 3]}},
                      "required": ["city", "days"], "additionalProperties": False}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                "parameters": WEATHER_PARAMETERS}},
              {"type": "function", "function": {"name": "now", "parameters": {
                  "type": "object", "properties": {}, "additionalProperties": False}}}]
THINKS = ("{% for m in messages %}{% if m['reasoning_content'] %}({{ m['reasoning_content'] }}){% endif %}"
          "{{ m['content'] }}|{% endfor %}{% if add_generation_prompt %}<think>{% endif %}")  # R1's way


def start_server(app):
    """uvicorn in a daemon thread on a free loopback port -> (server, base url)."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    return server, f"http://127.0.0.1:{sock.getsockname()[1]}"


@contextlib.contextmanager
def chat_servers(engine, **plain):
    """Three servers over `engine`: {"plain" (`plain`'s create_app arguments), "hermes" (its tool
    parser), "r1" (R1's template and reasoning parser): base url}, stopped at the end."""
    started = {"plain": start_server(create_app(engine, model_name="tiny", api_key=KEY, **plain)),
               "hermes": start_server(create_app(engine, model_name="tiny", api_key=KEY, tool_parser="hermes")),
               "r1": start_server(create_app(engine, model_name="tiny", api_key=KEY, chat_template=THINKS,
                                             reasoning_parser="deepseek_r1"))}
    try:
        yield {name: base for name, (_, base) in started.items()}
    finally:
        for server, _ in started.values():
            server.should_exit = True


def library_text(gen, tiny, prompts, max_new_tokens=NEW, **kw):
    """Greedy completions straight from the library, 4 prompts per batch (the compiled shape).
    `prompts`: strings or token-id lists."""
    opts = SamplingOptions(max_new_tokens=max_new_tokens, temperature=0.0, eos_token_id=tiny.eos, **kw)
    ids = [tiny.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    out = []
    for i in range(0, len(ids), 4):
        group = ids[i:i + 4]
        out += [s.text for s in gen.generate(group + [group[0]] * (4 - len(group)), opts, tiny.tokenizer)[:len(group)]]
    return out


def template_ids(tiny, messages: list[dict], tool_specs=None, template: str = PLAIN_TEMPLATE, **kw) -> list[int]:
    """transformers' rendering and encoding of a conversation (the oracle for a chat server's prompt)."""
    kw.setdefault("add_generation_prompt", True)
    return tiny.tokenizer.apply_chat_template(messages, tools=tool_specs, chat_template=template, tokenize=True,
                                              return_dict=False, **kw)


def library(tiny_long, ids: list[int], new: int, grammar=None, **kw):
    """The library's greedy reply to `ids` on `tiny_long` (in a batch of 4, as the engine runs it)."""
    tiny, gen = tiny_long
    opts = SamplingOptions(**{"max_new_tokens": new, "temperature": 0.0, "eos_token_id": tiny.eos, "grammar": grammar,
                              **kw})
    return gen.generate([ids] * 4, opts, tiny.tokenizer)[0]


def wait_idle(engine, timeout: float = 30) -> None:
    """Until no sequence is queued or running (cancelled rows are retired at the next step) and the
    engine thread waits for work (so its last step's arrays are released)."""
    deadline = time.monotonic() + timeout
    while engine.stats()["active"] or engine.stats()["queued"] or not engine.parked:
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.02)


@pytest.fixture(scope="module")
def engine(gen, tiny):
    """Batch-invariant: answers over HTTP equal the library's bit for bit, whatever runs beside them
    (the default, rows in use only, is pinned in tests/test_generate.py)."""
    engine = Engine(gen, tiny.tokenizer, max_batch=4, chunk=4, max_queue=256, batch_invariant=True).start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def url(engine):
    server, base = start_server(create_app(engine, model_name="tiny", api_key=KEY, max_request_bytes=LIMIT))
    yield base
    server.should_exit = True


@pytest.fixture(scope="module")
def client(url):
    from openai import OpenAI
    return OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
