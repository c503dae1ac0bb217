"""Embedding and classification speed: /v1/embeddings' pass (`Scorer.embed`) and /classify's
(`Scorer.classify`) against transformers, same weights, same run.

    python bench/embed.py                                  # random GPT-J, 4 x d_model 512, 64 texts of 16-256 tokens
    python bench/embed.py --family llama --texts 256 --mp 2 --rounds 5
    python bench/embed.py --task classify --labels 1       # a reward model: its ForSequenceClassification

Each side embeds the same texts (random token ids, lengths spread evenly over --min-len..--max-len)
into L2-normalised last-token vectors, the way embedding models built on decoder LMs are read
(E5-Mistral, GTE-Qwen2): ours through the scorer the server embeds with (texts sorted by length,
right-padded, rows and positions bucketed, `DEFAULT_BATCH_TOKENS` positions a pass, the model over
--mp simulated CPU devices); transformers' base model (`AutoModel`, torch fp32) as
sentence-transformers runs one: texts sorted by length, batches of --hf-batch right-padded with an
attention mask, each text's last real state gathered and normalised. Both are warmed up (our
compiles) and then timed in turn, --rounds rounds; texts/s and tokens/s are the median and min-max.
The largest difference between the two sides' vectors is printed, so both did the same work.
With `--task classify` the model gets a random score head of --labels outputs (transformers'
`AutoModelForSequenceClassification`, saved, read by both sides) and each side answers every
text's logits at its last token: ours through /classify's scorer, transformers' model batched as
above (it finds each row's last token by the padding id).
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


def ours(path: str, mp: int, dtype: str, prompts: list[list[int]], task: str):
    """-> (measure: texts/s of one pass over `prompts`, their vectors or a classifier's logits)."""
    from mesh_transformer import loading
    from mesh_transformer.evaluate.scoring import Scorer

    scorer = Scorer.for_generator(loading.load(hf=path, mp=mp, dp=1, dtype=dtype).generator())
    run = scorer.embed if task == "embed" else scorer.classify
    vectors = run(prompts)  # compiles every shape the texts need

    def measure() -> float:
        start = time.perf_counter()
        run(prompts)
        return len(prompts) / (time.perf_counter() - start)
    return measure, vectors


def as_classifier(path: str, labels: int) -> None:
    """The causal LM in `path` rewritten as transformers' ForSequenceClassification of `labels`
    outputs (a random score head, seeded; padding id 0)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=labels, dtype=torch.float32)
    model.config.pad_token_id = 0
    model.save_pretrained(path)


def transformers_side(path: str, prompts: list[list[int]], batch: int, task: str):
    """-> (measure, vectors): transformers' base model, as sentence-transformers embeds with it (or
    its ForSequenceClassification's logits)."""
    import torch
    from transformers import AutoModel, AutoModelForSequenceClassification

    model = (AutoModel if task == "embed" else AutoModelForSequenceClassification).from_pretrained(
        path, dtype=torch.float32).eval()
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    size = model.config.hidden_size if task == "embed" else model.config.num_labels

    def embed() -> np.ndarray:
        out = np.zeros((len(prompts), size), np.float32)
        with torch.inference_mode():
            for start in range(0, len(order), batch):
                group = order[start:start + batch]
                width = max(len(prompts[i]) for i in group)
                ids = torch.zeros((len(group), width), dtype=torch.long)
                mask = torch.zeros((len(group), width), dtype=torch.long)
                for row, i in enumerate(group):
                    ids[row, :len(prompts[i])] = torch.tensor(prompts[i])
                    mask[row, :len(prompts[i])] = 1
                if task == "classify":
                    out[group] = model(input_ids=ids, attention_mask=mask).logits.numpy()
                    continue
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
    parser.add_argument("--task", choices=("embed", "classify"), default="embed")
    parser.add_argument("--labels", type=int, default=1, help="--task classify: the score head's outputs (1: a reward model)")
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
        if args.task == "classify":
            as_classifier(tmp, args.labels)
        measure_ours, ours_vectors = ours(tmp, args.mp, args.dtype, prompts, args.task)
        measure_hf, hf_vectors = transformers_side(tmp, prompts, args.hf_batch, args.task)
        rates = machine.interleaved({"ours": measure_ours, "transformers": measure_hf}, args.rounds,
                                    progress=not args.json)
    results = {"task": args.task, "labels": args.labels if args.task == "classify" else None,
               "texts": args.texts, "tokens": tokens, "family": args.family, "layers": args.layers,
               "d_model": args.d_model, "mp": args.mp, "dtype": args.dtype,
               "max_abs_diff": float(np.abs(ours_vectors - hf_vectors).max()),
               "texts_per_s": rates, "speedup": rates["ours"]["median"] / rates["transformers"]["median"]}

    def text():
        task = "embed" if args.task == "embed" else f"classify ({args.labels} label(s))"
        print(f"{task}: {args.family} {args.layers} x d_model {args.d_model}, {args.texts} texts of {args.min_len}-"
              f"{args.max_len} tokens ({tokens} in all), {args.dtype}, ours on {args.mp} device(s)")
        for name, s in rates.items():
            per_token = {k: s[k] * tokens / args.texts for k in ("median", "min", "max")}
            print(f"  {name:13s} {machine.fmt(s, 1)} texts/s   {machine.fmt(per_token)} tokens/s")
        print(f"  ours / transformers: {results['speedup']:.2f}x   outputs agree within {results['max_abs_diff']:.1e}")
    machine.report(description, results, args.json, text)


if __name__ == "__main__":
    main()
