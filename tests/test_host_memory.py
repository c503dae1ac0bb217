"""host_memory: big blocks freed by XLA:CPU's worker threads are reused, not faulted in afresh."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mesh_transformer import host_memory

MB = 64  # one block the size of a decode call's cache window (README, "Speed")

PROGRAM = f"""
import ctypes, json, resource, threading
from mesh_transformer import host_memory
kept = host_memory.keep_freed_memory()  # what the tools that run a model do first
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
faults = []
def calls():  # as XLA:CPU runs a program: a worker thread allocates, writes and frees its buffers
    for _ in range(4):
        block = libc.malloc({MB} << 20)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        ctypes.memset(block, 1, {MB} << 20)
        faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) * 4096 / 2**20)
        libc.free(block)
worker = threading.Thread(target=calls)
worker.start()
worker.join()
print(json.dumps({{"kept": kept, "fault_mb": faults}}))
"""


def run(**env) -> dict:
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env})
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
