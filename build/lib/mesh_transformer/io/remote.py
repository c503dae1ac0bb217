"""Directories that may live on gs://, for tools whose libraries only read and write local paths."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator

from mesh_transformer.io import storage

_CHUNK = 64 << 20  # bytes per read: bounded memory for multi-GB weight files


@contextlib.contextmanager
def local_copy(path: str) -> Iterator[str]:
    """A local directory with the files of `path` (downloaded to a temporary dir when gs://)."""
    if not storage.is_gcs(path):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="mesh-transformer-") as tmp:
        for remote_file in storage.list_files(path):
            name = remote_file[len(path.rstrip("/")) + 1:]
            os.makedirs(os.path.dirname(os.path.join(tmp, name)) or tmp, exist_ok=True)
            with storage.open(remote_file, "rb") as src, open(os.path.join(tmp, name), "wb") as dst:
                shutil.copyfileobj(src, dst, _CHUNK)
        yield tmp


@contextlib.contextmanager
def local_output(path: str) -> Iterator[str]:
    """A local directory to write into; when `path` is gs://, its files are uploaded afterwards."""
    if not storage.is_gcs(path):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="mesh-transformer-") as tmp:
        yield tmp
        for root, _, files in os.walk(tmp):
            for name in files:
                local = os.path.join(root, name)
                with open(local, "rb") as src, storage.open(storage.join(path, os.path.relpath(local, tmp)), "wb") as dst:
                    shutil.copyfileobj(src, dst, _CHUNK)
                os.remove(local)  # keep at most one file twice on disk
