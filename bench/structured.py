"""Structured outputs' cost: the same greedy batch free and under a grammar, ours and transformers', same run.

    python bench/structured.py                        # random 200M GPT-J (8 x d_model 1024), GPT-2's 50k vocabulary
    python bench/structured.py --batches 1 16 --new 64 --regex '[a-z ,.]+' --json

Four sides per batch size, in interleaved rounds (median and min-max of each): ours free, ours under
the grammar (`SamplingOptions(grammar=Grammar.regex(..))`: one decode step per call, llguidance's
mask each step), transformers' `generate` free, and `generate` under the same grammar through a
`LogitsProcessor` over llguidance (what a transformers user adds for structured output; llguidance
is the engine on both sides, so the difference is the decode loop around it). Rates are new tokens
per second end to end (the 32-token prompt's prefill included, the same on every side). End-of-text
is off on every side and the default regex never ends, so every row makes `--new` tokens.
The machine, software and load come first (bench/machine.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import machine  # noqa: E402
from decode import make_random  # noqa: E402


def grammar_processor(tokenizer, grammar: str, rows: int, prompt_len: int):
    """A transformers LogitsProcessor: each row's logits outside llguidance's allowed tokens -> -inf
    (end-of-text never allowed: every row runs to max_new_tokens, as ours does here)."""
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lgnp
    import torch
    from transformers import LogitsProcessor

    lltok = llguidance.hf.from_tokenizer(tokenizer)

    class Grammar(LogitsProcessor):
        def __init__(self):
            self.matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(rows)]
            self.words = lgnp.allocate_token_bitmask(rows, lltok.vocab_size)

        def __call__(self, input_ids, scores):
            if input_ids.shape[1] > prompt_len:
                for m, t in zip(self.matchers, input_ids[:, -1].tolist()):
                    m.consume_token(t)
            for i, m in enumerate(self.matchers):
                lgnp.fill_next_token_bitmask(m, self.words, i)
            bits = np.zeros(scores.shape, np.uint8)  # ids past the tokenizer's (a padded vocabulary): never
            unpacked = np.unpackbits(self.words.view(np.uint8), axis=-1, bitorder="little")[:, : scores.shape[-1]]
            bits[:, : unpacked.shape[1]] = unpacked
            bits[:, lltok.eos_token] = 0
            return scores.masked_fill(torch.from_numpy(bits == 0), -float("inf"))
    return Grammar


def sides(path: str, torch_model, batch: int, prompt_len: int, new: int, regex: str) -> dict:
    import torch
    from transformers import LogitsProcessorList

    from mesh_transformer import loading
    from mesh_transformer.generate import SamplingOptions
    from mesh_transformer.generate.structured import Grammar

    model = loading.load(hf=path, mp=1, dp=1, dtype="float32")
    tokenizer = model.tokenizer
    gen = model.generator()
    prompts = np.random.RandomState(0).randint(0, 50000, (batch, prompt_len)).tolist()
    free = SamplingOptions(max_new_tokens=new, temperature=0.0)
    guided = SamplingOptions(max_new_tokens=new, temperature=0.0, grammar=Grammar.regex(regex))

    def ours(options):
        def measure() -> float:
            start = time.perf_counter()
            seqs = gen.generate(prompts, options, tokenizer)
            assert all(len(s.tokens) == new for s in seqs), [len(s.tokens) for s in seqs]
            return batch * new / (time.perf_counter() - start)
        measure()  # compile
        return measure

    import llguidance
    source = llguidance.LLMatcher.grammar_from_regex(regex)
    processor = grammar_processor(tokenizer, source, batch, prompt_len)
    ids = torch.tensor(prompts)

    def hf(constrained: bool):
        def measure() -> float:
            start = time.perf_counter()
            with torch.no_grad():
                out = torch_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                           max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                                           logits_processor=LogitsProcessorList([processor()] if constrained else []))
            assert out.shape[1] == prompt_len + new
            return batch * new / (time.perf_counter() - start)
        measure()
        return measure

    return {"ours free": ours(free), "ours regex": ours(guided), "hf free": hf(False), "hf regex": hf(True)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--regex", default="[a-z ,.]+", help="the grammar (never ending, so every row runs --new tokens)")
    machine.add_args(parser, rounds=3)
    args = parser.parse_args(argv)
    from mesh_transformer import host_memory
    host_memory.keep_freed_memory()
    description = machine.describe(("llguidance",))
    if not args.json:
        print(machine.header(description), flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        torch_model = make_random(tmp, "gptj", args.layers, args.d_model, args.heads).eval()
        for batch in args.batches:
            rates = machine.interleaved(sides(tmp, torch_model, batch, args.prompt, args.new, args.regex),
                                        args.rounds, progress=not args.json)
            row = {"batch": batch, "new": args.new, "regex": args.regex, "tok_s": rates,
                   "ours_regex_vs_free": rates["ours regex"]["median"] / rates["ours free"]["median"],
                   "ours_regex_vs_hf_regex": rates["ours regex"]["median"] / rates["hf regex"]["median"]}
            results.append(row)
            if not args.json:
                print(f"batch {batch:3d}: " + "  ".join(f"{k} {machine.fmt(v, 1)}" for k, v in rates.items()) +
                      f"  tok/s; ours under the grammar {row['ours_regex_vs_free']:.2f}x ours free, "
                      f"{row['ours_regex_vs_hf_regex']:.2f}x transformers under it", flush=True)
    if args.json:
        machine.report(description, {"rows": results}, True)


if __name__ == "__main__":
    main()
