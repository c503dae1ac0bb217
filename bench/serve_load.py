"""Serving under concurrent load, ours beside the peers a user would pick instead, in one run.

    python bench/serve_load.py                                   # device_serve.py alone, random GPT-J
    bash bench/setup_vllm_venv.sh && python bench/serve_load.py --peer vllm --peer transformers
    python bench/serve_load.py --url http://127.0.0.1:5000 --concurrency 32 --requests 512

Models (random weights, the GPT-2 tokenizer saved beside them, built here): `gptj` as in issue 13
(4 layers, d_model 512, 8 heads, vocabulary 50,400) and `llama`, LLaMA-shaped at the same size
(8 query and 2 kv heads, SwiGLU 1,536: bench/families.py). Every server gets the same model directory in float32
(`--dtype`), and the same load from this process: for each concurrency and shared-prefix length,
`--requests` streamed completions (`--concurrency` in flight at all times) of random text prompts
of `--prompt-tokens` tokens, after a shared prefix of `--shared-prefix` tokens when that is not 0,
`--max-tokens` new tokens each (ignore_eos), after one unmeasured round of the same shape (other
prompts; it compiles our programs and fills every server's prefix cache with the shared prefix).

Reported per run: requests/s, output tokens/s, time to first token (TTFT: request sent -> first
streamed token) p50/p99, and inter-token latency (ITL: (last token - first token) / (tokens - 1) of
each request, what vLLM's benchmark calls TPOT) p50/p99.

Ours: `device_serve.py` with one CPU device and `--server-args` (default: 64 rows, chunks of 8
steps, and a warm-up that compiles the prefill of 128- and 160-token prompts alone and behind a
1,024-token prefix already cached, the shapes these prompts take).

`--lora N`: N random LoRA adapters (PEFT's format, rank `--lora-rank`, on every attention and MLP
projection, B random) served beside the base, request i naming adapter i mod N: ours with
`--lora-modules`, vLLM with `--enable-lora --lora-modules` (the same directories); one batch then
decodes rows of every adapter (multi-LoRA serving). `--max-loras M` (M < N): a batch holds M
adapters at once (ours: M bank entries, taken by turns; vLLM: `--max-loras M --max-cpu-loras N`).

Peers, each started from its own venv or command:
  vllm          vLLM's CPU build (`bash bench/setup_vllm_venv.sh`): its OpenAI server, prefix caching on
  transformers  `transformers serve DIR --continuous-batching` from the project's venv
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import machine  # noqa: E402
VLLM_PYTHON = os.path.join(ROOT, "bench", ".venv-vllm", "bin", "python")
OURS_ARGS = "--max-batch 64 --chunk 8 --warmup 128 160 --warmup-prefix 1024"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------
# Models and servers
# --------------------------------------------------------------------------------------------

def make_model(kind: str, path: str) -> str:
    """A random `kind` ('gptj' or 'llama', shaped as bench/families.py says) HF model with the GPT-2
    tokenizer in `path`."""
    from decode import make_random
    from mesh_transformer.io.tokenizer import load_tokenizer

    make_random(path, kind, vocab=50304 if kind == "llama" else 50400)
    load_tokenizer("gpt2").save_pretrained(path)
    return path


LORA_TARGETS = {"gptj": ["q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out"],
                "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def make_adapters(kind: str, model_dir: str, n: int, rank: int, out_dir: str) -> list[tuple[str, str]]:
    """`n` random PEFT LoRA adapters (B random, not PEFT's zeros) on the model in `model_dir`, saved
    under `out_dir` -> [(name, directory)]."""
    import peft
    import torch
    import transformers

    out = []
    for i in range(n):
        torch.manual_seed(i)
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False,
                                                          target_modules=LORA_TARGETS.get(kind, "all-linear")))
        path = os.path.join(out_dir, f"{kind}-lora{i}")
        model.save_pretrained(path)
        out.append((f"lora{i}", path))
    return out


def wait_ready(proc, url: str, name: str, log: str, timeout: float = 900) -> None:
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = open(log, errors="replace").read()[-3000:]
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"{name} did not start in {timeout:g} s (log: {log})")


def start_server(peer: str, model_dir: str, dtype: str, ours_args: str, logdir: str, max_len: int = 2048,
                 adapters: tuple = (), rank: int = 16, slots: Optional[int] = None):
    """Start `peer` ('ours', 'vllm', 'transformers') on `model_dir` -> (process, url, model name);
    `max_len`: vLLM's context (at most the model's); `adapters`: [(name, PEFT directory)] of rank <= `rank`,
    `slots` of them in a batch at once (default: all)."""
    slots = slots or len(adapters)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           # one CPU device, as a user's machine has it (not the test suite's 8 simulated ones:
           # device_serve.py would split the batch over them, dp=8 on 2 cores)
           "XLA_FLAGS": re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")).strip()}
    name = os.path.basename(model_dir.rstrip("/"))
    if peer == "ours":
        cmd = [sys.executable, os.path.join(ROOT, "device_serve.py"), "--hf", model_dir, "--port", str(port),
               "--dtype", dtype, *shlex.split(ours_args)]
        if adapters:
            cmd += ["--lora-modules", *(f"{a}={p}" for a, p in adapters), "--max-loras", str(slots)]
    elif peer == "vllm":
        if not os.path.exists(VLLM_PYTHON):
            raise RuntimeError("no vLLM venv: run `bash bench/setup_vllm_venv.sh` first")
        cmd = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
               "--port", str(port), "--dtype", dtype, "--served-model-name", name, "--max-model-len", str(max_len)]
        if adapters:
            cmd += ["--enable-lora", "--max-loras", str(slots), "--max-cpu-loras", str(len(adapters)),
                    "--max-lora-rank", str(rank), "--lora-modules", *(f"{a}={p}" for a, p in adapters)]
        env.update(VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"), VLLM_HOST_IP="127.0.0.1",
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    elif peer == "transformers":
        if adapters:
            raise RuntimeError("`transformers serve` serves no LoRA adapters")
        cmd = [os.path.join(os.path.dirname(sys.executable), "transformers"), "serve", model_dir,  # 5.x: positional
               "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--continuous-batching"]
        name = model_dir
    else:
        raise ValueError(f"unknown peer {peer!r} (ours, vllm, transformers)")
    log = os.path.join(logdir, f"{peer}-{os.path.basename(model_dir)}.log")
    proc = subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True)
    wait_ready(proc, url, peer, log)
    return proc, url, name


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------------------------
# The load
# --------------------------------------------------------------------------------------------

def random_text(tokenizer, n: int, rng) -> str:
    """Text of about `n` GPT-2 tokens (random ids decoded; re-encoding gives about as many)."""
    return tokenizer.decode(rng.integers(300, 50000, n).tolist())


def prompts(tokenizer, count: int, tokens: int, shared: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    prefix = random_text(tokenizer, shared, np.random.default_rng(12345)) + "\n" if shared else ""
    return [prefix + random_text(tokenizer, tokens, rng) for _ in range(count)]


@dataclass
class Result:
    wall: float
    ttft: np.ndarray
    itl: np.ndarray
    tokens: np.ndarray
    prompt_tokens: np.ndarray
    errors: list

    def row(self) -> dict:
        pct = lambda x, q: float(np.percentile(x, q) * 1e3) if len(x) else float("nan")  # noqa: E731
        return {"requests_s": len(self.tokens) / self.wall, "output_tok_s": self.tokens.sum() / self.wall,
                "ttft_p50_ms": pct(self.ttft, 50), "ttft_p99_ms": pct(self.ttft, 99),
                "itl_p50_ms": pct(self.itl, 50), "itl_p99_ms": pct(self.itl, 99),
                "prompt_tokens": float(self.prompt_tokens.mean()) if len(self.prompt_tokens) else 0,
                "failed": len(self.errors)}


async def one_request(client, body: dict):
    """A streamed completion -> (ttft, itl, completion tokens, prompt tokens)."""
    t0 = time.perf_counter()
    first = last = None
    usage = None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices"):
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
            if event.get("usage"):
                usage = event["usage"]
            if event.get("error") or event.get("object") == "error":
                raise RuntimeError(f"error in the stream: {line[6:300]}")
    if first is None:  # a stream that ended without a token is a failed request, not a measurement
        raise RuntimeError(f"the stream ended without a token (usage: {usage})")
    n = usage["completion_tokens"] if usage else 0
    return first - t0, (last - first) / (n - 1) if n > 1 else 0.0, n, usage["prompt_tokens"] if usage else 0


async def load(url: str, model, texts: list[str], concurrency: int, body: dict, api_key=None) -> Result:
    """`model`: the name every request sends, or a list: request i sends model[i % len]."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    ttft, itl, tokens, prompt_tokens, errors = [], [], [], [], []
    todo = iter(enumerate(texts))

    async def worker(client):
        for i, text in todo:
            try:
                name = model[i % len(model)] if isinstance(model, list) else model
                a, b, n, p = await one_request(client, {**body, "model": name, "prompt": text, "seed": i, "stream": True,
                                                        "stream_options": {"include_usage": True}})
            except (RuntimeError, httpx.HTTPError) as e:
                errors.append(str(e)[:200])
                continue
            ttft.append(a), itl.append(b), tokens.append(n), prompt_tokens.append(p)

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=1800, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return Result(wall, np.array(ttft), np.array(itl), np.array(tokens), np.array(prompt_tokens), errors)


