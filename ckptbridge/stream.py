"""Bounded parallel streaming: the one way ckptbridge reads, computes and writes ahead.

A conversion is a sequence of pieces in the order its writer needs them: row blocks of a
tensor, whole tensors, batches of LoRA factors, merged rows. An :class:`Engine` runs the jobs
that make them (read, decode, rearrange, multiply) on ``workers`` threads while the writer takes
the finished pieces in order from a :class:`Stream`. Every piece started and not yet released
counts against one :class:`Budget` of bytes shared by all the streams of a conversion, so
memory is bounded by the budget (plus at most one piece per stream, so that a piece larger than
the budget still goes through, alone) whatever the worker count.

An exception in a job cancels the jobs of its stream not yet started and is raised once, to the
consumer, at the piece that failed; closing the engine (leaving its ``with`` block) cancels what
has not started and waits for every thread it started.

numpy, ml_dtypes, TensorStore and the kernel's file I/O release the GIL for the work that
matters here (copies, transposes, products, codecs, reads), so threads spread it over cores.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

from ckptbridge import malloc, options
from ckptbridge.errors import ConfigError

T = TypeVar("T")
Job = tuple[int, Callable[[], T]]  # (bytes the piece holds, function that makes it)

DEFAULT_MEMORY_BUDGET = options.parse_size(options.DEFAULT_MEMORY_BUDGET)
MAX_QUEUED_PER_WORKER = 4  # pieces started ahead per worker at most, however small they are
# Default workers of the verbs whose pieces are encoded or decoded on TensorStore's own threads
# (safetensors-to-orbax, orbax-to-safetensors): ours only read and rearrange, and TensorStore's
# codec threads use every core besides. On a 13-core host (docs/benchmarks.md, "On a
# TPU host's 13 cores") 4 of ours were as fast as 13 or faster, with 40% less CPU for o2s.
CODEC_VERB_WORKERS = 4


def default_workers(cap: int | None = None) -> int:
    """The worker count a verb uses when none is given: the usable cores, at most ``cap``."""
    cores = usable_cores()
    return cores if cap is None else max(1, min(cores, cap))


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, as ``taskset`` sets it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class Budget:
    """Bytes that may be held at once by the pieces of every stream of an engine."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"a budget needs at least one byte, not {limit}")
        self.limit = int(limit)
        self.used = 0
        self.peak = 0  # the most bytes held at once
        self._lock = threading.Lock()

    def try_acquire(self, nbytes: int, force: bool = False) -> bool:
        """Take ``nbytes`` if they fit (always when ``force``)."""
        with self._lock:
            if not force and self.used + nbytes > self.limit:
                return False
            self.used += nbytes
            self.peak = max(self.peak, self.used)
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes
            if self.used < 0:
                raise RuntimeError(f"budget released {-self.used} bytes more than it gave")

    def fits(self, nbytes: int) -> bool:
        with self._lock:
            return self.used + nbytes <= self.limit


