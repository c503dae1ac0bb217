"""CPU kernels XLA:CPU lacks, as XLA FFI custom calls compiled from source on first use.

All for decoding, in `rows_times_weight.cc` (which says why XLA:CPU's own are slower there):
`rows_times_weight`, the product of a few float32 rows and a bfloat16, float32 or int8 weight at
the machine's memory bandwidth, and of a serving batch's rows (32-64, float32) register-blocked
(`layers.product` calls it where `applies` says so), and `bf16_rows_times_weight`, 1-64 bf16 rows
times a bf16 weight as AVX-512-BF16 pair dot products where the CPU has them; `rows_dot_weight`,
1-64 rows times an inputs-last weight [O, K] (float32, or bf16 as pair products: `dot_applies`);
`grouped_rows_times_weight`, the few-row
product per (row, kv head) group, for attention over the KV cache (`grouped_applies`);
`update_slice` (in place), `slice`, `take_rows` and `put_slots` (in place): a KV cache's slices, an
embedding table's rows and a prefix cache's slots moved without XLA:CPU's copies of the whole array
(`layers.update_slice`, `layers.take_rows`, `generate.decode`'s admission). In `sampling.cc`:
`truncation_floor`, each row's top-k/top-p threshold without sorting or bisecting the vocabulary
(`generate.sampling.top_k_top_p`). In `attention.cc`: `attention`, a prefill's attention over its
own keys and a shared prefix's with the softmax fused in, tile by tile (`layers.Attention._attend`).
The register-blocked product tiles they share are `tiles.h`'s.

The sources are compiled into one library with the system's C++ compiler (`$CXX`, else
`c++`/`g++`/`clang++`) against the FFI headers jaxlib ships, once per source/jaxlib/compiler, into
`$MESH_TRANSFORMER_KERNEL_CACHE` (default `~/.cache/mesh_transformer/kernels`, see `cache_dir`):
a few seconds, and later processes load the cached library. Where there is no compiler or the build fails, a warning
says why and the model runs XLA's own products (slower, the same numbers up to summation order);
`MESH_TRANSFORMER_KERNELS=0` turns the kernels off.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

FOLDER = Path(__file__).parent
SOURCES = (FOLDER / "rows_times_weight.cc", FOLDER / "sampling.cc", FOLDER / "attention.cc")  # one library
HEADERS = (FOLDER / "amx.h", FOLDER / "threads.h", FOLDER / "tiles.h")


class Kernel(NamedTuple):
    """A weight dtype's product: its FFI target, the library's handler symbol, and the row counts
    it runs streamed (weights read once at memory speed, threads splitting the weight's rows) and
    register-blocked (threads taking panels of columns; None: XLA's products are faster)."""

    target: str
    symbol: str
    streamed: Optional[tuple[int, int]]
    blocked: Optional[tuple[int, int]] = None

    def runs(self, rows: int) -> bool:
        return any(low <= rows <= high for low, high in filter(None, (self.streamed, self.blocked)))


KERNELS = {
    jnp.dtype(jnp.bfloat16): Kernel("mesh_transformer_bf16_rows_times_weight", "MeshTransformerBf16RowsTimesWeight",
                                    streamed=(1, 8)),
    jnp.dtype(jnp.float32): Kernel("mesh_transformer_f32_rows_times_weight", "MeshTransformerF32RowsTimesWeight",
                                   streamed=(2, 8), blocked=(32, 64)),
    # int8 weights (`Generator(quantize="int8")`): every row count a decode step has, since XLA's
    # product would first convert the whole weight; more rows (a prefill) convert it once instead.
    jnp.dtype(jnp.int8): Kernel("mesh_transformer_i8_rows_times_weight", "MeshTransformerI8RowsTimesWeight",
                                streamed=(1, 8), blocked=(9, 64)),
}
# Row counts, measured on the AVX-512 EPYC (16 chained [r, 1024] x [1024, 4096] products, weights
# out of cache): bf16 1-8 rows in 3.4-6.7 ms against XLA's 7.3-8.5 (YNNPACK; 73 ms at one row),
# float32 2-8 rows in 6.9-9.3 ms against 8.3-10.6; from 12 rows on XLA's are faster (the kernel
# loads and stores its partial product once per row per pass). One float32 row stays XLA's
# matrix-vector product, as fast as the kernel (6.5 vs 6.9 ms). Blocked, float32: 16 / 24 rows
# 10.3 / 12.4 ms against XLA's 9.3 / 11.7 (weight-bound: XLA overlaps reading and computing
# better), 32 / 64 rows 15.3 / 23.1 ms (280 / 372 GFLOP/s) against 22.8 / 32.6 (the decode
# program's XLA:CPU matmuls; YNNPACK's 16.2 / 27.0), 128 rows 50.5 against YNNPACK's 45.9. bf16
# none: YNNPACK multiplies bf16 pairs (AVX-512-BF16), 7.1 / 13.5 ms at 16 / 64 rows against the
# kernel's float32 arithmetic, 10.0 / 24.3.
# Attention over a KV cache: per group (row and kv head) a few query rows times its keys or values.
# Since session 43 a decode step's attention is `attention` below (its decode path: one call a
# layer, 1.5-1.8x these two products and XLA's softmax between them); these run where that does
# not: ALiBi, and more than ATTENTION_FEW_ROWS query heads per kv head.
# float32 from 1 row: bench/decode.py's LLaMA-shaped model (grouped-query attention, 4 query heads
# per kv head), 16 / 64 rows, 492-504 -> 550-576 and 914-925 -> 1079-1104 tok/s. With one query
# per kv head (GPT-J), 8 x d_model 1024, Zen 4, 5 interleaved rounds (session 41): batch 1 / 4 / 16
# 44.2-45.6 -> 45.4-46.8, 132.7 -> 139.1, 270-287 -> 297-300 tok/s (medians): XLA's batched dot
# of [heads, 1, d] x [heads, d, slots] ran ~50 us per call at one row, 16 calls a step; in a
# 16-row x 1024-slot serving batch the same (328 / 321).
GROUPED = {
    jnp.dtype(jnp.bfloat16): Kernel("mesh_transformer_bf16_grouped_rows_times_weight",
                                    "MeshTransformerBf16GroupedRowsTimesWeight", streamed=(1, 8)),
    jnp.dtype(jnp.float32): Kernel("mesh_transformer_f32_grouped_rows_times_weight",
                                   "MeshTransformerF32GroupedRowsTimesWeight", streamed=(1, 8)),
}
# bf16 rows times a bf16 weight (a bfloat16 model's decode step) as pair dot products
# (AVX-512-BF16's vdpbf16ps: two multiply-adds per float32 lane and instruction), streamed as the
# kernels above for 1-4 rows and register-blocked for 5-64, where the CPU has them (`bf16_pairs`;
# only there is it used: elsewhere the float32-row kernel and YNNPACK's bf16 products are faster).
# On the Zen 4 EPYC (16 chained [r, 1024] x [1024, 4096] products, weights out of cache): 1 / 2 /
# 4 rows streamed in 4.8 / 5.0 / 5.5 ms against the float32-row kernel's 5.4 / 6.2 / 6.2 (it is
# near compute-bound there: widening bf16 and an FMA per weight); 5 / 8 / 16 / 32 rows blocked in
# 8.1 / 9.8-10.6 / 12.2-13.4 / 18.1-20.2 ms against YNNPACK's 11.9 / 12.6-13.3 / 15.2-15.6 /
# 21.5-22.4 and the float32-row kernel's 9.4 / 15-19 / 47 / 100; 64 rows even (31-34 ms both).
BF16_ROWS = Kernel("mesh_transformer_bf16_rows_times_bf16_weight", "MeshTransformerBf16RowsTimesBf16Weight",
                   streamed=(1, 4), blocked=(5, 64))
# Inputs-last weights (`Generator(matvec=True)`; a tied embedding table as the head): x [B, K] times
# w [O, K], 1-64 rows, each output a dot product of contiguous rows read as 4 long streams, where the
# CPU has AVX-512 (float32) and AVX-512-BF16 (bf16 pair products; `dot_applies`). On the Zen 4 EPYC
# (16 chained [r, 1024] x [4096, 1024] products, weights out of cache): bf16 1 / 2 / 4 rows in
# 3.6-4.0 / 3.7 / 4.2 ms (34-37 GB/s) against the inputs-first pair kernel's 5.0-5.1 / 5.5 / 6.0 and
# XLA's 93 at one row; 8 / 16 / 32 / 64 rows 6.4 / 9.0 / 15.6 / 26.7 against the blocked pair
# kernel's 11.0 / 13.7 / 20.3 / 36.0. float32 1 / 2 / 4 rows 8.1 / 8.0 / 9.8 ms against XLA's 8.5 /
# 16.2 / 18.4 on the same weights and the inputs-first kernel's 10.6 / 11.1 / 11.2; 8 / 16 / 32 rows
# 13.5 / 17.2 / 27.9 against XLA's inputs-first 21.8 / 22.7 / 38.0. A tied head ([50304, 1024], 4
# chained) at 4-64 rows: float32 34-143 ms against YNNPACK's 54-188 and, in the float32 decode
# program (no YNNPACK), XLA's 330-944; bf16 13-79 against YNNPACK's 35-97. With the next block's
# rows fetched during a block's second pass (8 rows or more; session 38, a slower day, the two
# builds in alternating processes): bf16 8 / 16 rows 6.4 / 8.4 ms against 7.2 / 10.2, float32
# 16 / 32 rows 16.2 / 25.6 against 18.9 / 28.2. On an AMX Xeon (Emerald Rapids, 2 cores; session
# 68) bf16 from 4 rows runs as AMX tile products (amx.h): 16 chained [r, 1024] x [4096, 1024], 4 / 8
# / 16 / 32 / 64 rows in 9.9 / 11.8 / 12.1 / 15.9 / 25.8 ms against the pair products' 12.0 / 27.4 /
# 29.2 / 65.7 / 110 (1-2 rows stay pair products: 11-13 ms either way, memory-bound).
DOT = {jnp.dtype(jnp.float32): Kernel("mesh_transformer_f32_rows_dot_f32_weight", "MeshTransformerF32RowsDotF32Weight",
                                      streamed=(1, 64)),
       jnp.dtype(jnp.bfloat16): Kernel("mesh_transformer_bf16_rows_dot_bf16_weight",
                                       "MeshTransformerBf16RowsDotBf16Weight", streamed=(1, 64))}
DOT_BITS = {jnp.dtype(jnp.float32): 1, jnp.dtype(jnp.bfloat16): 2}  # of MeshTransformerDotKernels()
EXPERTS = {jnp.dtype(jnp.float32): ("mesh_transformer_f32_expert_rows_times_weight",
                                    "MeshTransformerF32ExpertRowsTimesWeight"),
           jnp.dtype(jnp.bfloat16): ("mesh_transformer_bf16_expert_rows_times_weight",
                                     "MeshTransformerBf16ExpertRowsTimesWeight"),
           jnp.dtype(jnp.int8): ("mesh_transformer_i8_expert_rows_times_weight",  # (int8 values: scaled after)
                                 "MeshTransformerI8ExpertRowsTimesWeight")}
EXPERT_WEIGHT_GRADIENT = ("mesh_transformer_expert_weight_gradient", "MeshTransformerExpertWeightGradient")
UPDATE_SLICE = ("mesh_transformer_update_slice", "MeshTransformerUpdateSlice")
SLICE = ("mesh_transformer_slice", "MeshTransformerSlice")
TAKE_ROWS = ("mesh_transformer_take_rows", "MeshTransformerTakeRows")
PUT_SLOTS = ("mesh_transformer_put_slots", "MeshTransformerPutSlots")
TRUNCATION_FLOOR = ("mesh_transformer_truncation_floor", "MeshTransformerTruncationFloor")
ATTENTION_FEW_ROWS = 16  # query rows of a row and kv head (G x T) that take attention.cc's decode path
ATTENTION = {jnp.dtype(jnp.float32): ("mesh_transformer_f32_attention", "MeshTransformerF32Attention"),
             jnp.dtype(jnp.bfloat16): ("mesh_transformer_bf16_attention", "MeshTransformerBf16Attention")}
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC")

_lock = threading.Lock()
_state: dict = {}


def enabled() -> bool:
    return os.environ.get("MESH_TRANSFORMER_KERNELS", "1") not in ("0", "false", "no", "")


def compiler() -> Optional[str]:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def cache_dir() -> Path:
    """$MESH_TRANSFORMER_KERNEL_CACHE, else ~/.cache/mesh_transformer/kernels, else (a home that
    cannot be written) a directory of this user's under the system's temporary directory."""
    if os.environ.get("MESH_TRANSFORMER_KERNEL_CACHE"):
        return Path(os.environ["MESH_TRANSFORMER_KERNEL_CACHE"])
    home = Path.home() / ".cache" / "mesh_transformer" / "kernels"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"mesh_transformer-kernels-{os.getuid()}"


def build(sources=SOURCES, out_dir: Optional[Path] = None) -> Path:
    """Compile `sources` (they may include this folder's headers) into one shared library (once:
    the file name hashes the sources and headers, jaxlib's version, the compiler and flags) -> its
    path. Raises RuntimeError saying what failed."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found ($CXX, c++, g++ or clang++)")
    sources = [Path(s) for s in sources]
    texts = [p.read_bytes() for p in (*sources, *HEADERS)]
    key = hashlib.sha256(b"\0".join([*texts, jax.lib.__version__.encode(), cxx.encode(),
                                     " ".join(FLAGS).encode()])).hexdigest()[:16]
    out_dir = Path(out_dir or cache_dir())
    library = out_dir / f"mesh_transformer_kernels-{key}.so"
    if library.exists():
        return library
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as scratch:  # built beside, then renamed: atomic
        built = Path(scratch) / library.name
        result = subprocess.run([cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", f"-I{FOLDER}", *map(str, sources),
                                 "-o", str(built)], capture_output=True, text=True)
        if result.returncode != 0:
            names = ", ".join(p.name for p in sources)
            raise RuntimeError(f"{cxx} could not compile {names}:\n{result.stderr[-2000:]}")
        os.replace(built, library)
    return library


def _load() -> bool:
    """Build and register the kernels once per process -> whether they are available."""
    with _lock:
        if "ok" not in _state:
            _state["ok"] = False
            if enabled():
                try:
                    library = ctypes.cdll.LoadLibrary(str(build()))
                    calls = [(k.target, k.symbol) for k in (*KERNELS.values(), *GROUPED.values(), BF16_ROWS, *DOT.values())]
                    calls += [UPDATE_SLICE, SLICE, TAKE_ROWS, PUT_SLOTS, TRUNCATION_FLOOR, *ATTENTION.values(),
                              *EXPERTS.values(), EXPERT_WEIGHT_GRADIENT]
                    for target, symbol in calls:
                        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
                    _state["pairs"] = bool(library.MeshTransformerBf16Pairs())
                    _state["dot"] = int(library.MeshTransformerDotKernels())
                    _state["amx"] = bool(library.MeshTransformerAmx())
                    _state["ok"] = True
                except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as error:
                    log.warning("CPU kernels unavailable, using XLA's products: %s", error)
        return _state["ok"]


def available() -> bool:
    """Whether the kernels run here: on CPU, enabled, built."""
    return jax.default_backend() == "cpu" and _load()


def bf16_pairs() -> bool:
    """Whether bf16 x bf16 products run as pair dot products here (AVX-512-BF16, no ISA forced by
    $MESH_TRANSFORMER_KERNEL_ISA), with the kernels available."""
    return available() and _state.get("pairs", False)


def amx() -> bool:
    """Whether inputs-last bf16 products of 4-64 rows (K a multiple of 32) run as AMX tile products
    here (`rows_dot_weight`; amx.h): a CPU with AMX-BF16 whose OS grants this process the tile
    state, no ISA forced by $MESH_TRANSFORMER_KERNEL_ISA (`avx512bf16`: the pair products instead)."""
    return available() and _state.get("amx", False)


def _call(target: str, like, shape, dtype, **options):
    """`jax.ffi.ffi_call(target, ...)` for one result of `shape`/`dtype` that varies over the mesh
    axes `like` does (inside shard_map), after making sure the kernels are loaded."""
    if not _load():
        raise RuntimeError("the CPU kernels are not available here (see the warning logged when loading them)")
    typed = jax.typeof(like)
    result = jax.ShapeDtypeStruct(shape, dtype, sharding=typed.sharding,
                                  manual_axis_type=getattr(typed, "manual_axis_type", None))
    return jax.ffi.ffi_call(target, result, **options)


MAX_PARTS = 8  # a few threads saturate a socket's memory bandwidth; each part is a [rows, O] float32 partial


def parts() -> int:
    """Threads one product splits its weight's rows over: the cores per local device, at most MAX_PARTS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_PARTS, cores // max(1, jax.local_device_count("cpu"))))


def applies(x, w) -> bool:
    """Whether `rows_times_weight(x, w)` will run: x [..., K] of as many rows as the weight dtype's
    kernel takes (or bf16 rows the pair kernel takes, `pairs_apply`), w a [K, O] matrix, on CPU,
    with the kernels built."""
    kernel = KERNELS.get(jnp.dtype(w.dtype))
    if kernel is None or w.ndim != 2:
        return False
    return (kernel.runs(math.prod(x.shape[:-1])) and available()) or pairs_apply(x, w)


def pairs_apply(x, w) -> bool:
    """Whether x [..., K] times w [K, O] runs as bf16 pair products (`BF16_ROWS`): both bfloat16,
    as many rows as it takes, on a CPU that has them."""
    bf16 = jnp.dtype(jnp.bfloat16)
    return (jnp.dtype(x.dtype) == bf16 and jnp.dtype(w.dtype) == bf16 and w.ndim == 2
            and BF16_ROWS.runs(math.prod(x.shape[:-1])) and bf16_pairs())


def rows_times_weight(x, w, n_parts: Optional[int] = None, blocked: Optional[bool] = None):
    """x [..., K] (any float dtype) times w [K, O] (bfloat16, float32 or int8) -> float32 [..., O]:
    the float32 product of the (widened) weight, summed in another order than XLA's (~1e-7 relative).
    bf16 rows times a bf16 weight as pair products where they apply (`pairs_apply`, unless
    `n_parts` or `blocked` ask for this kernel's paths); else streamed up to the kernel's `streamed`
    rows (`n_parts` threads, default `parts()`, take chunks of w's rows; their sums are added
    here), register-blocked beyond (or as `blocked` says)."""
    if n_parts is None and blocked is None and pairs_apply(x, w):
        return bf16_rows_times_weight(x, w)
    batch, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k).astype(jnp.float32)
    kernel = KERNELS[jnp.dtype(w.dtype)]
    blocked = rows.shape[0] > kernel.streamed[1] if blocked is None else blocked
    shape = (1 if blocked else n_parts or parts(), rows.shape[0], w.shape[1])
    partial = _call(kernel.target, rows, shape, jnp.float32)(rows, w, blocked=blocked)
    return partial.sum(0).reshape(*batch, w.shape[1])


def bf16_rows_times_weight(x, w, n_parts: Optional[int] = None, blocked: Optional[bool] = None):
    """x [..., K] times w [K, O], both bfloat16 -> float32 [..., O]: the exact products of the
    bf16 values summed in float32 (`BF16_ROWS`). Streamed up to its `streamed` rows (`n_parts`
    threads, default `parts()`, take chunks of w's rows; their sums are added here), register-
    blocked beyond, or as `blocked` says; on a CPU without AVX-512-BF16 always blocked, as float32
    tiles of the widened rows (the same numbers up to summation order)."""
    batch, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    if blocked is None:
        blocked = rows.shape[0] > BF16_ROWS.streamed[1]
    blocked = blocked or not bf16_pairs()
    shape = (1 if blocked else n_parts or parts(), rows.shape[0], w.shape[1])
    partial = _call(BF16_ROWS.target, rows, shape, jnp.float32)(rows, w, blocked=blocked)
    return partial.sum(0).reshape(*batch, w.shape[1])


def dot_kernel(dtype) -> bool:
    """Whether inputs-last weights of `dtype` multiply through `rows_dot_weight` here (float32 with
    AVX-512, bfloat16 with AVX-512-BF16; no ISA forced by $MESH_TRANSFORMER_KERNEL_ISA)."""
    bit = DOT_BITS.get(jnp.dtype(dtype))
    return bit is not None and available() and bool(_state.get("dot", 0) & bit)


def dot_applies(x, w) -> bool:
    """Whether `rows_dot_weight(x, w)` will run: x [..., K] of 1-64 rows and w [O, K] (inputs-last) of
    one dtype whose kernel runs here (`dot_kernel`)."""
    return (jnp.dtype(x.dtype) == jnp.dtype(w.dtype) and w.ndim == 2 and x.shape[-1] == w.shape[1]
            and jnp.dtype(w.dtype) in DOT and DOT[jnp.dtype(w.dtype)].runs(math.prod(x.shape[:-1]))
            and dot_kernel(w.dtype))


def rows_dot_weight(x, w):
    """x [..., K] times w [O, K] (inputs-last), both float32 or both bfloat16 -> float32 [..., O]:
    each output the dot product of a row of x and a row of w, summed in float32 (bf16: the exact
    products of the bf16 values, as pairs, or as AMX tile products where `amx` says so); another
    summation order than XLA's (~1e-7 relative)."""
    batch, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    call = _call(DOT[jnp.dtype(w.dtype)].target, rows, (rows.shape[0], w.shape[0]), jnp.float32)
    return call(rows, w).reshape(*batch, w.shape[0])


def grouped_applies(x, w) -> bool:
    """Whether `grouped_rows_times_weight(x, w)` will run: x [*G, M, K] with as many rows M as the
    weight dtype's kernel takes (`GROUPED`), w [*G, K, O] bfloat16 or float32 with the same leading
    group axes, on CPU, with the kernels built."""
    kernel = GROUPED.get(jnp.dtype(w.dtype))
    return (kernel is not None and x.ndim == w.ndim >= 3 and x.shape[:-2] == w.shape[:-2]
            and x.shape[-1] == w.shape[-2] and kernel.runs(x.shape[-2]) and available())


def grouped_rows_times_weight(x, w):
    """x [*G, M, K] times w [*G, K, O] (bfloat16 or float32), group by group -> float32 [*G, M, O]
    (attention's products over a KV cache, read in place: XLA:CPU converts a bf16 cache or hands
    each group to YNNPACK, and runs float32 groups of a few rows as many small matmuls)."""
    groups, (m, k), o = x.shape[:-2], x.shape[-2:], w.shape[-1]
    n = math.prod(groups)
    flat_x = x.reshape(n, m, k).astype(jnp.float32)
    call = _call(GROUPED[jnp.dtype(w.dtype)].target, flat_x, (n, m, o), jnp.float32)
    return call(flat_x, w.reshape(n, k, o)).reshape(*groups, m, o)


def experts_apply(rows, w) -> bool:
    """Whether `expert_rows_times_weight(rows, w, sizes)` will run: rows [M, K], w [E, K, O]
    float32, bfloat16 or int8, on CPU, with the kernels built."""
    return (jnp.dtype(w.dtype) in EXPERTS and rows.ndim == 2 and w.ndim == 3 and rows.shape[1] == w.shape[1]
            and available())


def expert_rows_times_weight(rows, w, sizes, blocked: bool = False):
    """rows [M, K] (sizes[e] rows for expert e in turn) times w [E, K, O] -> float32 [M, O]: what
    `jax.lax.ragged_dot` computes, each expert's weight read only for its own rows (XLA:CPU's
    ragged_dot multiplies every row by every expert). Per expert, a few rows stream the weight, more
    (or all, where `blocked`) are register-blocked (rows_times_weight.cc)."""
    rows = rows.astype(jnp.float32)
    call = _call(EXPERTS[jnp.dtype(w.dtype)][0], rows, (rows.shape[0], w.shape[2]), jnp.float32)
    return call(rows, w, sizes.astype(jnp.int32), blocked=blocked)


def expert_weight_gradient(rows, g, sizes, experts: int):
    """The gradient of `expert_rows_times_weight` for its weight: [E, K, O] float32, expert e's
    rows (transposed) times their rows of g [M, O] (zeros for an expert no row chose)."""
    xt = rows.astype(jnp.float32).T
    call = _call(EXPERT_WEIGHT_GRADIENT[0], xt, (experts, rows.shape[1], g.shape[1]), jnp.float32)
    return call(xt, g.astype(jnp.float32), sizes.astype(jnp.int32))


def _starts(x, starts):
    """int32 [rank] start indices, each negative one counted from the end (as lax's)."""
    starts = jnp.stack([jnp.asarray(s, jnp.int32) for s in starts]) if len(starts) else jnp.zeros(0, jnp.int32)
    return jnp.where(starts < 0, starts + jnp.asarray(x.shape, jnp.int32), starts)


def update_slice(x, update, starts):
    """`lax.dynamic_update_slice(x, update, starts)` (starts clamped as lax's), in place: the result
    aliases x's buffer and only `update` is copied (see `layers.update_slice` for what XLA:CPU's
    own update copied). On one device's arrays (inside `shard_map`, or a one-device mesh): a custom
    call is not partitioned over a mesh."""
    call = _call(UPDATE_SLICE[0], x, x.shape, x.dtype, input_output_aliases={0: 0})
    return call(x, update.astype(x.dtype), _starts(x, starts))


def slice(x, starts, sizes):  # noqa: A001 - the op's name
    """`lax.dynamic_slice(x, starts, sizes)` (starts clamped as lax's), one memcpy per contiguous run.
    On one device's arrays (see `update_slice`)."""
    return _call(SLICE[0], x, tuple(sizes), x.dtype)(x, _starts(x, starts))


def take_rows(table, ids):
    """`table[ids]` (rows of axis 0, ids clamped to the table; any dtype), one memcpy per row, reading
    the table where it is. On one device's arrays (see `update_slice`)."""
    flat = jnp.asarray(ids, jnp.int32).reshape(-1)
    rows = _call(TAKE_ROWS[0], table, (flat.shape[0], *table.shape[1:]), table.dtype)(table, flat)
    return rows.reshape(*jnp.shape(ids), *table.shape[1:])


def put_slots(x, update, slots, axis: int, after: tuple = ()):
    """x with update's positions written at `slots` of its `axis`, in place (the result aliases x):
    x [*A, M, *C] (M on `axis`, which is not the first), update [N, *A', W, *C] with A' as many
    elements as A (x [1, K, M, H] takes [N, K, W, H]), slots int32 [N, W] (a slot outside 0 .. M-1:
    not written; two positions at one slot: the later row's). One memcpy per run of consecutive
    slots, on one device's arrays (see `update_slice`). `after`: arrays the call waits for, not read
    (XLA orders operations by their data only: a read of x that must come first and that `update`
    does not depend on makes XLA copy x whole, unless something the call takes depends on it)."""
    call = _call(PUT_SLOTS[0], x, x.shape, x.dtype, input_output_aliases={0: 0})
    return call(x, update.astype(x.dtype), jnp.asarray(slots, jnp.int32), *after, axis=axis)


def truncation_floor(logits, top_k, top_p):
    """Each row's threshold for top-k then top-p: logits [B, V] float32, top_k [B] int (0: no
    limit), top_p [B] float (1: no limit) -> int32 [B], the order key (`sampling._order_key`) of the
    smallest logit the row keeps (int32's minimum: all). Exactly `sampling.top_k_top_p`'s sets (ties
    at the threshold kept), found per row by bucketing the vocabulary by probability and selecting
    in the one bucket the threshold falls in (`sampling.cc`); probabilities are exp(logit - max) as
    XLA computes them, their sums double. On one device's arrays (see `update_slice`)."""
    logits = logits.astype(jnp.float32)
    e = jnp.exp(logits - logits.max(axis=-1, keepdims=True))
    call = _call(TRUNCATION_FLOOR[0], logits[:, 0], logits.shape[:1], jnp.int32)  # varies as a row of logits
    return call(logits, e, jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32))


