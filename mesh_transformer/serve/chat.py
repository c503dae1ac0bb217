"""`POST /v1/chat/completions`: OpenAI's chat API over the completion engine.

`messages` become one prompt through a chat template (`io.chat_template`): `--chat-template FILE`
if given, else the tokenizer's own, else `PLAIN_TEMPLATE` ("Role: content" paragraphs, then
"Assistant:"; a `developer` message counts as `system`). The rendered text is tokenized without
adding special tokens (a template writes the ones it wants). No stop strings are implied: pass
`stop` (e.g. ["\\n\\nUser:"]) to end a base model's turn.

With `tools`, the template also gets them (`tools=`), and the reply may be calls (`serve.tools`):
assistant messages carry `tool_calls` (their `arguments` JSON text, given to the template as an
object, as transformers' templates expect) and `tool` messages the results. With a reasoning
parser, the reply's thinking comes back apart from its answer (`serve.reasoning`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Union

from fastapi import Request as HttpRequest
from pydantic import Field

from mesh_transformer.generate import SamplingOptions, Sequence
from mesh_transformer.generate.structured import Grammar, check
from mesh_transformer.io.chat_template import RESERVED, FieldError, Rendering, template_messages
from mesh_transformer.serve import formats
from mesh_transformer.serve import openai as oa
from mesh_transformer.serve import reasoning
from mesh_transformer.serve import tools as tool_calls
from mesh_transformer.serve.engine import Engine



class ContentPart(oa._Strict):
    type: str
    text: Optional[str] = None


class ChatMessage(oa._Strict):
    role: str
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list] = None  # an assistant's calls: [{"id", "type": "function", "function": {"name", "arguments"}}]
    tool_call_id: Optional[str] = None  # a tool message's: the call it answers
    reasoning: Optional[str] = None  # an assistant's earlier thinking (vLLM's name; `reasoning_content`, DeepSeek's)
    reasoning_content: Optional[str] = None


class TemplateFields(oa._Strict):
    """vLLM's fields beside `messages` that say how the template renders them."""

    add_generation_prompt: bool = True  # end where the assistant's reply starts
    continue_final_message: bool = False  # end inside the last message, for the model to go on with it
    chat_template_kwargs: Optional[dict[str, Any]] = None  # more variables for the template (enable_thinking ..)


def rendering(body: TemplateFields) -> Rendering:
    """The body's template fields, checked; a 400 naming the one at fault."""
    if body.add_generation_prompt and body.continue_final_message:
        raise oa.ApiError(400, "continue_final_message: the reply would continue the last message, so set "
                               "add_generation_prompt to false", param="continue_final_message")
    given = body.chat_template_kwargs or {}
    for key in given:
        if key in RESERVED:
            raise oa.ApiError(400, f"chat_template_kwargs.{key}: set by the server (or by its own request field)",
                              param=f"chat_template_kwargs.{key}")
    return Rendering(body.add_generation_prompt, body.continue_final_message, tuple(given.items()))


class ChatRequest(oa.StructuredFields, TemplateFields):
    """OpenAI's /v1/chat/completions body (plus top_k, min_p, repetition_penalty, min_tokens, stop_token_ids
    and ignore_eos, as vLLM takes them). `tools`, `tool_choice`, `parallel_tool_calls`: `serve.tools`."""

    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    n: int = Field(1, ge=1, le=16)
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=5)
    stream: bool = False
    stream_options: Optional[oa.StreamOptions] = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: Optional[list[int]] = None
    logit_bias: Optional[dict[str, float]] = None
    tools: Optional[list] = None
    tool_choice: Optional[Union[str, dict]] = None
    parallel_tool_calls: Optional[bool] = None  # default (null too): true
    thinking_token_budget: Optional[int] = Field(None, ge=1)  # vLLM's: the thinking's tokens at most
    functions: Optional[list] = None  # OpenAI's deprecated forms of tools and tool_choice: a 400 saying so
    function_call: Optional[Union[str, dict]] = None
    user: Optional[str] = None


