"""safetensors-to-maxtext and maxtext-to-safetensors at 31B width, beside ``cp -r`` + ``sync``.

A bf16 checkpoint of real shapes with k decoder layers: Gemma 4 31B (``--model gemma4``, the
default: hidden 5376, real embedding, k = 6 so that the layers fill one MaxText block of five
local layers and a global k_eq_v one: 9.4 GB) or Qwen3-32B (``--model qwen3``: hidden 5120, 64
query / 8 KV heads of 128, MLP 25600, vocab 151936, untied head; k = 4: 7.0 GB). It is converted
to MaxText scanned, unscanned and scanned without zstd, and back, alternating with ``cp -r`` +
``sync`` of the base ``--repeat`` times (medians shown), each a fresh CLI process after ``sync``
(wall time, peak RSS and CPU from ``wait4``). Then ``verify tensors`` of the round trip (bitwise
for Qwen 3; Gemma 4's embedding is rounded once each way by MaxText's scale).

    .venv/bin/python benchmarks/maxtext_31b.py [--model gemma4|qwen3] [--layers K] [--repeat 3] [--dir DIR]
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from convert_31b import _convert  # noqa: E402
from merge_31b import GEMMA4_31B, dir_bytes, timed_shell  # noqa: E402

QWEN3_32B = dict(vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_attention_heads=64,
                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
MODELS = {"gemma4": (GEMMA4_31B, 6), "qwen3": (QWEN3_32B, 4)}  # dims, default layers
GENERATE = """
import json, sys
from ckptbridge.testing import write_random_checkpoint
family, k, dims = sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
if family == "gemma4":  # five local layers, then a global one, in every six
    dims["layer_types"] = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(k)]
write_random_checkpoint(sys.argv[1], family=family, num_hidden_layers=k, **dims)
"""
HOW = {"scanned": ["--scan-layers"], "unscanned": [], "scanned, no zstd": ["--scan-layers", "--no-compression"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="gemma4")
    ap.add_argument("--layers", type=int, help="decoder layers (default: 6 for gemma4, 4 for qwen3)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", help="where the base, outputs and copies go (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the base in DIR/maxtext-31b for the next run")
    ap.add_argument("--out", help="JSON file for the results")
    args = ap.parse_args()
    dims, default_layers = MODELS[args.model]
    args.layers = args.layers or default_layers
    work = (os.path.join(args.dir or tempfile.gettempdir(), "maxtext-31b") if args.keep
            else tempfile.mkdtemp(prefix="maxtext-31b-", dir=args.dir))
    os.makedirs(work, exist_ok=True)
    base = os.path.join(work, f"{args.model}-base{args.layers}")
    mt, back, copy = (os.path.join(work, n) for n in ("mt", "back", "copy"))
    try:
        if not os.path.isdir(base):
            subprocess.run([sys.executable, "-c", GENERATE, base, args.model, str(args.layers), json.dumps(dims)],
                           check=True)
        runs: dict = {"cp_sync_s": [], **{h: {"s2m": [], "m2s": []} for h in HOW}}
        for _ in range(args.repeat):
            runs["cp_sync_s"].append(timed_shell(f"cp -r {base} {copy} && sync"))
            shutil.rmtree(copy)
            line = f"cp + sync {runs['cp_sync_s'][-1]:.1f} s"
            for how, flags in HOW.items():
                runs[how]["s2m"].append(_convert("safetensors-to-maxtext", base, mt, *flags))
                shutil.rmtree(back, ignore_errors=True)
                runs[how]["m2s"].append(_convert("maxtext-to-safetensors", mt, back))
                last = {d: runs[how][d][-1]["wall_s"] for d in ("s2m", "m2s")}
                line += f"; {how}: s2m {last['s2m']:.1f} s, m2s {last['m2s']:.1f} s"
            print(line, flush=True)
        same = subprocess.run([sys.executable, "-m", "ckptbridge", "verify", "tensors", base, back],
                              capture_output=True, text=True).returncode == 0
        cps = statistics.median(runs["cp_sync_s"])
        result = {"model": {"family": args.model, **dims, "num_hidden_layers": args.layers}, "base_bytes": dir_bytes(base),
                  "cp_sync_s": cps, "runs": runs, "round_trip_bitwise": same}
        print(f"base {result['base_bytes'] / 2**30:.2f} GiB, cp + sync median {cps:.2f} s")
        print(f"{'how':<16} | {'s2m s':>6} {'x cp+sync':>9} {'RSS MB':>6} {'CPU s':>6} | "
              f"{'m2s s':>6} {'x cp+sync':>9} {'RSS MB':>6} {'CPU s':>6}")
        for how in HOW:
            cells = []
            for d in ("s2m", "m2s"):
                r = runs[how][d]
                wall = statistics.median(x["wall_s"] for x in r)
                cells.append(f"{wall:>6.2f} {wall / cps:>9.2f} {max(x['peak_rss_mb'] for x in r):>6.0f} "
                             f"{statistics.median(x['user_s'] + x['sys_s'] for x in r):>6.1f}")
            print(f"{how:<16} | {cells[0]} | {cells[1]}")
        print(f"round trip bit-identical (verify tensors): {same}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
    finally:
        for p in (mt, back, copy):
            shutil.rmtree(p, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
