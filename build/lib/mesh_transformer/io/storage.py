"""Paths that may be local or on Google Cloud Storage (``gs://bucket/key``).

Everything that reads or writes datasets and checkpoints goes through these few functions, so
the rest of the library never asks which kind of path it holds. gs:// uses smart_open over a
google-cloud-storage client; when ``STORAGE_EMULATOR_HOST`` is set (tests, local emulators) the
client is anonymous and talks only to that host.
"""
from __future__ import annotations

import builtins
import contextlib
import os
import posixpath
import tempfile
from typing import IO, Iterator


def is_gcs(path: str) -> bool:
    return str(path).startswith("gs://")


def join(base: str, *parts: str) -> str:
    """``os.path.join`` for local paths, '/'-joining for gs:// (never backslashes)."""
    return posixpath.join(base, *parts) if is_gcs(base) else os.path.join(base, *parts)


def dirname(path: str) -> str:
    return posixpath.dirname(path) if is_gcs(path) else os.path.dirname(path)


def basename(path: str) -> str:
    return posixpath.basename(path.rstrip("/")) if is_gcs(path) else os.path.basename(path)


def _split(path: str) -> tuple[str, str]:
    bucket, _, key = path[len("gs://"):].partition("/")
    return bucket, key


_UMASK = os.umask(0)
os.umask(_UMASK)
_clients: dict = {}


def gcs_client():
    """A google-cloud-storage client; anonymous against ``STORAGE_EMULATOR_HOST`` when set.

    Cached per emulator host, so tests that start an emulator on a new port get a new client.
    """
    from google.cloud import storage as gcs  # imported lazily: local-only users never pay for it

    host = os.environ.get("STORAGE_EMULATOR_HOST")
    if host not in _clients:
        if host:
            from google.auth.credentials import AnonymousCredentials

            project = os.environ.get("GOOGLE_CLOUD_PROJECT", "mesh-transformer-test")
            _clients[host] = gcs.Client(project=project, credentials=AnonymousCredentials())
        else:
            _clients[host] = gcs.Client()
    return _clients[host]


def open(path: str, mode: str = "rb", **kwargs) -> IO:  # noqa: A001 - mirrors builtins.open
    """Open a local or gs:// file. Never decompresses (callers choose how to read .gz/.zst)."""
    if not is_gcs(path):
        return builtins.open(path, mode, **kwargs)
    import smart_open

    return smart_open.open(path, mode, compression="disable",
                           transport_params={"client": gcs_client()}, **kwargs)



def exists(path: str) -> bool:
    if not is_gcs(path):
        return os.path.exists(path)
    bucket, key = _split(path)
    blob_exists = gcs_client().bucket(bucket).blob(key).exists()
    return blob_exists or isdir(path)


def isdir(path: str) -> bool:
    """A local directory, or a gs:// prefix with at least one object under it."""
    if not is_gcs(path):
        return os.path.isdir(path)
    bucket, key = _split(path.rstrip("/") + "/")
    return any(True for _ in gcs_client().list_blobs(bucket, prefix=key, max_results=1))


def size(path: str) -> int:
    if not is_gcs(path):
        return os.path.getsize(path)
    bucket, key = _split(path)
    blob = gcs_client().bucket(bucket).get_blob(key)
    if blob is None:
        raise FileNotFoundError(path)
    return blob.size


def list_files(path: str) -> list[str]:
    """All files below directory ``path`` (recursive), as full paths, sorted."""
    if not is_gcs(path):
        found = [os.path.join(root, name) for root, _, names in os.walk(path) for name in names]
        return sorted(found)
    bucket, prefix = _split(path.rstrip("/") + "/")
    blobs = gcs_client().list_blobs(bucket, prefix=prefix)
    return sorted(f"gs://{bucket}/{b.name}" for b in blobs if not b.name.endswith("/"))


def makedirs(path: str) -> None:
    """Create a local directory tree; a no-op on gs:// (prefixes need no creating)."""
    if not is_gcs(path):
        os.makedirs(path, exist_ok=True)


def remove(path: str) -> None:
    if not is_gcs(path):
        os.remove(path)
        return
    bucket, key = _split(path)
    gcs_client().bucket(bucket).blob(key).delete()


@contextlib.contextmanager
def atomic_writer(path: str) -> Iterator[IO[bytes]]:
    """Binary writer whose file appears at ``path`` only if the block finishes without error.

    Local: writes ``<path>.tmp-XXXX`` in the same directory, then ``os.replace`` (atomic on POSIX).
    gs://: an object upload is already atomic; on error the upload is cancelled, not committed.
    """
    if is_gcs(path):
        with open(path, "wb") as f:  # BlobWriter.__exit__ terminates the upload on exceptions
            yield f
        return
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=os.path.basename(path) + ".tmp-")
    try:
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the file the usual permissions
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def write_bytes(path: str, data: bytes) -> None:
    """Atomically write a small file (an index, a metadata JSON)."""
    with atomic_writer(path) as f:
        f.write(data)


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def read_text(path: str) -> str:
    return read_bytes(path).decode("utf-8")
