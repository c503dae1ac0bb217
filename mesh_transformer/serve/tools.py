"""Tool calling on /v1/chat/completions: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`.

The tools (`{"type": "function", "function": {"name", "description", "parameters"}}`) go to the
chat template (transformers' `apply_chat_template(tools=...)`), which shows them to the model.
What the reply may be depends on `tool_choice`:

- `"none"`: text, not read for calls.
- a named function (`{"type": "function", "function": {"name": ..}}`): the reply is held to that
  function's `parameters` schema (a grammar, as structured outputs are) and returned as its one
  call's `arguments`; `finish_reason` "stop", as OpenAI answers.
- `"required"`: the reply is held to a JSON array of calls, `[{"name": .., "parameters": {..}}]`
  (at most one with `parallel_tool_calls: false`), returned as `tool_calls`; "tool_calls".
- `"auto"` (the default when tools are given): the model writes freely, and the server's
  `--tool-call-parser` reads calls from its text (`PARSERS`); "tool_calls" when it made any.
  Without a parser, "auto" is a 400 (as vLLM answers): the model's format is not known.

Forced calls are JSON laid out as `json.dumps` writes it (`{"a": 1, "b": [2]}`: the layout chat
templates write earlier calls in, and no room for a run of blank space).

Streamed, a named call's arguments arrive as they are generated; other calls arrive whole, each
in one chunk once its text is complete, and text that may begin a call is held until it is known.
"""
from __future__ import annotations

import json
import re
import secrets
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from mesh_transformer.generate.structured import JSON_DUMPS, Grammar
from mesh_transformer.io import chat_template
from mesh_transformer.io.chat_template import Tool
from mesh_transformer.serve import openai as oa

CHOICES = ("none", "auto", "required")


def _openai_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _mistral_id() -> str:  # Mistral's templates refuse ids that are not 9 letters or digits
    return "".join(secrets.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789") for _ in range(9))


def id_maker(parser: Optional[str]) -> Callable[[], str]:
    """New call ids as the server's models take them back in later turns."""
    return _mistral_id if parser == "mistral" else _openai_id


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=_openai_id)

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


# --------------------------------------------------------------------------------------------
# Reading calls from a model's text (tool_choice "auto")
# --------------------------------------------------------------------------------------------

def _arguments(args) -> Optional[str]:
    """Arguments as a call's JSON text of an object (None: not an object; a string is taken if its
    JSON is one)."""
    try:
        decoded = {} if args is None else json.loads(args) if isinstance(args, str) else args
        return json.dumps(decoded, ensure_ascii=False, allow_nan=False) if isinstance(decoded, dict) else None
    except (ValueError, RecursionError):  # not JSON, NaN / Infinity (which JSON does not have), too deep
        return None


def _call(obj, arguments_keys: tuple[str, ...], new_id: Callable[[], str]) -> Optional[Call]:
    """A decoded `{"name": .., <arguments key>: {..}}` as a Call (None: not a call)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = _arguments(next((obj[k] for k in arguments_keys if k in obj), {}))
    return Call(obj["name"], args, new_id()) if args is not None else None


def _objects(text: str, separator: str = "") -> Optional[list]:
    """The JSON values `text` holds one after another (whitespace and `separator` between them);
    None unless it is all values."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or (separator and text[pos] == separator)):
            pos += 1
        if pos == len(text):
            return values or None
        try:
            value, pos = decoder.raw_decode(text, pos)
        except (json.JSONDecodeError, RecursionError):
            return None
        values.append(value)


def _calls(values: Optional[list], arguments_keys: tuple[str, ...], new_id) -> Optional[list[Call]]:
    calls = [_call(v, arguments_keys, new_id) for v in values or ()]
    return calls if calls and all(calls) else None