def compiled_shapes(url: str):
    import httpx
    try:
        return httpx.get(f"{url}/health", timeout=5).json().get("compiled_shapes")
    except (ValueError, AttributeError, httpx.HTTPError):
        return None  # a peer's /health is not JSON


class Server:
    """A started peer that `revive` starts again if it died (vLLM 0.32's CPU build crashes in its
    seeded sampling under load here, at temperature > 0: the rows after that still run, on a fresh
    server; `--temperature 0` avoids it)."""

    def __init__(self, peer: str, model_dir: str, args, logdir: str, adapters: tuple = ()):
        self.peer = peer
        self.start = lambda: start_server(peer, model_dir, args.dtype, args.server_args, logdir, adapters=adapters,
                                          rank=args.lora_rank, slots=args.max_loras)
        self.proc, self.url, self.name = self.start()

    def revive(self) -> bool:
        """Start the server again if it exited or stopped answering (vLLM's API process outlives its
        crashed engine); True if it was restarted."""
        import httpx
        if self.proc.poll() is None:
            try:
                if httpx.get(f"{self.url}/health", timeout=10).status_code == 200:
                    return False
            except httpx.HTTPError:
                pass
            stop(self.proc)
        self.proc, self.url, self.name = self.start()
        return True


def run_scenarios(url: str, model, tokenizer, args, label: str, results: list,
                  server: Optional[Server] = None) -> None:
    body = {"max_tokens": args.max_tokens, "temperature": args.temperature, "ignore_eos": True}
    if server is not None and server.peer == "transformers":
        del body["ignore_eos"]  # `transformers serve` answers 422 to it
    for shared in args.shared_prefix:
        for concurrency in args.concurrency:
            revived = server is not None and server.revive()
            url = server.url if server is not None else url
            for round_ in range(args.warmup_rounds + 1):  # other prompts each round; same shared prefix
                seed = 1000 * round_ + 10 * concurrency + (shared > 0)
                texts = ([args.prompt] * args.requests if args.prompt else
                         prompts(tokenizer, args.requests, args.prompt_tokens, shared, seed))
                before = compiled_shapes(url)
                result = asyncio.run(load(url, model, texts, concurrency, body, args.api_key))
            after = compiled_shapes(url)
            row = {"server": label, "concurrency": concurrency, "shared_prefix": shared, **result.row()}
            notes = ([f"{after - before} programs compiled while measuring"] if before is not None and after != before
                     else []) + (["on a restarted server (it had died)"] if revived else [])
            if notes:
                row["note"] = "; ".join(notes)
            results.append(row)
            print(format_row(row), flush=True)
            if result.errors:
                print("  errors:", result.errors[:3], flush=True)


