"""POST /v1/chat/completions through the official openai client: templates, greedy text equal to
the library's generation of the rendered prompt, streaming, n/seed, logprobs, usage, errors.

The tiny model's context is 32 tokens, so the conversations are short."""
from __future__ import annotations

import copy
import json

import httpx
import numpy as np
import openai
import pytest

from mesh_transformer.serve import PLAIN_TEMPLATE, ChatTemplate, create_app
from tests.helpers import in_pieces
from tests.serving import KEY, client, engine, library_text, start_server, url, wait_idle  # noqa: F401

HI = [{"role": "user", "content": "hi"}]
HI_TEXT = "User: hi\n\nAssistant:"  # the plain template's rendering of HI
COMPACT = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"  # fits more turns in 32 tokens


def test_plain_template_renders_roles_and_the_assistant_cue(tiny):
    chat = ChatTemplate(tiny.tokenizer)  # the tiny tokenizer has no chat_template of its own
    assert chat.source == "plain" and chat.template == PLAIN_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Pack my box"},
                {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Again"}]
    assert chat.render(messages) == "System: Be brief.\n\nUser: Pack my box\n\nAssistant: Done.\n\nUser: Again\n\nAssistant:"


def test_tokenizer_template_is_used_and_a_file_overrides_it(tiny, tmp_path):
    tok = copy.deepcopy(tiny.tokenizer)
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    own = ChatTemplate(tok)
    assert own.source == "tokenizer"
    assert own.render(HI) == "<user>hi<assistant>" == tok.apply_chat_template(HI, tokenize=False,
                                                                             add_generation_prompt=True)
    (tmp_path / "t.jinja").write_text(COMPACT)
    override = ChatTemplate.from_file(tok, str(tmp_path / "t.jinja"))
    assert override.source == "file" and override.render(HI) == "hi|"


def test_chat_greedy_equals_library_generation_of_the_rendered_prompt(client, gen, tiny):
    r = client.chat.completions.create(model="tiny", messages=HI, max_tokens=8, temperature=0)
    [expected] = library_text(gen, tiny, [HI_TEXT], max_new_tokens=8)
    [choice] = r.choices
    assert choice.message.role == "assistant" and choice.message.content == expected
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "tiny"
    assert choice.finish_reason in ("stop", "length") and choice.logprobs is None
    ids = tiny.tokenizer.encode(HI_TEXT)
    assert r.usage.prompt_tokens == len(ids) == 20
    assert (r.usage.completion_tokens == 8) == (choice.finish_reason == "length")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # max_completion_tokens is the newer name for the same limit
    again = client.chat.completions.create(model="tiny", messages=HI, max_completion_tokens=8, temperature=0)
    assert again.choices[0].message.content == expected


def test_chat_stream_adds_up_to_the_whole_answer(client):
    # 12 tokens (all the 32-token context leaves): the answer's 1st, 2nd and 6th tokens end inside a
    # UTF-8 character, which a stream holds back until it completes, and where the decode calls
    # happened to end after them a 10-token answer came out in one piece
    kw = dict(model="tiny", messages=HI, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = in_pieces(lambda: list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)),
                       lambda got: len([c for c in got if c.choices and c.choices[0].delta.content]))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([p for p in pieces if p]) > 1  # streamed in several pieces (4-token decode chunks)
    assert "".join(pieces) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == []  # the usage: the same counts (the repeated prompt may be read from the prefix cache)
    assert chunks[-1].usage.model_dump(exclude={"prompt_tokens_details"}) == whole.usage.model_dump(
        exclude={"prompt_tokens_details"})
    for usage in (whole.usage, chunks[-1].usage):
        assert 0 <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens


