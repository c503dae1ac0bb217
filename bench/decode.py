"""Decode speed: our Generator vs transformers' `generate` (torch, KV cache on), same weights, same run.

    python bench/decode.py                                   # random 200M-parameter GPT-J (8 x d_model 1024), CPU
    python bench/decode.py --family llama                    # the same size, LLaMA-shaped (bench/families.py)
    python bench/decode.py --hf ./gpt-j-6b --batches 1 16 --dtypes bfloat16 --new 128
    python bench/decode.py --server-batch 64 2048 8 --batches 16 64 --no-hf   # as device_serve.py decodes

Prints the machine's memory bandwidth (every core at once, copying and reading), and for batch 1
the memory-bandwidth bound on decode (every step reads every weight but the embedding table once:
those bytes / the higher bandwidth) with our share of it. The bandwidth is measured before and after every
configuration and the highest value is used (a shared machine's bandwidth varies from minute to
minute; the highest gives the strictest bound). At batch 1 a third side joins the rounds: reading
as many bytes as a decode run does (`sustained_read`), the bound under the same conditions and over
the same duration as each decode, and our share of its median. Decode time excludes the prompt: ours is timed
around the compiled decode loop alone (after a warm-up run that compiles it); transformers' is
generate(new tokens) - generate(1 token). Ours and transformers run in turn, --repeats rounds per
configuration (ours, transformers, ours, ...); each reports the median and min-max of its rounds.
The machine, software and load come first (bench/machine.py); --json prints everything as one JSON
object.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import mmap
import os
import sys
import tempfile
import time
from typing import Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import families  # noqa: E402
import machine  # noqa: E402


def memory_bandwidth(mbytes: int = 512, repeats: int = 5) -> dict:
    """GB/s of large passes over memory on every core at once, best of `repeats`: "copy" is numpy
    copies on a thread per core, each over its slice (numpy releases the GIL), counting bytes read +
    written; "read" is torch's sum of the same array on its threads, one per core (numpy's float64
    sum held the GIL here: 24 GB/s on one thread and on two). Decode only reads its weights, and
    which of the two runs faster differs from day to day on these VMs (session 37: read 39, copy 45
    GB/s; session 40: read 27-44, copy 27-40), so the bound takes the higher.

    Every core, because decode reads its weights with all of XLA's threads: on the AVX-512 EPYC a
    single thread's copy ran at 40 GB/s and two threads' at 70, and the one-thread figure made
    decode look 150% of its bound. The arrays are anonymous memory maps, as malloc gives large
    blocks by default: with the library's malloc setting (`host_memory`, which this script applies)
    numpy's arrays would come from the heap, where the same copy runs at a third of the speed on
    the AVX2 EPYC (9.4 vs 30 GB/s, 4 KiB pages), and the bound would understate the machine."""
    threads = len(os.sched_getaffinity(0))
    size = mbytes * 2**20 // (8 * threads) * (8 * threads)
    src, dst = (np.frombuffer(mmap.mmap(-1, size), np.float64) for _ in range(2))
    src[:] = 1.0
    dst[:] = 0.0
    step = len(src) // threads
    parts = [slice(i * step, (i + 1) * step) for i in range(threads)]
    import torch
    whole = torch.from_numpy(src)
    passes = {"copy": (lambda pool: list(pool.map(lambda part: np.copyto(dst[part], src[part]), parts)), 2),
              "read": (lambda pool: whole.sum(), 1)}
    rates = {}
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for kind, (one_pass, times_read) in passes.items():
            best = float("inf")
            for _ in range(repeats):
                t = time.perf_counter()
                one_pass(pool)
                best = min(best, time.perf_counter() - t)
            rates[kind] = times_read * src.nbytes / best / 1e9
    return rates


def sustained_read(step_bytes: int, steps: int, mbytes: int = 512):
    """-> a callable reading `step_bytes` x `steps` bytes (torch's sum of a `mbytes` array on every
    core, as many whole passes as it takes), returning the decode rate such reading would allow:
    tokens/s at one row, if each step read `step_bytes` at this speed and did nothing else. It runs
    as a side of the same interleaved rounds as the decode, for about as long as one decode run,
    so the bound it gives is measured over the same minutes and the same duration; the best
    short pass of `memory_bandwidth` catches the machine's bursts (on these VMs 27-48 GB/s
    within minutes) and so sets a bound above what any sustained reading reaches."""
    import torch
    whole = torch.from_numpy(np.frombuffer(mmap.mmap(-1, mbytes * 2**20), np.float32))
    whole.fill_(1.0)
    passes = max(1, round(step_bytes * steps / whole.nbytes))

    def measure() -> float:
        t = time.perf_counter()
        for _ in range(passes):
            whole.sum()
        return passes * whole.nbytes / step_bytes / (time.perf_counter() - t)
    return measure


GPT2_EOS = 50256  # <|endoftext|>: the random models use the GPT-2 tokenizer


def make_random(path, family="gptj", layers=4, d_model=512, heads=8, vocab=50400, seq=2048, seed=0, window=None):
    """Save a random `family` model (GPT-2 tokenizer sized vocabulary; the family's shape, see
    bench/families.py; `window`: a sliding window, Mistral) to `path`; return the torch model."""
    from mesh_transformer.config import config_from_dict

    config = config_from_dict({"family": family, "layers": layers, "d_model": d_model, "n_heads": heads,
                               "n_vocab": vocab, "seq": seq, **families.family_keys(family, d_model, heads, layers),
                               **({"sliding_window": window} if window else {})})
    model = families.hf_model(config.model, seed).eval()
    for c in (model.config, model.generation_config):
        c.bos_token_id = c.eos_token_id = GPT2_EOS
    model.save_pretrained(path)
    return model


MATVEC_ROWS = 1  # up to this batch Generator(matvec=True), as device_sample.py; beyond, the default layout


def bench_ours(model, batch: int, prompt_len: int, new: int, server: Optional[tuple[int, int, int]] = None,
               prefix_cache: bool = False, sampling: Optional[dict] = None, quantize: Optional[str] = None,
               shared_prefix: int = 0, fuse: bool = True, speculate: int = 0, lookup_ngram: int = 3, prompt=None,
               outputs: Optional[list] = None):
    """Compile, then -> (a callable decoding once: decode tokens/s, details of the calls so far).

    `server` (rows, slots, chunk): decode as device_serve.py does, the `batch` sequences in the
    first rows of a batch of `rows` rows and `slots` cache slots, `chunk` steps per call (each call
    reads and writes a window of the cache), instead of one call over a cache sized to them;
    `prefix_cache`: with device_serve.py's default prefix cache (each admission stores its prompts'
    full blocks there; the prompts are random, so none is found); `shared_prefix` (with it): every
    prompt starts with the same this many tokens, cached by one request decoded before each timed
    admission, as a server holds a system prompt (the admission reads them from the pool);
    `sampling`: SamplingOptions' temperature, top_k, top_p, min_p (default greedy); `quantize`:
    Generator(quantize=...); `fuse`: Generator(fuse=...); `speculate`, `lookup_ngram`: Generator's (the
    details' `tokens_per_pass`: decode tokens over passes of the model); `prompt`: every row's prompt
    (default: random tokens, new ones each run); `outputs`: a list each run's tokens are appended to."""
    import jax

    from mesh_transformer import kernels
    from mesh_transformer.generate import Batch, Generator, SamplingOptions
    from mesh_transformer.generate.prefix import PrefixCache, default_tokens

    matvec = True if batch <= MATVEC_ROWS and server is None else None
    gen = Generator(model.config, model.params, model.mesh, matvec=matvec, quantize=quantize, fuse=fuse,
                    speculate=speculate, lookup_ngram=lookup_ngram)
    rng = np.random.RandomState(0)
    options = SamplingOptions(max_new_tokens=new, **(sampling or {"temperature": 0.0}))
    prefix = PrefixCache(gen, default_tokens(gen.config, server[1])) if server and prefix_cache else None
    shared = rng.randint(0, 50000, shared_prefix if prefix is not None else 0).tolist()
    prompts = lambda n: ([list(prompt)] * n if prompt is not None else  # noqa: E731
                         [shared + p for p in rng.randint(0, 50000, (n, prompt_len)).tolist()])

    def once():
        seqs = gen.sequences(prompts(batch), options)
        if prefix is not None:
            prefix.clear()
        b = Batch(gen, *server, prefix=prefix) if server else Batch.for_sequences(gen, seqs, chunk=None)
        if shared:  # the shared prefix cached by an earlier request, as in a server
            b.admit(gen.sequences(prompts(1), options))
            while b.active():
                b.step()
        jax.block_until_ready(b.state)
        t0 = time.perf_counter()
        b.admit(seqs)
        t1 = time.perf_counter()
        passes = gen.row_passes
        while b.active():
            b.step()  # without `server`, the whole decode loop: one compiled call
        t2 = time.perf_counter()
        assert all(len(s.tokens) == new for s in seqs)
        details["tokens_per_pass"] = batch * (new - 1) / (gen.row_passes - passes)
        if outputs is not None:
            outputs.append([s.tokens for s in seqs])
        return t1 - t0, t2 - t1

    details = {}

    once()  # compile
    details.update({"weights": "inputs-last" if gen.inputs_last else "inputs-first", "fused": gen.layout.fused,
               "kernels": kernels.available(),
               "quantize": quantize, "weight_bytes": gen.weight_bytes,
               "server_batch": server, "prefix_cache": prefix is not None, "shared_prefix": len(shared),
               "speculate": speculate, "prefill_ms": []})

    def measure() -> float:
        prefill_s, decode_s = once()
        details["prefill_ms"].append(prefill_s * 1e3)
        return batch * (new - 1) / decode_s
    return measure, details


