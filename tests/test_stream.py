"""The streaming engine every conversion reads ahead with (ckptbridge/stream.py): order, the
memory budget, parallelism, errors, cancellation and its threads."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time

import pytest

from ckptbridge.errors import ConfigError
from ckptbridge.stream import Budget, Engine, Parallelism, Parts, Shared, usable_cores


def _threads(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


class _Held:
    """Counts the bytes of pieces made and not yet released, as the budget should see them."""

    def __init__(self):
        self.lock = threading.Lock()
        self.running = 0
        self.most_running = 0

    def job(self, i: int, delay: float):
        def make():
            with self.lock:
                self.running += 1
                self.most_running = max(self.most_running, self.running)
            time.sleep(delay)
            with self.lock:
                self.running -= 1
            return i

        return make


@pytest.mark.parametrize("workers", [1, 2, 5])
def test_results_come_in_job_order_whatever_finishes_first(workers):
    rng = random.Random(workers)
    held = _Held()
    with Engine(workers, 100, name="t-order") as engine:
        got = list(engine.stream((10, held.job(i, rng.uniform(0, 0.01))) for i in range(60)))
    assert got == list(range(60))
    assert held.most_running <= workers
    assert engine.budget.used == 0


def test_budget_is_never_exceeded_by_one_stream():
    with Engine(4, 30, name="t-budget1") as engine:
        seen = []

        def make(i):
            seen.append(engine.budget.used)
            time.sleep(0.002)
            return i

        assert list(engine.stream((10, lambda i=i: make(i)) for i in range(40))) == list(range(40))
        assert engine.budget.peak <= 30 and max(seen) <= 30


def test_budget_is_shared_by_streams():
    """Two streams of one consumer: the budget is shared; a stream with nothing in flight starts
    the piece its consumer waits for even when the other holds the budget (else neither could go
    on), so the most held is the budget plus one piece."""
    with Engine(4, 30, name="t-budget") as engine:
        budget = engine.budget
        seen = []

        def job(i):
            def make():
                seen.append(budget.used)  # the bytes held while a piece is being made
                time.sleep(0.002)
                return i
            return make

        a = engine.stream((10, job(i)) for i in range(40))
        b = engine.stream((10, job(100 + i)) for i in range(40))
        out = []
        for x, y in zip(a, b):  # taking from each in turn
            assert budget.used <= 30 + 10
            out.append((x, y))
        assert out == [(i, 100 + i) for i in range(40)]
        assert budget.peak <= 30 + 10 and max(seen) <= 30 + 10
        assert budget.used == 10  # b's last piece, held until b is asked for more
        assert next(b, None) is None and budget.used == 0


def test_a_piece_larger_than_the_budget_goes_through_alone():
    with Engine(3, 10, name="t-large") as engine:
        got = list(engine.stream([(4, lambda: "a"), (25, lambda: "big"), (4, lambda: "b"), (4, lambda: "c")]))
    assert got == ["a", "big", "b", "c"]
    assert engine.budget.peak == 25  # the large piece alone, nothing beside it


def test_workers_run_at_once():
    barrier = threading.Barrier(2, timeout=10)

    def meet():
        barrier.wait()  # returns only when both jobs are running at the same time
        return True

    with Engine(2, 100, name="t-par") as engine:
        assert list(engine.stream([(1, meet), (1, meet)])) == [True, True]


def test_an_error_cancels_the_rest_surfaces_once_and_leaves_no_thread():
    started = []
    release = threading.Event()

    def job(i):
        def make():
            started.append(i)
            if i == 3:
                raise ValueError("piece 3 is damaged")
            if i > 3:
                release.wait(5)
            return i
        return make

    with pytest.raises(ValueError, match="piece 3 is damaged"):
        with Engine(2, 1000, name="t-err") as engine:
            stream = engine.stream((1, job(i)) for i in range(200))
            got = []
            try:
                for x in stream:
                    got.append(x)
            finally:
                release.set()
    assert got == [0, 1, 2]
    assert max(started) < 3 + 2 * 4 + 2  # jobs beyond those queued when it failed never started
    assert list(stream) == []  # surfaces once: the stream is closed after it
    assert engine.budget.used == 0
    assert not _threads("t-err")


def test_closing_early_cancels_and_joins():
    with Engine(2, 1000, name="t-close") as engine:
        stream = engine.stream((1, lambda i=i: (time.sleep(0.001), i)[1]) for i in range(10_000))
        assert next(stream) == 0
    assert not _threads("t-close")
    assert engine.budget.used == 0
    with pytest.raises(RuntimeError, match="closed"):
        engine.stream([])


def test_hand_over_keeps_bytes_until_released():
    with Engine(1, 10, name="t-hand") as engine:
        stream = engine.stream([(6, lambda: "a"), (6, lambda: "b")])
        assert next(stream) == "a"
        release = stream.hand_over()
        assert engine.budget.used == 6 and not stream.started()  # "b" does not fit beside the held "a"
        release()
        release()  # once only
        stream.prefetch()
        assert stream.started()
        assert next(stream) == "b"
        assert next(stream, None) is None
        assert engine.budget.used == 0


def test_parts_are_taken_by_name_in_order():
    with Engine(2, 100, name="t-parts") as engine:
        parts = Parts(engine.stream([(2, lambda: [("x", 1), ("y", 2)]), (1, lambda: [("z", 3)])]))
        assert parts.take("x") == 1 and parts.take("y") == 2
        with pytest.raises(RuntimeError, match="w: asked for out of order"):
            parts.take("w")


def test_shared_value_is_made_once_for_its_uses():
    calls = []
    shared = Shared(lambda: calls.append(1) or "v", uses=2)
    with Engine(2, 100, name="t-shared") as engine:
        assert list(engine.stream([(1, shared.get), (1, shared.get)])) == ["v", "v"]
    assert calls == [1]
    assert shared._value is None  # dropped after its last use


def test_budget_and_engine_refuse_nonsense():
    with pytest.raises(ValueError):
        Budget(0)
    with pytest.raises(ValueError):
        Engine(0)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ConfigError, match=r"workers \(--workers\)"):
            Parallelism.of(bad)
    with pytest.raises(ConfigError, match=r"memory_budget \(--memory-budget\)"):
        Parallelism.of(memory_budget="lots")
    with pytest.raises(ConfigError, match=r"less than one piece .*chunk_size"):
        Parallelism.of(memory_budget="1MiB", least=2 << 20, least_what="chunk_size (--chunk-size)")
    with Parallelism.of(None, "64MiB").engine("t-default") as engine:
        assert engine.workers == usable_cores() and engine.budget.limit == 64 << 20


def test_default_workers_of_the_codec_verbs_are_capped(monkeypatch):
    """safetensors-to-orbax and orbax-to-safetensors take the usable cores up to CODEC_VERB_WORKERS
    when no --workers is given (their codecs run on TensorStore's threads); a count given is kept."""
    from ckptbridge import stream

    monkeypatch.setattr(stream, "usable_cores", lambda: 13)
    assert Parallelism.of(None, default_cap=stream.CODEC_VERB_WORKERS).workers == stream.CODEC_VERB_WORKERS == 4
    assert Parallelism.of(13, default_cap=stream.CODEC_VERB_WORKERS).workers == 13
    assert Parallelism.of(None).workers == 13  # merge, adapters: every usable core
    monkeypatch.setattr(stream, "usable_cores", lambda: 2)
    assert Parallelism.of(None, default_cap=stream.CODEC_VERB_WORKERS).workers == 2


@pytest.mark.parametrize("setup", ["with stream.Engine(2, 1 << 20):\n    pass", "stream.Parallelism.of(2)"])
def test_freed_memory_is_reused_on_glibc(setup):
    """An engine, and a verb's Parallelism before it opens its sources, set glibc's arenas and
    thresholds (ckptbridge.malloc): a 24 MiB block freed by one thread is reused by the next
    without faulting its pages in again (8 fresh blocks: 4200 page faults with the mapping
    threshold at 8 MiB, 530 with an arena per thread; 14 with the settings). Fails if mallopt
    goes away or the settings stop taking effect."""
    import platform

    from ckptbridge import malloc

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's allocator only")
    code = """
import resource, threading, numpy as np
from ckptbridge import stream
SETUP
def fill():
    a = np.empty(24 << 20, np.uint8)
    a[:] = 1
def run(n):
    for _ in range(n):
        t = threading.Thread(target=fill)
        t.start()
        t.join()
run(2)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
run(8)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", code.replace("SETUP", setup)], env=env, capture_output=True,
                         text=True, check=True)
    assert int(out.stdout.split()[-1]) < 40, out.stdout
    assert malloc.reuse_freed_memory() is True


def test_allocator_settings_given_in_the_environment_are_kept():
    from ckptbridge import malloc

    assert malloc._given("MALLOC_ARENA_MAX", "glibc.malloc.arena_max", {"MALLOC_ARENA_MAX": "4"})
    assert malloc._given("MALLOC_ARENA_MAX", "glibc.malloc.arena_max",
                         {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1:glibc.malloc.arena_max=4"})
    assert not malloc._given("MALLOC_ARENA_MAX", "glibc.malloc.arena_max", {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})
