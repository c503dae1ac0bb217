"""The FastAPI app over a started `Engine`, and `run`: uvicorn with a graceful shutdown.

Routes: `GET /` (the playground page), `POST /complete`, `POST /v1/completions`,
`POST /v1/chat/completions`, `POST /v1/responses` (with `GET` and `DELETE /v1/responses/{id}`,
`POST /v1/responses/input_tokens`),
`POST /v1/messages` and `POST /v1/messages/count_tokens` (Anthropic's),
`POST /v1/embeddings`, `POST /classify` (vLLM's; also at SGLang's `/v1/classify`; a classifier's server
answers it, and a 400 on the routes that generate), `POST /score` and `POST /rerank` (vLLM's; also at
`/v1/score`, `/v1/rerank`, `/v2/rerank`: a classifier of one label's), `POST /tokenize` and `POST /detokenize` (vLLM's),
`GET /v1/models` and `GET /v1/models/{id}` (read
by OpenAI's and Anthropic's clients alike), `GET /health`, `GET /metrics`
(Prometheus), and with
runtime LoRA loading `POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter` (vLLM's).
"""
from __future__ import annotations

import html
import json
import logging
import os
import pathlib
import secrets
import signal
import threading
import time
from typing import Optional

from fastapi import Request as HttpRequest

from mesh_transformer.evaluate.scoring import POOLINGS
from mesh_transformer.io.chat_template import ChatTemplate
from mesh_transformer.serve import chat as chat_api
from mesh_transformer.serve import classify as classify_api
from mesh_transformer.serve import embeddings as embeddings_api
from mesh_transformer.serve import messages as messages_api
from mesh_transformer.serve import openai as oa
from mesh_transformer.serve import reasoning as reasoning_api
from mesh_transformer.serve import responses as responses_api
from mesh_transformer.serve import tokens as tokens_api
from mesh_transformer.serve import tools as tools_api
from mesh_transformer.serve.engine import Engine
from mesh_transformer.serve.metrics import CONTENT_TYPE

log = logging.getLogger("mesh_transformer.serve")

