"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API over the chat
machinery (`serve.chat`), for clients written against it (Anthropic's SDKs, Claude Code and other
agents that take a base URL).

A request's `system` and `messages` become chat messages, rendered by the chat template as
/v1/chat/completions renders them. Content blocks map as follows:
- `text` blocks are the message's text (blocks joined by a newline, as are consecutive messages
  of one role, which Anthropic combines into one turn);
- an assistant's `tool_use` blocks are its calls, a user's `tool_result` blocks `tool` messages;
- an assistant's `thinking` blocks are its earlier reasoning (`redacted_thinking`: nothing to
  show, left out).
A final assistant message is a prefill: the reply continues it (the template's
`continue_final_message`), and does not repeat it.

`tools` (`name`, `description`, `input_schema`) and `tool_choice` (`auto`, `any`, `tool`, `none`;
`disable_parallel_tool_use`) mean what chat's do (`serve.tools`). `thinking` sets the template's
`enable_thinking` (the variable Qwen 3-style templates read) and its `budget_tokens` caps the
thinking (`chat.prepare`), `output_config.effort` its
`reasoning_effort`, and `output_config.format` holds the reply to a JSON schema. The reply comes
back as content blocks: `thinking` (with `--reasoning-parser`), `text`, and a `tool_use` per call,
with `stop_reason` `end_turn`, `max_tokens`, `stop_sequence` (and the `stop_sequence` that ended
it) or `tool_use`. `usage.input_tokens` counts the prompt's tokens computed, and
`cache_read_input_tokens` those read from the prefix cache, as Anthropic counts them.

Streamed (`stream: true`), the answer is Anthropic's events: `message_start`, then per block
`content_block_start`, its deltas (`text_delta`, `thinking_delta`, `input_json_delta`) and
`content_block_stop`, then `message_delta` (the stop reason, the usage) and `message_stop`; an
`error` event if generation fails. A named tool's input streams as generated; calls read from the
text come at the end, where the whole reply has them, so the blocks streamed are the blocks sent
whole.

Errors are Anthropic's `{"type": "error", "error": {"type", "message"}}`; a 400's message starts
with the field at fault. Not here: images and documents, server tools (web search, code execution,
MCP servers), citations.
"""
from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Union

import pydantic_core
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse
from pydantic import Field

from mesh_transformer.generate import Sequence
from mesh_transformer.io.chat_template import FieldError, Rendering, template_messages
from mesh_transformer.serve import chat
from mesh_transformer.serve import formats
from mesh_transformer.serve import openai as oa
from mesh_transformer.serve import tools as tool_calls

ROLES = ("user", "assistant")
JOIN = "\n"  # between text blocks of one turn
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error",
               504: "timeout_error"}  # Anthropic's error types by status (else api_error)
STREAM_ERRORS = {"timeout": "timeout_error", "shutdown": "overloaded_error", "error": "api_error"}


class CountRequest(oa.SamplingExtensions):
    """Anthropic's /v1/messages/count_tokens body: what a message request renders (with vLLM's
    extensions, which /v1/messages takes)."""

    model: Optional[str] = None
    messages: list[Any] = Field(min_length=1)
    system: Optional[Union[str, list[Any]]] = None
    tools: Optional[list] = None
    tool_choice: Optional[dict[str, Any]] = None
    thinking: Optional[dict[str, Any]] = None
    output_config: Optional[dict[str, Any]] = None
    mcp_servers: Optional[list] = None  # server-side features: a 400 when asked for
    container: Optional[Any] = None


class MessagesRequest(CountRequest):
    """Anthropic's /v1/messages body."""

    max_tokens: int
    stop_sequences: Optional[list[str]] = None
    stream: bool = False
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    metadata: Optional[dict[str, Any]] = None
    service_tier: Optional[str] = None


def error_response(e: oa.ApiError) -> JSONResponse:
    """An error in Anthropic's shape."""
    return JSONResponse(error_body(e.status, e.message), e.status)


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


# --------------------------------------------------------------------------------------------
# system and messages -> chat messages
# --------------------------------------------------------------------------------------------

