"""Quantizing in the merge's pass at real Gemma 4 31B width: ``ckptbridge merge`` against
``merge --quantize int8|fp8`` and ``ckptbridge quantize`` of the base, in one run.

For each k (default 2 and 4): the bf16 Gemma 4 text checkpoint of benchmarks/merge_31b.py (the 31B's
real shapes and embedding, k decoder layers, the last a global k_eq_v layer) and its rank-64 PEFT
adapter on all seven projections. Each contender runs in a fresh process after ``sync`` (wall time
includes the interpreter and its imports; peak RSS is the process's VmHWM), the contenders
alternating ``--repeat`` times (medians: the disk's writeback state moves between runs):

* ``ckptbridge merge BASE ADAPTER DST`` (the reference, written in bf16);
* ``ckptbridge merge BASE ADAPTER DST --quantize int8`` and ``--quantize fp8`` (one pass);
* ``ckptbridge quantize BASE DST --scheme int8`` and ``--scheme fp8``.

Every projection is computed when quantizing (the merge computes them too: the adapter is on all
seven), and the quantized output is smaller (int8 / e4m3 projections: half their bf16 bytes).

    .venv/bin/python benchmarks/quantize_31b.py [--layers 2 4] [--repeat 3] [--out FILE] [--dir DIR] [--keep]
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
from merge_31b import GEMMA4_31B, dir_bytes, measure  # noqa: E402

CONTENDERS = {
    "merge": lambda base, adapter, dst: ["merge", base, adapter, dst],
    "merge --quantize int8": lambda base, adapter, dst: ["merge", base, adapter, dst, "--quantize", "int8"],
    "merge --quantize fp8": lambda base, adapter, dst: ["merge", base, adapter, dst, "--quantize", "fp8"],
    "quantize int8": lambda base, adapter, dst: ["quantize", base, dst, "--scheme", "int8"],
    "quantize fp8": lambda base, adapter, dst: ["quantize", base, dst, "--scheme", "fp8"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--alpha", type=float, default=128.0)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each contender, alternating (median)")
    ap.add_argument("--out", help="write results JSON here")
    ap.add_argument("--dir", help="work in this directory (default: the system's temporary one; needs ~2.5x the "
                    "base free)")
    ap.add_argument("--keep", action="store_true", help="keep the generated bases and adapters in DIR/merge-31b "
                    "(shared with benchmarks/merge_31b.py) and reuse them")
    args = ap.parse_args()

    work = (os.path.join(args.dir or tempfile.gettempdir(), "merge-31b") if args.keep
            else tempfile.mkdtemp(prefix="quantize-31b-", dir=args.dir))
    os.makedirs(work, exist_ok=True)
    rows = []
    try:
        for k in args.layers:
            base, adapter = os.path.join(work, f"base{k}"), os.path.join(work, f"adapter{k}")
            if not os.path.isdir(base):
                measure("generate", base, adapter, str(k), str(args.rank), str(args.alpha), json.dumps(GEMMA4_31B))
            row: dict = {"layers": k, "base_bytes": dir_bytes(base), "runs": {c: [] for c in CONTENDERS}}
            print(f"k={k}: base {row['base_bytes'] / 2**30:.2f} GiB", flush=True)
            out = os.path.join(work, "out")
            for _ in range(args.repeat):
                for name, argv in CONTENDERS.items():
                    shutil.rmtree(out, ignore_errors=True)
                    r = measure("ckptbridge", *argv(base, adapter, out))
                    r["output_bytes"] = dir_bytes(out)
                    row["runs"][name].append(r)
            shutil.rmtree(out, ignore_errors=True)
            row["medians"] = {c: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                              for c, runs in row["runs"].items()}
            ref = row["medians"]["merge"]["wall_s"]
            for name, m in row["medians"].items():
                print(f"  {name:<22} {m['wall_s']:6.2f} s = {m['wall_s'] / ref:4.2f}x merge, peak RSS "
                      f"{m['peak_rss_mb']:5.0f} MB, output {m['output_bytes'] / 2**30:.2f} GiB", flush=True)
            rows.append(row)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        grew = last["base_bytes"] / first["base_bytes"]
        print(f"peak RSS k={last['layers']} vs k={first['layers']} (base {grew:.2f}x): "
              + ", ".join(f"{c} {last['medians'][c]['peak_rss_mb'] / first['medians'][c]['peak_rss_mb']:.2f}x"
                          for c in CONTENDERS))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "rank": args.rank,
                       "cores": len(os.sched_getaffinity(0)), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
