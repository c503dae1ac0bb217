"""Serve a model over HTTP: OpenAI-compatible `/v1/completions`, `/v1/chat/completions` and
`/v1/embeddings`, the original `POST /complete`, a playground page at `/`, Prometheus `/metrics`.

    python device_serve.py --hf ./gpt-j-6b --mp 8 [--host 127.0.0.1] [--port 5000] [--api-key KEY]

A sequence classifier or reward model (a `*ForSequenceClassification` checkpoint, or one trained
with the "reward" objective) is served for vLLM's `POST /classify`, `/score` and `/rerank` instead
of generation; so is a language model read through some of its tokens' logits
(`--classifier-from-tokens no yes`: a yes/no reranker such as Qwen3-Reranker, or a judge).

SIGTERM (or Ctrl-C) drains: new requests get 503, running ones finish (at most --drain-timeout
seconds), then the server exits 0. See mesh_transformer/serve/ for the endpoints and the batching.
"""
import argparse
import logging
import os
import pathlib
import sys

from mesh_transformer import cli, host_memory, loading, lora, serve
from mesh_transformer.config import ConfigError
from mesh_transformer.evaluate.scoring import POOLINGS
from mesh_transformer.io import hf
from mesh_transformer.serve import reasoning, responses, tools


def check_ranges(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """One error line naming the flag for a number, or a combination of flags, no server can run
    with (an out-of-range --port would otherwise be bound modulo 65,536, a port the log does not
    name); checked before anything loads."""
    if not 1 <= args.port <= 65535:
        parser.error(f"--port must be in [1, 65535]; got {args.port}")
    if args.chunk < 1 or args.join_chunk < 1:
        parser.error(f"--chunk and --join-chunk must be at least 1 decode step; got {args.chunk} and "
                     f"{args.join_chunk}")
    cli.check_at_least(parser, [
        ("--admit-tokens", args.admit_tokens, 1), ("--max-batch", args.max_batch, 1), ("--slots", args.slots, 1),
        ("--max-queue", args.max_queue, 0), ("--max-request-bytes", args.max_request_bytes, 1),
        ("--responses-kept", args.responses_kept, 0), ("--warmup-prefix", args.warmup_prefix, 0),
        ("--speculate-rows", args.speculate_rows, 1),
        *(("--warmup", n, 1) for n in args.warmup or ())])
    cli.check_speculate(parser, args)
    if args.speculate and args.batch_invariant:
        parser.error("--speculate and --batch-invariant exclude each other: a request's passes, and so its "
                     "rounding, would depend on whether it ran alone and on its drafts")
    if args.tool_call_parser == "openai" and args.reasoning_parser != reasoning.HARMONY:
        parser.error(f"--tool-call-parser openai reads GPT-OSS's harmony messages, which the reasoning parser splits: "
                     f"add --reasoning-parser {reasoning.HARMONY}")
    if args.gather_ms < 0:
        parser.error(f"--gather-ms must be at least 0; got {args.gather_ms:g}")
    if not args.timeout > 0 or not args.drain_timeout >= 0:
        parser.error(f"--timeout must be above 0 and --drain-timeout at least 0 seconds; got {args.timeout:g} and "
                     f"{args.drain_timeout:g}")
    if args.prefix_block < 1 or not (args.prefix_cache_tokens is None or args.prefix_cache_tokens == 0
                                     or args.prefix_cache_tokens >= args.prefix_block):
        parser.error(f"--prefix-cache-tokens must be 0 (off) or at least --prefix-block ({args.prefix_block}), "
                     f"and --prefix-block at least 1; got {args.prefix_cache_tokens} and {args.prefix_block}")
    for flag, value in (("--max-loras", args.max_loras), ("--max-lora-rank", args.max_lora_rank),
                        ("--max-cpu-loras", args.max_cpu_loras)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be at least 1; got {value}")
        if value is not None and not (args.lora_modules or args.enable_runtime_lora):
            parser.error(f"{flag} sizes the bank of served LoRA adapters: pass --lora-modules or --enable-runtime-lora")
    entries = args.max_loras or len(args.lora_modules) or 1  # the bank's (see main's `slots`)
    if args.max_cpu_loras is not None and args.max_cpu_loras < entries:
        parser.error(f"--max-cpu-loras ({args.max_cpu_loras}) must be at least the bank's entries, --max-loras "
                     f"({entries}{'' if args.max_loras else '; default: one per --lora-modules adapter'}): the "
                     f"adapters in them are held in host memory too")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    loading.add_model_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the server)")
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--max-batch", type=int, default=16, help="sequences decoded together on the device")
    parser.add_argument("--max-queue", type=int, default=100, help="waiting sequences before answering 503")
    parser.add_argument("--chunk", type=int, default=8, help="decode steps between admitting new requests")
    parser.add_argument("--join-chunk", type=int, default=1,
                        help="decode steps of the call right after requests joined or finished (requests arrive in "
                             "bursts: the rest of one waits this long to be admitted, not a whole --chunk)")
    parser.add_argument("--admit-tokens", type=int, default=4096, metavar="N",
                        help="prompt positions one admission (prefill) computes at most: a burst of requests joins in "
                             "groups of about N tokens, each decoding while the next is prefilled (vLLM's "
                             "--max-num-batched-tokens plays this part); a longer prompt is admitted alone")
    parser.add_argument("--gather-ms", type=float, default=serve.DEFAULT_GATHER * 1000, metavar="MS",
                        help="when no request is running, how long new ones may wait for the rest of their burst "
                             "(as many as the last decode call finished, or others arriving right behind them: "
                             "clients finishing together send their next requests together): a burst is admitted "
                             "as one prefill, not as whoever came first and then the rest; 0 disables")
    parser.add_argument("--slots", type=int, help="KV-cache slots per row (default: the model's context)")
    parser.add_argument("--prefix-cache-tokens", type=int, metavar="N",
                        help="keys/values of up to N prompt tokens kept for reuse by prompts that start the same "
                             "way, least recently used evicted first; 0 disables (default: what fits in "
                             "512 MiB, at most 16 contexts; see mesh_transformer/generate/prefix.py)")
    parser.add_argument("--prefix-block", type=int, default=16,
                        help="tokens per prefix-cache block: prompts share cached keys/values in whole blocks")
    parser.add_argument("--no-prefix-sharing", action="store_true",
                        help="copy a prompt's cached keys/values into its row instead of every row behind the same "
                             "prefix reading them from the cache once per step between them (the default)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="decode all --max-batch rows at every step, so a request's tokens are bit-identical "
                             "whatever else runs (default: only the rows in use, faster when few run; float "
                             "rounding then depends on how many run)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a request is answered 504")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="on SIGTERM, seconds to let running requests finish before exiting")
    parser.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' (default: ${serve.API_KEY_ENV})")
    parser.add_argument("--max-request-bytes", type=int, default=1 << 20)
    parser.add_argument("--chat-template", metavar="FILE",
                        help="Jinja chat template for /v1/chat/completions (default: the tokenizer's, else a "
                             "plain 'Role: content' template; see mesh_transformer/serve/chat.py)")
    parser.add_argument("--tool-call-parser", choices=sorted(tools.PARSERS),
                        help="read tool calls from the model's text under tool_choice \"auto\" (vLLM's names): hermes "
                             "(Qwen 2.5/3, Hermes), llama3_json (Llama 3.1+), mistral; without it, \"auto\" is a 400 "
                             "(\"required\" and named tool choices need no parser)")
    parser.add_argument("--reasoning-parser", choices=reasoning.PARSERS,
                        help="return a reasoning model's <think> block as the chat message's reasoning (vLLM's names): "
                             "deepseek_r1 (R1 and its distills), qwen3 (Qwen 3, QwQ)")
    parser.add_argument("--responses-kept", type=int, default=responses.KEPT, metavar="N",
                        help="/v1/responses answers kept in memory for previous_response_id and GET "
                             "/v1/responses/{id} (the newest N; 0: none)")
    parser.add_argument("--embedding-pooling", choices=list(POOLINGS),
                        help="how POST /v1/embeddings makes a text's vector from the model's final hidden states "
                             "(default: what a sentence-transformers directory's modules.json declares, else last): "
                             + "; ".join(f"{k}: {v}" for k, v in POOLINGS.items()))
    parser.add_argument("--embedding-normalize", action=argparse.BooleanOptionalAction,
                        help="POST /v1/embeddings answers L2-normalised vectors (default: on, or as a "
                             "sentence-transformers directory declares: a Normalize module)")
    parser.add_argument("--classifier-from-tokens", nargs="+", metavar="TOKEN",
                        help="serve the language model as a classifier of these tokens' logits at the last token "
                             "(vLLM's classifier_from_token), for /classify, /score and /rerank: two tokens make one "
                             "label, the second's logit minus the first's (its sigmoid: the second's probability "
                             "among the two, as Qwen3-Reranker reads 'no' and 'yes'); more make a label each. Each "
                             "must be one token of the tokenizer")
    parser.add_argument("--warmup", type=int, nargs="*", metavar="PROMPT_TOKENS",
                        help="compile prefill for every batch-size bucket at these prompt lengths (default 16) "
                             "and decode, before listening")
    parser.add_argument("--warmup-prefix", type=int, default=0, metavar="TOKENS",
                        help="with --warmup, also compile the prefill of prompts behind a TOKENS-long prefix already "
                             "in the prefix cache (a system prompt or few-shot examples every request repeats)")
    parser.add_argument("--model-name", help="the id /v1/models reports (default: the weights' directory name)")
    parser.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                        help="PEFT LoRA adapters served beside the base, unmerged: a request whose model is NAME runs "
                             "with the adapter in PATH, and one batch decodes rows of every adapter together "
                             "(vLLM's flag; --lora-adapter instead merges one adapter into the weights)")
    parser.add_argument("--max-loras", type=int, metavar="N",
                        help="LoRA adapters one batch holds at once: the bank's entries (default: one for each of "
                             "--lora-modules, 1 with --enable-runtime-lora and none named). More adapters than that "
                             "may be known: a request's adapter takes an idle entry when it is admitted (vLLM's flag)")
    parser.add_argument("--max-cpu-loras", type=int, metavar="N",
                        help="LoRA adapters whose weights stay in host memory, at least --max-loras (default: all "
                             "known). The least recently requested are dropped and read from their directories again "
                             "when a request names them (vLLM's flag)")
    parser.add_argument("--max-lora-rank", type=int, metavar="R",
                        help="the largest rank an adapter may have (default: the largest of --lora-modules', and "
                             f"at least {lora.DEFAULT_SERVED_RANK} with --enable-runtime-lora; vLLM's flag)")
    parser.add_argument("--enable-runtime-lora", action="store_true",
                        default=os.environ.get(serve.RUNTIME_LORA_ENV, "").lower() in ("1", "true"),
                        help="serve POST /v1/load_lora_adapter {lora_name, lora_path} and /v1/unload_lora_adapter "
                             "{lora_name} (vLLM's API; also on with vLLM's $" + serve.RUNTIME_LORA_ENV + "=True). The paths are "
                             "read on this machine: set --api-key where clients are not trusted. The bank then "
                             "holds every linear layer but the head, so later adapters may adapt any of those")
    cli.add_speculate_args(parser).add_argument(
        "--speculate-rows", type=int, default=1, metavar="N",
        help="draft in decode calls while at most N rows run (default: 1, a request alone): the rows share "
             "the cache's write index, so a pass keeps as many tokens as the row that kept the fewest, while "
             "each row's drafts cost compute")
    args = parser.parse_args(argv)
    check_ranges(parser, args)
    host_memory.keep_freed_memory()

    import jax
    import uvicorn  # noqa: F401  (fail before loading weights if the server's dependencies are missing)

    logging.basicConfig(level=logging.INFO)
    if args.dtype is None and jax.default_backend() == "cpu":
        args.dtype = "float32"  # XLA:CPU runs 16-bit matmuls through slow paths (README, "Decode")
    with cli.user_errors(OSError) as status:
        adapters = lora.parse_named(args.lora_modules, "--lora-modules")
        if adapters and args.lora_adapter:
            raise ConfigError("--lora-adapter merges an adapter into the base and --lora-modules serves adapters "
                              "made for the base: pass one (merge first with to_hf_weights.py to serve both)")
        for name, path in adapters:  # what can be checked before the base loads (minutes for a big one)
            try:
                rank = lora.peft_config(path).get("r")
            except ConfigError as e:
                raise ConfigError(f"--lora-modules {name}={path}: {e}") from None
            if args.max_lora_rank and isinstance(rank, int) and rank > args.max_lora_rank:
                raise ConfigError(f"--lora-modules {name}={path}: rank {rank} is above --max-lora-rank "
                                  f"{args.max_lora_rank}")
        embeddings = embedding_settings(args)  # before the weights load: a bad modules.json fails at once
        model = loading.from_args(args)
        labels = model.as_token_classifier(args.classifier_from_tokens) if args.classifier_from_tokens else None
        model_name = args.model_name or model.name
        if model_name in {name for name, _ in adapters}:
            raise ConfigError(f"--lora-modules: adapter name {model_name!r} is the base model's name (see --model-name)")
        runtime = args.enable_runtime_lora
        slots = args.max_loras or (1 if runtime and not adapters else None)
        generator = model.generator(adapters=adapters, slots=slots, rank=args.max_lora_rank, every_linear=runtime,
                                    host=args.max_cpu_loras, speculate=args.speculate, lookup_ngram=args.lookup_ngram,
                                    speculate_rows=args.speculate_rows)
        chat_template = pathlib.Path(args.chat_template).read_text(encoding="utf-8") if args.chat_template else None
        if labels is None and model.config.classifier:  # its config's names (a HF checkpoint's id2label)
            labels = model.config.label_names
    if status.code:
        return status.code
    engine = serve.Engine(generator, model.tokenizer,
                          max_batch=args.max_batch, slots=args.slots, chunk=args.chunk, join_chunk=args.join_chunk,
                          admit_tokens=args.admit_tokens, gather=args.gather_ms / 1000,
                          max_queue=args.max_queue,
                          prefix_cache_tokens=args.prefix_cache_tokens, prefix_block=args.prefix_block,
                          batch_invariant=args.batch_invariant, share_prefix=not args.no_prefix_sharing,
                          host_adapters=args.max_cpu_loras, eos_token_ids=model.eos_token_ids)
    model.params = None  # the Generator holds its own copy
    if args.warmup is not None:
        engine.warmup(args.warmup or (16,), shared_prefix=args.warmup_prefix)
    engine.start()
    app = serve.create_app(engine, model_name=model_name, api_key=args.api_key,
                           timeout=args.timeout, max_request_bytes=args.max_request_bytes,
                           chat_template=chat_template, runtime_lora=args.enable_runtime_lora,
                           tool_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                           responses_kept=args.responses_kept, labels=labels, **embeddings)
    try:
        serve.run(app, engine, host=args.host, port=args.port, drain_timeout=args.drain_timeout)
    finally:
        engine.stop()
    return 0


def embedding_settings(args) -> dict:
    """create_app's embedding_pooling and embedding_normalize: the flags, else what an --hf
    sentence-transformers directory declares (`hf.embedding_pooling`; a pooling it declares that
    this library does not run is a ConfigError unless --embedding-pooling chooses one), else the
    last token's state, normalised."""
    declared = None
    if args.hf and (args.embedding_pooling is None or args.embedding_normalize is None):
        try:
            declared = hf.embedding_pooling(args.hf)
        except ConfigError:
            if args.embedding_pooling is None:
                raise
    pooling, normalize = declared or ("last", True)
    pooling = args.embedding_pooling or pooling
    normalize = normalize if args.embedding_normalize is None else args.embedding_normalize
    logging.getLogger("mesh_transformer.serve").info(
        "embeddings: %s pooling, %s%s", pooling, "normalised" if normalize else "not normalised",
        " (as the model's modules.json declares)" if declared else "")
    return {"embedding_pooling": pooling, "embedding_normalize": normalize}


if __name__ == "__main__":
    sys.exit(main())
