"""Training in several processes (the hosts of a TPU slice, or processes on one machine) through
JAX's own multi-process runtime: its coordinator, its collectives, and its key-value store for a
watch on the peers.

Where the processes come from, first match:

1. ``--coordinator HOST:PORT --num-processes N --process-id I`` on the command line;
2. JAX's variables ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``;
3. a TPU slice of several hosts (``TPU_WORKER_HOSTNAMES`` lists more than one): JAX reads the
   coordinator, the count and the index from the TPU environment.

Otherwise the run is one process and nothing here does anything. On CPUs the processes talk
through gloo (``jax_cpu_collectives_implementation``), set before the backend starts.

A dead peer (killed, out of memory, its host gone) would leave the others waiting in a collective
for ever. :class:`PeerWatch` keeps a counter per process in the coordinator's key-value store,
bumped every second by a thread; a process whose counter has not moved for ``peer_timeout``
seconds, or a coordinator that has not answered for that long, ends every other process with one
line naming it (exit code :data:`PEER_LOST_EXIT`). JAX's own heartbeat check, which would abort
with a stack trace, is given ``peer_timeout`` + 60 s so that this one speaks first.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time

from ckptbridge.errors import ConfigError

log = logging.getLogger("training")

PEER_LOST_EXIT = 9  # a peer process stopped; what the command line's epilog says
DEFAULT_PEER_TIMEOUT = 180.0
_KEY = "ckptbridge/alive/"
_DONE = "ckptbridge/done/"


@dataclasses.dataclass(frozen=True)
class Cluster:
    """How this process joins the others (``coordinator`` None: from the TPU environment)."""

    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    source: str  # "flags", "environment" or "tpu"


def cluster_of(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               environ: dict | None = None) -> Cluster | None:
    """The processes this one belongs to, from the flags, JAX's variables or the TPU environment
    (see the module's docstring); None for a one-process run. Half a description (a coordinator
    without a count, an index out of range) is a ConfigError naming what is missing."""
    env = os.environ if environ is None else environ
    given = [coordinator, num_processes, process_id]
    if any(v is not None for v in given):
        source = "flags"
        names = ("--coordinator", "--num-processes", "--process-id")
    elif env.get("JAX_COORDINATOR_ADDRESS") or env.get("JAX_NUM_PROCESSES") or env.get("JAX_PROCESS_ID"):
        source = "environment"
        names = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
        try:
            given = [env.get(names[0]) or None, *(int(env[n]) if env.get(n) else None for n in names[1:])]
        except ValueError:
            raise ConfigError(f"{names[1]}={env.get(names[1])!r}, {names[2]}={env.get(names[2])!r}: both must be "
                              "whole numbers") from None
    elif env.get("TPU_WORKER_HOSTNAMES", "").count(",") > 0:
        return Cluster(None, None, None, "tpu")
    else:
        return None
    missing = [n for n, v in zip(names, given) if v is None]
    if missing:
        raise ConfigError(f"{', '.join(missing)} missing: a run of several processes needs all of {', '.join(names)} "
                          "(the coordinator's HOST:PORT, the process count, this process's index from 0)")
    coordinator, num_processes, process_id = given
    if ":" not in str(coordinator):
        raise ConfigError(f"{names[0]} {coordinator}: write it as HOST:PORT (process 0's host, a free port)")
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ConfigError(f"{names[2]} {process_id} with {names[1]} {num_processes}: the index runs from 0 to "
                          f"{num_processes - 1}")
    return Cluster(str(coordinator), int(num_processes), int(process_id), source)


_joined: Cluster | None = None
_watch: PeerWatch | None = None


def join(cluster: Cluster | None, *, peer_timeout: float = DEFAULT_PEER_TIMEOUT) -> None:
    """Join the other processes (before JAX's backend starts: before any ``jax.devices()``), and
    watch them. One process: nothing."""
    global _joined, _watch
    if cluster is None or _joined is not None:
        return
    import jax

    if peer_timeout <= 0:
        raise ConfigError(f"--peer-timeout {peer_timeout}: give the seconds a silent peer is waited for (> 0)")
    if _cpu_only():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption service would catch SIGTERM and wait for a sync point the loop never asks
    # for: a terminated process must end as a one-process run does
    jax.config.update("jax_enable_preemption_service", False)
    kwargs = dict(initialization_timeout=int(max(60, peer_timeout)), heartbeat_timeout_seconds=int(peer_timeout) + 60)
    try:
        if cluster.source == "tpu":
            jax.distributed.initialize(**kwargs)
        else:
            jax.distributed.initialize(cluster.coordinator, cluster.num_processes, cluster.process_id, **kwargs)
    except Exception as e:  # the coordinator never answered: a wrong address, or process 0 not started
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise ConfigError(f"cannot join the other processes through {cluster.coordinator or 'the TPU environment'}: "
                          f"{first[:200]}; start process 0 (the coordinator) and every other with the same "
                          "address and count") from None
    _joined = cluster
    _watch = PeerWatch(jax.process_index(), jax.process_count(), peer_timeout, cluster.coordinator)
    _watch.start()
    log.info("process %d of %d (coordinator %s), %d local devices of %d", jax.process_index(), jax.process_count(),
             cluster.coordinator or "from the TPU environment", jax.local_device_count(), jax.device_count())


def finish() -> None:
    """This process is done: the watch stops counting on it, and the processes leave together."""
    global _watch
    if _watch is None:
        return
    _watch.done()
    _watch = None
    import jax

    jax.distributed.shutdown()


def _cpu_only() -> bool:
    platforms = os.environ.get("JAX_PLATFORMS", "") or os.environ.get("JAX_PLATFORM_NAME", "")
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    import importlib.util

    return not any(importlib.util.find_spec(m) for m in ("libtpu", "jax_cuda12_plugin", "jax_cuda13_plugin"))


def _client():
    """JAX's client of the coordinator's service (its key-value store): ``jax.distributed``
    keeps it as ``global_state.client``; tests/test_multiprocess.py fails if that moves."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return client


class PeerWatch:
    """Every second: bump this process's counter in the key-value store and read the others'.
    A peer whose counter stands still for ``timeout`` seconds (or a store that does not answer for
    that long: the coordinator, process 0, is gone) ends this process with one line."""

    def __init__(self, index: int, count: int, timeout: float, coordinator: str | None, interval: float = 1.0):
        self.index, self.count, self.timeout, self.interval = index, count, timeout, interval
        self.coordinator = coordinator
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peer-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def done(self) -> None:
        try:
            _client().key_value_set(f"{_DONE}{self.index}", "1", allow_overwrite=True)
        except Exception:  # the others are finishing too; nothing to tell them
            pass
        self._stop.set()

    def _run(self) -> None:
        client = _client()
        beat = 0
        now = time.monotonic()
        last_seen = {p: (None, now) for p in range(self.count) if p != self.index}
        store_ok = now
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            beat += 1
            try:
                client.key_value_set(f"{_KEY}{self.index}", str(beat), allow_overwrite=True)
                values = dict(client.key_value_dir_get(_KEY))
                done = {k.rsplit("/", 1)[-1] for k, _ in client.key_value_dir_get(_DONE)}
                store_ok = now
            except Exception:
                if now - store_ok > self.timeout:
                    where = f", {self.coordinator}" if self.coordinator else ""
                    self._lost(0, f"(the coordinator{where}) stopped: its key-value store has not answered for "
                                  f"{self.timeout:.0f} s")
                continue
            for p, (value, since) in list(last_seen.items()):
                if str(p) in done:
                    del last_seen[p]
                    continue
                got = values.get(f"{_KEY}{p}")
                if got != value:
                    last_seen[p] = (got, now)
                elif now - since > self.timeout:
                    what = "never started its heartbeat" if value is None else "stopped: no heartbeat"
                    self._lost(p, f"{what} for {self.timeout:.0f} s")

    def _lost(self, peer: int, why: str) -> None:
        print(f"training: error: process {peer} of {self.count} {why} (seen from process {self.index}); "
              "the run stops here: start every process again with the same command to resume from the last "
              "checkpoint", file=sys.stderr, flush=True)
        os._exit(PEER_LOST_EXIT)
