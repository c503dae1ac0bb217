"""Chat-format training data: `{"messages": [..], "tools": [..]}` records (OpenAI's fine-tuning
format; TRL's "conversational" datasets), rendered by the model's chat template (the one the server
renders requests with, `io.chat_template`) and trained on the assistant's turns only.

Which tokens are the assistant's: for each assistant message, the template renders the
conversation up to it with the generation prompt, and up to and through it; the text between the
two is that turn, as the model writes it when served (its content, and whatever the template puts
after it, e.g. `<|im_end|>`, so the model learns to end its turn). Tokens with any character in
those spans are trained on (as transformers' `return_assistant_tokens_mask` marks a template's
`{% generation %}` blocks). This needs a template that renders each turn as a prefix of the whole
conversation; one that rewrites earlier turns (e.g. drops earlier reasoning) is refused by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from mesh_transformer.io.chat_template import ChatTemplate, Rendering

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class Conversation:
    messages: tuple  # of {"role", "content", ...} dicts, as the template takes them
    tools: Optional[tuple] = None  # tool specs shown to the template
    where: str = ""  # the file and line it came from, for errors


def read(obj: dict, where: str) -> Conversation:
    """A record's conversation; ValueError naming the field at fault."""
    messages, tools = obj["messages"], obj.get("tools")
    if not isinstance(messages, list) or not messages:
        raise ValueError("field 'messages' must be a non-empty list of {\"role\", \"content\"} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            got = m.get("role") if isinstance(m, dict) else type(m).__name__
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {got!r}")
        if not isinstance(m.get("content"), str) and not (m["role"] == "assistant" and m.get("tool_calls")):
            raise ValueError(f"messages[{i}].content must be a string, got {type(m.get('content')).__name__}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("no assistant message: nothing to train on")
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"field 'tools' must be a list of tool specs, got {type(tools).__name__}")
    return Conversation(tuple(messages), tuple(tools) if tools is not None else None, where)


def encode(chat: ChatTemplate, conversation: Conversation) -> tuple[list[int], np.ndarray]:
    """(token ids, loss mask: 1 on the assistant's tokens) of the whole conversation as `chat`
    renders it; ValueError saying why a template cannot be used."""
    messages, tools = list(conversation.messages), list(conversation.tools) if conversation.tools else None
    whole = chat.render(messages, Rendering(add_generation_prompt=False), tools)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = chat.render(messages[:i], Rendering(add_generation_prompt=True), tools) if i else ""
        through = chat.render(messages[: i + 1], Rendering(add_generation_prompt=False), tools)
        if not through.startswith(before) or not whole.startswith(through):
            raise ValueError(f"the chat template does not render messages[{i}] (an assistant turn) as a "
                             f"continuation of the turns before it, so its tokens cannot be told apart; "
                             f"use --chat-template with one that does")
        spans.append((len(before), len(through)))
    encoded = chat.tokenizer(whole, add_special_tokens=False, return_offsets_mapping=True)
    starts, ends = np.array(encoded["offset_mapping"], np.int64).reshape(-1, 2).T
    mask = np.zeros(len(starts), np.uint8)
    for lo, hi in spans:
        mask[(starts < hi) & (ends > lo)] = 1
    return list(encoded["input_ids"]), mask
