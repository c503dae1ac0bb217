"""Host memory for XLA:CPU: keep freed buffers for reuse instead of handing them back to the OS.

XLA:CPU allocates every program's outputs and temporaries with malloc. glibc serves a large
allocation with a fresh mmap (from 128 KiB up; always from a worker thread's arena, whose heaps
hold at most 64 MiB) and unmaps it on free, so each call of a program with big buffers touches
fresh pages, and the kernel zero-fills every 4 KiB page on its first write. Measured on the 2-core
AVX2 EPYC: a 16-row decode call over a 1,024-slot window took 283 MB of page faults and 139 ms, of
which 111 ms were not compute; with freed memory kept, no faults and 57 ms (README, "Speed").

`keep_freed_memory` makes glibc keep what is freed: one arena for every thread (the main heap grows
as far as needed), no mmap for large blocks, no trimming of the heap top. The process keeps its peak
host memory instead of returning it, as GPU and TPU allocators do with device memory. The tools that
run a model call it first (device_train.py, device_sample.py, device_serve.py, eval_harness.py,
train.py's host workers); the converters, which stream one tensor at a time to disk, do not (with
freed blocks kept, an export's peak grew from 2.0x to 3.1x the parameters: blocks of many sizes
fragment the heap). Set MESH_TRANSFORMER_MALLOC=system to leave malloc as it was. Anything but
glibc (macOS, musl) is left alone. mallopt takes an int, so a block of 2 GiB or more is still
mmapped and faulted afresh on each call: keep programs' temporaries below that (the serving
admission once copied a 64-row KV cache, 2.1 GB, and spent a quarter of its time in page faults).
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
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
LARGEST = 2**31 - 1  # mallopt takes an int: thresholds this high are never reached by one block


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
    done = all(mallopt(param, value) == 1 for param, value in (
        (M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, LARGEST), (M_TRIM_THRESHOLD, LARGEST)))
    if not done:
        log.warning("glibc refused a mallopt setting; XLA:CPU buffers may page-fault on every call")
    return done
