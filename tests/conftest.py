"""Every test sees 8 simulated CPU devices, so each dp x mp layout runs on a laptop.

The suite is mostly compile time, so XLA:CPU compiles at LLVM level 1 (level 2's extra passes cost
about a third more; results agree to a few float32 ulps; level 0 skips fused multiply-adds and fails
parity tests) with its classic loop-fusion emitters (`--xla_cpu_use_fusion_emitters=false`: the MLIR
fusion emitters, XLA:CPU's default, took 40-45% of the backend compile time of tests/test_generate.py
and of a training step's loss and gradients on this project's 2-core machines; left out where a
newer jaxlib no longer has them), and compiled programs go to one persistent JAX cache for the run
(or $JAX_COMPILATION_CACHE_DIR's, kept between runs), which the scripts the tests start inherit: a
program compiled once (a tool run again after a kill, a fixture recompiled after JAX's caches were
cleared) is loaded, not compiled."""
import atexit
import os
import shutil
import socket
import subprocess
import sys
import tempfile

CLASSIC_FUSION_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _xla_flag_parses(flag: str) -> bool:
    """Whether this jaxlib's XLA knows `flag`: an unknown flag in XLA_FLAGS aborts the process, and
    XLA drops flags of retired code paths (the classic fusion emitters are on their way out)."""
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True,
                           env={**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"})
    return probe.returncode == 0


def _with_test_xla_flags(flags: str) -> str:
    """`flags` plus the suite's own (once: pytest-xdist's workers inherit the controller's)."""
    ours = ["--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=1"]
    if "--xla_cpu_use_fusion_emitters" not in flags and _xla_flag_parses(CLASSIC_FUSION_EMITTERS):
        ours.append(CLASSIC_FUSION_EMITTERS)
    return " ".join([flags, *(flag for flag in ours if flag.split("=")[0] not in flags)]).strip()


os.environ["XLA_FLAGS"] = _with_test_xla_flags(os.environ.get("XLA_FLAGS", ""))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="mesh-transformer-tests-xla-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "NO_GCE_CHECK": "true",
                   "GCE_METADATA_HOST": "127.0.0.1:9", "GCE_METADATA_IP": "127.0.0.1:9",
                   "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
                   "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}.items():
    os.environ.setdefault(key, value)

import pytest  # noqa: E402  (after the environment is set, before jax is imported by tests)

# The files that take longest, longest first (the rest follow, most tests first). scripts/test.sh's
# two workers take whole files in this order (--no-loadscope-reorder): by pytest-xdist's own order,
# most tests first, the few long tests of a cluster, a training script or a server started as a
# process came last, and one worker ran them alone for the last minutes of the run.
LONGEST_FILES = ("test_families.py", "test_cluster.py", "test_dpo.py", "test_device_train.py",
                 "test_serve_prefix.py", "test_serve_ops.py", "test_family_tools.py", "test_serve_replies.py",
                 "test_eval.py", "test_serve_lora.py", "test_kernels.py", "test_generate.py")


def pytest_collection_modifyitems(config, items):
    """Order the collected tests by `LONGEST_FILES`, then the other files by their number of tests;
    a file's own tests keep their order."""
    counts: dict[str, int] = {}
    for item in items:
        counts[item.path.name] = counts.get(item.path.name, 0) + 1
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -counts[item.path.name], item.path.name))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reset_gcs_clients():
    """Drop cached GCS clients so the next gs:// access reads the emulator settings in os.environ."""
    import fsspec
    import gcsfs
    from etils.epath import backend
    from orbax.checkpoint._src.path import gcs_utils

    # gcsfs's default class asks a gRPC control plane (not loopback, not covered by the netguard)
    # what kind of bucket this is; the plain class only speaks the JSON API to the emulator.
    for protocol in ("gs", "gcs"):
        fsspec.register_implementation(protocol, gcsfs.core.GCSFileSystem, clobber=True)
    fsspec.config.conf["gs"] = {"token": "anon"}
    gcsfs.core.GCSFileSystem.clear_instance_cache()
    backend._FileSystemSpecBackend._get_filesystem.cache_clear()
    gcs_utils.get_bucket.cache_clear()


