"""Evaluation speed: loglikelihood requests/s of eval_harness.py's model (`MeshLM`) against lm-eval's
own `--model hf` (HFLM, torch) on the same weights and the same task, in the same run.

    python bench/eval_throughput.py                          # random GPT-J, 4 x d_model 512, GPT-2 vocabulary
    python bench/eval_throughput.py --docs 400 --rounds 5 --layers 8 --d-model 1024
    python bench/eval_throughput.py --family llama --lora --served --peer vllm   # evaluating a LoRA adapter
    bash bench/setup_vllm_venv.sh && python bench/eval_throughput.py --peer vllm

The task is LAMBADA-shaped (score each text's last word after the rest: one loglikelihood request
per document), over sentences of data/corpus/stories.txt written as a local task, so nothing is
downloaded. Both sides run through `lm_eval.simple_evaluate` with the same batch size; each is run
once to warm up (our compiles, torch's allocator), then `--rounds` times, alternating, and every
round's requests/s is reported with the median and the range (`--json`: one JSON object with the
machine, the software and every round). Both sides' per-request
log-likelihoods are compared (max |difference|), so the two measure the same work.
Ours runs with the model split over `--devices` simulated CPU devices as mp (the README's
training numbers: one device per core is how XLA uses a multi-core CPU). `--peer vllm` adds vLLM's
CPU build (its own venv, bench/setup_vllm_venv.sh) served on the same weights and driven by
lm-eval's `local-completions` (token ids, echo, logprobs), the way an OpenAI-style evaluator uses it;
`--served` adds our own server (device_serve.py, one CPU device) driven the same way.

`--lora`: evaluate a random PEFT LoRA adapter (rank `--lora-rank`, every attention and MLP weight)
instead of the base: ours with it merged (eval_harness.py --lora-adapter), HFLM with `peft=`, and
the servers serving it unmerged under its name (ours --lora-modules, vLLM --enable-lora).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
import machine  # noqa: E402
import serve_load  # noqa: E402  (the peer servers)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TASK = """task: bench_lambada
dataset_path: json
dataset_kwargs:
  data_files:
    test: "{data}"
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_task(directory: str, docs: int) -> None:
    """`docs` texts of 2-4 consecutive story sentences each, as a local lm-eval task."""
    import re
    text = open(os.path.join(ROOT, "data", "corpus", "stories.txt")).read().replace("<|endoftext|>", " ")
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if len(s.split()) > 3]
    with open(os.path.join(directory, "docs.jsonl"), "w") as f:
        for i in range(docs):
            k = 2 + i % 3
            body = " ".join(sentences[(i * 3) % (len(sentences) - k):][:k]).rstrip(".!?\"")
            f.write(json.dumps({"text": body}) + "\n")
    with open(os.path.join(directory, "bench_lambada.yaml"), "w") as f:
        f.write(TASK.format(data=os.path.join(directory, "docs.jsonl")))


