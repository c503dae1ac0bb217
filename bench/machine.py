"""What every benchmark here says first: the machine, the software, the load; and the interleaved runner.

    from machine import add_args, describe, interleaved, report   # bench/ scripts import it by name

A benchmark's numbers only mean something next to what they ran on: the CPU and the flags its
kernels use (AVX-512, AVX-512-BF16 and AMX change which paths oneDNN and XLA:CPU take), the cores,
the memory, the library versions and XLA_FLAGS, and the load average while it ran (this machine may
be shared). `describe()` collects that; `header()` prints it; `report()` prints the text or, with
`--json`, one JSON object holding the same and the results.

`interleaved()` runs every side of a comparison in turn, round after round (ours, peer, ours,
peer, ...), so a change of load in the middle hits both alike, and summarises each side as
median and min-max over the rounds. A side can run in this process (a callable) or in a process of
its own (`Apart`): its own heap and malloc setting, as for a user who runs only that program.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
import traceback
from typing import Callable, Mapping

FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
PACKAGES = ("jax", "jaxlib", "torch", "transformers")


# (vendor, family, first model, last model) -> core generation. A VM often names its CPU only "AMD
# EPYC": two such machines of this project's kind ran the same matmul at 173 and 492 GFLOP/s, and the
# family/model numbers are what tells them apart (Zen 4 runs AVX-512 on 256-bit halves, Zen 5 not).
# Family 23 model 1 is Zen 1 (Naples), and also what QEMU's generic "EPYC" CPU model reports; the
# one seen here (L2 512K, L3 8M: that model's cache table) multiplied fp32 at 67 GFLOP/s on 2 cores,
# Zen 1's two 128-bit FMA pipes at 2 GHz, so its name holds.
GENERATIONS = (
    ("AuthenticAMD", 23, 0x00, 0x2F, "Zen 1"), ("AuthenticAMD", 23, 0x30, 0x3F, "Zen 2"),
    ("AuthenticAMD", 25, 0x00, 0x0F, "Zen 3"), ("AuthenticAMD", 25, 0x10, 0x1F, "Zen 4"),
    ("AuthenticAMD", 25, 0x20, 0x5F, "Zen 3"),
    ("AuthenticAMD", 25, 0x60, 0xAF, "Zen 4"), ("AuthenticAMD", 26, 0x00, 0xFF, "Zen 5"),
    ("GenuineIntel", 6, 0x55, 0x55, "Skylake/Cascade Lake"), ("GenuineIntel", 6, 0x6A, 0x6C, "Ice Lake"),
    ("GenuineIntel", 6, 0x8F, 0x8F, "Sapphire Rapids"), ("GenuineIntel", 6, 0xCF, 0xCF, "Emerald Rapids"),
    ("GenuineIntel", 6, 0xAD, 0xAE, "Granite Rapids"),
)


def generation(vendor: str, family: int, model: int) -> str:
    """The core generation of a (vendor, family, model) triple from /proc/cpuinfo, or '' if not known here."""
    return next((name for v, f, lo, hi, name in GENERATIONS if (v, f) == (vendor, family) and lo <= model <= hi), "")


def cpu() -> dict:
    """{"model", "vendor", "family", "model_number", "generation", "flags" (those of FLAGS it has), "cores"
    (usable by this process), "memory_gib", "l2"/"l3"}."""
    info: dict = {"model": platform.processor() or platform.machine(), "flags": []}
    fields = {"model name": "model", "vendor_id": "vendor", "cpu family": "family", "model": "model_number"}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in fields:
                    info[fields[key]] = int(value) if key in ("cpu family", "model") else value.strip()
                elif key == "flags":
                    have = set(value.split())
                    info["flags"] = [flag for flag in FLAGS if flag in have]
                    break
    except (OSError, ValueError):
        pass
    info["generation"] = generation(info.get("vendor", ""), info.get("family", -1), info.get("model_number", -1))
    info["cores"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    info.update(_caches())
    return info


def _caches() -> dict:
    """L2 and L3 sizes of cpu0 as the kernel reports them ("1024K"), where it does."""
    out = {}
    root = "/sys/devices/system/cpu/cpu0/cache"
    for index in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        try:
            with open(f"{root}/{index}/level") as f:
                level = f.read().strip()
            with open(f"{root}/{index}/size") as f:
                size = f.read().strip()
        except OSError:
            continue
        if level in ("2", "3"):
            out[f"l{level}"] = size
    return out


def software(extra: tuple[str, ...] = ()) -> dict:
    """Versions of the packages that decide the numbers (read from their metadata: nothing is imported)."""
    versions = {"python": platform.python_version()}
    for name in PACKAGES + tuple(extra):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {"versions": versions, "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
            "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", ""),
            "MESH_TRANSFORMER_KERNELS": os.environ.get("MESH_TRANSFORMER_KERNELS", "1"),
            "MESH_TRANSFORMER_KERNEL_ISA": os.environ.get("MESH_TRANSFORMER_KERNEL_ISA", "")}


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def kind(info: Mapping) -> str:
    """A short name for the README's rows: '2-core AMD EPYC 7B13 (Zen 3; AVX2)', '... (AVX-512, AVX-512-BF16, AMX)'."""
    flags = info["flags"]
    isa = ["AMX"] if "amx_tile" in flags else []
    isa = (["AVX-512"] + (["AVX-512-BF16"] if "avx512_bf16" in flags else []) + isa) if "avx512f" in flags else \
        (["AVX2"] if "avx2" in flags else [])
    generation = f"{info['generation']}; " if info.get("generation") else ""
    return f"{info['cores']}-core {info['model']} ({generation}{', '.join(isa) or 'no AVX2'})"


