"""Where a conversion's wall time goes: whether the writer waits for the workers (reading,
decoding, rearranging) or the workers wait for the writer (the budget full of pieces not yet
stored), from one in-process run of ``safetensors-to-orbax`` or ``orbax-to-safetensors`` with
its jobs, the writer's waits and the stored pieces timed.

Per run it prints: wall; the jobs' summed time and how busy the workers were; the writer's time
blocked on the next piece; how long a piece handed to the writer took to be stored; the share of
the wall the budget was nearly full; process CPU (user, system). Reading the figures: a writer
that waits most of the wall on pieces means the jobs are the limit; a budget nearly full most of
the wall means storing is.

    .venv/bin/python benchmarks/convert_timeline.py s2o BASE [--workers N] [--memory-budget S]
        [--chunk-size S] [--no-compression] [--dir DIR] [--out FILE.json]
    .venv/bin/python benchmarks/convert_timeline.py o2s ORBAX ...
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import threading
import time

os.environ["JAX_PLATFORMS"] = os.environ.get("JAX_PLATFORMS") or "cpu"  # as the CLI: no accelerator runtime
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ckptbridge import stream  # noqa: E402
from ckptbridge import convert_orbax_to_safetensors, convert_safetensors_to_orbax  # noqa: E402


class Timeline:
    """Timings gathered by wrapping the engine's submit and the stream's hand-out (this script's
    instrumentation only; the library is not changed)."""

    def __init__(self):
        self.jobs: list[tuple[float, float]] = []
        self.waits: list[float] = []
        self.stored: list[float] = []
        self.samples: list[tuple[float, int, int]] = []  # (time, budget used, budget limit)
        self.engines: list[stream.Engine] = []
        self._lock = threading.Lock()

    def install(self) -> None:
        tl = self
        submit, nxt, hand_over, init = (stream.Engine.submit, stream.Stream.__next__, stream.Stream.hand_over,
                                        stream.Engine.__init__)

        def engine_init(self, *a, **k):
            init(self, *a, **k)
            tl.engines.append(self)

        def timed_submit(self, fn):
            def run():
                t0 = time.perf_counter()
                try:
                    return fn()
                finally:
                    with tl._lock:
                        tl.jobs.append((t0, time.perf_counter()))
            return submit(self, run)

        def timed_next(self):
            t0 = time.perf_counter()
            try:
                return nxt(self)
            finally:
                tl.waits.append(time.perf_counter() - t0)

        def timed_hand_over(self):
            release = hand_over(self)
            t0 = time.perf_counter()

            def timed_release():
                tl.stored.append(time.perf_counter() - t0)
                release()
            return timed_release

        stream.Engine.__init__, stream.Engine.submit = engine_init, timed_submit
        stream.Stream.__next__, stream.Stream.hand_over = timed_next, timed_hand_over

    def sample(self, stop: threading.Event) -> None:
        while not stop.wait(0.02):
            for e in self.engines[-1:]:
                self.samples.append((time.perf_counter(), e.budget.used, e.budget.limit))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("direction", choices=["s2o", "o2s"])
    ap.add_argument("src")
    ap.add_argument("--workers", type=int)
    ap.add_argument("--memory-budget")
    ap.add_argument("--chunk-size", default="32MiB")
    ap.add_argument("--no-compression", action="store_true")
    ap.add_argument("--dir", help="where the output is written (removed after)")
    ap.add_argument("--out", help="append the figures as one JSON line here")
    ap.add_argument("--ts-context", default="{}",
                    help="JSON merged into the TensorStore context Orbax makes (an experiment: e.g. "
                    "'{\"file_io_sync\": false}')")
    args = ap.parse_args()
    extra = json.loads(args.ts_context)
    if extra:
        import tensorstore as ts
        from orbax.checkpoint._src.serialization import tensorstore_utils as tsu
        made = tsu.get_ts_context

        def with_extra(**kw):
            return ts.Context({**made(**kw).spec.to_json(), **extra})
        tsu.get_ts_context = with_extra
    tl = Timeline()
    tl.install()
    dst = os.path.join(tempfile.mkdtemp(prefix="timeline-", dir=args.dir), "out")
    stop = threading.Event()
    sampler = threading.Thread(target=tl.sample, args=(stop,), daemon=True)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    sampler.start()
    try:
        common = dict(workers=args.workers, memory_budget=args.memory_budget, chunk_size=args.chunk_size,
                      progress=False)
        if args.direction == "s2o":
            convert_safetensors_to_orbax(args.src, dst, compression=not args.no_compression, **common)
        else:
            convert_orbax_to_safetensors(args.src, dst, **common)
        wall = time.perf_counter() - t0
    finally:
        stop.set()
        sampler.join()
        shutil.rmtree(os.path.dirname(dst), ignore_errors=True)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    workers = tl.engines[-1].workers if tl.engines else 0
    busy = sum(b - a for a, b in tl.jobs)
    full = [s for s in tl.samples if s[1] > 0.75 * s[2]]
    res = {
        "direction": args.direction, "workers": workers, "memory_budget": tl.engines[-1].budget.limit,
        "chunk_size": args.chunk_size, "compression": not args.no_compression, "ts_context": extra,
        "wall_s": round(wall, 2),
        "jobs": len(tl.jobs), "jobs_s": round(busy, 2), "workers_busy": round(busy / max(wall * workers, 1e-9), 2),
        "writer_waits_s": round(sum(tl.waits), 2),
        "store_s_median": round(sorted(tl.stored)[len(tl.stored) // 2], 3) if tl.stored else None,
        "budget_over_75pct": round(len(full) / max(len(tl.samples), 1), 2),
        "user_s": round(r1.ru_utime - r0.ru_utime, 1), "sys_s": round(r1.ru_stime - r0.ru_stime, 1),
        "peak_rss_mb": round(r1.ru_maxrss / 1024),
    }
    print(json.dumps(res), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