def quantization_agreement(model, quantize: str, prompts: int = 64, prompt_len: int = 32, new: int = 16) -> dict:
    """How close `quantize`d decoding stays to the unquantized model in the same compute dtype:
    greedy continuations of the same random prompts, the share of first tokens and of whole
    `new`-token continuations that agree, and the mean |difference| of the first token's log p
    where they agree (the model's `generate`, each side its own Generator)."""
    from mesh_transformer.generate import Generator, SamplingOptions
    tokens = np.random.RandomState(1).randint(0, 50000, (prompts, prompt_len)).tolist()
    options = SamplingOptions(max_new_tokens=new, temperature=0.0, logprobs=0)
    outs = [Generator(model.config, model.params, model.mesh, quantize=q).generate(tokens, options)
            for q in (None, quantize)]
    same_first = [a.tokens[0] == b.tokens[0] for a, b in zip(*outs)]
    gaps = [abs(a.logprobs[0] - b.logprobs[0]) for (a, b), same in zip(zip(*outs), same_first) if same]
    return {"first_token_agreement": float(np.mean(same_first)),
            "continuation_agreement": float(np.mean([a.tokens == b.tokens for a, b in zip(*outs)])),
            "mean_abs_first_logprob_diff": float(np.mean(gaps)) if gaps else None}