def describe(extra_packages: tuple[str, ...] = ()) -> dict:
    """Everything above, as one JSON-ready dict (call it at the start; `report` adds the load at the end)."""
    info = cpu()
    return {"machine": {**info, "kind": kind(info)}, "software": software(extra_packages),
            "load_average": {"start": load_average()}, "argv": sys.argv}


def header(description: Mapping) -> str:
    """The lines a text report starts with."""
    m, s = description["machine"], description["software"]
    versions = ", ".join(f"{k} {v}" for k, v in s["versions"].items() if v)
    caches = ", ".join(f"{k.upper()} {m[k]}" for k in ("l2", "l3") if k in m)
    loads = " -> ".join(" ".join(f"{x:.2f}" for x in v) for v in description["load_average"].values())
    cpuid = (f" ({m['generation'] or 'family'} {m['family']}/{m['model_number']})" if "family" in m else "")
    return (f"machine: {m['model']}{cpuid}; {m['cores']} cores; {m['memory_gib']} GiB; flags: {' '.join(m['flags']) or '-'}"
            f"{'; ' + caches if caches else ''}\n"
            f"software: {versions}; XLA_FLAGS={s['XLA_FLAGS']!r}"
            f"{'; MESH_TRANSFORMER_KERNELS=0' if s.get('MESH_TRANSFORMER_KERNELS') == '0' else ''}"
            f"{'; MESH_TRANSFORMER_KERNEL_ISA=' + s['MESH_TRANSFORMER_KERNEL_ISA'] if s.get('MESH_TRANSFORMER_KERNEL_ISA') else ''}\n"
            f"load average (1/5/15 min): {loads}")


