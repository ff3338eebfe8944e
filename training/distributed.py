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

A process that ends (killed, crashed, out of memory) is known at once, not after the timeout:
every two processes hold a TCP connection open (:class:`PeerLinks`), never written, which the
operating system closes the moment either ends, however it ends; one that closes without its
process having said it finished ends the others the same way. A collective that fails because a
peer is gone ends the process as well (:func:`end_if_peer_lost`), never in JAX's shutdown
barrier. Only a host that vanishes, which closes nothing, waits for the heartbeat's timeout.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import selectors
import socket
import struct
import sys
import threading
import time

from ckptbridge.errors import ConfigError

log = logging.getLogger("training")

PEER_LOST_EXIT = 9  # a peer process stopped; what the command line's epilog says
DEFAULT_PEER_TIMEOUT = 180.0
_KEY = "ckptbridge/alive/"
_DONE = "ckptbridge/done/"
_ADDR = "ckptbridge/link/"
LINK_CLOSED = "ended without finishing: its connection to this process closed"


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


def end_if_peer_lost(error: BaseException) -> None:
    """After ``error`` ended the run of a process that joined others: if a peer is gone (a
    collective fails as soon as a peer's connection closes, long before any heartbeat times
    out), end this process as the watch does, one line naming the peer and exit
    :data:`PEER_LOST_EXIT`, without waiting in JAX's shutdown barrier for a peer that will never
    come. Otherwise (every peer alive: the error is this process's own) return."""
    if _watch is None:
        return
    found = _watch.find_lost()
    if found is not None:
        peer, why = found
        _watch._lost(peer, f"{why} ({_first_line(error)})")


def _first_line(error: BaseException) -> str:
    text = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {text[:160]}" if text else type(error).__name__


def _finished(client) -> set[str]:
    """The indices (as strings) of the processes that said they finished (:meth:`PeerWatch.done`)."""
    return {k.rsplit("/", 1)[-1] for k, _ in client.key_value_dir_get(_DONE)}


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
    that long: the coordinator, process 0, is gone), or whose connection (:class:`PeerLinks`)
    closes before it said it finished, ends this process with one line."""

    def __init__(self, index: int, count: int, timeout: float, coordinator: str | None, interval: float = 1.0):
        self.index, self.count, self.timeout, self.interval = index, count, timeout, interval
        self.coordinator = coordinator
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peer-watch", daemon=True)
        self.links = PeerLinks(index, count, coordinator, self._closed)

    def start(self) -> None:
        self._thread.start()
        self.links.start()

    def done(self) -> None:
        try:
            _client().key_value_set(f"{_DONE}{self.index}", "1", allow_overwrite=True)
        except Exception:  # the others are finishing too; nothing to tell them
            pass
        self._stop.set()

    def _closed(self, peer: int) -> None:
        """``peer``'s connection closed: unless it said it finished, it is gone."""
        if self._stop.is_set():
            return
        done: set[str] = set()
        if peer != 0:  # process 0 holds the store, and leaves only with the others (JAX's shutdown)
            try:
                done = _finished(_client())
            except Exception:
                pass
        if str(peer) not in done:
            self._lost(peer, LINK_CLOSED)

    def find_lost(self, beats: int = 3) -> tuple[int, str] | None:
        """The peer that is gone, and how it went, seen over ``beats`` of the live ones' counters
        (they keep counting while this waits, whatever the others' main threads do); None if every
        peer still counts or has finished."""
        try:
            client = _client()
            done = _finished(client)
            ended = [p for p in sorted(self.links.closed()) if str(p) not in done]
            if ended:
                return ended[0], LINK_CLOSED
            before = dict(client.key_value_dir_get(_KEY))
            time.sleep(beats * self.interval + 0.5)
            after = dict(client.key_value_dir_get(_KEY))
            done = _finished(client)
        except Exception:  # the store is process 0's: the coordinator is gone
            where = f", {self.coordinator}" if self.coordinator else ""
            return 0, f"(the coordinator{where}) stopped: its key-value store does not answer"
        for p in range(self.count):
            key = f"{_KEY}{p}"
            if p != self.index and str(p) not in done and after.get(key) == before.get(key):
                return p, f"stopped: a collective failed and its heartbeat stood still for " \
                          f"{beats * self.interval + 0.5:.0f} s"
        return None

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
                done = _finished(client)
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