API_KEY_ENV = "MESH_TRANSFORMER_API_KEY"
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's switch for the runtime LoRA routes (device_serve.py)
PAGE = pathlib.Path(__file__).with_name("page.html")
KEPT_RESPONSE = "/v1/responses/{id}"  # the metrics' name for GET and DELETE of a kept response
MODEL_CARD = "/v1/models/{id}"  # and for GET of one model
OPEN_PATHS = ("/", "/health", "/metrics")  # answered without the API key (no model output, no secrets)
ENDPOINTS = ("/", "/complete", "/v1/completions", "/v1/chat/completions", "/v1/responses",
             "/v1/responses/input_tokens", "/v1/messages",
             "/v1/messages/count_tokens", "/v1/embeddings", "/classify", "/v1/classify", "/score", "/v1/score",
             "/rerank", "/v1/rerank", "/v2/rerank", "/tokenize", "/detokenize",
             "/v1/models", "/health", "/metrics",
             "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
ANTHROPIC = "/v1/messages"  # this path and those under it answer errors in Anthropic's shape


def anthropic_path(path: str) -> bool:
    return path == ANTHROPIC or path.startswith(ANTHROPIC + "/")


def create_app(engine: Engine, model_name: str = "mesh-transformer", api_key: Optional[str] = None,
               timeout: float = 300.0, max_request_bytes: int = 1 << 20, max_prompts: int = 64,
               chat_template: Optional[str] = None, runtime_lora: bool = False, tool_parser: Optional[str] = None,
               reasoning_parser: Optional[str] = None, responses_kept: int = responses_api.KEPT,
               embedding_pooling: str = "last", embedding_normalize: bool = True, labels: Optional[list[str]] = None):
    """The app over a started `engine`. `api_key` (or $MESH_TRANSFORMER_API_KEY) protects all but
    `OPEN_PATHS`; `chat_template`: Jinja source overriding the tokenizer's (see `chat`);
    `tool_parser`: how `tool_choice: "auto"` reads calls from the model's text (`tools.PARSERS`);
    `reasoning_parser`: how a reasoning model's thinking is told from its answer (`reasoning.PARSERS`);
    `responses_kept`: how many /v1/responses answers are kept for `previous_response_id` and GET;
    `embedding_pooling`, `embedding_normalize`: how /v1/embeddings makes a text's vector from the
    model's final hidden states (`evaluate.scoring.POOLINGS`; L2-normalised or not);
    `labels`: a classifier's class names for /classify (its checkpoint's id2label; default LABEL_i);
    `runtime_lora`: the routes that load and unload LoRA adapters (the engine's generator needs a
    bank: `Generator(adapters=...)`; they read directories on the server's disk, so the API key
    should be set wherever clients are not trusted)."""
    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse, JSONResponse, Response

    api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
    app = FastAPI(title="mesh-transformer", version="0.1.0", docs_url=None, redoc_url=None)
    app.add_middleware(_Guard, limit=max_request_bytes, api_key=api_key, metrics=engine.metrics)
    if tool_parser is not None and tool_parser not in tools_api.PARSERS:
        raise ValueError(f"tool_parser: one of {', '.join(tools_api.PARSERS)}, got {tool_parser!r}")
    if reasoning_parser is not None and reasoning_parser not in reasoning_api.PARSERS:
        raise ValueError(f"reasoning_parser: one of {', '.join(reasoning_api.PARSERS)}, got {reasoning_parser!r}")
    if tool_parser == "openai" and reasoning_parser != reasoning_api.HARMONY:
        raise ValueError(f"tool_parser 'openai' reads GPT-OSS's harmony messages, which the reasoning parser "
                         f"splits: start the server with reasoning_parser {reasoning_api.HARMONY!r} too "
                         f"(--reasoning-parser {reasoning_api.HARMONY})")
    if embedding_pooling not in POOLINGS:
        raise ValueError(f"embedding_pooling: one of {', '.join(POOLINGS)}, got {embedding_pooling!r}")
    config = engine.gen.config
    settings = oa.Settings(engine, model_name, timeout, max_prompts, ChatTemplate(engine.tokenizer, chat_template),
                           tool_parser, reasoning_parser, responses_api.Store(responses_kept),
                           embeddings_api.embedder(engine.gen, embedding_pooling, embedding_normalize),
                           classify_api.classifier(engine.gen) if config.classifier else None,
                           classify_api.label_names(config.num_labels, labels))
    created = int(time.time())
    if runtime_lora and engine.adapters is None:
        raise ValueError("runtime_lora needs a generator with a bank of adapter entries (Generator(adapters=...))")
    adapters = engine.adapters.names() if engine.adapters is not None else []
    if model_name in adapters:
        raise ValueError(f"adapter name {model_name!r} is the served model's name: a request naming it would get the base")
    page = (PAGE.read_text(encoding="utf-8").replace("{{MODEL}}", html.escape(model_name))
            .replace("{{MODEL_PANE}}", "" if adapters or runtime_lora else "hidden")
            .replace("{{KEY_REQUIRED}}", "true" if api_key else "false")
            .replace("{{CLASSIFIER}}", "true" if config.classifier else "false")
            .replace("{{LABELS}}", html.escape("\n".join(settings.labels)))
            .replace("{{MODEL_OPTIONS}}", "".join(f'<option value="{html.escape(m)}">{html.escape(m)}</option>'
                                                  for m in (model_name, *adapters)))
            .encode())

    def error(http, e: oa.ApiError):
        return messages_api.error_response(e) if anthropic_path(http.url.path) else JSONResponse(e.body(), e.status)

    @app.exception_handler(oa.ApiError)
    async def _api_error(http, e: oa.ApiError):
        return error(http, e)

    @app.exception_handler(404)
    async def _not_found(http, _):
        return error(http, oa.ApiError(404, f"no such endpoint: {http.method} {http.url.path}", "not_found_error"))

    @app.exception_handler(405)
    async def _wrong_method(http, _):
        return error(http, oa.ApiError(405, f"{http.url.path} does not take {http.method}"))

    @app.get("/", include_in_schema=False)
    async def playground():
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @app.get("/health")
    async def health():
        stats = engine.stats()
        return JSONResponse({"status": "draining" if stats["draining"] else "ok", **stats},
                            503 if stats["draining"] else 200)

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    def model_cards() -> list[dict]:
        """The served model, then its adapters (`parent`: the base), each in OpenAI's shape and
        Anthropic's (`type`, `display_name`, `created_at`), so either SDK reads them."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))
        base = {"id": model_name, "object": "model", "created": created, "owned_by": "mesh-transformer",
                "root": model_name, "parent": None, "max_model_len": engine.context,
                "type": "model", "display_name": model_name, "created_at": stamp, "lifecycle": "active",
                "max_input_tokens": engine.context}
        known = engine.adapters.names() if engine.adapters is not None else []
        return [base] + [{**base, "id": name, "display_name": name, "root": name, "parent": model_name}
                         for name in known]

    @app.get("/v1/models")
    async def models(http: HttpRequest):
        return {"object": "list", **model_page(model_cards(), http.query_params)}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        cards = model_cards()
        card = next((c for c in cards if c["id"] == model_id), None)
        if card is None:
            served = ", ".join(c["id"] for c in cards)
            raise oa.ApiError(404, f"model_id: the model {model_id!r} does not exist (served: {served})",
                              "not_found_error", param="model_id", code="model_not_found")
        return card

    posts = {"/complete": oa.complete, "/v1/completions": oa.completions,
             "/v1/chat/completions": chat_api.chat_completions, "/v1/responses": responses_api.create,
             "/v1/responses/input_tokens": responses_api.input_tokens,
             "/v1/messages": messages_api.create, "/v1/messages/count_tokens": messages_api.count_tokens,
             "/v1/embeddings": embeddings_api.create, "/classify": classify_api.create,
             "/v1/classify": classify_api.create, "/tokenize": tokens_api.tokenize, "/detokenize": tokens_api.detokenize,
             **{path: classify_api.score for path in ("/score", "/v1/score")},
             **{path: classify_api.rerank for path in ("/rerank", "/v1/rerank", "/v2/rerank")}}
    if config.classifier:
        posts.update({path: classify_api.refuse_generating(path, config.num_labels)
                      for path in classify_api.GENERATING})
    if runtime_lora:
        posts.update({"/v1/load_lora_adapter": oa.load_lora_adapter, "/v1/unload_lora_adapter": oa.unload_lora_adapter})
    for path, handler in posts.items():
        app.add_api_route(path, _handler(handler, settings), methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", _handler(responses_api.retrieve, settings), methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", _handler(responses_api.delete, settings), methods=["DELETE"])
    return app


def model_page(cards: list[dict], query) -> dict:
    """`cards` (all of them without `limit`, as OpenAI's list has them; Anthropic's default of 20 would
    only page a list this short), or one page of them by Anthropic's `limit` (1 to 1,000),
    `after_id` or `before_id` (the page that ends just before that id), with `first_id`, `last_id`
    and `has_more` (more past the page, in the direction read)."""
    ids = [c["id"] for c in cards]
    for name in ("after_id", "before_id"):
        if name in query and query[name] not in ids:
            raise oa.ApiError(400, f"{name}: no model {query[name]!r} (served: {', '.join(ids)})", param=name)
    if "after_id" in query and "before_id" in query:
        raise oa.ApiError(400, "after_id: give after_id or before_id, not both", param="after_id")
    limit = query.get("limit")
    if limit is None:
        limit = len(cards)
    elif not (limit.isascii() and limit.isdigit() and 1 <= int(limit) <= 1000):
        raise oa.ApiError(400, f"limit: a whole number from 1 to 1000, got {limit!r}", param="limit")
    limit = int(limit)
    if "before_id" in query:
        end = ids.index(query["before_id"])
        start = max(0, end - limit)
        more = start > 0
    else:
        start = ids.index(query["after_id"]) + 1 if "after_id" in query else 0
        end = min(len(cards), start + limit)
        more = end < len(cards)
    page = cards[start:end]
    return {"data": page, "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None,
            "has_more": more}


def _handler(handle, settings: oa.Settings):
    """A POST route's endpoint: `handle(settings, request)`."""
    async def endpoint(http: HttpRequest):
        return await handle(settings, http)
    return endpoint


class _Guard:
    """ASGI middleware: counts answers by status, refuses new work while draining (503), checks the
    API key (all paths but OPEN_PATHS), then a body-size limit (413) before parsing.

    Plain ASGI rather than BaseHTTPMiddleware, which does not pass streamed responses through cleanly.
    """

    def __init__(self, app, limit: int, api_key: Optional[str], metrics):
        self.app, self.limit, self.api_key, self.metrics = app, limit, api_key, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        kept = path.startswith("/v1/responses/")
        endpoint = (path if path in ENDPOINTS else KEPT_RESPONSE if kept
                    else MODEL_CARD if path.startswith("/v1/models/") else "other")

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.answered(endpoint, message["status"])
            await send(message)

        headers = dict(scope.get("headers") or [])
        if self.api_key and path not in OPEN_PATHS:
            given = headers.get(b"authorization", b"").decode("latin-1")
            given = given[7:] if given.lower().startswith("bearer ") else headers.get(b"x-api-key", b"").decode("latin-1")
            if not secrets.compare_digest(given.encode(), self.api_key.encode()):
                return await _send_error(counted, 401, "missing or wrong API key (Authorization: Bearer KEY, or "
                                         "x-api-key: KEY)", "authentication_error", path)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._refuse(counted, path)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                return await self._refuse(counted, path)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, counted)

    async def _refuse(self, send, path: str):
        await _send_error(send, 413, f"request body larger than {self.limit} bytes", path=path)


