"""Device mesh (fsdp x tp) from the devices and the settings, with checks that name the rule broken,
and LoRA parameter shardings that fit their factors.

Multi-host TPU pods: call :func:`init_distributed` first on every host (it runs
``jax.distributed.initialize()``, which reads the TPU environment); ``jax.devices()`` then lists
the chips of all hosts and the same mesh spans the pod. On one host it does nothing.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from ckptbridge.config import ModelConfig
from ckptbridge.errors import ConfigError

log = logging.getLogger(__name__)


def init_distributed() -> None:
    """Join a multi-host run when the environment describes one (TPU pod slices, or the
    ``JAX_COORDINATOR_ADDRESS``/``JAX_NUM_PROCESSES``/``JAX_PROCESS_ID`` variables)."""
    import jax

    multi = os.environ.get("JAX_COORDINATOR_ADDRESS") or os.environ.get("TPU_WORKER_HOSTNAMES", "").count(",") > 0
    if multi:
        jax.distributed.initialize()
        log.info("jax.distributed: process %d of %d", jax.process_index(), jax.process_count())


def check_mesh(fsdp: int, tp: int, n_devices: int, cfg: ModelConfig) -> None:
    """Raise a ConfigError naming the first rule the mesh breaks."""
    if fsdp * tp != n_devices:
        raise ConfigError(f"mesh fsdp={fsdp} x tp={tp} = {fsdp * tp} devices, but {n_devices} are available; "
                          "set fsdp and tp so that their product is the device count")
    kv = sorted({layer.num_kv_heads for layer in cfg.layers if not layer.is_global})
    gkv = sorted({layer.num_kv_heads for layer in cfg.layers if layer.is_global})
    for what, sizes in (("query heads", [cfg.num_heads]), ("kv heads", kv), ("global kv heads", gkv)):
        for size in sizes:
            if size % tp:
                raise ConfigError(f"tp={tp} must divide the {what} ({size}): Tunix shards heads over tp (a "
                                  "model with 4 kv heads on its global layers takes tp=4 on a v5p-8, not 8)")
    if cfg.hidden_size % fsdp or cfg.intermediate_size % fsdp:
        raise ConfigError(f"fsdp={fsdp} must divide the hidden size ({cfg.hidden_size}) and the MLP width "
                          f"({cfg.intermediate_size})")


def make_mesh(fsdp: int, tp: int, cfg: ModelConfig):
    import jax
    from jax.sharding import Mesh

    devices = jax.devices()
    check_mesh(fsdp, tp, len(devices), cfg)
    return Mesh(np.asarray(devices).reshape(fsdp, tp), ("fsdp", "tp"))
