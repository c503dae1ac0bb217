"""OpenAI's request and response shapes: `/v1/completions`, the original `/complete`, and what the
chat endpoint shares with them (errors, parsing, text encoding, sampling options, waiting, streaming);
vLLM's runtime LoRA endpoints `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`.

Errors are OpenAI's `{"error": {"message", "type", "param", "code"}}`; a 400 names the field in
`param` and at the start of the message.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, Union

from fastapi import Request as HttpRequest
from pydantic import BaseModel, ConfigDict, Field

from mesh_transformer import lora
from mesh_transformer.config import ConfigError
from mesh_transformer.generate import MAX_EOS, MAX_LOGIT_BIAS, SamplingOptions, Sequence
from mesh_transformer.generate.sampling import LOGIT_BIAS_RANGE
from mesh_transformer.io import chat_template
from mesh_transformer.serve.adapters import NameTaken
from mesh_transformer.serve.engine import Draining, Engine, QueueFull, Request

log = logging.getLogger("mesh_transformer.serve")

FAILED = {"timeout": "request timed out", "error": "generation failed (see the server log)",
          "shutdown": "the server is shutting down"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def busy(e: Exception) -> ApiError:
    if isinstance(e, Draining):
        return ApiError(503, "the server is shutting down and accepts no new requests", "server_shutting_down")
    return ApiError(503, "queue full, try again later", "server_busy")


@dataclass
class Settings:
    """What every handler needs besides the request."""

    engine: Engine
    model_name: str
    timeout: float
    max_prompts: int
    chat: Any = None  # chat.ChatTemplate
    tool_parser: Optional[str] = None  # tools.PARSERS' key: how "auto" tool choice reads calls from text
    reasoning_parser: Optional[str] = None  # reasoning.PARSERS' item: how replies' thinking is told from answers
    responses: Any = None  # responses.Store: the kept responses of /v1/responses
    embedder: Any = None  # passes.Passes: /v1/embeddings'
    classifier: Any = None  # passes.Passes: /classify's (a classifier's server)
    labels: tuple[str, ...] = ()  # a classifier's class names


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False  # a last chunk with `usage` and no choices
    continuous_usage_stats: bool = False  # vLLM's: `usage` so far in every chunk


class StructuredFields(_Strict):
    """Structured-output fields, /v1/completions' and /v1/chat/completions' alike (`formats`)."""

    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Any] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None


class SamplingExtensions(_Strict):
    """vLLM's sampling fields, as the chat-shaped APIs whose own bodies lack them (Responses,
    Anthropic's Messages) take them too (None: the default)."""

    seed: Optional[int] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    min_tokens: Optional[int] = None
    stop_token_ids: Optional[list[int]] = None
    logit_bias: Optional[dict[str, float]] = None
    structured_outputs: Optional[dict[str, Any]] = None  # (`serve.formats`), instead of the API's own format field
    chat_template_kwargs: Optional[dict[str, Any]] = None  # more variables for the chat template


class CompleteRequest(_Strict):
    """The original endpoint's body."""

    context: str
    top_p: float = 0.9
    temp: float = 0.75
    length: Optional[int] = None  # default: 256 (the original's), or what the context allows
    top_k: int = 0


class CompletionRequest(StructuredFields):
    """OpenAI's /v1/completions body (plus vLLM's top_k, min_p, repetition_penalty, min_tokens, stop_token_ids
    and ignore_eos)."""

    model: Optional[str] = None
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # extension (vLLM's name)
    min_p: float = 0.0  # extension (vLLM's name)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[int] = Field(None, ge=0, le=5)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0  # extension (HF's)
    ignore_eos: bool = False  # extension (vLLM's)
    min_tokens: int = 0  # extension (vLLM's): no end-of-text before this many tokens
    stop_token_ids: Optional[list[int]] = None  # extension (vLLM's): ids that end the text as EOS does
    logit_bias: Optional[dict[str, float]] = None  # token id (as a string) -> bias in [-100, 100]
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    user: Optional[str] = None


