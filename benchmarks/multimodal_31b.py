"""A multimodal Gemma 4 shaped like 31B through every format that holds its vision tower, side by
side with copying the same bytes, in one run.

The model: a bf16 ``Gemma4ForConditionalGeneration`` checkpoint with the 31B's text shapes (the
real embedding, 262144 x 5376, and ``--layers`` decoder layers, the last one a global k_eq_v
layer) and the 31B's real vision tower (27 layers of width 1152, its 10240 x 2 position table, the
projection into the text model's 5376), written by ``ckptbridge.testing.write_random_checkpoint``
(random values, which zstd compresses as it would real weights) with its image processor's
config, in a process of its own. Alternating ``--repeat`` times, each in a fresh process after
``sync`` (wall time includes the interpreter and its imports; peak RSS and CPU time from
``wait4``, a process's peak counting this script's few tens of MB at the fork): ``cp -r`` +
``sync`` of the model, ``convert`` HF -> Tunix (the towers under
``towers/``), Tunix -> HF, HF -> MaxText (unscanned: the vision tower in MaxText's tree) and HF ->
GGUF bf16 (the text file and ggml's projector file ``mmproj-``). Medians are shown, each as a ratio
to ``cp`` + ``sync`` of the same source bytes. Then, once: ``verify tensors`` of HF -> Tunix -> HF
(every tensor, the towers' too, bit for bit).

    .venv/bin/python benchmarks/multimodal_31b.py [--layers 2] [--repeat 3] [--dir DIR] [--keep] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gguf_31b import _run as measure_process  # noqa: E402
from merge_31b import GEMMA4_31B, dir_bytes  # noqa: E402
from results_file import append_run  # noqa: E402

# google/gemma-4-31B-it's vision_config (MaxText's hf_model_configs.gemma4_31b_dict)
VISION_31B = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                  num_key_value_heads=16, head_dim=72, patch_size=16, position_embedding_size=10240,
                  pooling_kernel_size=3, use_clipped_linears=False, standardize=True)

CONVERSIONS = {  # name -> (source: base or tunix, destination name, convert flags)
    "hf -> tunix": ("base", "tunix", ["--to", "tunix"]),
    "tunix -> hf": ("tunix", "back", ["--to", "hf"]),
    "hf -> maxtext": ("base", "maxtext", ["--to", "maxtext"]),
    "hf -> gguf + mmproj (bf16)": ("base", "model.gguf", ["--outtype", "bf16", "--no-tokenizer"]),
}


def generate(base: str, layers: int) -> None:
    from ckptbridge.specs import get_family
    from ckptbridge.testing import write_random_checkpoint

    layer_types = ["sliding_attention"] * (layers - 1) + ["full_attention"]
    write_random_checkpoint(base, family="gemma4", prefix="model.language_model.", num_hidden_layers=layers,
                            layer_types=layer_types, vision=VISION_31B, **GEMMA4_31B)
    with open(os.path.join(base, "config.json")) as f:
        config = json.load(f)
    processor = get_family("gemma4").model_type("gemma4").tiny_processor
    assert processor is not None
    processor(base, config)


def run(argv: list[str]) -> dict:
    """A command in a fresh process after ``sync`` (gguf_31b's measure): wall time, peak RSS (MB)
    and CPU seconds."""
    r = measure_process(argv)
    return {"wall_s": r["wall_s"], "peak_rss_mb": r["peak_rss_mb"], "cpu_s": r["user_s"] + r["sys_s"]}


def clear(path: str) -> None:
    for p in (path, os.path.join(os.path.dirname(path), "mmproj-" + os.path.basename(path))):
        if os.path.isdir(p):
            shutil.rmtree(p)
        elif os.path.exists(p):
            os.remove(p)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", help="working directory (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the generated model for the next run")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "multimodal_31b.json"))
    ap.add_argument("--generate", metavar="DIR", help=argparse.SUPPRESS)  # (in a process of its own)
    args = ap.parse_args(argv)
    if args.generate:
        generate(args.generate, args.layers)
        return 0
    work = args.dir or tempfile.mkdtemp(prefix="mm31b-")
    os.makedirs(work, exist_ok=True)
    base = os.path.join(work, f"base{args.layers}")
    if not os.path.isdir(base):  # this process stays small: a child's peak RSS counts it at the fork
        subprocess.run([sys.executable, __file__, "--layers", str(args.layers), "--generate", base], check=True)
    towers = json.loads(subprocess.run([sys.executable, "-m", "ckptbridge", "inspect", base, "--json"],
                                       capture_output=True, text=True, check=True).stdout)["towers"]
    nbytes = dir_bytes(base)
    print(f"{base}: {nbytes / 1e9:.2f} GB; vision tower {towers['vision']['tensors']} tensors, "
          f"{towers['vision']['bytes'] / 1e9:.2f} GB", file=sys.stderr)
    paths = {"base": base, "tunix": os.path.join(work, "tunix")}
    times: dict[str, list[dict]] = {"cp -r + sync": [], **{name: [] for name in CONVERSIONS}}
    for i in range(args.repeat):
        copy = os.path.join(work, "copy")
        clear(copy)
        t = run(["sh", "-c", f"cp -r {base} {copy} && sync"])
        times["cp -r + sync"].append(t)
        clear(copy)
        for name, (src, dst, flags) in CONVERSIONS.items():
            out = os.path.join(work, dst)
            clear(out)
            times[name].append(run([sys.executable, "-m", "ckptbridge", "convert", paths[src], out, "--quiet",
                                    *flags]))
            print(f"run {i + 1}: {name}: {times[name][-1]['wall_s']:.1f} s", file=sys.stderr)
    verify = subprocess.run([sys.executable, "-m", "ckptbridge", "verify", "tensors", base,
                             os.path.join(work, "back"), "--json"], capture_output=True, text=True)
    identical = json.loads(verify.stdout)["identical"]
    copy_s = statistics.median(t["wall_s"] for t in times["cp -r + sync"])
    rows = {}
    for name, ts in times.items():
        wall = statistics.median(t["wall_s"] for t in ts)
        rows[name] = {"wall_s": round(wall, 2), "x_cp_sync": round(wall / copy_s, 2),
                      "peak_rss_mb": round(max(t["peak_rss_mb"] for t in ts)),
                      "cpu_s": round(statistics.median(t["cpu_s"] for t in ts), 1),
                      "runs_s": [round(t["wall_s"], 2) for t in ts]}
    outputs = {"tunix": dir_bytes(paths["tunix"]), "maxtext": dir_bytes(os.path.join(work, "maxtext")),
               "gguf": os.path.getsize(os.path.join(work, "model.gguf")),
               "mmproj": os.path.getsize(os.path.join(work, "mmproj-model.gguf"))}
    result = {"command": " ".join([os.path.relpath(__file__, ROOT), *(argv or sys.argv[1:])]),
              "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
              "model": {"layers": args.layers, "bytes": nbytes, "vision": VISION_31B, "towers": towers},
              "repeat": args.repeat, "round_trip_identical": identical, "output_bytes": outputs, "rows": rows}
    print(f"\n| conversion | seconds (median of {args.repeat}) | x cp+sync | peak RSS | CPU s |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['wall_s']:.1f} | {r['x_cp_sync']:.2f} | {r['peak_rss_mb']} MB | {r['cpu_s']} |")
    print(f"\nHF -> Tunix -> HF identical (verify tensors): {identical}")
    append_run(args.out, result)
    if not args.keep and not args.dir:
        shutil.rmtree(work)
    return 0 if identical else 6


if __name__ == "__main__":
    raise SystemExit(main())