class Engine:
    """``workers`` threads and one byte :class:`Budget` for the streams of one conversion.

    With ``reuse_freed_memory`` (the default), memory any thread frees is reused by the others
    instead of faulted in afresh (:mod:`ckptbridge.malloc`, process-wide), so that peak RSS follows
    the budget at any worker count. Use as a context manager; leaving it (normally or by an
    exception) cancels the jobs not started and joins every thread."""

    def __init__(self, workers: int | None = None, memory_budget: int = DEFAULT_MEMORY_BUDGET,
                 name: str = "ckptbridge", reuse_freed_memory: bool = True):
        self.workers = usable_cores() if workers is None else int(workers)
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, not {workers}")
        self.budget = Budget(memory_budget)
        if reuse_freed_memory:  # else each worker's arena keeps pieces past the budget (ckptbridge.malloc)
            malloc.reuse_freed_memory()
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix=name)
        self._streams: list[Stream] = []
        self._closed = False

    def stream(self, jobs: Iterable[Job]) -> Stream:
        """The results of ``jobs`` (``(nbytes, fn)`` pairs, taken lazily, in order) in order."""
        if self._closed:
            raise RuntimeError("this engine is closed")
        s: Stream = Stream(self, jobs)
        self._streams.append(s)
        return s

    def submit(self, fn: Callable[[], T]) -> Future:
        return self._pool.submit(fn)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for s in self._streams:
            s.close()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """A verb's ``workers`` (``--workers``) and ``memory_budget`` (``--memory-budget``), checked
    before any work starts; :meth:`engine` makes the engine when the work does."""

    workers: int
    memory_budget: int

    @classmethod
    def of(cls, workers: int | None = None, memory_budget: str | int | None = None, *, least: int = 0,
           least_what: str = "", default_cap: int | None = None) -> Parallelism:
        """A ConfigError naming the parameter and its flag when one is not usable, e.g. a budget
        under ``least`` bytes (one piece: ``least_what``). Without ``workers``: the usable cores,
        at most ``default_cap``. Sets the allocator up for the verb (:mod:`ckptbridge.malloc`) now,
        before its sources start threads of their own: a thread that allocated before keeps an
        arena of its own (TensorStore's, opening an Orbax checkpoint: orbax-to-safetensors of a
        31B-width model at 639-716 MB of peak RSS and 157-177 thousand page faults, against 421-424
        MB and 23-27 thousand with the arena set first)."""
        count = options.workers("workers (--workers)", workers)
        budget = (DEFAULT_MEMORY_BUDGET if memory_budget is None
                  else options.size("memory_budget (--memory-budget)", memory_budget))
        if budget < least:
            raise ConfigError(
                f"memory_budget (--memory-budget) {budget} bytes is less than one piece ({least} bytes, "
                f"{least_what}); raise it or make the pieces smaller"
            )
        malloc.reuse_freed_memory()
        return cls(default_workers(default_cap) if count is None else count, budget)

    @classmethod
    def for_chunks(cls, chunk_size: str | int, workers: int | None = None,
                   memory_budget: str | int | None = None) -> tuple[int, Parallelism]:
        """``chunk_size`` in bytes and the parallelism of a verb that moves Orbax pieces of at most
        that size (:meth:`of`, its budget one piece at least, at most :data:`CODEC_VERB_WORKERS`
        workers by default)."""
        chunk_bytes = options.size("chunk_size", chunk_size)
        return chunk_bytes, cls.of(workers, memory_budget, least=chunk_bytes,
                                   least_what="chunk_size (--chunk-size)", default_cap=CODEC_VERB_WORKERS)

    def engine(self, name: str = "ckptbridge") -> Engine:
        return Engine(self.workers, self.memory_budget, name)


