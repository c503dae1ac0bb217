"""Server throughput under a fixed concurrent load: requests/s, tokens/s, p50/p99 latency.

    python bench/serve_load.py                                  # starts device_serve.py on a random model
    python bench/serve_load.py --hf ./gpt-j-6b --server-args "--mp 8 --max-batch 32"
    python bench/serve_load.py --url http://127.0.0.1:5000 --concurrency 32 --requests 512

The load comes from this process (asyncio + httpx, `--concurrency` requests in flight at all
times); the server is another process (started here unless `--url` is given).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str, extra: str, startup_timeout: float = 600):
    """device_serve.py in a subprocess on a free loopback port -> (process, url)."""
    import httpx

    port = free_port()
    cmd = [sys.executable, os.path.join(ROOT, "device_serve.py"), "--hf", model_dir, "--port", str(port), *shlex.split(extra)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"device_serve.py exited with {proc.returncode}:\n{proc.stderr.read()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("device_serve.py did not start in time")


async def load(url: str, concurrency: int, requests: int, body: dict, api_key=None, warmup_rounds: int = 1):
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    latencies, tokens, errors = [], [], []
    remaining = iter(range(requests))

    async def worker(client):
        for i in remaining:  # noqa: B020 - shared by all workers; rebound between rounds
            t = time.perf_counter()
            r = await client.post("/v1/completions", json={**body, "seed": i})
            if r.status_code != 200:
                errors.append(r.status_code)
                continue
            latencies.append(time.perf_counter() - t)
            tokens.append(r.json()["usage"]["completion_tokens"])

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as client:
        for _ in range(warmup_rounds):  # the same load unmeasured first: its shapes get compiled
            await asyncio.gather(*(worker(client) for _ in range(concurrency)))
            latencies.clear(), tokens.clear(), errors.clear()
            remaining = iter(range(requests))
        compiled = (await client.get("/health")).json().get("compiled_shapes")
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
        compiled = (await client.get("/health")).json().get("compiled_shapes", 0) - (compiled or 0)
    if compiled:
        print(f"warning: {compiled} new program(s) compiled during the measurement; more --warmup-rounds?")
    return wall, np.array(latencies), np.array(tokens), errors


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="an already running server")
    parser.add_argument("--hf", help="model for the server to start (default: a random 4-layer GPT-J)")
    parser.add_argument("--server-args", default="--max-batch 16 --chunk 8 --warmup 16 64 --dtype float32",
                        help="extra device_serve.py flags (float32: the fast dtype on CPU)")
    parser.add_argument("--api-key")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog. " * 4)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--warmup-rounds", type=int, default=1, help="unmeasured runs of the same load first")
    args = parser.parse_args(argv)

    proc, tmp = None, None
    try:
        url = args.url
        if url is None:
            model_dir = args.hf
            if model_dir is None:
                from decode import make_random_gptj
                tmp = tempfile.TemporaryDirectory()
                model_dir = tmp.name
                make_random_gptj(model_dir)
            proc, url = start_server(model_dir, args.server_args)
        body = {"prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": args.temperature}
        wall, latency, tokens, errors = asyncio.run(load(url, args.concurrency, args.requests, body, args.api_key,
                                                         args.warmup_rounds))
        print(f"{len(latency)} requests ({len(errors)} failed) at concurrency {args.concurrency} in {wall:.2f} s")
        print(f"throughput: {len(latency) / wall:.2f} requests/s, {tokens.sum() / wall:.1f} generated tokens/s")
        if len(latency):
            print(f"latency: p50 {np.percentile(latency, 50) * 1e3:.0f} ms, p99 {np.percentile(latency, 99) * 1e3:.0f} ms, "
                  f"mean {latency.mean() * 1e3:.0f} ms")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    main()
