"""`/v1/messages`: Anthropic's Messages API over the chat machinery.

Oracles: transformers' `apply_chat_template` for the prompt a request's messages make (with
`continue_final_message` for a prefill); the library's generation from it (under the grammar a
forced tool or `output_config.format` implies) for the reply; `jsonschema`; `jiter`, the reader
Anthropic's SDK reads streamed tool input with; /v1/chat/completions for the cached tokens both
count; and Anthropic's own client: its typed `Message`, its stream accumulator
(`messages.stream`), which rebuilds the message from the events, and its error classes.
"""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

import anthropic
import httpx
import jiter
import jsonschema
import openai
import pytest

from mesh_transformer.generate.structured import JSON_DUMPS, Grammar
from mesh_transformer.serve import create_app, messages, reasoning, tools
from mesh_transformer.serve.chat import Shape, StreamedReply
from tests.helpers import END_THINK_ID, THINK_ID, decoding_held_past, in_pieces
from tests.serving import (CHAT_TOOLS, KEY, THINKS, WEATHER_PARAMETERS, chat_servers, library, start_server,
                           template_ids)

TOOLS = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"],
          **({"description": t["function"]["description"]} if "description" in t["function"] else {})}
         for t in CHAT_TOOLS]  # Anthropic's client tools
GREEDY = {"temperature": 0}  # (Anthropic's SDK no longer takes sampling fields: they go as extra_body)


@pytest.fixture(scope="module")
def servers(long_engine):
    with chat_servers(long_engine, max_request_bytes=50_000) as bases:
        yield bases


def client(base: str, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=120)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def text_deltas(events) -> list:
    return [e for e in events if e.type == "content_block_delta"]


def streamed(c: anthropic.Anthropic, **kw):
    """(the final message the SDK's accumulator builds from the events, the events): the events'
    order is checked (message_start first; each block started, filled and stopped in turn; one
    message_delta; message_stop last)."""
    with c.messages.stream(**kw) as stream:
        events = [e for e in stream if e.type in ("message_start", "content_block_start", "content_block_delta",
                                                  "content_block_stop", "message_delta", "message_stop")]
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    open_block = None
    for e in events[1:-2]:
        if e.type == "content_block_start":
            assert open_block is None
            open_block = e.index
        else:
            assert e.index == open_block
            open_block = None if e.type == "content_block_stop" else open_block
    starts = [e.index for e in events if e.type == "content_block_start"]
    assert starts == list(range(len(final.content))) and open_block is None
    return final, events


def dumped(message) -> dict:
    """A message's content, stop and token counts (its id is fresh each time, and a repeated
    prompt is read from the prefix cache: its prompt's tokens are counted whichever way they came)."""
    out = message.model_dump(exclude_none=True)
    for block in out["content"]:
        block.pop("parsed_output", None)  # (the stream accumulator's own field)
        if block["type"] == "tool_use":
            block.pop("id")
    u = message.usage
    return {"content": out["content"], "stop_reason": out["stop_reason"], "stop_sequence": out.get("stop_sequence"),
            "prompt": u.input_tokens + u.cache_read_input_tokens, "output": u.output_tokens}


# --------------------------------------------------------------------------------------------
# Text replies
# --------------------------------------------------------------------------------------------