def _block_list(content, where: str) -> list:
    """A message's content as blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        oa.bad(where, f"a string or a list of content blocks, got {type(content).__name__}")
    return content


def _text(block: dict, key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        oa.bad(f"{where}.{key}", f"a string is required, got {type(value).__name__}")
    return oa.check_text(value, f"{where}.{key}")


def _texts(content, where: str) -> str:
    """Content that may hold text blocks alone (`system`, a tool result) as one string."""
    pieces = []
    for j, block in enumerate(_block_list(content, where)):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            oa.bad(f"{where}[{j}].type", f"only text blocks are supported here, got {kind!r}")
        pieces.append(_text(block, "text", f"{where}[{j}]"))
    return JOIN.join(pieces)


class _Turns:
    """Chat messages built block by block: a block of a role joins that role's open message."""

    def __init__(self):
        self.messages: list[dict] = []
        self.user_text = False  # the user's turn (its messages, combined) has text so far

    def open(self, role: str) -> dict:
        if not self.messages or self.messages[-1]["role"] != role:
            self.messages.append({"role": role, "content": ""})
        return self.messages[-1]

    def text(self, role: str, text: str) -> None:
        self.user_text = self.user_text or role == "user"
        message = self.open(role)
        message["content"] = f"{message['content']}{JOIN}{text}" if message["content"] else text


def chat_messages(system, messages: list) -> tuple[list[dict], bool]:
    """(Anthropic's `system` and `messages` as OpenAI chat messages, whether the last is a prefill
    the reply continues); a 400 names the block's field at fault."""
    turns = _Turns()
    if system is not None:
        turns.text("system", _texts(system, "system"))
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            oa.bad(f"{where}.role", f"one of {', '.join(ROLES)}, got {role!r}")
        if role == "assistant":
            turns.user_text = False
        for j, block in enumerate(_block_list(message.get("content"), f"{where}.content")):
            _add_block(turns, role, block, f"{where}.content[{j}]")
        if role == "assistant":
            turns.open("assistant")  # (an assistant message of redacted thinking alone is still its turn)
    out = turns.messages
    prefill = bool(out) and out[-1]["role"] == "assistant"
    if prefill and out[-1].get("tool_calls"):
        oa.bad(f"messages[{len(messages) - 1}]", "a final assistant message is a prefill the reply continues; it "
                                               "cannot end in tool_use (answer the calls in a user message)")
    if not any(m["role"] in ("user", "tool") for m in out):
        oa.bad("messages", "at least one user message is required")
    return out, prefill


def _add_block(turns: _Turns, role: str, block, where: str) -> None:
    kind = block.get("type") if isinstance(block, dict) else None
    allowed = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}
    if kind not in allowed[role]:
        known = "image and document blocks are not supported (text models)" if kind in ("image", "document") \
            else f"a {role} message holds {', '.join(allowed[role])} blocks"
        oa.bad(f"{where}.type", f"{known}; got {kind!r}")
    if kind == "text":
        turns.text(role, _text(block, "text", where))
    elif kind == "tool_use":
        given = block.get("input")
        if not isinstance(given, dict):
            oa.bad(f"{where}.input", f"an object is required, got {type(given).__name__}")
        call = {"id": oa.required_text(block, "id", where), "type": "function",
                "function": {"name": oa.required_text(block, "name", where), "arguments": json.dumps(given)}}
        turns.open("assistant").setdefault("tool_calls", []).append(call)
    elif kind == "tool_result":
        if turns.user_text:
            oa.bad(f"{where}.type", "tool_result blocks come first in a user turn, before its text")
        content = block.get("content", "")
        turns.messages.append({"role": "tool", "tool_call_id": oa.required_text(block, "tool_use_id", where),
                               "content": _texts(content, f"{where}.content")})
    elif kind == "thinking":
        message, thought = turns.open("assistant"), _text(block, "thinking", where)
        message["reasoning"] = f"{message['reasoning']}{JOIN}{thought}" if message.get("reasoning") else thought


def _function(i: int, tool) -> dict:
    """An Anthropic client tool's fields (`name`, `description`, `input_schema`) as chat's
    `function` holds them (`tools.chat_tools`)."""
    if not isinstance(tool, dict):
        oa.bad(f"tools[{i}]", f"a tool (an object), got {type(tool).__name__}")
    if tool.get("type") not in (None, "custom"):
        oa.bad(f"tools[{i}].type", f"only custom tools (type \"custom\", or none, with an input_schema) are "
                                 f"supported; not Anthropic's server tools, nor its tools whose schema it defines "
                                 f"(bash, text_editor, computer: declare them as custom tools); got {tool['type']!r}")
    if "input_schema" not in tool:
        oa.bad(f"tools[{i}].input_schema", "a JSON schema of the tool's input is required")
    function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    return function | ({"description": tool["description"]} if "description" in tool else {})


CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # Anthropic's tool choices -> chat's (and "tool")


def _flat_choice(s: oa.Settings, given: Optional[dict], tools: Optional[list]):
    """Anthropic's `tool_choice` as chat's (and whether it allows more than one call); a 400 in
    Anthropic's words where it cannot be had."""
    kind = "auto" if given is None else given.get("type")
    if not isinstance(kind, str) or (kind not in CHOICES and kind != "tool"):
        oa.bad("tool_choice.type", f"one of auto, any, tool, none; got {kind!r}")
    if given is None and not tools:
        return None, True
    if kind != "none" and not tools:
        oa.bad("tool_choice", f"{kind} needs tools")
    if kind == "auto" and s.tool_parser is None:
        oa.bad("tool_choice", "\"auto\" (the default with tools) needs the server started with --tool-call-parser, "
                              "which reads the model's calls from its text; ask for \"any\", a named tool or \"none\"")
    parallel = (given or {}).get("disable_parallel_tool_use") is not True
    if kind == "tool":
        if not isinstance(given.get("name"), str):
            oa.bad("tool_choice.name", "the name of the tool to use is required")
        return {"type": "function", "function": {"name": given["name"]}}, parallel
    return CHOICES[kind], parallel


CHAT_NAMES = ((".function.parameters", ".input_schema"), (".function.", "."), ("tool_choice.function", "tool_choice"))


def _renamed(e: oa.ApiError) -> oa.ApiError:
    """A chat-shaped 400 with Anthropic's field names (`tools[0].function.parameters` ->
    `tools[0].input_schema`, `stop` -> `stop_sequences`)."""
    if e.param == "stop":
        e.message, e.param = e.message.replace("stop", "stop_sequences", 1), "stop_sequences"
    return tool_calls.renamed(e, CHAT_NAMES)


def _template_variables(body: CountRequest) -> Optional[dict]:
    """`chat_template_kwargs`, with `thinking` as `enable_thinking` and `output_config.effort` as
    `reasoning_effort`, unless they set those themselves."""
    derived = {}
    if body.thinking is not None:
        kind = body.thinking.get("type")
        if kind not in ("enabled", "adaptive", "disabled"):
            oa.bad("thinking.type", f"one of enabled, adaptive, disabled; got {kind!r}")
        derived["enable_thinking"] = kind != "disabled"
    effort = (body.output_config or {}).get("effort")
    if effort is not None:
        if not isinstance(effort, str):
            oa.bad("output_config.effort", f"a string (low, medium, high ..), got {type(effort).__name__}")
        derived["reasoning_effort"] = effort
    return {**derived, **(body.chat_template_kwargs or {})} or None


def _check_fields(body: CountRequest) -> None:
    if body.mcp_servers:
        oa.bad("mcp_servers", "MCP servers are not reached from here: run the tools on the client")
    if body.container is not None:
        oa.bad("container", "code-execution containers are Anthropic's: not here")
    budget = (body.thinking or {}).get("budget_tokens")
    max_tokens = getattr(body, "max_tokens", None)
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1 or
                               (max_tokens is not None and budget >= max_tokens)):
        oa.bad("thinking.budget_tokens", f"a whole number from 1 to below max_tokens, got {budget!r}")


def _output_format(engine, config: Optional[dict]):
    """`output_config.format` (`{"type": "json_schema", "schema": {..}}`, the one kind Anthropic
    has) as a grammar, or None."""
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        oa.bad("output_config.format.type", f"\"json_schema\" (with a schema), got {fmt!r}")
    return formats.text_format(engine, config, "output_config")


def _budget(body: MessagesRequest) -> int:
    """`thinking.budget_tokens` where thinking is on (0: none); `chat.prepare` holds the thinking to it
    where it can (a reasoning parser, `</think>` a token)."""
    thinking = body.thinking or {}
    return thinking.get("budget_tokens") or 0 if thinking.get("type") == "enabled" else 0


@dataclass(frozen=True)
class Rendered:
    """What a request renders: its messages (as templates take them), how, and its tool plan."""

    messages: list[dict]
    plan: Optional[tool_calls.Plan]
    how: Rendering


