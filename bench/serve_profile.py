"""Where a lone request's time goes, from the library's decode loop up to HTTP.

    python bench/serve_profile.py [--new 64] [--prompt-tokens 32] [--repeats 5] [--json]

One random GPT-J as in issue 13 (4 layers, d_model 512, vocabulary 50,400, fp32, one CPU device),
one greedy request of `--new` tokens, each layer measured on its own (median of `--repeats`):

  library    Generator.generate: one prefill, one compiled decode loop (batch and cache sized to the request)
  batch      the server's Batch (--max-batch rows, --slots cache slots), admit + steps of --chunk tokens
  engine     Engine.generate: the same through the engine thread and its queue
  http       device_serve.py's app in this process (uvicorn on loopback), non-streamed and streamed

and the batch layer's split: admission (prefill), decode calls, host work between calls; then the
time to first token (admission) of a prompt of `--shared-prefix` tokens every prompt shares plus
`--prompt-tokens` of its own, with the prefix cache on and off.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import sys
import tempfile
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import machine  # noqa: E402


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=8)
    parser.add_argument("--slots", type=int, default=None, help="cache slots per row (default: the context, 2048)")
    parser.add_argument("--shared-prefix", type=int, default=1000)
    machine.add_args(parser)
    args = parser.parse_args(argv)
    description = machine.describe()
    if not args.json:
        print(machine.header(description), flush=True)

    import httpx
    import uvicorn

    from decode import make_random
    from mesh_transformer import loading
    from mesh_transformer.generate import Batch, Generator, SamplingOptions
    from mesh_transformer.generate.prefix import PrefixCache, default_tokens
    from mesh_transformer.serve import Engine, create_app

    tmp = tempfile.TemporaryDirectory()
    make_random(tmp.name)
    model = loading.load(hf=tmp.name, mp=1, dp=1, dtype="float32")
    gen = Generator(model.config, model.params, model.mesh)
    prompt = list(range(1000, 1000 + args.prompt_tokens))
    options = SamplingOptions(max_new_tokens=args.new, temperature=0.0)
    rows = {}

    def library():
        [seq] = gen.generate([prompt], options)
        assert len(seq.tokens) == args.new
    library()
    rows["library (1 decode call)"] = median_time(library, args.repeats)

    batch = Batch(gen, args.max_batch, args.slots or model.config.seq, args.chunk)
    split = {"admit": [], "decode": [], "host": []}

    def batched():
        [seq] = gen.sequences([prompt], options)
        t = time.perf_counter()
        batch.admit([seq])
        split["admit"].append(time.perf_counter() - t)
        decode = host = 0.0
        while batch.active():
            t0 = time.perf_counter()
            # the device call alone, then Batch's bookkeeping (Sequence.extend, retire)
            state, out, done, reason, index = gen.decode(batch.state, batch.chunk, *batch._window())
            t1 = time.perf_counter()
            batch.state, batch.index = state, index
            batch._absorb(out, done, reason)
            decode, host = decode + t1 - t0, host + time.perf_counter() - t1
        split["decode"].append(decode)
        split["host"].append(host)
    for _ in range(2):
        batched()
    for v in split.values():
        v.clear()
    rows[f"batch ({args.max_batch} rows, chunk {args.chunk})"] = median_time(batched, args.repeats)

    engine = Engine(gen, model.tokenizer, max_batch=args.max_batch, slots=args.slots, chunk=args.chunk)
    engine.batch = batch  # compiled and warm
    engine.start()
    engine.generate(prompt, options)  # warm-up, as every other layer gets
    rows["engine (thread + queue)"] = median_time(lambda: engine.generate(prompt, options), args.repeats)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(engine, "random"), log_level="warning", lifespan="off"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions"
    body = {"prompt": prompt, "max_tokens": args.new, "temperature": 0, "ignore_eos": True}
    first = []

    with httpx.Client(timeout=120) as http:
        def plain():
            r = http.post(url, json=body)
            assert r.json()["usage"]["completion_tokens"] == args.new, r.text

        def streamed():
            t = time.perf_counter()
            seen = False
            with http.stream("POST", url, json={**body, "stream": True}) as r:
                for line in r.iter_lines():
                    if not seen and line.startswith("data: "):
                        first.append(time.perf_counter() - t)
                        seen = True
        plain()
        rows["http, non-streamed"] = median_time(plain, args.repeats)
        streamed()
        first.clear()
        rows["http, streamed"] = median_time(streamed, args.repeats)
        rows["http, max_tokens=1 (HTTP + admission)"] = median_time(
            lambda: http.post(url, json={**body, "max_tokens": 1}), args.repeats)
    server.should_exit = True
    engine.stop()

    slots = args.slots or model.config.seq
    shared = list(range(2000, 2000 + args.shared_prefix))
    fresh = iter(range(10_000, 50_000, args.prompt_tokens))
    first_token_s = {}
    for label, prefix in [("off", None), ("on", PrefixCache(gen, default_tokens(model.config, slots)))]:
        cached = Batch(gen, args.max_batch, slots, args.chunk, prefix)

        def first_token():
            start = next(fresh)
            [seq] = gen.sequences([shared + list(range(start, start + args.prompt_tokens))],
                                  SamplingOptions(max_new_tokens=1, temperature=0.0))
            cached.admit([seq])
            assert seq.finished
        for _ in range(2):  # compile; the first also stores the shared prefix
            first_token()
        first_token_s[label] = median_time(first_token, args.repeats)
    tmp.cleanup()

    results = {"request": {"prompt_tokens": args.prompt_tokens, "new_tokens": args.new, "repeats": args.repeats,
                           "max_batch": args.max_batch, "chunk": args.chunk, "shared_prefix": args.shared_prefix},
               "layers_s": rows, "batch_split_s": {k: statistics.median(v) for k, v in split.items()},
               "streamed_first_event_s": statistics.median(first), "first_token_s_prefix_cache": first_token_s}
    if args.json:
        machine.report(description, results, True)
    else:
        print_profile(results)


def print_profile(results: dict) -> None:
    """The text report, from the results alone: each layer's time for one request, the batch
    layer's split, first tokens."""
    req = results["request"]
    print(f"one greedy request: prompt {req['prompt_tokens']} tokens, {req['new_tokens']} new; random GPT-J 4x512, "
          f"vocab 50,400, fp32, {os.cpu_count()} CPU cores; median of {req['repeats']}")
    for name, t in results["layers_s"].items():
        print(f"  {name:45s} {t * 1e3:8.1f} ms  {req['new_tokens'] / t:7.1f} tok/s")
    med = results["batch_split_s"]
    print(f"  batch split: admission (prefill + first token) {med['admit'] * 1e3:.1f} ms, "
          f"{-(-(req['new_tokens'] - 1) // req['chunk'])} decode calls {med['decode'] * 1e3:.1f} ms, "
          f"host bookkeeping {med['host'] * 1e3:.1f} ms")
    print(f"  streamed: first event after {results['streamed_first_event_s'] * 1e3:.1f} ms")
    for label, t in results["first_token_s_prefix_cache"].items():
        print(f"  time to first token, {req['shared_prefix']}-token shared prefix + {req['prompt_tokens']} own, "
              f"prefix cache {label}: {t * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
