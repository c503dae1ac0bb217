"""`/v1/responses`: OpenAI's Responses API over the chat machinery.

Oracles: transformers' `apply_chat_template` for the prompt a request's items make; the library's
generation from it (under the grammar a forced call or `text.format` implies) for the reply;
`jsonschema` for structured text; /v1/chat/completions for what both APIs share; and the official
openai client: its typed `Response`, and its stream accumulator (`responses.stream`), which checks
the events' order and items and rebuilds the response from them.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest

from mesh_transformer.generate import SamplingOptions
from mesh_transformer.generate.structured import JSON_DUMPS, Grammar
from mesh_transformer.serve import create_app, reasoning, responses, tools
from mesh_transformer.serve.chat import Shape, StreamedReply
from tests.helpers import END_THINK_ID, decoding_held_past, in_pieces
from tests.serving import (CHAT_TOOLS, KEY, THINKS, WEATHER_PARAMETERS, chat_servers, library, start_server,
                           template_ids)

TOOLS = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]  # Responses' flat function tools


@pytest.fixture(scope="module")
def servers(long_engine):
    with chat_servers(long_engine, responses_kept=3) as bases:
        yield bases


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)


def streamed(c: openai.OpenAI, **kw):
    """(the final response, the events) of a stream read by the openai client's accumulator, which
    checks the events' order and items as they come. The output items rebuilt from the events
    alone (`rebuilt`) are the final response's."""
    with c.responses.stream(**kw) as stream:
        events = list(stream)
    final = events[-1].response
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert rebuilt(events) == final.model_dump(exclude_none=True)["output"]
    return final, events


def rebuilt(events) -> list[dict]:
    """The output items as the events build them: each item as added, its text or arguments the
    deltas joined, checked against its `..done` events, its status as done."""
    items, texts = {}, {}
    for e in events:
        if e.type == "response.output_item.added":
            items[e.output_index] = e.item.model_dump(exclude_none=True)
            texts[e.item.id] = ""
        elif e.type in ("response.output_text.delta", "response.reasoning_text.delta",
                        "response.function_call_arguments.delta"):
            texts[e.item_id] += e.delta
        elif e.type in ("response.output_text.done", "response.reasoning_text.done"):
            assert e.text == texts[e.item_id]
        elif e.type == "response.function_call_arguments.done":
            assert e.arguments == texts[e.item_id]
        elif e.type == "response.content_part.done":
            items[e.output_index]["content"] = [e.part.model_dump(exclude_none=True)]
            assert e.part.text == texts[e.item_id]
        elif e.type == "response.output_item.done":
            item = items[e.output_index]
            if item["type"] == "function_call":
                item["arguments"] = texts[e.item.id]
            item["status"] = e.item.status
            assert item == e.item.model_dump(exclude_none=True)
    assert sorted(items) == list(range(len(items)))
    return [items[i] for i in range(len(items))]


def argument_deltas(events) -> list[str]:
    return [e.delta for e in events if e.type == "response.function_call_arguments.delta"]


def raw_events(base: str, body: dict) -> list[tuple[str, dict]]:
    """The server-sent events themselves: (the `event:` line's name, the data)."""
    with httpx.stream("POST", f"{base}/v1/responses", json={**body, "stream": True}, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    assert len(names) == len(data)
    return list(zip(names, data))


def without_ids(response, logprobs: bool = True) -> list[dict]:
    """A response's output items, their ids (fresh in each response) left out (and their text's
    logprobs, unless `logprobs`)."""
    dumped = response.model_dump(exclude_none=True) if hasattr(response, "model_dump") else response
    items = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in dumped["output"]]
    if not logprobs:
        for item in items:
            for part in item.get("content", ()):
                part.pop("logprobs", None)
    return items


# --------------------------------------------------------------------------------------------
# Text replies
# --------------------------------------------------------------------------------------------

