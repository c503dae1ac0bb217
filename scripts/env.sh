# Settings that keep Ray, Google clients and HF on this machine (sourced by the scripts here).
# See ../shared/netguard/README.md for why each is needed.
export XLA_FLAGS="${XLA_FLAGS:---xla_force_host_platform_device_count=8}"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
export HTTP_PROXY=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9 http_proxy=http://127.0.0.1:9 https_proxy=http://127.0.0.1:9
export NO_PROXY=127.0.0.1,localhost,::1 no_proxy=127.0.0.1,localhost,::1
export NO_GCE_CHECK=true GCE_METADATA_HOST=127.0.0.1:9 GCE_METADATA_IP=127.0.0.1:9
export GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false  # gcsfs: no gRPC bucket-type probe (not loopback)
