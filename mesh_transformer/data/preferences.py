"""Preference pairs: `{"prompt", "chosen", "rejected"}` records (TRL's preference datasets, the
data of DPO, `train/preference.py`), each two completions of one prompt, the first preferred.

Two forms, as TRL reads them:
- text: three strings; a completion is trained on with the tokenizer's EOS after it (TRL adds it;
  a completion that ends with the EOS token's text already gets no second one), tokenized apart
  from its prompt as prompt/completion examples are, so the prompt's tokens are those the server
  gives the model (TRL tokenizes prompt + completion as one text, so where a token would span the
  boundary, e.g. a prompt ending in a space, its completion starts differently);
- conversational: `prompt` a list of messages, `chosen` and `rejected` the lists of messages that
  follow it (usually one assistant message), optional `tools`. Each side is the conversation
  prompt + completion, rendered by the chat template as chat data is (`conversations.encode`) and
  trained on the completion's assistant turns only.
Without `prompt` (TRL's "implicit prompt", `trl.extract_prompt`), what `chosen` and `rejected` start
with in common is the prompt: the shared messages, or for text the shared characters (a space just
before they differ goes with the completions).

A pair is stored as two rows, chosen then rejected, each padded to the row (never packed with
others), so a batch that takes whole pairs holds each pair's two sides.

Unpaired preferences (TRL's "unpaired preference" datasets, the data of KTO): `{"prompt",
"completion", "label"}` records, one completion judged alone, `label` true when it is desirable.
Text or conversational as pairs are (`prompt` a string, or a list of messages with `completion`
the messages that follow it), the completion tokenized apart from its prompt as a pair's are. KTO's
KL estimate needs each example's prompt with another example's completion, so an example is
stored as two rows too: its own (prompt + completion) and its KL row (its prompt + the next
example's completion; the last example takes the first one's), both labelled. TRL rotates the
other way, within each batch; either way the KL rows hold other examples' completions, and a
shuffled batch draws them from across the data.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from mesh_transformer.data import conversations


class TextPair(NamedTuple):
    prompt: str
    chosen: str
    rejected: str


@dataclass(frozen=True)
class ConversationPair:
    chosen: conversations.Conversation
    rejected: conversations.Conversation

    @property
    def where(self) -> str:
        return self.chosen.where

    @property
    def chars(self) -> int:
        return sum(len(m.get("content") or "") for c in (self.chosen, self.rejected) for m in c.messages)


def _shared_text(chosen: str, rejected: str) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) of a text pair without a prompt, split as `trl.extract_prompt` splits it."""
    cut = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), None)
    if cut is None or cut == 0:
        raise ValueError("no field 'prompt', and 'chosen' and 'rejected' do not start with shared text "
                         "followed by different text")
    if chosen[cut - 1] == " ":
        cut -= 1
    return chosen[:cut], chosen[cut:], rejected[cut:]


def is_pair(obj: dict) -> bool:
    return "chosen" in obj and "rejected" in obj


class LabeledText(NamedTuple):
    prompt: str
    completion: str
    label: bool


@dataclass(frozen=True)
class LabeledConversation:
    conversation: conversations.Conversation
    label: bool

    @property
    def where(self) -> str:
        return self.conversation.where


def unpaired(records):
    """`records` with each preference pair as two unpaired examples, its chosen side desirable and
    its rejected side not (TRL's `unpair_preference_dataset`); other records as they are."""
    for record in records:
        if isinstance(record, TextPair):
            yield LabeledText(record.prompt, record.chosen, True)
            yield LabeledText(record.prompt, record.rejected, False)
        elif isinstance(record, ConversationPair):
            yield LabeledConversation(record.chosen, True)
            yield LabeledConversation(record.rejected, False)
        else:
            yield record


def is_unpaired(obj: dict) -> bool:
    return "completion" in obj and "label" in obj


def read_unpaired(obj: dict, where: str) -> LabeledText | LabeledConversation:
    """An unpaired record's example; ValueError naming the field at fault."""
    prompt, completion, label = obj.get("prompt"), obj["completion"], obj["label"]
    if not isinstance(label, bool):
        raise ValueError(f"field 'label' must be true (a desirable completion) or false, got {label!r}")
    if isinstance(completion, str):
        if not isinstance(prompt, str):
            raise ValueError(f"field 'prompt' must be a string, the text 'completion' completes, "
                             f"got {type(prompt).__name__}")
        return LabeledText(prompt, completion, label)
    if not isinstance(completion, list) or not completion:
        raise ValueError(f"field 'completion' must be a string or a non-empty list of messages, "
                         f"got {type(completion).__name__}{' (empty)' if completion == [] else ''}")
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"field 'prompt' must be a non-empty list of messages, as 'completion' is a list, "
                         f"got {type(prompt).__name__}")
    record = {"messages": [*prompt, *completion], "tools": obj.get("tools")}
    try:
        return LabeledConversation(conversations.read(record, where, prompt_messages=len(prompt)), label)
    except ValueError as e:
        if "no assistant message" in str(e):
            raise ValueError("field 'completion' has no assistant message to train on") from None
        raise ValueError(f"prompt + completion: {e}") from None


def read(obj: dict, where: str) -> TextPair | ConversationPair:
    """A record's pair; ValueError naming the field at fault."""
    prompt, chosen, rejected = obj.get("prompt"), obj["chosen"], obj["rejected"]
    if isinstance(chosen, str) and isinstance(rejected, str):
        if prompt is None:
            prompt, chosen, rejected = _shared_text(chosen, rejected)
        elif not isinstance(prompt, str):
            raise ValueError(f"field 'prompt' must be a string, the text 'chosen' and 'rejected' complete, "
                             f"got {type(prompt).__name__}")
        return TextPair(prompt, chosen, rejected)
    if isinstance(chosen, str) or isinstance(rejected, str):
        field, other = ("rejected", "chosen") if isinstance(chosen, str) else ("chosen", "rejected")
        raise ValueError(f"field {field!r} must be a string as {other!r} is, got {type(obj[field]).__name__}")
    for field, value in (("chosen", chosen), ("rejected", rejected)):
        if not isinstance(value, list) or not value:
            raise ValueError(f"field {field!r} must be a string or a non-empty list of messages, "
                             f"got {type(value).__name__}{' (empty)' if value == [] else ''}")
    if prompt is None:  # TRL's implicit prompt: what the two conversations share
        shared = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected)))
        if shared == 0 or shared == len(chosen) or shared == len(rejected):
            raise ValueError("no field 'prompt', and 'chosen' and 'rejected' do not start with shared messages "
                             "followed by different ones")
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    elif not isinstance(prompt, list) or not prompt:
        raise ValueError(f"field 'prompt' must be a non-empty list of messages, as 'chosen' and 'rejected' are "
                         f"lists, got {type(prompt).__name__}")
    sides = []
    for field, completion in (("chosen", chosen), ("rejected", rejected)):
        record = {"messages": [*prompt, *completion], "tools": obj.get("tools")}
        try:
            sides.append(conversations.read(record, where, prompt_messages=len(prompt)))
        except ValueError as e:
            if "no assistant message" in str(e):
                raise ValueError(f"field {field!r} has no assistant message to train on") from None
            raise ValueError(f"prompt + {field}: {e}") from None
    return ConversationPair(*sides)
