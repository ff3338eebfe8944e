"""Adapter algebra at Gemma 4 31B width: ``ckptbridge adapter extract`` against mergekit's
``mergekit-extract-lora``, and ``ckptbridge adapter combine`` against PEFT's
``add_weighted_adapter``, on the same inputs, each run once in a fresh process (wall time and peak
RSS from ``wait4``), on this machine's cores.

The model: 4 decoder layers with the 31B's projection shapes (hidden 5376, MLP 21504, q 8192,
k/v 4096: 32 heads of 256, 16 kv heads) and a 16384-token vocabulary (the embedding is not
what these verbs work on), bf16. mergekit has no Gemma 4 architecture (``mergekit-extract-lora``
stops on ``Gemma4ForConditionalGeneration``), so the side-by-side runs on a Qwen 3 with those
shapes, and ckptbridge's extract also runs on the Gemma 4 itself. The fine-tune is the base with a
random rank-64 PEFT adapter merged (bf16); both extract at rank 64, and the relative error of each
result against the adapter's true delta is given (the bf16 rounding of the merged weights is the
floor). combine takes three float32 rank-64 adapters with weights 0.5, 0.3, 0.2 (``ties`` at density 0.5,
``svd`` back to rank 64); its relative error is our combined delta against PEFT's.

    .venv/bin/python benchmarks/adapter_algebra.py --mergekit /tmp/mkvenv/bin/mergekit-extract-lora
        [--dir DIR] [--keep] [--out FILE] [--methods cat linear ties svd] [--parts extract combine]
        [--timeout 1800] [--small]

Each run adds its rows to ``--out`` (numbered by run) when that file holds the same shapes and rank.

mergekit comes from PyPI in an environment of its own (``python -m venv /tmp/mkvenv;
/tmp/mkvenv/bin/pip install torch==2.13.0 mergekit==0.1.5``); without ``--mergekit`` its rows say
"not run".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = dict(vocab_size=16384, hidden_size=5376, intermediate_size=21504, num_attention_heads=32,
              num_key_value_heads=16, head_dim=256)
GEMMA4 = dict(SHAPES, family="gemma4", global_head_dim=512, num_global_key_value_heads=4, sliding_window=1024,
              attention_k_eq_v=True, prefix="model.language_model.",
              layer_types=["sliding_attention"] * 3 + ["full_attention"])
QWEN3 = dict(SHAPES, family="qwen3")
RANK = 64
WEIGHTS = [0.5, 0.3, 0.2]

# a contender's process: prints {"seconds": ...} (ours) or nothing (a CLI), peak RSS from wait4
OURS = r"""
import json, sys, time
t = time.perf_counter()
verb, kw = sys.argv[1], json.loads(sys.argv[2])
from ckptbridge import adapter
getattr(adapter, verb)(**kw, progress=False)
print(json.dumps({"seconds": time.perf_counter() - t}))
"""
PEFT = r"""
import json, sys, time
t = time.perf_counter()
base, method, out = sys.argv[1:4]
adapters, weights = json.loads(sys.argv[4]), json.loads(sys.argv[5])
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
pm = PeftModel.from_pretrained(model, adapters[0], adapter_name="a0")
for i, a in enumerate(adapters[1:], 1):
    pm.load_adapter(a, adapter_name=f"a{i}")
extra = {"density": 0.5} if "ties" in method else {}
if method == "svd":
    extra = {"svd_rank": int(sys.argv[6]), "svd_full_matrices": False}
