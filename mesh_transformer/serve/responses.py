"""`POST /v1/responses`: OpenAI's Responses API over the chat machinery (`serve.chat`), with
`GET` and `DELETE /v1/responses/{id}` for the responses the server keeps.

A request's `input` (a string: one user message; or items: messages, `function_call`s,
`function_call_output`s, `reasoning`) and `instructions` (a system message first) become chat
messages, rendered by the chat template as /v1/chat/completions renders them. Its `tools` (flat
function tools), `tool_choice` and `parallel_tool_calls` mean what they do there (`serve.tools`),
`text.format` holds the reply to a JSON schema (`formats.text_format`), and a reasoning parser
splits off the thinking. The reply comes back as output items: a `reasoning` item, a `message`
with its `output_text`, and a `function_call` per call. `status` is "incomplete" (with
`incomplete_details.reason` "max_output_tokens") when `max_output_tokens` cut it.

Streamed (`stream: true`), the answer is OpenAI's typed events (`event:` and `data:` lines):
`response.created`, `response.in_progress`, then per item `response.output_item.added`,
its content's `..content_part.added`, deltas (`response.output_text.delta`,
`response.reasoning_text.delta`, `response.function_call_arguments.delta`) and `...done`s,
and last `response.completed` (or `response.incomplete`, or `response.failed`) with the whole
response, whose items are the ones streamed. A named call's arguments stream as generated; calls
read from the text come at the end, after the message, where the whole reply has them.

Kept responses (`store`, true by default, as OpenAI's): the server keeps the last `kept` (an
in-memory store: a restart forgets them). `previous_response_id` continues one: its input and
output items come before the new input (its `instructions` do not carry over, as OpenAI's).
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from fastapi import Request as HttpRequest
from pydantic import Field

from mesh_transformer.generate import Sequence
from mesh_transformer.io.chat_template import FieldError, template_messages
from mesh_transformer.serve import chat
from mesh_transformer.serve import formats
from mesh_transformer.serve import openai as oa
from mesh_transformer.serve import reasoning
from mesh_transformer.serve import tools as tool_calls

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
INPUT_ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")  # (output_text: an earlier reply's, given back)
LOGPROBS = "message.output_text.logprobs"  # `include`'s value for the output text's token logprobs
KNOWN_INCLUDES = (LOGPROBS, "reasoning.encrypted_content")  # (encrypted reasoning: none here, so none comes back)
KEPT = 1000  # responses kept for previous_response_id and GET, by default


class ResponsesRequest(oa.SamplingExtensions):
    """OpenAI's /v1/responses body (plus vLLM's sampling extensions, as chat takes them)."""

    model: Optional[str] = None
    input: Union[str, list[Any]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    tools: Optional[list] = None
    tool_choice: Optional[Union[str, dict]] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[dict[str, Any]] = None
    reasoning: Optional[dict[str, Any]] = None
    store: Optional[bool] = None  # default (null too): true
    previous_response_id: Optional[str] = None
    stream: bool = False
    include: Optional[list[str]] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=5)
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    truncation: Optional[str] = None
    background: Optional[bool] = None
    conversation: Optional[Any] = None  # OpenAI's Conversations API and stored prompts: not here (a 400)
    prompt: Optional[Any] = None


class InputTokensRequest(ResponsesRequest):
    """/v1/responses/input_tokens: what a /v1/responses request would render (its input may be
    left out where `previous_response_id` gives the conversation)."""

    input: Optional[Union[str, list[Any]]] = None


@dataclass
class Kept:
    """A kept response and the items its conversation holds (input, then output) for the next one."""

    response: dict
    items: list[dict]


class Store:
    """The last `size` kept responses, by id (oldest dropped first)."""

    def __init__(self, size: int = KEPT):
        self.size, self.kept = size, OrderedDict()

    def put(self, kept: Kept) -> None:
        if self.size <= 0:
            return
        self.kept[kept.response["id"]] = kept
        while len(self.kept) > self.size:
            self.kept.popitem(last=False)

    def get(self, response_id: str, field_name: str = "response_id") -> Kept:
        """The kept response; else a 404 (a 400 with OpenAI's code "previous_response_not_found" when
        a request continues it, which clients match to start the conversation afresh)."""
        found = self.kept.get(response_id)
        if found is None:
            why = (f"{field_name}: no kept response has the id {response_id!r} (responses made with store: false, "
                   f"or over {self.size} responses ago, or before the server started, are not kept)")
            if field_name == "previous_response_id":
                raise oa.ApiError(400, why, param=field_name, code="previous_response_not_found")
            raise oa.ApiError(404, why, "not_found_error", param=field_name)
        return found

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self.kept[response_id]


# --------------------------------------------------------------------------------------------
# Input items -> chat messages
# --------------------------------------------------------------------------------------------

def _text_of(content, where: str) -> str:
    """A message's or output's content (a string, or text parts) as one string of valid Unicode."""
    if isinstance(content, str):
        return oa.check_text(content, where)
    if not isinstance(content, list):
        oa.bad(where, f"a string or a list of text parts, got {type(content).__name__}")
    pieces = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = "refusal" if kind == "refusal" else "text"
        if kind not in TEXT_PARTS and kind != "refusal":
            oa.bad(f"{where}[{j}].type", f"only text parts ({', '.join(TEXT_PARTS[:2])}) are supported, got {kind!r}")
        if not isinstance(part.get(key), str):
            oa.bad(f"{where}[{j}].{key}", f"a string is required, got {type(part.get(key)).__name__}")
        pieces.append(oa.check_text(part[key], f"{where}[{j}].{key}"))
    return "".join(pieces)


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text: its `content`'s reasoning text, else its summary's."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts:
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                      for p in parts):
                oa.bad(f"{where}.{key}", "a list of {\"type\", \"text\"} parts is required")
            return "".join(oa.check_text(p["text"], f"{where}.{key}[{j}].text") for j, p in enumerate(parts))
    return ""


def chat_messages(items: list, labels: list[str]) -> tuple[list[dict], list[dict]]:
    """Responses input items (`labels[i]` names item i in errors) as OpenAI chat messages, and the
    items with only what the conversation keeps of them (what a kept response holds). A function
    call joins the assistant message just before it (or starts one); a reasoning item's text goes
    to the next assistant message (dropped if a user or tool message
    comes first: a reply cut while thinking); a call's output is a `tool` message; a call that was
    cut short (`status` "incomplete", its arguments not an object) is left out: it cannot be
    answered. A 400 names the item's field at fault."""
    messages, kept, thought, joinable = [], [], None, False
    for item, where in zip(items, labels):
        if not isinstance(item, dict):
            oa.bad(where, f"an input item (an object), got {type(item).__name__}")
        kind = item.get("type", "message")
        if kind not in ITEM_TYPES:
            oa.bad(f"{where}.type", f"one of {', '.join(ITEM_TYPES)}, got {kind!r}")
        if kind == "reasoning":
            text = _reasoning_text(item, where)
            thought = (thought or "") + text
            kept.append({"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]})
            continue
        if kind == "function_call":
            arguments = item.get("arguments") or "{}"  # (some clients send "" for no arguments)
            if not isinstance(arguments, str) or not isinstance(oa.json_value(arguments), dict):
                if item.get("status") == "incomplete":
                    continue
                oa.bad(f"{where}.arguments", f"the JSON text of an object is required, got {arguments!r}")
            call_id, name = oa.required_text(item, "call_id", where), oa.required_text(item, "name", where)
            if not joinable:
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
            kept.append({"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments})
            joinable = True
        elif kind == "function_call_output":
            call_id, output = oa.required_text(item, "call_id", where), _text_of(item.get("output"), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
            kept.append({"type": "function_call_output", "call_id": call_id, "output": output})
            joinable = False
        else:
            role = item.get("role")
            if role not in INPUT_ROLES:
                oa.bad(f"{where}.role", f"one of {', '.join(INPUT_ROLES)}, got {role!r}")
            content = _text_of(item.get("content"), f"{where}.content")
            messages.append({"role": role, "content": content})
            kept.append({"type": "message", "role": role, "content": content})
            joinable = role == "assistant"
        if messages[-1]["role"] != "assistant":
            thought = None
        elif thought is not None:
            earlier = messages[-1].get("reasoning", "")
            messages[-1]["reasoning"], thought = earlier + thought, None
    return messages, kept


def _function(i: int, tool) -> dict:
    """A Responses function tool's (`{"type": "function", "name", "description", "parameters",
    "strict"}`) fields, as chat's `function` holds them (`tools.chat_tools`)."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        oa.bad(f"tools[{i}].type", f"only function tools are supported (hosted tools such as web_search run at "
                                 f"OpenAI), got {kind!r}")
    return {k: tool[k] for k in ("name", "description", "parameters") if k in tool}


def _flat_choice(given):
    """Responses' `tool_choice` in chat's form: "none", "auto", "required", or `{"type":
    "function", "name"}`."""
    if given is None or given in tool_calls.CHOICES:
        return given
    name = given.get("name") if isinstance(given, dict) else None
    if not isinstance(given, dict) or given.get("type") != "function" or not isinstance(name, str):
        oa.bad("tool_choice", f"none, auto, required, or a named function: {{\"type\": \"function\", \"name\": ..}}; "
                            f"got {given!r}")
    return {"type": "function", "function": {"name": name}}


CHAT_NAMES = ((".function.", "."), ("tool_choice.function", "tool_choice"))  # chat's field names -> Responses'


# --------------------------------------------------------------------------------------------
# The request
# --------------------------------------------------------------------------------------------

def _check_fields(body: ResponsesRequest) -> None:
    if body.background:
        oa.bad("background", "background responses are not supported (ask without it, or stream)")
    if body.conversation is not None:
        oa.bad("conversation", "conversations are not kept here: continue a kept response with previous_response_id")
    if body.prompt is not None:
        oa.bad("prompt", "stored prompts (prompt templates) are not supported: send input and instructions")
    if body.truncation not in (None, "disabled"):
        oa.bad("truncation", f"only \"disabled\" is supported (a conversation longer than the context is a 400), "
                           f"got {body.truncation!r}")
    for i, name in enumerate(body.include or ()):
        if name not in KNOWN_INCLUDES:
            oa.bad(f"include[{i}]", f"one of {', '.join(KNOWN_INCLUDES)}, got {name!r}")
    if body.top_logprobs and LOGPROBS not in (body.include or ()):
        oa.bad("top_logprobs", f"needs include: [\"{LOGPROBS}\"]")
    if body.instructions is not None:
        oa.check_text(body.instructions, "instructions")


def _check_logprobs(s: oa.Settings, body: ResponsesRequest) -> Optional[int]:
    """How many alternatives per token the output text's logprobs carry (None: no logprobs). They
    are the reply's tokens, so only where all of the reply is the text: not with tools, nor with a
    reasoning parser."""
    if LOGPROBS not in (body.include or ()):
        return None
    if body.tools or s.reasoning_parser:
        where = "tools" if body.tools else "the server's --reasoning-parser"
        oa.bad("include", f"{LOGPROBS} covers replies that are all text; with {where} part of a reply may be "
                        f"calls or thinking")
    return body.top_logprobs or 0


def _template_variables(body: ResponsesRequest) -> Optional[dict]:
    """`chat_template_kwargs`, with `reasoning.effort` as `reasoning_effort` (the variable templates
    of models with effort levels read, gpt-oss's among them) unless they set it themselves."""
    effort = (body.reasoning or {}).get("effort")
    if effort is None:
        return body.chat_template_kwargs
    if not isinstance(effort, str):
        oa.bad("reasoning.effort", f"a string (low, medium, high ..), got {type(effort).__name__}")
    return {"reasoning_effort": effort, **(body.chat_template_kwargs or {})}


def _conversation(store: Store, body: ResponsesRequest) -> tuple[list[dict], list[dict]]:
    """(the conversation's items: the previous response's, then this request's input; the
    messages the template renders: the instructions, then those items)."""
    if isinstance(body.input, str):
        oa.check_text(body.input, "input")
    given = [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) else \
        body.input or []
    if not given and (body.input is not None or body.previous_response_id is None):
        oa.bad("input", "at least one input item is required")
    earlier = store.get(body.previous_response_id, "previous_response_id").items \
        if body.previous_response_id is not None else []
    labels = ["previous_response_id"] * len(earlier) + (
        ["input"] if isinstance(body.input, str) else [f"input[{i}]" for i in range(len(given))])
    messages, kept = chat_messages(earlier + given, labels)
    if body.instructions is not None:
        messages = [{"role": "system", "content": body.instructions}] + messages
    try:
        return kept, template_messages(messages)
    except FieldError as e:  # (not expected: `chat_messages` checked every field it passes on)
        raise oa.ApiError(400, f"input: {e}", param="input") from None


def _plan(s: oa.Settings, body: ResponsesRequest) -> Optional[tool_calls.Plan]:
    """The request's tools and tool choice, as chat's (`tools.plan_for`)."""
    tools = tool_calls.chat_tools(body.tools, _function)
    choice = _flat_choice(body.tool_choice)
    return tool_calls.plan_for(tool_calls.read_tools(tools), choice, body.parallel_tool_calls, s.tool_parser)


def _rendering(body: ResponsesRequest):
    return chat.rendering(chat.TemplateFields(chat_template_kwargs=_template_variables(body)))


async def input_tokens(s: oa.Settings, http: HttpRequest):
    """`POST /v1/responses/input_tokens`: the tokens a request's conversation (its previous
    response's, its instructions, its input) and tools make, as /v1/responses would count them."""
    body = oa.parse(await http.body(), InputTokensRequest)
    _check_fields(body)
    _, messages = _conversation(s.responses, body)
    try:
        plan = _plan(s, body)
        _, ids = chat.prompt(s, messages, _rendering(body), plan.specs() if plan else None, "input")
    except oa.ApiError as e:
        raise tool_calls.renamed(e, CHAT_NAMES) from None
    return {"object": "response.input_tokens", "input_tokens": len(ids)}


async def create(s: oa.Settings, http: HttpRequest):
    body = oa.parse(await http.body(), ResponsesRequest)
    _check_fields(body)
    store: Store = s.responses
    history, messages = _conversation(store, body)
    try:
        plan = _plan(s, body)
        # (checked even where a forced call, which `prepare` holds to its own grammar, leaves it no text)
        text_grammar = await asyncio.to_thread(formats.text_format, s.engine, body.text) if body.text else None
        how = _rendering(body)
        logprobs = _check_logprobs(s, body)
        reply = await chat.prepare(s, body, messages, how, plan, body.max_output_tokens, "max_output_tokens", (),
                                   logprobs, text_grammar, "text.format", "input")
    except oa.ApiError as e:
        raise tool_calls.renamed(e, CHAT_NAMES) from None
    seqs = await oa.sequences(s, [reply.ids], reply.opts, 1, body.seed, body.model)
    response = Response(s, body, reply.shape, f"resp_{uuid.uuid4().hex}")
    if body.stream:
        request = oa.submit(s.engine, seqs)
        return oa.streaming_response(_events(store, request, response, history))
    await oa.wait(s.engine, seqs, s.timeout)
    whole = response.finished(seqs[0], response.items(seqs[0]))
    _keep(store, body, whole, history)
    return whole


def _keep(store: Store, body: ResponsesRequest, response: dict, history: list) -> None:
    """`response` kept (unless the request said not to, or it failed) with its conversation's
    items: `history` (the earlier ones and this request's input), then its output."""
    if body.store is not False and response["status"] != "failed":
        output = response["output"]  # (its cut calls are "incomplete": left out of the conversation)
        store.put(Kept(response, history + chat_messages(output, ["output"] * len(output))[1]))


async def retrieve(s: oa.Settings, http: HttpRequest):
    if http.query_params.get("stream", "false").lower() not in ("false", "0"):
        oa.bad("stream", "a kept response is answered whole: its events are not kept to stream again")
    return s.responses.get(http.path_params["response_id"]).response


async def delete(s: oa.Settings, http: HttpRequest):
    response_id = http.path_params["response_id"]
    s.responses.delete(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


# --------------------------------------------------------------------------------------------
# The response
# --------------------------------------------------------------------------------------------

def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class Response:
    """One response's fixed fields (what the request asked for) and how its reply becomes items."""

    s: oa.Settings
    body: ResponsesRequest
    shape: chat.Shape
    id: str
    created_at: int = field(default_factory=lambda: int(time.time()))

    def head(self, status: str) -> dict:
        b = self.body
        choice = b.tool_choice if b.tool_choice is not None else ("auto" if b.tools else "none")
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "background": False, "error": None, "incomplete_details": None, "instructions": b.instructions,
                "max_output_tokens": b.max_output_tokens, "model": b.model or self.s.model_name, "output": [],
                "parallel_tool_calls": b.parallel_tool_calls is not False,
                "previous_response_id": b.previous_response_id,
                "reasoning": {"effort": (b.reasoning or {}).get("effort"), "summary": None},
                "store": b.store is not False, "temperature": b.temperature if b.temperature is not None else 1.0,
                "text": b.text or {"format": {"type": "text"}}, "tool_choice": choice, "tools": b.tools or [],
                "top_logprobs": b.top_logprobs or 0, "top_p": b.top_p if b.top_p is not None else 1.0,
                "truncation": "disabled", "usage": None, "user": b.user, "metadata": b.metadata or {}}

    def items(self, seq: Sequence) -> list[dict]:
        """A whole reply's output items: reasoning, the message, the calls."""
        message, finish = self.shape.message(seq.text, seq.finish_reason)
        out = []
        thought, calls = message.get("reasoning"), message.get("tool_calls", ())
        if thought:
            out.append(reasoning_item(_item_id("rs"), thought, "completed"))
        if message.get("content") or not (thought or calls):  # (an empty reply is an empty message)
            out.append(message_item(_item_id("msg"), message["content"] or "", "completed", self.logprobs(seq)))
        for call in calls:
            fn = call["function"]
            out.append(call_item(_item_id("fc"), call["id"], fn["name"], fn["arguments"], "completed"))
        if finish == "length":
            cut_item(out)["status"] = "incomplete"
        for item in out:
            finished_call(item)
        return out

    def logprobs(self, seq: Sequence, lo: int = 0, hi: Optional[int] = None) -> list:
        """The output text's token logprobs (with `include` asking for them): the reply's tokens lo..hi."""
        if seq.options.logprobs is None:
            return []
        return chat.token_logprobs(self.s.engine, seq, lo, seq.kept_tokens() if hi is None else hi)["content"]

    def finished(self, seq: Sequence, items: list[dict], error: Optional[str] = None) -> dict:
        """The whole response: `items`, its status (by `seq`'s finish reason), its usage."""
        if error is not None:
            return {**self.head("failed"), "output": items, "error": {"code": "server_error", "message": error}}
        cut = seq.finish_reason == "length"
        out = {**self.head("incomplete" if cut else "completed"), "output": items, "usage": self.usage(seq, items)}
        if cut:
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out

    def usage(self, seq: Sequence, items: list[dict]) -> dict:
        output = seq.kept_tokens() if seq.finished else len(seq.tokens)
        thought = any(item["type"] == "reasoning" for item in items)
        return {"input_tokens": len(seq.prompt), "input_tokens_details": {"cached_tokens": seq.cached_tokens},
                "output_tokens": output,
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens(self.s.engine.tokenizer, seq, output,
                                                                                 self.shape.thinking)
                                          if thought else 0},
                "total_tokens": len(seq.prompt) + output}


def cut_item(items: list[dict]) -> dict:
    """The item being written when `max_output_tokens` cut a reply: its message (calls read from
    the text are whole, and come after it), else its last item."""
    return next((item for item in items if item["type"] == "message"), items[-1])


def finished_call(item: dict) -> None:
    """A call whose arguments are not an object (a named call cut short, by a stop id too) is
    "incomplete": it cannot be answered, and a later turn leaves it out."""
    if item["type"] == "function_call" and not isinstance(oa.json_value(item["arguments"]), dict):
        item["status"] = "incomplete"


def reasoning_tokens(tokenizer, seq: Sequence, output: int, thinking: reasoning.Thinking) -> int:
    """The reply's tokens up to the end of its thinking (`</think>` included, or harmony's answer's
    header; all of them if it never ended): the fewest whose text ends it (a binary search over
    prefixes)."""
    if not thinking.ended(tokenizer.decode(seq.tokens[:output])):
        return output
    lo, hi = 1, output
    while lo < hi:
        mid = (lo + hi) // 2
        if thinking.ended(tokenizer.decode(seq.tokens[:mid])):
            hi = mid
        else:
            lo = mid + 1
    return lo


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "encrypted_content": None, "status": status}


def message_item(item_id: str, text: str, status: str, logprobs: list) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [output_text(text, logprobs)]}


def output_text(text: str, logprobs: list) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


# --------------------------------------------------------------------------------------------
# Streaming: typed events
# --------------------------------------------------------------------------------------------

class EventWriter(chat.CallEvents):
    """Numbered server-sent events, and the output items they open, fill and close."""

    def __init__(self, response: Response):
        super().__init__(response.shape)
        self.number, self.items = 0, []
        self.open: Optional[dict] = None  # the item being written
        self.held: list = []  # token logprobs of text not yet sent (a partial character)

    def event(self, kind: str, **fields) -> bytes:
        payload = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()

    def _start(self, item: dict, part: Optional[dict]) -> list[bytes]:
        out = self.close("completed")
        self.open = item
        self.items.append(item)
        index = len(self.items) - 1
        out.append(self.event("response.output_item.added", output_index=index,
                              item={**item, "status": "in_progress",
                                    **({"content": []} if part is not None else {})}))
        if part is not None:
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part=part))
        return out

    def text(self, kind: str, delta: str, logprobs: list) -> list[bytes]:
        """New reasoning ("reasoning") or answer ("message") text."""
        out = []
        if self.open is None or self.open["type"] != kind:
            item = reasoning_item(_item_id("rs"), "", "completed") if kind == "reasoning" else \
                message_item(_item_id("msg"), "", "completed", [])
            out += self._start(item, item["content"][0] | {"text": ""})
        part = self.open["content"][0]
        part["text"] += delta
        index = len(self.items) - 1
        if not delta and not self.held and not logprobs:
            return out  # (an empty reply: its message, no delta)
        if kind == "reasoning":
            out.append(self.event("response.reasoning_text.delta", item_id=self.open["id"], output_index=index,
                                  content_index=0, delta=delta))
        else:
            logprobs, self.held = self.held + logprobs, []
            part["logprobs"] += logprobs
            out.append(self.event("response.output_text.delta", item_id=self.open["id"], output_index=index,
                                  content_index=0, delta=delta, logprobs=logprobs))
        return out

    def end(self, status: str) -> list[bytes]:
        """The last events before the response's: the open item closed (an empty reply is an
        empty message), then the calls read from the text; the last item ends with `status`,
        the others "completed"."""
        deferred = self.take_deferred()
        out = self.text("message", "", []) if (not self.items and not deferred) or self.held else []
        message = any(item["type"] == "message" for item in self.items)  # the item cut, if there is one (`cut_item`)
        out += self.close(status if message or not deferred else "completed")
        for i, entry in enumerate(deferred):
            out += self.call(entry) + self.close(status if i == len(deferred) - 1 and not message else "completed")
        return out

    def write_call(self, entry: dict) -> list[bytes]:
        """A new call (with its id), or more of the open one's arguments."""
        out, fn = [], entry.get("function", {})
        if "id" in entry:
            out += self._start(call_item(_item_id("fc"), entry["id"], fn["name"], "", "completed"), None)
        arguments = fn.get("arguments", "")
        if arguments:
            self.open["arguments"] += arguments
            out.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                  output_index=len(self.items) - 1, delta=arguments))
        return out

    def close(self, status: str) -> list[bytes]:
        """The `..done` events of the open item, which ends with `status`."""
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        finished_call(item)
        index, out = len(self.items) - 1, []
        if item["type"] == "function_call":
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            extra = {} if item["type"] == "reasoning" else {"logprobs": part["logprobs"]}
            out.append(self.event(done, item_id=item["id"], output_index=index, content_index=0, text=part["text"],
                                  **extra))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part))
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out


