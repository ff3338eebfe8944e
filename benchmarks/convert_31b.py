"""safetensors-to-orbax and orbax-to-safetensors at real Gemma 4 31B width, side by side with
copying the same bytes (``cp -r``, and ``cp -r`` + ``sync``), in one run.

For each k (default 2 and 4): a bf16 Gemma 4 text checkpoint of the 31B's real shapes with the
real embedding (262144 x 5376, 2.8 GB) and k decoder layers (the last one a global k_eq_v
layer). ``cp``, ``cp`` + ``sync``, ``ckptbridge convert safetensors-to-orbax`` and
``orbax-to-safetensors`` of its output alternate ``--repeat`` times (medians shown; the disk's
writeback state moves a lot between runs), each in a fresh process after ``sync`` (wall time
includes the interpreter and its imports; peak RSS is the process's maximum resident set, as
``wait4`` reports it).
Then, once each: both directions with ``--no-compression``, and ``verify tensors`` of the round
trip. The first k's model with half the embedding (131072 rows) is converted both ways in the
same alternation: peak RSS must not change when the largest tensor doubles. Each conversion
runs several ways in the alternation (``configs``): on every core with the default ``--workers``,
on every core with each ``--workers N`` asked for (default: 1), and pinned to one core with
``taskset`` (unless ``--no-pin``); the table gives each as a ratio to ``cp`` + ``sync`` and the
rate from one core to all. It needs no more than the core extra (no ``/usr/bin/time``; child
processes keep this environment, PYTHONPATH included).

    .venv/bin/python benchmarks/convert_31b.py [--layers 2 4] [--repeat 3] [--chunk-size 32MiB]
        [--workers 1 2 4 8 13] [--no-pin] [--no-half] [--no-uncompressed] [--memory-budget SIZE] [--dir DIR]
        [--keep] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from merge_31b import GEMMA4_31B, dir_bytes, measure, timed_shell  # noqa: E402  (measure: generation only)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ckptbridge import options, stream  # noqa: E402


def configs(workers: list[int], pin: bool) -> dict[str, tuple[str | None, list[str]]]:
    """How each conversion runs: {name: (CPUs it is pinned to with taskset, or None for all; extra
    flags)}. Pinned to one core, the default --workers is 1 (the usable cores)."""
    out = {"all cores": (None, [])}
    out.update({f"all cores, --workers {w}": (None, ["--workers", str(w)]) for w in workers})
    if pin and shutil.which("taskset"):
        out["1 core"] = ("0", [])
    return out


def _convert(direction: str, src: str, dst: str, *options: str, pin: str | None = None) -> dict:
    """``python -m ckptbridge convert ...`` as a user runs it (the program, not ``main(argv)``,
    so that it re-executes itself with huge pages where it would), in a process of its own
    (this environment and PYTHONPATH kept) pinned to the CPUs ``pin`` with ``taskset`` when
    given; its wall time, peak RSS and CPU time from ``wait4`` (no ``/usr/bin/time`` needed)."""
    if os.path.exists(dst):
        shutil.rmtree(dst)
    subprocess.run(["sync"], check=True)
    taskset = ["taskset", "-c", pin] if pin is not None else []
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([*taskset, sys.executable, "-m", "ckptbridge", "convert", direction, src, dst,
                                 "--quiet", *options], stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            raise SystemExit(f"{direction} failed:\n{err.read()[-3000:]}")
    return {"wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024, "user_s": usage.ru_utime, "sys_s": usage.ru_stime}


def _base(work: str, k: int, vocab: int) -> str:
    base = os.path.join(work, f"base{k}-v{vocab}")
    if not os.path.isdir(base):  # --keep leaves them for the next run
        measure("generate", base, base + ".adapter", str(k), "1", "1", json.dumps({**GEMMA4_31B, "vocab_size": vocab}))
        shutil.rmtree(base + ".adapter")
    return base


def _median(runs: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeat", type=int, default=3, help="alternating runs of each contender (median)")
    ap.add_argument("--chunk-size", default=None, help="--chunk-size for both conversions (default: ckptbridge's)")
    ap.add_argument("--out", help="write results JSON here")
    ap.add_argument("--dir", help="work in this directory (default: the system's temporary one; needs ~4x the "
                    "largest base free)")
    ap.add_argument("--keep", action="store_true", help="keep the generated bases in DIR/convert-31b for the next run")
    ap.add_argument("--workers", type=int, nargs="*", default=[1],
                    help="also run both conversions with each of these --workers (default: 1; e.g. 1 2 4 8 13)")
    ap.add_argument("--no-pin", action="store_true", help="leave out the run pinned to one core (taskset)")
    ap.add_argument("--memory-budget", help="--memory-budget of every conversion (default: ckptbridge's)")
    ap.add_argument("--no-uncompressed", action="store_true",
                    help="leave out the conversions without compression after the timed runs")
    ap.add_argument("--no-half", action="store_true",
                    help="leave out the model with half the embedding (the peak RSS check of the largest tensor)")
    args = ap.parse_args()
    opts = (["--chunk-size", args.chunk_size] if args.chunk_size else []) + \
        (["--memory-budget", args.memory_budget] if args.memory_budget else [])
    how = configs(args.workers, not args.no_pin)

    work = (os.path.join(args.dir or tempfile.gettempdir(), "convert-31b") if args.keep
            else tempfile.mkdtemp(prefix="convert-31b-", dir=args.dir))
    os.makedirs(work, exist_ok=True)
    orbax, back, copy = (os.path.join(work, n) for n in ("orbax", "back", "copy"))
    rows: list = []
    flat: dict = {}

    def save(partial: dict | None = None) -> None:
        """The results so far into --out (after every repeat: a run cut short keeps what it took)."""
        if not args.out:
            return
        with open(args.out, "w") as f:
            json.dump({"chunk_size": args.chunk_size,
                       "memory_budget": args.memory_budget or options.DEFAULT_MEMORY_BUDGET,
                       "cores": stream.usable_cores(),
                       "default_workers": stream.default_workers(stream.CODEC_VERB_WORKERS),
                       "configs": {name: {"pin": pin, "flags": flags} for name, (pin, flags) in how.items()},
                       "rows": rows + ([partial] if partial else []), "half_embedding": flat,
                       "complete": partial is None}, f, indent=2)
    try:
        half_vocab = GEMMA4_31B["vocab_size"] // 2
        half = None if args.no_half else _base(work, args.layers[0], half_vocab)
        for k in args.layers:
            base = _base(work, k, GEMMA4_31B["vocab_size"])
            row: dict = {"layers": k, "vocab": GEMMA4_31B["vocab_size"], "base_bytes": dir_bytes(base)}
            print(f"k={k}: base {row['base_bytes'] / 2**30:.2f} GiB", flush=True)
            runs: dict = {"cp_s": [], "cp_sync_s": [], **{c: {"s2o": [], "o2s": []} for c in how}}
            halves: dict[str, list] = {"s2o": [], "o2s": []}
            for _ in range(args.repeat):
                for p in (orbax, back):  # the disk holds the base, its half and one conversion's outputs at a time
                    shutil.rmtree(p, ignore_errors=True)
                if half and k == args.layers[0]:  # the same model with half the embedding, in the same alternation
                    halves["s2o"].append(_convert("safetensors-to-orbax", half, orbax + ".half", *opts))
                    halves["o2s"].append(_convert("orbax-to-safetensors", orbax + ".half", back + ".half", *opts))
                    shutil.rmtree(orbax + ".half")
                    shutil.rmtree(back + ".half")
                runs["cp_s"].append(timed_shell(f"cp -r {base} {copy}"))
                shutil.rmtree(copy)
                runs["cp_sync_s"].append(timed_shell(f"cp -r {base} {copy} && sync"))
                shutil.rmtree(copy)
                line = f"  cp {runs['cp_s'][-1]:.1f} s, cp + sync {runs['cp_sync_s'][-1]:.1f} s"
                for name, (pin, flags) in how.items():
                    runs[name]["s2o"].append(_convert("safetensors-to-orbax", base, orbax, *opts, *flags, pin=pin))
                    shutil.rmtree(back, ignore_errors=True)
                    runs[name]["o2s"].append(_convert("orbax-to-safetensors", orbax, back, *opts, *flags, pin=pin))
                    line += (f"; {name}: s2o {runs[name]['s2o'][-1]['wall_s']:.1f} s, "
                             f"o2s {runs[name]['o2s'][-1]['wall_s']:.1f} s")
                print(line, flush=True)
                save({**row, "runs": runs})
            row["runs"] = runs
            row["cp_s"], row["cp_sync_s"] = statistics.median(runs["cp_s"]), statistics.median(runs["cp_sync_s"])
            row["configs"] = {c: {d: _median(runs[c][d]) for d in ("s2o", "o2s")} for c in how}
            row["s2o"], row["o2s"] = row["configs"]["all cores"]["s2o"], row["configs"]["all cores"]["o2s"]
            row["orbax_bytes"] = dir_bytes(orbax)
            row["round_trip_identical"] = subprocess.run(
                [sys.executable, "-m", "ckptbridge", "verify", "tensors", base, back], capture_output=True).returncode == 0
            if not args.no_uncompressed:
                row["s2o_nc"] = _convert("safetensors-to-orbax", base, orbax, "--no-compression", *opts)
                row["orbax_nc_bytes"] = dir_bytes(orbax)
                row["o2s_nc"] = _convert("orbax-to-safetensors", orbax, back, *opts)
            rows.append(row)
            save()
            if halves["s2o"]:
                flat = {"layers": k, "vocab": half_vocab, "base_bytes": dir_bytes(half), "runs": halves,
                        "s2o": _median(halves["s2o"]), "o2s": _median(halves["o2s"])}
        if half and not args.keep:
            shutil.rmtree(half)
    finally:
        for p in (orbax, back, copy, orbax + ".half", back + ".half"):
            shutil.rmtree(p, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])} ({stream.usable_cores()} cores)")
    print(f"{'k':>2} {'base GiB':>8} {'cp s':>6} {'cp+sync':>7} | {'how':<22} | {'s2o s':>6} {'x cp+sync':>9} "
          f"{'RSS MB':>6} {'CPU s':>6} | {'o2s s':>6} {'x cp+sync':>9} {'RSS MB':>6} {'CPU s':>6}")
    for r in rows:
        for n, (name, c) in enumerate(r["configs"].items()):
            s, o = c["s2o"], c["o2s"]
            head = (f"{r['layers']:>2} {r['base_bytes'] / 2**30:>8.2f} {r['cp_s']:>6.2f} {r['cp_sync_s']:>7.2f}"
                    if not n else " " * 26)
            print(f"{head} | {name:<22} | {s['wall_s']:>6.2f} {s['wall_s'] / r['cp_sync_s']:>9.2f} "
                  f"{s['peak_rss_mb']:>6.0f} {s['user_s'] + s['sys_s']:>6.1f} | {o['wall_s']:>6.2f} "
                  f"{o['wall_s'] / r['cp_sync_s']:>9.2f} {o['peak_rss_mb']:>6.0f} {o['user_s'] + o['sys_s']:>6.1f}")
        if "1 core" in r["configs"]:
            one, every = r["configs"]["1 core"], r["configs"]["all cores"]
            print(f"   1 core -> all cores: s2o {one['s2o']['wall_s'] / every['s2o']['wall_s']:.2f}x, "
                  f"o2s {one['o2s']['wall_s'] / every['o2s']['wall_s']:.2f}x the rate")
        if "s2o_nc" in r:
            print(f"   no compression: s2o {r['s2o_nc']['wall_s']:.2f} s, o2s {r['o2s_nc']['wall_s']:.2f} s; Orbax "
                  f"{r['orbax_bytes'] / 2**30:.2f} GiB, {r['orbax_nc_bytes'] / 2**30:.2f} GiB uncompressed")
        print(f"   round trip bit-identical (verify tensors): {r['round_trip_identical']}")
    first = rows[0]
    if flat:
        print(f"embedding {flat['vocab']} -> {first['vocab']} rows (k={first['layers']}): peak RSS s2o "
              f"{flat['s2o']['peak_rss_mb']:.0f} -> {first['s2o']['peak_rss_mb']:.0f} MB "
              f"({first['s2o']['peak_rss_mb'] / flat['s2o']['peak_rss_mb']:.2f}x), o2s {flat['o2s']['peak_rss_mb']:.0f} -> "
              f"{first['o2s']['peak_rss_mb']:.0f} MB ({first['o2s']['peak_rss_mb'] / flat['o2s']['peak_rss_mb']:.2f}x)")
    save()

if __name__ == "__main__":
    main()
