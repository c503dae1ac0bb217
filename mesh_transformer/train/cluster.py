"""Training over many hosts with Ray: `train.py` is the driver, one worker actor runs on each host.

    driver (train.py; any small machine)               worker actor, one per host ({"mesh_host": 1})
    ------------------------------------               ---------------------------------------------
    opens train/val sets, owns the Loader  --rows-->   jax.distributed.initialize(coordinator, n, i)
    sends host i only its rows of each step             TrainHost (train_loop.py): the mesh over all
    schedules validation and checkpoints                hosts' devices, and the start-up, step,
    logs metrics, restarts the group on faults          validation and checkpoints of device_train.py

Every call to the workers has a timeout. A worker that dies (its process or its host) is seen at
once (Ray reports the actor dead); one that hangs is seen when the call's timeout runs out. The
driver then kills the whole group (the survivors sit in collectives with the lost peer), starts a
new one, and the new workers resume from the last *complete* checkpoint and its loader position;
the driver rewinds its Loader to that position, so no step's data is trained twice or skipped.
A save cut short by the fault never became a complete checkpoint (orbax renames or commits a
step only when every host has written its part), so it is never restored.

    run = ClusterRun(config, ClusterOptions(local_hosts=2, cpu_devices=8))
    summary = run.train()
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import numpy as np
import ray

from mesh_transformer import host_memory
from mesh_transformer.io import storage
from mesh_transformer.io.checkpoint import CheckpointError, checkpoint_dir
from mesh_transformer.config import Config, ConfigError
from mesh_transformer.errors import UserError
from mesh_transformer.data import DatasetError, Mixture
from mesh_transformer.train.metrics import MetricsLogger
from mesh_transformer.train.loop import (RunOptions, TrainingError, check_distinct_parts, due, open_datasets,
                                         require_keys, train_loader, train_values, uses_segments, val_loader)

HOST_RESOURCE = "mesh_host"  # Ray custom resource that marks a host for one worker
TEST_HANG_ENV = "MESH_TRANSFORMER_TEST_HANG"  # test-only fault injection, see HostWorker.step
FATAL = (ConfigError, CheckpointError, DatasetError, TrainingError)  # restarting would fail the same way
PIPELINE = 1  # steps sent ahead of the one awaited: the next batch travels while this step computes
GRACE_S = 5.0  # how long an error from one worker waits to learn whether a peer died meanwhile


class ClusterError(UserError, RuntimeError):
    """The run cannot go on; the message says which worker, during which call, and why."""


class WorkerFailure(Exception):
    """A worker died, hung, or hit an infrastructure error: the group is torn down and restarted."""

    def __init__(self, message: str, step: Optional[int] = None, seconds: float = 0.0):
        super().__init__(message)
        self.step, self.seconds = step, seconds  # the step being waited for; how long until detected


@dataclass(frozen=True)
class ClusterOptions:
    address: Optional[str] = None  # Ray cluster to join ("auto", "HEAD:6379", "ray://HEAD:10001"); None: start one here
    local_hosts: int = 1  # without address: worker processes on this machine, each with its share of the devices
    cpu_devices: Optional[int] = None  # without address: simulate this many CPU devices in all (split over hosts)
    new: bool = False  # start from scratch; refuses a model_dir holding files unless overwrite
    overwrite: bool = False  # with new: delete model_dir first
    max_restarts: int = 3  # restarts in a row that do not get past the furthest step reached, before giving up
    startup_timeout: float = 1800.0  # s: placing actors, jax.distributed, restore, first compile of each call
    step_timeout: float = 600.0  # s: any later call (a step, a validation pass, starting a save)
    coordinator: Optional[str] = None  # JAX coordinator "host:port", or "auto" (TPU pods); default worker 0's host
    worker_env: Mapping[str, str] = field(default_factory=dict)  # extra environment of the worker processes
    run: RunOptions = RunOptions()  # what device_train.py takes: fine-tune source, log_dir, stop_after, ...


@dataclass
class RunSummary:
    step: int  # last step trained
    checkpoint: Optional[int]  # latest complete checkpoint at the end
    hosts: int
    restarts: int
    failures: list[str]  # one line per fault (each restart's, and any given up on), with its detection time
    resumed_from: list[int]  # start step of each worker group (the first, then one per restart)
    step_seconds: list[float]  # driver-side wall time of each step trained by this call (pipelined)
    bytes_per_step: int  # batch bytes the driver sends per step, all hosts together


# --------------------------------------------------------------------------------------------
# The worker: one Ray actor per host
# --------------------------------------------------------------------------------------------

class StartupError(RuntimeError):
    """A worker could not join the JAX job (bad coordinator address, unreachable peer, ...)."""


def unpack_batch(batch: Mapping[str, np.ndarray]) -> dict:
    """The dtypes the step expects (tokens int32 [A, b, T+1], mask float32 [A, b, T]) from `pack_batch`'s."""
    tokens = np.asarray(batch["tokens"], np.int32)
    mask = batch.get("mask")
    out = {"tokens": tokens, "mask": np.ones(tokens[..., 1:].shape, np.float32) if mask is None
           else np.asarray(mask, np.float32)}
    if "segments" in batch:  # packed examples kept apart (int32 [A, b, T+1])
        out["segments"] = np.asarray(batch["segments"], np.int32)
    if "labels" in batch:  # KTO's unpaired examples, a classifier's texts (float32 [A, b, 1]; multi-label [A, b, classes])
        out["labels"] = np.asarray(batch["labels"], np.float32)
    return out


