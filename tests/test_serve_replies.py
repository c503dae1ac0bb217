"""What a chat reply's text becomes: tool calls (`tools`, `tool_choice`, `parallel_tool_calls`)
and a reasoning model's thinking apart from its answer (`--reasoning-parser`).

Oracles: transformers' `apply_chat_template(tools=...)` for the prompt; the library's generation
under the grammar a forced choice implies for the reply; `jsonschema` for the arguments; the
official openai client, whose stream accumulator (`chat.completions.stream`) rebuilds the calls
from the chunks, for the answer's shape. A tiny GPT-J with a 768-token context (tool schemas are
long in its 300-token vocabulary) and the plain template, which lists the tools.
"""
from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace
from typing import Optional

import httpx
import jsonschema
import llguidance
import llguidance.hf
import openai
import pytest

from mesh_transformer.generate import SamplingOptions
from mesh_transformer.generate.structured import JSON_DUMPS, Grammar
from mesh_transformer.serve import PLAIN_TEMPLATE, create_app, reasoning, tools
from mesh_transformer.serve import chat as chat_api
from mesh_transformer.serve.chat import Shape, StreamedReply
from tests.helpers import COMMA, END_THINK_ID, THINK_ID, in_pieces  # tiny_long's vocabulary (tests/conftest.py)
from tests.serving import KEY, start_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"enum": [1, 2, 3]}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "user", "content": "Weather?"}]


TEXT_PARSERS = [p for p in tools.PARSERS if p != "openai"]  # (GPT-OSS's reads harmony: its own tests, below)


@pytest.fixture(scope="module")
def servers(long_engine):
    """{parser name or None: base url}, each app over the one engine."""
    started = {parser: start_server(create_app(long_engine, model_name="tiny", api_key=KEY, tool_parser=parser))
               for parser in (None, *TEXT_PARSERS)}
    yield {parser: base for parser, (_, base) in started.items()}
    for server, _ in started.values():
        server.should_exit = True


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)


def prompt_ids(tiny, messages: list[dict], tool_specs: list[dict]) -> list[int]:
    """transformers' rendering and encoding of the conversation (the oracle for the server's prompt)."""
    return tiny.tokenizer.apply_chat_template(messages, tools=tool_specs, chat_template=PLAIN_TEMPLATE,
                                              add_generation_prompt=True, tokenize=True, return_dict=False)


def library(tiny_long, ids: list[int], grammar: Optional[Grammar], new: int, **kw) -> tuple[str, str]:
    tiny, gen = tiny_long
    opts = SamplingOptions(max_new_tokens=new, temperature=0.0, eos_token_id=tiny.eos, grammar=grammar, **kw)
    seq = gen.generate([ids] * 4, opts, tiny.tokenizer)[0]
    return seq.text, seq.finish_reason


def field(obj, name: str):
    """A message's or delta's field the openai client may not declare (then in `model_extra`)."""
    return getattr(obj, name, None) if name in type(obj).model_fields else (obj.model_extra or {}).get(name)


def streamed(c: openai.OpenAI, **kw):
    """The completion the openai client's stream accumulator builds from the chunks."""
    with c.chat.completions.stream(**kw) as stream:
        return stream.get_final_completion()


# --------------------------------------------------------------------------------------------
# Reading calls from text: each parser, whole and streamed in pieces
# --------------------------------------------------------------------------------------------

TEXTS = [  # (parser, model text, content, [(name, arguments)])
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
               '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
     "Let me look.\n\n", [("get_weather", '{"city": "Oslo", "days": 2}'), ("now", "{}")]),
    ("hermes", '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n', None, [("now", "{}")]),
    ("hermes", '<tool_call>{"name": "now", "arguments": {"tz": "ütc"}}', None, [("now", '{"tz": "ütc"}')]),  # unclosed at the end
    ("hermes", "a <tool_call>not json</tool_call> b <tool_", "a <tool_call>not json</tool_call> b <tool_", []),
    ("hermes", "The weather is fine.", "The weather is fine.", []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 1}}; '
                    '{"name": "now", "parameters": {}}', None,
     [("get_weather", '{"city": "Paris", "days": 1}'), ("now", "{}")]),
    ("llama3_json", ' {"name": "now", "parameters": {}}', None, [("now", "{}")]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", "It is {sunny}.", "It is {sunny}.", []),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}, '
                '{"name": "now", "arguments": {}}]', "Sure. ",
     [("get_weather", '{"city": "Oslo", "days": 3}'), ("now", "{}")]),
    ("mistral", "[TOOL_CALLS] [oops", "[TOOL_CALLS] [oops", []),
    ("mistral", "No tools [TOOL", "No tools [TOOL", []),
    ("mistral", '[TOOL_CALLS][{"name": "now", "arguments": {}}]\n\nDone.', "\n\nDone.", [("now", "{}")]),
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "days": 1}[TOOL_CALLS]now[ARGS]{}', "Sure.",
     [("get_weather", '{"city": "Oslo", "days": 1}'), ("now", "{}")]),  # tokenizer v11's form
    ("mistral", "[TOOL_CALLS]now[ARGS]soon", "[TOOL_CALLS]now[ARGS]soon", []),
    ("hermes", '<tool_call>{"name": "now", "arguments": "{\\"tz\\": \\"utc\\"}"}</tool_call>', None,
     [("now", '{"tz": "utc"}')]),  # arguments as JSON text of an object, taken
    ("hermes", '<tool_call>{"name": "now", "arguments": "soon"}</tool_call>',
     '<tool_call>{"name": "now", "arguments": "soon"}</tool_call>', []),  # not an object: not a call
    ("hermes", '<tool_call>{"name": "now", "arguments": {"t": NaN}}</tool_call>',
     '<tool_call>{"name": "now", "arguments": {"t": NaN}}</tool_call>', []),  # JSON has no NaN
    *[(parser, text, text, []) for parser, text in (  # nested deeper than Python's JSON reader goes: text
        ("hermes", "<tool_call>" + "[" * 3000 + "</tool_call>"),
        ("hermes", '<tool_call>{"name": "now", "arguments": ' + "[" * 3000 + "]" * 3000 + "}</tool_call>"),
        ("llama3_json", '{"name": "now", "parameters": ' + "[" * 3000),
        ("mistral", "[TOOL_CALLS]" + "[" * 3000), ("mistral", "[TOOL_CALLS]now[ARGS]" + "[" * 3000))],
]