def make_model(path: str, family: str, layers: int, d_model: int, heads: int, seq: int) -> None:
    """A random GPT-J or LLaMA-shaped model (SwiGLU of 8/3 d_model rounded to 128, RMSNorm, no
    biases) with the GPT-2 tokenizer saved beside it (every side reads this directory)."""
    import torch
    import transformers

    from mesh_transformer.io.tokenizer import load_tokenizer

    torch.manual_seed(0)
    ids = dict(vocab_size=50257, bos_token_id=50256, eos_token_id=50256)
    if family == "gptj":
        model = transformers.GPTJForCausalLM(transformers.GPTJConfig(
            n_positions=seq, n_embd=d_model, n_layer=layers, n_head=heads, rotary_dim=min(64, d_model // heads), **ids))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=d_model, intermediate_size=(8 * d_model // 3 + 127) // 128 * 128, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=seq, **ids))
    model.eval().save_pretrained(path)
    load_tokenizer("gpt2").save_pretrained(path)


def timed(lm, manager, docs: int) -> tuple[float, list]:
    from mesh_transformer.evaluate import harness

    start = time.perf_counter()
    results = harness.run(lm, ["bench_lambada"], manager, bootstrap_iters=0, log_samples=True)
    seconds = time.perf_counter() - start
    lls = [s["resps"][0][0][0] for s in sorted(results["samples"]["bench_lambada"], key=lambda s: s["doc_id"])]
    return docs / seconds, lls


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16, help="the same for both sides")
    p.add_argument("--family", choices=["gptj", "llama"], default="gptj",
                   help="GPT-J, or LLaMA-shaped (vLLM serves LoRA adapters of LLaMA, not of GPT-J)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--devices", type=int, default=2, help="simulated CPU devices for ours (mp)")
    p.add_argument("--peer", action="append", default=[], choices=["vllm"],
                   help="also vLLM's CPU build through lm-eval local-completions")
    p.add_argument("--served", action="store_true", help="also our device_serve.py through local-completions")
    p.add_argument("--lora", action="store_true", help="evaluate a random LoRA adapter on the model")
    p.add_argument("--lora-rank", type=int, default=16)
    machine.add_args(p, rounds=3)
    args = p.parse_args(argv)
    description = machine.describe(("lm_eval",))
    if not args.json:
        print(machine.header(description), flush=True)

    from mesh_transformer import cli
    cli.simulate_cpu_devices(args.devices)
    import torch
    from lm_eval.models.huggingface import HFLM

    from mesh_transformer import loading
    from mesh_transformer.evaluate import harness
    from mesh_transformer.evaluate.lm import MeshLM

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, task_dir = os.path.join(tmp, "model"), os.path.join(tmp, "tasks")
        os.makedirs(task_dir)
        make_model(model_dir, args.family, args.layers, args.d_model, args.heads, args.seq)
        write_task(task_dir, args.docs)
        manager = harness.task_manager(task_dir, ["bench_lambada"])
        adapters = tuple(serve_load.make_adapters(args.family, model_dir, 1, args.lora_rank, tmp)) if args.lora else ()
        merged = adapters[0][1] if adapters else None
        ours = MeshLM.from_loaded(loading.load(hf=model_dir, mp=args.devices, dp=1, dtype="float32",
                                               lora_adapter=merged), batch_size=args.batch_size)
        theirs = HFLM(pretrained=model_dir, peft=merged, dtype="float32", batch_size=args.batch_size, device="cpu")
        sides = {"mesh-transformer": ours, "lm-eval hf (torch)": theirs}
        servers = []
        rates: dict[str, list[float]] = {}
        answers = {}
        try:
            if args.served:
                sides["mesh-transformer server (local-completions)"] = served_side("ours", model_dir, args, tmp,
                                                                                 servers, adapters)
            if "vllm" in args.peer:
                sides["vLLM CPU (local-completions)"] = served_side("vllm", model_dir, args, tmp, servers, adapters)
            rates.update({name: [] for name in sides})
            for name, lm in sides.items():  # warm-up: compiles, allocator
                _, answers[name] = timed(lm, manager, args.docs)
            for _ in range(args.rounds):
                for name, lm in sides.items():
                    rate, _ = timed(lm, manager, args.docs)
                    rates[name].append(rate)
        except Exception:
            for _, log in servers:
                print(f"--- the end of {log}:\n{open(log, errors='replace').read()[-4000:]}", file=sys.stderr)
            raise
        finally:
            for proc, _ in servers:
                serve_load.stop(proc)
        reference = answers["lm-eval hf (torch)"]
        diffs = {name: max(abs(a - b) for a, b in zip(got, reference)) for name, got in answers.items()
                 if name != "lm-eval hf (torch)"}
    results = {"model": {"family": args.family, "layers": args.layers, "d_model": args.d_model, "heads": args.heads,
                         "vocab": 50257, "dtype": "float32", "lora_rank": args.lora_rank if args.lora else None},
               "requests": args.docs, "batch_size": args.batch_size, "our_devices": args.devices,
               "torch_threads": torch.get_num_threads(), "max_abs_loglikelihood_diff_from_hflm": diffs,
               "requests_per_s": {name: machine.summary(values) for name, values in rates.items()}}
    medians = {name: r["median"] for name, r in results["requests_per_s"].items()}
    results["ratios"] = {"ours / HFLM": medians["mesh-transformer"] / medians["lm-eval hf (torch)"]}
    vllm = medians.get("vLLM CPU (local-completions)")
    if vllm:
        results["ratios"]["ours / vLLM"] = medians["mesh-transformer"] / vllm
        if "mesh-transformer server (local-completions)" in medians:
            results["ratios"]["our server / vLLM"] = medians["mesh-transformer server (local-completions)"] / vllm
    if args.json:
        machine.report(description, results, True)
    else:
        print_table(results, torch.__version__)


def print_table(results: dict, torch_version: str) -> None:
    """The text report: the run's shape, how close the sides' answers are, requests/s and the ratios."""
    diffs, model = results["max_abs_loglikelihood_diff_from_hflm"], results["model"]
    lora = (f"; a LoRA adapter r{model['lora_rank']} (ours merged, HFLM peft=, servers unmerged)"
            if model["lora_rank"] else "")
    family = "GPT-J" if model["family"] == "gptj" else "LLaMA-shaped"
    print(f"model: {family} {model['layers']} layers, d_model {model['d_model']}, vocabulary {model['vocab']:,}, "
          f"fp32{lora}; {results['requests']} loglikelihood requests, batch {results['batch_size']}; ours on "
          f"{results['our_devices']} CPU devices (mp), torch {torch_version} with {results['torch_threads']} "
          f"threads; load average {os.getloadavg()[0]:.1f} at the end")
    print(f"max |log-likelihood difference| from lm-eval hf: ours {diffs['mesh-transformer']:.2e}" +
          "".join(f", {n} {d:.2e}" for n, d in diffs.items() if n != "mesh-transformer"))
    print("| | requests/s (median) | min - max | rounds |")
    print("|---|---|---|---|")
    for name, r in results["requests_per_s"].items():
        print(f"| {name} | {r['median']:.1f} | {r['min']:.1f} - {r['max']:.1f} | "
              f"{', '.join(f'{v:.1f}' for v in r['runs'])} |")
    for name, ratio in results["ratios"].items():
        print(f"{name}: {ratio:.2f}x")


def served_side(peer: str, model_dir: str, args, tmp: str, servers: list, adapters: tuple = ()):
    """`peer`'s server ('ours', 'vllm') on `model_dir` (fp32), serving `adapters` when given, and
    lm-eval's local-completions model pointed at it (at the first adapter's name when given)."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    proc, url, name = serve_load.start_server(peer, model_dir, "float32", "", tmp, max_len=args.seq,
                                              adapters=adapters, rank=args.lora_rank)
    servers.append((proc, os.path.join(tmp, f"{peer}-{os.path.basename(model_dir)}.log")))
    os.environ.setdefault("OPENAI_API_KEY", "EMPTY")
    return LocalCompletionsAPI(base_url=f"{url}/v1/completions", model=adapters[0][0] if adapters else name,
                               tokenizer_backend="huggingface", tokenizer=model_dir, max_length=args.seq,
                               batch_size=args.batch_size, max_retries=1)


if __name__ == "__main__":
    main()
