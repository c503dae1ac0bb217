"""host_memory: big blocks freed by XLA:CPU's worker threads are reused, not faulted in afresh."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mesh_transformer import host_memory

MB = 64  # one block the size of a decode call's cache window (README, "Speed")

PROGRAM = """
import ctypes, json, resource, sys, threading
from mesh_transformer import host_memory
kept = host_memory.keep_freed_memory()  # what the tools that run a model do first
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
sizes_mb, calls = json.loads(sys.argv[1]), int(sys.argv[2])
faults = []
def run_calls():  # as XLA:CPU runs a program: a worker thread allocates, writes and frees its buffers
    for _ in range(calls):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [libc.malloc(mb << 20) for mb in sizes_mb]
        for block, mb in zip(blocks, sizes_mb):
            ctypes.memset(block, 1, mb << 20)
        faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) * 4096 / 2**20)
        for block in blocks:
            libc.free(block)
worker = threading.Thread(target=run_calls)
worker.start()
worker.join()
print(json.dumps({"kept": kept, "fault_mb": faults}))
"""


def run(sizes_mb=(MB,), calls=4, **env) -> dict:
    out = subprocess.run([sys.executable, "-c", PROGRAM, json.dumps(list(sizes_mb)), str(calls)],
                         capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_big_blocks_are_reused_not_faulted_in_on_every_call():
    """After `keep_freed_memory()` (what the tools that run a model call first), a 64 MB block a worker
    thread frees is reused by its next allocation (only the first call faults its pages in); with
    malloc left as it was (MESH_TRANSFORMER_MALLOC=system) glibc maps and unmaps it, and every call
    faults 64 MB in."""
    kept, system = run(), run(**{host_memory.ENV: "system"})
    assert kept["kept"] and not system["kept"]
    assert kept["fault_mb"][0] > MB * 0.9 and max(kept["fault_mb"][1:]) < 1, kept
    assert min(system["fault_mb"]) > MB * 0.9, system


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.parametrize("sizes_mb", [(2304,), (1024, 1024, 1024)], ids=["one 2.25 GiB block", "a 3 GiB heap top"])
def test_gigabyte_temporaries_are_kept_past_two_gib(sizes_mb):
    """Past mallopt's int range too: one block of 2.25 GiB (glibc would mmap it afresh on each call
    with a threshold of 2**31 - 1) and three 1 GiB blocks freed into a 3 GiB heap top (which a trim
    threshold of 2**31 - 1 hands back to the OS at every free, as it did to a 1-device training step
    of bench/train_throughput.py) are faulted in on the first call only."""
    total = sum(sizes_mb)
    kept = run(sizes_mb, calls=2)
    assert kept["kept"] and kept["fault_mb"][0] > total * 0.9 and kept["fault_mb"][1] < 1, kept
