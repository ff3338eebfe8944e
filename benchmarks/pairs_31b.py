"""Every model pair of ``ckptbridge convert`` at real Gemma 4 31B width, each against copying the
same bytes, in one run: HF, Tunix, MaxText and GGUF in, HF, Tunix, MaxText, GGUF (bf16 and q8_0)
and compressed-tensors (int8) out, and a QLoRA base (Tunix, int4).

A bf16 Gemma 4 text checkpoint of the 31B's real shapes with the real embedding (262144 x 5376)
and k decoder layers (default 4, 6.3 GiB; the last one a global k_eq_v layer). Each repeat goes
source by source: ``cp -r`` + ``sync`` of the source, then every pair from it, each a fresh
``python -m ckptbridge convert SRC DST --to FORMAT --quiet`` after ``sync`` (wall time includes
the interpreter and its imports; peak RSS and user + system CPU from ``wait4``). The Tunix,
MaxText and GGUF sources are the outputs of HF -> that format in the same repeat, removed once
their pairs are done (the disk holds the base, one source and one output). Each pair's ratio is
its median over the repeats to the median ``cp -r`` + ``sync`` of its source. Needs the core
extra only (no torch): it runs on a TPU host as it does here.

    .venv/bin/python benchmarks/pairs_31b.py [--layers 4] [--repeat 3] [--pairs NAME ...] [--workers N]
        [--memory-budget SIZE] [--dir DIR] [--keep] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from convert_31b import _base  # noqa: E402
from gguf_31b import _run  # noqa: E402
from merge_31b import GEMMA4_31B, dir_bytes, timed_shell  # noqa: E402
from results_file import append_run  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ckptbridge import options, stream  # noqa: E402

# name: (source, destination format, its options); grouped by source, HF first (its outputs are the others' sources)
PAIRS = {
    "hf -> tunix": ("hf", "tunix", []), "hf -> maxtext": ("hf", "maxtext", []),
    "hf -> gguf": ("hf", "gguf", ["--outtype", "bf16"]), "hf -> gguf q8_0": ("hf", "gguf", ["--outtype", "q8_0"]),
    "hf -> compressed-tensors": ("hf", "compressed-tensors", ["--quantize", "int8"]),
    "hf -> tunix int4 (QLoRA base)": ("hf", "tunix", ["--quantize", "int4"]),
    "tunix -> hf": ("tunix", "hf", []), "tunix -> maxtext": ("tunix", "maxtext", []),
    "tunix -> gguf": ("tunix", "gguf", ["--outtype", "bf16"]),
    "tunix -> gguf q8_0": ("tunix", "gguf", ["--outtype", "q8_0"]),
    "tunix -> compressed-tensors": ("tunix", "compressed-tensors", ["--quantize", "int8"]),
    "maxtext -> hf": ("maxtext", "hf", []), "maxtext -> tunix": ("maxtext", "tunix", []),
    "maxtext -> gguf": ("maxtext", "gguf", ["--outtype", "bf16"]),
    "gguf -> hf": ("gguf", "hf", []), "gguf -> tunix": ("gguf", "tunix", []),
    "gguf -> maxtext": ("gguf", "maxtext", []),
}
SOURCES = ("hf", "tunix", "maxtext", "gguf")
SUFFIX = {"gguf": ".gguf"}


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


def _convert(src: str, dst: str, fmt: str, flags: list[str], base: str) -> dict:
    _remove(dst)
    extra = (["--no-tokenizer"] if fmt == "gguf" else []) + (["--config", base] if src.endswith(".gguf") else [])
    r = _run([sys.executable, "-m", "ckptbridge", "convert", src, dst, "--to", fmt, "--quiet", *extra, *flags])
    r["cores_busy"] = (r["user_s"] + r["sys_s"]) / r["wall_s"]
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--pairs", nargs="+", choices=list(PAIRS), metavar="PAIR",
                    help=f"the pairs to measure (default: all: {', '.join(PAIRS)})")
    ap.add_argument("--workers", type=int, help="--workers of every conversion (default: ckptbridge's)")
    ap.add_argument("--memory-budget", help="--memory-budget of every conversion (default: ckptbridge's)")
    ap.add_argument("--dir", help="work here (default: the system's temporary directory; needs ~3.5x the base)")
    ap.add_argument("--keep", action="store_true", help="keep the generated base in DIR/convert-31b")
    ap.add_argument("--out", help="append the results as a run to this JSON file")
    args = ap.parse_args()
    chosen = args.pairs or list(PAIRS)
    flags = (["--workers", str(args.workers)] if args.workers else []) + \
        (["--memory-budget", args.memory_budget] if args.memory_budget else [])
    work = (os.path.join(args.dir or tempfile.gettempdir(), "convert-31b") if args.keep
            else tempfile.mkdtemp(prefix="pairs-31b-", dir=args.dir))
    os.makedirs(work, exist_ok=True)
    copy, out = os.path.join(work, "copy"), os.path.join(work, "out")
    record: dict = {"command": " ".join(["benchmarks/pairs_31b.py", *sys.argv[1:]]),
                    "machine": {"cores": stream.usable_cores(), "python": platform.python_version()},
                    "layers": args.layers, "repeat": args.repeat, "workers": args.workers,
                    "memory_budget": args.memory_budget or options.DEFAULT_MEMORY_BUDGET}
    runs: dict = {name: [] for name in chosen}
    cps: dict = {s: [] for s in SOURCES}
    try:
        base = _base(work, args.layers, GEMMA4_31B["vocab_size"])
        record["base_bytes"] = dir_bytes(base)
        print(f"base {record['base_bytes'] / 2**30:.2f} GiB, {record['machine']['cores']} cores", flush=True)
        for rep in range(args.repeat):
            for source in SOURCES:
                names = [n for n in chosen if PAIRS[n][0] == source]
                feeds = [n for n in chosen if n == f"hf -> {source}"]
                if not names and not feeds:
                    continue
                src = base if source == "hf" else os.path.join(work, "src-" + source + SUFFIX.get(source, ""))
                line = []
                if source != "hf":  # HF -> source, its output kept as the source of the pairs below
                    opts = PAIRS[f"hf -> {source}"][2]
                    r = _convert(base, src, source, [*opts, *flags], base)
                    if feeds:
                        r["out_bytes"] = dir_bytes(src) if os.path.isdir(src) else os.path.getsize(src)
                        runs[feeds[0]].append(r)
                        line.append(f"{feeds[0]} {r['wall_s']:.1f} s ({r['peak_rss_mb']:.0f} MB, "
                                    f"{r['cores_busy']:.1f} cores)")
                cps[source].append(timed_shell(f"cp -r {src} {copy} && sync"))
                _remove(copy)
                line.insert(0, f"cp+sync {cps[source][-1]:.1f} s")
                for name in names:
                    fmt = PAIRS[name][1]
                    if source == "hf" and fmt in SOURCES and name == f"hf -> {fmt}":
                        continue  # measured as it makes the source of its group
                    dst = out + SUFFIX.get(fmt, "")
                    r = _convert(src, dst, fmt, [*PAIRS[name][2], *flags], base)
                    r["out_bytes"] = dir_bytes(dst) if os.path.isdir(dst) else os.path.getsize(dst)
                    _remove(dst)
                    runs[name].append(r)
                    line.append(f"{name} {r['wall_s']:.1f} s ({r['peak_rss_mb']:.0f} MB, {r['cores_busy']:.1f} cores)")
                if source != "hf":
                    record.setdefault("source_bytes", {})[source] = (dir_bytes(src) if os.path.isdir(src)
                                                                    else os.path.getsize(src))
                    _remove(src)
                print(f"repeat {rep + 1}, {source}: " + "; ".join(line), flush=True)
    finally:
        for p in (copy, out, out + ".gguf", *(os.path.join(work, "src-" + s + SUFFIX.get(s, "")) for s in SOURCES)):
            _remove(p)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    rows: dict = {}
    for source in SOURCES:
        if cps[source]:
            rows[f"cp -r + sync ({source})"] = {"wall_s": round(statistics.median(cps[source]), 2),
                                                "runs_s": [round(x, 2) for x in cps[source]]}
    print(f"\n{'pair':<28} {'median s':>8} {'x cp+sync':>9} {'peak RSS MB':>11} {'CPU s':>6} {'cores':>5}  runs s")
    for name in chosen:
        rs = runs[name]
        if not rs:
            continue
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        cp = statistics.median(cps[PAIRS[name][0]])
        rows[name] = {"wall_s": round(med["wall_s"], 2), "x_cp_sync": round(med["wall_s"] / cp, 2),
                      "peak_rss_mb": round(max(r["peak_rss_mb"] for r in rs)),
                      "cpu_s": round(med["user_s"] + med["sys_s"], 1), "cores_busy": round(med["cores_busy"], 2),
                      "out_bytes": rs[-1]["out_bytes"], "runs_s": [round(r["wall_s"], 2) for r in rs]}
        row = rows[name]
        print(f"{name:<28} {row['wall_s']:>8.2f} {row['x_cp_sync']:>9.2f} {row['peak_rss_mb']:>11} "
              f"{row['cpu_s']:>6.1f} {row['cores_busy']:>5.1f}  {', '.join(map(str, row['runs_s']))}")
    for source in SOURCES:
        key = f"cp -r + sync ({source})"
        if key in rows:
            print(f"{key:<28} {rows[key]['wall_s']:>8.2f}  runs {', '.join(map(str, rows[key]['runs_s']))}")
    record["rows"] = rows
    if args.out:
        n = append_run(args.out, record)
        print(f"results: run {n} of {args.out}")


if __name__ == "__main__":
    main()
