"""storage.py against the local filesystem and a gcp-storage-emulator on 127.0.0.1."""
import os
import stat

import pytest

from mesh_transformer.io import storage

def test_paths():
    assert storage.join("gs://b/dir", "x", "y.npy") == "gs://b/dir/x/y.npy"
    assert storage.dirname("gs://b/dir/i.json") == "gs://b/dir"
    assert storage.basename("gs://b/dir/") == "dir"
    assert storage.is_gcs("gs://b") and not storage.is_gcs("/tmp/gs://x")


def test_local_atomic_write_and_listing(tmp_path):
    path = str(tmp_path / "sub" / "meta.json")
    storage.write_text(path, '{"step": 3}')
    assert storage.read_text(path) == '{"step": 3}'
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~storage._UMASK
    with pytest.raises(RuntimeError):
        with storage.atomic_writer(path) as f:
            f.write(b"half")
            raise RuntimeError("crash mid-write")
    assert storage.read_text(path) == '{"step": 3}'  # the old file survives, no temp left behind
    assert storage.list_files(str(tmp_path)) == [path]
    assert storage.isdir(str(tmp_path / "sub")) and storage.size(path) == 11


def test_gcs_round_trip(gcs_bucket):
    path = storage.join(gcs_bucket, "ckpt", "meta.json")
    assert not storage.exists(path)
    storage.write_text(path, "hello")
    with storage.atomic_writer(storage.join(gcs_bucket, "ckpt", "big.bin")) as f:
        f.write(os.urandom(3 << 20))
    with pytest.raises(RuntimeError):  # a failed upload is cancelled, not committed
        with storage.atomic_writer(storage.join(gcs_bucket, "ckpt", "broken.bin")) as f:
            f.write(b"partial")
            raise RuntimeError("crash mid-upload")
    assert storage.read_text(path) == "hello"
    assert storage.exists(path) and storage.isdir(storage.join(gcs_bucket, "ckpt"))
    assert storage.size(storage.join(gcs_bucket, "ckpt", "big.bin")) == 3 << 20
    assert storage.list_files(storage.join(gcs_bucket, "ckpt")) == [
        f"{gcs_bucket}/ckpt/big.bin", f"{gcs_bucket}/ckpt/meta.json"]
    storage.remove(path)
    assert not storage.exists(path)


def test_tensorstore_reads_the_generation_its_ocdbt_writes_are_conditioned_on(gcs_bucket):
    """GCS reads report the generation the write made, and OCDBT conditions its manifest updates on it:
    the emulator sends `x-goog-generation` as GCS does (tests/gcs_emulator.py), else tensorstore reads
    generation 0 and a fresh handle's update fails "Malformed StorageGeneration" (as orbax's checkpoint
    saves did when they re-read their manifest)."""
    import tensorstore as ts
    bucket = ts.KvStore.open({"driver": "gcs", "bucket": gcs_bucket.removeprefix("gs://")}).result()
    written = bucket.write("generations/object", b"x").result()
    assert bucket.read("generations/object").result().stamp.generation == written.generation
    database = {"driver": "ocdbt", "base": f"{gcs_bucket}/ocdbt/"}
    ts.KvStore.open(database, context=ts.Context()).result().write("first", b"1").result()
    second = ts.KvStore.open(database, context=ts.Context()).result()  # its own cache: reads the manifest
    second.write("second", b"2").result()
    assert [second.read(k).result().value for k in ("first", "second")] == [b"1", b"2"]
