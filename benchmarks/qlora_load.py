"""Load time of a QLoRA base: each weight quantized on the host's cores as it loads (qwix's own
quantization, tensor by tensor) against the plain load of the same bf16 checkpoint.

Builds a Gemma 4 of 31B's width with ``--layers`` decoder layers (random bf16, the paper's LoRA
targets at rank 64), then loads it into the Tunix model with qwix LoRA (``open_tunix_model`` +
``plan.load``, as training does) under ``base_quant=none`` and each scheme, each in a fresh
process, alternating, ``--runs`` times; prints the median seconds and the bytes the devices hold.
On a machine without an accelerator the "device" is the host's CPU backend.

    .venv/bin/python benchmarks/qlora_load.py [--layers 2] [--runs 3] [--schemes none int8 int4]
        [--out benchmarks/results/qlora_load_31b.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LOAD = r"""
import json, sys, time
import jax
from ckptbridge.tunix_model import open_tunix_model
from training.config import PAPER_TARGETS, build_config
base, scheme = sys.argv[1], sys.argv[2]
cfg = build_config("gemma4-31b-v6e1-qlora", None, [f"base_quant={scheme}", "param_dtype=bfloat16"])
rules = cfg.lora_rules(PAPER_TARGETS)
t = time.perf_counter()
with open_tunix_model(base, param_dtype=cfg.param_dtype, dtype=cfg.dtype, skip_multimodal=True,
                      lora_rules=rules) as plan:
    planned = time.perf_counter() - t
    t = time.perf_counter()
    model = plan.load()
    jax.block_until_ready(jax.tree.leaves(model))
    loaded = time.perf_counter() - t
    held = plan.weights_bytes()
with open("/proc/self/status") as f:
    hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
print(json.dumps({"plan_seconds": round(planned, 2), "load_seconds": round(loaded, 2), "device_weight_bytes": held,
                  "peak_rss_mb": round(hwm / 1024)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--schemes", nargs="+", default=["none", "int8", "int4"])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "qlora_load_31b.json"))
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from merge_31b import GEMMA4_31B
    from results_file import append_run

    from ckptbridge.testing import build_checkpoint

    width = {k: v for k, v in GEMMA4_31B.items() if k != "num_hidden_layers"}
    types = ["full_attention" if (i + 1) % 6 == 0 or i == args.layers - 1 else "sliding_attention"
             for i in range(args.layers)]
    with tempfile.TemporaryDirectory(prefix="qlora-load-") as tmp:
        base = build_checkpoint(os.path.join(tmp, "hf"), family="gemma4", dtype="bfloat16", tokenizer=False,
                                num_hidden_layers=args.layers, layer_types=types, **width)
        size = sum(os.path.getsize(os.path.join(base, n)) for n in os.listdir(base) if n.endswith(".safetensors"))
        got: dict[str, list[dict]] = {s: [] for s in args.schemes}
        for i in range(args.runs):
            for scheme in args.schemes:
                proc = subprocess.run([sys.executable, "-c", LOAD, base, scheme], capture_output=True, text=True,
                                      cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
                if proc.returncode != 0:
                    raise SystemExit(f"{scheme}:\n{proc.stderr[-3000:]}")
                got[scheme].append(json.loads(proc.stdout.strip().splitlines()[-1]))
                print(f"run {i + 1} {scheme}: {got[scheme][-1]}", flush=True)
    rows = []
    for scheme, runs in got.items():
        rows.append({"base_quant": scheme, "load_seconds_median": statistics.median(r["load_seconds"] for r in runs),
                     "device_weight_bytes": runs[0]["device_weight_bytes"],
                     "peak_rss_mb_median": statistics.median(r["peak_rss_mb"] for r in runs), "runs": runs})
    plain = next((r["load_seconds_median"] for r in rows if r["base_quant"] == "none"), None)
    for r in rows:
        r["vs_plain"] = None if not plain else round(r["load_seconds_median"] / plain, 2)
        print(f"{r['base_quant']}: load {r['load_seconds_median']:.1f} s ({r['vs_plain']}x plain), "
              f"{r['device_weight_bytes'] / 1e9:.2f} GB on the device, peak RSS {r['peak_rss_mb_median']:.0f} MB")
    append_run(args.out, {"layers": args.layers, "checkpoint_bytes": size,
                          "machine": f"{os.cpu_count()} cores, CPU backend", "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