def without_marker_start(text: str, marker: str) -> str:
    """`text` less a last part that may be the start of `marker` (held until the next text says)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return text[:-n]
    return text


def hermes(text: str, final: bool, new_id=_openai_id) -> tuple[str, list[Call]]:
    """Hermes 2 Pro / Qwen 2.5 / Qwen 3: `<tool_call>{"name": .., "arguments": {..}}</tool_call>` blocks
    anywhere in the text, the rest content. An unclosed block counts at the end if its JSON is whole."""
    open_, close = "<tool_call>", "</tool_call>"
    content, calls, pos = [], [], 0
    while True:
        start = text.find(open_, pos)
        if start < 0:
            rest = text[pos:]
            content.append(rest if final else without_marker_start(rest, open_))
            return "".join(content), calls
        content.append(text[pos:start])
        end = text.find(close, start)
        body = text[start + len(open_): end if end >= 0 else len(text)]
        if end < 0 and not final:
            return "".join(content), calls
        found = _calls(_objects(body), ("arguments", "parameters"), new_id)
        if found and len(found) == 1:
            calls += found
        else:
            content.append(text[start: end + len(close) if end >= 0 else len(text)])
        if end < 0:
            return "".join(content), calls
        pos = end + len(close)


PYTHON_TAG = "<|python_tag|>"


def llama3_json(text: str, final: bool, new_id=_openai_id) -> tuple[str, list[Call]]:
    """Llama 3.1 / 3.2 JSON tool calls: the whole reply is `{"name": .., "parameters": {..}}` objects
    (`;` between them, `<|python_tag|>` before them optional); any other reply is content."""
    body = text.lstrip()
    tagged = body.startswith(PYTHON_TAG)
    if tagged:
        body = body[len(PYTHON_TAG):].lstrip()
    if not final and (not body if tagged else PYTHON_TAG.startswith(body)):
        return "", []  # nothing yet, or the tag's start
    if not body.startswith("{"):
        return text, []
    if not final:
        return "", []
    calls = _calls(_objects(body, ";"), ("parameters", "arguments"), new_id)
    return ("", calls) if calls else (text, [])


TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


def mistral(text: str, final: bool, new_id=_mistral_id) -> tuple[str, list[Call]]:
    """Mistral: content, then `[TOOL_CALLS]` and a JSON array of `{"name": .., "arguments": {..}}`
    (7B v0.3, Nemo, Small 3), or `[TOOL_CALLS]name[ARGS]{..}` per call (tokenizer v11 and later:
    Magistral, Devstral); the markers are special tokens the text keeps. Text after the calls is
    content too."""
    start = text.find(TOOL_CALLS)
    if start < 0:
        return (text if final else without_marker_start(text, TOOL_CALLS)), []
    if not final:
        return text[:start], []
    rest = text[start + len(TOOL_CALLS):]
    found = _mistral_array(rest, new_id) or _mistral_args(rest, new_id)
    return (text[:start] + found[1], found[0]) if found else (text, [])


def _mistral_array(rest: str, new_id) -> Optional[tuple[list[Call], str]]:
    """(calls, the text after them) of `[{..}, ..]` at the start of `rest`."""
    try:
        array, end = json.JSONDecoder().raw_decode(rest, len(rest) - len(rest.lstrip()))
    except (json.JSONDecodeError, RecursionError):
        return None
    calls = _calls(array if isinstance(array, list) else None, ("arguments", "parameters"), new_id)
    return (calls, rest[end:] if rest[end:].strip() else "") if calls else None


def _mistral_args(rest: str, new_id) -> Optional[tuple[list[Call], str]]:
    """(calls, the text after and between them) of `name[ARGS]{..}[TOOL_CALLS]name[ARGS]{..}`."""
    calls, tail = [], ""
    for part in rest.split(TOOL_CALLS):
        name, marker, args = part.partition(ARGS)
        try:
            value, end = json.JSONDecoder().raw_decode(args, len(args) - len(args.lstrip())) if marker else (None, 0)
        except (json.JSONDecodeError, RecursionError):
            return None
        call = _call({"name": name.strip(), "arguments": value}, ("arguments",), new_id) if marker else None
        if call is None:
            return None
        calls.append(call)
        tail += args[end:] if args[end:].strip() else ""
    return calls, tail


HARMONY_CALL = re.compile(r"<\|start\|>[^<]*?(?:<\|channel\|>[^<]*?)?\bto=functions\.([^\s<]+)(?:\s[^<]*)?"
                          r"(?:<\|(?:channel|constrain)\|>[^<]*)*<\|message\|>")
HARMONY_BODY_END = re.compile(r"<\|(?:end|call|return)\|>")  # what ends a harmony message's body


def openai(text: str, final: bool, new_id=_openai_id) -> tuple[str, list[Call]]:
    """GPT-OSS (harmony): each call is a message to a tool, `<|start|>assistant<|channel|>commentary
    to=functions.name <|constrain|>json<|message|>{..}`, which `--reasoning-parser openai_gptoss`
    (which this parser needs: `create_app` says so) leaves in the answer as written (the reply's
    `<|call|>` stop token ends the last); the text around them is content. A call whose arguments
    are not a JSON object stays content."""
    content, calls, pos = [], [], 0
    for found in HARMONY_CALL.finditer(text):
        nxt = text.find("<|start|>", found.end())
        end = len(text) if nxt < 0 else nxt
        if nxt < 0 and not final:  # its arguments may still be arriving: held until the reply ends
            return "".join(content) + text[pos:found.start()], calls
        args = _arguments(HARMONY_BODY_END.split(text[found.end():end], 1)[0].strip())
        content.append(text[pos:found.start()] if args is not None else text[pos:end])
        if args is not None:
            calls.append(Call(found[1], args, new_id()))
        pos = end
    rest, start = text[pos:], text[pos:].rfind("<|start|>")
    if not final:  # a message whose header is still arriving may be a call: held until it is known
        rest = rest[:start] if start >= 0 and "<|message|>" not in rest[start:] else without_marker_start(rest, "<|start|>")
    return "".join(content) + rest, calls


PARSERS = {"hermes": hermes, "llama3_json": llama3_json, "mistral": mistral, "openai": openai}  # --tool-call-parser


# --------------------------------------------------------------------------------------------
# The request: which tools, which choice, and the answer's shape
# --------------------------------------------------------------------------------------------

def renamed(e: oa.ApiError, names: tuple[tuple[str, str], ...]) -> oa.ApiError:
    """A chat-shaped 400 about tools with another API's field names: each (chat's, theirs) in
    `names` replaced in turn in its field (`tools[0].function.name` -> Responses' `tools[0].name`)."""
    if e.param and (e.param.startswith("tools[") or e.param.startswith("tool_choice")):
        theirs = e.param
        for old, new in names:
            theirs = theirs.replace(old, new)
        e.message, e.param = e.message.replace(e.param, theirs, 1), theirs
    return e


def chat_tools(given, function_of) -> Optional[list]:
    """Another API's `tools` (Responses', Anthropic's) in chat's form, `function_of(i, tool)` giving
    each one's function fields (or a 400 naming the field at fault); None where there are none."""
    if given is None:
        return None
    if not isinstance(given, list):
        oa.bad("tools", f"a list of tools, got {type(given).__name__}")
    return [{"type": "function", "function": function_of(i, tool)} for i, tool in enumerate(given)]


def read_tools(given: Optional[list]) -> list[Tool]:
    """The request's `tools` (`io.chat_template.read_tools`); a 400 naming the first thing wrong."""
    try:
        return chat_template.read_tools(given)
    except chat_template.FieldError as e:
        raise oa.ApiError(400, str(e), param=e.field) from None


def _identified(schema: dict, i: int) -> tuple[str, dict]:
    """(its id, the schema with it): the tool's own `$id`, else one made for it. Its local
    references (`#`, `#/$defs/..`, `#anchor`) then resolve inside it wherever it sits."""
    if isinstance(schema.get("$id"), str):
        return schema["$id"], schema
    own = f"urn:mesh-transformer:tool-{i}"
    return own, {"$id": own, **schema}


@dataclass(frozen=True)
class Plan:
    """One request's tools and what its replies may be (`tool_choice`)."""

    tools: tuple[Tool, ...]
    choice: Union[str, Tool]  # "none", "auto", "required", or the one tool to call
    parallel: bool = True
    parser: Optional[str] = None  # PARSERS' key, for "auto"

    @property
    def named(self) -> Optional[Tool]:
        return self.choice if isinstance(self.choice, Tool) else None

    def specs(self) -> list[dict]:
        return [t.spec() for t in self.tools]

    @property
    def new_id(self) -> Callable[[], str]:
        return id_maker(self.parser)

    def grammar(self) -> Optional[tuple[str, Grammar]]:
        """(the field a compile error names, the grammar) the reply is held to; None for free text."""
        if self.named is not None:
            return (f"tools[{self.tools.index(self.named)}].function.parameters",
                    Grammar.json_schema(self.named.parameters, separators=JSON_DUMPS))
        if self.choice != "required":
            return None
        # each tool's parameters sit in the root's $defs under an id of their own (see `_identified`)
        identified = [_identified(t.parameters, i) for i, t in enumerate(self.tools)]
        definitions = {f"tool_{i}": schema for i, (_, schema) in enumerate(identified)}
        items = [{"type": "object", "properties": {"name": {"const": t.name}, "parameters": {"$ref": ref}},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for t, (ref, _) in zip(self.tools, identified)]
        schema = {"type": "array", "items": {"anyOf": items}, "minItems": 1,
                  **({} if self.parallel else {"maxItems": 1}), "$defs": definitions}
        return "tools", Grammar.json_schema(schema, separators=JSON_DUMPS)

    def parameter_grammars(self) -> list[tuple[str, Grammar]]:
        """Each tool's arguments alone: what names the tool at fault when "required"'s grammar fails."""
        return [(f"tools[{i}].function.parameters", Grammar.json_schema(t.parameters, separators=JSON_DUMPS))
                for i, t in enumerate(self.tools)]

    def split(self, text: str, final: bool) -> tuple[str, list[Call]]:
        """(content, calls) in the text so far (`final`: all of it). Content only grows as text does;
        calls are whole when they appear."""
        if self.named is not None:  # (blank space before the arguments is the thinking's, when there is one)
            return "", [Call(self.named.name, text.lstrip(), self.new_id())] if final and text.strip() else []
        if self.choice == "required":
            if not final:
                return "", []
            values = _objects(text)
            array = values[0] if values and len(values) == 1 and isinstance(values[0], list) else None
            calls = _calls(array, ("parameters",), self.new_id)
            return ("", calls) if calls else (text, [])
        if self.choice == "auto":
            content, calls = PARSERS[self.parser](text, final, self.new_id)
            return content, calls if self.parallel else calls[:1]  # one call at most: the first
        return text, []

    def reply(self, text: str, finish_reason: Optional[str]) -> tuple[dict, Optional[str]]:
        """A whole choice's message and finish reason."""
        content, calls = self.split(text, final=True)
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        message = {"role": "assistant", "content": content if content.strip() else None,
                   "tool_calls": [c.as_openai() for c in calls]}
        return message, _finish(self, finish_reason)

    def reader(self) -> "Reader":
        return Reader(self)


def _finish(plan: Plan, reason: Optional[str]) -> Optional[str]:
    """OpenAI's: "tool_calls" where the model chose to call (not for a named choice, which ends "stop")."""
    return "tool_calls" if reason == "stop" and plan.named is None else reason


class Reader:
    """One streamed choice: its text in as generated, chat deltas out (`content`, `tool_calls`)."""

    def __init__(self, plan: Plan):
        self.plan, self.text, self.sent, self.calls = plan, "", 0, 0
        self.named_id = plan.new_id()

    def feed(self, piece: str, finished: bool) -> dict:
        """The delta for `piece` (the text since the last call); `finished`: the choice's last."""
        self.text += piece
        if self.plan.named is not None:
            return self._named(piece)
        content, calls = self.plan.split(self.text, finished)
        delta = {}
        upto = len(content) if finished else len(content.rstrip())  # trailing space waits for what follows
        if finished and calls and not content.strip():
            upto = self.sent  # a reply of calls only has no content (as the whole answer's None)
        if upto > self.sent:
            delta["content"] = content[self.sent:upto]
            self.sent = upto
        if len(calls) > self.calls:
            delta["tool_calls"] = [{"index": i, **c.as_openai()} for i, c in enumerate(calls) if i >= self.calls]
            self.calls = len(calls)
        return delta

    def _named(self, piece: str) -> dict:
        if not self.calls:
            piece = piece.lstrip()  # the call starts with its arguments' first character
        if not piece:
            return {}
        first = not self.calls
        self.calls = 1
        head = {"id": self.named_id, "type": "function"} if first else {}
        function = {"name": self.plan.named.name, "arguments": piece} if first else {"arguments": piece}
        return {"tool_calls": [{"index": 0, **head, "function": function}]}

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        return _finish(self.plan, reason) if self.calls else reason


def plan(body, parser: Optional[str]) -> Optional[Plan]:
    """A chat request's tool plan (None: no tools, no choice); a 400 naming the field at fault."""
    return plan_for(read_tools(body.tools), body.tool_choice, body.parallel_tool_calls, parser)


def plan_for(tools: list[Tool], given, parallel: Optional[bool], parser: Optional[str]) -> Optional[Plan]:
    """The plan of read `tools` under chat's `tool_choice` (`given`) and `parallel_tool_calls`
    (null: true); a 400 naming the field at fault."""
    if given is None:
        choice: Union[str, Tool] = "auto" if tools else "none"
    elif isinstance(given, str):
        if given not in CHOICES:
            oa.bad("tool_choice", f"must be none, auto, required or {{\"type\": \"function\", \"function\": "
                                  f"{{\"name\": ..}}}}, got {given!r}")
        choice = given
    else:
        fn = given.get("function") if isinstance(given, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if given.get("type") != "function" or not isinstance(name, str):
            oa.bad("tool_choice", "a named choice is {\"type\": \"function\", \"function\": {\"name\": ..}}")
        choice = next((t for t in tools if t.name == name), None)
        if choice is None:
            known = ", ".join(t.name for t in tools) or "none given"
            oa.bad("tool_choice.function.name", f"no tool is named {name!r} (tools: {known})")
    if choice != "none" and not tools:
        oa.bad("tool_choice", f"{choice if isinstance(choice, str) else 'a named function'} needs tools")
    if choice == "auto" and parser is None:
        oa.bad("tool_choice", f"\"auto\" needs the server started with --tool-call-parser ({', '.join(PARSERS)}), "
                              "which reads the model's calls from its text; ask for \"required\", a named function "
                              "or \"none\" instead")
    if not tools:
        return None
    return Plan(tuple(tools), choice, parallel is not False, parser)