def test_a_conversation_with_calls_renders_as_transformers_and_answers_as_the_library(servers, tiny_long):
    """System blocks, thinking, text and two tool_use blocks, their tool_result blocks and more
    text: the template sees the chat conversation transformers would be given."""
    tiny, _ = tiny_long
    conversation = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Ask.", "signature": "sig"}, {"type": "text", "text": "Looking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo", "days": 1}},
            {"type": "tool_use", "id": "toolu_2", "name": "now", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Snow."},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "Noon."}]},
            {"type": "text", "text": "Thanks", "cache_control": {"type": "ephemeral"}}]}]
    chat = [{"role": "system", "content": "Be brief.\nNo jokes."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Looking.", "reasoning_content": "Ask.", "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "get_weather",
                                                                   "arguments": {"city": "Oslo", "days": 1}}},
                {"id": "toolu_2", "type": "function", "function": {"name": "now", "arguments": {}}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "Snow."},
            {"role": "tool", "tool_call_id": "toolu_2", "content": "Noon."}, {"role": "user", "content": "Thanks"}]
    ids = template_ids(tiny, chat, CHAT_TOOLS)
    kw = dict(model="tiny", messages=conversation, tools=TOOLS, tool_choice={"type": "none"},
              system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "No jokes."}])
    c = client(servers["plain"])
    assert c.messages.count_tokens(**kw).input_tokens == len(ids)
    m = c.messages.create(**kw, max_tokens=6, extra_body=GREEDY)
    expected = library(tiny_long, ids, 6)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(ids) and m.usage.output_tokens == 6
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == expected.text
    assert (m.stop_reason, m.role, m.model, m.type) == ("max_tokens", "assistant", "tiny", "message")
    assert m.id.startswith("msg_")


def test_a_stream_is_anthropics_events_and_builds_the_same_message(servers, tiny_long):
    tiny, _ = tiny_long
    c = client(servers["plain"])
    kw = dict(model="tiny", messages=user("Pack my box"), max_tokens=12, extra_body=GREEDY)
    whole = c.messages.create(**kw)
    final, events = in_pieces(lambda: streamed(c, **kw), lambda got: len(text_deltas(got[1])))
    assert dumped(final) == dumped(whole)
    expected = library(tiny_long, template_ids(tiny, user("Pack my box")), 12).text
    assert "".join(e.delta.text for e in text_deltas(events)) == expected and len(text_deltas(events)) > 1
    start = events[0].message.usage  # the prompt's tokens are known when the stream starts
    assert (start.input_tokens, start.cache_read_input_tokens) == (final.usage.input_tokens,
                                                                   final.usage.cache_read_input_tokens)


def test_a_stop_sequence_ends_the_reply_and_is_named(servers, tiny_long):
    tiny, _ = tiny_long
    expected = library(tiny_long, template_ids(tiny, user("Pack my box")), 16).text
    at = next(i for i in range(3, len(expected) - 2) if "\ufffd" not in expected[i:i + 2]
              and expected.find(expected[i:i + 2]) == i)
    stop = expected[at:at + 2]
    c = client(servers["plain"])
    kw = dict(model="tiny", messages=user("Pack my box"), max_tokens=16, stop_sequences=["never said", stop],
              extra_body=GREEDY)
    for m in (c.messages.create(**kw), streamed(c, **kw)[0]):
        assert (m.content[0].text, m.stop_reason, m.stop_sequence) == (expected[:at], "stop_sequence", stop)
    ended = c.messages.create(model="tiny", messages=user("Pack my box"), max_tokens=16, extra_body={
        **GREEDY, "stop_token_ids": [library(tiny_long, template_ids(tiny, user("Pack my box")), 16).tokens[2]]})
    assert (ended.stop_reason, ended.stop_sequence) == ("end_turn", None)


