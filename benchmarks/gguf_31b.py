"""``ckptbridge convert to-gguf`` at real Gemma 4 31B width, side by side with copying the same bytes
and with ggml's own converter (``convert_hf_to_gguf.py``, from build/ggml), in one run.

A bf16 Gemma 4 text checkpoint of the 31B's real shapes with the real embedding (262144 x 5376)
and k decoder layers (the last one a global k_eq_v layer; ``convert_31b.py``'s generator). ``cp
-r`` + ``sync`` and our export to bf16 and to q8_0 alternate ``--repeat`` times (medians), each in
a fresh process after ``sync``; peak RSS and CPU time from ``wait4``. ggml's converter runs once
per output type (unless ``--no-converter``); the random checkpoint has no tokenizer, so both
write none (ours ``--no-tokenizer``; the converter's vocabulary step is skipped), and a
``tokenizer.json`` naming 262144 tokens is put beside it for the converter, which reads the
vocabulary's size from there to trim Gemma's embedding (it trims nothing). The two files of each
type are compared byte for byte.

    .venv/bin/python benchmarks/gguf_31b.py [--layers 4] [--repeat 3] [--workers N] [--no-converter]
        [--dir DIR] [--keep] [--out FILE]
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from convert_31b import _base  # noqa: E402
from merge_31b import GEMMA4_31B, dir_bytes, timed_shell  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from ckptbridge import stream  # noqa: E402

CONVERTER = os.path.join(ROOT, "build", "ggml")
NO_VOCAB = r"""
import os, sys
root = sys.argv[1]
sys.path[:0] = [os.path.join(root, "gguf-py"), root]
import convert_hf_to_gguf
from conversion import base, gemma  # noqa: F401  (gemma: its classes, to reach them below)
def no_vocab(cls):  # the benchmark's checkpoint has no tokenizer (ours: --no-tokenizer)
    cls.set_vocab = lambda self: None
    for sub in cls.__subclasses__():
        no_vocab(sub)
no_vocab(base.TextModel)
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
convert_hf_to_gguf.main()
"""


def _run(argv: list[str]) -> dict:
    """A fresh process after ``sync``: wall time, peak RSS and CPU from ``wait4``."""
    subprocess.run(["sync"], check=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        if os.waitstatus_to_exitcode(status) != 0:
            err.seek(0)
            raise SystemExit(f"{argv[:4]} failed:\n{err.read()[-3000:]}")
    return {"wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024, "user_s": usage.ru_utime, "sys_s": usage.ru_stime}


def _ours(base: str, dst: str, outtype: str, workers: int | None) -> dict:
    if os.path.exists(dst):
        os.remove(dst)
    extra = ["--workers", str(workers)] if workers else []
    return _run([sys.executable, "-m", "ckptbridge", "convert", "to-gguf", base, dst, "--outtype", outtype,
                 "--no-tokenizer", "--quiet", *extra])


def _theirs(base: str, dst: str, outtype: str) -> dict:
    if os.path.exists(dst):
        os.remove(dst)
    return _run([sys.executable, "-c", NO_VOCAB, CONVERTER, base, "--outfile", dst, "--outtype", outtype])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", type=int, help="--workers of our export (default: ckptbridge's)")
    ap.add_argument("--no-converter", action="store_true", help="leave out ggml's converter")
    ap.add_argument("--dir", help="work here (default: the system's temporary directory; needs ~4x the base)")
    ap.add_argument("--keep", action="store_true", help="keep the generated base in DIR/convert-31b")
    ap.add_argument("--out", help="write results JSON here")
    args = ap.parse_args()
    work = (os.path.join(args.dir or tempfile.gettempdir(), "convert-31b") if args.keep
            else tempfile.mkdtemp(prefix="gguf-31b-", dir=args.dir))
    os.makedirs(work, exist_ok=True)
    copy = os.path.join(work, "copy")
    out = {"layers": args.layers, "cores": stream.usable_cores(), "workers": args.workers, "runs": {}}
    try:
        base = _base(work, args.layers, GEMMA4_31B["vocab_size"])
        vocab = os.path.join(base, "tokenizer.json")
        if not os.path.exists(vocab):  # for the converter's embedding trim (nothing to trim)
            with open(vocab, "w") as f:
                json.dump({"model": {"type": "BPE", "vocab": {f"t{i}": i for i in range(GEMMA4_31B["vocab_size"])},
                                     "merges": []}, "added_tokens": []}, f)
        out["base_bytes"] = dir_bytes(base)
        print(f"base {out['base_bytes'] / 2**30:.2f} GiB, {out['cores']} cores", flush=True)
        runs: dict = {"cp_sync_s": [], "bf16": [], "q8_0": []}
        for _ in range(args.repeat):
            runs["cp_sync_s"].append(timed_shell(f"cp -r {base} {copy} && sync"))
            shutil.rmtree(copy)
            for outtype in ("bf16", "q8_0"):
                runs[outtype].append(_ours(base, os.path.join(work, f"ours.{outtype}.gguf"), outtype, args.workers))
            print(f"  cp + sync {runs['cp_sync_s'][-1]:.1f} s; bf16 {runs['bf16'][-1]['wall_s']:.1f} s "
                  f"({runs['bf16'][-1]['peak_rss_mb']:.0f} MB); q8_0 {runs['q8_0'][-1]['wall_s']:.1f} s "
                  f"({runs['q8_0'][-1]['peak_rss_mb']:.0f} MB)", flush=True)
        out["runs"] = runs
        cp = statistics.median(runs["cp_sync_s"])
        out["cp_sync_s"] = cp
        for outtype in ("bf16", "q8_0"):
            med = {k: statistics.median(r[k] for r in runs[outtype]) for k in runs[outtype][0]}
            out[outtype] = {**med, "x_cp_sync": med["wall_s"] / cp,
                            "file_bytes": os.path.getsize(os.path.join(work, f"ours.{outtype}.gguf"))}
            if not args.no_converter:
                ref = os.path.join(work, f"theirs.{outtype}.gguf")
                theirs = _theirs(base, ref, outtype)
                theirs["identical"] = filecmp.cmp(os.path.join(work, f"ours.{outtype}.gguf"), ref, shallow=False)
                out[f"converter_{outtype}"] = theirs
                os.remove(ref)
            print(f"{outtype}: ours {med['wall_s']:.2f} s = {med['wall_s'] / cp:.2f}x cp + sync ({cp:.2f} s), "
                  f"peak RSS {med['peak_rss_mb']:.0f} MB, CPU {med['user_s'] + med['sys_s']:.1f} s" +
                  ("" if args.no_converter else
                   f"; ggml's converter {theirs['wall_s']:.2f} s, {theirs['peak_rss_mb']:.0f} MB, "
                   f"CPU {theirs['user_s'] + theirs['sys_s']:.1f} s; same bytes: {theirs['identical']}"),
                  flush=True)
    finally:
        for n in ("ours.bf16.gguf", "ours.q8_0.gguf", "theirs.bf16.gguf", "theirs.q8_0.gguf"):
            p = os.path.join(work, n)
            if os.path.exists(p):
                os.remove(p)
        shutil.rmtree(copy, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
