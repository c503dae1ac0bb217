"""HTTP serving: an engine thread that batches requests onto the device, and a FastAPI app.

    engine = Engine(Generator(config, params, mesh), tokenizer, max_batch=16)
    app = create_app(engine, model_name="gpt-j-6b")      # uvicorn.run(app, host="127.0.0.1")

Endpoints: `POST /complete` (the original: {"context", "top_p", "temp"[, "length", "top_k"]} ->
{"completion"}), `POST /v1/completions` (OpenAI-compatible, with SSE streaming), `GET /v1/models`,
`GET /health`.

Dynamic batching: the engine keeps one `generate.Batch` of `max_batch` rows. Between decode calls
of `chunk` tokens it admits waiting requests into free rows (they join requests already decoding)
and hands new tokens to their handlers. A bounded queue answers 503 when full; every request has a
deadline.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import os
import secrets
import threading
import time
import uuid
from typing import Iterable, Optional, Union

from fastapi import Request as HttpRequest
from pydantic import BaseModel, ConfigDict, Field

from mesh_transformer.generate import Batch, Generator, SamplingOptions, Sequence

log = logging.getLogger("mesh_transformer.serve")

API_KEY_ENV = "MESH_TRANSFORMER_API_KEY"


class QueueFull(Exception):
    pass


# --------------------------------------------------------------------------------------------
# Engine: one thread drives the device
# --------------------------------------------------------------------------------------------

class Request:
    """Sequences submitted together (one API call), and how to wake the handler waiting on them."""

    def __init__(self, seqs: list[Sequence], loop: Optional[asyncio.AbstractEventLoop]):
        self.seqs = seqs
        self.loop = loop
        self.updated = asyncio.Event() if loop else threading.Event()

    def notify(self) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.updated.set)
        else:
            self.updated.set()

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    def cancel(self) -> None:
        for s in self.seqs:
            s.cancelled = True


class Engine:
    """Runs a `Batch` in a background thread; `submit` from any thread.

    max_batch: device rows; slots: cache slots per row (default: the model's context);
    chunk: decode steps per device call (new requests join between calls); max_queue: waiting
    sequences before `submit` raises QueueFull.
    """

    def __init__(self, generator: Generator, tokenizer, max_batch: int = 16, slots: Optional[int] = None,
                 chunk: int = 8, max_queue: int = 100):
        self.gen, self.tokenizer = generator, tokenizer
        self.batch = Batch(generator, max_batch, slots or generator.config.seq, chunk)
        self.context = min(generator.config.seq, self.batch.slots)  # prompt + output must fit a row
        self.max_new_tokens = self.context - 1
        self.max_queue = max_queue
        self._pending: collections.deque[tuple[Sequence, Request]] = collections.deque()
        self._owner: dict[int, Request] = {}  # id(seq) -> request, for sequences in the batch
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="mesh-transformer-engine", daemon=True)
        self.completed = 0
        self.admissions = 0  # prefill calls (each admits a group of waiting sequences)

    def start(self) -> "Engine":
        self._thread.start()
        return self

    def warmup(self, prompt_tokens: Iterable[int] = (16,)) -> None:
        """Compile prefill for every group size (1, 2, 4, .. rows) at these prompt lengths, and decode.

        Call before `start`; otherwise the first requests of each shape wait for the compiler
        (prefill compiles once per group-size bucket and prompt-length bucket).
        """
        options = SamplingOptions(max_new_tokens=min(self.batch.chunk + 1, self.max_new_tokens), temperature=0.0)
        for length in prompt_tokens:
            n = 1
            while n <= self.batch.size:
                prompt = [0] * min(length, self.context - options.max_new_tokens)
                self.batch.admit([Sequence(prompt, options, self.context) for _ in range(n)])
                while self.batch.active():
                    self.batch.step()
                n *= 2

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=30)

    # ---- called from request handlers ---------------------------------------------------------

    def sequence(self, prompt_ids: list[int], options: SamplingOptions, timeout: Optional[float]) -> Sequence:
        """Build (and validate) a Sequence; ValueError names what is wrong."""
        if options.max_new_tokens > self.max_new_tokens:
            raise ValueError(f"max_tokens must be at most {self.max_new_tokens} for this model "
                             f"(context {self.context} tokens), got {options.max_new_tokens}")
        deadline = time.monotonic() + timeout if timeout else None
        return Sequence(prompt_ids, options, self.context, self.tokenizer, deadline=deadline)

    def submit(self, seqs: list[Sequence], loop: Optional[asyncio.AbstractEventLoop] = None) -> Request:
        request = Request(seqs, loop)
        with self._cv:
            if len(self._pending) + len(seqs) > self.max_queue:
                raise QueueFull()
            self._pending.extend((s, request) for s in seqs)
            self._cv.notify()
        return request

    def stats(self) -> dict:
        with self._cv:
            return {"active": len(self.batch.active()), "queued": len(self._pending), "completed": self.completed,
                    "admissions": self.admissions, "compiled_shapes": len(self.gen.shapes)}

    # ---- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._pending and not self.batch.active():
                    self._cv.wait()
                if self._stop:
                    break
                group = self._take_admissible()
            try:
                self._advance(group)
            except Exception:  # noqa: BLE001 - fail the affected requests, keep serving
                log.exception("generation failed; failing the affected requests")
                self._fail_all(group)

    def _take_admissible(self) -> list[tuple[Sequence, Request]]:
        """Waiting sequences (in order) that fit in the batch now; drops cancelled/expired ones."""
        group: list[tuple[Sequence, Request]] = []
        now = time.monotonic()
        while self._pending:
            seq, request = self._pending[0]
            if seq.cancelled or (seq.deadline is not None and now > seq.deadline):
                self._pending.popleft()
                seq.finish("cancelled" if seq.cancelled else "timeout")
                request.notify()
                continue
            if self.batch.plan([s for s, _ in group] + [seq]) is None:
                break  # first come, first served: later requests wait behind this one
            group.append(self._pending.popleft())
        return group

    def _advance(self, group: list[tuple[Sequence, Request]]) -> None:
        finished: list[Sequence] = []
        if group:
            for seq, request in group:
                self._owner[id(seq)] = request
            finished += self.batch.admit([s for s, _ in group])
            self.admissions += 1
        if self.batch.active():
            finished += self.batch.step()
        touched = {id(r): r for r in self._owner.values()}
        for seq in finished:
            self._owner.pop(id(seq), None)
            self.completed += 1
        for request in touched.values():
            request.notify()

    def _fail_all(self, group) -> None:
        for seq, request in group:
            seq.finish("error")
            request.notify()
        for request in list(self._owner.values()):
            for s in request.seqs:
                s.finish("error")
            request.notify()
        self._owner.clear()
        self.batch = Batch(self.gen, self.batch.size, self.batch.slots, self.batch.chunk)

    def generate(self, prompt_ids: list[int], options: SamplingOptions, timeout: Optional[float] = None) -> Sequence:
        """Blocking helper (tests, scripts): one sequence through the queue."""
        seq = self.sequence(prompt_ids, options, timeout)
        request = self.submit([seq])
        while not request.finished:
            request.updated.wait()
            request.updated.clear()
        return seq


# --------------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------------

class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class CompleteRequest(_Strict):
    """The original endpoint's body."""

    context: str
    top_p: float = 0.9
    temp: float = 0.75
    length: Optional[int] = None  # default: 256 (the original's), or what the context allows
    top_k: int = 0


class CompletionRequest(_Strict):
    """OpenAI's /v1/completions body (plus top_k and repetition_penalty)."""

    model: Optional[str] = None
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # extension (vLLM's name)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=5)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0  # extension (HF's)
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    user: Optional[str] = None


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def create_app(engine: Engine, model_name: str = "mesh-transformer", api_key: Optional[str] = None,
               timeout: float = 300.0, max_request_bytes: int = 1 << 20, max_prompts: int = 64):
    """The FastAPI app over a started `engine`. `api_key` (or $MESH_TRANSFORMER_API_KEY) protects all but /health."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
    app = FastAPI(title="mesh-transformer", version="0.1.0")
    app.add_middleware(_Guard, limit=max_request_bytes, api_key=api_key)
    created = int(time.time())

    def error(status, message, kind="invalid_request_error", param=None):
        return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return error(e.status, e.message, e.kind, e.param)

    @app.get("/health")
    async def health():
        return {"status": "ok", **engine.stats()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "mesh-transformer"}]}

    @app.post("/complete")
    async def complete(http: HttpRequest):
        body = _parse(await http.body(), CompleteRequest)
        if not body.context:
            raise ApiError(400, "context must not be empty", param="context")
        length = body.length if body.length is not None else min(256, engine.max_new_tokens)
        options = _options(engine, max_tokens=length, temperature=body.temp, top_p=body.top_p, top_k=body.top_k)
        seqs = _sequences(engine, [engine.tokenizer.encode(body.context)], options, 1, None, timeout)
        try:
            await _wait(engine, seqs, timeout)
        except QueueFull:
            return JSONResponse({"error": "queue full, try again later"}, 503)
        return {"completion": seqs[0].text, "prompt_truncated": seqs[0].truncated}

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        body = _parse(await http.body(), CompletionRequest)
        prompts = _prompts(engine, body.prompt, max_prompts)
        for name, bad in (("echo", body.echo), ("suffix", body.suffix is not None),
                          ("best_of", body.best_of not in (None, body.n))):
            if bad:
                raise ApiError(400, f"{name} is not supported", param=name)
        if body.max_tokens is None:
            body.max_tokens = engine.max_new_tokens
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        options = _options(engine, max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                           top_k=body.top_k, frequency_penalty=body.frequency_penalty,
                           presence_penalty=body.presence_penalty, repetition_penalty=body.repetition_penalty,
                           stop=tuple(stops), logprobs=body.logprobs)
        seqs = _sequences(engine, prompts, options, body.n, body.seed, timeout)
        ident, name = f"cmpl-{uuid.uuid4().hex}", body.model or model_name
        if body.stream:
            try:
                request = engine.submit(seqs, asyncio.get_running_loop())
            except QueueFull:
                raise ApiError(503, "queue full, try again later", "server_busy") from None
            return StreamingResponse(_stream(engine, request, ident, name), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            await _wait(engine, seqs, timeout)
        except QueueFull:
            raise ApiError(503, "queue full, try again later", "server_busy") from None
        choices = [_choice(engine, i, s) for i, s in enumerate(seqs)]
        prompt_tokens = sum(len(s.prompt) for s in seqs[:: body.n])
        completion_tokens = sum(s.kept_tokens() for s in seqs)
        return {"id": ident, "object": "text_completion", "created": int(time.time()), "model": name,
                "choices": choices, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                              "total_tokens": prompt_tokens + completion_tokens}}

    return app


def _parse(raw: bytes, schema: type[BaseModel]):
    """The JSON body as `schema` (whatever the Content-Type, as curl -d sends form-encoded); 400 names the field."""
    from pydantic import ValidationError

    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise ApiError(400, f"{where}: {first['msg']}" if where else first["msg"], param=where or None) from None


def _options(engine: Engine, **given) -> SamplingOptions:
    names = {"max_tokens": "max_new_tokens"}
    fields = {names.get(k, k): v for k, v in given.items() if v is not None}
    fields.setdefault("eos_token_id", getattr(engine.tokenizer, "eos_token_id", None))
    max_new = fields.get("max_new_tokens", 16)
    if max_new < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_new}", param="max_tokens")
    if max_new > engine.max_new_tokens:
        raise ApiError(400, f"max_tokens must be at most {engine.max_new_tokens} (the model's context is "
                            f"{engine.context} tokens), got {max_new}", param="max_tokens")
    options = SamplingOptions(**fields)
    try:
        options.validate(engine.context)
    except ValueError as e:
        raise ApiError(400, str(e).replace("max_new_tokens", "max_tokens"), param=str(e).split()[0]) from None
    return options


def _prompts(engine: Engine, prompt, max_prompts: int) -> list[list[int]]:
    """The request's prompt(s) as token-id lists."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    if len(prompt) > max_prompts:
        raise ApiError(400, f"at most {max_prompts} prompts per request, got {len(prompt)}", param="prompt")
    ids = [engine.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]
    vocab = engine.gen.config.n_vocab
    for p in ids:
        if not p:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        if any(t < 0 or t >= vocab for t in p):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
    return ids


def _sequences(engine: Engine, prompts, options: SamplingOptions, n: int, seed: Optional[int], timeout):
    seqs = []
    for p in prompts:
        for j in range(n):
            o = options if seed is None else dataclasses.replace(options, seed=(seed + j) % 2**32)
            try:
                seqs.append(engine.sequence(p, o, timeout))
            except ValueError as e:
                raise ApiError(400, str(e)) from None
    return seqs


async def _wait(engine: Engine, seqs: list[Sequence], timeout: float) -> None:
    """Queue `seqs` and wait until all are finished (or `timeout` seconds passed: 504)."""
    request = engine.submit(seqs, asyncio.get_running_loop())
    deadline = time.monotonic() + timeout
    try:
        while not request.finished:
            await asyncio.wait_for(request.updated.wait(), max(0.0, deadline - time.monotonic()))
            request.updated.clear()
    except asyncio.TimeoutError:
        request.cancel()
        for s in seqs:
            s.finish("timeout")
    except asyncio.CancelledError:  # the client went away
        request.cancel()
        raise
    reasons = {s.finish_reason for s in seqs}
    if "timeout" in reasons or "cancelled" in reasons:
        raise ApiError(504, f"request timed out after {timeout:g} s", "timeout")
    if "error" in reasons:
        raise ApiError(500, "generation failed (see the server log)", "server_error")


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


async def _stream(engine: Engine, request: Request, ident: str, name: str):
    """Server-sent events: one `text_completion` chunk per choice per decode call, then [DONE]."""
    sent_tokens = [0] * len(request.seqs)
    reported = [False] * len(request.seqs)

    def event(payload) -> bytes:
        return f"data: {json.dumps(payload)}\n\n".encode()

    try:
        while True:
            await request.updated.wait()
            request.updated.clear()
            for i, seq in enumerate(request.seqs):
                if reported[i]:
                    continue
                if seq.finish_reason in ("timeout", "error"):
                    message = "request timed out" if seq.finish_reason == "timeout" else "generation failed"
                    yield event({"error": {"message": message, "type": seq.finish_reason}})
                    request.cancel()
                    return
                text = seq.pop_text()
                hi = seq.kept_tokens() if seq.finished else len(seq.tokens)
                lp = _logprobs(engine, seq, sent_tokens[i], hi) if hi > sent_tokens[i] else None
                sent_tokens[i] = max(sent_tokens[i], hi)
                if text or seq.finished:
                    reported[i] = seq.finished
                    yield event({"id": ident, "object": "text_completion", "created": int(time.time()), "model": name,
                                 "choices": [{"text": text, "index": i, "logprobs": lp,
                                              "finish_reason": seq.finish_reason if seq.finished else None}]})
            if all(reported):
                yield b"data: [DONE]\n\n"
                return
    finally:
        if not request.finished:
            request.cancel()  # the client disconnected


class _Guard:
    """ASGI middleware: the API key (all paths but /health), then a body-size limit (413) before parsing.

    Plain ASGI rather than BaseHTTPMiddleware, which does not pass streamed responses through cleanly.
    """

    def __init__(self, app, limit: int, api_key: Optional[str]):
        self.app, self.limit, self.api_key = app, limit, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.api_key and scope.get("path") != "/health":
            given = headers.get(b"authorization", b"").decode("latin-1")
            given = given[7:] if given.lower().startswith("bearer ") else headers.get(b"x-api-key", b"").decode("latin-1")
            if not secrets.compare_digest(given.encode(), self.api_key.encode()):
                return await _send_error(send, 401, "missing or wrong API key (Authorization: Bearer KEY)",
                                         "authentication_error")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._refuse(send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                return await self._refuse(send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send):
        await _send_error(send, 413, f"request body larger than {self.limit} bytes")


async def _send_error(send, status: int, message: str, kind: str = "invalid_request_error") -> None:
    payload = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