def test_a_final_assistant_message_is_a_prefill_the_reply_continues(servers, tiny_long):
    tiny, _ = tiny_long
    conversation = [{"role": "user", "content": "Pack my box"}, {"role": "assistant", "content": "with five"}]
    ids = template_ids(tiny, conversation, add_generation_prompt=False, continue_final_message=True)
    assert tiny.tokenizer.decode(ids).endswith("Assistant: with five")
    c = client(servers["plain"])
    m = c.messages.create(model="tiny", messages=conversation, max_tokens=8, extra_body=GREEDY)
    assert m.content[0].text == library(tiny_long, ids, 8).text  # the prefill is not repeated
    assert c.messages.count_tokens(model="tiny", messages=conversation).input_tokens == len(ids)

    # With a reasoning parser, a prefill is answer (prefilling "{" to get JSON is common), unless it
    # opened a block it has not closed: then the reply goes on thinking.
    c = client(servers["r1"])
    assert [reasoning.Thinking.of("deepseek_r1", text, continued=True).prompt for text in (
        "The answer:", "<think>Let me see", "")] == ["closed", "opened", ""]  # (an empty prefill says nothing)
    for prefill, kinds in (("The answer:", ["text"]), ("<think>Let me see", ["thinking"])):
        conversation[1]["content"] = prefill
        ids = template_ids(tiny, conversation, template=THINKS, add_generation_prompt=False,
                           continue_final_message=True)
        m = c.messages.create(model="tiny", messages=conversation, max_tokens=8, extra_body=GREEDY)
        assert [b.type for b in m.content] == kinds
        assert (m.content[0].text if kinds == ["text"] else m.content[0].thinking) == library(tiny_long, ids, 8).text


def test_max_tokens_is_a_cap_the_context_lowers(servers, tiny_long, long_engine):
    """Anthropic's clients ask for more tokens than a small model's context holds (Claude Code:
    32,000): the reply runs to the end of the context and says so."""
    tiny, _ = tiny_long
    c = client(servers["plain"])
    sentence = "Pack my box with five dozen liquor jugs. "
    one, two = (c.messages.count_tokens(model="tiny", messages=user(sentence * k)).input_tokens for k in (1, 2))
    reps = (long_engine.context - 24 - one) // (two - one) + 1
    ids = template_ids(tiny, user(sentence * reps))
    room = long_engine.context - len(ids)
    assert 0 < room <= 40
    m = c.messages.create(model="tiny", messages=user(sentence * reps), max_tokens=32_000,
                          extra_body={**GREEDY, "ignore_eos": True})
    assert (m.stop_reason, m.usage.output_tokens) == ("model_context_window_exceeded", room)
    assert m.content[0].text == library(tiny_long, ids, room, eos_token_id=None).text
    assert c.messages.create(model="tiny", messages=user(sentence * reps), max_tokens=room,
                             extra_body=GREEDY | {"ignore_eos": True}).stop_reason == "max_tokens"
    with pytest.raises(anthropic.BadRequestError) as long:
        c.messages.create(model="tiny", messages=user(sentence * (reps + 20)), max_tokens=8)
    assert "does not fit the model's context" in long.value.body["error"]["message"]


def test_output_config_format_holds_the_reply_to_a_json_schema(servers, tiny_long):
    tiny, _ = tiny_long
    schema = {"enum": ["Paris", "Oslo"]}
    c = client(servers["plain"])
    kw = dict(model="tiny", messages=user("Where?"), max_tokens=40, extra_body=GREEDY,
              output_config={"format": {"type": "json_schema", "schema": schema}})
    m = c.messages.create(**kw)
    expected = library(tiny_long, template_ids(tiny, user("Where?")), 40, Grammar.json_schema(schema))
    assert (m.content[0].text, m.stop_reason) == (expected.text, "end_turn") and expected.finish_reason == "stop"
    jsonschema.validate(json.loads(m.content[0].text), schema)
    assert dumped(streamed(c, **kw)[0]) == dumped(m)


