"""Load time of a QLoRA base: each weight quantized on the host's cores as it loads (qwix's own
quantization, tensor by tensor), or read from a base stored quantized (``convert --to tunix
--quantize``), against the plain load of the same bf16 checkpoint and the files' read speed.

Builds a Gemma 4 of 31B's width with ``--layers`` decoder layers (random bf16, the paper's LoRA
targets at rank 64), then loads it into the Tunix model with qwix LoRA (``open_tunix_model`` +
``plan.load``, as training does) under ``base_quant=none`` and each scheme, each in a fresh
process, alternating, ``--runs`` times; with ``--stored`` also converts it once per scheme with
``--quantize`` (timed: the quantization's rate) and loads those. Prints the median seconds, the
rate against reading the same files (``cat``, page-cached, just before), and the bytes the
devices hold. It runs on whatever JAX finds (the TPU of a TPU host; elsewhere the host's CPU
backend).

    .venv/bin/python benchmarks/qlora_load.py [--layers 2] [--runs 3] [--schemes none int8 int4] [--stored]
        [--dir DIR] [--out benchmarks/results/qlora_load_31b.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

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
                  "peak_rss_mb": round(hwm / 1024), "device": jax.devices()[0].device_kind}))
"""


def _read_seconds(path: str) -> float:
    """Seconds to read every file under ``path`` (page-cached, as the loads find them)."""
    files = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    t = time.perf_counter()
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t


def _bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--schemes", nargs="+", default=["none", "int8", "int4"])
    ap.add_argument("--stored", action="store_true", help="also load each scheme from a base stored quantized")
    ap.add_argument("--dir", help="work here (default: the system's temporary directory)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "qlora_load_31b.json"))
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from merge_31b import GEMMA4_31B
    from results_file import append_run

    from ckptbridge.testing import build_checkpoint

    width = {k: v for k, v in GEMMA4_31B.items() if k != "num_hidden_layers"}
    types = ["full_attention" if (i + 1) % 6 == 0 or i == args.layers - 1 else "sliding_attention"
             for i in range(args.layers)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    stored: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="qlora-load-", dir=args.dir) as tmp:
        base = build_checkpoint(os.path.join(tmp, "hf"), family="gemma4", dtype="bfloat16", tokenizer=False,
                                num_hidden_layers=args.layers, layer_types=types, **width)
        size = sum(os.path.getsize(os.path.join(base, n)) for n in os.listdir(base) if n.endswith(".safetensors"))
        sources = {s: base for s in args.schemes}
        if args.stored:
            for scheme in (s for s in args.schemes if s != "none"):
                dst = os.path.join(tmp, f"q-{scheme}")
                t = time.perf_counter()
                proc = subprocess.run([sys.executable, "-m", "ckptbridge", "convert", base, dst, "--to", "tunix",
                                       "--quantize", scheme, "--quiet"], capture_output=True, text=True, cwd=ROOT,
                                      env=env)
                if proc.returncode != 0:
                    raise SystemExit(f"--quantize {scheme}:\n{proc.stderr[-3000:]}")
                seconds = time.perf_counter() - t
                stored[scheme] = {"convert_seconds": round(seconds, 2), "gb_per_s": round(size / 1e9 / seconds, 3),
                                  "bytes": _bytes(dst)}
                print(f"convert --quantize {scheme}: {seconds:.1f} s ({size / 1e9 / seconds:.2f} GB/s of bf16), "
                      f"{stored[scheme]['bytes'] / 1e9:.2f} GB", flush=True)
                sources[f"{scheme} stored"] = dst
        got: dict[str, list[dict]] = {s: [] for s in sources}
        for i in range(args.runs):
            for name, src in sources.items():
                read = _read_seconds(src)
                proc = subprocess.run([sys.executable, "-c", LOAD, src, name.split()[0]], capture_output=True,
                                      text=True, cwd=ROOT, env=env)
                if proc.returncode != 0:
                    raise SystemExit(f"{name}:\n{proc.stderr[-3000:]}")
                got[name].append({**json.loads(proc.stdout.strip().splitlines()[-1]), "read_seconds": round(read, 2)})
                print(f"run {i + 1} {name}: {got[name][-1]}", flush=True)
        files = {name: _bytes(src) for name, src in sources.items()}
    rows = []
    for name, runs in got.items():
        load = statistics.median(r["load_seconds"] for r in runs)
        read = statistics.median(r["read_seconds"] for r in runs)
        rows.append({"base_quant": name, "load_seconds_median": load, "read_seconds_median": read,
                     "of_read_speed": round(read / load, 3), "file_bytes": files[name],
                     "device_weight_bytes": runs[0]["device_weight_bytes"], "device": runs[0].get("device"),
                     "peak_rss_mb_median": statistics.median(r["peak_rss_mb"] for r in runs), "runs": runs})
    plain = next((r["load_seconds_median"] for r in rows if r["base_quant"] == "none"), None)
    for r in rows:
        r["vs_plain"] = None if not plain else round(r["load_seconds_median"] / plain, 2)
        print(f"{r['base_quant']}: load {r['load_seconds_median']:.1f} s ({r['vs_plain']}x plain; "
              f"{r['file_bytes'] / 1e9 / r['load_seconds_median']:.2f} GB/s, {100 * r['of_read_speed']:.0f}% of "
              f"reading its files, {r['read_seconds_median']:.1f} s), {r['device_weight_bytes'] / 1e9:.2f} GB on "
              f"the device, peak RSS {r['peak_rss_mb_median']:.0f} MB")
    append_run(args.out, {"layers": args.layers, "checkpoint_bytes": size, "cores": os.cpu_count(),
                          "device": rows[0]["device"], "quantized": stored or None, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
