"""Chat-format training data: `{"messages": [..], "tools": [..]}` records (OpenAI's fine-tuning
format; TRL's "conversational" datasets), rendered by the model's chat template exactly as the
server renders a request (`io.chat_template`: the same message and tool handling, the same
template) and trained on the assistant's turns only.

Which text is the assistant's: for each assistant message, the template renders the conversation
up to it with the generation prompt, and up to and through it; the text between the two is that
turn as the model writes it when served (its content, and whatever the template writes after it,
e.g. `<|im_end|>`, so the model learns to end its turn). The conversation is tokenized piece by
piece at those boundaries (the prompt part as the server tokenizes a prompt, each turn on its own
as the model generates it), so no token spans a boundary and any tokenizer works. The plain
template writes no end-of-turn marker, so there each trained turn is followed by the tokenizer's
EOS (trained too): a model fine-tuned on it stops where it should.

A message with OpenAI's `"weight": 0` is not trained on. A template must render each turn as a
prefix of the whole conversation; one that rewrites earlier turns (e.g. drops earlier thinking)
is refused by name. A conversation's first message, if the assistant's, is not trained on: where
it starts cannot be told (transformers renders no empty conversation, and a template may put a
default system prompt or a header before it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from mesh_transformer.io.chat_template import ChatTemplate, FieldError, Rendering, read_tools, template_messages

OPEN = Rendering(add_generation_prompt=True)
SHUT = Rendering(add_generation_prompt=False)


@dataclass(frozen=True)
class Conversation:
    messages: tuple  # as the template takes them (`template_messages`)
    tools: Optional[tuple] = None  # tool specs shown to the template (`read_tools`)
    trained: tuple = ()  # per message: whether an assistant turn is trained on (OpenAI's `weight`)
    where: str = ""  # the file and line it came from, for errors


def read(obj: dict, where: str, prompt_messages: int = 0) -> Conversation:
    """A record's conversation; ValueError naming the field at fault. The first `prompt_messages`
    messages are context only, never trained on (a preference pair's prompt)."""
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError("field 'messages' must be a non-empty list of {\"role\", \"content\"} objects")
    try:
        rendered = template_messages(messages)
        tools = read_tools(obj.get("tools"))
    except FieldError as e:
        raise ValueError(str(e)) from None
    trained = []
    for i, m in enumerate(messages):
        weight = m.get("weight", 1)
        if weight not in (0, 1) or isinstance(weight, bool):
            raise ValueError(f"messages[{i}].weight must be 0 or 1, got {weight!r}")
        trained.append(m["role"] == "assistant" and weight == 1 and i >= prompt_messages)
    if not any(trained):
        raise ValueError("no assistant message to train on")
    return Conversation(tuple(rendered), tuple(t.spec() for t in tools) or None, tuple(trained), where)


def encode(chat: ChatTemplate, conversation: Conversation) -> tuple[list[int], np.ndarray]:
    """(token ids, loss mask: 1 on the assistant's trained turns) of the whole conversation as `chat`
    renders it; ValueError saying why a template cannot be used."""
    messages, tools = list(conversation.messages), list(conversation.tools) if conversation.tools else None
    whole = chat.render(messages, SHUT, tools)
    spans = [_span(chat, messages, tools, whole, i) for i, trained in enumerate(conversation.trained) if trained]
    cuts = [0, *[x for span in spans if span for x in span], len(whole)]
    pieces = [whole[a:b] for a, b in zip(cuts, cuts[1:])]
    encoded = chat.tokenizer(pieces, add_special_tokens=False)["input_ids"] if pieces else []
    eos = chat.tokenizer.eos_token_id if chat.source == "plain" else None
    ids, mask = [], []
    for k, piece in enumerate(encoded):
        turn = k % 2 == 1  # pieces alternate: before the first turn, a turn, between turns, ..
        ids += piece + ([eos] if turn and eos is not None else [])
        mask += [int(turn)] * (len(piece) + (turn and eos is not None))
    return ids, np.asarray(mask, np.uint8)


def _span(chat: ChatTemplate, messages: list, tools, whole: str, i: int) -> Optional[tuple[int, int]]:
    """Where assistant message `i` is in `whole` (None: its start cannot be told, a first message)."""
    through = chat.render(messages[: i + 1], SHUT, tools)
    try:
        before = chat.render(messages[:i], OPEN, tools)
    except ValueError:
        if i:
            raise
        return None  # an empty conversation is not rendered: where a first message starts is unknown
    if not through.startswith(before) or not whole.startswith(through):
        if not i:
            return None
        raise ValueError(f"the chat template does not render messages[{i}] (an assistant turn) as a "
                         f"continuation of the turns before it, so its tokens cannot be told apart; "
                         f"use --chat-template with one that does")
    return len(before), len(through)