pm.add_weighted_adapter([f"a{i}" for i in range(len(adapters))], weights, "c", combination_type=method, **extra)
pm.save_pretrained(out, selected_adapters=["c"])
print(json.dumps({"seconds": time.perf_counter() - t}))
"""


def measured(cmd: list[str], timeout: float, env: dict | None = None) -> dict:
    """``cmd`` in a fresh process after ``sync``: wall seconds and the peak RSS of its process tree
    (MB, ``/usr/bin/time``'s maximum resident set size)."""
    subprocess.run(["sync"], check=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(["/usr/bin/time", "-f", "@@peak_kb %M", *cmd], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        return {"ok": False, "wall_s": round(time.perf_counter() - t0, 2), "peak_rss_mb": None,
                "error": f"not done after {timeout:.0f} s (--timeout)"}
    wall = time.perf_counter() - t0
    peak = [line for line in proc.stderr.splitlines() if line.startswith("@@peak_kb")]
    result = {"ok": proc.returncode == 0, "wall_s": round(wall, 2),
              "peak_rss_mb": round(int(peak[-1].split()[1]) / 1024) if peak else None}
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines()
                 if line.strip() and not line.startswith(("@@", "Command exited", "Command terminated"))]
        result["error"] = lines[-1][:300] if lines else f"exit {proc.returncode}"
    return result


def delta_error(extracted: str, adapter: str) -> float:
    """``||B A * s - true delta|| / ||true delta||`` over every module of ``adapter`` (a PEFT
    directory with factors that mergekit or ckptbridge extracted), in float64."""
    import ml_dtypes  # noqa: F401  # numpy learns bfloat16, the adapters' dtype
    import numpy as np
    from safetensors.numpy import load_file

    def pairs(d: str) -> tuple[dict, dict]:
        with open(os.path.join(d, "adapter_config.json")) as f:
            cfg = json.load(f)
        out: dict = {}
        for k, v in load_file(os.path.join(d, "adapter_model.safetensors")).items():
            if ".lora_" not in k:
                continue
            module, which = k.removeprefix("base_model.model.").rsplit(".lora_", 1)
            out.setdefault(module, [None, None])[0 if which.startswith("A") else 1] = v.astype(np.float64)
        return out, cfg

    got, gcfg = pairs(extracted)
    want, wcfg = pairs(adapter)
    num = den = 0.0
    for module, (a, b) in want.items():
        true = (wcfg["lora_alpha"] / wcfg["r"]) * (b @ a)
        ga, gb = got[module]
        alpha = next((v for k, v in gcfg.get("alpha_pattern", {}).items() if re.search(k, module)), gcfg["lora_alpha"])
        rank = next((v for k, v in gcfg.get("rank_pattern", {}).items() if re.search(k, module)), gcfg["r"])
        num += float(np.sum((true - (alpha / rank) * (gb @ ga)) ** 2))
        den += float(np.sum(true ** 2))
    return (num / den) ** 0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mergekit", help="mergekit-extract-lora of an environment with mergekit")
    ap.add_argument("--methods", nargs="+", default=["cat", "linear", "ties", "svd"])
    ap.add_argument("--parts", nargs="+", default=["extract", "combine"], choices=("extract", "combine"))
    ap.add_argument("--families", nargs="+", default=["qwen3", "gemma4"], choices=("qwen3", "gemma4"),
                    help="the models extract runs on")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds any one run may take")
    ap.add_argument("--dir", help="work directory (default: a temporary one)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--out", help="results file (default: benchmarks/results/adapter_algebra_31b.json; with "
                    "--small, one in the temporary directory)")
    ap.add_argument("--small", action="store_true", help="1/16 of the widths, rank 8: to check the script")
    args = ap.parse_args()
    global RANK
    args.out = args.out or (os.path.join(tempfile.gettempdir(), "adapter_algebra_small.json") if args.small
                            else os.path.join(ROOT, "benchmarks", "results", "adapter_algebra_31b.json"))
    if args.small:
        RANK = 8
        for dims in (QWEN3, GEMMA4):
            dims.update(hidden_size=336, intermediate_size=1344, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=64, vocab_size=1024)
        GEMMA4.update(global_head_dim=128, num_global_key_value_heads=1)
    sys.path.insert(0, ROOT)
    from ckptbridge import merge_lora
    from ckptbridge.testing import write_random_adapter, write_random_checkpoint

    work = args.dir or tempfile.mkdtemp(prefix="ckptbridge-algebra-")
    os.makedirs(work, exist_ok=True)
    py = sys.executable
    rows: list[dict] = []
    try:
        models = {}
        for name, dims in (("qwen3", QWEN3), ("gemma4", GEMMA4)):
            base = os.path.join(work, f"{name}-base")
            if not os.path.exists(base):
                write_random_checkpoint(base, num_hidden_layers=4, seed=1, **dims)
            adapters = []
            for i in range(3):
                a = os.path.join(work, f"{name}-adapter{i}")
                if not os.path.exists(a):
                    write_random_adapter(base, a, r=RANK, lora_alpha=2 * RANK, seed=7 + i)
                adapters.append(a)
            tuned = os.path.join(work, f"{name}-tuned")
            if not os.path.exists(tuned):
                merge_lora(base, adapters[0], tuned, progress=False)
            models[name] = (base, adapters, tuned)
        print("inputs ready", flush=True)

        def extract_row(who: str, family: str, cmd: list[str], out: str, **extra) -> None:
            shutil.rmtree(out, ignore_errors=True)
            r = measured(cmd, args.timeout, env=extra.pop("env", None))
            if r["ok"]:
                r["relative_error"] = delta_error(out, models[family][1][0])
            rows.append({"verb": "extract", "family": family, "who": who, **extra, **r})
            print(json.dumps(rows[-1]), flush=True)

        for family in args.families if "extract" in args.parts else ():
            base, adapters, tuned = models[family]
            for randomized in (False, True):
                out = os.path.join(work, f"x-{family}-{randomized}")
                kw = dict(model=tuned, dst=out, base=base, rank=RANK, randomized=randomized)
                extract_row(f"ckptbridge{' --randomized' if randomized else ''}", family,
                            [py, "-c", OURS, "extract", json.dumps(kw)], out)
            out = os.path.join(work, f"mk-{family}")
            if args.mergekit:
                extract_row("mergekit-extract-lora", family,
                            [args.mergekit, "--model", tuned, "--base-model", base, "--out-path", out,
                             "--max-rank", str(RANK), "--no-distribute-scale"], out, env={"CUDA_VISIBLE_DEVICES": ""})
            else:
                rows.append({"verb": "extract", "family": family, "who": "mergekit-extract-lora", "ok": False,
                             "error": "not run (no --mergekit)"})
        base = models["qwen3"][0]
        adapters = []  # float32, as PEFT saves them (in bf16, ties at the density's threshold are broken
        for i in range(3 if "combine" in args.parts else 0):  # differently by torch.topk and numpy)
            adapters.append(os.path.join(work, f"qwen3-adapter{i}-f32"))
            if not os.path.exists(adapters[-1]):
                write_random_adapter(base, adapters[-1], r=RANK, lora_alpha=2 * RANK, seed=7 + i, dtype="float32")
        for method in args.methods if "combine" in args.parts else ():
            out = os.path.join(work, f"c-{method}")
            kw = dict(adapters=adapters, dst=out, method=method, weights=WEIGHTS, base=base,
                      **({"density": 0.5} if "ties" in method else {}), **({"rank": RANK} if method == "svd" else {}))
            shutil.rmtree(out, ignore_errors=True)
            r = measured([py, "-c", OURS, "combine", json.dumps(kw)], args.timeout)
            ours = {"verb": "combine", "family": "qwen3", "who": "ckptbridge", "method": method, **r}
            theirs = os.path.join(work, f"p-{method}")
            shutil.rmtree(theirs, ignore_errors=True)
            r = measured([py, "-c", PEFT, base, method, theirs, json.dumps(adapters), json.dumps(WEIGHTS),
                          str(RANK)], args.timeout)
            if r["ok"] and ours["ok"]:  # how far our combined delta is from PEFT's
                ours["relative_error"] = delta_error(out, os.path.join(theirs, "c"))  # PEFT saves "c" under c/
            rows += [ours, {"verb": "combine", "family": "qwen3", "who": "PEFT add_weighted_adapter",
                            "method": method, **r}]
            print(json.dumps(rows[-2]), json.dumps(rows[-1]), sep="\n", flush=True)
            shutil.rmtree(theirs, ignore_errors=True)
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    import platform

    command = " ".join([os.path.basename(py), *sys.argv])
    shapes = {k: QWEN3[k] for k in SHAPES}
    result = {"command": [command], "cpus": os.cpu_count(), "machine": platform.machine(), "shapes": shapes,
              "layers": 4, "rank": RANK, "rows": []}
    if os.path.exists(args.out):  # a run adds its rows to the earlier ones, numbered
        with open(args.out) as f:
            earlier = json.load(f)
        if earlier.get("rank") == RANK and earlier.get("shapes") == shapes:
            result["command"] = [*earlier["command"], command]
            result["rows"] = earlier["rows"]
    run = 1 + max((r.get("run", 1) for r in result["rows"]), default=0)
    result["rows"] += [{**r, "run": run} for r in rows]
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(f"\n{'verb':<8} {'family':<7} {'who':<28} {'method':<7} {'wall s':>8} {'peak MB':>8} {'rel. error':>10}")
    for r in rows:
        err = f"{r['relative_error']:.2e}" if "relative_error" in r else ""
        wall = f"{r['wall_s']:.1f}" if r.get("ok") else r.get("error", "")[:40]
        print(f"{r['verb']:<8} {r['family']:<7} {r['who']:<28} {r.get('method', ''):<7} {wall:>8} "
              f"{r.get('peak_rss_mb') or '':>8} {err:>10}")


if __name__ == "__main__":
    main()
