"""Peak resident memory of conversions and merge vs the number of layers (same width).

Builds two bf16 checkpoints of the same width with 4 and 16 layers (and a rank-16 adapter on
every LoRA-able module of each), converts each HF -> Orbax -> HF and merges the adapter, each
in a fresh process, and prints peak RSS (and the RSS of a process that only imports the same
modules) next to the checkpoint size. Streaming means the peak should stay flat while the
checkpoint grows 4x. ``--model``: the dense Gemma 4 (default), or an expert-heavy model, Qwen 3
MoE (16 experts per layer, one HF key each, stacked into one Tunix tensor per projection) or
Gemma 4 MoE (one HF tensor per layer's experts), whose layers are mostly experts. With
``--vocab V1 V2`` the models differ in their embedding instead (the largest tensor), so that
with a small ``--chunk-size`` the peak shows whether conversions hold a tensor whole. With
``--quantize int8|fp8`` the merge is also run quantizing in the same pass (dense models).
``--pairs`` chooses the conversions (any pair of HF, Tunix, MaxText, GGUF bf16 and q8_0 and
compressed-tensors; ``all``: every one, and merge), each source made from the HF model first.

    .venv/bin/python benchmarks/memory_vs_layers.py [--model gemma4|qwen3_moe|gemma4_moe] [--layers 4 16]
        [--vocab V1 V2] [--chunk-size SIZE] [--memory-budget SIZE] [--width 1024] [--quantize int8|fp8]
        [--pairs s2o o2s merge | all | PAIR ...] [--out FILE] [--max-growth 0.6]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

DRIVER = r"""
import json, sys, time
from ckptbridge import convert, merge_lora
import orbax.checkpoint, jax  # the same imports in every run, so baselines are comparable
what, src, dst = sys.argv[1:4]
kw = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}  # the verb's keyword arguments
t = time.perf_counter()
if what == "convert":
    convert(src, dst, progress=False, **kw)
elif what == "merge":
    merge_lora(src, kw.pop("adapter"), dst, progress=False, **kw)
# peak RSS of this program: VmHWM (ru_maxrss would include the parent's peak at fork)
with open("/proc/self/status") as f:
    hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
