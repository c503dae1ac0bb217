"""Reasoning models' thinking apart from their answer (`--reasoning-parser`, vLLM's names).

Models such as DeepSeek-R1 (and its distills), QwQ and Qwen 3 think in a `<think> .. </think>`
block before they answer. With a parser, /v1/chat/completions returns the block's text as the
message's `reasoning` (vLLM's field, as OpenAI advises for chains of thought) and
`reasoning_content` (DeepSeek's, which many clients read), and only what follows as `content`,
which is also where tool calls are looked for. Streamed, chunks carry `delta.reasoning` /
`delta.reasoning_content` and then `delta.content`.

- `deepseek_r1`: the reply starts inside the block (R1's template opens it in the prompt, and the
  model may omit `<think>`); no `</think>`: all of it is reasoning (the thinking was cut short).
- `qwen3`: the reply starts inside the block if it begins with `<think>` or the prompt ends with
  one (templates that open it, e.g. the 2507 Thinking models'); otherwise it is all answer (as
  with `chat_template_kwargs: {"enable_thinking": false}`, whose empty block is in the prompt).

A grammar (structured outputs, a named or required tool choice) holds the answer, not the
thinking: the reply may think freely until `</think>` (`Grammar.after_thinking`), as vLLM's
structured outputs do with a reasoning parser.
"""
from __future__ import annotations

from dataclasses import dataclass

from mesh_transformer.serve.tools import without_marker_start

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


@dataclass(frozen=True)
class Thinking:
    """How one request's replies split into reasoning and answer."""

    parser: str
    prompt_opens: bool = False  # the rendered prompt ends inside a block its template opened

    @classmethod
    def of(cls, parser: str, prompt_tail: str) -> "Thinking":
        """`prompt_tail`: the prompt's last few tokens as text."""
        return cls(parser, prompt_tail.rstrip().endswith(OPEN))

    @property
    def starts_inside(self) -> bool:
        """Whether a reply starts inside the block without writing `<think>` (else it may write it)."""
        return self.parser == "deepseek_r1" or self.prompt_opens

    def hold(self, grammar):
        """`grammar` (a `structured.Grammar`) for the answer, after the thinking."""
        return grammar.after_thinking(CLOSE, "" if self.starts_inside else OPEN)

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, answer) in the reply so far (`final`: all of it); each only grows as text does,
        so a stream sends what is new of each."""
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


def fields(reasoning: str) -> dict:
    """The message's (or delta's) reasoning, under both names clients read."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


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
