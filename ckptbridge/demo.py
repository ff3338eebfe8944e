"""The main job: a tiny 31B-shaped Gemma 4 through HF -> Orbax -> HF, checked bit for bit and
across frameworks, and a Tunix/qwix LoRA through PEFT and merge_lora, checked by logits, with a
short report (``out/report.md`` and ``out/report.json``).

    python -m ckptbridge.demo [--out DIR] [--layers N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

from ckptbridge.cli import _quiet_libraries


def _step(i: int, n: int, text: str) -> None:
    print(f"[{i}/{n}] {text}", flush=True)


def run(out: str, layers: int = 12) -> dict:
    from ckptbridge.convert import convert_orbax_to_safetensors, convert_safetensors_to_orbax
    from ckptbridge.testing import TINY_DIMS, build_checkpoint
    from ckptbridge.verify import compare_tensors, logits_parity

    work = os.path.join(out, "demo")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    n = 6
    report: dict = {"model": {**TINY_DIMS, "num_hidden_layers": layers, "attention_k_eq_v": True}}

    _step(1, n, f"building a tiny random Gemma 4 shaped like 31B ({layers} layers, 5 sliding : 1 global with "
              "k_eq_v, distinct dims, byte-level BPE tokenizer + chat template), float32 and bfloat16")
    paths = {}
    for dtype in ("float32", "bfloat16"):
        paths[dtype] = build_checkpoint(os.path.join(work, f"hf-{dtype}"), dtype=dtype, shards=2,
                                        num_hidden_layers=layers, seed=0)

    report["conversions"] = {}
    for dtype, hf in paths.items():
        orbax_dir, back = os.path.join(work, f"orbax-{dtype}"), os.path.join(work, f"hf-{dtype}-roundtrip")
        _step(2, n, f"safetensors -> orbax ({dtype})")
        to_orbax = convert_safetensors_to_orbax(hf, orbax_dir, progress=False)
        _step(3, n, f"orbax -> safetensors ({dtype})")
        to_hf = convert_orbax_to_safetensors(orbax_dir, back, max_shard_size="100KB", progress=False)
        _step(4, n, f"bitwise comparison of the round trip ({dtype})")
        same = compare_tensors(hf, back)
        report["conversions"][dtype] = {
            "tensors": same["tensors"],
            "bytes": same["bytes"],
            "identical": same["identical"],
            "safetensors_to_orbax_s": to_orbax["seconds"],
            "orbax_to_safetensors_s": to_hf["seconds"],
            "shards_written": len([f for f in to_hf["files"] if f.endswith(".safetensors")]),
        }
    _step(5, n, "logits parity: transformers on the HF model vs Tunix on the Orbax checkpoint (float32)")
    report["parity"] = logits_parity(paths["float32"], os.path.join(work, "orbax-float32"))
    _step(6, n, "LoRA: qwix LoRA on all seven targets (rank 4, alpha 12) saved by Tunix's CheckpointManager "
              "-> PEFT adapter -> transformers+PEFT, and merged into the base")
    report["lora"] = lora_round(paths["float32"], work)
    report["ok"] = all(c["identical"] for c in report["conversions"].values()) and (
        report["parity"]["rel_l2"] <= 1e-5 and report["parity"]["argmax_agreement"] == 1.0
    ) and report["lora"]["peft_rel_l2"] <= 1e-5 and report["lora"]["merged_rel_l2"] <= 1e-5
    return report


def lora_round(base: str, work: str) -> dict:
    import numpy as np

    from ckptbridge.adapters import convert_orbax_to_peft
    from ckptbridge.merge import merge_lora
    from ckptbridge.testing import LORA_TARGETS, build_tunix_lora, save_tunix_lora
    from ckptbridge.verify import hf_logits, peft_logits, rel_l2, tunix_logits

    rules = [{"module_path": LORA_TARGETS, "rank": 4, "alpha": 12.0}]
    model, rules = build_tunix_lora(base, rules, seed=1)
    root = save_tunix_lora(model, os.path.join(work, "lora-checkpoints"), step=100,
                           custom_metadata={"ckptbridge": {"family": "gemma4", "kind": "lora", "lora": {"rules": rules}}})
    tokens = np.random.default_rng(5).integers(0, 300, size=(2, 11))
    ref = tunix_logits(model, tokens)
    adapter, merged = os.path.join(work, "adapter"), os.path.join(work, "merged")
    t0 = time.perf_counter()
    r = convert_orbax_to_peft(root, adapter, base=base, progress=False)
    t1 = time.perf_counter()
    merge_lora(base, root, merged, progress=False)
    t2 = time.perf_counter()
    return {
        "modules": r["modules"],
        "adapter_bytes": r["bytes"],
        "orbax_to_peft_s": round(t1 - t0, 2),
        "merge_s": round(t2 - t1, 2),
        "peft_rel_l2": rel_l2(peft_logits(base, adapter, tokens), ref),
        "merged_rel_l2": rel_l2(hf_logits(merged, tokens), ref),
    }


def render(report: dict) -> str:
    p = report["parity"]
    lines = [
        "# ckptbridge report",
        "",
        f"Model: tiny random Gemma 4, {report['model']['num_hidden_layers']} layers (5 sliding : 1 global, "
        "k_eq_v global layers), all dims distinct.",
        "",
        "## Round trip HF -> Orbax -> HF",
        "",
        "| dtype | tensors | bytes | bit-identical | safetensors->orbax (s) | orbax->safetensors (s) |",
        "|---|---|---|---|---|---|",
    ]
    for dtype, c in report["conversions"].items():
        lines.append(f"| {dtype} | {c['tensors']} | {c['bytes']:,} | {'yes' if c['identical'] else 'NO'} | "
                     f"{c['safetensors_to_orbax_s']:.2f} | {c['orbax_to_safetensors_s']:.2f} |")
    lines += [
        "",
        "## Logits parity (float32, transformers vs Tunix loaded from the Orbax checkpoint)",
        "",
        f"- tokens: {p['tokens'][0]} x {p['tokens'][1]} (sliding window {p['sliding_window']})",
        f"- relative L2: {p['rel_l2']:.3e} (bound 1e-5)",
        f"- max |diff|: {p['max_abs_diff']:.3e}",
        f"- argmax agreement: {p['argmax_agreement']:.4f}",
        "",
        "## LoRA (Tunix + qwix -> PEFT adapter and merged model, float32 logits vs the Tunix LoRA model)",
        "",
        f"- {report['lora']['modules']} modules, adapter {report['lora']['adapter_bytes']:,} bytes; "
        f"orbax-to-peft {report['lora']['orbax_to_peft_s']:.2f} s, merge {report['lora']['merge_s']:.2f} s",
        f"- transformers + PEFT adapter: relative L2 {report['lora']['peft_rel_l2']:.3e} (bound 1e-5)",
        f"- merged model: relative L2 {report['lora']['merged_rel_l2']:.3e} (bound 1e-5)",
        "",
        f"Result: {'PASS' if report['ok'] else 'FAIL'}",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="run.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out", help="output directory (default: out)")
    parser.add_argument("--layers", type=int, default=12, help="decoder layers of the tiny model (default 12)")
    args = parser.parse_args(argv)
    _quiet_libraries()
    t0 = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    report = run(args.out, args.layers)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    md = render(report)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(md)
    print()
    print(md)
    print(f"wrote {os.path.join(args.out, 'report.md')} and report.json in {report['seconds']} s")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