class PeerLinks:
    """A TCP connection between this process and every other, held open and never written: the
    operating system closes it when either process ends, however it ends, so that a peer's end is
    seen at once (:meth:`closed`; ``on_closed(peer)`` is called). Each process listens on a port
    of its own, published in the coordinator's key-value store; it connects to the peers before it
    and accepts the ones after it. Where a connection cannot be made (a firewall between hosts),
    that peer is watched by its heartbeat alone."""

    def __init__(self, index: int, count: int, coordinator: str | None, on_closed=None):
        self.index, self.count, self.coordinator, self.on_closed = index, count, coordinator, on_closed
        self._closed: set[int] = set()
        self._lock = threading.Lock()
        self._selector = selectors.DefaultSelector()
        self._thread = threading.Thread(target=self._run, name="peer-links", daemon=True)

    def closed(self) -> set[int]:
        """The peers whose connection has closed."""
        with self._lock:
            return set(self._closed)

    def start(self) -> None:
        try:
            server = socket.create_server(("", 0), family=socket.AF_INET)
            client = _client()
            client.key_value_set(f"{_ADDR}{self.index}", f"{_own_address(self.coordinator)}:{server.getsockname()[1]}",
                                 allow_overwrite=True)
        except Exception as e:  # no socket here: the heartbeat alone
            log.debug("peer links: not listening: %s", e)
            return
        server.setblocking(False)
        self._selector.register(server, selectors.EVENT_READ, None)
        self._thread.start()

    def _run(self) -> None:
        waiting = set(range(self.index))  # the peers before this one: this one connects to them
        deadline = time.monotonic() + 600
        while True:
            if waiting and time.monotonic() < deadline:
                self._connect(waiting)
            for key, _ in self._selector.select(timeout=0.5 if waiting else None):
                sock: socket.socket = key.fileobj  # type: ignore[assignment]  # only sockets are registered
                if key.data is None:  # the listener: a peer after this one connects
                    try:
                        conn, _ = sock.accept()
                        conn.settimeout(5)
                        peer = struct.unpack("<I", _recv_exactly(conn, 4))[0]
                    except OSError:
                        continue
                    conn.setblocking(False)
                    self._selector.register(conn, selectors.EVENT_READ, peer)
                    continue
                try:
                    data = sock.recv(64)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:  # closed: the peer's process ended
                    self._selector.unregister(sock)
                    sock.close()
                    with self._lock:
                        self._closed.add(key.data)
                    if self.on_closed is not None:
                        self.on_closed(key.data)

    def _connect(self, waiting: set[int]) -> None:
        client = _client()
        for peer in sorted(waiting):
            try:
                found = client.key_value_try_get(f"{_ADDR}{peer}")
            except Exception:  # not published yet
                continue
            waiting.discard(peer)
            host, _, port = found.rpartition(":")
            try:
                conn = socket.create_connection((host, int(port)), timeout=5)
                conn.sendall(struct.pack("<I", self.index))
            except OSError as e:
                log.debug("peer links: no connection to process %d at %s: %s", peer, found, e)
                continue
            conn.setblocking(False)
            self._selector.register(conn, selectors.EVENT_READ, peer)


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        got = conn.recv(n - len(out))
        if not got:
            raise OSError("closed")
        out += got
    return out


def _own_address(coordinator: str | None) -> str:
    """This host's address as the peers reach it: the interface that leads to the coordinator."""
    if coordinator is None:
        from jax._src import distributed

        coordinator = distributed.global_state.coordinator_address
    host, _, port = (coordinator or "").rpartition(":")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host or "8.8.8.8", int(port or 9)))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