class Stream(Generic[T]):
    """Pieces made on an engine's workers, handed out in the order of their jobs.

    A piece's bytes are held from when its job starts until the consumer asks for the next one
    (or, after :meth:`hand_over`, until the consumer calls the function it returned). Jobs are
    started from the consumer's thread, as the budget allows, each time it asks for a piece or
    calls :meth:`prefetch`; the piece it waits for is started even over the budget when nothing
    else of this stream is in flight."""

    def __init__(self, engine: Engine, jobs: Iterable[Job]):
        self._engine = engine
        self._budget = engine.budget
        self._jobs: Iterator[Job] | None = iter(jobs)
        self._next: Job | None = None  # the job taken from _jobs and not yet started
        self._queue: deque[tuple[int, Future]] = deque()
        self._held = 0  # bytes of the piece last handed out
        self._closed = False
        self._cap = MAX_QUEUED_PER_WORKER * engine.workers

    def _peek(self) -> Job | None:
        if self._next is None and self._jobs is not None:
            self._next = next(self._jobs, None)
            if self._next is None:
                self._jobs = None
        return self._next

    def prefetch(self, *, wanted: bool = False) -> None:
        """Start as many of the next jobs as the budget allows (with ``wanted``, the first one in
        any case when none is in flight)."""
        while not self._closed and len(self._queue) < self._cap:
            job = self._peek()
            if job is None:
                return
            nbytes = max(0, int(job[0]))
            if not self._budget.try_acquire(nbytes, force=wanted and not self._queue):
                return
            self._next = None
            self._queue.append((nbytes, self._engine.submit(job[1])))

    def started(self) -> bool:
        """Whether the next piece is already being made (or there is none)."""
        return bool(self._queue) or self._peek() is None

    def __iter__(self) -> Stream[T]:
        return self

    def __next__(self) -> T:
        self._release_held()
        if self._closed:
            raise StopIteration
        self.prefetch(wanted=True)
        if not self._queue:
            self.close()
            raise StopIteration
        nbytes, fut = self._queue.popleft()
        try:
            value = fut.result()
        except BaseException:
            self._budget.release(nbytes)
            self.close()
            raise
        self._held = nbytes
        self.prefetch()
        return value

    def hand_over(self) -> Callable[[], None]:
        """Keep the bytes of the piece last handed out held past the next one: the returned
        function releases them (once), e.g. when a write of the piece completes."""
        nbytes, self._held = self._held, 0
        done = threading.Event()

        def release() -> None:
            if not done.is_set():
                done.set()
                self._budget.release(nbytes)

        return release

    def _release_held(self) -> None:
        if self._held:
            self._budget.release(self._held)
            self._held = 0

    def close(self) -> None:
        """Cancel the jobs not started; the bytes of those running are released as they end."""
        self._closed = True
        self._jobs = None
        self._next = None
        self._release_held()
        while self._queue:
            nbytes, fut = self._queue.popleft()
            if fut.cancel():
                self._budget.release(nbytes)
            else:
                fut.add_done_callback(functools.partial(self._release_done, nbytes))

    def _release_done(self, nbytes: int, _: Future) -> None:
        self._budget.release(nbytes)


class Parts(Generic[T]):
    """The parts of a stream's pieces, one at a time and by name, in order: each piece is a list
    of ``(name, value)``, released once its last part is taken and the next is asked for. For
    writers that take tensors one by one while a job makes several (every HF tensor of a fused
    Tunix leaf, the A and B of a module)."""

    def __init__(self, stream: Stream[list[tuple[str, T]]]):
        self._stream = stream
        self._current: deque[tuple[str, T]] = deque()

    def take(self, name: str) -> T:
        while not self._current:
            try:
                self._current = deque(next(self._stream))
            except StopIteration:
                raise RuntimeError(f"{name}: asked for after the last piece") from None
        got, value = self._current.popleft()
        if got != name:
            raise RuntimeError(f"{name}: asked for out of order (the next part is {got})")
        return value

    def take_many(self, name: str, count: int) -> Iterator[T]:
        """The next ``count`` parts, each named ``name`` (the row blocks of one tensor)."""
        for _ in range(count):
            yield self.take(name)


class Shared(Generic[T]):
    """One value that several jobs need (the factors of a module for its A and B leaves): the
    first to ask computes it while the others wait, and it is dropped after ``uses`` gets."""

    def __init__(self, fn: Callable[[], T], uses: int):
        self._fn: Callable[[], T] | None = fn
        self._uses = uses
        self._value: T | None = None
        self._lock = threading.Lock()

    def get(self) -> T:
        with self._lock:
            if self._fn is not None:
                self._value = self._fn()
                self._fn = None
            value = self._value
            self._uses -= 1
            if self._uses <= 0:
                self._value = None
        return value  # type: ignore[return-value]  # set above


__all__ = ["CODEC_VERB_WORKERS", "DEFAULT_MEMORY_BUDGET", "Budget", "Engine", "Job", "Parallelism", "Parts",
           "Shared", "Stream", "default_workers", "usable_cores"]
