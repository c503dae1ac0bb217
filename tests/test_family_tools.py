"""Every command-line tool on a family other than GPT-J, run as a user runs it (subprocesses).

LLaMA (GQA): from_hf_weights.py -> device_sample.py (greedy text = transformers') -> to_hf_weights.py
(logits = the source's) and device_train.py --hf. GPT-NeoX: train.py on Ray. OPT: device_serve.py.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from mesh_transformer.io import hf
from mesh_transformer.io.tokenizer import load_tokenizer
from tests.helpers import hf_greedy, hf_logits, make_hf_model, random_tokens, rounded_like_int8

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT2_VOCAB = dict(vocab_size=50257)  # the bundled corpus is GPT-2 BPE
TRAIN = dict(cores_per_replica=2, per_replica_batch=2, warmup_steps=1, anneal_steps=10, lr=1e-3, total_steps=2,
             ckpt_every=2, name="family-tools", compute_dtype="float32", remat="none")


def run(*cmd, timeout=600, env=None, with_stderr=False):
    """Run a tool; its stdout (and stderr after it, `with_stderr`). `env`: variables added to ours."""
    proc = subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr if with_stderr else proc.stdout


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    run("create_finetune_dataset.py", "data/corpus/stories.txt", "train", "--output-dir", str(out), "--seq", "32")
    return out / "train.index.json"


def config_file(path, hf_dir, dataset, **train):
    """A training config whose model keys are the HF model's (as a user writes them for --hf)."""
    model = hf.config_from_hf(json.loads((hf_dir / "config.json").read_text()), seq=32)
    raw = {k: v for k, v in dataclasses.asdict(model).items() if v is not None}
    raw.update(TRAIN, train_set=str(dataset), model_dir=str(path / "run"), **train)
    (path / "config.json").write_text(json.dumps(raw))
    return path / "config.json"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    return path, make_hf_model(path, "llama_gqa2_llama3_rope", **GPT2_VOCAB)


def test_llama_import_sample_export(llama, tmp_path):
    hf_dir, torch_model = llama
    run("from_hf_weights.py", "--input-hf", str(hf_dir), "--output-ckpt", str(tmp_path / "ckpt"))
    sample = ("device_sample.py", "--ckpt", str(tmp_path / "ckpt"), "--dtype", "float32", "--prompt", "Once upon a",
              "--temperature", "0", "--max-new-tokens", "6", "--no-eos", "--compile-cache", str(tmp_path / "xla"))
    out = run(*sample)
    tok = load_tokenizer("gpt2")
    expected = tok.decode(hf_greedy(torch_model, tok.encode("Once upon a"), 6))
    assert out.startswith(expected) and "[6 tokens, finish: length]" in out
    # A second run loads its programs from --compile-cache instead of compiling them.
    again = run(*sample, env={"JAX_DEBUG_LOG_MODULES": "jax._src.compiler"}, with_stderr=True)
    assert again.startswith(expected) and "Persistent compilation cache hit" in again
    assert "PERSISTENT COMPILATION CACHE MISS" not in again
    # --speculate 3: the same text, the model checking drafts from prompt lookup (generate.lookup), a
    # pass at most for each token after the first
    drafted = run(*sample, "--speculate", "3")
    assert drafted.startswith(expected + "\n[6 tokens, finish: length, ") and drafted.rstrip().endswith(" passes]")
    assert 1 <= int(drafted.rstrip().split(", ")[-1].split()[0]) <= 5
    # --quantize int8: transformers' greedy text on the weights rounded as the int8 ones are
    quantized = run(*sample[:-2], "--quantize", "int8")
    assert quantized.startswith(tok.decode(hf_greedy(rounded_like_int8(torch_model), tok.encode("Once upon a"), 6)))
    run("to_hf_weights.py", "--input-ckpt", str(tmp_path / "ckpt"), "--output-path", str(tmp_path / "hf"), "--dtype", "fp32")
    from transformers import AutoModelForCausalLM
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = random_tokens((2, 7), 50257, seed=4)
    np.testing.assert_array_equal(hf_logits(exported, tokens), hf_logits(torch_model, tokens))


def test_llama_device_train_from_hf(llama, dataset, tmp_path):
    hf_dir, _ = llama
    config = config_file(tmp_path, hf_dir, dataset)
    out = run("device_train.py", "--config", str(config), "--hf", str(hf_dir), "--cpu-devices", "4",
              "--no-tensorboard", "--log-dir", str(tmp_path / "logs"))
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["train/loss"]) for r in rows), out
    assert (tmp_path / "run" / "step_2").is_dir()


def test_gpt_neox_train_py_on_ray(dataset, tmp_path):
    raw = dict(family="gpt_neox", layers=2, d_model=32, n_heads=4, n_vocab=50257, seq=32, d_ff=48, rotary_pct=0.5,
               parallel_residual=False, **TRAIN, train_set=str(dataset), model_dir=str(tmp_path / "run"))
    (tmp_path / "config.json").write_text(json.dumps(raw))
    out = run("train.py", "--config", str(tmp_path / "config.json"), "--cpu-devices", "2", "--no-tensorboard",
              "--log-dir", str(tmp_path / "logs"))
    assert "done: step 2 on 1 host(s)" in out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_opt_device_serve(tmp_path):
    torch_model = make_hf_model(tmp_path, "opt_projected", **GPT2_VOCAB)
    port = _free_port()
    server = subprocess.Popen([sys.executable, "device_serve.py", "--hf", str(tmp_path), "--dtype", "float32",
                               "--port", str(port), "--max-batch", "2"], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, server.stdout.read() if server.poll() else "timeout"
            time.sleep(0.5)
        tok = load_tokenizer("gpt2")
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=300,
                       json={"prompt": "The cat", "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tok.decode(hf_greedy(torch_model, tok.encode("The cat"), 5))
    finally:
        server.terminate()
        server.wait(timeout=60)