@pytest.fixture(scope="session")
def gcs_bucket():
    """gs://test-bucket on an in-memory gcp-storage-emulator at 127.0.0.1, for every GCS client we use
    (google-cloud-storage, smart_open, gcsfs/orbax, tensorstore), with anonymous credentials."""
    import subprocess
    import sys
    import time

    port, bucket = _free_port(), "test-bucket"
    url = f"http://127.0.0.1:{port}"
    env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "x",
           "GOOGLE_CLOUD_PROJECT": "mesh-transformer-test", "FSSPEC_GS_TOKEN": "anon",
           "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
           "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
           "NO_PROXY": "127.0.0.1,localhost,::1", "no_proxy": "127.0.0.1,localhost,::1"}
    saved = {k: os.environ.get(k) for k in env}
    emulator = os.path.join(os.path.dirname(__file__), "gcs_emulator.py")  # sends GCS's generation headers
    server = subprocess.Popen([sys.executable, emulator, "start", "--host", "127.0.0.1",
                               "--port", str(port), "--in-memory", "--default-bucket", bucket, "-q"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert time.time() < deadline and server.poll() is None, "the storage emulator did not start"
                time.sleep(0.1)
        os.environ.update(env)
        _reset_gcs_clients()
        yield f"gs://{bucket}"
    finally:
        server.kill()
        server.wait()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _reset_gcs_clients()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A random tiny HF GPT-J with its own tokenizer saved beside it (generation and serving tests)."""
    from tests.helpers import Tiny
    return Tiny(tmp_path_factory.mktemp("tiny_gptj"))


@pytest.fixture(scope="session")
def gen(tiny):
    """The tiny model on one device (fp32), loaded the way the tools load it; compiled programs are shared."""
    from mesh_transformer import loading
    from mesh_transformer.generate import Generator
    model = loading.load(hf=str(tiny.path), mp=1, dp=1, dtype="float32")
    return Generator(model.config, model.params, model.mesh)


@pytest.fixture(scope="session")
def tiny_long(tmp_path_factory):
    """(a tiny GPT-J with a 768-token context and `<think>`, `</think>` special tokens, its
    Generator): the chat replies' tests (tool schemas are long in its 300-token vocabulary)."""
    from mesh_transformer import loading
    from mesh_transformer.generate import Generator
    from tests.helpers import COMMA, END_THINK_ID, THINK_ID, Tiny
    tiny = Tiny(tmp_path_factory.mktemp("tiny_tools"), n_positions=768, specials=("<think>", "</think>"))
    assert tiny.tokenizer.convert_tokens_to_ids(["<think>", "</think>", ","]) == [THINK_ID, END_THINK_ID, COMMA]
    model = loading.load(hf=str(tiny.path), mp=1, dp=1, dtype="float32")
    return tiny, Generator(model.config, model.params, model.mesh)


@pytest.fixture(scope="module")
def long_engine(tiny_long):
    """A started Engine over `tiny_long` (4 rows, 4-token decode chunks, batch-invariant: answers
    equal the library's), one per test module."""
    from mesh_transformer.serve import Engine
    tiny, gen = tiny_long
    engine = Engine(gen, tiny.tokenizer, max_batch=4, chunk=4, max_queue=64, batch_invariant=True).start()
    yield engine
    engine.stop()


MAPS_KEPT = 0.5  # of vm.max_map_count: past it, JAX's caches are cleared after a test module


@pytest.fixture(scope="module", autouse=True)
def compiled_programs_stay_under_the_map_limit():
    """XLA:CPU maps each kernel of a compiled program on its own (about 500 memory maps a decode
    program) and Linux stops a process at vm.max_map_count (65,530 here): the suite's one
    process held ~49,000 maps by its end. After a test module, when more than `MAPS_KEPT` of the
    limit is held, every cached program is dropped (the next use of one compiles it again)."""
    yield
    from mesh_transformer import host_memory
    maps = host_memory.memory_maps()
    if maps is not None and maps[0] > MAPS_KEPT * maps[1]:
        import gc

        import jax
        jax.clear_caches()
        gc.collect()