def _messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the template sees them (`template_messages`); a 400 naming the field at fault."""
    try:
        return template_messages([m.model_dump(exclude_none=True) for m in messages])
    except FieldError as e:
        raise oa.ApiError(400, str(e), param=e.field) from None


def render(s: oa.Settings, messages: list[dict], how: Rendering, specs: Optional[list],
           field: str = "messages") -> str:
    """The text the chat template renders of `messages` (as templates take them) and the tools'
    `specs`; a 400 naming `field` if it refuses."""
    try:
        return s.chat.render(messages, how, specs)
    except ValueError as e:
        raise oa.ApiError(400, f"{field}: {e}", param=field) from None


def encoded_messages(s: oa.Settings, messages: list[ChatMessage], how: Rendering = Rendering(),
                     add_special_tokens: bool = False, tools: Optional[list] = None) -> list[int]:
    """`messages` rendered (`render`) and tokenized (no special tokens added by default: a
    template writes the ones it wants)."""
    text = render(s, _messages(messages), how, tools)
    return oa.encode(s.engine, text, "messages", add_special_tokens=add_special_tokens)


def _reply_start(s: oa.Settings, messages: list[dict], how: Rendering, tools: Optional[list], cue: str) -> str:
    """The text the template puts just before the reply: the final message it continues, or the
    generation prompt (`cue`, the rendering with it, less the rendering without)."""
    if how.continue_final_message:
        return messages[-1]["content"]
    if not how.add_generation_prompt:
        return ""
    try:
        bare = s.chat.render(messages, dataclasses.replace(how, add_generation_prompt=False), tools)
    except ValueError:
        bare = ""
    if bare and cue.startswith(bare):
        return cue[len(bare):]
    end = cue.rstrip()  # the cue cannot be told apart: only a marker it ends with counts
    return next((m for m in (reasoning.OPEN, reasoning.CLOSE) if end.endswith(m)), "")


def _thinking(s: oa.Settings, messages: list[dict], how: Rendering, specs, text: str,
              plan: Optional[tool_calls.Plan]) -> reasoning.Thinking:
    """How this request's replies split into reasoning and answer. Harmony's reply starts after the
    rendered prompt's last message header (a prefill's open body included), and its messages to
    tools stay in the answer only where `--tool-call-parser openai` reads them ("auto")."""
    if s.reasoning_parser != reasoning.HARMONY:
        return reasoning.Thinking.of(s.reasoning_parser, _reply_start(s, messages, how, specs, text),
                                     s.engine.tokenizer, how.continue_final_message)
    reads_calls = plan is not None and plan.parser == "openai" and plan.choice == "auto"
    return dataclasses.replace(reasoning.Thinking.of(s.reasoning_parser, text), tool_messages=reads_calls)


def _check_held_after_thinking(s: oa.Settings, body, plan: Optional[tool_calls.Plan], grammar: Optional[Grammar],
                               grammar_field: str) -> None:
    """A 400, before any grammar compiles, for a reply format or a forced call the server's reasoning
    parser cannot hold after its thinking (harmony's answer starts after a header of several tokens,
    not one closer)."""
    if reasoning.holds_after_thinking(s.reasoning_parser):
        return
    why = f"not held after the thinking of --reasoning-parser {s.reasoning_parser} (its answer starts after a " \
          f"header of several tokens)"
    if plan is not None and plan.grammar() is not None:
        raise oa.ApiError(400, f"tool_choice: a forced call is {why}; use \"auto\" with --tool-call-parser openai",
                          param="tool_choice")
    where = formats.asked_field(body) or (grammar_field if grammar is not None else None)
    if where is not None:
        raise oa.ApiError(400, f"{where}: a reply's format is {why}", param=where)


def _tool_grammar(engine: Engine, plan: tool_calls.Plan, where: str, grammar: Grammar) -> Grammar:
    """`grammar`, the one a named or required tool choice holds the reply to (`plan.grammar()`),
    compiled once to check it; a 400 naming the tool whose parameters do not compile."""
    try:
        check(grammar, engine.tokenizer, engine.gen.vocab)
        return grammar
    except ValueError as e:
        error = e
    if where == "tools":  # "required"'s array of every tool: name the tool that fails alone
        for alone_where, alone in plan.parameter_grammars():
            try:
                check(alone, engine.tokenizer, engine.gen.vocab)
            except ValueError as e:
                raise oa.ApiError(400, f"{alone_where}: {e}", param=alone_where) from None
    raise oa.ApiError(400, f"{where}: {error}", param=where)


async def chat_completions(s: oa.Settings, http: HttpRequest):
    body = oa.parse(await http.body(), ChatRequest)
    if body.top_logprobs is not None and not body.logprobs:
        raise oa.ApiError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
    for old, new in (("functions", "tools"), ("function_call", "tool_choice")):
        if getattr(body, old) is not None:
            raise oa.ApiError(400, f"{old}: OpenAI's deprecated form is not supported; use {new}", param=old)
    if body.thinking_token_budget is not None and not s.reasoning_parser:
        oa.bad("thinking_token_budget", "needs the server started with --reasoning-parser, which tells the thinking "
                                        "apart")
    if body.thinking_token_budget is not None and s.reasoning_parser == reasoning.HARMONY:
        oa.bad("thinking_token_budget", f"not with --reasoning-parser {reasoning.HARMONY}: its answer starts after a "
                                        f"header of several tokens, not one closer a budget could force")
    if body.thinking_token_budget is not None and reasoning.marker_ids(s.engine.tokenizer)[1] < 0:
        oa.bad("thinking_token_budget", f"the tokenizer has no {reasoning.CLOSE} token of its own to end the thinking "
                                        f"with (its text takes several)")
    engine = s.engine
    plan = tool_calls.plan(body, s.tool_parser)
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    reply = await prepare(s, body, _messages(body.messages), rendering(body), plan, getattr(body, field), field,
                          oa.stop_list(body.stop), (body.top_logprobs or 0) if body.logprobs else None,
                          thinking_budget=body.thinking_token_budget or 0)
    seqs = await oa.sequences(s, [reply.ids], reply.opts, body.n, body.seed, body.model)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": body.model or s.model_name}
    if body.stream:
        request = oa.submit(engine, seqs)
        return oa.streaming_response(_events(engine, request, head, body.n, body.stream_options, reply.shape))
    await oa.wait(engine, seqs, s.timeout)
    return {**head, "choices": [_choice(engine, i, seq, reply.shape) for i, seq in enumerate(seqs)],
            "usage": oa.usage(seqs, body.n)}


def prompt(s: oa.Settings, messages: list[dict], how: Rendering, specs: Optional[list],
           field: str = "messages") -> tuple[str, list[int]]:
    """The text the template renders of `messages` and the tools' `specs`, and its token ids (none
    added: a template writes the ones it wants); a 400 naming `field` where it is empty."""
    text = render(s, messages, how, specs, field)
    ids = oa.encode(s.engine, text, field, add_special_tokens=False)
    if not ids:
        raise oa.ApiError(400, f"{field}: the rendered prompt is empty", param=field)
    return text, ids


@dataclass(frozen=True)
class Prepared:
    """A chat-shaped request ready to run: its prompt, its sampling options, what its replies become."""

    ids: list[int]
    opts: SamplingOptions
    shape: "Shape"


async def prepare(s: oa.Settings, body, messages: list[dict], how: Rendering, plan: Optional[tool_calls.Plan],
                  max_tokens: Optional[int], max_field: str, stop: tuple[str, ...], logprobs: Optional[int],
                  grammar: Optional[Grammar] = None, grammar_field: str = "",
                  messages_field: str = "messages", fit: bool = False, thinking_budget: int = 0) -> Prepared:
    """What /v1/chat/completions, /v1/responses and /v1/messages share: `messages` (as templates
    take them) rendered and tokenized, `max_tokens` checked against the context (None: what it
    leaves; with `fit`, a cap lowered to what it leaves, as Anthropic's clients ask for more than a
    small model's context holds), the sampling options (`body`'s, `oa.body_options`) with the
    grammar the reply is held to (a forced tool choice's, else `grammar`, which `grammar_field`
    asked for), and the reply's `Shape`. With a reasoning parser, `thinking_budget` caps the
    thinking's tokens where it can (`reasoning.Thinking.can_cap`): a grammar then ends it. A 400
    names the field at fault (`messages_field` for the conversation, `max_field` for the length)."""
    engine = s.engine
    specs = plan.specs() if plan else None
    if s.reasoning_parser == reasoning.HARMONY:
        messages = reasoning.harmony_history(messages)
    text, ids = prompt(s, messages, how, specs, messages_field)
    room = engine.context - len(ids)
    if max_tokens is None or (fit and max_tokens > room > 0):
        max_tokens = room
    if len(ids) + max(max_tokens, 1) > engine.context:
        raise oa.ApiError(400, f"{messages_field}: the prompt is {len(ids)} tokens; with {max_field} {max_tokens} it "
                               f"does not fit the model's context of {engine.context} tokens", param=messages_field)
    _check_held_after_thinking(s, body, plan, grammar, grammar_field)
    try:
        held = plan.grammar() if plan else None
        if held:
            grammar, grammar_field = await asyncio.to_thread(_tool_grammar, engine, plan, *held), "tool_choice"
        opts = await oa.body_options(engine, body, max_tokens, stop, logprobs, grammar, grammar_field)
    except oa.ApiError as e:
        if e.param == "max_tokens":
            e.param, e.message = max_field, e.message.replace("max_tokens", max_field)
        raise
    thinking = _thinking(s, messages, how, specs, text, plan) if s.reasoning_parser else None
    budget = thinking_budget if thinking is not None and thinking.can_cap else 0
    if thinking is not None and (opts.grammar is not None or budget):  # a grammar holds the answer, after the thinking
        opts = dataclasses.replace(opts, grammar=thinking.hold(opts.grammar or reasoning.ANY_ANSWER, budget))
        await asyncio.to_thread(check, opts.grammar, engine.tokenizer, engine.gen.vocab)
    return Prepared(ids, opts, Shape(plan, thinking))


@dataclass(frozen=True)
class Shape:
    """What a reply's text becomes: reasoning (`reasoning.Thinking`) and an answer, the answer's text
    and tool calls (`tools.Plan`)."""

    plan: Optional[tool_calls.Plan] = None
    thinking: Optional[reasoning.Thinking] = None

    def message(self, text: str, finish_reason: Optional[str]) -> tuple[dict, Optional[str]]:
        """A whole reply's message and finish reason."""
        thought, answer = self.thinking.split(text, final=True) if self.thinking else ("", text)
        message, finish_reason = ({"role": "assistant", "content": answer}, finish_reason) if self.plan is None \
            else self.plan.reply(answer, finish_reason)
        if self.thinking is not None:
            message = {**message, **reasoning.fields(thought or None), "content": message["content"] or None}
        return message, finish_reason


