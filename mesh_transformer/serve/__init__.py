"""HTTP serving: an engine thread that batches requests onto the device, and a FastAPI app.

    engine = Engine(Generator(config, params, mesh), tokenizer, max_batch=16).start()
    app = create_app(engine, model_name="gpt-j-6b")
    run(app, engine, port=5000, drain_timeout=30)          # uvicorn; SIGTERM drains, then returns

Files: `engine` (dynamic batching on the device), `openai` (OpenAI's shapes: /v1/completions,
the original /complete, errors, streaming), `chat` (/v1/chat/completions over `io.chat_template`),
`responses` (/v1/responses, OpenAI's Responses API, over `chat`), `tools` (tool calls), `reasoning`
(thinking apart from answers), `embeddings` (/v1/embeddings: pooled hidden states, `evaluate.scoring`),
`classify` (/classify: a sequence classifier's or reward model's scores), `passes` (the forward
passes those two share between requests), `metrics` (Prometheus), `app` (routes, API key and size limits, graceful shutdown), `adapters`
(the LoRA adapters known by name and the bank entries they take), `page.html` (the playground at GET /).
"""
from mesh_transformer.io.chat_template import PLAIN_TEMPLATE, ChatTemplate
from mesh_transformer.serve.app import API_KEY_ENV, RUNTIME_LORA_ENV, create_app, run
from mesh_transformer.serve.engine import DEFAULT_GATHER, Draining, Engine, QueueFull, Request
from mesh_transformer.serve.metrics import Metrics
from mesh_transformer.serve.openai import ApiError

__all__ = ["API_KEY_ENV", "ApiError", "ChatTemplate", "DEFAULT_GATHER", "Draining", "Engine", "Metrics",
           "PLAIN_TEMPLATE", "QueueFull", "RUNTIME_LORA_ENV", "Request", "create_app", "run"]