def summary(values: list[float]) -> dict:
    """{"median", "min", "max", "runs"} of one side's measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": list(values)}


def interleaved(sides: Mapping[str, Callable[[], float]], rounds: int, progress: bool = False,
                faults: bool = False) -> dict:
    """Call each side once per round, in turn, `rounds` rounds -> {side: summary of its values}.

    Each callable measures once and returns a number (a rate, or seconds); warm-up and compilation
    belong before the first round. `faults`: also report the fresh memory each measurement touched
    in the process it ran in (minor page faults x page size, MB per round: "faulted_mb"; an `Apart`
    side counts its own process's), which the kernel zero-fills on the way — a cost that belongs to
    the allocator, not to the computation (mesh_transformer/host_memory.py)."""
    values: dict[str, list[float]] = {name: [] for name in sides}
    faulted: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(rounds):
        for name, measure in sides.items():
            count = getattr(measure, "minor_faults", minor_faults)
            before = count()
            values[name].append(measure())
            faulted[name].append((count() - before) * PAGE / 2**20)
            if progress:
                touched = f", faulted {faulted[name][-1]:.0f} MB" if faults else ""
                print(f"  round {r + 1}/{rounds} {name:32s} {values[name][-1]:12.2f}   (load {load_average()[0]:.2f}{touched})",
                      file=sys.stderr, flush=True)
    return {name: {**summary(v), **({"faulted_mb": faulted[name]} if faults else {})} for name, v in values.items()}


class Apart:
    """A side of `interleaved` that runs in a process of its own, started here and kept for every
    round: its own heap, its own malloc setting and XLA_FLAGS, as for a user who runs only that
    program. `build(*args)` (a module-level function) runs there after `env` is set and returns the
    side's measure callable (compile and warm up inside it); calling this object measures once
    there. Starting waits until the side is built, so sides are built one after another."""

    def __init__(self, name: str, build: Callable, *args, env: Mapping[str, str] | None = None):
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no jax, torch or heap of ours
        self.name = name
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve_side, args=(child, dict(env or {}), build, args), daemon=True)
        self._process.start()
        child.close()
        self._faults = self._receive()

    def __call__(self) -> float:
        self._conn.send("measure")
        value, self._faults = self._receive()
        return value

    def minor_faults(self) -> int:
        """The side's process's minor page faults as of its last measurement."""
        return self._faults

    def close(self) -> None:
        if self._process.is_alive():
            self._conn.send(None)
        self._process.join(timeout=60)

    def _receive(self):
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self._process.join(timeout=10)
            raise RuntimeError(f"benchmark side {self.name!r}: its process died (exit code {self._process.exitcode}; "
                               "out of memory?)") from None
        if kind == "error":
            raise RuntimeError(f"benchmark side {self.name!r} failed in its process:\n{payload}")
        return payload


def _serve_side(conn, env: dict, build: Callable, args: tuple) -> None:
    """`Apart`'s process: build the side, then measure whenever asked, until told to stop (None)."""
    os.environ.update(env)
    try:
        measure = build(*args)
        conn.send(("ready", minor_faults()))
        while conn.recv() is not None:
            value = measure()
            conn.send(("value", (value, minor_faults())))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it with the side's name
        conn.send(("error", traceback.format_exc()))


PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def settle(step: Callable[[], object], warmup: int = 2, quiet: int = 3, most: int = 24) -> None:
    """Run `warmup` steps, and more (up to `most` in all) until `quiet` steps in a row touch no fresh
    memory (under 16 MB of page faults): a process's heap grows to its peak over its first steps, by
    fragmentation, now and then after several quiet ones (mesh_transformer/host_memory.py), and a
    step that grows it by GBs takes 3x as long."""
    in_a_row = 0
    for done in range(1, most + 1):
        faults = minor_faults()
        step()
        in_a_row = in_a_row + 1 if (minor_faults() - faults) * PAGE < 16 << 20 else 0
        if done >= warmup and in_a_row >= quiet:
            return


def minor_faults() -> int:
    """This process's minor page faults so far (0 where unknown)."""
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    except (ImportError, OSError):
        return 0


def per_call(fn: Callable[[], object], calls: int, scale: float = 1e3) -> Callable[[], float]:
    """A side for `interleaved`: each measurement calls `fn` `calls` times, waits for the last
    result (JAX arrays are asynchronous) and returns the time a call, in seconds x `scale` (ms)."""
    def measure() -> float:
        import jax
        start = time.perf_counter()
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / calls * scale
    return measure


def fmt(s: Mapping, digits: int = 0) -> str:
    """'median (min-max)' of a summary."""
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def add_args(parser: argparse.ArgumentParser, rounds: int | None = None) -> None:
    """--json (and --rounds, for scripts that interleave) on a script's parser."""
    parser.add_argument("--json", action="store_true", help="print one JSON object (machine, software, load, results)")
    if rounds is not None:
        parser.add_argument("--rounds", type=int, default=rounds,
                            help="interleaved rounds of every side; median and min-max are reported")


def report(description: dict, results: Mapping, as_json: bool, text: Callable[[], None] | None = None) -> None:
    """Print the header and `text()`'s lines, or one JSON object {description..., "results": results}."""
    description["load_average"]["end"] = load_average()
    if as_json:
        print(json.dumps({**description, "results": results}, indent=2, default=str))
        return
    print(header(description))
    if text is not None:
        text()
