"""Host memory for XLA:CPU: keep freed buffers for reuse instead of handing them back to the OS.

XLA:CPU allocates every program's outputs and temporaries with malloc. glibc serves a large
allocation with a fresh mmap (from 128 KiB up; always from a worker thread's arena, whose heaps
hold at most 64 MiB) and unmaps it on free, so each call of a program with big buffers touches
fresh pages, and the kernel zero-fills every 4 KiB page on its first write. Measured on the 2-core
AVX2 EPYC: a 16-row decode call over a 1,024-slot window took 283 MB of page faults and 139 ms, of
which 111 ms were not compute; with freed memory kept, no faults and 57 ms (README, "Speed").

`keep_freed_memory` makes glibc keep what is freed: one arena for every thread (the main heap grows
as far as needed), no mmap for any block (M_MMAP_MAX 0; older glibc refuses an mmap threshold above
32 MiB — 2.33's malloc.c, for one — so a threshold cannot say "never" everywhere), no trimming of
the heap top. The process keeps its peak host memory instead of returning it, as GPU and TPU
allocators do with device memory. The tools that run a model call it first (device_train.py,
device_sample.py, device_serve.py, eval_harness.py, train.py's host workers); the converters, which
stream one tensor at a time to disk, do not (with freed blocks kept, an export's peak grew from 2.0x
to 3.1x the parameters: blocks of many sizes fragment the heap). Set MESH_TRANSFORMER_MALLOC=system
to leave malloc as it was. Anything but glibc (macOS, musl) is left alone. mallopt takes an int,
which glibc reads as a size_t: a trim threshold of -1 is the largest size, so the heap top is never
trimmed, whatever its size. (Until session 39 the thresholds were 2**31 - 1: a block of 2 GiB or
more was mmapped afresh on each call, and the heap top was trimmed whenever 2 GiB of it was free —
strace of a 1-device training step of bench/train_throughput.py, whose ~1 GB temporaries free into a
2.8 GB top: the heap cut by 2.8 GB and grown back, its pages faulted in afresh. The heap still grows
to its peak over the first steps, by fragmentation: a growth step is one call's temporaries, which
XLA:CPU mallocs as one block, landing past a freed block that smaller allocations have split;
docs/speed.md, sessions 39 and 40.)

Compiled programs hold memory maps: XLA:CPU jit-compiles each kernel of a program on its own, with
a mapping for its code, its constants and its data (about 500 maps for a decode program, whatever
the depth: identical layers share kernels). Linux caps a process's maps at vm.max_map_count (65,530
on Debian 12 and Ubuntu 22.04, 1,048,576 on Ubuntu 24.04 and Fedora); past it, the next compile
fails inside LLVM and the process dies (SIGSEGV). `memory_maps` reads both numbers so a server can
drop compiled programs before that (`generate.Generator`).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)

ENV = "MESH_TRANSFORMER_MALLOC"
# mallopt(3) parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
NEVER = -1  # mallopt's int read as glibc's size_t: SIZE_MAX, a threshold no heap top reaches
SETTINGS = ((M_ARENA_MAX, 1, "one arena for every thread"), (M_MMAP_MAX, 0, "no mmap for big blocks"),
            (M_TRIM_THRESHOLD, NEVER, "no trimming of the heap top"))


def keep_freed_memory() -> bool:
    """Tune glibc's malloc as described above; True if it was done."""
    if os.environ.get(ENV, "").lower() == "system" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    if not hasattr(libc, "gnu_get_libc_version"):
        return False  # musl has a mallopt that ignores these
    refused = [what for param, value, what in SETTINGS if mallopt(param, value) != 1]  # each one tried
    if refused:
        log.warning("glibc refused %s; XLA:CPU buffers may page-fault on every call", ", ".join(refused))
    return not refused


MAPS_PER_PROGRAM = 1000  # a new compiled program's maps, with margin (a decode program: about 500)


def memory_maps() -> tuple[int, int] | None:
    """(memory maps this process holds, the kernel's limit vm.max_map_count); None where unknown."""
    try:
        with open("/proc/self/maps", "rb") as f:
            held = sum(1 for _ in f)
        with open("/proc/sys/vm/max_map_count") as f:
            return held, int(f.read())
    except (OSError, ValueError):
        return None


def room_for_programs(programs: int = 1, keep_free: float = 0.0) -> bool:
    """Whether `programs` more compiled programs fit under vm.max_map_count with `keep_free` of it
    still unused (True where unknown)."""
    maps = memory_maps()
    return maps is None or maps[0] + programs * MAPS_PER_PROGRAM <= maps[1] * (1 - keep_free)
