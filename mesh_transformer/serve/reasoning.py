"""Reasoning models' thinking apart from their answer (`--reasoning-parser`, vLLM's names).

Models such as DeepSeek-R1 (and its distills), QwQ and Qwen 3 think in a `<think> .. </think>`
block before they answer. With a parser, /v1/chat/completions returns the block's text as the
message's `reasoning` (vLLM's field, as OpenAI advises for chains of thought) and
`reasoning_content` (DeepSeek's, which many clients read), and only what follows as `content`,
which is also where tool calls are looked for. Streamed, chunks carry `delta.reasoning` /
`delta.reasoning_content` and then `delta.content`.

Where the reply starts is read from the text the template puts just before it: a last `<think>`
there (R1's templates, Qwen 3's 2507 Thinking models') starts it inside the block; a last
`</think>` (Qwen 3 with `chat_template_kwargs: {"enable_thinking": false}`, DeepSeek V3.1's
non-thinking mode) means no thinking: all of the reply is answer. With neither:

- `deepseek_r1`: the reply starts inside the block (R1 may omit `<think>`); no `</think>`: all of
  it is reasoning (the thinking was cut short).
- `qwen3`: the reply thinks if it begins with `<think>`; otherwise it is all answer.

A reply that continues a final message (a prefill, `continue_final_message`) is answer unless that
message opened a block it did not close.

- `openai_gptoss`: GPT-OSS's harmony format, whose reply is a run of messages, each a header naming
  its channel and a body: `<|channel|>analysis<|message|>..<|end|><|start|>assistant<|channel|>final
  <|message|>..` (the template's generation prompt writes the first `<|start|>assistant`). The
  analysis channel's bodies are the reasoning, the final channel's (and commentary addressed to
  no tool, a preamble) the answer, bodies of one part a line apart; a message addressed to a tool
  (`to=functions.name`) stays in the answer as it was written where `--tool-call-parser openai`
  reads calls (`tools.openai`), and is dropped elsewhere. Where the reply starts is read from the
  rendered prompt: after a message header, or inside the body a prefill leaves open.
  The markers are special tokens the server's text keeps. Structured outputs, a forced tool choice
  and a thinking budget are refused with this parser (`holds_after_thinking`): the answer starts
  after a header of several tokens, not one closer. Earlier calling turns go to the template as
  `harmony_history` says.

A grammar (structured outputs, a named or required tool choice) holds the answer, not the
thinking: the reply may think freely until `</think>` (`Grammar.after_thinking`), as vLLM's
structured outputs do with a reasoning parser.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from mesh_transformer.generate.structured import Grammar
from mesh_transformer.serve.tools import HARMONY_BODY_END, without_marker_start

OPEN, CLOSE = "<think>", "</think>"
ANY_ANSWER = Grammar.lark("%llguidance {}\nstart: <[*]>*")  # a free answer under a thinking budget: any tokens
# (special ones too: a regex would refuse a `<tool_call>` added token, or a stop id)
HARMONY = "openai_gptoss"
PARSERS = ("deepseek_r1", "qwen3", HARMONY)
MESSAGE, START = "<|message|>", "<|start|>"  # harmony's markers: a body begins, a message begins
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")


@dataclass(frozen=True)
class Thinking:
    """How one request's replies split into reasoning and answer."""

    parser: str
    prompt: str = ""  # "opened": the prompt leaves the reply inside a block; "closed": it closed it (no thinking);
    # harmony: the channel whose body the prompt leaves open (a prefill), else ""
    opener_id: int = -1  # the markers' own tokens, where the tokenizer has them (-1: text)
    closer_id: int = -1
    tool_messages: bool = False  # harmony: keep messages to tools in the answer, for `tools.openai`

    @classmethod
    def of(cls, parser: str, reply_start: str, tokenizer=None, continued: bool = False) -> "Thinking":
        """`reply_start`: the text the template puts just before the reply (its generation prompt, or
        the final message a reply continues). Its last marker says where the reply starts: inside a
        block (R1's `<think>\n`), after one (Qwen 3's `enable_thinking: false`, an empty closed
        block), or neither. `continued`: it is the message the reply goes on with (a prefill), which
        is answer unless it opened a block it has not closed (an empty one says nothing)."""
        if parser == HARMONY:  # the channel of a body the prompt leaves open (a prefill), else ""
            header, sep, body = reply_start.rsplit(START, 1)[-1].partition(MESSAGE)
            return cls(parser, _channel(header) if sep and not HARMONY_BODY_END.search(body) else "")
        opened, closed = reply_start.rfind(OPEN), reply_start.rfind(CLOSE)
        state = "opened" if opened > closed else "closed" if closed > opened or (continued and reply_start.strip()) \
            else ""
        return cls(parser, state, *marker_ids(tokenizer))

    @property
    def thinks(self) -> bool:
        return self.prompt != "closed"

    @property
    def can_hold(self) -> bool:
        """Whether a grammar can hold the answer after the thinking (`hold`): where one marker ends it."""
        return holds_after_thinking(self.parser)

    @property
    def starts_inside(self) -> bool:
        """Whether a reply starts inside the block without writing `<think>` (else it may write it)."""
        return self.prompt == "opened" or (self.prompt == "" and self.parser == "deepseek_r1")

    @property
    def can_cap(self) -> bool:
        """Whether a thinking budget can be held to: the reply may think, and `</think>` is a token of
        its own (a budget forces it)."""
        return self.thinks and self.closer_id >= 0 and self.can_hold

    def hold(self, grammar, budget: int = 0):
        """`grammar` (a `structured.Grammar`) for the answer, after any thinking (of at most
        `budget` tokens, where given: see `can_cap`)."""
        if not self.thinks:
            return grammar
        return grammar.after_thinking(CLOSE, "" if self.starts_inside else OPEN, self.closer_id, self.opener_id,
                                      budget)

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, answer) in the reply so far (`final`: all of it); each only grows as text does,
        so a stream sends what is new of each."""
        if self.parser == HARMONY:
            return harmony_split(text, final, self.prompt, self.tool_messages)
        if not self.thinks:
            return "", text
        head = text.lstrip()
        if head.startswith(OPEN):
            inside, body = True, head[len(OPEN):]
        elif not final and OPEN.startswith(head):
            return "", ""  # nothing yet, or the start of "<think>"
        else:
            inside, body = self.starts_inside, text
        if not inside:
            return "", text
        end = body.find(CLOSE)
        if end < 0:
            return (body if final else without_marker_start(body, CLOSE)), ""
        return body[:end], body[end + len(CLOSE):]

    def ended(self, text: str) -> bool:
        """Whether the thinking has ended in `text`, a reply's start: its closer written, or (harmony)
        a message other than analysis begun."""
        if self.parser == HARMONY:
            return any(channel != "analysis" for channel, _, _ in _harmony_bodies(text, self.prompt))
        return CLOSE in text


def holds_after_thinking(parser: Optional[str]) -> bool:
    """Whether a grammar (a reply format, a forced call) can hold the answer after `parser`'s thinking."""
    return parser != HARMONY