@pytest.mark.parametrize("parser,text,content,calls", TEXTS, ids=[f"{t[0]}-{i}" for i, t in enumerate(TEXTS)])
def test_a_parser_reads_its_models_calls_whole_and_in_any_pieces(parser, text, content, calls):
    plan = tools.Plan(tuple(tools.read_tools(TOOLS)), "auto", parser=parser)
    message, finish = plan.reply(text, "stop")
    assert message["content"] == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])] == calls
    assert finish == ("tool_calls" if calls else "stop")
    if parser == "mistral":  # Mistral's templates take 9-character ids only
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in message.get("tool_calls", []))
    for size in (1, 2, 3, 7, len(text)):  # streamed: the same content and calls, calls whole, content never taken back
        reader, got, deltas = plan.reader(), {"content": "", "calls": []}, []
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        for i, piece in enumerate(pieces):
            delta = reader.feed(piece, i == len(pieces) - 1)
            deltas.append(delta)
            got["content"] += delta.get("content", "")
            got["calls"] += [(c["function"]["name"], c["function"]["arguments"]) for c in delta.get("tool_calls", [])]
        assert got == {"content": content or "", "calls": calls}, size
        assert reader.finish_reason("stop") == finish


def test_without_parallel_calls_auto_keeps_the_first_call():
    plan = tools.Plan(tuple(tools.read_tools(TOOLS)), "auto", parallel=False, parser="hermes")
    text = '<tool_call>{"name": "now", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", "arguments": {}}'
    message, finish = plan.reply(text + "</tool_call>", "stop")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["now"] and finish == "tool_calls"
    reader = plan.reader()
    deltas = [reader.feed(text, False), reader.feed("</tool_call>", True)]
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", [])] == ["now"]


def test_tools_without_parameters_take_none_and_others_take_objects():
    [bare] = tools.read_tools([{"type": "function", "function": {"name": "now"}}])
    assert bare.parameters == {"type": "object", "properties": {}, "additionalProperties": False}
    [typed] = tools.read_tools([{"type": "function", "function": {"name": "f", "parameters": {"properties": {}}}}])
    assert typed.parameters == {"type": "object", "properties": {}}  # a call's arguments are an object
    [mcp] = tools.read_tools([{"type": "function", "function": {"name": "github.create_issue"}}])  # MCP's names
    assert mcp.name == "github.create_issue"


def test_required_keeps_each_tools_own_references_pointing_into_its_parameters(tiny_long):
    """"required" holds all the tools to one schema: each tool's parameters sit in its `$defs` under an
    `$id` of their own, so their local references (`#/$defs/..`, `#/properties/..`, `#`, `#anchor`)
    resolve inside them: two tools may define one name differently, a recursive tool stays recursive."""
    tiny, _ = tiny_long
    def tool(name, parameters):
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "required": sorted(parameters["properties"]), "additionalProperties": False,
            **parameters}}}
    person = {"type": "object", "properties": {"name": {"enum": ["Ada"]}}, "required": ["name"],
              "additionalProperties": False}
    given = [tool("book", {"properties": {"who": {"$ref": "#/$defs/Person"}}, "$defs": {"Person": person}}),
             tool("pay", {"properties": {"who": {"$ref": "#/$defs/Person"}}, "$defs": {"Person": {"enum": [5]}}}),
             tool("tree", {"properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}),
             tool("same", {"properties": {"a": {"enum": [1, 2]}, "b": {"$ref": "#/properties/a"}}}),
             tool("anchored", {"properties": {"x": {"$ref": "#A"}}, "$defs": {"a": {"$anchor": "A", "enum": [7]}}}),
             tool("owned", {"$id": "https://example.com/t.json", "properties": {"x": {"$ref": "#/$defs/a"}},
                            "$defs": {"a": {"enum": [8]}}})]
    source = tools.Plan(tuple(tools.read_tools(given)), "required").grammar()[1].source()
    view = llguidance.hf.from_tokenizer(tiny.tokenizer)

    def takes(text: str) -> bool:
        matcher = llguidance.LLMatcher(view, source)
        assert not matcher.is_error(), matcher.get_error()
        return all(matcher.consume_token(t) for t in tiny.tokenizer.encode(text)) and matcher.is_accepting()
    assert takes('[{"name": "book", "parameters": {"who": {"name": "Ada"}}}, {"name": "pay", "parameters": {"who": 5}}]')
    assert takes('[{"name": "tree", "parameters": {"kids": [{"kids": []}]}}]')
    assert takes('[{"name": "same", "parameters": {"a": 1, "b": 2}}]')
    assert takes('[{"name": "anchored", "parameters": {"x": 7}}, {"name": "owned", "parameters": {"x": 8}}]')
    assert not takes('[{"name": "pay", "parameters": {"who": {"name": "Ada"}}}]')
    assert not takes('[{"name": "tree", "parameters": {"kids": [[]]}}]')  # "#" is the tool's parameters, not the array


def test_a_named_and_a_required_choice_read_the_reply_held_to_their_grammar():
    named = tools.Plan(tuple(tools.read_tools(TOOLS)), tools.read_tools(TOOLS)[0])
    message, finish = named.reply('{"city": "Oslo", "days": 1}', "stop")
    assert message["content"] is None and finish == "stop"  # OpenAI ends a named call "stop"
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}
    reader = named.reader()
    first, second, last = reader.feed('{"city"', False), reader.feed(': "Oslo"}', False), reader.feed("", True)
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city"'}
    assert first["tool_calls"][0]["id"].startswith("call_") and "id" not in second["tool_calls"][0]
    assert second["tool_calls"][0]["function"] == {"arguments": ': "Oslo"}'} and last == {}
    required = tools.Plan(tuple(tools.read_tools(TOOLS)), "required")
    message, finish = required.reply('[{"name": "now", "parameters": {}}, {"name": "get_weather", '
                                     '"parameters": {"city": "Paris", "days": 3}}]', "stop")
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "now", "arguments": "{}"}, {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}]
    assert finish == "tool_calls" and message["content"] is None
    message, finish = required.reply('[{"name": "now", "param', "length")  # cut short: the text, as content
    assert message == {"role": "assistant", "content": '[{"name": "now", "param'} and finish == "length"


