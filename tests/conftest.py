"""Every test sees 8 simulated CPU devices, so each dp x mp layout runs on a laptop."""
import os
import socket

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "NO_GCE_CHECK": "true",
                   "GCE_METADATA_HOST": "127.0.0.1:9", "GCE_METADATA_IP": "127.0.0.1:9",
                   "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
                   "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}.items():
    os.environ.setdefault(key, value)

import pytest  # noqa: E402  (after the environment is set, before jax is imported by tests)

from mesh_transformer import storage  # noqa: E402

# Keep every Google client on loopback (see ../shared/netguard/README.md).
_LOOPBACK_ENV = {"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
                 "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
                 "NO_PROXY": "127.0.0.1,localhost,::1", "no_proxy": "127.0.0.1,localhost,::1",
                 "NO_GCE_CHECK": "true", "GCE_METADATA_HOST": "127.0.0.1:9", "GCE_METADATA_IP": "127.0.0.1:9",
                 "GOOGLE_CLOUD_PROJECT": "mesh-transformer-test"}


@pytest.fixture(scope="session")
def gcs_bucket():
    """An in-memory GCS emulator on a free loopback port; yields ``gs://test-bucket``."""
    from gcp_storage_emulator.server import create_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = create_server("127.0.0.1", port, in_memory=True)
    server.start()
    env = dict(_LOOPBACK_ENV, STORAGE_EMULATOR_HOST=f"http://127.0.0.1:{port}")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        storage.gcs_client().create_bucket("test-bucket")
        yield "gs://test-bucket"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