def test_chat_over_a_file_template_with_system_and_history(gen, tiny, engine):
    server, base = start_server(create_app(engine, model_name="tiny", chat_template=COMPACT))
    try:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Pack my box"},
                    {"role": "assistant", "content": "ok"}, {"role": "developer", "content": [{"type": "text", "text": "fox"}]}]
        r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
        [expected] = library_text(gen, tiny, ["Be brief.|Pack my box|ok|fox|"], max_new_tokens=6)
        assert r.choices[0].message.content == expected
        assert r.usage.prompt_tokens == len(tiny.tokenizer.encode("Be brief.|Pack my box|ok|fox|"))
    finally:
        server.should_exit = True


def test_chat_n_seed_stop_and_logprobs(client):
    kw = dict(model="tiny", messages=HI, max_tokens=8, temperature=1.0, top_p=0.9, n=3, seed=11)
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    streamed = list(client.chat.completions.create(stream=True, **kw))
    for i, choice in enumerate(a.choices):
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices and c.choices[0].index == i) \
            == choice.message.content

    greedy = client.chat.completions.create(model="tiny", messages=HI, max_tokens=8, temperature=0,
                                            logprobs=True, top_logprobs=3).choices[0]
    content = greedy.logprobs.content
    assert "".join(t.token for t in content) == greedy.message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token  # greedy picks the most likely
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob) and t.logprob <= 0
        assert t.bytes == list(t.token.encode()) and np.all(np.diff([x.logprob for x in t.top_logprobs]) <= 0)
    text = greedy.message.content
    stop = text[3:5]
    cut = client.chat.completions.create(model="tiny", messages=HI, max_tokens=8, temperature=0, stop=[stop]).choices[0]
    assert cut.message.content == text[: text.index(stop)] and cut.finish_reason == "stop"


def test_tokenize_and_detokenize_are_vllms(url, client, tiny):
    """vLLM's /tokenize counts what a request would send: a prompt as /v1/completions encodes it,
    chat messages as /v1/chat/completions renders them (its usage.prompt_tokens); /detokenize inverts."""
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as http:
        r = http.post("/tokenize", json={"model": "tiny", "prompt": "Pack my box", "return_token_strs": True}).json()
        ids = tiny.tokenizer.encode("Pack my box")
        assert r == {"count": len(ids), "max_model_len": 32, "tokens": ids,
                     "token_strs": tiny.tokenizer.convert_ids_to_tokens(ids)}
        chat = http.post("/tokenize", json={"messages": HI}).json()
        usage = client.chat.completions.create(model="tiny", messages=HI, max_tokens=2, temperature=0).usage
        assert chat["tokens"] == tiny.tokenizer.encode(HI_TEXT) and chat["count"] == usage.prompt_tokens
        bare = http.post("/tokenize", json={"messages": HI, "add_generation_prompt": False}).json()
        assert bare["tokens"] == tiny.tokenizer.encode("User: hi\n\n") and chat["token_strs"] is None
        assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "Pack my box"}
        for path, body, param, message in [
                ("/tokenize", {"prompt": "hi", "messages": HI}, "prompt", "exactly one of prompt or messages"),
                ("/tokenize", {}, "prompt", "exactly one of prompt or messages"),
                ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "must be one of"),
                ("/detokenize", {"tokens": [5, 99999]}, "tokens", "token ids must be in [0, 300)"),
                ("/detokenize", {"tokens": "abc"}, "tokens", "tokens")]:
            answer = http.post(path, json=body)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
            assert message in answer.json()["error"]["message"], answer.text
    assert httpx.post(f"{url}/tokenize", json={"prompt": "hi"}).status_code == 401  # the API key guards it


SHOUTING = "{% for m in messages %}{{ m['content'] }}{% if shout %}!{% endif %}|{% endfor %}"