def test_a_string_input_with_instructions_answers_as_the_template_and_the_library_do(servers, tiny_long):
    tiny, _ = tiny_long
    c = client(servers["plain"])
    r = c.responses.create(model="tiny", input="Pack my box", instructions="Be brief.", max_output_tokens=10,
                           temperature=0)
    ids = template_ids(tiny, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Pack my box"}])
    expected = library(tiny_long, ids, 10)
    assert expected.finish_reason == "length"  # (the random model does not stop): the response is incomplete
    assert (r.output_text, r.status, r.incomplete_details.reason) == (expected.text, "incomplete", "max_output_tokens")
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    [message] = r.output
    assert (message.type, message.role, message.status, message.id[:4]) == ("message", "assistant", "incomplete", "msg_")
    assert r.usage.input_tokens == len(ids) and r.usage.output_tokens == 10
    assert r.usage.total_tokens == len(ids) + 10 and r.usage.output_tokens_details.reasoning_tokens == 0
    assert (r.instructions, r.max_output_tokens, r.temperature, r.store) == ("Be brief.", 10, 0.0, True)
    chat = c.chat.completions.create(model="tiny", max_tokens=10, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Pack my box"}])
    assert chat.choices[0].message.content == r.output_text and chat.usage.prompt_tokens == len(ids)


def test_a_stream_is_openais_typed_events_and_rebuilds_the_same_response(servers):
    c = client(servers["plain"])
    kw = dict(model="tiny", input=[{"role": "user", "content": [{"type": "input_text", "text": "Pack my box"}]}],
              max_output_tokens=12, temperature=0, include=["message.output_text.logprobs"], top_logprobs=2)
    whole = c.responses.create(**kw)
    final, events = streamed(c, **kw)
    assert final.status == whole.status == "incomplete" and final.output_text == whole.output_text
    assert without_ids(final, logprobs=False) == without_ids(whole, logprobs=False)
    assert final.usage.output_tokens == whole.usage.output_tokens == 12
    logprobs = whole.output[0].content[0].logprobs
    assert len(logprobs) == 12 and all(len(lp.top_logprobs) == 2 for lp in logprobs)
    assert "".join(lp.token for lp in logprobs) == whole.output_text
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Pack my box"}], max_tokens=12,
                                     temperature=0, logprobs=True, top_logprobs=2)  # the chat API's, the same tokens
    for other in (final.output[0].content[0].logprobs, chat.choices[0].logprobs.content):
        # (a repeated prompt is read from the prefix cache: the same tokens, logprobs equal to float noise)
        assert [lp.token for lp in other] == [lp.token for lp in logprobs]
        assert [lp.logprob for lp in other] == pytest.approx([lp.logprob for lp in logprobs], abs=1e-5)

    raw = in_pieces(lambda: raw_events(servers["plain"], {**kw, "input": "Pack my box"}),
                    lambda got: [name for name, _ in got].count("response.output_text.delta"))
    names = [name for name, _ in raw]
    assert [data["type"] for _, data in raw] == names
    assert [data["sequence_number"] for _, data in raw] == list(range(len(raw)))
    deltas = [data for name, data in raw if name == "response.output_text.delta"]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert len(deltas) > 1 and set(names[4:-4]) == {"response.output_text.delta"}
    assert "".join(d["delta"] for d in deltas) == whole.output_text
    assert [lp["token"] for d in deltas for lp in d["logprobs"]] == [lp.token for lp in logprobs]
    assert raw[0][1]["response"]["status"] == "in_progress" and raw[0][1]["response"]["output"] == []
    assert raw[-1][1]["response"]["output"][0]["id"] == raw[2][1]["item"]["id"] == deltas[0]["item_id"]


def test_text_format_holds_the_reply_to_a_json_schema(servers, tiny_long):
    tiny, _ = tiny_long
    schema = {"enum": ["Paris", "Oslo"]}
    c = client(servers["plain"])
    kw = dict(model="tiny", input="Where?", max_output_tokens=40, temperature=0,
              text={"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}})
    r = c.responses.create(**kw)
    expected = library(tiny_long, template_ids(tiny, [{"role": "user", "content": "Where?"}]), 40,
                       Grammar.json_schema(schema))
    assert (r.output_text, r.status) == (expected.text, "completed") and expected.finish_reason == "stop"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"
    final, _ = streamed(c, **kw)
    assert final.output_text == r.output_text and final.status == "completed"


# --------------------------------------------------------------------------------------------
# Conversations: items, kept responses
# --------------------------------------------------------------------------------------------

def test_reasoning_effort_and_template_variables_reach_the_template(long_engine, tiny_long):
    tiny, _ = tiny_long
    template = "{{ reasoning_effort | default('none') }}|{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    server, base = start_server(create_app(long_engine, model_name="tiny", api_key=KEY, chat_template=template))
    try:
        c = client(base)
        for extra, effort in (({}, "none"), ({"reasoning": {"effort": "high"}}, "high"),
                              ({"reasoning": {"effort": "high"}, "extra_body": {
                                  "chat_template_kwargs": {"reasoning_effort": "low"}}}, "low")):
            r = c.responses.create(model="tiny", input="Hi", max_output_tokens=2, **extra)
            ids = tiny.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], chat_template=template,
                                                     tokenize=True, return_dict=False, reasoning_effort=effort)
            assert r.usage.input_tokens == len(ids) == len(tiny.tokenizer.encode(f"{effort}|Hi|"))
    finally:
        server.should_exit = True


def test_items_with_calls_and_their_outputs_render_as_the_chat_conversation(servers, tiny_long):
    """A message, a reasoning item, an assistant's text and two calls, their outputs: the template
    sees the chat conversation transformers would be given."""
    tiny, _ = tiny_long
    items = [{"role": "user", "content": "Weather?"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Ask."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
             {"type": "function_call", "call_id": "call_2", "name": "now", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_1", "output": "Snow."},
             {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "Noon."}]}]
    chat = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Looking.", "reasoning_content": "Ask.", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}},
                {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Snow."},
            {"role": "tool", "tool_call_id": "call_2", "content": "Noon."}]
    ids = template_ids(tiny, chat, CHAT_TOOLS)
    assert tiny.tokenizer.decode(ids).endswith(
        'Assistant: Looking.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}</tool_call>'
        '<tool_call>{"name": "now", "arguments": {}}</tool_call>\n\nTool: Snow.\n\nTool: Noon.\n\nAssistant:')
    r = client(servers["plain"]).responses.create(model="tiny", input=items, tools=TOOLS, tool_choice="none",
                                                  max_output_tokens=6, temperature=0)
    assert r.usage.input_tokens == len(ids) and r.output_text == library(tiny_long, ids, 6).text
    assert r.tool_choice == "none" and [t.name for t in r.tools] == ["get_weather", "now"]


def test_a_kept_response_continues_by_its_id_and_can_be_read_and_deleted(servers, tiny_long):
    tiny, _ = tiny_long
    c = client(servers["plain"])
    first = c.responses.create(model="tiny", input="Hi", instructions="Be brief.", max_output_tokens=5, temperature=0)
    second = c.responses.create(model="tiny", input="Again", previous_response_id=first.id, max_output_tokens=5,
                                temperature=0)
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "Again"}]  # the first's instructions do not carry over
    ids = template_ids(tiny, conversation)
    assert second.usage.input_tokens == len(ids) and second.output_text == library(tiny_long, ids, 5).text
    assert second.previous_response_id == first.id
    third = c.responses.create(model="tiny", input="More", previous_response_id=second.id, instructions="Be kind.",
                               max_output_tokens=5, temperature=0)
    longer = [{"role": "system", "content": "Be kind."}, *conversation,
              {"role": "assistant", "content": second.output_text}, {"role": "user", "content": "More"}]
    assert third.usage.input_tokens == len(template_ids(tiny, longer))

    assert c.responses.retrieve(second.id).model_dump() == second.model_dump()
    c.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError, match=second.id):
        c.responses.retrieve(second.id)
    with pytest.raises(openai.BadRequestError, match=second.id) as refused:  # OpenAI's answer, which clients match
        c.responses.create(model="tiny", input="x", previous_response_id=second.id, max_output_tokens=2)
    assert (refused.value.code, refused.value.param) == ("previous_response_not_found", "previous_response_id")
    unkept = c.responses.create(model="tiny", input="Hi", store=False, max_output_tokens=2)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError, match="store: false"):
        c.responses.retrieve(unkept.id)
    streamed_first, _ = streamed(c, model="tiny", input="Hi", max_output_tokens=5, temperature=0)
    assert c.responses.retrieve(streamed_first.id).output_text == streamed_first.output_text  # kept when streamed too
    for _ in range(3):  # this server keeps 3
        c.responses.create(model="tiny", input="Hi", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(streamed_first.id)
    metrics = httpx.get(f"{servers['plain']}/metrics", timeout=30).text  # reads and deletes under one name
    assert 'endpoint="/v1/responses/{id}",status="404"' in metrics
    assert 'endpoint="/v1/responses/{id}",status="200"' in metrics


def test_input_tokens_counts_what_a_response_would_read(servers, tiny_long):
    """`responses.input_tokens.count`: the conversation (a kept response's, the input) and the
    tools, rendered as /v1/responses renders them; the input may be left out after a kept response."""
    tiny, _ = tiny_long
    c = client(servers["plain"])
    first = c.responses.create(model="tiny", input="Hi", instructions="Be brief.", max_output_tokens=5, temperature=0)
    kw = dict(model="tiny", previous_response_id=first.id, tools=TOOLS, tool_choice="none")
    counted = c.responses.input_tokens.count(input="Again", **kw)
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text}]
    assert counted.object == "response.input_tokens"
    assert counted.input_tokens == len(template_ids(tiny, [*conversation, {"role": "user", "content": "Again"}],
                                                    CHAT_TOOLS))
    assert c.responses.create(input="Again", max_output_tokens=2, **kw).usage.input_tokens == counted.input_tokens
    assert c.responses.input_tokens.count(model="tiny", previous_response_id=first.id).input_tokens == len(
        template_ids(tiny, conversation))
    with pytest.raises(openai.BadRequestError) as unknown:
        c.responses.input_tokens.count(model="tiny", input="x", previous_response_id="resp_gone")
    assert unknown.value.code == "previous_response_not_found"
    for bad, param in (({}, "input"), ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type")):
        with pytest.raises(openai.BadRequestError) as refused:
            c.responses.input_tokens.count(model="tiny", **bad)
        assert refused.value.param == param


def test_a_store_keeps_the_newest_responses():
    store = responses.Store(2)
    for i in range(3):
        store.put(responses.Kept({"id": f"resp_{i}"}, []))
    assert list(store.kept) == ["resp_1", "resp_2"]
    with pytest.raises(Exception, match="resp_0"):
        store.get("resp_0")
    none = responses.Store(0)
    none.put(responses.Kept({"id": "resp_0"}, []))
    assert not none.kept  # keeping none: nothing kept


def test_a_repeated_prompt_reports_the_tokens_read_from_the_prefix_cache(servers, tiny_long):
    c = client(servers["plain"])
    long = "The quick brown fox jumps over the lazy dog. " * 6
    first = c.responses.create(model="tiny", input=long, max_output_tokens=2, temperature=0)
    again = c.responses.create(model="tiny", input=long, max_output_tokens=2, temperature=0)
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert 0 < again.usage.input_tokens_details.cached_tokens < again.usage.input_tokens == first.usage.input_tokens
    assert again.output_text == first.output_text
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": long}], max_tokens=2)
    assert chat.usage.prompt_tokens_details.cached_tokens == again.usage.input_tokens_details.cached_tokens


# --------------------------------------------------------------------------------------------
# Tool calls and reasoning as output items
# --------------------------------------------------------------------------------------------

def test_a_named_tool_choice_is_a_function_call_item_streamed_as_argument_deltas(servers, tiny_long):
    tiny, _ = tiny_long
    c = client(servers["plain"])
    kw = dict(model="tiny", input="Weather?", tools=TOOLS, max_output_tokens=48, temperature=0,
              tool_choice={"type": "function", "name": "get_weather"})
    r = c.responses.create(**kw)
    ids = template_ids(tiny, [{"role": "user", "content": "Weather?"}], CHAT_TOOLS)
    expected = library(tiny_long, ids, 48, Grammar.json_schema(WEATHER_PARAMETERS, separators=JSON_DUMPS))
    [call] = r.output
    assert (call.type, call.name, call.arguments, call.status, r.status) == (
        "function_call", "get_weather", expected.text, "completed", "completed")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    final, events = in_pieces(lambda: streamed(c, **kw), lambda got: len(argument_deltas(got[1])))
    assert without_ids(final) == without_ids(r)
    deltas = argument_deltas(events)
    assert len(deltas) > 1 and "".join(deltas) == expected.text
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert (done.arguments, done.item_id) == (expected.text, final.output[0].id)


def test_a_named_call_cut_short_is_incomplete_and_left_out_of_the_next_turn(servers, tiny_long):
    """Cut by max_output_tokens or by a stop id, a named call's arguments are no object: the call
    is "incomplete", the response kept, and continuing it leaves the call out."""
    tiny, _ = tiny_long
    c = client(servers["plain"])
    kw = dict(model="tiny", input="Weather?", tools=TOOLS, temperature=0,
              tool_choice={"type": "function", "name": "get_weather"})
    ids = template_ids(tiny, [{"role": "user", "content": "Weather?"}], CHAT_TOOLS)
    whole = library(tiny_long, ids, 48, Grammar.json_schema(WEATHER_PARAMETERS, separators=JSON_DUMPS))
    third = whole.tokens[2]
    for extra, status in (({"max_output_tokens": 2}, "incomplete"),
                          ({"max_output_tokens": 48, "extra_body": {"stop_token_ids": [third]}}, "completed")):
        for r in (c.responses.create(**kw, **extra), streamed(c, **kw, **extra)[0]):
            [call] = r.output
            assert (r.status, call.status, call.arguments) == (
                status, "incomplete", tiny.tokenizer.decode(whole.tokens[:2]))
            again = c.responses.create(model="tiny", input="Again", previous_response_id=r.id, max_output_tokens=2)
            assert again.usage.input_tokens == len(template_ids(tiny, [{"role": "user", "content": "Weather?"},
                                                                       {"role": "user", "content": "Again"}]))


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_calls_read_from_text_become_items_whole_and_streamed_in_any_pieces(finish):
    """"auto" with a parser: the same items whether the text comes whole or in pieces; cut
    short, the message is the item being written (the calls read are whole)."""
    text = 'Looking.<tool_call>{"name": "now", "arguments": {}}</tool_call> and <tool_call>{"name": "get_weather", ' \
           '"arguments": {"city": "Oslo", "days": 2}}</tool_call>\n'
    plan = tools.Plan(tuple(tools.read_tools(CHAT_TOOLS)), "auto", parser="hermes")
    response = responses.Response(None, responses.ResponsesRequest(input="x"), Shape(plan), "resp_1")
    seq = SimpleNamespace(text=text, finish_reason=finish, options=SamplingOptions(), kept_tokens=lambda: 0)
    whole = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in response.items(seq)]
    assert [item["type"] for item in whole] == ["message", "function_call", "function_call"]
    assert [item["status"] for item in whole] == ["incomplete" if finish == "length" else "completed"] + ["completed"] * 2
    assert whole[0]["content"][0]["text"] == "Looking. and \n"  # the text around the calls: one message
    assert [(item["name"], item["arguments"]) for item in whole[1:]] == [
        ("now", "{}"), ("get_weather", '{"city": "Oslo", "days": 2}')]
    for size in (1, 3, 7, len(text)):
        writer, reply = responses.EventWriter(response), StreamedReply(Shape(plan))
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        events = [e for i, piece in enumerate(pieces)
                  for e in responses._delta_events(writer, reply.feed(piece, i == len(pieces) - 1), [])]
        events += writer.end("incomplete" if finish == "length" else "completed")
        assert [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in writer.items] == whole
        kinds = [json.loads(e.split(b"data: ", 1)[1])["type"] for e in events]
        assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3