async def _send_error(send, status: int, message: str, kind: str = "invalid_request_error", path: str = "") -> None:
    """An error before the app: in Anthropic's shape on its paths, else in OpenAI's."""
    error = messages_api.error_body(status, message) if anthropic_path(path) else \
        {"error": {"message": message, "type": kind, "param": None, "code": None}}
    payload = json.dumps(error).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


# --------------------------------------------------------------------------------------------
# Running it: uvicorn, and a drain on SIGTERM
# --------------------------------------------------------------------------------------------

def run(app, engine: Engine, host: str = "127.0.0.1", port: int = 5000, drain_timeout: float = 30.0,
        sock=None) -> None:
    """Serve `app` until SIGTERM or SIGINT, then shut down gracefully: new requests get 503 while the
    queued and running ones finish, for at most `drain_timeout` seconds (then they are ended with
    an error saying the server is shutting down); then the server closes and this returns. A second
    signal skips the wait."""
    import uvicorn

    class Server(uvicorn.Server):
        draining = None

        def handle_exit(self, sig, frame):
            if self.draining is not None:  # the second signal: end what runs and stop now
                engine.abort("shutdown")
                self.should_exit = True
                return
            log.info("%s: draining (no new requests; up to %g s for %d queued and %d running sequences)",
                     signal.Signals(sig).name, drain_timeout, engine.stats()["queued"], engine.stats()["active"])
            self.draining = threading.Thread(target=self._drain, name="drain", daemon=True)
            self.draining.start()

        def _drain(self):
            engine.drain()
            deadline = time.monotonic() + drain_timeout
            while not engine.idle and time.monotonic() < deadline:
                time.sleep(0.05)
            if not engine.idle:
                log.warning("drain timeout (%g s): ending %s unfinished sequences", drain_timeout,
                            engine.stats()["queued"] + engine.stats()["active"])
                engine.abort("shutdown")
                end = time.monotonic() + 5
                while not engine.idle and time.monotonic() < end:
                    time.sleep(0.01)
            time.sleep(0.1)  # let handlers send their last bytes
            self.should_exit = True

    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=5, log_level="info")
    Server(config).run(sockets=[sock] if sock is not None else None)