class LoadLoraRequest(_Strict):
    """vLLM's /v1/load_lora_adapter body (`load_inplace`: replace the adapter of that name)."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoraRequest(_Strict):
    """vLLM's /v1/unload_lora_adapter body."""

    lora_name: str


# --------------------------------------------------------------------------------------------
# Shared by every endpoint
# --------------------------------------------------------------------------------------------

def parse(raw: bytes, schema: type[BaseModel]):
    """The JSON body as `schema` (whatever the Content-Type, as curl -d sends form-encoded); 400 names the field."""
    from pydantic import ValidationError

    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = field_name(first["loc"])
        raise ApiError(400, f"{where}: {first['msg']}" if where else first["msg"], param=where or None) from None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "StreamOptions", "ContentPart"}


def field_name(loc) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" not in str(part) and part not in _TYPE_TAGS:  # pydantic's union members: 'str', 'list[int]'
            out += ("." if out else "") + str(part)
    return out


def bad(field: str, why: str):
    """A 400 naming `field` (first in the message too)."""
    raise ApiError(400, f"{field}: {why}", param=field)


def required_text(obj: dict, key: str, where: str) -> str:
    """`obj[key]`, a non-empty string of valid Unicode; else a 400 naming `where.key`."""
    value = obj.get(key)
    if not isinstance(value, str) or not value:
        bad(f"{where}.{key}", f"a non-empty string is required, got {value!r}")
    return check_text(value, f"{where}.{key}")