def _harmony_bodies(text: str, inside: str = ""):
    """(channel, header, body) of each message of a harmony reply whose body has begun, each body
    cut at its end marker; a message to a tool (`to=`) is "tool"'s. The first message's `<|start|>`
    is the prompt's; `inside`: the channel of a body the prompt left open, which the reply's text
    goes on."""
    for i, message in enumerate(text.split(START)):
        if i == 0 and inside:
            header, sep, body = f"<|channel|>{inside}", MESSAGE, message
        else:
            header, sep, body = message.partition(MESSAGE)
        if sep:
            yield "tool" if " to=" in header else _channel(header), header, HARMONY_BODY_END.split(body, 1)[0]


def _channel(header: str) -> str:
    found = _CHANNEL.search(header)
    return found[1] if found else "final"


def harmony_split(text: str, final: bool, inside: str = "", tool_messages: bool = False) -> tuple[str, str]:
    """(reasoning, answer) of a harmony reply so far: the analysis channel's bodies, and the final
    channel's and tool-less commentary's (`_harmony_bodies`), a part's bodies a line apart; with
    `tool_messages`, each message to a tool as written (`<|start|>`, header, `<|message|>`,
    arguments) in the answer. A body's text waits while it ends in what may be the start of a
    marker ("<", "<|..."), so each part only grows. A whole reply with no channel at all (a model
    that does not write harmony) is all answer."""
    if final and not inside and "<|channel|>" not in text and MESSAGE not in text:
        return "", text
    cut = text.rfind("<")
    if not final and cut >= 0 and (text[cut:] == "<" or text[cut:].startswith("<|") and "|>" not in text[cut:]):
        text = text[:cut]
    reasoning, answer, last = [], [], None  # (last: the answer's last piece was a body of text)
    for channel, header, body in _harmony_bodies(text, inside):
        if channel == "tool":
            if tool_messages:
                answer.append(START + header.lstrip() + MESSAGE + body)
                last = "tool"
        elif channel == "analysis":
            reasoning.append(("\n" if reasoning else "") + body)
        else:
            answer.append(("\n" if last == "text" else "") + body)
            last = "text"
    return "".join(reasoning), "".join(answer)


def harmony_history(messages: list[dict]) -> list[dict]:
    """Earlier turns as GPT-OSS's template takes them. It renders a tool-calling turn's analysis from
    its content or its thinking (transformers hands it `reasoning_content` as `thinking`) and
    refuses a turn with both, which this parser's replies are when a preamble came before the
    calls: such a turn goes to it as one analysis, the reasoning and then the preamble."""
    out = []
    for m in messages:
        if m.get("tool_calls") and m.get("content") and m.get("reasoning_content"):
            m = {**m, "content": "", "reasoning_content": m["reasoning_content"] + "\n" + m["content"]}
        out.append(m)
    return out


def fields(reasoning: str) -> dict:
    """The message's (or delta's) reasoning, under both names clients read."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


def marker_ids(tokenizer) -> tuple[int, int]:
    """The ids of `<think>` and `</think>` as tokens of their own (-1 where the tokenizer has none)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    ids = [backend.token_to_id(marker) if backend is not None else None for marker in (OPEN, CLOSE)]
    return tuple(-1 if i is None else i for i in ids)


class Reader:
    """One streamed choice: its text in as generated, (new reasoning, new answer) out."""

    def __init__(self, thinking: Thinking):
        self.thinking, self.text, self.sent = thinking, "", (0, 0)

    def feed(self, piece: str, finished: bool) -> tuple[str, str]:
        self.text += piece
        reasoning, answer = self.thinking.split(self.text, finished)
        new = reasoning[self.sent[0]:], answer[self.sent[1]:]
        self.sent = len(reasoning), len(answer)
        return new