# --------------------------------------------------------------------------------------------
# Over HTTP
# --------------------------------------------------------------------------------------------

def test_tools_and_a_conversation_with_calls_render_as_transformers_renders_them(servers, tiny_long):
    tiny, _ = tiny_long
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Snow."}]
    r = httpx.post(f"{servers[None]}/tokenize", json={"messages": messages, "tools": TOOLS},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    hf_messages = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
                       {"id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "Snow."}]
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == prompt_ids(tiny, hf_messages, TOOLS)
    assert tiny.tokenizer.decode(r.json()["tokens"]) == (
        'Tools (to call one, write <tool_call>{"name": .., "arguments": {..}}</tool_call>):\n'
        + json.dumps(WEATHER["function"]) + "\n" + json.dumps(CLOCK["function"]) + "\n\n"
        'User: Weather?\n\nAssistant: <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}'
        "</tool_call>\n\nTool: Snow.\n\nAssistant:")


def test_a_named_tool_choice_returns_that_call_with_arguments_of_its_schema(servers, tiny_long):
    tiny, _ = tiny_long
    c = client(servers[None])
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=48, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = c.chat.completions.create(**kw)
    [choice] = r.choices
    grammar = Grammar.json_schema(WEATHER["function"]["parameters"], separators=JSON_DUMPS)
    text, finish = library(tiny_long, prompt_ids(tiny, ASK, TOOLS), grammar, 48)
    [call] = choice.message.tool_calls
    assert (call.function.name, call.function.arguments, choice.finish_reason) == ("get_weather", text, finish)
    assert finish == "stop" and choice.message.content is None and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert call.function.arguments == json.dumps(json.loads(call.function.arguments))  # json.dumps' layout
    whole = streamed(c, **kw)  # the arguments streamed as generated, rebuilt by the client
    [again] = whole.choices[0].message.tool_calls
    assert (again.function.name, again.function.arguments) == ("get_weather", text)
    assert whole.choices[0].finish_reason == "stop"

    def call_deltas():  # the chunks themselves: OpenAI's shape
        with httpx.stream("POST", f"{servers[None]}/v1/chat/completions", timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}, json={**kw, "stream": True}) as raw:
            events = [json.loads(line[6:]) for line in raw.iter_lines() if line.startswith("data: {")]
        return [e["choices"][0]["delta"]["tool_calls"][0] for e in events if e["choices"][0]["delta"].get("tool_calls")]

    deltas = in_pieces(call_deltas, len)
    assert len(deltas) > 1 and deltas[0]["index"] == 0 and deltas[0]["type"] == "function"
    assert deltas[0]["id"].startswith("call_") and deltas[0]["function"]["name"] == "get_weather"
    assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in deltas[1:])
    assert "".join(d["function"]["arguments"] for d in deltas) == text


@pytest.mark.parametrize("parallel", [True, False])
def test_a_required_tool_choice_returns_calls_of_the_given_tools(servers, tiny_long, parallel):
    tiny, _ = tiny_long
    c = client(servers[None])
    one = {str(COMMA): -100}  # greedy, the random model calls again and again: a comma only where the grammar must
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=120, temperature=0, tool_choice="required",
              parallel_tool_calls=parallel, logit_bias=one)
    r = c.chat.completions.create(**kw)
    [choice] = r.choices
    grammar = tools.Plan(tuple(tools.read_tools(TOOLS)), "required", parallel).grammar()[1]
    text, finish = library(tiny_long, prompt_ids(tiny, ASK, TOOLS), grammar, 120, logit_bias=((COMMA, -100.0),))
    assert finish == "stop", text
    expected = json.loads(text)
    assert [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls] == [
        (e["name"], e["parameters"]) for e in expected]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments),
                            {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name])
    assert len({t.id for t in choice.message.tool_calls}) == len(choice.message.tool_calls)
    whole = streamed(c, **kw)
    assert [(t.function.name, t.function.arguments) for t in whole.choices[0].message.tool_calls] == [
        (t.function.name, t.function.arguments) for t in choice.message.tool_calls]
    for call in choice.message.tool_calls:
        assert call.function.arguments == json.dumps(json.loads(call.function.arguments))  # json.dumps' layout
    sampled = c.chat.completions.create(**{**kw, "temperature": 1.0, "n": 4, "seed": 5, "logit_bias": None})
    called = [s for s in sampled.choices if s.finish_reason == "tool_calls"]
    assert called  # (others may be cut short by max_tokens)
    for s in called:  # sampled: still calls of the tools given, one at most without parallel calls
        assert s.message.tool_calls and {t.function.name for t in s.message.tool_calls} <= {"get_weather", "now"}
        assert parallel or len(s.message.tool_calls) == 1


