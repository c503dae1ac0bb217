"""Where a training step's time goes: the JAX profiler over a few steps, summed per XLA operation.

    .venv/bin/python bench/profile_train.py [--mp 1] [--steps 3] [--top 25] [--json]
                                            [--layers 4 --d-model 512 --vocab 50257 --seq 256 --batch 4]

Builds bench/train_throughput.py's model and step, runs `--warmup` steps (8), traces `--steps` more
with `jax.profiler.trace`, and adds up the time of every XLA:CPU operation (thunk) over the trace.
Each row names the operation, its HLO kind (dot, loop/input fusion, copy, ...), its output shape and
the JAX code it came from (the op_name metadata), so the non-matmul time is easy to attribute: the
vocabulary head and cross-entropy, element-wise fusions, layout copies. Times are wall time per
step of that operation; with mp > 1 the devices run side by side, so the rows add up to more than
the step.
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import machine  # noqa: E402
import train_throughput  # noqa: E402

HLO_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+) = (?P<shape>\S+(?: \S+)*?) (?P<op>[\w\-]+)\(")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mp", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=8,
                   help="untraced steps first: the heap grows to its peak over the first few (host_memory)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--trace-dir", help="keep the trace here (default: a temporary directory)")
    args, rest = p.parse_known_args()
    model = train_throughput.parse_args(rest)
    for key, value in vars(model).items():
        setattr(args, key, getattr(args, key, value))
    return args


def hlo_ops(text: str) -> dict:
    """{instruction name: (op kind, output shape, op_name metadata)} from an HLO module's text."""
    ops = {}
    for line in text.splitlines():
        m = HLO_LINE.match(line)
        if not m:
            continue
        kind = m["op"]
        fusion_kind = re.search(r"kind=(k\w+)", line)
        if kind == "fusion" and fusion_kind:
            kind = f"fusion:{fusion_kind[1][1:]}"
        meta = re.search(r'op_name="([^"]*)"', line)
        ops[m["name"]] = (kind, m["shape"].split("{")[0], meta[1] if meta else "")
    return ops


def xla_events(directory: str):
    """(line name, event name, duration in ns) of every event on the host's XLA lines of the trace in `directory`."""
    from jax.profiler import ProfileData
    path = sorted(glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True))[-1]
    for plane in ProfileData.from_file(path).planes:
        for line in plane.lines:
            for event in line.events:
                yield line.name, event.name, event.duration_ns


def trace_events(directory: str) -> collections.Counter:
    """Total duration (ns) of each event name on the host's XLA lines of the trace in `directory`."""
    totals: collections.Counter = collections.Counter()
    for line, name, ns in xla_events(directory):
        totals[(line, name)] += ns
    return totals


def main():
    args = parse_args()
    from mesh_transformer import host_memory
    host_memory.keep_freed_memory()  # as device_train.py and bench/train_throughput.py do
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.mp}"
    description = machine.describe()
    import jax
    import numpy as np

    trainer = train_throughput.make_trainer(args, args.mp)
    tokens = np.random.RandomState(0).randint(0, args.vocab, (1, args.batch, args.seq + 1)).astype(np.int32)
    batch = trainer.shard_batch({"tokens": tokens})
    state = trainer.init_state(0)
    compiled = trainer.step.lower(state, batch).compile()
    ops = hlo_ops(compiled.as_text())
    for _ in range(args.warmup):
        state, metrics = trainer.step(state, batch)
        jax.block_until_ready(metrics)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = args.trace_dir or tmp
        with jax.profiler.trace(tmp):
            faults, t0 = machine.minor_faults(), time.perf_counter()
            for _ in range(args.steps):
                state, metrics = trainer.step(state, batch)
            jax.block_until_ready(metrics)
            step_s = (time.perf_counter() - t0) / args.steps
            faulted_mb = (machine.minor_faults() - faults) * machine.PAGE / 2**20 / args.steps
        totals = trace_events(tmp)
    rows = []
    for (line, name), ns in totals.items():
        if name in ops:
            kind, shape, source = ops[name]
            rows.append({"op": name, "kind": kind, "shape": shape, "source": source, "line": line,
                         "ms_per_step": ns / 1e6 / args.steps})
    rows.sort(key=lambda r: -r["ms_per_step"])
    by_kind: collections.Counter = collections.Counter()
    for r in rows:
        by_kind[r["kind"].split(":")[0] if not r["kind"].startswith("fusion") else r["kind"]] += r["ms_per_step"]
    results = {"config": vars(args), "step_ms": 1e3 * step_s, "faulted_mb_per_step": faulted_mb, "ops_ms_total": sum(r["ms_per_step"] for r in rows),
               "by_kind_ms": dict(by_kind.most_common()), "top": rows[: args.top]}

    def text():
        print(f"step {1e3 * step_s:.0f} ms (mp={args.mp}, {args.steps} traced steps after {args.warmup}; fresh memory "
              f"touched {faulted_mb:.0f} MB a step); XLA ops sum to {results['ops_ms_total']:.0f} ms per step")
        print("by kind: " + ", ".join(f"{k} {v:.0f} ms" for k, v in by_kind.most_common(8)))
        for r in rows[: args.top]:
            print(f"{r['ms_per_step']:8.1f} ms  {r['kind']:18s} {r['op']:28s} {r['shape']:28s} {r['source'][-70:]}")
    machine.report(description, results, args.json, text)


if __name__ == "__main__":
    main()
