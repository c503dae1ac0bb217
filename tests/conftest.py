"""Every test sees 8 simulated CPU devices, so each dp x mp layout runs on a laptop."""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "NO_GCE_CHECK": "true",
                   "GCE_METADATA_HOST": "127.0.0.1:9", "GCE_METADATA_IP": "127.0.0.1:9",
                   "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
                   "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}.items():
    os.environ.setdefault(key, value)