def attention_applies(k) -> bool:
    """Whether `attention(q, k, ...)` will run: k (the cache) float32 or bfloat16, on CPU, with the kernels built."""
    return jnp.dtype(k.dtype) in ATTENTION and available()


def attention(q, k, v, mask, shared_k=None, shared_v=None, shared_positions=None, sinks=None):
    """Softmax attention in float32, fused (`attention.cc`): q [B, K, M, H] (M = G x T: each kv
    head's G query heads at T positions, heads major), k [B, K, H, S] and v [B, K, S, H] (a KV cache,
    float32 or bfloat16; q is rounded to its dtype), mask [B, T, S] (True: may attend); and keys
    every row may read besides its own, shared_k [K, H, U] and shared_v [K, U, H] at
    shared_positions [B, U] (-1: not read), one softmax over both -> float32 [B, K, M, H]. Scores
    are q.k / sqrt(H); a masked one counts as NEG, as `layers.Attention._attend_block`'s. sinks
    [K, G] or None: each query head's sink score, in its softmax's sum (GPT-OSS). On one device's
    arrays (see `update_slice`)."""
    b, kv, m, hd = q.shape
    sinks = jnp.zeros((kv, 0), jnp.float32) if sinks is None else jnp.asarray(sinks, jnp.float32)
    if shared_k is None:
        shared_k = jnp.zeros((kv, hd, 0), k.dtype)
        shared_v = jnp.zeros((kv, 0, hd), k.dtype)
        shared_positions = jnp.zeros((b, 0), jnp.int32)
    target = ATTENTION[jnp.dtype(k.dtype)][0]
    call = _call(target, q, q.shape, jnp.float32)
    return call(q.astype(k.dtype), k, v.astype(k.dtype), jnp.asarray(mask, bool), shared_k.astype(k.dtype),
                shared_v.astype(k.dtype), jnp.asarray(shared_positions, jnp.int32), sinks)
