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

from mesh_transformer import cli


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_run_args(p)
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
    args = p.parse_args(argv)
    cli.check_at_least(p, [("--local-hosts", args.local_hosts, 1), ("--cpu-devices", args.cpu_devices, 1),
                           ("--max-restarts", args.max_restarts, 0)])
    # (--step-timeout 0 would time out every step, each timeout a restart, until the run gave up)
    cli.check_above_zero(p, [("--step-timeout", args.step_timeout, " seconds"),
                             ("--startup-timeout", args.startup_timeout, " seconds")])
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from mesh_transformer.config import load_config
    from mesh_transformer.train.cluster import ClusterOptions, ClusterRun

    options = ClusterOptions(address=args.address, local_hosts=args.local_hosts, cpu_devices=args.cpu_devices,
                             new=args.new, overwrite=args.overwrite, max_restarts=args.max_restarts,
                             step_timeout=args.step_timeout, startup_timeout=args.startup_timeout,
                             coordinator=args.coordinator, run=cli.run_options(args))
    with cli.user_errors() as status:
        summary = ClusterRun(load_config(args.config), options).train()
    if status.code:
        return status.code
    print(f"done: step {summary.step} on {summary.hosts} host(s), latest checkpoint {summary.checkpoint}, "
          f"{summary.restarts} restart(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
