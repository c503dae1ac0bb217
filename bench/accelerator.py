"""Training MFU and decode bandwidth on an accelerator (GPU/TPU): what a CPU cannot show.

    python bench/accelerator.py train --preset llama-1b gptj-1.3b [--batch 8] [--remat dots] [--attention cudnn xla]
                                  [--loss fused autodiff] [--set scan_layers=false] [--profile DIR]
    python bench/accelerator.py decode --preset gptj-1.3b llama-1b [--new 128] [--fuse on off]
    python bench/accelerator.py peak                      # measured bf16 matmul rate and memory bandwidth

Training runs the library's own sharded step (`train.step.Trainer`: bf16 compute, float32 master
weights, AdamW, gradient clipping) on random tokens, one device (dp = mp = 1). MFU = tokens/s x
the model's training FLOPs per token (`ModelConfig.flops_per_token`: 6 x matmul parameters plus
attention, the PaLM convention) / peak bf16 matmul FLOP/s, given against the chip's published dense
peak and against the rate this run measured for a large bf16 matmul.

Decode runs `generate.Generator` (the serving path) greedy on random prompts and reports, for small
batches, the bytes each step must read (every weight but the embedding table, plus the KV cache
written so far) per step time, as a share of the device-to-device copy bandwidth measured in the
same run (bytes read + written, as a copy streams both).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

PRESETS = {
    # GPT-J-shaped 1.3B (GPT-Neo 1.3B's sizes with GPT-J's block): 24 x 2048, 16 heads of 128, rotary 64
    "gptj-1.3b": dict(family="gptj", layers=24, d_model=2048, n_heads=16, d_ff=8192, n_vocab=50400,
                      pe_rotary_dims=64, seq=2048),
    # Llama-3.2-1B's shape: 16 x 2048, 32 query / 8 kv heads of 64, SwiGLU 8192, vocabulary 128,256, tied
    "llama-1b": dict(family="llama", layers=16, d_model=2048, n_heads=32, n_kv_heads=8, d_ff=8192,
                     n_vocab=128256, tie_embeddings=True, rope_theta=500000.0, seq=2048),
    "llama-tiny": dict(family="llama", layers=2, d_model=256, n_heads=4, n_kv_heads=2, d_ff=512, n_vocab=1000,
                       seq=256),
}
# Dense bf16 matmul peaks published by the vendors (FLOP/s), by the device_kind JAX reports.
PUBLISHED_PEAK = {"NVIDIA H100 80GB HBM3": 989.4e12, "NVIDIA H100": 989.4e12, "NVIDIA H200": 989.4e12,
                  "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA A100-SXM4-40GB": 312e12}


def machine() -> dict:
    """The host and software as every bench script reports them (bench/machine.py), plus the accelerator."""
    import jax
    from bench import machine as host
    return {**host.describe(), "accelerator": {"device": jax.devices()[0].device_kind,
                                               "backend": jax.default_backend(), "devices": jax.device_count()}}


def timed(fn, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of fn (which blocks until its result is ready)."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def measure_peak(n: int = 8192, repeats: int = 5, per_timing: int = 10) -> dict:
    """Measured bf16 matmul FLOP/s ([n, n] x [n, n], float32 accumulation) and copy bandwidth.

    Each timing covers `per_timing` calls back to back, after two such blocks as a warm-up: timed
    one call at a time from a cold start, an H200's 8192^3 product measured 540-674 TFLOP/s from
    run to run, where this machine kind's notes give 769-798 for a warm one."""
    import jax
    import jax.numpy as jnp
    a, b = (jax.random.normal(jax.random.key(i), (n, n), jnp.bfloat16) for i in (0, 1))
    matmul = jax.jit(lambda x, y: x @ y)
    buf = jnp.ones((2 ** 30 // 4,), jnp.float32)  # 1 GiB
    copy = jax.jit(lambda x: x * 1.0001)  # reads and writes every byte once

    def block(fn, *args):
        def run():
            for _ in range(per_timing):
                out = fn(*args)
            out.block_until_ready()
        run(), run()
        return min(timed(run, repeats)) / per_timing
    best, best_copy = block(matmul, a, b), block(copy, buf)
    kind = jax.devices()[0].device_kind
    return {"matmul_flops": 2 * n ** 3 / best, "published_flops": PUBLISHED_PEAK.get(kind),
            "copy_bytes_per_s": 2 * buf.nbytes / best_copy}


OVERRIDES: dict = {}  # --set key=value: config keys over every preset's


def model_config(preset: str, **overrides):
    from mesh_transformer.config import config_from_dict
    raw = {**PRESETS[preset], "compute_dtype": "bfloat16", "lr": 1e-4, "warmup_steps": 10, "anneal_steps": 1000,
           "total_steps": 1000, **OVERRIDES, **overrides}
    return config_from_dict(raw)


def autodiff_normalizer_and_target(logits, targets):
    """The loss's (logsumexp, target logit) differentiated by JAX, not by its own one-pass backward
    (train/loss.py normalizer_and_target): the A/B's other side."""
    from mesh_transformer.train import loss
    return loss.log_normalizer(logits), loss.target_logits(logits, targets)


def bench_train(preset: str, batch: int, remat: str, attention: str, steps: int, peak: dict,
                profile: Optional[str] = None, loss: str = "fused") -> dict:
    from mesh_transformer.train import loss as losses
    own = losses.normalizer_and_target
    if loss == "autodiff":
        losses.normalizer_and_target = autodiff_normalizer_and_target
    try:
        return _bench_train(preset, batch, remat, attention, steps, peak, profile, loss)
    finally:
        losses.normalizer_and_target = own


def _bench_train(preset, batch, remat, attention, steps, peak, profile, loss) -> dict:
    import jax
    from mesh_transformer import parallel
    from mesh_transformer.train.step import Trainer
    config = model_config(preset, per_replica_batch=batch, remat=remat, attention_impl=attention)
    m = config.model
    trainer = Trainer(config, parallel.make_mesh(1, 1, jax.devices()[:1]))
    state = trainer.init_state(0)
    tokens = np.random.RandomState(0).randint(0, m.n_vocab, (1, batch, m.seq + 1)).astype(np.int32)
    data = trainer.shard_batch({"tokens": tokens})
    t0 = time.perf_counter()
    state, metrics = trainer.step(state, data)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0
    state, metrics = trainer.step(state, data)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = trainer.step(state, data)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    step_s = float(np.median(times))
    tokens_per_s = batch * m.seq / step_s
    flops = m.flops_per_token()
    mem = jax.devices()[0].memory_stats() or {}
    row = {"preset": preset, "params": m.n_params(), "batch": batch, "seq": m.seq, "remat": remat,
           "attention": attention, "loss_backward": loss, "scan_layers": m.scan_layers, "compile_s": compile_s, "step_s": step_s,
           "step_s_min_max": [min(times), max(times)], "tokens_per_s": tokens_per_s,
           "flops_per_token": flops, "loss": float(metrics["loss"]),
           "mfu_measured_peak": tokens_per_s * flops / peak["matmul_flops"],
           "peak_bytes_in_use": mem.get("peak_bytes_in_use")}
    if peak.get("published_flops"):
        row["mfu"] = tokens_per_s * flops / peak["published_flops"]
    if profile:  # one more step under the profiler: the device's time per kernel name
        trace_dir = os.path.join(profile, f"train_{preset}_b{batch}_{remat}_{attention}_{loss}_{m.scan_layers}")
        jax.profiler.start_trace(trace_dir)
        state, metrics = trainer.step(state, data)
        jax.block_until_ready(metrics)
        jax.profiler.stop_trace()
        row["kernels"] = kernel_summary(trace_dir, 1, top=40)
    del state, data
    return row


def bench_decode(preset: str, batches: list[int], prompt: int, new: int, peak: dict, fuses=(True,),
                 profile: Optional[str] = None, repeats: int = 3) -> list[dict]:
    """Rows of decode timings, one per (batch, fuse): every layout's Generator is built first from
    the same weights, then their runs alternate (min of `repeats` each), so an A/B sees the same
    device state."""
    import jax
    from mesh_transformer import parallel
    from mesh_transformer.generate import Batch, Generator, SamplingOptions
    from mesh_transformer.train.step import Trainer
    config = model_config(preset, remat="none")
    m = config.model
    mesh = parallel.make_mesh(1, 1, jax.devices()[:1])
    params = Trainer(config, mesh).init_state(0).params
    gens = {fuse: Generator(m, params, mesh, donate=i == len(fuses) - 1, fuse=fuse) for i, fuse in enumerate(fuses)}
    del params
    some = next(iter(gens.values()))
    weight_bytes = some.weight_bytes
    rows = []
    rng = np.random.RandomState(0)
    options = SamplingOptions(max_new_tokens=new, temperature=0.0)
    for batch in batches:
        def once(gen, trace_dir=None):
            seqs = gen.sequences(rng.randint(0, m.n_vocab, (batch, prompt)).tolist(), options)
            b = Batch.for_sequences(gen, seqs, chunk=None)
            b.admit(seqs)
            jax.effects_barrier()
            if trace_dir:
                jax.profiler.start_trace(trace_dir)
            t0 = time.perf_counter()
            b.step()
            took = time.perf_counter() - t0
            if trace_dir:
                jax.profiler.stop_trace()
            return took
        times = {fuse: [] for fuse in fuses}
        for gen in gens.values():
            once(gen)
        for _ in range(repeats):
            for fuse, gen in gens.items():
                times[fuse].append(once(gen))
        for fuse, gen in gens.items():
            step_s = min(times[fuse]) / (new - 1)
            kernels = None
            if profile:  # one more run under the profiler: the device's time per kernel name, per step
                trace_dir = os.path.join(profile, f"{preset}_b{batch}_{'fused' if fuse else 'apart'}")
                once(gen, trace_dir)
                kernels = kernel_summary(trace_dir, new - 1)
            # the cache read by an average step: keys and values of every layer up to the middle of the run
            kv_bytes = batch * some.slot_bytes * (prompt + new / 2)
            read = weight_bytes + kv_bytes
            rows.append({"preset": preset, "fused": fuse, "batch": batch, "prompt": prompt, "new": new,
                         "weight_GB": weight_bytes / 1e9, "kv_GB": kv_bytes / 1e9, "step_ms": 1e3 * step_s,
                         "step_ms_all": [1e3 * t / (new - 1) for t in times[fuse]], "tokens_per_s": batch / step_s,
                         "bandwidth_share": read / step_s / peak["copy_bytes_per_s"],
                         "read_bytes_per_s": read / step_s, **({"kernels": kernels} if kernels else {})})
    return rows


def kernel_summary(trace_dir: str, steps: int, top: int = 25) -> dict:
    """The device's time in a profiler trace (`jax.profiler`'s *.trace.json.gz) by kernel name, per
    decode step: {"device_us_per_step", "kernels_per_step", "top": [[name, calls/step, us/step]]}.
    Device events are those of a process named for a GPU/TPU (on a CPU, XLA's op threads)."""
    import glob
    import gzip
    path, = glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.trace.json.gz"))
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, name in names.items() if "GPU" in name or "TPU" in name} or set(names)
    by_name: dict = {}
    what: dict = {}  # an event's args per name (the HLO op it runs, on a GPU)
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in device and "dur" in e:
            calls, us = by_name.get(e["name"], (0, 0.0))
            by_name[e["name"]] = (calls + 1, us + float(e["dur"]))
            what.setdefault(e["name"], json.dumps(e.get("args", {}))[:400])
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    kinds: dict = {}
    for name, (calls, us) in by_name.items():
        kind = kernel_kind(name, what[name])
        kinds[kind] = kinds.get(kind, 0.0) + us / steps
    return {"device_us_per_step": sum(us for _, us in by_name.values()) / steps,
            "us_per_step_by_kind": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "kernels_per_step": sum(c for c, _ in by_name.values()) / steps,
            "top": [[name[:120], calls / steps, us / steps, what[name]] for name, (calls, us) in ranked[:top]]}


def kernel_kind(name: str, args: str) -> str:
    """A kernel's kind by its name and profiler args: matrix product, flash attention, or other."""
    import re
    text = f"{name} {args}".lower()
    if re.search(r"fmha|flash|sdpa|dot_product_attention|cudnn", text):
        return "attention"
    if re.search(r"gemm|cutlass|xmma|nvjet|cublas|sm90_|triton_gemm|dot", name.lower()):
        return "matmul"
    if re.search(r"reduce|reduction", text):
        return "reduction"
    if re.search(r"copy|transpose|memcpy|memset|dynamic.update.slice|dynamic.slice", text):
        return "copy"
    return "elementwise"


def _brief(row: dict) -> dict:
    """A result row to print: a profile's kernels by kind, not each kernel (the --json file has them)."""
    if "kernels" not in row:
        return row
    k = row["kernels"]
    return {**{key: v for key, v in row.items() if key != "kernels"}, "device_us": k["device_us_per_step"],
            "kernels_per_step": k["kernels_per_step"], "us_by_kind": k["us_per_step_by_kind"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["train", "decode", "peak", "all"])
    p.add_argument("--preset", nargs="+", default=["llama-1b", "gptj-1.3b"], choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, nargs="+", default=[8])
    p.add_argument("--remat", nargs="+", default=["dots"])
    p.add_argument("--attention", nargs="+", default=["cudnn"])
    p.add_argument("--loss", nargs="+", default=["fused"], choices=["fused", "autodiff"],
                   help="train: the cross-entropy's backward, its own one pass (fused) or JAX's autodiff of it")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="decode: timed runs of each layout, alternating")
    p.add_argument("--profile", metavar="DIR", help="one more training step, or decode run of each batch, under "
                   "jax.profiler, traces here; prints the device's time per kernel name per step")
    p.add_argument("--fuse", nargs="+", default=["on"], choices=["on", "off"],
                   help="decode with q/k/v (and gate/up) fused into one weight (Generator(fuse=...)); both: an A/B")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=JSON", help="override config keys of every preset")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    OVERRIDES.update({k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.set)})

    info = machine()
    print(json.dumps(info))
    peak = measure_peak()
    published = peak["published_flops"]
    print(f"bf16 matmul: {peak['matmul_flops'] / 1e12:.0f} TFLOP/s measured"
          + (f", {published / 1e12:.0f} published" if published else "")
          + f"; copy bandwidth {peak['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write)", flush=True)
    results = {"machine": info, "peak": peak, "overrides": OVERRIDES, "train": [], "decode": []}
    if args.what in ("train", "all"):
        for preset in args.preset:
            for batch in args.batch:
                for remat, attention, loss in itertools.product(args.remat, args.attention, args.loss):
                    try:
                        row = bench_train(preset, batch, remat, attention, args.steps, peak, args.profile, loss)
                    except Exception as e:  # out of memory for one variant: report it, go on
                        row = {"preset": preset, "batch": batch, "remat": remat, "attention": attention,
                               "loss_backward": loss, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
                    results["train"].append(row)
                    print(json.dumps(_brief(row)), flush=True)
    if args.what in ("decode", "all"):
        for preset in args.preset:
            for row in bench_decode(preset, args.decode_batches, args.prompt, args.new, peak,
                                    [f == "on" for f in args.fuse], args.profile, args.repeats):
                results["decode"].append(row)
                print(json.dumps(_brief(row)), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