class HostWorker:
    """Runs on one host as a Ray actor: joins the JAX job, then runs `TrainHost` on the driver's batches.

    The process environment (JAX_PLATFORMS, XLA_FLAGS, test hooks) comes from the actor's
    runtime_env, so it is in place before jax is imported here.
    """

    def __init__(self):
        host_memory.keep_freed_memory()  # this process runs the training steps (see host_memory)
        self.host = self.state = None
        self.process_index, self.step_number = None, 0
        self.broken: Optional[str] = None  # after a failed step the state's buffers are gone (donated)

    def hello(self) -> dict:
        """pid, host address, and a "host:port" free now on this host (for the JAX coordinator)."""
        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
        return {"pid": os.getpid(), "node": ip, "address": f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"}

    def setup(self, config: Config, options: RunOptions, coordinator: Optional[str], num_processes: int,
              process_id: int, cpu_devices: Optional[int], timeout_s: int) -> dict:
        """Join the JAX job (none for a lone worker: coordinator None) and build the mesh over every
        host's devices; -> where this host stands."""
        import jax

        if cpu_devices:
            jax.config.update("jax_num_cpu_devices", cpu_devices)
        if coordinator not in (None, "auto") and process_id == 0:
            _check_can_listen(coordinator)
        try:
            if coordinator == "auto":  # TPU pods, Slurm: JAX reads the topology from the platform
                jax.distributed.initialize(initialization_timeout=timeout_s)
            elif coordinator is not None:
                jax.distributed.initialize(coordinator, num_processes, process_id, initialization_timeout=timeout_s,
                                           coordinator_bind_address=coordinator)
        except Exception as e:  # noqa: BLE001 - XLA raises its own runtime errors
            raise StartupError(f"jax.distributed.initialize(coordinator={coordinator!r}, "
                               f"num_processes={num_processes}, process_id={process_id}) failed: "
                               f"{type(e).__name__}: {_first_lines(e)}") from None
        from mesh_transformer.train.loop import TrainHost

        self.host = TrainHost(config, options)
        self.process_index = jax.process_index()
        tr = self.host.trainer
        return {"process_index": self.process_index, "local_devices": jax.local_device_count(),
                "devices": jax.device_count(), "platform": jax.devices()[0].platform, "dp": tr.dp, "mp": tr.mp,
                "global_batch": tr.global_batch, "rows": self.host.batch_rows()}

    def start(self) -> dict:
        """Resume the latest complete checkpoint (or fine-tune / init) and compile the step:
        -> {"step", "loader"}."""
        self.state, loader_state = self.host.start_state()
        self.step_number = int(self.state.step)
        self.host.compile(self.state)
        return {"step": self.step_number, "loader": loader_state}

    def step(self, batch: Mapping[str, np.ndarray]) -> dict:
        self.step_number += 1
        if os.environ.get(TEST_HANG_ENV) == f"{self.process_index}:{self.step_number}":
            # Test-only (tests/test_cluster.py): behave like a hung host, never answering.
            while True:
                time.sleep(60)
        return self._guarded(f"step {self.step_number}", self._step, batch)

    def _step(self, batch) -> dict:
        self.state, metrics = self.host.step(self.state, unpack_batch(batch))
        return metrics

    def validate(self, batches: Mapping[str, list]) -> dict:
        return self._guarded("validation", lambda: self.host.val_losses(
            self.state.params, {name: map(unpack_batch, b) for name, b in batches.items()}))

    def evaluate(self, tokenizer: str) -> dict:
        """eval_harness_tasks on the current params; every worker runs them (the forward passes span
        all hosts), each returns the same metrics."""
        return self._guarded("evaluation", lambda: self.host.eval_metrics(self.state.params, tokenizer))

    def save(self, loader_state: dict) -> None:
        self._guarded("saving", self.host.save, self.state, loader_state)

    def finish(self) -> Optional[int]:
        """Wait for the last checkpoint to be complete on storage; -> the latest complete step."""
        self.host.ckpt.wait()
        return self.host.ckpt.latest_step()

    def _guarded(self, what: str, fn, *args):
        """Run fn, refusing once anything has failed here: calls already queued behind a failed step
        would touch donated buffers (XLA crashes the process on that)."""
        if self.broken:
            raise RuntimeError(f"not {what}: this worker's state is lost ({self.broken} failed)")
        try:
            return fn(*args)
        except BaseException:
            self.broken = what
            raise


# --------------------------------------------------------------------------------------------
# Where workers go and what each gets
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Placement:
    hosts: int
    resources: dict  # Ray resources each worker asks for (always HOST_RESOURCE: 1)
    num_gpus: float  # Ray sets CUDA_VISIBLE_DEVICES from this, so ask for the host's GPUs
    env: dict  # worker process environment
    cpu_devices: Optional[int]  # simulated CPU devices per worker
    coordinator: Optional[str]


def with_device_count(xla_flags: str, n: int) -> str:
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", xla_flags or "").split()
    return " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])


def plan_placement(config: Config, options: ClusterOptions) -> Placement:
    """How many workers, and the devices each gets: this machine's split `local_hosts` ways, or
    one worker per `mesh_host` node of the cluster with all that node's GPUs or TPU chips."""
    if options.address is None:
        n = options.local_hosts
        gpus = ray.cluster_resources().get("GPU", 0)
        if options.cpu_devices or not gpus:
            total = options.cpu_devices or config.train.tpu_size or n
            if total % n:
                raise ClusterError(f"{total} CPU devices do not split over --local-hosts {n}")
            env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": with_device_count(os.environ.get("XLA_FLAGS", ""), total // n)}
            return Placement(n, {HOST_RESOURCE: 1}, 0, env, total // n, options.coordinator)
        if gpus % n:
            raise ClusterError(f"this machine's {gpus:g} GPUs do not split over --local-hosts {n}")
        return Placement(n, {HOST_RESOURCE: 1}, gpus // n, {}, None, options.coordinator)
    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive") and node["Resources"].get(HOST_RESOURCE)]
    if not nodes:
        raise ClusterError(f"no node of the Ray cluster at {options.address} has the {HOST_RESOURCE!r} resource: "
                           f"start one per accelerator host with ray start --address=HEAD:6379 "
                           f"--resources='{{\"{HOST_RESOURCE}\": 1}}'")
    hosts = int(sum(r[HOST_RESOURCE] for r in nodes))
    gpus, tpus = min(r.get("GPU", 0) for r in nodes), min(r.get("TPU", 0) for r in nodes)
    resources = {HOST_RESOURCE: 1, **({"TPU": tpus} if tpus else {})}
    coordinator = options.coordinator or ("auto" if tpus else None)
    return Placement(hosts, resources, gpus, {}, None, coordinator)


# --------------------------------------------------------------------------------------------
# A group of workers that fail together
# --------------------------------------------------------------------------------------------

class WorkerGroup:
    """One actor per host joined into one JAX job; every call goes to all of them, with a timeout."""

    def __init__(self, placement: Placement, options: ClusterOptions):
        self.options, self.placement = options, placement
        actor = ray.remote(HostWorker).options(
            num_cpus=0, num_gpus=placement.num_gpus, resources=placement.resources, max_restarts=0,
            runtime_env={"env_vars": {**placement.env, **options.worker_env}})
        self.actors = [actor.remote() for _ in range(placement.hosts)]
        self.names = [f"worker {i}" for i in range(placement.hosts)]
        self.pids: list[int] = []
        self.rows: list[tuple[int, int]] = []
        self.info: dict = {}
        self._warm: set[str] = set()  # calls already run once (compiled) in this group

    def __len__(self) -> int:
        return len(self.actors)

    def start(self, config: Config) -> dict:
        """Place the actors, join the JAX job, restore: -> {"step", "loader"} to continue from."""
        o, p, n = self.options, self.placement, len(self)
        try:
            hellos = self.gather(self.call("hello"), "start-up", o.startup_timeout)
        except WorkerFailure as e:
            raise WorkerFailure(f"{e} (are {n} Ray nodes with a free {HOST_RESOURCE!r} resource up?)") from None
        self.pids = [h["pid"] for h in hellos]
        self.names = [f"worker {i} (pid {h['pid']} on {h['node']})" for i, h in enumerate(hellos)]
        # A lone worker needs no JAX job (on CPU that keeps its collectives in-process instead of gloo).
        coordinator = p.coordinator or (hellos[0]["address"] if n > 1 else None)
        infos = self.gather([a.setup.remote(config, o.run, coordinator, n, i, p.cpu_devices, int(o.startup_timeout))
                             for i, a in enumerate(self.actors)], "setup", o.startup_timeout)
        order = sorted(range(n), key=lambda i: infos[i]["process_index"])  # "auto" numbers processes itself
        self.actors = [self.actors[i] for i in order]
        self.names, self.pids = [self.names[i] for i in order], [self.pids[i] for i in order]
        infos = [infos[i] for i in order]
        self.rows = [tuple(info["rows"]) for info in infos]
        self.info = {**infos[0], "coordinator": coordinator}
        starts = self.gather(self.call("start"), "restoring the train state and compiling", o.startup_timeout)
        if any(s != starts[0] for s in starts):
            raise WorkerFailure(f"workers disagree on where to resume: {starts}")
        self._warm.update(("step", "validate"))  # compiled by start()
        return starts[0]

    @property
    def global_batch(self) -> int:
        return self.info["global_batch"]

    def call(self, method: str, *args, per_worker: Optional[list] = None) -> list:
        """Start `method` on every worker (the same args, or per_worker[i] for worker i)."""
        if per_worker is not None:
            return [getattr(a, method).remote(arg) for a, arg in zip(self.actors, per_worker)]
        return [getattr(a, method).remote(*args) for a in self.actors]

    def timeout(self, kind: str) -> float:
        """The first call of a kind may compile (saving: the fingerprints): it gets startup_timeout."""
        first = kind not in self._warm
        self._warm.add(kind)
        return self.options.startup_timeout if first else self.options.step_timeout

    def gather(self, refs: list, what: str, timeout: float, step: Optional[int] = None) -> list:
        """Results of one call on every worker, in worker order. A worker that dies or errs is
        reported at once; one that has not answered when `timeout` runs out counts as hung."""
        started = time.monotonic()
        index = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            left = max(0.0, started + timeout - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                late = ", ".join(self.names[index[r]] for r in pending)
                raise WorkerFailure(f"{late} did not finish {what} within {timeout:g} s (hung, or its host is lost)",
                                    step, time.monotonic() - started)
            try:
                results[index[ready[0]]] = ray.get(ready[0])
            except ray.exceptions.RayError as e:
                others = {ref: index[ref] for ref in pending}
                raise self._failure(index[ready[0]], what, e, others, step, started) from None
        return results

    def _failure(self, i: int, what: str, error: Exception, others: dict, step, started) -> Exception:
        name = self.names[i]
        if isinstance(error, ray.exceptions.RayActorError):
            return WorkerFailure(f"{name} died during {what}", step, time.monotonic() - started)
        cause = getattr(error, "cause", None) or error
        text = f"{name}: {what}: {type(cause).__name__}: {_first_lines(cause)}"
        dead = self._dead_peer(others)
        if dead is not None:  # the root cause: the survivor's error is its echo
            return WorkerFailure(f"{dead} died during {what} (then {text})", step, time.monotonic() - started)
        if isinstance(cause, FATAL):
            return ClusterError(text)  # a deterministic error: a restart would hit it again
        return WorkerFailure(text, step, time.monotonic() - started)

    def _dead_peer(self, others: dict) -> Optional[str]:
        """The name of a worker whose pending call (`others`: ref -> worker index) fails with a dead
        actor within GRACE_S: a peer's death often surfaces first as an error in the survivors'
        collectives or saves, and the failure should name the root cause."""
        refs = list(others)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=GRACE_S) if refs else ([], [])
        return next((self.names[others[ref]] for ref in ready if _died(ref)), None)

    def kill(self, wait_s: float = 30.0) -> None:
        """Kill every worker, then wait (bounded) until Ray reports each dead: a worker that outlived its
        group would keep its devices busy, or, with Ray shut down under it, sit in JAX's exit barrier."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        deadline, alive = time.monotonic() + wait_s, list(self.actors)
        while alive and time.monotonic() < deadline:
            probes = {actor.hello.remote(): actor for actor in alive}
            ready, _ = ray.wait(list(probes), num_returns=len(probes), timeout=max(0.0, deadline - time.monotonic()))
            alive = [a for a in alive if not any(probes[r] is a and _died(r) for r in ready)]
            if alive:
                time.sleep(0.2)


# --------------------------------------------------------------------------------------------
# Batches on their way to the workers
# --------------------------------------------------------------------------------------------

def pack_batch(batch: Mapping[str, np.ndarray], seq: int) -> dict:
    """Crop a loader batch to `seq` and shrink it losslessly for the trip to the workers: tokens as
    uint16 when every id fits, the mask left out when all ones (plain text) and sent as uint8 when
    0/1 -- 2 to 3 bytes a token instead of 8. Segments (packed examples), when the loader gives
    them, travel as they are (uint16); labels as uint8 where all are (unpaired examples', most classes),
    else float32 (a regression's targets)."""
    tokens, mask = batch["tokens"][..., : seq + 1], batch["mask"][..., :seq]
    if tokens.size and tokens.min() >= 0 and tokens.max() < 1 << 16:
        tokens = tokens.astype(np.uint16)
    out = {"tokens": tokens}
    if "segments" in batch:
        out["segments"] = batch["segments"][..., : seq + 1]
    if "labels" in batch:
        labels = np.asarray(batch["labels"], np.float32)
        small = ((labels >= 0) & (labels <= 255) & (labels == np.round(labels))).all()
        out["labels"] = labels.astype(np.uint8) if small else labels
    if not mask.all():
        small = mask.astype(np.uint8)
        out["mask"] = small if np.array_equal(small, mask) else mask
    return out


def rows_of(batch: Mapping[str, np.ndarray], rows: tuple[int, int]) -> dict:
    """The [A, rows, ...] slice of a batch that one host feeds."""
    return {k: np.ascontiguousarray(v[:, rows[0]:rows[1]]) for k, v in batch.items()}


@dataclass
class _Job:
    """Calls sent to the workers for one step, awaited in order."""
    step: int
    step_refs: Optional[list]
    val_refs: Optional[list] = None
    eval_refs: Optional[list] = None
    save_refs: Optional[list] = None


# --------------------------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------------------------

class ClusterRun:
    """Drive one training run over a Ray cluster (or N local worker processes); see the module docstring."""

    def __init__(self, config: Config, options: ClusterOptions = ClusterOptions()):
        require_keys(config, "train_set", "model_dir")
        if options.address is not None and options.local_hosts != 1:
            raise ClusterError("--local-hosts starts workers on this machine; with --address the workers are the "
                               f"cluster's {HOST_RESOURCE!r} nodes")
        if options.local_hosts < 1 or options.max_restarts < 0:
            raise ClusterError(f"local_hosts must be >= 1 and max_restarts >= 0 (got {options.local_hosts}, "
                               f"{options.max_restarts})")
        self.config = _absolute_paths(config)
        self.options = dataclasses.replace(options, run=_absolute_run_paths(options.run))
        self.dataset, self.val_sets = open_datasets(self.config)
        self.group: Optional[WorkerGroup] = None
        self.restarts, self.failures, self.resumed_from = 0, [], []
        self.step_seconds: list[float] = []
        self.bytes_per_step = 0
        self._furthest = -1  # furthest step whose results came back
        self._interrupted = False

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the current group's workers, in process order (tests kill them)."""
        return list(self.group.pids) if self.group else []

    def train(self, on_step: Optional[Callable[["ClusterRun", int, dict], None]] = None) -> RunSummary:
        """Train to total_steps (or stop_after more steps), restarting the workers on faults.

        on_step(run, step, values) is called after each step's results are in (and logged).
        """
        t = self.config.train
        prepare_model_dir(checkpoint_dir(t), self.options.new, self.options.overwrite)
        ray_dir = connect(self.options)
        logger = MetricsLogger(self.options.run.log_dir or f"logs/{t.name}", t.name, t.wandb_project,
                               self.config.to_json_dict(), tensorboard=self.options.run.tensorboard)
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGINT, self._on_interrupt)
        try:
            return self._supervise(plan_placement(self.config, self.options), logger, on_step)
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
            logger.close()
            if ray_dir is not None:
                ray.shutdown()
                shutil.rmtree(ray_dir, ignore_errors=True)

    # ---- supervision --------------------------------------------------------------------------

    def _supervise(self, placement: Placement, logger: MetricsLogger, on_step) -> RunSummary:
        end, streak, furthest_at_failure = None, 0, -1
        while True:
            self.group = WorkerGroup(placement, self.options)
            started = None
            try:
                started = self.group.start(self.config)
                if end is None:
                    stop_after = self.options.run.stop_after
                    end = min(self.config.train.total_steps, started["step"] + stop_after) if stop_after else \
                        self.config.train.total_steps
                self.resumed_from.append(started["step"])
                self._log_start(logger, started["step"])
                return self._train(started, end, logger, on_step)
            except WorkerFailure as failure:
                if not self.resumed_from:  # never got going: the setup itself is wrong
                    raise ClusterError(f"the workers could not start: {failure}") from None
                streak = 1 if self._furthest > furthest_at_failure else streak + 1
                furthest_at_failure = self._furthest
                self.failures.append(f"{failure} (detected after {failure.seconds:.1f} s)")
                if streak > self.options.max_restarts:
                    raise ClusterError(f"giving up after {self.options.max_restarts} restart(s) in a row without "
                                       f"getting past step {self._furthest}; last failure: {failure}") from None
                self.restarts += 1
                logger.message(f"{self.failures[-1]}; restarting the workers ({streak} of "
                               f"{self.options.max_restarts}) from the last complete checkpoint")
            finally:
                self.group.kill()
                self.group = None

    def _log_start(self, logger: MetricsLogger, step: int) -> None:
        t, g = self.config.train, self.group
        info = g.info
        logger.message(f"{t.name}: step {step} of {t.total_steps} on {len(g)} host(s) x {info['local_devices']} "
                       f"{info['platform']} devices, mesh dp={info['dp']} x mp={info['mp']}, "
                       f"{self.config.model.n_params():,} parameters, "
                       + (f"JAX coordinator {info['coordinator']}, " if info["coordinator"] else "")
                       + f"checkpoints in {checkpoint_dir(t)}")
        if isinstance(self.dataset, Mixture):
            logger.message(self.dataset.describe())

    # ---- the loop -----------------------------------------------------------------------------

    def _train(self, started: dict, end: int, logger: MetricsLogger, on_step) -> RunSummary:
        step, g = started["step"], self.group
        loader = train_loader(self.config, self.dataset, g.global_batch, started["loader"])
        val_refs = self._val_refs()
        jobs: collections.deque[_Job] = collections.deque()
        self._last_result = time.monotonic()
        try:
            while step < end and not self._interrupted:
                step += 1
                jobs.append(self._dispatch(step, next(loader), loader.state(), val_refs, finished=step >= end))
                if len(jobs) > PIPELINE:
                    self._complete(jobs.popleft(), logger, on_step)
            if self._interrupted and step > started["step"] and not (jobs and jobs[-1].save_refs):
                logger.message(f"interrupted: saving step {step}")
                jobs.append(_Job(step, None, save_refs=g.call("save", loader.state())))
            while jobs:
                self._complete(jobs.popleft(), logger, on_step)
        finally:
            loader.close()
        checkpoint = g.gather(g.call("finish"), "the last checkpoint", self.options.startup_timeout)[0]
        return RunSummary(step, checkpoint, len(g), self.restarts, list(self.failures), list(self.resumed_from),
                          list(self.step_seconds), self.bytes_per_step)

    def _dispatch(self, step: int, batch: dict, loader_state: dict, val_refs, finished: bool) -> _Job:
        t, g = self.config.train, self.group
        packed = pack_batch(batch, self.config.model.seq)
        slices = [rows_of(packed, rows) for rows in g.rows]
        self.bytes_per_step = sum(v.nbytes for s in slices for v in s.values())
        job = _Job(step, g.call("step", per_worker=slices))
        if val_refs is not None and due(step, t.val_every):
            job.val_refs = g.call("validate", per_worker=val_refs)
        if t.eval_harness_tasks and due(step, t.eval_period):
            job.eval_refs = g.call("evaluate", self.dataset.index.get("tokenizer") or "gpt2")
        if due(step, t.ckpt_every) or finished:
            job.save_refs = g.call("save", loader_state)
        return job

    def _complete(self, job: _Job, logger: MetricsLogger, on_step) -> None:
        g, values = self.group, {}
        if job.step_refs is not None:
            metrics = g.gather(job.step_refs, f"step {job.step}", g.timeout("step"), job.step)
            now = time.monotonic()
            seconds, self._last_result = now - self._last_result, now
            self.step_seconds.append(seconds)
            values = train_values(_mean(metrics), job.step, seconds, self.config, g.global_batch)
        if job.val_refs is not None:
            values.update(_mean(g.gather(job.val_refs, f"validation at step {job.step}", g.timeout("validate"),
                                         job.step)))
        if job.eval_refs is not None:  # a whole task set: the start-up timeout, not a step's
            values.update(g.gather(job.eval_refs, f"evaluation at step {job.step}", self.options.startup_timeout,
                                   job.step)[0])
        if job.save_refs is not None:
            g.gather(job.save_refs, f"the checkpoint of step {job.step}", g.timeout("save"), job.step)
        self._furthest = max(self._furthest, job.step)
        if values:
            logger.log(job.step, values)
            logger.progress(job.step, self.config.train.total_steps, values)
            if on_step is not None:
                on_step(self, job.step, values)

    def _val_refs(self) -> Optional[list]:
        """Each worker's rows of the validation batches, put in the object store once per group."""
        t, g = self.config.train, self.group
        if not (t.val_every and self.val_sets):
            return None
        per_worker: list[dict] = [{} for _ in range(len(g))]
        for name, dataset in self.val_sets.items():
            with val_loader(dataset, g.global_batch, segments=uses_segments(self.config, dataset)) as loader:
                batches = [pack_batch(b, self.config.model.seq)
                           for b in itertools.islice(loader, t.val_batches or None)]
            for i, rows in enumerate(g.rows):
                per_worker[i][name] = [rows_of(b, rows) for b in batches]
        return [ray.put(batches) for batches in per_worker]

    def _on_interrupt(self, signum, frame):
        if self._interrupted:  # a second Ctrl-C: give up at once
            raise KeyboardInterrupt
        self._interrupted = True


# --------------------------------------------------------------------------------------------
# Ray, model_dir and paths
# --------------------------------------------------------------------------------------------

def start_local_ray(hosts: int, num_cpus: Optional[int] = None) -> str:
    """Start a Ray instance on this machine, on 127.0.0.1 only, offering `hosts` x HOST_RESOURCE.

    Returns its temp dir (short: Ray's socket paths must stay under 107 characters). Ray's own
    processes keep to loopback only with the environment of scripts/env.sh
    (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, RAY_USAGE_STATS_ENABLED=0, ...; see the README).
    """
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    # Ray starts its workers at niceness 15 (below the raylet's). Here they share the machine with this
    # driver and whatever else runs on it, and a niced worker gets a few percent of a busy CPU while the
    # other host's worker waits for it in every collective: with two busy processes beside it, a tiny
    # 8-step run took 361 s instead of 29. The hosts' workers are the job, so they run at the driver's
    # priority (an explicit RAY_worker_niceness is kept).
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(num_cpus=num_cpus or os.cpu_count(), resources={HOST_RESOURCE: hosts}, include_dashboard=False,
             _node_ip_address="127.0.0.1", _temp_dir=temp_dir, log_to_driver=True)
    return temp_dir


def connect(options: ClusterOptions) -> Optional[str]:
    """Join `options.address`, or start a local Ray; -> temp dir to remove after ray.shutdown() (or None
    when Ray was already initialised by the caller, who then owns it)."""
    if ray.is_initialized():
        if options.address is None:
            have = ray.cluster_resources().get(HOST_RESOURCE, 0)
            if have < options.local_hosts:
                raise ClusterError(f"the running Ray instance offers {have:g} {HOST_RESOURCE!r} resources, "
                                   f"fewer than --local-hosts {options.local_hosts}")
        return None
    if options.address is not None:
        ray.init(address=options.address)
        return ""
    return start_local_ray(options.local_hosts)


def prepare_model_dir(directory: str, new: bool, overwrite: bool) -> None:
    """--new refuses a model_dir that holds anything (a previous run) unless --overwrite, which empties it."""
    if not new or not storage.isdir(directory):
        return
    gcs = storage.is_gcs(directory)
    if not (storage.list_files(directory) if gcs else os.listdir(directory)):
        return
    if not overwrite:
        raise ClusterError(f"{directory} is not empty (a previous run?); --new will not mix a new run into it: "
                           f"add --overwrite to delete it first, or set another model_dir "
                           f"(without --new, train.py resumes it)")
    if gcs:
        for path in storage.list_files(directory):
            storage.remove(path)
    else:
        shutil.rmtree(directory)


def _absolute(path: Optional[str]) -> Optional[str]:
    """Local paths as absolute ones: workers run elsewhere (another cwd, another host)."""
    return path if path is None or storage.is_gcs(path) else os.path.abspath(path)


def _absolute_paths(config: Config) -> Config:
    t = config.train
    if isinstance(t.train_set, dict):
        check_distinct_parts(t.train_set)  # (two spellings of one dataset would become one key here)
    train = dataclasses.replace(t, model_dir=t.model_dir if t.bucket else _absolute(t.model_dir),
                                train_set=({_absolute(p): w for p, w in t.train_set.items()}
                                           if isinstance(t.train_set, dict) else _absolute(t.train_set)),
                                val_set={k: _absolute(v) for k, v in t.val_set.items()})
    return dataclasses.replace(config, train=train)


def _absolute_run_paths(run: RunOptions) -> RunOptions:
    return dataclasses.replace(run, tune_model_path=_absolute(run.tune_model_path), hf=_absolute(run.hf))


def _check_can_listen(address: str) -> None:
    """Raise StartupError unless this host can listen on "host:port" (jaxlib 0.10 may crash the whole
    process, rather than raise, when its coordinator cannot bind)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT is no obstacle
            s.bind((host, int(port)))
    except (OSError, ValueError) as e:
        raise StartupError(f"the JAX coordinator cannot listen on {address} on this host: "
                           f"{getattr(e, 'strerror', None) or e}") from None


def _died(ref) -> bool:
    """Whether the finished call `ref` failed because its actor died."""
    try:
        ray.get(ref)
    except ray.exceptions.RayActorError:
        return True
    except ray.exceptions.RayError:
        pass
    return False


def _mean(results: list[dict]) -> dict:
    return {k: float(np.mean([r[k] for r in results])) for k in results[0]}


def _first_lines(error: BaseException, n: int = 3) -> str:
    return " ".join(str(error).strip().splitlines()[:n])