def test_auto_with_the_servers_parser_returns_calls_as_items(servers, tiny_long):
    c = client(servers["hermes"])
    text = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    kw = dict(model="tiny", input="Time?", tools=TOOLS, max_output_tokens=60, temperature=0,
              extra_body={"structured_outputs": {"choice": [text]}})
    r = c.responses.create(**kw)
    [call] = r.output
    assert (call.type, call.name, call.arguments, r.status) == ("function_call", "now", "{}", "completed")
    final, _ = streamed(c, **kw)
    assert without_ids(final) == without_ids(r)
    answer = c.responses.create(model="tiny", max_output_tokens=4, temperature=0, previous_response_id=r.id,
                                tools=TOOLS, tool_choice="none",
                                input=[{"type": "function_call_output", "call_id": call.call_id, "output": "noon"}])
    conversation = [{"role": "user", "content": "Time?"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": "now", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "noon"}]
    assert answer.usage.input_tokens == len(template_ids(tiny_long[0], conversation, CHAT_TOOLS))
    assert answer.previous_response_id == r.id


def test_a_reasoning_parser_makes_a_reasoning_item_and_counts_its_tokens(servers, tiny_long):
    tiny, _ = tiny_long
    c = client(servers["r1"])
    ids = template_ids(tiny, [{"role": "user", "content": "Weather?"}], template=THINKS)
    closing = {str(END_THINK_ID): 100.0}  # the model closes the block at once; the grammar holds what follows
    kw = dict(model="tiny", input="Weather?", max_output_tokens=20, temperature=0, extra_body={"logit_bias": closing},
              text={"format": {"type": "json_schema", "name": "yes", "schema": {"enum": ["yes", "no"]}}})
    r = c.responses.create(**kw)
    thinking = reasoning.Thinking.of("deepseek_r1", "<think>", tiny.tokenizer)
    expected = library(tiny_long, ids, 20, thinking.hold(Grammar.json_schema({"enum": ["yes", "no"]})),
                       logit_bias=((END_THINK_ID, 100.0),))
    thought, answer = thinking.split(expected.text, final=True)
    assert expected.text.startswith("</think>") and thought == "" and json.loads(answer) in ("yes", "no")
    assert [item.type for item in r.output] == ["message"] and r.output_text == answer
    assert r.usage.output_tokens_details.reasoning_tokens == 0

    plain = c.responses.create(model="tiny", input="Weather?", max_output_tokens=12, temperature=0)
    thought = library(tiny_long, ids, 12).text  # never closed: all of it is reasoning
    [item] = plain.output
    assert (item.type, item.content[0].text, item.status, plain.status) == (
        "reasoning", thought, "incomplete", "incomplete")
    assert plain.usage.output_tokens_details.reasoning_tokens == 12 and plain.output_text == ""
    final, events = streamed(c, model="tiny", input="Weather?", max_output_tokens=12, temperature=0)
    assert without_ids(final) == without_ids(plain)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought


def test_reasoning_tokens_end_at_the_closer(tiny_long):
    tiny, _ = tiny_long
    tokens = tiny.tokenizer.encode("sum") + [END_THINK_ID] + tiny.tokenizer.encode("Four")
    seq, thinking = SimpleNamespace(tokens=tokens), reasoning.Thinking.of("deepseek_r1", "<think>")
    assert responses.reasoning_tokens(tiny.tokenizer, seq, len(tokens), thinking) == len(tiny.tokenizer.encode("sum")) + 1
    assert responses.reasoning_tokens(tiny.tokenizer, seq, 2, thinking) == 2  # cut before the closer: all reasoning


def test_harmony_reasoning_tokens_end_at_the_answers_header(tiny_long):
    """GPT-OSS's markers as special tokens of their own: the reasoning is every token up to the final
    channel's `<|message|>`."""
    import copy
    tokenizer = copy.deepcopy(tiny_long[0].tokenizer)
    markers = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": markers})
    start, channel, message, end = tokenizer.convert_tokens_to_ids(markers)
    word = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    thought = [channel, *word("analysis"), message, *word("sum it"), end]
    header = [start, *word("assistant"), channel, *word("final"), message]
    tokens = thought + header + word("Four")
    thinking = reasoning.Thinking.of(reasoning.HARMONY, "<|start|>assistant")
    seq = SimpleNamespace(tokens=tokens)
    assert thinking.split(tokenizer.decode(tokens), final=True) == ("sum it", "Four")
    assert responses.reasoning_tokens(tokenizer, seq, len(tokens), thinking) == len(thought) + len(header)
    assert responses.reasoning_tokens(tokenizer, seq, len(thought) + 3, thinking) == len(thought) + 3  # no answer yet


# --------------------------------------------------------------------------------------------
# Bad requests
# --------------------------------------------------------------------------------------------

BAD = [
    ({"input": []}, "input", "at least one"),
    ({"input": [{"type": "image_generation_call"}]}, "input[0].type", "one of message"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type",
     "only text parts"),
    ({"input": [{"role": "critic", "content": "x"}]}, "input[0].role", "one of user"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "name": "now", "arguments": "{}"}]},
     "input[1].call_id", "non-empty string"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "now", "arguments": "{oops"}]},
     "input[0].arguments", "JSON text of an object"),
    ({"input": [{"role": "user", "content": "ok"}, {"role": "user", "content": "\ud800"}]}, "input[1].content",
     "not valid Unicode"),
    ({"instructions": "\ud800"}, "instructions", "not valid Unicode"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "only function tools"),
    ({"tools": [{"type": "function", "name": "a b"}], "tool_choice": "none"}, "tools[0].name", "letters, digits"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "later"}}, "tool_choice.name",
     "no tool is named 'later'"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "got 'sometimes'"),
    ({"tools": TOOLS}, "tool_choice", "--tool-call-parser"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "JSON schema"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type", "json_schema"),
    ({"text": {"format": {"type": "json_object"}}, "structured_outputs": {"choice": ["a"]}}, "structured_outputs",
     "text.format"),
    ({"background": True}, "background", "not supported"),
    ({"truncation": "auto"}, "truncation", "disabled"),
    ({"include": ["file_search_call.results"]}, "include[0]", "one of"),
    ({"top_logprobs": 2}, "top_logprobs", "include"),
    ({"include": ["message.output_text.logprobs"], "tools": TOOLS, "tool_choice": "none"}, "include", "tools"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "\ud800"}]}, "input[0].output",
     "not valid Unicode"),
    ({"input": [{"type": "function_call_output", "call_id": "\ud800", "output": "x"}]}, "input[0].call_id",
     "not valid Unicode"),
    ({"input": [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": "\ud800"}]}]},
     "input[0].content[0].text", "not valid Unicode"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "\ud800"}]}, "input[0].name", "not valid Unicode"),
    ({"input": "\ud800"}, "input", "not valid Unicode"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "now", "arguments": "[" * 100000}]},
     "input[0].arguments", "JSON text of an object"),
    ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
    ({"reasoning": {"effort": 3}}, "reasoning.effort", "a string"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text", "a string"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "not supported"),
    ({"tools": TOOLS, "tool_choice": "required", "text": {"format": {"type": "xml"}}}, "text.format.type",
     "json_schema"),
    ({"previous_response_id": "resp_gone"}, "previous_response_id", "resp_gone"),
    ({"max_output_tokens": 5000}, "input", "with max_output_tokens 5000 it does not fit"),
    ({"max_output_tokens": 0}, "max_output_tokens", "at least 1"),
]