def test_continue_final_message_and_template_kwargs_render_as_transformers_does(url, client, gen, tiny, engine):
    """vLLM's fields beside `messages`: the reply goes on with the last message (no new turn), and
    `chat_template_kwargs` are the template's variables (as `enable_thinking` is Qwen 3's)."""
    started = [("plain", url, PLAIN_TEMPLATE, {}),
               ("kwargs", start_server(create_app(engine, model_name="tiny", api_key=KEY, chat_template=SHOUTING)),
                SHOUTING, {"shout": True})]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Pack my"}]
    try:
        for name, base, template, variables in started:
            base = base if isinstance(base, str) else base[1]
            fields = {"add_generation_prompt": False, "continue_final_message": True,
                      **({"chat_template_kwargs": variables} if variables else {})}
            expected = tiny.tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True,
                                                          return_dict=False, continue_final_message=True, **variables)
            r = httpx.post(f"{base}/tokenize", json={"messages": messages, **fields},
                           headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
            assert r.json()["tokens"] == expected, name
            assert tiny.tokenizer.decode(expected) == {"plain": "User: hi\n\nAssistant: Pack my",
                                                       "kwargs": "hi!|Pack my"}[name]
            c = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=60)
            answer = c.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                               extra_body=fields)
            assert answer.choices[0].message.content == library_text(gen, tiny, [expected], max_new_tokens=6)[0]
            assert answer.usage.prompt_tokens == len(expected)
    finally:
        started[1][1][0].should_exit = True


BAD = [
    ({}, "messages", "messages: Field required"),
    ({"messages": []}, "messages", "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "must be one of"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type", "only text parts"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content", "not valid Unicode"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "a\udfffb"}]},
     "messages[1].content", "position 1"),
    ({"messages": HI, "stop": ["ok", "\ud800"]}, "stop[1]", "not valid Unicode"),
    ({"messages": HI, "max_tokens": 20}, "messages", "does not fit the model's context of 32 tokens"),
    ({"messages": [{"role": "user", "content": "fox " * 20}]}, "messages", "does not fit"),
    ({"messages": HI, "max_completion_tokens": 0}, "max_completion_tokens", "at least 1"),
    ({"messages": HI, "temperature": -1}, "temperature", "temperature"),
    ({"messages": HI, "top_p": 0}, "top_p", "top_p"),
    ({"messages": HI, "min_p": -0.1}, "min_p", "min_p must be in [0, 1]"),
    ({"messages": HI, "n": 17}, "n", "n"),
    ({"messages": HI, "top_logprobs": 2}, "top_logprobs", "requires logprobs: true"),
    ({"messages": HI, "logprobs": True, "top_logprobs": 6}, "top_logprobs", "top_logprobs"),
    ({"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice",
     "--tool-call-parser"),  # "auto" by default; more in tests/test_serve_replies.py
    ({"messages": HI, "response_format": {"type": "xml"}}, "response_format.type", "must be text, json_object or"),
    ({"messages": HI, "stream": "yes"}, "stream", "stream"),
    ({"messages": HI, "logit_bias": {"x": 1}}, "logit_bias", "keys must be token ids, got 'x'"),
    ({"messages": HI, "logit_bias": {"5": 101}}, "logit_bias", "logit_bias['5']: the bias must be in [-100, 100]"),
    ({"messages": HI, "max_tokens": 4, "min_tokens": 5}, "min_tokens",
     "min_tokens must be an integer in [0, max_tokens=4]"),
    ({"messages": HI, "continue_final_message": True}, "continue_final_message", "add_generation_prompt to false"),
    ({"messages": HI, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools", "set by the server"),
    ({"messages": HI, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages", "set by the server"),
    ({"messages": HI, "chat_template_kwargs": ["x"]}, "chat_template_kwargs", "dictionary"),
]


@pytest.mark.parametrize("body,param,message", BAD, ids=[b[1] for b in BAD])
def test_bad_chat_requests_are_400_naming_the_field(url, body, param, message):
    r = httpx.post(f"{url}/v1/chat/completions", content=json.dumps(body),  # json.dumps keeps "\ud800" escaped
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"] and error["type"] == "invalid_request_error", error


def test_openai_client_raises_bad_request_with_the_param(client, engine):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=30)
    assert e.value.status_code == 400 and e.value.body["param"] == "messages"
    wait_idle(engine)
