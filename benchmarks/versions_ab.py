"""Every conversion at 31B width by two versions of ckptbridge, interleaved: this checkout (new) and
another one (old, ``--old DIR``: e.g. ``git worktree add /tmp/old <commit>``).

A bf16 Gemma 4 text checkpoint of the 31B's real shapes (hidden 5376, MLP 21504, the real 262144 x
5376 embedding) with k decoder layers (default 4, the last a global k_eq_v layer) and a rank-64
PEFT adapter on every projection (``benchmarks/merge_31b.py``'s generator), then for each verb
its old and new runs alternate, after ``--warmup`` pairs not counted, A B then B A, ``--repeat``
times, each a fresh CLI process after
``sync`` (wall time, peak RSS and CPU time from ``wait4``; the old one runs with PYTHONPATH at its
checkout). The verbs, with the earlier releases' names both versions know: safetensors-to-orbax,
orbax-to-safetensors, merge (the adapter), to-gguf (bf16 and q8_0), safetensors-to-maxtext
(unscanned: Gemma 4 scans blocks of six layers; ``benchmarks/maxtext_31b.py`` times the scanned
form) and maxtext-to-safetensors. The table gives each version's median and the median of
the per-pair ratios new / old (the disk's writeback moves single runs a lot; pairs share it).

    .venv/bin/python benchmarks/versions_ab.py --old /tmp/old [--layers 4] [--repeat 5] [--warmup 1] [--verbs ...]
        [--dir DIR] [--keep] [--out FILE]
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
from merge_31b import GEMMA4_31B, measure  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# verb -> (CLI arguments before SRC DST, the input it reads, flags)
VERBS = {
    "safetensors-to-orbax": (["convert", "safetensors-to-orbax"], "base", []),
    "orbax-to-safetensors": (["convert", "orbax-to-safetensors"], "orbax", []),
    "merge": (["merge"], "base+adapter", []),
    "to-gguf bf16": (["convert", "to-gguf"], "base", ["--outtype", "bf16", "--no-tokenizer"]),
    "to-gguf q8_0": (["convert", "to-gguf"], "base", ["--outtype", "q8_0", "--no-tokenizer"]),
    "safetensors-to-maxtext": (["convert", "safetensors-to-maxtext"], "base", []),
    "maxtext-to-safetensors": (["convert", "maxtext-to-safetensors"], "maxtext", []),
}


def run(tree: str, verb: list[str], inputs: list[str], dst: str, flags: list[str]) -> dict:
    """One CLI run of the checkout ``tree`` (its ckptbridge first on the path) in a fresh process."""
    if os.path.isdir(dst):
        shutil.rmtree(dst)
    elif os.path.exists(dst):
        os.remove(dst)
    subprocess.run(["sync"], check=True)
    env = {**os.environ, "PYTHONPATH": tree}
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "ckptbridge", *verb, *inputs, dst, "--quiet", *flags],
                                stdout=subprocess.DEVNULL, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        if os.waitstatus_to_exitcode(status) != 0:
            err.seek(0)
            raise SystemExit(f"{' '.join(verb)} ({tree}) failed:\n{err.read()[-3000:]}")
    return {"wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024, "cpu_s": usage.ru_utime + usage.ru_stime}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="a checkout of the version to compare with")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5, help="pairs of runs per verb (A B, then B A, ...)")
    ap.add_argument("--warmup", type=int, default=1, help="pairs of runs per verb first, not counted (the page "
                    "cache and the disk's writeback settle after the verb before)")
    ap.add_argument("--verbs", nargs="+", default=list(VERBS), choices=list(VERBS))
    ap.add_argument("--dir", help="work here (default: a temporary directory; needs ~3.5x the base)")
    ap.add_argument("--keep", action="store_true", help="keep the generated inputs in DIR/versions-ab")
    ap.add_argument("--out", help="JSON file for the runs (written after every verb)")
    args = ap.parse_args()
    work = os.path.join(args.dir, "versions-ab") if args.dir and args.keep else tempfile.mkdtemp(
        prefix="versions-ab-", dir=args.dir)
    os.makedirs(work, exist_ok=True)
    base, adapter = os.path.join(work, "base"), os.path.join(work, "adapter")
    try:
        if not os.path.isdir(base):
            measure("generate", base, adapter, str(args.layers), "64", "128", json.dumps(GEMMA4_31B))
        inputs = {"base": [base], "base+adapter": [base, adapter], "orbax": [os.path.join(work, "orbax")],
                  "maxtext": [os.path.join(work, "maxtext")]}
        for made, verb in (("orbax", "safetensors-to-orbax"), ("maxtext", "safetensors-to-maxtext")):
            if not os.path.isdir(inputs[made][0]) and any(VERBS[v][1] == made for v in args.verbs):
                run(ROOT, VERBS[verb][0], [base], inputs[made][0], VERBS[verb][2])
        results: dict = {"layers": args.layers, "old": os.path.abspath(args.old), "verbs": {}}
        trees = {"new": ROOT, "old": os.path.abspath(args.old)}
        for name in args.verbs:
            cli, needs, flags = VERBS[name]
            dst = os.path.join(work, "out" + (".gguf" if "gguf" in name else ""))
            runs: dict = {"new": [], "old": []}
            for i in range(args.warmup):
                for who in ("old", "new"):
                    run(trees[who], cli, inputs[needs], dst, flags)
            for i in range(args.repeat):
                for who in ("new", "old") if i % 2 == 0 else ("old", "new"):
                    runs[who].append(run(trees[who], cli, inputs[needs], dst, flags))
                print(f"{name} {i}: new {runs['new'][-1]['wall_s']:.1f} s, old {runs['old'][-1]['wall_s']:.1f} s",
                      flush=True)
            ratios = [n["wall_s"] / o["wall_s"] for n, o in zip(runs["new"], runs["old"])]
            results["verbs"][name] = {
                **{f"{who}_median_s": statistics.median(r["wall_s"] for r in runs[who]) for who in runs},
                **{f"{who}_peak_rss_mb": max(r["peak_rss_mb"] for r in runs[who]) for who in runs},
                **{f"{who}_cpu_s": statistics.median(r["cpu_s"] for r in runs[who]) for who in runs},
                "ratio_of_medians": statistics.median(r["wall_s"] for r in runs["new"])
                / statistics.median(r["wall_s"] for r in runs["old"]),
                "median_pair_ratio": statistics.median(ratios), "runs": runs}
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)
        print(f"\n{'verb':<24}{'old s':>8}{'new s':>8}{'new/old':>9}{'pairs':>8}{'old MB':>8}{'new MB':>8}"
              f"{'old CPU':>9}{'new CPU':>9}")
        for name, r in results["verbs"].items():
            print(f"{name:<24}{r['old_median_s']:>8.1f}{r['new_median_s']:>8.1f}{r['ratio_of_medians']:>9.3f}"
                  f"{r['median_pair_ratio']:>8.3f}{r['old_peak_rss_mb']:>8.0f}{r['new_peak_rss_mb']:>8.0f}"
                  f"{r['old_cpu_s']:>9.1f}{r['new_cpu_s']:>9.1f}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