print(json.dumps({"seconds": time.perf_counter() - t, "peak_rss_mb": hwm / 1024}))
"""

# The conversions --pairs names: (source format, destination format, convert options). The
# sources other than HF are made from the HF model once per size (not measured unless named).
PAIRS = {
    "s2o": ("hf", "tunix", {}), "o2s": ("tunix", "hf", {}),
    "hf-maxtext": ("hf", "maxtext", {}), "maxtext-hf": ("maxtext", "hf", {}),
    "tunix-maxtext": ("tunix", "maxtext", {}), "maxtext-tunix": ("maxtext", "tunix", {}),
    "hf-gguf": ("hf", "gguf", {"outtype": "bf16"}), "hf-gguf-q8_0": ("hf", "gguf", {"outtype": "q8_0"}),
    "tunix-gguf": ("tunix", "gguf", {"outtype": "bf16"}), "tunix-gguf-q8_0": ("tunix", "gguf", {"outtype": "q8_0"}),
    "maxtext-gguf": ("maxtext", "gguf", {"outtype": "bf16"}),
    "gguf-hf": ("gguf", "hf", {}), "gguf-tunix": ("gguf", "tunix", {}), "gguf-maxtext": ("gguf", "maxtext", {}),
    "hf-ct": ("hf", "compressed-tensors", {"quantize": "int8"}),
    "tunix-ct": ("tunix", "compressed-tensors", {"quantize": "int8"}),
}
SUFFIX = {"gguf": ".gguf"}


def _gemma4(d: int) -> dict:
    return dict(vocab_size=8 * d, hidden_size=d, intermediate_size=4 * d, num_attention_heads=8,
                num_key_value_heads=4, head_dim=d // 8, global_head_dim=d // 4, num_global_key_value_heads=2,
                sliding_window=128)


MODELS = {
    "gemma4": _gemma4,
    # experts: 3 x 16 x (D/2 x D) = 24 D^2 per layer, against about 3 D^2 of attention
    "qwen3_moe": lambda d: dict(family="qwen3", model_type="qwen3_moe", vocab_size=8 * d, hidden_size=d,
                                intermediate_size=4 * d, num_attention_heads=8, num_key_value_heads=4, head_dim=d // 8,
                                num_experts=16, num_experts_per_tok=2, moe_intermediate_size=d // 2),
    "gemma4_moe": lambda d: dict(_gemma4(d), intermediate_size=d, enable_moe_block=True, num_experts=16,
                                 top_k_experts=2, moe_intermediate_size=d // 2),
}


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


def _options(src_fmt: str, dst_fmt: str, hf: str) -> dict:
    """What a pair needs besides the measured options: a GGUF source its HF config, a GGUF file no
    tokenizer (the random models have none)."""
    return {**({"config": hf} if src_fmt == "gguf" else {}), **({"tokenizer": False} if dst_fmt == "gguf" else {})}


def _source(made: dict, fmt: str, tmp: str, kw: dict) -> str:
    """The model in format ``fmt``, converted from the HF one the first time it is asked for."""
    if fmt not in made:
        dst = os.path.join(tmp, "src-" + fmt + SUFFIX.get(fmt, ""))
        measure("convert", made["hf"], dst, json.dumps({**kw, **_options("hf", fmt, made["hf"]), "to": fmt}))
        made[fmt] = dst
    return made[fmt]


def measure(what: str, src: str, dst: str, *extra: str) -> dict:
    out = subprocess.run([sys.executable, "-c", DRIVER, what, src, dst, *extra], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{what} {src} -> {dst} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def workers_table(args, tmp: str, dims: dict, baseline: dict, budget: dict) -> None:
    """Peak RSS of each verb at each of ``args.workers`` (one model), against the first count."""
    from ckptbridge.testing import write_random_adapter, write_random_checkpoint

    n = args.layers[0]
    hf = os.path.join(tmp, "hf")
    write_random_checkpoint(hf, num_hidden_layers=n, **dims)
    adapter = write_random_adapter(hf, os.path.join(tmp, "adapter"), r=16)
    chunk = {"chunk_size": args.chunk_size} if args.chunk_size else {}
    rows = []
    for w in args.workers:
        kw = {**budget, "workers": w}
        orbax = os.path.join(tmp, f"orbax{w}")
        row = {"workers": w}
        for verb, src, dst, extra in (("s2o", hf, orbax, {**chunk, "to": "tunix"}),
                                      ("o2s", orbax, os.path.join(tmp, f"back{w}"), {**chunk, "to": "hf"}),
                                      ("merge", hf, os.path.join(tmp, f"merged{w}"), {"adapter": adapter})):
            m = measure("merge" if verb == "merge" else "convert", src, dst, json.dumps({**kw, **extra}))
            row[f"{verb}_s"], row[f"{verb}_peak_rss_mb"] = m["seconds"], m["peak_rss_mb"]
        for name in (f"orbax{w}", f"back{w}", f"merged{w}"):
            shutil.rmtree(os.path.join(tmp, name))
        rows.append(row)
    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"model {args.model}, width D={dims['hidden_size']}, {n} layers, checkpoint {dir_bytes(hf) / 2**20:.0f} MB, "
          f"memory budget {args.memory_budget or 'default'}; "
          f"baseline RSS after imports: {baseline['peak_rss_mb']:.0f} MB")
    print(f"{'workers':>7} " + " ".join(f"{v + ' s':>8} {v + ' peak MB':>13}" for v in ("s2o", "o2s", "merge")))
    for r in rows:
        print(f"{r['workers']:>7} " + " ".join(f"{r[v + '_s']:>8.2f} {r[v + '_peak_rss_mb']:>13.0f}"
                                               for v in ("s2o", "o2s", "merge")))
    from ckptbridge import options

    limit_mb = options.parse_size(args.memory_budget or options.DEFAULT_MEMORY_BUDGET) / 2**20
    over = {v: max(r[f"{v}_peak_rss_mb"] for r in rows) - baseline["peak_rss_mb"] for v in ("s2o", "o2s", "merge")}
    print(f"largest peak RSS over the baseline, memory budget {limit_mb:.0f} MB: "
          + ", ".join(f"{v} {o:.0f} MB ({o / limit_mb:.2f}x)" for v, o in over.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "width": dims["hidden_size"], "layers": n, "memory_budget_mb": limit_mb,
                       "baseline_rss_mb": baseline["peak_rss_mb"], "rows": rows}, f, indent=2)
    if args.max_over_budget is not None:
        bad = [v for v, o in over.items() if o > args.max_over_budget * limit_mb]
        if bad:
            print(f"memory follows the workers past the budget: {', '.join(bad)} > {args.max_over_budget}x")
            sys.exit(1)
        print(f"memory guard ok: every peak RSS within {args.max_over_budget}x the memory budget over the baseline")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--model", choices=sorted(MODELS), default="gemma4", help="model shape (default gemma4)")
    ap.add_argument("--width", type=int, default=1024, help="hidden size D (MLP 4 D, 8 heads)")
    ap.add_argument("--vocab", type=int, nargs="+",
                    help="compare these vocabulary sizes at the first --layers count instead of layer counts: the "
                    "embedding, the largest tensor, grows (default vocabulary: 8 D)")
    ap.add_argument("--workers", type=int, nargs="+",
                    help="compare these --workers counts at the first --layers count instead of layer counts: the "
                    "memory budget is shared by the workers, so the peak should not follow them")
    ap.add_argument("--max-over-budget", type=float,
                    help="with --workers: exit 1 when a verb's peak RSS over the baseline exceeds this many times "
                    "the memory budget at any worker count")
    ap.add_argument("--chunk-size", help="--chunk-size of both conversions (default: ckptbridge's)")
    ap.add_argument("--memory-budget", help="--memory-budget of every verb (default: ckptbridge's)")
    ap.add_argument("--pairs", nargs="+", default=["s2o", "o2s", "merge"], choices=[*PAIRS, "merge", "all"],
                    help="what to measure at each size: conversions (source-destination; s2o is hf-tunix, o2s "
                    "tunix-hf; q8_0 a GGUF of that type, ct compressed-tensors int8) and merge; all: every one "
                    "(default: s2o o2s merge)")
    ap.add_argument("--quantize", choices=("int8", "fp8"),
                    help="also measure merge --quantize SCHEME (a dense model: MoE experts are not quantized)")
    ap.add_argument("--out", help="write results JSON here")
    ap.add_argument("--max-growth", type=float,
                    help="exit 1 when a peak RSS grows by more than this many MB per MB of checkpoint between the "
                    "smallest and largest model (the CI guard; holding the whole model in memory is >= 1)")
    args = ap.parse_args()
    from ckptbridge.testing import write_random_adapter, write_random_checkpoint

    d = args.width
    dims = MODELS[args.model](d)
    tmp = tempfile.mkdtemp(prefix="ckptbridge-bench-")
    rows = []
    try:
        baseline = measure("none", "", "")
        budget = {"memory_budget": args.memory_budget} if args.memory_budget else {}
        if args.workers:
            return workers_table(args, tmp, dims, baseline, budget)
        verbs = [*PAIRS, "merge"] if "all" in args.pairs else args.pairs
        chunk = {"chunk_size": args.chunk_size} if args.chunk_size else {}
        sizes = ([(args.layers[0], v) for v in args.vocab] if args.vocab
                 else [(n, dims["vocab_size"]) for n in args.layers])
        for n, vocab in sizes:
            hf = os.path.join(tmp, f"hf{n}-{vocab}")
            write_random_checkpoint(hf, num_hidden_layers=n, **{**dims, "vocab_size": vocab})
            size = dir_bytes(hf)
            t = time.perf_counter()
            subprocess.run(["cp", "-r", hf, hf + ".cp"], check=True)
            cp_s = time.perf_counter() - t
            shutil.rmtree(hf + ".cp")  # each output is removed once measured
            row = {"layers": n, "vocab": vocab, "embedding_mb": vocab * d * 2 / 2**20, "checkpoint_mb": size / 2**20,
                   "cp_s": cp_s}
            made = {"hf": hf}
            for verb in verbs:
                if verb == "merge":
                    adapter = write_random_adapter(hf, os.path.join(tmp, "adapter"), r=16)
                    quantized = [("mergeq", {"quantize": args.quantize})] if args.quantize else []
                    for name, extra in [("merge", {}), *quantized]:
                        m = measure("merge", hf, os.path.join(tmp, "merged"),
                                    json.dumps({**budget, "adapter": adapter, **extra}))
                        row[f"{name}_s"], row[f"{name}_peak_rss_mb"] = m["seconds"], m["peak_rss_mb"]
                        shutil.rmtree(os.path.join(tmp, "merged"))
                    shutil.rmtree(adapter)
                    continue
                src_fmt, dst_fmt, opts = PAIRS[verb]
                src = _source(made, src_fmt, tmp, {**budget, **chunk})
                dst = os.path.join(tmp, "out" + SUFFIX.get(dst_fmt, ""))
                m = measure("convert", src, dst, json.dumps({**budget, **chunk, **_options(src_fmt, dst_fmt, hf),
                                                             **opts, "to": dst_fmt}))
                row[f"{verb}_s"], row[f"{verb}_peak_rss_mb"] = m["seconds"], m["peak_rss_mb"]
                _remove(dst)
            rows.append(row)
            for path in made.values():
                _remove(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"model {args.model}, width D={d}, bf16, chunk size {args.chunk_size or 'default'}, memory budget "
          f"{args.memory_budget or 'default'}; baseline RSS after "
          f"imports: {baseline['peak_rss_mb']:.0f} MB")
    names = [v for v in verbs if v != "merge"] + (["merge"] if "merge" in verbs else []) + \
        (["mergeq"] if "merge" in verbs and args.quantize else [])
    print(f"{'layers':>6} {'emb MB':>7} {'ckpt MB':>8} {'cp s':>6} " + " ".join(f"{v + ' s':>{max(8, len(v) + 2)}} "
                                                                           f"{v + ' peak MB':>{len(v) + 8}}"
                                                                           for v in names))
    for r in rows:
        print(f"{r['layers']:>6} {r['embedding_mb']:>7.0f} {r['checkpoint_mb']:>8.0f} {r['cp_s']:>6.2f} "
              + " ".join(f"{r[v + '_s']:>{max(8, len(v) + 2)}.2f} {r[v + '_peak_rss_mb']:>{len(v) + 8}.0f}"
                         for v in names))
    first, last = rows[0], rows[-1]
    keys = ("checkpoint_mb", *(f"{v}_peak_rss_mb" for v in names))
    ratio = {k: last[k] / first[k] for k in keys}
    what = (f"embedding {last['vocab']} vs {first['vocab']} rows" if args.vocab
            else f"{last['layers']} vs {first['layers']} layers")
    print(f"ratio {what}: checkpoint {ratio['checkpoint_mb']:.2f}x, "
          + ", ".join(f"{v} peak RSS {ratio[v + '_peak_rss_mb']:.2f}x" for v in names))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "width": d, "quantize": args.quantize,
                       "baseline_rss_mb": baseline["peak_rss_mb"], "rows": rows, "ratio": ratio}, f, indent=2)
    growth = {k: (last[k] - first[k]) / (last["checkpoint_mb"] - first["checkpoint_mb"]) for k in keys[1:]}
    print("peak RSS growth per MB of checkpoint: " + ", ".join(f"{k.removesuffix('_peak_rss_mb')} {v:.2f}"
                                                             for k, v in growth.items()))
    if args.max_growth is not None:
        over = [k for k, v in growth.items() if v > args.max_growth]
        if over:
            grown = ", ".join(f"{k.removesuffix('_peak_rss_mb')} {growth[k]:.2f}" for k in over)
            print(f"memory grows with the model: {grown} MB/MB > {args.max_growth}")
            sys.exit(1)
        print(f"memory guard ok: every peak RSS grows <= {args.max_growth} MB per MB of checkpoint")


if __name__ == "__main__":
    main()
