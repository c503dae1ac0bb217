"""Chat templates: conversations as the text a model reads (transformers' `apply_chat_template`,
Jinja). The server renders requests' messages with them (`serve.chat`), and the dataset tool
renders training conversations with the same ones (`data`), so a model is trained on the text it
is then served.

A tokenizer's own `chat_template` is used when it has one, else a given file, else
`PLAIN_TEMPLATE`, which renders

    System: You are terse.

    User: Hi!

    Assistant:

(each message as "Role: content" and a blank line, then "Assistant:" for the model to continue).
With tools it lists them in a first paragraph and writes calls as Hermes'
`<tool_call>{..}</tool_call>` (what the server's `--tool-call-parser hermes` reads).

Messages and tools given in OpenAI's chat format (a request's, a training record's) become what
templates take by one path, `template_messages` and `read_tools`, so training and serving render a
conversation alike.
"""
from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass
from typing import Any, Optional

from transformers import PreTrainedTokenizerBase

ROLES = ("system", "developer", "user", "assistant", "tool")
NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")  # OpenAI's letters, digits, _ and -, and MCP tools' . and :

PLAIN_TEMPLATE = (  # no text right after a block tag: transformers renders with trim_blocks
    "{% if tools %}Tools (to call one, write <tool_call>{\"name\": .., \"arguments\": {..}}</tool_call>):"
    "{% for tool in tools %}{{ '\\n' }}{{ tool['function'] | tojson }}{% endfor %}{{ '\\n\\n' }}{% endif %}"
    "{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}<tool_call>"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}</tool_call>"
    "{% endfor %}{{ '\\n\\n' }}{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")

RESERVED = frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) | {
    "messages", "conversations"}  # what transformers passes the template itself


@dataclass(frozen=True)
class Rendering:
    """How messages become text besides the messages: where the text ends, the template's variables."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    variables: tuple[tuple[str, Any], ...] = ()  # chat_template_kwargs


class ChatTemplate:
    """Renders `messages` to the prompt text. `template`: Jinja source (default: the tokenizer's, else plain)."""

    def __init__(self, tokenizer, template: Optional[str] = None):
        own = getattr(tokenizer, "chat_template", None)
        self.tokenizer = tokenizer
        self.source = "file" if template else "tokenizer" if isinstance(own, str) and own else "plain"
        self.template = template or (own if self.source == "tokenizer" else PLAIN_TEMPLATE)

    @classmethod
    def from_file(cls, tokenizer, path: Optional[str]) -> "ChatTemplate":
        if path is None:
            return cls(tokenizer)
        with open(path, encoding="utf-8") as f:
            return cls(tokenizer, f.read())

    def render(self, messages: list[dict], how: Rendering = Rendering(), tools: Optional[list] = None) -> str:
        """The prompt text (ending where the assistant's reply starts, unless `how` says otherwise);
        `tools`: their specs (`tools.Tool.spec`). ValueError if the template refuses."""
        try:
            return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                      add_generation_prompt=how.add_generation_prompt,
                                                      continue_final_message=how.continue_final_message, tools=tools,
                                                      **dict(how.variables))
        except Exception as e:  # noqa: BLE001 - jinja errors and templates' raise_exception(...)
            raise ValueError(f"the chat template cannot render these messages ({type(e).__name__}: {e})") from None


# --------------------------------------------------------------------------------------------
# OpenAI's chat format -> what templates take
# --------------------------------------------------------------------------------------------

class FieldError(ValueError):
    """A message or tool templates cannot take, naming its field (e.g. `messages[2].content`)."""

    def __init__(self, field: str, why: str):
        super().__init__(f"{field}: {why}")
        self.field = field


def text(value, field: str) -> str:
    """`value` if it is a string of valid Unicode (JSON allows lone UTF-16 surrogates such as
    "\\ud800", which no tokenizer can encode); else a FieldError."""
    if not isinstance(value, str):
        raise FieldError(field, f"must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise FieldError(field, f"character {value[e.start]!r} at position {e.start} is not valid Unicode "
                                f"({e.reason}) and cannot be tokenized") from None
    return value