class StreamedReply:
    """One streamed choice of a `Shape`: text in as generated, chat deltas out."""

    def __init__(self, shape: Shape):
        self.thinking = reasoning.Reader(shape.thinking) if shape.thinking else None
        self.tools = shape.plan.reader() if shape.plan else None

    def feed(self, piece: str, finished: bool) -> dict:
        delta = {}
        if self.thinking is not None:
            thought, piece = self.thinking.feed(piece, finished)
            if thought:
                delta.update(reasoning.fields(thought))
        if self.tools is not None:
            delta.update(self.tools.feed(piece, finished))
        elif piece:
            delta["content"] = piece
        return delta

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        return self.tools.finish_reason(reason) if self.tools else reason


class CallEvents:
    """What the typed-event streams (Responses', Anthropic's) share: calls read whole from the text
    wait for the end, after the text, where a whole reply has them, so streamed and whole replies
    have the same items (a named call's arguments stream as generated: its reply is the call).
    Subclasses write a call's events (`write_call`)."""

    def __init__(self, shape: Shape):
        plan = shape.plan
        self.deferred: Optional[list] = [] if plan is not None and plan.named is None else None

    def call(self, entry: dict) -> list[bytes]:
        """A chat delta's tool call entry (`StreamedReply.feed`): its events now, or at the end."""
        if self.deferred is not None:
            self.deferred.append(entry)
            return []
        return self.write_call(entry)

    def write_call(self, entry: dict) -> list[bytes]:
        raise NotImplementedError

    def take_deferred(self) -> list[dict]:
        """The calls held back; later calls are written as they come."""
        deferred, self.deferred = self.deferred or [], None
        return deferred


