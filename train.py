"""Train over many hosts (a TPU pod slice, GPU nodes) from one driver, with one Ray worker per host.

    python train.py --config CFG                       # start Ray here, one worker with this machine's devices
    python train.py --config CFG --local-hosts 2       # try multi-host on one box: 2 workers split the devices
    python train.py --config CFG --address HEAD:6379   # join a cluster: one worker per 'mesh_host' node
    python train.py --config CFG --new --overwrite     # start over, deleting model_dir

Resumes from the latest complete checkpoint in the config's model_dir unless --new. The driver
holds the data and sends each host its rows of every batch; a worker that dies or hangs makes the
driver restart all workers from the last complete checkpoint (see mesh_transformer/cluster.py).
Every host must reach model_dir: use a gs:// bucket (config key 'bucket') or a shared filesystem.
"""
from __future__ import annotations

import argparse
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="JSON config (original mesh-transformer-jax keys)")
    p.add_argument("--address", help="Ray cluster to join (HEAD:6379, auto, ray://HEAD:10001); default: start one here")
    p.add_argument("--new", action="store_true", help="start a new run instead of resuming model_dir")
    p.add_argument("--overwrite", action="store_true", help="with --new: delete what model_dir holds")
    p.add_argument("--local-hosts", type=int, default=1, metavar="N",
                   help="without --address: run N worker processes here, each with 1/N of the devices")
    p.add_argument("--cpu-devices", type=int, metavar="D",
                   help="without --address: simulate D CPU devices in all (default: tpu_size)")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="give up after this many restarts in a row that get no further (default 3)")
    p.add_argument("--step-timeout", type=float, default=600.0, help="seconds a step may take (default 600)")
    p.add_argument("--startup-timeout", type=float, default=1800.0,
                   help="seconds for start-up, restore and each first compile (default 1800)")
    p.add_argument("--coordinator", help="JAX coordinator HOST:PORT, or 'auto' (default: a free port on worker 0; "
                                         "auto on TPU hosts)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--tune-model-path", help="fine-tune from this checkpoint directory (fresh LR schedule)")
    source.add_argument("--hf", help="fine-tune from this HF GPT-J directory (fresh LR schedule and optimizer)")
    p.add_argument("--fresh-opt", action="store_true", help="with --tune-model-path: do not load optimizer state")
    p.add_argument("--log-dir", help="metrics.jsonl + TensorBoard events (default logs/<name>)")
    p.add_argument("--no-tensorboard", action="store_true")
    p.add_argument("--stop-after", type=int, help="stop (with a checkpoint) after this many steps of this run")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from mesh_transformer.checkpoint import CheckpointError
    from mesh_transformer.cluster import ClusterError, ClusterOptions, ClusterRun
    from mesh_transformer.config import ConfigError, load_config
    from mesh_transformer.data import DatasetError
    from mesh_transformer.train_loop import RunOptions, TrainingError

    run_options = RunOptions(tune_model_path=args.tune_model_path, hf=args.hf, fresh_opt=args.fresh_opt,
                             log_dir=args.log_dir, tensorboard=not args.no_tensorboard, stop_after=args.stop_after)
    options = ClusterOptions(address=args.address, local_hosts=args.local_hosts, cpu_devices=args.cpu_devices,
                             new=args.new, overwrite=args.overwrite, max_restarts=args.max_restarts,
                             step_timeout=args.step_timeout, startup_timeout=args.startup_timeout,
                             coordinator=args.coordinator, run=run_options)
    try:
        summary = ClusterRun(load_config(args.config), options).train()
    except (ClusterError, ConfigError, CheckpointError, DatasetError, TrainingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"done: step {summary.step} on {summary.hosts} host(s), latest checkpoint {summary.checkpoint}, "
          f"{summary.restarts} restart(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
