"""merge, safetensors-to-orbax and orbax-to-safetensors at real Gemma 4 31B width, side by side with
PEFT's merge_and_unload and with copying the bytes, in one run.

For each k (default 2 and 4): a bf16 Gemma 4 text checkpoint of the 31B's real shapes with the
real embedding (262144 x 5376) and k decoder layers (the last one a global k_eq_v layer, as in
the 31B's 5:1 pattern), and a rank-64 PEFT adapter on all seven projections of every layer. Each
contender runs in a fresh process (wall time includes the interpreter and its imports; peak RSS
is the process's high-water mark, VmHWM), after ``sync`` so that no contender pays for another's writes:

* ``cp -r`` of the base, and the same followed by ``sync`` (ckptbridge fsyncs what it writes),
  alternating with ``ckptbridge merge`` three times (medians: the disk's writeback state moves
  a lot between runs);
* reading the base once (``cat > /dev/null``; the page cache is warm for every contender alike);
* ``ckptbridge merge BASE ADAPTER DST``, three ways (``CONFIGS``): on every core with the default
  ``--workers``, on every core with ``--workers 1``, and pinned to one core with ``taskset``;
* PEFT: ``AutoModelForCausalLM.from_pretrained`` (bf16) + ``PeftModel.from_pretrained`` +
  ``merge_and_unload()`` + ``save_pretrained``; its merged weights are compared with ours;
* ``ckptbridge convert safetensors-to-orbax`` of the base and ``orbax-to-safetensors`` back.

    .venv/bin/python benchmarks/merge_31b.py [--layers 2 4] [--rank 64] [--no-peft] [--out FILE]
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GEMMA4_31B = dict(vocab_size=262144, hidden_size=5376, intermediate_size=21504,
                  num_attention_heads=32, num_key_value_heads=16, head_dim=256, global_head_dim=512,
                  num_global_key_value_heads=4, sliding_window=1024)

# How each merge runs: (CPUs it is pinned to with taskset, or None for all; extra flags).
# Pinned to one core, the default --workers is 1 (the usable cores).
CONFIGS = {"all cores": (None, []), "all cores, --workers 1": (None, ["--workers", "1"]), "1 core": ("0", [])}

RUN = r"""
import json, sys, time
t = time.perf_counter()
what, args = sys.argv[1], sys.argv[2:]
if what == "ckptbridge":
    from ckptbridge.cli import main
    assert main(args + ["--quiet"]) == 0
elif what == "peft":
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base, adapter, dst = args
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.save_pretrained(dst)
elif what == "generate":
    from ckptbridge.testing import write_random_adapter, write_random_checkpoint
    base, adapter, k, rank, alpha, dims = args[0], args[1], int(args[2]), int(args[3]), float(args[4]), json.loads(args[5])
    layer_types = ["sliding_attention"] * (k - 1) + ["full_attention"]
    write_random_checkpoint(base, num_hidden_layers=k, layer_types=layer_types, **dims)
    write_random_adapter(base, adapter, r=rank, lora_alpha=alpha)
# peak RSS of this program: VmHWM (ru_maxrss would include the parent's peak at fork), where the
# kernel reports it (gVisor's /proc does not)
with open("/proc/self/status") as f:
    hwm = next((int(line.split()[1]) for line in f if line.startswith("VmHWM:")), None)
if hwm is None:
    import resource
    hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"seconds": time.perf_counter() - t, "peak_rss_mb": hwm / 1024}))