def _choice(engine: Engine, index: int, seq: Sequence, shape: Shape) -> dict:
    message, finish_reason = shape.message(seq.text, seq.finish_reason)
    return {"index": index, "message": message, "logprobs": token_logprobs(engine, seq, 0, seq.kept_tokens()),
            "finish_reason": finish_reason}


def token_logprobs(engine: Engine, seq: Sequence, lo: int, hi: int) -> Optional[dict]:
    """OpenAI's chat logprobs ({"content": [{token, logprob, bytes, top_logprobs}]}) of output tokens lo..hi."""
    if seq.options.logprobs is None:
        return None

    def entry(t: int, lp: float) -> dict:
        text = engine.tokenizer.decode([t])
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in alts]}
                        for t, lp, alts in zip(seq.tokens[lo:hi], seq.logprobs[lo:hi], seq.top_logprobs[lo:hi])]}


async def _events(engine: Engine, request, head: dict, n: int, stream_options: Optional[oa.StreamOptions],
                  shape: Shape):
    """Server-sent `chat.completion.chunk` events: the role first, then reasoning, content and tool
    calls as they are generated, the finish reason with the last piece, then (with include_usage)
    the usage, then [DONE]."""
    so = stream_options or oa.StreamOptions()
    head = {**head, "object": "chat.completion.chunk"}

    def chunk(choices: list, **extra) -> bytes:
        if so.continuous_usage_stats:
            extra["usage"] = oa.usage(request.seqs, n)
        return oa.event({**head, "choices": choices, **extra})

    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                 for i in range(len(request.seqs))])
    try:
        replies = [StreamedReply(shape) for _ in request.seqs]
        async for d in oa.deltas(request):
            lp = token_logprobs(engine, request.seqs[d.index], d.lo, d.hi) if d.hi > d.lo else None
            finished = d.finish_reason is not None
            delta = replies[d.index].feed(d.text, finished)
            finish_reason = replies[d.index].finish_reason(d.finish_reason)
            if delta or lp or finished:
                yield chunk([{"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}])
    except oa.StreamFailed as e:
        yield oa.error_event(e)
        return
    if so.include_usage:
        yield oa.event({**head, "choices": [], "usage": oa.usage(request.seqs, n)})
    yield b"data: [DONE]\n\n"