def template_messages(messages: list) -> list[dict]:
    """OpenAI chat messages as templates take them: roles checked (`developer` is `system`),
    content one string (text parts joined), an assistant's `tool_calls` with their `arguments`
    decoded to objects (transformers' templates write them with `tojson`), earlier thinking
    (`reasoning`, vLLM's name, or `reasoning_content`) as `reasoning_content`."""
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLES:
            raise FieldError(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        content = m.get("content") or ""
        if isinstance(content, list):
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise FieldError(f"{where}.content[{j}].type", f"only text parts are supported, got type {kind!r}")
            content = "".join(part["text"] for part in content)
        message = {"role": "system" if role == "developer" else role, "content": text(content, f"{where}.content")}
        if m.get("name") is not None:
            message["name"] = text(m["name"], f"{where}.name")
        if m.get("tool_calls"):
            if role != "assistant":
                raise FieldError(f"{where}.tool_calls", "only assistant messages make calls")
            if not isinstance(m["tool_calls"], list):
                raise FieldError(f"{where}.tool_calls", f"a list of calls, got {type(m['tool_calls']).__name__}")
            message["tool_calls"] = [_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(m["tool_calls"])]
        thought = m.get("reasoning") if m.get("reasoning") is not None else m.get("reasoning_content")
        if thought is not None:  # templates that show earlier thinking read it here (Qwen 3's)
            message["reasoning_content"] = text(thought, f"{where}.reasoning")
        if m.get("tool_call_id") is not None:
            message["tool_call_id"] = text(m["tool_call_id"], f"{where}.tool_call_id")
        out.append(message)
    return out


def _call(call, where: str) -> dict:
    """An assistant message's tool call as templates take it: `arguments` decoded to an object."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise FieldError(f"{where}.function", "an object with the function's name and arguments is required")
    arguments = fn.get("arguments", "{}")
    try:
        decoded = json.loads(arguments) if isinstance(arguments, str) else arguments  # (vLLM takes an object too)
    except json.JSONDecodeError as e:
        decoded, arguments = None, f"not JSON ({e})"
    except RecursionError:
        decoded, arguments = None, "JSON nested too deeply"
    if not isinstance(decoded, dict):
        raise FieldError(f"{where}.function.arguments", f"an object (or its JSON text) is required, got "
                                                         f"{arguments if isinstance(arguments, str) else type(arguments).__name__}")
    out = {"type": "function", "function": {"name": text(fn["name"], f"{where}.function.name"), "arguments": decoded}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict  # a JSON schema of the arguments object
    description: Optional[str] = None

    def spec(self) -> dict:
        """The tool as chat templates take it (transformers' `apply_chat_template(tools=...)`)."""
        function = {"name": self.name, **({"description": self.description} if self.description else {}),
                    "parameters": self.parameters}
        return {"type": "function", "function": function}


def read_tools(given: Optional[list]) -> list[Tool]:
    """OpenAI's `tools` (function tools); a FieldError naming the first thing wrong."""
    if given is not None and not isinstance(given, list):
        raise FieldError("tools", f"a list of tools, got {type(given).__name__}")
    tools: list[Tool] = []
    for i, item in enumerate(given or ()):
        where = f"tools[{i}]"
        kind = item.get("type") if isinstance(item, dict) else None
        if kind != "function":
            raise FieldError(f"{where}.type", f"only function tools are supported, got {kind!r}")
        fn = item.get("function")
        if not isinstance(fn, dict):
            raise FieldError(f"{where}.function", "an object with the function's name and parameters is required")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise FieldError(f"{where}.function.name", f"1 to 128 letters, digits or _ - . :, got {name!r}")
        if any(t.name == name for t in tools):
            raise FieldError(f"{where}.function.name", f"{name!r} names an earlier tool too")
        parameters = fn.get("parameters")
        if parameters is None:  # no parameters: OpenAI's empty parameter list
            parameters = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(parameters, dict):
            raise FieldError(f"{where}.function.parameters", f"a JSON schema (an object), got "
                                                             f"{type(parameters).__name__}")
        parameters = {"type": "object", **parameters}  # what a call's arguments are, said where a schema leaves it
        if parameters["type"] != "object":
            raise FieldError(f"{where}.function.parameters.type", f"a function's arguments are an object, got "
                                                                  f"{parameters['type']!r}")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise FieldError(f"{where}.function.description", f"a string, got {type(description).__name__}")
        tools.append(Tool(name, parameters, description))
    return tools
