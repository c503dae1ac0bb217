"""The ('dp', 'mp') device mesh, and the one place (dp, mp) is derived from a config and flags."""
from __future__ import annotations

from typing import Optional

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from mesh_transformer.config import ConfigError, TrainConfig

DP, MP = "dp", "mp"


def mesh_shape(train: Optional[TrainConfig], n_devices: Optional[int], dp: Optional[int] = None,
               mp: Optional[int] = None) -> tuple[int, int]:
    """(dp, mp): mp from the flag, else the config's cores_per_replica, else 1; dp from the flag, else
    tpu_size // mp, else every remaining device (`n_devices`; None: 1, for planning without devices)."""
    mp = mp if mp is not None else (train.cores_per_replica if train is not None else 1)
    if mp <= 0 or (dp is not None and dp <= 0):
        raise ConfigError(f"--dp and --mp must be positive, got dp={dp} mp={mp}")
    if dp is None and train is not None and train.tpu_size is not None:
        if train.tpu_size % mp:
            raise ConfigError(f"config key 'tpu_size': {train.tpu_size} devices do not split into mp={mp} groups")
        dp = train.tpu_size // mp
    if dp is None:
        if n_devices is None:
            return 1, mp
        if n_devices % mp:
            raise ConfigError(f"config key 'cores_per_replica': {mp} does not divide the {n_devices} available devices")
        dp = n_devices // mp
    return dp, mp


def make_mesh(mp: int, dp: Optional[int] = None, devices=None) -> Mesh:
    """A ('dp', 'mp') mesh; mp devices of a replica are neighbours (fast links carry mp traffic)."""
    devices = list(jax.devices() if devices is None else devices)
    dp, mp = mesh_shape(None, len(devices), dp, mp)
    if dp * mp > len(devices):
        raise ConfigError(f"a dp={dp} x mp={mp} mesh needs {dp * mp} devices, only {len(devices)} are available")
    devices = devices[: dp * mp]
    try:
        grid = mesh_utils.create_device_mesh((dp, mp), devices)
    except (AssertionError, NotImplementedError, ValueError):
        grid = np.array(devices).reshape(dp, mp)
    return Mesh(grid, (DP, MP))


def mesh_for(train: TrainConfig, dp: Optional[int] = None, mp: Optional[int] = None, devices=None) -> Mesh:
    """The mesh a config (and optional --dp/--mp flags) asks for, on `devices` (default: all)."""
    devices = list(jax.devices() if devices is None else devices)
    dp, mp = mesh_shape(train, len(devices), dp, mp)
    return make_mesh(mp, dp, devices)
