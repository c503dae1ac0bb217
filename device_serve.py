"""Serve a model over HTTP: the original `POST /complete` and an OpenAI-compatible `/v1/completions`.

    python device_serve.py --hf ./gpt-j-6b --mp 8 [--host 127.0.0.1] [--port 5000] [--api-key KEY]

See mesh_transformer/serve.py for the endpoints and the batching.
"""
import argparse
import logging
import sys

from mesh_transformer import cli, loading, serve


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    loading.add_model_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the server)")
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--max-batch", type=int, default=16, help="sequences decoded together on the device")
    parser.add_argument("--max-queue", type=int, default=100, help="waiting sequences before answering 503")
    parser.add_argument("--chunk", type=int, default=8, help="decode steps between admitting new requests")
    parser.add_argument("--slots", type=int, help="KV-cache slots per row (default: the model's context)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a request is answered 504")
    parser.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' (default: ${serve.API_KEY_ENV})")
    parser.add_argument("--max-request-bytes", type=int, default=1 << 20)
    parser.add_argument("--warmup", type=int, nargs="*", metavar="PROMPT_TOKENS",
                        help="compile prefill for every batch-size bucket at these prompt lengths (default 16) "
                             "and decode, before listening")
    parser.add_argument("--model-name", help="the id /v1/models reports (default: the weights' directory name)")
    args = parser.parse_args(argv)

    import uvicorn

    logging.basicConfig(level=logging.INFO)
    with cli.user_errors() as status:
        model = loading.from_args(args)
    if status.code:
        return status.code
    engine = serve.Engine(model.generator(), model.tokenizer,
                          max_batch=args.max_batch, slots=args.slots, chunk=args.chunk, max_queue=args.max_queue)
    if args.warmup is not None:
        engine.warmup(args.warmup or (16,))
    engine.start()
    app = serve.create_app(engine, model_name=args.model_name or model.name, api_key=args.api_key,
                           timeout=args.timeout, max_request_bytes=args.max_request_bytes)
    try:
        uvicorn.run(app, host=args.host, port=args.port)
    finally:
        engine.stop()


if __name__ == "__main__":
    sys.exit(main())