def _parsed(s: oa.Settings, body: CountRequest) -> Rendered:
    _check_fields(body)
    messages, prefill = chat_messages(body.system, body.messages)
    try:
        messages = template_messages(messages)
    except FieldError as e:  # (not expected: `chat_messages` checked every field it passes on)
        raise oa.ApiError(400, f"messages: {e}", param="messages") from None
    tools = tool_calls.read_tools(tool_calls.chat_tools(body.tools, _function))  # (a tool at fault: before the choice)
    choice, parallel = _flat_choice(s, body.tool_choice, tools)
    plan = tool_calls.plan_for(tools, choice, parallel, s.tool_parser)
    how = chat.rendering(chat.TemplateFields(add_generation_prompt=not prefill, continue_final_message=prefill,
                                             chat_template_kwargs=_template_variables(body)))
    return Rendered(messages, plan, how)


async def count_tokens(s: oa.Settings, http: HttpRequest):
    try:
        body = oa.parse(await http.body(), CountRequest)
        parsed = _parsed(s, body)
        _, ids = chat.prompt(s, parsed.messages, parsed.how, parsed.plan.specs() if parsed.plan else None)
        return {"input_tokens": len(ids)}
    except oa.ApiError as e:
        return error_response(_renamed(e))


async def create(s: oa.Settings, http: HttpRequest):
    try:
        return await _create(s, http)
    except oa.ApiError as e:
        return error_response(_renamed(e))


async def _create(s: oa.Settings, http: HttpRequest):
    body = oa.parse(await http.body(), MessagesRequest)
    parsed = _parsed(s, body)
    grammar = await asyncio.to_thread(_output_format, s.engine, body.output_config)
    reply = await chat.prepare(s, body, parsed.messages, parsed.how, parsed.plan, body.max_tokens, "max_tokens",
                               oa.stop_list(body.stop_sequences, "stop_sequences"), None, grammar,
                               "output_config.format", fit=True, thinking_budget=_budget(body))
    seqs = await oa.sequences(s, [reply.ids], reply.opts, 1, body.seed, body.model)
    message = Message(f"msg_{uuid.uuid4().hex}", body.model or s.model_name, reply.shape, body.max_tokens)
    if body.stream:
        return oa.streaming_response(_events(oa.submit(s.engine, seqs), message))
    await oa.wait(s.engine, seqs, s.timeout)
    return message.whole(seqs[0])


# --------------------------------------------------------------------------------------------
# The reply
# --------------------------------------------------------------------------------------------

def tool_input(arguments: str) -> dict:
    """A call's input: its arguments' JSON object (as much of it as is whole, where the reply was cut
    inside it, as Anthropic's SDK reads streamed input)."""
    try:
        value = pydantic_core.from_json(arguments, allow_partial=True) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def thinking_block(text: str) -> dict:
    return {"type": "thinking", "thinking": text, "signature": ""}


def text_block(text: str) -> dict:
    return {"type": "text", "text": text}


def tool_use_block(call_id: str, name: str, arguments: str) -> dict:
    return {"type": "tool_use", "id": call_id, "name": name, "input": tool_input(arguments)}


