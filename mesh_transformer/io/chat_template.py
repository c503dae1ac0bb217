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
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Optional

from transformers import PreTrainedTokenizerBase

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