HEADER = (f"{'server':28s} {'conc':>4s} {'prefix':>6s} {'prompt':>6s} {'req/s':>6s} {'tok/s':>7s} "
          f"{'TTFT p50':>9s} {'TTFT p99':>9s} {'ITL p50':>8s} {'ITL p99':>8s} fail")


def format_row(r: dict) -> str:
    return (f"{r['server']:28s} {r['concurrency']:4d} {r['shared_prefix']:6d} {r['prompt_tokens']:6.0f} "
            f"{r['requests_s']:6.2f} {r['output_tok_s']:7.1f} {r['ttft_p50_ms']:9.0f} {r['ttft_p99_ms']:9.0f} "
            f"{r['itl_p50_ms']:8.1f} {r['itl_p99_ms']:8.1f} {r['failed']:4d} {r.get('note', '')}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="measure an already running server (ours or any OpenAI completions server)")
    parser.add_argument("--hf", help="one model directory for every server (default: the random --models)")
    parser.add_argument("--models", nargs="+", default=["gptj", "llama"], choices=["gptj", "llama"])
    parser.add_argument("--peer", action="append", default=[], choices=["vllm", "transformers"],
                        help="also serve the model with this peer (repeatable)")
    parser.add_argument("--server-args", default=OURS_ARGS, help="extra device_serve.py flags")
    parser.add_argument("--dtype", default="float32", help="every server's dtype")
    parser.add_argument("--api-key")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--shared-prefix", type=int, nargs="+", default=[0, 1000],
                        help="tokens of a prefix every prompt shares (0: none)")
    parser.add_argument("--prompt", help="one text prompt for every request instead of random ones")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--warmup-rounds", type=int, default=1, help="unmeasured rounds of each shape first")
    parser.add_argument("--lora", type=int, default=0, metavar="N",
                        help="serve N random LoRA adapters beside the base; request i names adapter i mod N")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--max-loras", type=int, metavar="M",
                        help="with --lora N: adapters a batch holds at once (default N)")
    parser.add_argument("--json", help="write the rows here too")
    parser.add_argument("--logs", help="keep every server's log in this directory (default: deleted at the end)")
    args = parser.parse_args(argv)

    from mesh_transformer.io.tokenizer import load_tokenizer
    tokenizer = load_tokenizer("gpt2")
    results: list[dict] = []
    print(machine.header(machine.describe()), flush=True)
    print(f"load: {args.requests} streamed requests per row, {args.prompt_tokens}-token prompts (+ shared prefix), "
          f"{args.max_tokens} new tokens, temperature {args.temperature}, {args.dtype}; "
          f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at start", flush=True)
    print(HEADER, flush=True)
    if args.url:
        import httpx
        model = httpx.get(f"{args.url}/v1/models", timeout=10).json()["data"][0]["id"]
        run_scenarios(args.url, model, tokenizer, args, "server at --url", results)
        return results
    with tempfile.TemporaryDirectory() as tmp:
        models = {"hf": args.hf} if args.hf else {m: make_model(m, os.path.join(tmp, m)) for m in args.models}
        for kind, model_dir in models.items():
            adapters = tuple(make_adapters(kind, model_dir, args.lora, args.lora_rank, tmp)) if args.lora else ()
            label = f", {args.lora} LoRA r{args.lora_rank}" if args.lora else ""
            label += f" in {args.max_loras} at once" if args.lora and args.max_loras else ""
            for peer in ["ours", *args.peer]:
                try:
                    if args.logs:
                        os.makedirs(args.logs, exist_ok=True)
                    server = Server(peer, model_dir, args, args.logs or tmp, adapters)
                    try:
                        names = [name for name, _ in adapters] or server.name
                        run_scenarios(server.url, names, tokenizer, args, f"{peer} ({kind}{label})", results, server)
                    finally:
                        stop(server.proc)
                except RuntimeError as e:
                    print(f"{peer} on {kind}: could not start: {str(e).splitlines()[0]}", flush=True)
                    print("\n".join(str(e).splitlines()[-15:]), flush=True)
        print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