AUTO_TEXTS = {  # what a model of each format writes when it calls (forced here: the tiny model is random)
    "hermes": 'On it.<tool_call>{"name": "now", "arguments": {}}</tool_call>',
    "llama3_json": '{"name": "now", "parameters": {}}',
    "mistral": 'On it.[TOOL_CALLS][{"name": "now", "arguments": {}}]',
}


@pytest.mark.parametrize("parser", TEXT_PARSERS)
def test_auto_reads_the_calls_the_server_parser_finds_in_the_text(servers, parser):
    c = client(servers[parser])
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
              extra_body={"structured_outputs": {"choice": [AUTO_TEXTS[parser]]}})
    r = c.chat.completions.create(**kw)
    [choice] = r.choices
    assert choice.finish_reason == "tool_calls"
    assert [(t.function.name, t.function.arguments) for t in choice.message.tool_calls] == [("now", "{}")]
    assert choice.message.content == (None if parser == "llama3_json" else "On it.")
    whole = streamed(c, **kw)
    assert [(t.function.name, t.function.arguments) for t in whole.choices[0].message.tool_calls] == [("now", "{}")]
    assert (whole.choices[0].message.content or None) == choice.message.content
    assert whole.choices[0].finish_reason == "tool_calls"
    plain = c.chat.completions.create(**{**kw, "tool_choice": "none"})  # "none": the text stays text
    assert plain.choices[0].message.content == AUTO_TEXTS[parser] and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "stop"


NINE = ("{% for m in messages %}{% for c in m['tool_calls'] or [] %}{% if c['id'] | length != 9 %}"
        "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
        "[{{ c['id'] }}]{% endfor %}{{ m['content'] }}|{% endfor %}")  # as Mistral's templates check


def test_a_mistral_servers_calls_come_back_to_its_template_in_the_next_turn(long_engine):
    server, base = start_server(create_app(long_engine, model_name="tiny", api_key=KEY, chat_template=NINE,
                                           tool_parser="mistral"))
    try:
        c = client(base)
        kw = dict(model="tiny", tools=TOOLS, max_tokens=80, temperature=0, parallel_tool_calls=False)
        for choice in ("required", {"type": "function", "function": {"name": "now"}}):
            r = c.chat.completions.create(messages=ASK, tool_choice=choice, **kw)
            [call, *_] = r.choices[0].message.tool_calls
            assert len(call.id) == 9 and call.id.isalnum()
            turn = [*ASK, r.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "noon"}]
            again = c.chat.completions.create(messages=turn, tool_choice="none", **{**kw, "max_tokens": 4})
            assert again.choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.BadRequestError, match="length 9"):  # what another server's ids would meet
            c.chat.completions.create(messages=[*ASK, {"role": "assistant", "tool_calls": [
                {"id": "call_0123456789", "type": "function", "function": {"name": "now", "arguments": "{}"}}]}],
                tool_choice="none", **kw)
    finally:
        server.should_exit = True


def test_auto_without_a_call_in_the_text_is_plain_content(servers):
    c = client(servers["hermes"])
    r = c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=6, temperature=0)
    free = c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=6, temperature=0,
                                     tool_choice="none")
    assert r.choices[0].message.content == free.choices[0].message.content and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == free.choices[0].finish_reason


BAD = [
    ({"tools": [{"type": "retrieval"}], "tool_choice": "none"}, "tools[0].type", "only function tools"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "none"}, "tools[0].function.name",
     "letters, digits"),
    ({"tools": [CLOCK, CLOCK], "tool_choice": "none"}, "tools[1].function.name", "earlier tool"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": [1]}}], "tool_choice": "none"},
     "tools[0].function.parameters", "JSON schema"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "got 'sometimes'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "later"}}}, "tool_choice.function.name",
     "no tool is named 'later' (tools: get_weather, now)"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS}, "tool_choice", "--tool-call-parser"),
    ({"tools": [CLOCK, {"type": "function", "function": {"name": "bad", "parameters": {"properties": {"x": {"type": "foo"}}}}}],
      "tool_choice": "required"}, "tools[1].function.parameters", "foo"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "none", "messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "now", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "not JSON"),
    ({"functions": [CLOCK["function"]]}, "functions", "use tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
      "tool_choice": "none"}, "tools[0].function.parameters.type", "arguments are an object"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "now", "arguments": "{}"}}]}]},
     "messages[0].tool_calls", "only assistant"),
]