"""


def measure(*args: str, pin: str | None = None) -> dict:
    """One contender in a fresh process after ``sync``, pinned to the CPUs ``pin`` (taskset) when given."""
    subprocess.run(["sync"], check=True)
    t0 = time.perf_counter()
    taskset = ["taskset", "-c", pin] if pin is not None else []
    out = subprocess.run([*taskset, sys.executable, "-c", RUN, *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{args[0]} failed:\n{out.stderr[-3000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["wall_s"] = time.perf_counter() - t0
    return r


def timed_shell(cmd: str) -> float:
    subprocess.run(["sync"], check=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, shell=True, check=True)
    return time.perf_counter() - t0


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def compare_merged(ours: str, peft: str, base_dir: str) -> dict:
    """Our merged weights vs PEFT's, on every tensor: bf16 values that differ, and by how much
    (in units of the last place). PEFT adds a bf16-rounded delta to the bf16 weight (two
    roundings); ckptbridge adds in float32 and rounds once."""
    import numpy as np

    from ckptbridge.io.hf import HFModelDir

    differ = total = changed = merged_values = 0
    max_ulps = 0
    with HFModelDir(ours) as a, HFModelDir(peft) as b, HFModelDir(base_dir) as base:
        if sorted(a.keys()) != sorted(b.keys()):
            raise SystemExit(f"merged tensors differ: {sorted(set(a.keys()) ^ set(b.keys()))[:5]}")
        for key in a.keys():
            if a.info(key).shape[0] > 100_000:  # the embedding: copied by both, compared by bytes
                same = all(x == y for x, y in zip(a.file_of(key).raw_chunks(key), b.file_of(key).raw_chunks(key)))
                differ += 0 if same else a.info(key).nbytes
                total += int(np.prod(a.info(key).shape))
                continue
            x = a.array(key).view(np.uint16).astype(np.int32)
            y = b.array(key).view(np.uint16).astype(np.int32)
            if key.endswith("_proj.weight"):
                changed += int((x != base.array(key).view(np.uint16)).sum())
                merged_values += x.size
            d = np.abs(x - y)
            differ += int((d != 0).sum())
            total += d.size
            max_ulps = max(max_ulps, int(d.max()))
    return {"values": total, "differing": differ, "fraction_differing": differ / total, "max_ulps": max_ulps,
            "fraction_of_projection_values_changed_by_merge": changed / merged_values}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--alpha", type=float, default=128.0)
    ap.add_argument("--repeat", type=int, default=3, help="runs of cp, cp + sync and merge, alternating (median)")
    ap.add_argument("--no-peft", action="store_true", help="skip PEFT's merge_and_unload (needs ~3x the model in RAM)")
    ap.add_argument("--no-convert", action="store_true", help="skip the conversions (benchmarks/convert_31b.py "
                    "measures them in full)")
    ap.add_argument("--out", help="write results JSON here")
    ap.add_argument("--dir", help="work in this directory (default: the system's temporary one; needs ~3.5x the "
                    "base free)")
    ap.add_argument("--keep", action="store_true", help="keep the generated bases and adapters in DIR/merge-31b "
                    "and reuse them on the next run")
    args = ap.parse_args()

    work = os.path.join(args.dir or tempfile.gettempdir(), "merge-31b") if args.keep else tempfile.mkdtemp(prefix="merge-31b-", dir=args.dir)
    os.makedirs(work, exist_ok=True)
    rows = []
    try:
        for k in args.layers:
            base, adapter = os.path.join(work, f"base{k}"), os.path.join(work, f"adapter{k}")
            if not os.path.isdir(base):  # --dir may hold them from an earlier run (--keep)
                measure("generate", base, adapter, str(k), str(args.rank), str(args.alpha), json.dumps(GEMMA4_31B))
            size = dir_bytes(base)
            print(f"k={k}: base {size / 2**30:.2f} GiB, adapter {dir_bytes(adapter) / 2**20:.0f} MiB", flush=True)
            row = {"layers": k, "base_bytes": size, "adapter_bytes": dir_bytes(adapter)}
            row["read_once_s"] = timed_shell(f"cat {base}/*.safetensors > /dev/null")
            merged = os.path.join(work, "merged")
            runs: dict = {"cp_s": [], "cp_sync_s": [], **{c: [] for c in CONFIGS}}
            for _ in range(args.repeat):  # alternating, median of each: the disk's state moves between runs
                runs["cp_s"].append(timed_shell(f"cp -r {base} {base}.cp"))
                shutil.rmtree(base + ".cp")
                runs["cp_sync_s"].append(timed_shell(f"cp -r {base} {base}.cp && sync"))
                shutil.rmtree(base + ".cp")
                for name, (pin, flags) in CONFIGS.items():
                    shutil.rmtree(merged, ignore_errors=True)
                    runs[name].append(measure("ckptbridge", "merge", base, adapter, merged, *flags, pin=pin))
            row["runs"] = runs
            row["cp_s"], row["cp_sync_s"] = statistics.median(runs["cp_s"]), statistics.median(runs["cp_sync_s"])
            row["configs"] = {c: {k: statistics.median(r[k] for r in runs[c]) for k in runs[c][0]} for c in CONFIGS}
            row["merge"] = row["configs"]["all cores"]
            print(f"  cp {row['cp_s']:.1f} s, cp + sync {row['cp_sync_s']:.1f} s, merge " + ", ".join(
                f"{c}: {m['wall_s']:.1f} s = {m['wall_s'] / row['cp_sync_s']:.2f}x cp + sync, {m['peak_rss_mb']:.0f} MB"
                for c, m in row["configs"].items()) + f" (medians of {args.repeat})", flush=True)
            one, every = row["configs"]["1 core"], row["configs"]["all cores"]
            print(f"  1 core -> all cores: merge {one['wall_s'] / every['wall_s']:.2f}x the rate", flush=True)
            if not args.no_peft:
                peft_out = os.path.join(work, "peft")
                row["peft"] = measure("peft", base, adapter, peft_out)
                print(f"  peft {row['peft']['wall_s']:.1f} s, {row['peft']['peak_rss_mb']:.0f} MB", flush=True)
                row["ours_vs_peft"] = compare_merged(merged, peft_out, base)
                shutil.rmtree(peft_out)
            shutil.rmtree(merged)
            rows.append(row)
            if args.no_convert:
                continue
            orbax, back = os.path.join(work, "orbax"), os.path.join(work, "back")
            row["s2o"] = measure("ckptbridge", "convert", "safetensors-to-orbax", base, orbax)
            row["orbax_bytes"] = dir_bytes(orbax)
            row["o2s"] = measure("ckptbridge", "convert", "orbax-to-safetensors", orbax, back)
            print(f"  s2o {row['s2o']['wall_s']:.1f} s, o2s {row['o2s']['wall_s']:.1f} s", flush=True)
            row["round_trip_identical"] = subprocess.run(
                [sys.executable, "-m", "ckptbridge", "verify", "tensors", base, back], capture_output=True).returncode == 0
            for p in (orbax, back):
                shutil.rmtree(p)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if args.no_convert:
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"rank": args.rank, "rows": rows}, f, indent=2)
        return

    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"{'k':>2} {'base GiB':>8} {'cp s':>6} {'cp+sync':>7} {'read':>5} | {'merge s':>7} {'x cp':>5} "
          f"{'x cp+sync':>9} {'RSS MB':>7} | {'peft s':>6} {'RSS MB':>7} | {'s2o s':>5} {'x cp':>5} {'RSS MB':>6} | "
          f"{'o2s s':>5} {'x cp':>5} {'RSS MB':>6}")
    for r in rows:
        m, s, o = r["merge"], r["s2o"], r["o2s"]
        p = r.get("peft", {"wall_s": float("nan"), "peak_rss_mb": float("nan")})
        print(f"{r['layers']:>2} {r['base_bytes'] / 2**30:>8.2f} {r['cp_s']:>6.2f} {r['cp_sync_s']:>7.2f} "
              f"{r['read_once_s']:>5.2f} | {m['wall_s']:>7.2f} {m['wall_s'] / r['cp_s']:>5.2f} "
              f"{m['wall_s'] / r['cp_sync_s']:>9.2f} {m['peak_rss_mb']:>7.0f} | {p['wall_s']:>6.1f} "
              f"{p['peak_rss_mb']:>7.0f} | {s['wall_s']:>5.1f} {s['wall_s'] / r['cp_s']:>5.2f} "
              f"{s['peak_rss_mb']:>6.0f} | {o['wall_s']:>5.1f} {o['wall_s'] / r['cp_s']:>5.2f} {o['peak_rss_mb']:>6.0f}")
        if "ours_vs_peft" in r:
            c = r["ours_vs_peft"]
            print(f"   ours vs PEFT merged values: {c['fraction_differing']:.2%} differ, at most {c['max_ulps']} "
                  f"bf16 ulp(s); the merge changed {c['fraction_of_projection_values_changed_by_merge']:.1%} of the "
                  "projection weights")
        print(f"   orbax round trip bit-identical: {r['round_trip_identical']}")
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        print(f"peak RSS k={last['layers']} vs k={first['layers']}: merge "
              f"{last['merge']['peak_rss_mb'] / first['merge']['peak_rss_mb']:.2f}x, s2o "
              f"{last['s2o']['peak_rss_mb'] / first['s2o']['peak_rss_mb']:.2f}x, o2s "
              f"{last['o2s']['peak_rss_mb'] / first['o2s']['peak_rss_mb']:.2f}x (base "
              f"{last['base_bytes'] / first['base_bytes']:.2f}x)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rank": args.rank, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