def bench_hf(torch_model, batch: int, prompt_len: int, new: int, dtype: str, sampling: Optional[dict] = None,
             lookup: Optional[tuple[int, int]] = None, prompt=None, outputs: Optional[list] = None):
    """-> a callable timing transformers' decode once (generate(new) - generate(1)): decode tokens/s.
    `sampling` as bench_ours' (transformers' top_k 0 and top_p 1 filter nothing, as ours; min_p None);
    `lookup` (tokens, n-gram): its prompt lookup decoding (`prompt_lookup_num_tokens`,
    `max_matching_ngram_size`; batch 1); `prompt`: every row's prompt (default: random tokens);
    `outputs`: a list each run's new tokens are appended to."""
    import torch

    model = torch_model.to(getattr(torch, dtype))
    tokens = (torch.tensor([list(prompt)] * batch) if prompt is not None else
              torch.randint(0, 50000, (batch, prompt_len), generator=torch.Generator().manual_seed(0)))
    sampled = sampling is not None and sampling.get("temperature", 1.0) > 0
    how = ({"do_sample": False} if not sampled else
           {"do_sample": True, **sampling, "min_p": sampling.get("min_p") or None})
    if lookup:
        how.update(prompt_lookup_num_tokens=lookup[0], max_matching_ngram_size=lookup[1])

    def run(n):
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(tokens, attention_mask=torch.ones_like(tokens), use_cache=True,
                                 max_new_tokens=n, min_new_tokens=n, pad_token_id=0, **how)
        assert out.shape[1] == tokens.shape[1] + n
        if outputs is not None and n == new:
            outputs.append(out[:, tokens.shape[1]:].tolist())
        return time.perf_counter() - t

    run(2)
    return lambda: batch * (new - 1) / (run(new) - run(1))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf", help="a HF model directory (default: a random model, see --family/--layers/--d-model)")
    families.add_arg(parser)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--window", type=int, help="a sliding window of this many tokens (--family llama: "
                        "Mistral's attention, transformers runs MistralForCausalLM; --family phi3; --family gemma: its "
                        "sliding layers' window)")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--new", type=int, default=64, help="new tokens per sequence")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds of ours and transformers")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")
    parser.add_argument("--server-batch", type=int, nargs=3, metavar=("ROWS", "SLOTS", "CHUNK"),
                        help="ours decodes as device_serve.py does: in the first rows of a ROWS-row batch of "
                             "SLOTS cache slots, CHUNK steps per call (--max-batch, the context, --chunk)")
    parser.add_argument("--prefix-cache", action="store_true",
                        help="with --server-batch: the batch has device_serve.py's default prefix cache, where each "
                             "admission stores its prompts")
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="with --prefix-cache: every prompt starts with the same this many tokens, cached "
                             "before each timed admission (the prefill reads them from the pool)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (both sides)")
    parser.add_argument("--top-k", type=int, default=0, help="with --temperature: keep the k most likely (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="with --temperature: keep the nucleus of this mass")
    parser.add_argument("--min-p", type=float, default=0.0,
                        help="with --temperature: drop tokens less likely than this x the most likely (0: none)")
    parser.add_argument("--quantize", choices=("int8",),
                        help="ours decodes with int8 weights (Generator(quantize=...)); transformers keeps --dtypes'")
    parser.add_argument("--fuse", choices=("on", "off"), default="on",
                        help="ours stores each layer's q/k/v (and gate/up) as one weight (Generator(fuse=...))")
    parser.add_argument("--out", help="also write the JSON object here")
    machine.add_args(parser)
    parser.add_argument("--mp", type=int, default=1,
                        help="split the model over this many (simulated CPU) devices")
    args = parser.parse_args(argv)
    if args.window and (args.family not in ("llama", "phi3", "gemma") or args.hf):
        parser.error("--window needs --family llama, phi3 or gemma (and a random model, not --hf)")
    if args.shared_prefix and not (args.server_batch and args.prefix_cache):
        parser.error("--shared-prefix needs --server-batch and --prefix-cache (the prefix is read from the cache)")
    from mesh_transformer import host_memory
    host_memory.keep_freed_memory()  # as device_sample.py does; the in-process transformers side gets it too
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.mp}"
    description = machine.describe()
    if not args.json:
        print(machine.header(description), flush=True)

    import jax
    import torch
    from transformers import AutoModelForCausalLM

    from mesh_transformer import loading, parallel

    first = memory_bandwidth()
    bandwidths = [max(first.values())]
    log = (lambda *a, **k: None) if args.json else print
    log(f"devices: {jax.devices()}  torch threads: {torch.get_num_threads()}")
    log(f"memory bandwidth, every core: copy (read + write) {first['copy']:.1f} GB/s, read {first['read']:.1f} GB/s")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.hf or tmp
        torch_model = (AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval() if args.hf
                       else make_random(tmp, args.family, args.layers, args.d_model, args.heads, window=args.window))
        results = []
        sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p}
        for dtype in args.dtypes:
            model = loading.load(hf=path, mp=args.mp, dp=1, dtype=dtype)
            if args.quantize:
                agreement = quantization_agreement(model, args.quantize)
                results.append({"dtype": dtype, "quantize": args.quantize, "agreement": agreement})
                log(f"{dtype:>9} {args.quantize} against {dtype} weights, 64 greedy prompts: first tokens "
                    f"{agreement['first_token_agreement']:.0%} equal, 16-token continuations "
                    f"{agreement['continuation_agreement']:.0%}, first-token log p within "
                    f"{agreement['mean_abs_first_logprob_diff']:.4f} (mean |diff|)", flush=True)
            for batch in args.batches:
                ours, details = bench_ours(model, batch, args.prompt, args.new, args.server_batch, args.prefix_cache,
                                           sampling, args.quantize, args.shared_prefix, args.fuse == "on")
                weight_bytes = details["weight_bytes"]
                sides = {"ours": ours}
                if not args.no_hf:
                    sides["hf"] = bench_hf(torch_model, batch, args.prompt, args.new, dtype, sampling)
                if batch == 1:
                    sides["read"] = sustained_read(weight_bytes, args.new - 1)
                rates = machine.interleaved(sides, args.repeats)
                bandwidths.append(max(memory_bandwidth().values()))
                row = {"dtype": dtype, "batch": batch, "weight_GB": weight_bytes / 1e9, "sampling": sampling,
                       "ours": {**details, "decode_tok_s": rates["ours"]["median"], "rounds": rates["ours"]}}
                if "hf" in rates:
                    row["hf"] = {"decode_tok_s": rates["hf"]["median"], "rounds": rates["hf"]}
                if batch == 1:
                    row["bandwidth_GBps"] = max(bandwidths)
                    row["bound_tok_s"] = max(bandwidths) * 1e9 / weight_bytes
                    row["ours_pct_of_bound"] = 100 * row["ours"]["decode_tok_s"] / row["bound_tok_s"]
                    row["sustained_read"] = {"tok_s": rates["read"]["median"], "rounds": rates["read"],
                                             "GBps": rates["read"]["median"] * weight_bytes / 1e9}
                    row["ours_pct_of_sustained"] = 100 * row["ours"]["decode_tok_s"] / rates["read"]["median"]
                results.append(row)
                log(format_row(row), flush=True)
            del model
    report = {"bandwidth_GBps": max(bandwidths), "rows": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**description, "results": report}, f, indent=2)
    if args.json:
        machine.report(description, report, True)