@pytest.mark.parametrize("extra,param,message", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_a_bad_tool_request_is_a_400_naming_the_field(servers, extra, param, message):
    r = httpx.post(f"{servers[None]}/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **extra},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_an_unknown_parser_is_refused_when_the_app_is_made(long_engine):
    with pytest.raises(ValueError, match="tool_parser: one of hermes, llama3_json, mistral, openai, got 'qwen'"):
        create_app(long_engine, tool_parser="qwen")
    with pytest.raises(ValueError, match="reasoning_parser: one of deepseek_r1, qwen3, openai_gptoss, got 'o1'"):
        create_app(long_engine, reasoning_parser="o1")
    with pytest.raises(ValueError, match="tool_parser 'openai' reads GPT-OSS's harmony messages, which the reasoning "
                                         "parser splits: start the server with reasoning_parser 'openai_gptoss' too"):
        create_app(long_engine, tool_parser="openai")


# --------------------------------------------------------------------------------------------
# Reasoning apart from the answer
# --------------------------------------------------------------------------------------------

R1 = "<｜Assistant｜><think>\n"  # generation prompts: R1's opens the block,
QWEN3 = "<|im_start|>assistant\n"  # Qwen 3's lets the reply open one,
QWEN3_OFF = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # and with enable_thinking false closes it
THOUGHTS = [  # (parser, the text before the reply, reply, reasoning, answer)
    ("deepseek_r1", R1, "Two and two.\n</think>\n\nFour.", "Two and two.\n", "\n\nFour."),
    ("deepseek_r1", QWEN3, "<think>\nsum\n</think>Four", "\nsum\n", "Four"),
    ("deepseek_r1", QWEN3, "sum</think>Four", "sum", "Four"),  # R1 may leave out <think>
    ("deepseek_r1", R1, "Still thinking about </thi", "Still thinking about </thi", ""),  # cut short
    ("deepseek_r1", QWEN3_OFF, '{"a": 1}', "", '{"a": 1}'),  # thinking off: all answer
    ("qwen3", QWEN3, "<think>sum</think>\n\nFour.", "sum", "\n\nFour."),
    ("qwen3", QWEN3_OFF, "Four.", "", "Four."),
    ("qwen3", QWEN3, "Four.", "", "Four."),
    ("qwen3", R1, "sum</think>Four", "sum", "Four"),  # a template that opens the block
    ("qwen3", QWEN3, "<thinker> is a word", "", "<thinker> is a word"),
    ("qwen3", QWEN3, "  <think>cut", "cut", ""),
]


def assert_read_in_any_pieces(thinking, text: str, expected: tuple[str, str]):
    """`thinking` splits `text` into `expected` (reasoning, answer) whole, and streamed in pieces of
    1, 2, 5 and all characters (each part only grows)."""
    assert thinking.split(text, final=True) == expected
    for size in (1, 2, 5, len(text)):
        reader, got = reasoning.Reader(thinking), ["", ""]
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        for i, piece in enumerate(pieces):
            new = reader.feed(piece, i == len(pieces) - 1)
            got = [got[0] + new[0], got[1] + new[1]]
        assert tuple(got) == expected, size


@pytest.mark.parametrize("parser,start,text,thought,answer", THOUGHTS,
                         ids=[f"{t[0]}-{i}" for i, t in enumerate(THOUGHTS)])
def test_reasoning_is_told_from_the_answer_whole_and_in_any_pieces(parser, start, text, thought, answer):
    thinking = reasoning.Thinking.of(parser, start)
    assert thinking.prompt == {R1: "opened", QWEN3: "", QWEN3_OFF: "closed"}[start]
    assert_read_in_any_pieces(thinking, text, (thought, answer))
    grammar = Grammar.choice(YES_NO)
    assert (thinking.hold(grammar) == grammar) == (start == QWEN3_OFF)  # no thinking: the grammar from the start


ANALYSIS, FINAL = "<|channel|>analysis<|message|>", "<|start|>assistant<|channel|>final<|message|>"
HARMONY = [  # GPT-OSS's replies (the template's generation prompt wrote the first <|start|>assistant): reasoning, answer
    (ANALYSIS + "User asks 2+2.<|end|>" + FINAL + "Four.", "User asks 2+2.", "Four."),
    ("<|channel|>final<|message|>Just this.", "", "Just this."),  # no thinking
    (ANALYSIS + "Need the weather.<|end|><|start|>assistant<|channel|>commentary to=functions.weather <|constrain|>json"
     '<|message|>{"city": "Oslo"}', "Need the weather.", ""),  # a tool's message (no tool parser reads it): neither
    (ANALYSIS + "a<|end|><|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" + FINAL + "Done.<|end|>"
     + ANALYSIS.replace("<|channel|>", "<|start|>assistant<|channel|>") + "b",
     "a\nb", "Checking.\nDone."),  # a preamble (commentary to no tool) is answer; a part's bodies a line apart
    (ANALYSIS + "x < y, and <|im not a marker", "x < y, and <|im not a marker", ""),  # cut short while thinking
    (ANALYSIS + "Hm<|end|><|start|>assistant<|channel|>fin", "Hm", ""),  # cut inside the next header
    ("No channels at all.", "", "No channels at all."),  # a model that does not write harmony: all answer
]


@pytest.mark.parametrize("text,thought,answer", HARMONY)
def test_harmony_channels_are_told_apart_whole_and_in_any_pieces(text, thought, answer):
    """--reasoning-parser openai_gptoss: the analysis channel is the reasoning, the final channel
    (and commentary to no tool) the answer, in any pieces (each part only grows: a piece that may
    be the start of a marker waits for the next); neither a budget nor a grammar can be held after
    its thinking, and its end is the answer's header."""
    thinking = reasoning.Thinking.of(reasoning.HARMONY, "<|start|>assistant")
    assert_read_in_any_pieces(thinking, text, (thought, answer))
    assert not thinking.can_hold and not thinking.can_cap
    assert thinking.ended(text) == ("<|channel|>" in text and (answer != "" or "to=functions" in text))


def test_a_harmony_server_refuses_what_it_cannot_hold_and_answers_plain_text(long_engine, tiny_long):
    """With --reasoning-parser openai_gptoss a reply's format (its answer starts after a header of
    several tokens) and a thinking budget are 400s naming the field; a reply with no channel (the
    tiny model writes none) is all answer, whole and streamed; the message's fields are chat's."""
    tiny, _ = tiny_long
    server, base = start_server(create_app(long_engine, model_name="tiny", api_key=KEY, chat_template=THINKS,
                                           reasoning_parser=reasoning.HARMONY))
    try:
        c = client(base)
        kw = dict(model="tiny", messages=ASK, max_tokens=8, temperature=0)
        for extra, where in (({"response_format": {"type": "json_object"}}, "response_format"),
                             ({"extra_body": {"structured_outputs": {"choice": YES_NO}}}, "structured_outputs")):
            with pytest.raises(openai.BadRequestError, match=f"{where}: a reply's format is not held after the "
                                                             f"thinking of --reasoning-parser openai_gptoss"):
                c.chat.completions.create(**kw, **extra)
        with pytest.raises(openai.BadRequestError, match="thinking_token_budget: not with --reasoning-parser"):
            c.chat.completions.create(**kw, extra_body={"thinking_token_budget": 3})
        for choice in ("required", {"type": "function", "function": {"name": "now"}}):
            with pytest.raises(openai.BadRequestError, match='tool_choice: a forced call is not held after the thinking '
                                                             'of --reasoning-parser openai_gptoss .*use "auto"'):
                c.chat.completions.create(**kw, tools=TOOLS, tool_choice=choice)
        r = c.chat.completions.create(**kw)
        expected, _ = library(tiny_long, hf_ids(tiny, ASK), None, 8)
        assert r.choices[0].message.content == expected and field(r.choices[0].message, "reasoning") is None
        chunks = list(c.chat.completions.create(stream=True, **kw))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == expected
    finally:
        server.should_exit = True
    shape = Shape(None, reasoning.Thinking.of(reasoning.HARMONY, "<|start|>assistant"))
    message, finish = shape.message(HARMONY[0][0], "stop")
    assert (message["reasoning"], message["reasoning_content"], message["content"], finish) == (
        "User asks 2+2.", "User asks 2+2.", "Four.", "stop")


def test_harmony_calls_are_read_from_the_tools_messages_after_the_reasoning():
    """--reasoning-parser openai_gptoss with --tool-call-parser openai: each message to a tool is a
    call (its recipient the name, its body the arguments), the preamble content, the analysis the
    reasoning; whole and streamed alike (a call arrives whole once the reply ends: `<|call|>` stops it)."""
    plan = tools.Plan(tuple(tools.read_tools(TOOLS)), "auto", parser="openai")
    server = SimpleNamespace(reasoning_parser=reasoning.HARMONY)
    prompt = "<|start|>user<|message|>Weather?<|end|><|start|>assistant"
    thinking = chat_api._thinking(server, ASK, None, None, prompt, plan)
    assert thinking.tool_messages and thinking.prompt == ""
    assert not chat_api._thinking(server, ASK, None, None, prompt, dataclasses.replace(plan, choice="none")).tool_messages
    shape = Shape(plan, thinking)
    text = (ANALYSIS + "Time and weather.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
            "<|start|>assistant<|channel|>commentary to=functions.now <|constrain|>json<|message|>{}<|call|>"
            "<|start|>assistant to=functions.weather<|channel|>commentary json<|message|>{\"city\": \"Oslo\"}")
    message, finish = shape.message(text, "stop")
    assert (message["reasoning"], message["content"], finish) == ("Time and weather.", "Checking.", "tool_calls")
    calls = [c["function"] for c in message["tool_calls"]]
    assert calls == [{"name": "now", "arguments": "{}"}, {"name": "weather", "arguments": '{"city": "Oslo"}'}]
    reply, got = StreamedReply(shape), {"reasoning": "", "content": "", "calls": []}
    for i in range(0, len(text), 4):
        delta = reply.feed(text[i:i + 4], i + 4 >= len(text))
        got["reasoning"] += delta.get("reasoning", "")
        got["content"] += delta.get("content", "")
        got["calls"] += [c["function"] for c in delta.get("tool_calls", [])]
    assert got == {"reasoning": "Time and weather.", "content": "Checking.", "calls": calls}
    bad = shape.message(ANALYSIS + "x<|end|><|start|>assistant<|channel|>commentary to=functions.now<|message|>[1]",
                        "stop")[0]  # arguments that are not an object: no call, the text stays
    assert not bad.get("tool_calls") and bad["content"].endswith("to=functions.now<|message|>[1]")


# How GPT-OSS's released template renders a turn that calls tools: its analysis from `content` or
# `thinking` (transformers hands it `reasoning_content` as `thinking`), refusing both
HARMONY_CALLS = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and m['tool_calls'] %}"
    "{% if m['content'] and m['thinking'] %}{{ raise_exception('Cannot pass both content and thinking') }}"
    "{% elif m['content'] %}<|start|>assistant<|channel|>analysis<|message|>{{ m['content'] }}<|end|>"
    "{% elif m['thinking'] %}<|start|>assistant<|channel|>analysis<|message|>{{ m['thinking'] }}<|end|>{% endif %}"
    "{% for c in m['tool_calls'] %}<|start|>assistant to=functions.{{ c['function']['name'] }}<|channel|>commentary"
    " json<|message|>{{ c['function']['arguments'] | tojson }}<|call|>{% endfor %}"
    "{% else %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}<|start|>assistant")


