"""Speculative decoding by prompt lookup: ours (`Generator(speculate=k)`, device_sample.py and
device_serve.py `--speculate k`) against transformers' prompt lookup decoding
(`generate(prompt_lookup_num_tokens=k)`), same weights, same prompt, one sequence, greedy.

    python bench/speculate.py                                  # random 200M GPT-J (8 x 1024), fp32, k = 2 4
    python bench/speculate.py --family llama --speculate 3 --new 256 --dtype bfloat16

Sides, in interleaved rounds: ours a token a pass, ours with each k, transformers' `generate` and
transformers with each k (both look up n-grams of up to --lookup-ngram tokens). Reports decode
tokens/s (median and min-max of the rounds; the prompt's prefill excluded, as bench/decode.py
times it), the tokens a pass of ours kept, and whether each side's tokens equal ours one at a time.

The drafts pay where the text repeats itself. A random model has nothing to copy from its prompt,
but its greedy text falls into loops after a few dozen tokens, as a small model's does; a real
model keeps drafts where it copies: code it edits, a document it quotes or summarises. --new sets
how much of the output that is.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import decode  # noqa: E402
import families  # noqa: E402
import machine  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    families.add_arg(parser)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens (random)")
    parser.add_argument("--new", type=int, default=128, help="new tokens")
    parser.add_argument("--speculate", type=int, nargs="+", default=[2, 4], help="draft tokens a pass (each a side)")
    parser.add_argument("--lookup-ngram", type=int, default=3, help="longest n-gram a draft looks up (both sides)")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")
    machine.add_args(parser, rounds=3)
    args = parser.parse_args(argv)
    from mesh_transformer import host_memory
    host_memory.keep_freed_memory()  # as device_sample.py does
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=1"
    description = machine.describe()

    from mesh_transformer import loading
    prompt = np.random.RandomState(0).randint(0, 50000, args.prompt).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        torch_model = decode.make_random(tmp, args.family, args.layers, args.d_model, args.heads)
        model = loading.load(hf=tmp, mp=1, dp=1, dtype=args.dtype)
        sides, details, outputs = {}, {}, {}
        for k in [0, *args.speculate]:
            name = f"ours, k={k}"
            outputs[name] = []
            sides[name], details[name] = decode.bench_ours(model, 1, args.prompt, args.new, speculate=k,
                                                           lookup_ngram=args.lookup_ngram, prompt=prompt,
                                                           outputs=outputs[name])
        if not args.no_hf:
            for k in [0, *args.speculate]:
                name = f"transformers, k={k}"
                outputs[name] = []
                sides[name] = decode.bench_hf(torch_model, 1, args.prompt, args.new, args.dtype,
                                              lookup=(k, args.lookup_ngram) if k else None, prompt=prompt,
                                              outputs=outputs[name])
        rates = machine.interleaved(sides, args.rounds)
    reference = outputs["ours, k=0"][-1][0]
    results = {"model": f"{args.family} {args.layers} x {args.d_model}", "dtype": args.dtype, "new": args.new,
               "lookup_ngram": args.lookup_ngram, "sides": {}}
    for name, rate in rates.items():
        tokens = outputs[name][-1][0]
        same = tokens[:args.new] == reference[:args.new]
        results["sides"][name] = {"decode_tok_s": rate, "same_tokens_as_ours_k0": same,
                                  "tokens_per_pass": details[name]["tokens_per_pass"] if name in details else None,
                                  "speedup_over_k0": rate["median"] / rates[name.split(",")[0] + ", k=0"]["median"]}

    def text():
        print(f"{results['model']} {args.dtype}, one sequence, {args.prompt}-token prompt, {args.new} new tokens, "
              f"greedy; n-grams of up to {args.lookup_ngram}")
        for name, row in results["sides"].items():
            per_pass = f", {row['tokens_per_pass']:.2f} tokens a pass" if row["tokens_per_pass"] else ""
            print(f"  {name:18s} {machine.fmt(row['decode_tok_s'], 1):>22s} tok/s  x{row['speedup_over_k0']:.2f} of "
                  f"its k=0{per_pass}; tokens {'equal' if row['same_tokens_as_ours_k0'] else 'differ from'} ours k=0")
    machine.report(description, results, args.json, text)


if __name__ == "__main__":
    main()
