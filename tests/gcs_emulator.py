"""gcp-storage-emulator as the tests run it, with the generation headers real GCS sends on downloads.

    python tests/gcs_emulator.py start --host 127.0.0.1 --port N --in-memory --default-bucket B

The emulator's media downloads carry no `x-goog-generation` header, which GCS always sends. tensorstore
takes a read's generation from that header, so it read generation 0 and refused the next write
conditioned on it ("Malformed StorageGeneration"). orbax's OCDBT writer does exactly that when timing
makes it re-read its manifest before updating it: a checkpoint save to gs:// failed once in ~40 suite
runs. Everything else is the emulator unchanged.
"""
from gcp_storage_emulator import server
from gcp_storage_emulator.__main__ import main
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

_emulator_download = objects.download


def download_with_generation(request, response, storage, *args, **kwargs):
    """The emulator's download, plus the object's `x-goog-generation` / `x-goog-metageneration`."""
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    except NotFound:
        pass  # the emulator's own handler answers 404
    else:
        response["x-goog-generation"] = str(obj["generation"])
        response["x-goog-metageneration"] = str(obj["metageneration"])
    return _emulator_download(request, response, storage, *args, **kwargs)


def _serve_downloads_with_generation() -> None:
    objects.download = download_with_generation  # `objects.get` with alt=media calls it by this name
    for _, handlers in server.HANDLERS:
        for method, handler in handlers.items():
            if handler is _emulator_download:
                handlers[method] = download_with_generation


if __name__ == "__main__":
    _serve_downloads_with_generation()
    main()
