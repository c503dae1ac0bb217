"""Embedding speed: /v1/embeddings' pass (`Scorer.embed`) against transformers, same weights, same run.

    python bench/embed.py                                  # random GPT-J, 4 x d_model 512, 64 texts of 16-256 tokens
    python bench/embed.py --family llama --texts 256 --mp 2 --rounds 5

Each side embeds the same texts (random token ids, lengths spread evenly over --min-len..--max-len)
into L2-normalised last-token vectors, the way embedding models built on decoder LMs are read
(E5-Mistral, GTE-Qwen2): ours through the scorer the server embeds with (texts sorted by length,
right-padded, rows and positions bucketed, `DEFAULT_BATCH_TOKENS` positions a pass, the model over
--mp simulated CPU devices); transformers' base model (`AutoModel`, torch fp32) as
sentence-transformers runs one: texts sorted by length, batches of --hf-batch right-padded with an
attention mask, each text's last real state gathered and normalised. Both are warmed up (our
compiles) and then timed in turn, --rounds rounds; texts/s and tokens/s are the median and min-max.
The largest difference between the two sides' vectors is printed, so both did the same work.
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

import families  # noqa: E402
import machine  # noqa: E402


def texts(n: int, shortest: int, longest: int, vocab: int) -> list[list[int]]:
    rng = np.random.RandomState(0)
    lengths = np.linspace(shortest, longest, n).round().astype(int)
    return [rng.randint(1, vocab, size=length).tolist() for length in rng.permutation(lengths)]


def ours(path: str, mp: int, dtype: str, prompts: list[list[int]]):
    """-> (measure: texts/s of one pass over `prompts`, their vectors)."""
    from mesh_transformer import loading
    from mesh_transformer.evaluate.scoring import Scorer

    scorer = Scorer.for_generator(loading.load(hf=path, mp=mp, dp=1, dtype=dtype).generator())
    vectors = scorer.embed(prompts)  # compiles every shape the texts need

    def measure() -> float:
        start = time.perf_counter()
        scorer.embed(prompts)
        return len(prompts) / (time.perf_counter() - start)
    return measure, vectors


def transformers_side(path: str, prompts: list[list[int]], batch: int):
    """-> (measure, vectors): transformers' base model, as sentence-transformers embeds with it."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))

    def embed() -> np.ndarray:
        out = np.zeros((len(prompts), model.config.hidden_size), np.float32)
        with torch.inference_mode():
            for start in range(0, len(order), batch):
                group = order[start:start + batch]
                width = max(len(prompts[i]) for i in group)
                ids = torch.zeros((len(group), width), dtype=torch.long)
                mask = torch.zeros((len(group), width), dtype=torch.long)
                for row, i in enumerate(group):
                    ids[row, :len(prompts[i])] = torch.tensor(prompts[i])
                    mask[row, :len(prompts[i])] = 1
                states = model(input_ids=ids, attention_mask=mask).last_hidden_state
                last = states[torch.arange(len(group)), mask.sum(1) - 1]
                out[group] = torch.nn.functional.normalize(last, dim=-1).numpy()
        return out

    vectors = embed()

    def measure() -> float:
        start = time.perf_counter()
        embed()
        return len(prompts) / (time.perf_counter() - start)
    return measure, vectors


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    families.add_shape_args(parser, vocab=50400)
    parser.add_argument("--texts", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--hf-batch", type=int, default=32, help="transformers' batch (sentence-transformers' default)")
    parser.add_argument("--mp", type=int, default=1, help="ours: the model split over this many simulated CPU devices")
    parser.add_argument("--dtype", default="float32")
    machine.add_args(parser, rounds=5)
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.mp}"
    from mesh_transformer import host_memory
    host_memory.keep_freed_memory()  # as device_serve.py does
    description = machine.describe()
    import decode  # its random-model maker: the same families and shapes as the decode benchmark

    prompts = texts(args.texts, args.min_len, args.max_len, args.vocab)
    tokens = sum(map(len, prompts))
    with tempfile.TemporaryDirectory() as tmp:
        decode.make_random(tmp, args.family, args.layers, args.d_model, args.heads, vocab=args.vocab,
                           seq=max(2048, args.max_len))
        measure_ours, ours_vectors = ours(tmp, args.mp, args.dtype, prompts)
        measure_hf, hf_vectors = transformers_side(tmp, prompts, args.hf_batch)
        rates = machine.interleaved({"ours": measure_ours, "transformers": measure_hf}, args.rounds,
                                    progress=not args.json)
    results = {"texts": args.texts, "tokens": tokens, "family": args.family, "layers": args.layers,
               "d_model": args.d_model, "mp": args.mp, "dtype": args.dtype,
               "max_abs_diff": float(np.abs(ours_vectors - hf_vectors).max()),
               "texts_per_s": rates, "speedup": rates["ours"]["median"] / rates["transformers"]["median"]}

    def text():
        print(f"{args.family} {args.layers} x d_model {args.d_model}, {args.texts} texts of {args.min_len}-"
              f"{args.max_len} tokens ({tokens} in all), {args.dtype}, ours on {args.mp} device(s)")
        for name, s in rates.items():
            per_token = {k: s[k] * tokens / args.texts for k in ("median", "min", "max")}
            print(f"  {name:13s} {machine.fmt(s, 1)} texts/s   {machine.fmt(per_token)} tokens/s")
        print(f"  ours / transformers: {results['speedup']:.2f}x   vectors agree within {results['max_abs_diff']:.1e}")
    machine.report(description, results, args.json, text)


if __name__ == "__main__":
    main()