def test_a_harmony_servers_earlier_call_with_a_preamble_renders_as_one_analysis(long_engine, tiny_long):
    """A reply this parser split into a preamble (content), reasoning and calls comes back in the next
    request as it was returned; GPT-OSS's template refuses a calling turn with both content and
    thinking, so the server hands it one analysis: the reasoning, then the preamble."""
    tiny, _ = tiny_long
    server, base = start_server(create_app(long_engine, model_name="tiny", api_key=KEY, chat_template=HARMONY_CALLS,
                                           reasoning_parser=reasoning.HARMONY))
    call = {"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{}"}}
    turn = [*ASK, {"role": "assistant", "content": "Checking.", "reasoning": "Look at the clock.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "noon"}]
    merged = [*ASK, {"role": "assistant", "content": "", "reasoning_content": "Look at the clock.\nChecking.",
                     "tool_calls": [{**call, "function": {"name": "now", "arguments": {}}}]},
              {"role": "tool", "tool_call_id": "c1", "content": "noon"}]
    try:
        r = client(base).chat.completions.create(model="tiny", messages=turn, max_tokens=2, temperature=0)
        assert r.usage.prompt_tokens == len(tiny.tokenizer.apply_chat_template(
            merged, chat_template=HARMONY_CALLS, tokenize=True, add_generation_prompt=True, return_dict=False))
        assert "analysis<|message|>Look at the clock.\nChecking.<|end|>" in tiny.tokenizer.apply_chat_template(
            merged, chat_template=HARMONY_CALLS, tokenize=False, add_generation_prompt=True)
    finally:
        server.should_exit = True
    with pytest.raises(Exception, match="Cannot pass both content and thinking"):  # what the server avoids
        tiny.tokenizer.apply_chat_template([*ASK, {**turn[1], "reasoning_content": "Look."}], chat_template=HARMONY_CALLS,
                                           tokenize=False)


def test_harmony_reply_that_goes_on_with_a_prefilled_body_keeps_its_channel():
    prefill = "<|start|>assistant<|channel|>analysis<|message|>Let me"  # continue_final_message, inside a body
    rendered = "<|start|>user<|message|>2+2?<|end|>" + prefill  # (the server reads the rendered prompt)
    thinking = chat_api._thinking(SimpleNamespace(reasoning_parser=reasoning.HARMONY), ASK, None, None, rendered, None)
    assert thinking.prompt == "analysis"
    assert thinking.split(" add.<|end|>" + FINAL + "Four.", final=True) == (" add.", "Four.")
    assert reasoning.Thinking.of(reasoning.HARMONY, prefill + " add.<|end|>").prompt == ""  # that body ended


def test_tool_calls_are_read_from_the_answer_after_the_reasoning():
    opened = reasoning.Thinking("deepseek_r1", "opened")
    shape = Shape(tools.Plan(tuple(tools.read_tools(TOOLS)), "auto", parser="hermes"), opened)
    text = 'They want <tool_call>s.</think>Checking.<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    message, finish = shape.message(text, "stop")
    assert message["reasoning"] == message["reasoning_content"] == "They want <tool_call>s."  # not read for calls
    assert message["content"] == "Checking." and finish == "tool_calls"
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "now", "arguments": "{}"}]
    reply, got = StreamedReply(shape), {"reasoning": "", "content": "", "calls": []}
    for i in range(0, len(text), 3):
        delta = reply.feed(text[i:i + 3], i + 3 >= len(text))
        assert delta.get("reasoning") == delta.get("reasoning_content")
        got["reasoning"] += delta.get("reasoning", "")
        got["content"] += delta.get("content", "")
        got["calls"] += [c["function"] for c in delta.get("tool_calls", [])]
    assert got == {"reasoning": "They want <tool_call>s.", "content": "Checking.",
                   "calls": [{"name": "now", "arguments": "{}"}]}
    assert reply.finish_reason("stop") == "tool_calls"
    thinking_only = Shape(None, opened).message("Hmm", "length")
    assert thinking_only == ({"role": "assistant", "content": None, "reasoning": "Hmm", "reasoning_content": "Hmm"},
                             "length")