def format_row(row) -> str:
    kernel = ", kernels" if row["ours"].get("kernels") else ""
    kernel += ", int8 weights" if row["ours"].get("quantize") == "int8" else ""
    if row["ours"].get("server_batch"):
        kernel += ", in a {}-row x {}-slot batch, {}-step calls".format(*row["ours"]["server_batch"])
        kernel += ", prefix cache" if row["ours"].get("prefix_cache") else ""
        kernel += f" behind a cached {row['ours']['shared_prefix']}-token prefix" if row["ours"].get("shared_prefix") else ""
    sampling = row.get("sampling") or {}
    if sampling.get("temperature"):
        shown = {"min_p": 0.0, **sampling}  # results written before --min-p have none
        kernel += ", temperature {temperature}, top-k {top_k}, top-p {top_p}, min-p {min_p}".format(**shown)
    line = (f"{row['dtype']:>9} batch {row['batch']:>3} ({row['ours']['weights']:>12}{kernel}): "
            f"ours {machine.fmt(row['ours']['rounds'], 1):>20s} tok/s "
            f"(prefill {np.median(row['ours']['prefill_ms']):.1f} ms, median)")
    if "hf" in row:
        line += (f" | transformers {machine.fmt(row['hf']['rounds'], 1):>20s} tok/s"
                 f" | x{row['ours']['decode_tok_s'] / row['hf']['decode_tok_s']:.2f} (medians)")
    if "bound_tok_s" in row:
        line += (f" | bandwidth bound {row['bound_tok_s']:.1f} tok/s ({row['weight_GB']:.3f} GB per step at "
                 f"{row['bandwidth_GBps']:.1f} GB/s, best pass): ours {row['ours_pct_of_bound']:.0f}%")
    if "sustained_read" in row:
        read = row["sustained_read"]
        line += (f" | sustained reads in the same rounds {machine.fmt(read['rounds'], 1)} tok/s "
                 f"({read['GBps']:.1f} GB/s): ours {row['ours_pct_of_sustained']:.0f}%")
    return line


if __name__ == "__main__":
    main()