async def _events(store: Store, request, response: Response, history: list):
    """The typed events of one streamed response (see the module's docstring); kept when done."""
    writer = EventWriter(response)
    started = response.head("in_progress")
    yield writer.event("response.created", response=started)
    yield writer.event("response.in_progress", response=started)
    seq = request.seqs[0]
    reply = chat.StreamedReply(response.shape)
    include_logprobs = seq.options.logprobs is not None
    try:
        async for d in oa.deltas(request):
            finished = d.finish_reason is not None
            delta = reply.feed(d.text, finished)
            logprobs = response.logprobs(seq, d.lo, d.hi) if include_logprobs and d.hi > d.lo else []
            for chunk in _delta_events(writer, delta, logprobs):
                yield chunk
    except oa.StreamFailed as e:
        for chunk in writer.close("incomplete"):
            yield chunk
        yield writer.event("response.failed", response=response.finished(seq, writer.items, oa.FAILED[str(e)]))
        return
    cut = seq.finish_reason == "length"
    for chunk in writer.end("incomplete" if cut else "completed"):  # (the item being written when it was cut)
        yield chunk
    whole = response.finished(seq, writer.items)
    _keep(store, response.body, whole, history)
    yield writer.event("response.incomplete" if cut else "response.completed", response=whole)


def _delta_events(writer: EventWriter, delta: dict, logprobs: list) -> list[bytes]:
    """The events of one chat delta (`chat.StreamedReply.feed`): reasoning, content, calls."""
    out = []
    if delta.get("reasoning"):
        out += writer.text("reasoning", delta["reasoning"], [])
    if delta.get("content"):
        out += writer.text("message", delta["content"], logprobs)
    else:
        writer.held += logprobs  # (with logprobs, all of the reply is text: `_check_logprobs`)
    for entry in delta.get("tool_calls", ()):
        out += writer.call(entry)
    return out