def test_thinking_and_effort_reach_the_template(long_engine, tiny_long):
    tiny, _ = tiny_long
    template = ("{{ enable_thinking | default('unset') }}/{{ reasoning_effort | default('none') }}|"
                "{% for m in messages %}{{ m['content'] }}|{% endfor %}")
    server, base = start_server(create_app(long_engine, model_name="tiny", api_key=KEY, chat_template=template))
    try:
        c = client(base)
        for extra, variables in (({}, {}), ({"thinking": {"type": "enabled", "budget_tokens": 1}},
                                            {"enable_thinking": True}),
                                 ({"thinking": {"type": "disabled"}}, {"enable_thinking": False}),
                                 ({"output_config": {"effort": "high"}}, {"reasoning_effort": "high"}),
                                 ({"thinking": {"type": "adaptive"}, "extra_body": {
                                     "chat_template_kwargs": {"enable_thinking": False}}}, {"enable_thinking": False})):
            ids = tiny.tokenizer.apply_chat_template(user("Hi"), chat_template=template, tokenize=True,
                                                     return_dict=False, add_generation_prompt=True, **variables)
            assert c.messages.count_tokens(model="tiny", messages=user("Hi"), **extra).input_tokens == len(ids)
            extra["extra_body"] = {**extra.get("extra_body", {}), **GREEDY}
            m = c.messages.create(model="tiny", messages=user("Hi"), max_tokens=6, **extra)  # (the prompt, through
            assert m.content[0].text == library(tiny_long, ids, 6).text  # the reply it makes: not just its length)
    finally:
        server.should_exit = True