@pytest.mark.parametrize("extra,param,message", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_a_bad_request_is_a_400_naming_the_field(servers, extra, param, message):
    body = json.dumps({"model": "tiny", "input": "Hi", "max_output_tokens": 4, **extra})  # (lone surrogates escaped)
    r = httpx.post(f"{servers['plain']}/v1/responses", content=body, timeout=30,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_a_kept_response_is_read_whole_and_a_wrong_method_is_an_openai_error(servers):
    c = client(servers["plain"])
    r = c.responses.create(model="tiny", input="Hi", max_output_tokens=2)
    headers = {"Authorization": f"Bearer {KEY}"}
    again = httpx.get(f"{servers['plain']}/v1/responses/{r.id}", params={"stream": "true"}, headers=headers, timeout=30)
    assert again.status_code == 400 and again.json()["error"]["param"] == "stream"
    wrong = httpx.post(f"{servers['plain']}/v1/responses/{r.id}", json={}, headers=headers, timeout=30)
    assert wrong.status_code == 405 and "does not take POST" in wrong.json()["error"]["message"]


def test_a_stream_that_fails_ends_with_response_failed(servers, long_engine, monkeypatch):
    """The server ends the running sequences (here `abort`, as a shutdown's drain timeout does):
    the open item closes incomplete and `response.failed` carries the error. The engine's decode
    calls wait for the abort past 64 tokens, so the text cannot end first."""
    aborted = decoding_held_past(monkeypatch, long_engine)
    with httpx.stream("POST", f"{servers['plain']}/v1/responses", timeout=60, headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "tiny", "input": "Hi", "max_output_tokens": 700, "stream": True,
                            "ignore_eos": True}) as r:
        data = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                data.append(json.loads(line[len("data: "):]))
                if data[-1]["type"] == "response.output_text.delta" and len(data) == 5:
                    long_engine.abort("shutdown")
                    aborted.set()
    monkeypatch.undo()
    assert [d["type"] for d in data[-4:]] == ["response.output_text.done", "response.content_part.done",
                                              "response.output_item.done", "response.failed"]
    failed = data[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert "shutting down" in failed["error"]["message"] and failed["output"][0]["status"] == "incomplete"
    assert client(servers["plain"]).responses.create(model="tiny", input="Hi", max_output_tokens=2).status  # serving on


def test_input_items_become_the_chat_conversation():
    """Reasoning goes to the next assistant message (joined if two come before it; dropped if a
    user message comes first); calls join the assistant message before them; a call cut short
    is left out; the items kept hold only what the conversation needs."""
    items = [{"role": "user", "content": "u1"},
             {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "cut short"}]},
             {"role": "user", "content": [{"type": "input_text", "text": "u"}, {"type": "input_text", "text": "2"}]},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "T1."}], "id": "rs_1"},
             {"role": "assistant", "content": [{"type": "output_text", "text": "a2", "annotations": []}], "id": "m"},
             {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "T2."}]},
             {"type": "function_call", "call_id": "c1", "name": "now", "arguments": "", "status": "completed"},
             {"type": "function_call", "call_id": "c2", "name": "now", "arguments": '{"t', "status": "incomplete"}]
    messages, kept = responses.chat_messages(items, [f"input[{i}]" for i in range(len(items))])
    assert messages == [{"role": "user", "content": "u1"}, {"role": "user", "content": "u2"},
                        {"role": "assistant", "content": "a2", "reasoning": "T1.T2.", "tool_calls": [
                            {"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]}]
    assert kept[4] == {"type": "message", "role": "assistant", "content": "a2"} and len(kept) == 7