def test_a_named_call_after_thinking_starts_with_its_arguments():
    named = Shape(tools.Plan(tuple(tools.read_tools(TOOLS)), tools.read_tools(TOOLS)[1]),
                  reasoning.Thinking("deepseek_r1", "opened"))
    message, finish = named.message("Time?</think>\n\n{}", "stop")
    assert message["tool_calls"][0]["function"] == {"name": "now", "arguments": "{}"} and finish == "stop"
    assert message["reasoning"] == "Time?"
    reply = StreamedReply(named)
    thinking = [reply.feed("Time?", False), reply.feed("</think>\n", False)]
    assert all("tool_calls" not in d for d in thinking)  # no call before its arguments begin
    assert reply.feed("\n{}", True)["tool_calls"][0]["function"] == {"name": "now", "arguments": "{}"}
    cut = named.message("Still thinking", "length")  # cut short while thinking: no call
    assert cut == ({"role": "assistant", "content": None, "reasoning": "Still thinking",
                    "reasoning_content": "Still thinking"}, "length")


YES_NO = ["yes", "no"]
THINKS = ("{% for m in messages %}{% if m['reasoning_content'] %}({{ m['reasoning_content'] }}){% endif %}"
          "{{ m['content'] }}|{% endfor %}{% if add_generation_prompt %}{% if enable_thinking is defined and "
          "not enable_thinking %}<think></think>{% else %}<think>{% endif %}{% endif %}")  # R1's / Qwen 3's way