def test_a_repeated_prompt_reports_the_tokens_read_from_the_prefix_cache(servers):
    c = client(servers["plain"])
    long = "The quick brown fox jumps over the lazy dog. " * 6
    first = c.messages.create(model="tiny", messages=user(long), max_tokens=2, extra_body=GREEDY)
    again = c.messages.create(model="tiny", messages=user(long), max_tokens=2, extra_body=GREEDY)
    assert first.usage.cache_read_input_tokens == 0 and first.usage.cache_creation_input_tokens == 0
    assert 0 < again.usage.cache_read_input_tokens
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == first.usage.input_tokens
    assert again.content == first.content
    chat = openai.OpenAI(base_url=f"{servers['plain']}/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model="tiny", messages=user(long), max_tokens=2)
    assert chat.usage.prompt_tokens_details.cached_tokens == again.usage.cache_read_input_tokens


# --------------------------------------------------------------------------------------------
# Tool use and thinking as content blocks
# --------------------------------------------------------------------------------------------

def test_a_named_tool_is_a_tool_use_block_whose_input_streams(servers, tiny_long):
    tiny, _ = tiny_long
    c = client(servers["plain"])
    kw = dict(model="tiny", messages=user("Weather?"), tools=TOOLS, max_tokens=48, extra_body=GREEDY,
              tool_choice={"type": "tool", "name": "get_weather"})
    m = c.messages.create(**kw)
    ids = template_ids(tiny, user("Weather?"), CHAT_TOOLS)
    expected = library(tiny_long, ids, 48, Grammar.json_schema(WEATHER_PARAMETERS, separators=JSON_DUMPS))
    [block] = m.content
    assert (block.type, block.name, block.input, m.stop_reason) == (
        "tool_use", "get_weather", json.loads(expected.text), "tool_use")
    jsonschema.validate(block.input, WEATHER_PARAMETERS)
    final, events = in_pieces(lambda: streamed(c, **kw), lambda got: len(text_deltas(got[1])))
    assert dumped(final) == dumped(m)
    pieces = [e.delta.partial_json for e in text_deltas(events)]
    assert len(pieces) > 1 and "".join(pieces) == expected.text
    cut = c.messages.create(**{**kw, "max_tokens": 3})  # cut inside the input: what of it is whole
    assert (cut.stop_reason, cut.content[0].input) == (
        "max_tokens", jiter.from_json(tiny.tokenizer.decode(expected.tokens[:3]).encode(), partial_mode=True))
    assert dumped(streamed(c, **{**kw, "max_tokens": 3})[0]) == dumped(cut)


def test_a_tool_cut_by_a_stop_sequence_is_not_a_finished_call(servers, tiny_long):
    """A stop sequence ends a named tool's input: the reply stopped for it, not to run the tool."""
    tiny, _ = tiny_long
    c = client(servers["plain"])
    ids = template_ids(tiny, user("Weather?"), CHAT_TOOLS)
    whole = library(tiny_long, ids, 48, Grammar.json_schema(WEATHER_PARAMETERS, separators=JSON_DUMPS)).text
    stop = next(city for city in ("Paris", "Oslo") if city in whole)
    kw = dict(model="tiny", messages=user("Weather?"), tools=TOOLS, max_tokens=48, stop_sequences=[stop],
              tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    for m in (c.messages.create(**kw), streamed(c, **kw)[0]):
        assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
        assert m.content[0].input == jiter.from_json(whole[:whole.index(stop)].encode(), partial_mode=True)


def test_any_holds_the_reply_to_calls_of_the_tools(servers, tiny_long):
    """`tool_choice: any` (chat's "required"): a JSON array of calls under a grammar, here one at
    most (`disable_parallel_tool_use`; this tiny model, left to it, writes calls until cut); the
    calls come back as tool_use blocks."""
    tiny, _ = tiny_long
    plan = tools.Plan(tuple(tools.read_tools(CHAT_TOOLS)), "required", parallel=False)
    expected = library(tiny_long, template_ids(tiny, user("Weather?"), CHAT_TOOLS), 80, plan.grammar()[1])
    calls = plan.split(expected.text, final=True)[1]
    assert expected.finish_reason == "stop" and len(calls) == 1
    c = client(servers["plain"])
    kw = dict(model="tiny", messages=user("Weather?"), tools=TOOLS, max_tokens=80, extra_body=GREEDY,
              tool_choice={"type": "any", "disable_parallel_tool_use": True})
    m = c.messages.create(**kw)
    assert [(b.type, b.name, b.input) for b in m.content] == [("tool_use", call.name, json.loads(call.arguments))
                                                             for call in calls]
    assert m.stop_reason == "tool_use" and dumped(streamed(c, **kw)[0]) == dumped(m)


def test_auto_with_the_servers_parser_returns_tool_use_and_takes_its_result(servers, tiny_long):
    c = client(servers["hermes"])
    text = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    kw = dict(model="tiny", messages=user("Time?"), tools=TOOLS, max_tokens=60,
              extra_body={**GREEDY, "structured_outputs": {"choice": [text]}})
    m = c.messages.create(**kw)
    [block] = m.content
    assert (block.type, block.name, block.input, m.stop_reason) == ("tool_use", "now", {}, "tool_use")
    assert dumped(streamed(c, **kw)[0]) == dumped(m)
    answer = c.messages.create(model="tiny", max_tokens=4, tools=TOOLS, tool_choice={"type": "none"}, messages=[
        *user("Time?"), {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "noon"}]}])
    conversation = [*user("Time?"), {"role": "assistant", "content": "", "tool_calls": [
        {"id": block.id, "type": "function", "function": {"name": "now", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": block.id, "content": "noon"}]
    used = answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    assert used == len(template_ids(tiny_long[0], conversation, CHAT_TOOLS))


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_calls_read_from_text_are_the_same_blocks_whole_and_streamed_in_any_pieces(finish):
    text = 'Looking.<tool_call>{"name": "now", "arguments": {}}</tool_call> and <tool_call>{"name": "get_weather", ' \
           '"arguments": {"city": "Oslo", "days": 2}}</tool_call>\n'
    plan = tools.Plan(tuple(tools.read_tools(CHAT_TOOLS)), "auto", parser="hermes")
    seq = SimpleNamespace(text=text, finish_reason=finish, stop_string=None, kept_tokens=lambda: 9, prompt=[1, 2],
                          cached_tokens=0, tokens=[3] * 9)
    whole = messages.Message("msg_1", "tiny", Shape(plan), 9).whole(seq)
    assert [{k: v for k, v in b.items() if k != "id"} for b in whole["content"]] == [
        {"type": "text", "text": "Looking. and \n"}, {"type": "tool_use", "name": "now", "input": {}},
        {"type": "tool_use", "name": "get_weather", "input": {"city": "Oslo", "days": 2}}]
    assert whole["stop_reason"] == ("tool_use" if finish == "stop" else "max_tokens")
    if finish == "stop":  # whole calls are to be run, whatever ended the text after them
        stopped = messages.Message("msg_2", "tiny", Shape(plan), 9).whole(SimpleNamespace(**{**vars(seq),
                                                                                              "stop_string": "END"}))
        assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("tool_use", None)
    for size in (1, 3, 7, len(text)):
        writer, reply = messages.BlockWriter(Shape(plan)), StreamedReply(Shape(plan))
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        events = []
        for i, piece in enumerate(pieces):
            delta = reply.feed(piece, i == len(pieces) - 1)
            events += writer.text("text", delta.get("content") or "")
            events += [e for entry in delta.get("tool_calls", ()) for e in writer.call(entry)]
        assert blocks_of(events + writer.end()) == [{k: v for k, v in b.items() if k != "id"}
                                                    for b in whole["content"]]


def blocks_of(events: list[bytes]) -> list[dict]:
    """The content blocks the events build: each block as started, its deltas joined (tool input
    read as JSON at its stop)."""
    blocks, inputs = [], {}
    for raw in events:
        name, data = raw.decode().split("\n")[:2]
        e = json.loads(data[len("data: "):])
        assert name == f"event: {e['type']}"
        if e["type"] == "content_block_start":
            assert e["index"] == len(blocks)
            blocks.append({k: v for k, v in e["content_block"].items() if k != "id"})
        elif e["type"] == "content_block_delta":
            delta, block = e["delta"], blocks[e["index"]]
            if delta["type"] == "input_json_delta":
                inputs[e["index"]] = inputs.get(e["index"], "") + delta["partial_json"]
            else:
                key = {"text_delta": "text", "thinking_delta": "thinking",
                       "signature_delta": "signature"}[delta["type"]]
                block[key] = block[key] + delta[key] if key != "signature" else delta[key]
        elif e["type"] == "content_block_stop" and e["index"] in inputs:
            blocks[e["index"]]["input"] = json.loads(inputs[e["index"]])
    return blocks


def test_a_reasoning_parser_makes_a_thinking_block(servers, tiny_long):
    tiny, _ = tiny_long
    c = client(servers["r1"])
    ids = template_ids(tiny, user("Weather?"), template=THINKS)
    kw = dict(model="tiny", messages=user("Weather?"), max_tokens=12, extra_body=GREEDY)
    m = c.messages.create(**kw)
    thought = library(tiny_long, ids, 12).text  # never closed: all of it is thinking
    assert [(b.type, b.thinking, b.signature) for b in m.content] == [("thinking", thought, "")]
    assert m.stop_reason == "max_tokens"
    final, events = streamed(c, **kw)
    assert dumped(final) == dumped(m)
    assert "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                   and e.delta.type == "thinking_delta") == thought

    closing = {str(END_THINK_ID): 100.0}  # the model closes the block at once; the format holds what follows
    schema = {"enum": ["yes", "no"]}
    answered = c.messages.create(model="tiny", messages=user("Weather?"), max_tokens=20,
                                 output_config={"format": {"type": "json_schema", "schema": schema}},
                                 extra_body={**GREEDY, "logit_bias": closing})
    thinking = reasoning.Thinking.of("deepseek_r1", "<think>", tiny.tokenizer)
    expected = library(tiny_long, ids, 20, thinking.hold(Grammar.json_schema(schema)),
                       logit_bias=((END_THINK_ID, 100.0),))
    assert [(b.type, b.text) for b in answered.content] == [("text", thinking.split(expected.text, final=True)[1])]


def test_a_thinking_budget_ends_the_thinking_after_that_many_tokens(servers, tiny_long, request):
    """Anthropic's `thinking.budget_tokens` and vLLM's `thinking_token_budget` (chat): the reply
    thinks as the model would for that many tokens, then `</think>` is forced and it answers as the
    model goes on from there. (A prompt whose greedy thought and answer are whole characters: the
    grammar that holds the budget admits text, and this tiny model also writes stray bytes.)"""
    tiny, _ = tiny_long
    plain_tiny = request.getfixturevalue("tiny")
    ids = template_ids(tiny, user("Why?"), template=THINKS)
    free = library(tiny_long, ids, 12)
    assert END_THINK_ID not in free.tokens  # (unheld, it thinks past the budget)
    forced = free.tokens[:2] + [END_THINK_ID]
    after = library(tiny_long, ids + forced, 8)
    thought, answer = reasoning.Thinking.of("deepseek_r1", "<think>", tiny.tokenizer).split(
        tiny.tokenizer.decode(forced + after.tokens), final=True)
    assert thought == tiny.tokenizer.decode(free.tokens[:2]) and answer and "\ufffd" not in thought + answer
    m = client(servers["r1"]).messages.create(model="tiny", messages=user("Why?"), max_tokens=11,
                                              thinking={"type": "enabled", "budget_tokens": 2}, extra_body=GREEDY)
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in m.content] == [("thinking", thought),
                                                                                    ("text", answer)]
    assert dumped(streamed(client(servers["r1"]), model="tiny", messages=user("Why?"), max_tokens=11,
                           thinking={"type": "enabled", "budget_tokens": 2}, extra_body=GREEDY)[0]) == dumped(m)
    chat = openai.OpenAI(base_url=f"{servers['r1']}/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model="tiny", messages=user("Why?"), max_tokens=11, temperature=0, extra_body={"thinking_token_budget": 2})
    assert (chat.choices[0].message.reasoning, chat.choices[0].message.content) == (thought, answer)
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget: needs the server started with"):
        openai.OpenAI(base_url=f"{servers['plain']}/v1", api_key=KEY, max_retries=0).chat.completions.create(
            model="tiny", messages=user("Hi"), max_tokens=2, extra_body={"thinking_token_budget": 3})
    # the closer must be a token of its own for a budget to force it (else chat's field is a 400)
    assert reasoning.marker_ids(tiny.tokenizer) == (THINK_ID, END_THINK_ID)
    assert reasoning.marker_ids(plain_tiny.tokenizer) == (-1, -1)  # (the suite's other tiny model: markers are text)


def test_tool_input_reads_as_much_json_as_is_whole_as_the_sdk_does():
    text = '{"city": "Oslo", "days": [1, 2], "note": "a \\"b\\" c"}'
    for end in range(len(text) + 1):
        expected = jiter.from_json(text[:end].encode(), partial_mode=True) if text[:end] else {}
        assert messages.tool_input(text[:end]) == expected
    assert messages.tool_input("[1, 2]") == {} and messages.tool_input("not json") == {}


# --------------------------------------------------------------------------------------------
# Errors, in Anthropic's shape
# --------------------------------------------------------------------------------------------

ASSISTANT_CALL = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "now", "input": {}}]}
BAD = [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "Hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "now", "input": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [*user("Hi"), {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "now", "input": "{}"}]}, *user("Ok")]}, "messages[1].content[0].input"),
    ({"messages": [*user("Hi"), ASSISTANT_CALL,
                   {"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
     "messages[2].content[0].tool_use_id"),
    ({"messages": [*user("Hi"), ASSISTANT_CALL]}, "messages[1]"),
    ({"messages": [{"role": "assistant", "content": "Hi"}]}, "messages"),
    ({"system": [{"type": "image"}]}, "system[0].type"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"name": "now"}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "", "input_schema": {"type": "object"}}]}, "tools[0].name"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"tools": TOOLS, "tool_choice": {"type": ["auto"]}}, "tool_choice.type"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
    ({"messages": [*user("Hi"), ASSISTANT_CALL, {"role": "user", "content": [
        {"type": "text", "text": "Here:"}, {"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}]},
     "messages[2].content[1].type"),
    ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format.type"),
    ({"messages": [*user("Hi"), ASSISTANT_CALL, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "x"}, {"type": "text", "text": "And:"},
        {"type": "tool_result", "tool_use_id": "t1", "content": "y"}]}]}, "messages[2].content[2].type"),
    ({"messages": [*user("Hi"), ASSISTANT_CALL, *user("Here:"), {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}]}, "messages[3].content[0].type"),
    ({"thinking": {"type": "enabled", "budget_tokens": True}}, "thinking.budget_tokens"),
    ({"tools": TOOLS}, "tool_choice"),  # ("auto", the default: no --tool-call-parser on this server)
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"thinking": {"type": "enabled", "budget_tokens": 8}}, "thinking.budget_tokens"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
    ({"mcp_servers": [{"type": "url", "url": "http://127.0.0.1:1", "name": "x"}]}, "mcp_servers"),
]


@pytest.mark.parametrize("extra, field", BAD, ids=[f for _, f in BAD])
def test_a_bad_request_is_an_anthropic_400_naming_the_field(servers, extra, field):
    body = {"model": "tiny", "max_tokens": 8, "messages": user("Hi"), **extra}
    r = httpx.post(f"{servers['plain']}/v1/messages", json={k: v for k, v in body.items() if v is not None},
                   headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert re.match(rf"{re.escape(field)}[: ]", error["error"]["message"]), error


def test_auth_size_and_sdk_errors_are_anthropics(servers):
    with pytest.raises(anthropic.AuthenticationError) as wrong:
        client(servers["plain"], "wrong").messages.create(model="tiny", max_tokens=2, messages=user("Hi"))
    assert wrong.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        client(servers["plain"]).messages.create(model="tiny", max_tokens=2, messages=user("Hi"),
                                                 tools=[{"name": "now"}])
    assert bad.value.body["error"]["message"].startswith("tools[0].input_schema:")
    big = httpx.post(f"{servers['plain']}/v1/messages/count_tokens", headers={"x-api-key": KEY}, timeout=30,
                     json={"model": "tiny", "messages": user("x" * 60_000)})
    assert big.status_code == 413 and big.json()["error"]["type"] == "request_too_large"
    for method, path, status in (("GET", "/v1/messages", 405), ("POST", "/v1/messages/batches", 404)):
        r = httpx.request(method, f"{servers['plain']}{path}", headers={"x-api-key": KEY}, timeout=30)
        assert r.status_code == status and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == {404: "not_found_error", 405: "invalid_request_error"}[status]
    with pytest.raises(anthropic.BadRequestError, match='ask for "any", a named tool or "none"'):
        client(servers["plain"]).messages.create(model="tiny", max_tokens=2, messages=user("Hi"), tools=TOOLS)
    metrics = httpx.get(f"{servers['plain']}/metrics", timeout=30).text
    assert 'endpoint="/v1/messages",status="401"' in metrics and 'endpoint="/v1/messages",status="200"' in metrics


def test_a_stream_that_fails_ends_with_an_error_event(servers, long_engine, monkeypatch):
    """The server ends the running sequences (here `abort`, as a shutdown's drain timeout does):
    the stream's last event is Anthropic's `error`, which the SDK raises. The engine's decode
    calls wait for the abort past 64 tokens, so the text cannot end first."""
    aborted = decoding_held_past(monkeypatch, long_engine)
    body = {"model": "tiny", "messages": user("Hi"), "max_tokens": 700, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{servers['plain']}/v1/messages", json=body, headers={"x-api-key": KEY},
                      timeout=60) as r:
        events = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
                if [e["type"] for e in events].count("content_block_delta") == 1:  # once, at the first text
                    long_engine.abort("shutdown")
                    aborted.set()
    monkeypatch.undo()
    assert events[-1] == {"type": "error", "error": {"type": "overloaded_error",
                                                     "message": "the server is shutting down"}}
    assert "message_stop" not in [e["type"] for e in events]
    assert client(servers["plain"]).messages.create(model="tiny", max_tokens=2, messages=user("Hi")).content
