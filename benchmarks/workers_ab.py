"""One conversion at two ``--workers`` settings, interleaved, beside ``cp -r`` + ``sync``.

Where a disk's writeback state moves a run by 3x (a VM's, like the TPU host's), a table that runs
each setting once per repeat in a fixed order lets the order decide. This one alternates the two
settings A B, B A, A B, ... so that each follows the other equally often, with ``cp -r SRC`` +
``sync`` at the start of every cycle, each a fresh CLI process after ``sync`` (wall time, peak RSS
and CPU from ``wait4``). Medians and the pairs A won are printed; the runs go to ``--out`` after
every cycle.

    python benchmarks/workers_ab.py orbax-to-safetensors SRC [--a default] [--b 1] [--cycles 6]
        [--dir DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from convert_31b import _convert  # noqa: E402
from merge_31b import timed_shell  # noqa: E402


def _flags(setting: str) -> list[str]:
    return [] if setting == "default" else ["--workers", setting]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("direction", help="a `ckptbridge convert` direction, e.g. orbax-to-safetensors")
    ap.add_argument("src", help="its source checkpoint (also what cp -r copies)")
    ap.add_argument("--a", default="default", help="--workers of A ('default': the flag left out)")
    ap.add_argument("--b", default="1", help="--workers of B")
    ap.add_argument("--cycles", type=int, default=6, help="cycles of cp + sync, then A and B in turn")
    ap.add_argument("--dir", help="where outputs and the copy go (default: a temporary directory)")
    ap.add_argument("--out", help="JSON file for the runs")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="workers-ab-", dir=args.dir)
    dst, copy = os.path.join(work, "out"), os.path.join(work, "copy")
    res: dict = {"direction": args.direction, "a": args.a, "b": args.b, "cp_sync_s": [], "A": [], "B": []}
    try:
        for i in range(args.cycles):
            res["cp_sync_s"].append(timed_shell(f"cp -r {args.src} {copy} && sync"))
            shutil.rmtree(copy)
            for name in ("A", "B") if i % 2 == 0 else ("B", "A"):
                res[name].append(_convert(args.direction, args.src, dst, *_flags(args.a if name == "A" else args.b)))
            print(f"{i}: cp + sync {res['cp_sync_s'][-1]:.1f} s, "
                  + ", ".join(f"{n} ({s}) {res[n][-1]['wall_s']:.1f} s" for n, s in (("A", args.a), ("B", args.b))),
                  flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(res, f, indent=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cps = statistics.median(res["cp_sync_s"])
    for n, s in (("A", args.a), ("B", args.b)):
        wall = statistics.median(r["wall_s"] for r in res[n])
        print(f"{n} --workers {s}: median {wall:.2f} s = {wall / cps:.2f}x cp + sync ({cps:.2f} s), "
              f"peak RSS {max(r['peak_rss_mb'] for r in res[n]):.0f} MB, "
              f"CPU {statistics.median(r['user_s'] + r['sys_s'] for r in res[n]):.1f} s")
    won = sum(a["wall_s"] < b["wall_s"] for a, b in zip(res["A"], res["B"]))
    print(f"A faster in {won} of {len(res['A'])} cycles")


if __name__ == "__main__":
    main()