def hf_ids(tiny, messages, **variables) -> list[int]:
    return tiny.tokenizer.apply_chat_template(messages, chat_template=THINKS, tokenize=True, return_dict=False,
                                              add_generation_prompt=True, **variables)


@pytest.mark.parametrize("parser", [p for p in reasoning.PARSERS if p != reasoning.HARMONY])  # (<think> parsers)
def test_a_reasoning_parser_returns_the_thinking_as_reasoning(long_engine, tiny_long, parser):
    """The template opens the block and the tiny model never closes it: all of its reply is
    reasoning (cut short by max_tokens). Made to close it at once (a logit bias on the `</think>`
    token), a grammar holds the answer after it. With thinking off, all of the reply is answer."""
    tiny, gen = tiny_long
    server, base = start_server(create_app(long_engine, model_name="tiny", api_key=KEY, chat_template=THINKS,
                                           reasoning_parser=parser))
    try:
        c = client(base)
        kw = dict(model="tiny", messages=ASK, max_tokens=12, temperature=0)
        r = c.chat.completions.create(**kw)
        [choice] = r.choices
        ids = hf_ids(tiny, ASK)
        assert tiny.tokenizer.decode(ids) == "Weather?|<think>" and ids[-1] == THINK_ID  # the marker: one token
        expected, _ = library(tiny_long, ids, None, 12)
        assert "</think>" not in expected and choice.finish_reason == "length"
        assert choice.message.content is None
        assert field(choice.message, "reasoning") == field(choice.message, "reasoning_content") == expected
        chunks = in_pieces(lambda: list(c.chat.completions.create(stream=True, **kw)),
                           lambda got: len([ch for ch in got if ch.choices and field(ch.choices[0].delta, "reasoning")]))
        pieces = [field(ch.choices[0].delta, "reasoning") or "" for ch in chunks if ch.choices]
        assert "".join(pieces) == expected and len([p for p in pieces if p]) > 1
        assert all(not ch.choices[0].delta.content for ch in chunks if ch.choices)

        closing = {str(END_THINK_ID): 100}  # the model closes the block at once; the grammar holds what follows
        held = c.chat.completions.create(**{**kw, "max_tokens": 20}, logit_bias=closing,
                                         extra_body={"structured_outputs": {"choice": YES_NO}})
        thinking = reasoning.Thinking.of(parser, "<think>", tiny.tokenizer)
        assert (thinking.prompt, thinking.closer_id) == ("opened", END_THINK_ID)
        text, finish = library(tiny_long, ids, thinking.hold(Grammar.choice(YES_NO)), 20,
                               logit_bias=((END_THINK_ID, 100.0),))
        assert text.startswith("</think>") and text[len("</think>"):].strip() in YES_NO and finish == "stop"
        assert (field(held.choices[0].message, "reasoning"), held.choices[0].message.content) == (
            None, text[len("</think>"):])
        assert held.choices[0].finish_reason == "stop"

        off = {"chat_template_kwargs": {"enable_thinking": False}}  # the prompt closes the block: no reasoning
        plain = c.chat.completions.create(**kw, extra_body=off)
        closed_ids = hf_ids(tiny, ASK, enable_thinking=False)
        assert plain.choices[0].message.content == library(tiny_long, closed_ids, None, 12)[0]
        assert field(plain.choices[0].message, "reasoning") is None
        answer = c.chat.completions.create(**kw, extra_body={**off, "structured_outputs": {"choice": YES_NO}})
        assert answer.choices[0].message.content == library(tiny_long, closed_ids, Grammar.choice(YES_NO), 12)[0]

        earlier = [*ASK, {"role": "assistant", "content": "Sunny.", "reasoning": "Look it up."}, *ASK]
        hf_earlier = [*ASK, {"role": "assistant", "content": "Sunny.", "reasoning_content": "Look it up."}, *ASK]
        assert c.chat.completions.create(**{**kw, "messages": earlier}).usage.prompt_tokens == len(
            hf_ids(tiny, hf_earlier)) == len(tiny.tokenizer.encode("Weather?|(Look it up.)Sunny.|Weather?|")) + 1
    finally:
        server.should_exit = True


def test_a_reply_may_open_its_own_block_or_answer_at_once_under_a_grammar(long_engine, tiny_long):
    """qwen3 with a template that does not open the block: the reply may open one (the grammar then
    holds what follows it) or answer at once (here: made to, a bias against `<think>`)."""
    tiny, _ = tiny_long
    server, base = start_server(create_app(long_engine, model_name="tiny", api_key=KEY, reasoning_parser="qwen3"))
    try:
        kw = dict(model="tiny", messages=ASK, max_tokens=20, temperature=0,
                  extra_body={"structured_outputs": {"choice": YES_NO}})
        ids = prompt_ids(tiny, ASK, None)
        thinking = reasoning.Thinking.of("qwen3", "Assistant:", tiny.tokenizer)
        for bias in (-100.0, 100.0):
            r = client(base).chat.completions.create(**kw, logit_bias={str(THINK_ID): bias})
            text, finish = library(tiny_long, ids, thinking.hold(Grammar.choice(YES_NO)), 20,
                                   logit_bias=((THINK_ID, bias),))
            thought, answer = thinking.split(text, final=True)
            message = r.choices[0].message
            assert (field(message, "reasoning"), message.content, r.choices[0].finish_reason) == (
                thought or None, answer or None, finish)
            if bias < 0:
                assert answer in YES_NO and finish == "stop" and not thought
            else:
                assert text.startswith("<think>")  # opened: thinking until `max_tokens` (the model never closes it)
    finally:
        server.should_exit = True