def json_value(text: str):
    """The JSON value `text` holds, or None where it holds none (or nests too deeply to read)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def check_text(text: str, field: str) -> str:
    """`text` if it is valid Unicode (`chat_template.text`); else a 400 naming `field`."""
    try:
        return chat_template.text(text, field)
    except chat_template.FieldError as e:
        raise ApiError(400, str(e), param=e.field) from None


def encode(engine: Engine, text: str, field: str, **kw) -> list[int]:
    """Token ids of `text`; anything the tokenizer cannot encode is a 400 naming `field`."""
    check_text(text, field)
    try:
        return list(engine.tokenizer.encode(text, **kw))
    except Exception as e:  # noqa: BLE001 - the tokenizer's own complaint, passed on
        raise ApiError(400, f"{field}: the tokenizer cannot encode this text ({type(e).__name__}: {e})",
                       param=field) from None


def stop_list(stop, field: str = "stop") -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    for i, s in enumerate(stops):
        check_text(s, field if isinstance(stop, str) else f"{field}[{i}]")
    return tuple(stops)


# What /v1/completions and /v1/chat/completions share
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                   "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids", "logit_bias")


async def body_options(engine: Engine, body, max_tokens: int, stop, logprobs, grammar=None,
                       grammar_field: str = "") -> SamplingOptions:
    """`options` from an OpenAI body's SAMPLING_FIELDS and structured-output fields, plus what the
    endpoint derives itself. A grammar compiles in a worker thread: the event loop keeps serving.
    `grammar`: one the endpoint derived from `grammar_field` (a forced tool call, `text.format`), which a
    structured-output field may not also ask for."""
    from mesh_transformer.serve import formats
    asked = await asyncio.to_thread(formats.grammar, engine, body) if formats.asked(body) else None
    if grammar is not None and asked is not None:
        other = formats.asked_field(body)
        raise ApiError(400, f"{other}: the reply is already held to {grammar_field}'s format", param=other)
    grammar = grammar if grammar is not None else asked
    shared = {name: getattr(body, name, None) for name in SAMPLING_FIELDS}  # (a body without one: the default)
    return options(engine, max_tokens=max_tokens, stop=stop, logprobs=logprobs, grammar=grammar, **shared)


def options(engine: Engine, ignore_eos: bool = False, stop_token_ids=None, **given) -> SamplingOptions:
    """SamplingOptions from the request's fields (None: the default); 400 names a bad one.
    `ignore_eos` (vLLM's): generate past the model's end-of-text ids (benchmarks); `stop_token_ids`
    (vLLM's): more ids that end the text as they do (not part of it), whatever `ignore_eos` says."""
    names = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
    fields = {names.get(k, k): v for k, v in given.items() if v is not None}
    if "logit_bias" in fields:
        fields["logit_bias"] = logit_bias(fields["logit_bias"], engine.gen.config.n_vocab)
    fields["eos_token_id"] = end_ids(engine, () if ignore_eos else engine.eos_token_ids, stop_token_ids or ())
    max_new = fields.get("max_new_tokens", 16)
    if max_new < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_new}", param="max_tokens")
    if max_new > engine.max_new_tokens:
        raise ApiError(400, f"max_tokens must be at most {engine.max_new_tokens} (the model's context is "
                            f"{engine.context} tokens), got {max_new}", param="max_tokens")
    result = SamplingOptions(**fields)
    try:
        result.validate(engine.context)
    except ValueError as e:
        message = str(e).replace("max_new_tokens", "max_tokens").replace("min_new_tokens", "min_tokens")
        raise ApiError(400, message, param=message.split()[0]) from None
    return result


def check_token_ids(engine: Engine, ids, field: str) -> None:
    """A 400 naming `field` unless every id is in the model's vocabulary."""
    vocab = engine.gen.config.n_vocab
    if any(not 0 <= t < vocab for t in ids):
        raise ApiError(400, f"{field}: token ids must be in [0, {vocab})", param=field)


def end_ids(engine: Engine, model_ids, requested) -> Optional[tuple[int, ...]]:
    """The model's end-of-text ids and a request's stop_token_ids, at most MAX_EOS together."""
    check_token_ids(engine, requested, "stop_token_ids")
    ids = tuple(dict.fromkeys((*model_ids, *requested)))
    if len(ids) > MAX_EOS:
        raise ApiError(400, f"stop_token_ids: at most {MAX_EOS - len(model_ids)} ids besides the model's "
                            f"{len(model_ids)} end-of-text ids, got {len(requested)}", param="stop_token_ids")
    return ids or None


def logit_bias(given: dict[str, float], vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (id, bias) pairs; too many, or a key that is not a token id, is a 400."""
    if len(given) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"logit_bias allows at most {MAX_LOGIT_BIAS} tokens, got {len(given)}", param="logit_bias")
    pairs = []
    for key, value in given.items():
        try:
            token = int(key)
        except ValueError:
            raise ApiError(400, f"logit_bias: keys must be token ids, got {key!r}", param="logit_bias") from None
        if not 0 <= token < vocab:
            raise ApiError(400, f"logit_bias: token id {token} is not in [0, {vocab})", param="logit_bias")
        if not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
            raise ApiError(400, f"logit_bias[{key!r}]: the bias must be in [{-LOGIT_BIAS_RANGE:g}, "
                                f"{LOGIT_BIAS_RANGE:g}], got {value}", param="logit_bias")
        pairs.append((token, float(value)))
    return tuple(pairs)


def adapter(s: Settings, model: Optional[str]) -> Optional[str]:
    """The LoRA adapter a request's `model` names (`--lora-modules`, `/v1/load_lora_adapter`): None
    (the base) for the served name or none. While the server has adapters (a bank), an unknown name
    is a 404, as vLLM's; without, any name means the one model served (clients send their own names)."""
    if model is None or model == s.model_name or s.engine.adapters is None:
        return None
    names = s.engine.adapters.names()
    if model not in names:
        served = ", ".join((s.model_name, *names))
        raise ApiError(404, f"model: the model {model!r} does not exist (served: {served})", "not_found_error",
                       param="model")
    return model


async def served(s: Settings, model: Optional[str]):
    """The adapter (a `lora.ServedAdapter`) a request's `model` names, as `adapter`; None: the base.
    Its leaves are read from its directory again if they were dropped (`serve.adapters`), off the event loop."""
    name = adapter(s, model)
    if name is None:
        return None
    try:
        return s.engine.adapters.held(name) or await asyncio.to_thread(s.engine.adapter, name)
    except ConfigError as e:  # its directory no longer holds it
        raise ApiError(400, f"model: {e}", param="model") from None
    except ValueError as e:  # unloaded since
        raise ApiError(404, f"model: {e}", "not_found_error", param="model") from None


async def sequences(s: Settings, prompts, opts: SamplingOptions, n: int, seed: Optional[int],
                    model: Optional[str] = None) -> list[Sequence]:
    """The request's sequences: each prompt `n` times (seeds seed, seed + 1, ..), under the adapter `model` names."""
    lora = await served(s, model)  # with its leaves, which the engine reads when it places the adapter
    seqs = []
    for p in prompts:
        for j in range(n):
            o = opts if seed is None else dataclasses.replace(opts, seed=(seed + j) % 2**32)
            try:
                seqs.append(s.engine.sequence(p, o, s.timeout, adapter=lora))
            except ValueError as e:
                raise ApiError(400, str(e)) from None
    return seqs


def submit(engine: Engine, seqs: list[Sequence]) -> Request:
    try:
        return engine.submit(seqs, asyncio.get_running_loop())
    except (QueueFull, Draining) as e:
        raise busy(e) from None


async def wait(engine: Engine, seqs: list[Sequence], timeout: float) -> None:
    """Queue `seqs` and wait until all are finished (or `timeout` seconds passed: 504)."""
    request = submit(engine, seqs)
    deadline = time.monotonic() + timeout
    try:
        while not request.finished:
            await asyncio.wait_for(request.updated.wait(), max(0.0, deadline - time.monotonic()))
            request.updated.clear()
    except asyncio.TimeoutError:
        request.cancel()
        for seq in seqs:
            seq.finish("timeout")
    except asyncio.CancelledError:  # the client went away
        request.cancel()
        raise
    reasons = {seq.finish_reason for seq in seqs}
    if "timeout" in reasons or "cancelled" in reasons:
        raise ApiError(504, f"request timed out after {timeout:g} s", "timeout")
    if "shutdown" in reasons:
        raise ApiError(503, FAILED["shutdown"], "server_shutting_down")
    if "error" in reasons:
        raise ApiError(500, FAILED["error"], "server_error")


def usage(seqs: list[Sequence], n: int) -> dict:
    """OpenAI's usage of a request's sequences (`n` per prompt, each prompt counted once), with the
    prompt tokens read from the prefix cache rather than computed (`prompt_tokens_details`)."""
    prompt = sum(len(seq.prompt) for seq in seqs[::n])
    completion = sum(seq.kept_tokens() if seq.finished else len(seq.tokens) for seq in seqs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(seq.cached_tokens for seq in seqs[::n])}}


@dataclass
class Delta:
    """New output of one choice: its text and the range of output tokens it came from."""

    index: int
    text: str
    lo: int
    hi: int
    finish_reason: Optional[str]


class StreamFailed(Exception):
    pass


async def deltas(request: Request) -> AsyncIterator[Delta]:
    """Each choice's new text as the engine delivers it (never part of a stop string or of a UTF-8
    character), its last with the finish reason. Raises StreamFailed if the request failed; cancels
    the request if the consumer stops early (the client went away)."""
    sent = [0] * len(request.seqs)
    reported = [False] * len(request.seqs)
    try:
        while not all(reported):
            await request.updated.wait()
            request.updated.clear()
            for i, seq in enumerate(request.seqs):
                if reported[i]:
                    continue
                if seq.finish_reason in FAILED:
                    raise StreamFailed(seq.finish_reason)
                text = seq.pop_text()
                hi = seq.kept_tokens() if seq.finished else len(seq.tokens)
                if text or seq.finished:
                    reported[i] = seq.finished
                    yield Delta(i, text, sent[i], max(sent[i], hi), seq.finish_reason)
                    sent[i] = max(sent[i], hi)
    finally:
        if not request.finished:
            request.cancel()


def event(payload) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def error_event(failure: StreamFailed) -> bytes:
    reason = str(failure)
    kind = {"shutdown": "server_shutting_down", "error": "server_error"}.get(reason, reason)
    return event({"error": {"message": FAILED[reason], "type": kind, "param": None, "code": None}})


def streaming_response(events: AsyncIterator[bytes]):
    from fastapi.responses import StreamingResponse
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# --------------------------------------------------------------------------------------------
# /v1/completions and /complete
# --------------------------------------------------------------------------------------------

def prompts(s: Settings, prompt) -> list[list[int]]:
    """The request's prompt(s) as token-id lists."""
    engine = s.engine
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    if len(prompt) > s.max_prompts:
        raise ApiError(400, f"at most {s.max_prompts} prompts per request, got {len(prompt)}", param="prompt")
    field = (lambda i: "prompt") if len(prompt) == 1 else (lambda i: f"prompt[{i}]")
    ids = [encode(engine, p, field(i)) if isinstance(p, str) else list(p) for i, p in enumerate(prompt)]
    for p in ids:
        if not p:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        check_token_ids(engine, p, "prompt")
    return ids


async def complete(s: Settings, http: HttpRequest):
    """The original endpoint: {"context", "top_p", "temp"[, "length", "top_k"]} -> {"completion"}."""
    from fastapi.responses import JSONResponse

    body = parse(await http.body(), CompleteRequest)
    if not body.context:
        raise ApiError(400, "context must not be empty", param="context")
    length = body.length if body.length is not None else min(256, s.engine.max_new_tokens)
    opts = options(s.engine, max_tokens=length, temperature=body.temp, top_p=body.top_p, top_k=body.top_k)
    seqs = await sequences(s, [encode(s.engine, body.context, "context")], opts, 1, None)
    try:
        await wait(s.engine, seqs, s.timeout)
    except ApiError as e:
        if e.status == 503 and e.kind == "server_busy":
            return JSONResponse({"error": "queue full, try again later"}, 503)  # the original's answer
        raise
    return {"completion": seqs[0].text, "prompt_truncated": seqs[0].truncated}


async def completions(s: Settings, http: HttpRequest):
    body = parse(await http.body(), CompletionRequest)
    ids = prompts(s, body.prompt)
    for name, bad in (("suffix", body.suffix is not None), ("best_of", body.best_of not in (None, body.n)),
                      ("stream", body.stream and body.echo)):
        if bad:
            raise ApiError(400, f"{name} is not supported" + (" with echo" if name == "stream" else ""), param=name)
    if body.echo:
        return await _echo_completions(s, body, ids)
    max_tokens = body.max_tokens if body.max_tokens is not None else room(s.engine, ids)
    opts = await body_options(s.engine, body, max_tokens, stop_list(body.stop), body.logprobs)
    seqs = await sequences(s, ids, opts, body.n, body.seed, body.model)
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": body.model or s.model_name}
    if body.stream:
        request = submit(s.engine, seqs)
        return streaming_response(_completion_events(s.engine, request, head, body.n, body.stream_options))
    await wait(s.engine, seqs, s.timeout)
    return {**head, "choices": [_choice(s.engine, i, seq) for i, seq in enumerate(seqs)],
            "usage": usage(seqs, body.n)}


async def load_lora_adapter(s: Settings, http: HttpRequest):
    """vLLM's runtime loading: {"lora_name", "lora_path"} -> the adapter in that directory (on the
    server's disk) is known by that name; requests naming it run with it from then on. 400 names
    what is wrong (a name in use, an adapter that cannot be served or does not fit the bank)."""
    from fastapi.responses import PlainTextResponse

    body = parse(await http.body(), LoadLoraRequest)
    name, slots = body.lora_name, s.engine.adapters
    if not name or name == s.model_name:
        raise ApiError(400, f"lora_name: {name!r} cannot name an adapter (it is {'empty' if not name else 'the base'})",
                       param="lora_name")
    taken = f"lora_name: the adapter {name!r} has already been loaded (load_inplace replaces it)"
    if name in slots.names() and not body.load_inplace:
        raise ApiError(400, taken, param="lora_name")
    gen = s.engine.gen
    try:
        loaded = await asyncio.to_thread(lora.served_adapter, name, body.lora_path, gen.config, gen.mp)
        slots.add(loaded, replace=body.load_inplace)
    except NameTaken:
        raise ApiError(400, taken, param="lora_name") from None
    except ConfigError as e:
        raise ApiError(400, f"lora_path: {e}", param="lora_path") from None
    log.info("loaded LoRA adapter %r from %s (rank %d)", name, body.lora_path, loaded.rank)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(s: Settings, http: HttpRequest):
    """vLLM's runtime unloading: {"lora_name"} -> requests can no longer name it (those already
    submitted finish with it); 404 if no adapter has that name."""
    from fastapi.responses import PlainTextResponse

    body = parse(await http.body(), UnloadLoraRequest)
    try:
        s.engine.adapters.remove(body.lora_name)
    except KeyError:
        raise ApiError(404, f"lora_name: the adapter {body.lora_name!r} cannot be found", "not_found_error",
                       param="lora_name") from None
    log.info("unloaded LoRA adapter %r", body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def room(engine: Engine, ids: list[list[int]]) -> int:
    """max_tokens when the request gives none: what the context leaves after the longest prompt."""
    return max(1, min(engine.max_new_tokens, engine.context - max(len(p) for p in ids)))


def _logprobs(engine: Engine, seq: Sequence, lo: int = 0, hi: Optional[int] = None) -> Optional[dict]:
    """OpenAI's legacy completions logprobs for output tokens lo..hi."""
    if seq.options.logprobs is None:
        return None
    tok = engine.tokenizer
    hi = seq.kept_tokens() if hi is None else hi
    ids = seq.tokens[lo:hi]
    offsets, text_so_far = [], len(tok.decode(seq.tokens[:lo]))
    for i in range(lo, hi):
        offsets.append(text_so_far)
        text_so_far = len(tok.decode(seq.tokens[: i + 1]))
    return {"tokens": [tok.decode([t]) for t in ids], "token_logprobs": seq.logprobs[lo:hi],
            "top_logprobs": [{tok.decode([t]): lp for t, lp in alts} for alts in seq.top_logprobs[lo:hi]],
            "text_offset": offsets}


def _choice(engine: Engine, index: int, seq: Sequence) -> dict:
    return {"text": seq.text, "index": index, "logprobs": _logprobs(engine, seq),
            "finish_reason": seq.finish_reason, "prompt_truncated": seq.truncated}


async def _completion_events(engine: Engine, request: Request, head: dict, n: int,
                             stream_options: Optional[StreamOptions]):
    """Server-sent events: one `text_completion` chunk per choice per decode call, then [DONE]."""
    so = stream_options or StreamOptions()
    try:
        async for d in deltas(request):
            lp = _logprobs(engine, request.seqs[d.index], d.lo, d.hi) if d.hi > d.lo or d.finish_reason else None
            chunk = {**head, "choices": [{"text": d.text, "index": d.index, "logprobs": lp,
                                          "finish_reason": d.finish_reason}]}
            if so.continuous_usage_stats:
                chunk["usage"] = usage(request.seqs, n)
            yield event(chunk)
    except StreamFailed as e:
        yield error_event(e)
        return
    if so.include_usage:
        yield event({**head, "choices": [], "usage": usage(request.seqs, n)})
    yield b"data: [DONE]\n\n"


# --------------------------------------------------------------------------------------------
# echo: the prompt's own tokens and log-probabilities (how evaluators score text)
# --------------------------------------------------------------------------------------------

async def _echo_completions(s: Settings, body: CompletionRequest, ids: list[list[int]]):
    """`echo: true`: each choice's text is its prompt followed by the completion (none with
    `max_tokens: 0`), and with `logprobs` its logprobs cover the prompt's tokens too, the first
    one's null (nothing comes before it), as OpenAI's legacy completions do. Prompts are scored
    together in one batched pass (`evaluate.scoring`); they must fit the context with max_tokens."""
    engine = s.engine
    max_tokens = body.max_tokens if body.max_tokens is not None else 16
    if max_tokens < 0:
        raise ApiError(400, f"max_tokens must not be negative, got {max_tokens}", param="max_tokens")
    for i, p in enumerate(ids):
        if len(p) + max_tokens > engine.context:
            field = "prompt" if len(ids) == 1 else f"prompt[{i}]"
            raise ApiError(400, f"{field} has {len(p)} tokens; with echo, prompt + max_tokens ({max_tokens}) must "
                                f"fit the model's context of {engine.context} tokens", param=field)
    texts = _prompt_texts(engine, body.prompt, ids)
    seqs: list[Optional[Sequence]] = [None] * (len(ids) * body.n)
    opts = await body_options(engine, body, max(max_tokens, 1), stop_list(body.stop), body.logprobs)  # checked even
    if max_tokens > 0:                                                # when nothing is generated
        seqs = await sequences(s, ids, opts, body.n, body.seed, body.model)
        submit_and_wait = wait(engine, seqs, s.timeout)
    else:
        submit_and_wait = None
    scores = None
    if body.logprobs is not None:
        from mesh_transformer.evaluate.scoring import scorer_for
        scorer = scorer_for(engine.gen)
        lora = seqs[0].lora if seqs[0] is not None else await served(s, body.model)  # the completions' own
        scoring = asyncio.to_thread(scorer.score, ids, max(1, body.logprobs), adapter=lora)
        if submit_and_wait is not None:
            scores, _ = await asyncio.gather(scoring, submit_and_wait)
        else:
            scores = await scoring
    elif submit_and_wait is not None:
        await submit_and_wait
    choices = []
    for index in range(len(ids) * body.n):
        p = index // body.n
        choices.append(_echo_choice(engine, index, ids[p], texts[p], scores[p] if scores else None, seqs[index],
                                    body.logprobs))
    prompt_tokens = sum(len(p) for p in ids)
    completion = sum(seq.kept_tokens() for seq in seqs if seq is not None)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": body.model or s.model_name, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                      "total_tokens": prompt_tokens + completion}}


def _prompt_texts(engine: Engine, prompt, ids: list[list[int]]) -> list[str]:
    """The prompts as echoed: the strings as sent, token-id prompts decoded."""
    given = [prompt] if isinstance(prompt, str) else prompt if prompt and isinstance(prompt[0], str) else None
    return list(given) if given is not None else [engine.tokenizer.decode(p) for p in ids]


def _echo_choice(engine: Engine, index: int, prompt: list[int], text: str, scores, seq: Optional[Sequence],
                 n_top: Optional[int]) -> dict:
    tok = engine.tokenizer
    logprobs = None
    if n_top is not None:
        offsets = [len(tok.decode(prompt[:i])) for i in range(len(prompt))]
        logprobs = {"tokens": [tok.decode([t]) for t in prompt],
                    "token_logprobs": [None] + [float(x) for x in scores.logprobs],
                    "top_logprobs": [None] + [_top_dict(tok, top[:n_top], lps[:n_top])
                                              for top, lps in zip(scores.top_ids, scores.top_logprobs)],
                    "text_offset": offsets}
        if seq is not None:
            generated = _logprobs(engine, seq)
            logprobs = {key: logprobs[key] + (generated[key] if key != "text_offset" else
                                              [len(text) + o for o in generated[key]]) for key in logprobs}
    completion = seq.text if seq is not None else ""
    return {"text": text + completion, "index": index, "logprobs": logprobs,
            "finish_reason": seq.finish_reason if seq is not None else "length", "prompt_truncated": 0}


def _top_dict(tok, ids, logprobs) -> dict:
    """{token text: log p}, most likely first; where two ids decode to the same text (partial UTF-8
    bytes) the likelier one is kept, so the dict's max is the most likely token's."""
    out: dict = {}
    for t, lp in zip(ids, logprobs):
        out.setdefault(tok.decode([int(t)]), float(lp))
    return out
