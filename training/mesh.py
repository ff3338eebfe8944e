"""Device mesh (fsdp x tp) from the devices and the settings, with checks that name the rule broken,
and LoRA parameter shardings that fit their factors.

Several processes (training/distributed.py): once they have joined, ``jax.devices()`` lists the
devices of all of them and the same mesh spans them.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from ckptbridge.config import ModelConfig
from ckptbridge.errors import ConfigError

log = logging.getLogger(__name__)


def start_backend() -> None:
    """Start JAX's accelerator backend (seconds on a TPU) on a thread, while the caller goes on
    importing and reading; the first ``jax.devices()`` elsewhere waits for it. A run of several
    processes joins them first (:func:`training.distributed.join`)."""
    import threading

    def start() -> None:
        try:
            import jax

            jax.devices()
        except Exception:  # the caller's own jax.devices() reports it
            pass

    threading.Thread(target=start, name="backend", daemon=True).start()


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


def make_mesh(fsdp: int, tp: int, cfg: ModelConfig, devices=None):
    """The fsdp x tp mesh over ``devices`` (default: every device JAX sees)."""
    import jax
    from jax.sharding import Mesh

    devices = jax.devices() if devices is None else list(devices)
    check_mesh(fsdp, tp, len(devices), cfg)
    return Mesh(np.asarray(devices).reshape(fsdp, tp), ("fsdp", "tp"))


# HBM per chip by jax's device_kind (first match), for a topology compiled for without its chips
HBM_BYTES: tuple[tuple[str, int], ...] = (
    (r"TPU v5 ?lite|TPU v5e", int(15.75 * 2**30)),
    (r"TPU v5p|TPU v5", 95 * 2**30),
    (r"TPU v6", 31 * 2**30 + 2**29),
    (r"TPU v4", 32 * 2**30),
)


def topology_devices(name: str):
    """The devices of a TPU slice named like ``v5p:2x2x1`` or ``v5e:1x1`` (chips per axis), to
    compile for ahead of time without the chips (needs the TPU runtime, libtpu: ``pip install
    'jax[tpu]'``; no TPU needed). One host holds at most 2x2x1 chips."""
    import re

    from jax.experimental import topologies

    m = re.fullmatch(r"(v\d+[a-z]*):(\d+(?:x\d+){1,2})", name.strip())
    if m is None:
        raise ConfigError(f"--topology {name}: write it as GENERATION:AxB[xC] (chips per axis), e.g. v5p:2x2x1 "
                          "for a v5p-8, v5e:1x1 for one v5e chip")
    dims = [int(d) for d in m.group(2).split("x")]
    host = tuple(min(d, h) for d, h in zip(dims + [1] * (3 - len(dims)), (2, 2, 1)))
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # libtpu on a machine that is no TPU VM
    try:
        topology = topologies.get_topology_desc(platform="tpu", topology_name=name.strip(), chips_per_host_bounds=host)
    except Exception as e:  # no libtpu, or a name it does not know
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise ConfigError(f"--topology {name}: cannot describe that TPU slice ({first[:200]}); it needs the TPU "
                          "runtime: pip install 'jax[tpu]'") from None
    return list(topology.devices)


def device_memory(device) -> tuple[int | None, str]:
    """Bytes of memory one device has, and where the figure comes from ("runtime": what the
    device reports; "nominal": the chip's HBM, for a device compiled for without it)."""
    import re

    try:
        stats = device.memory_stats() or {}
    except Exception:  # a topology's device has no runtime behind it
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), "runtime"
    for pattern, size in HBM_BYTES:
        if re.search(pattern, getattr(device, "device_kind", ""), re.IGNORECASE):
            return size, "nominal"
    return None, "unknown"