class Message:
    """One reply's fixed fields, and how its text becomes content blocks and a stop reason."""

    def __init__(self, message_id: str, model: str, shape: chat.Shape, max_tokens: int):
        self.id, self.model, self.shape, self.max_tokens = message_id, model, shape, max_tokens

    def head(self, seq: Sequence) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": usage(seq, 0)}

    def whole(self, seq: Sequence) -> dict:
        message, _ = self.shape.message(seq.text, seq.finish_reason)
        content = []
        if message.get("reasoning"):
            content.append(thinking_block(message["reasoning"]))
        if message.get("content"):
            content.append(text_block(message["content"]))
        calls = message.get("tool_calls", ())
        content += [tool_use_block(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
        reason, stop = stop_reason(seq, [c["function"]["arguments"] for c in calls], self.max_tokens)
        return {**self.head(seq), "content": content, "stop_reason": reason, "stop_sequence": stop,
                "usage": usage(seq, seq.kept_tokens())}


def stop_reason(seq: Sequence, arguments: list[str], max_tokens: int) -> tuple[str, Optional[str]]:
    """(Anthropic's stop reason, the stop sequence that ended the reply), given its calls' `arguments`.
    A reply cut where the context ended, before `max_tokens`, is "model_context_window_exceeded";
    whole calls are "tool_use"; a call cut short (a named tool's input, by a stop) is not to be run."""
    if seq.finish_reason == "length":
        return "max_tokens" if len(seq.tokens) >= max_tokens else "model_context_window_exceeded", None
    if arguments and all(isinstance(oa.json_value(a), dict) for a in arguments):
        return "tool_use", None
    stop = seq.stop_string
    return ("stop_sequence", stop) if stop is not None else ("end_turn", None)


def usage(seq: Sequence, output_tokens: int) -> dict:
    """Anthropic's usage: the prompt's tokens computed (`input_tokens`) apart from those read from
    the prefix cache; no tokens are written to a cache as a separate, dearer step here."""
    return {"input_tokens": len(seq.prompt) - seq.cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": seq.cached_tokens, "output_tokens": output_tokens}


# --------------------------------------------------------------------------------------------
# Streaming: Anthropic's events
# --------------------------------------------------------------------------------------------

def event(kind: str, **fields) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()


class BlockWriter(chat.CallEvents):
    """The content blocks of one streamed reply, opened, filled and closed as events."""

    def __init__(self, shape: chat.Shape):
        super().__init__(shape)
        self.count, self.open = 0, None  # blocks started; the kind of the one being written

    def _start(self, block: dict) -> list[bytes]:
        out = self.close()
        self.open = block["type"]
        self.count += 1
        return out + [event("content_block_start", index=self.count - 1, content_block=block)]

    def text(self, kind: str, delta: str) -> list[bytes]:
        """New thinking ("thinking") or answer ("text")."""
        if not delta:
            return []
        out = [] if self.open == kind else self._start(thinking_block("") if kind == "thinking" else text_block(""))
        body = {"type": "thinking_delta", "thinking": delta} if kind == "thinking" else \
            {"type": "text_delta", "text": delta}
        return out + [event("content_block_delta", index=self.count - 1, delta=body)]

    def write_call(self, entry: dict) -> list[bytes]:
        """A new call (with its id), or more of the open one's input."""
        out, fn = [], entry.get("function", {})
        if "id" in entry:
            out += self._start({"type": "tool_use", "id": entry["id"], "name": fn["name"], "input": {}})
        if fn.get("arguments"):
            out.append(event("content_block_delta", index=self.count - 1,
                             delta={"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return out

    def close(self) -> list[bytes]:
        kind, self.open = self.open, None
        if kind is None:
            return []
        out = [event("content_block_delta", index=self.count - 1, delta={"type": "signature_delta", "signature": ""})] \
            if kind == "thinking" else []
        return out + [event("content_block_stop", index=self.count - 1)]

    def end(self) -> list[bytes]:
        """The open block closed, then the calls read from the text, each whole."""
        out = []
        for entry in self.take_deferred():
            out += self.call(entry)
        return out + self.close()


async def _events(request, message: Message):
    """The events of one streamed reply (see the module's docstring)."""
    seq = request.seqs[0]
    try:
        await request.updated.wait()  # admitted (its cached prompt tokens known), or ended
        yield event("message_start", message=message.head(seq))
        writer, reply, arguments = BlockWriter(message.shape), chat.StreamedReply(message.shape), []
        try:
            async for d in oa.deltas(request):
                delta = reply.feed(d.text, d.finish_reason is not None)
                for chunk in writer.text("thinking", delta.get("reasoning") or ""):
                    yield chunk
                for chunk in writer.text("text", delta.get("content") or ""):
                    yield chunk
                for entry in delta.get("tool_calls", ()):
                    arguments += [""] if "id" in entry else []
                    arguments[-1] += entry.get("function", {}).get("arguments", "")
                    for chunk in writer.call(entry):
                        yield chunk
        except oa.StreamFailed as e:
            reason = str(e)
            yield event("error", error={"type": STREAM_ERRORS[reason], "message": oa.FAILED[reason]})
            return
        for chunk in writer.end():
            yield chunk
        reason, stop = stop_reason(seq, arguments, message.max_tokens)
        yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": stop},
                    usage=usage(seq, seq.kept_tokens()))
        yield event("message_stop")
    finally:
        if not request.finished:
            request.cancel()
