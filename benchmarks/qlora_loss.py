"""Training loss of LoRA on the base as it is against QLoRA (the base held in int8, int4, nf4 by
qwix), with the tiny-cpu preset on the bundled CodeV-format sample, the same tiny random Gemma 4,
seed and data order in every run. Writes one plot of the curves and the results (every step's
loss, the final loss, the run's wall time) as a numbered run of ``--out``.

    .venv/bin/python benchmarks/qlora_loss.py [--schemes none int8 int4 nf4] [--epochs 3] [--set KEY=VALUE ...]
        [--out benchmarks/results/qlora_loss_tiny.json] [--plot docs/img/qlora_loss.png]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(ROOT, "training", "data_files", "codev_sample.jsonl")


def train(base: str, out: str, scheme: str, epochs: int, settings: list[str]) -> dict:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "training", "--preset", "tiny-cpu", "--quiet", "--base", base,
                           "--data", SAMPLE, "--out", out, f"epochs={epochs}", f"base_quant={scheme}", *settings],
                          capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"training with base_quant={scheme} failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    losses = [r["loss"] for r in rows if "loss" in r]
    return {"base_quant": scheme, "steps": len(losses), "losses": [round(x, 5) for x in losses],
            "final_loss": round(losses[-1], 5), "wall_seconds": round(time.perf_counter() - t, 1)}


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for r in rows:
        label = "LoRA (base as it is)" if r["base_quant"] == "none" else f"QLoRA, base in {r['base_quant']}"
        ax.plot(range(1, r["steps"] + 1), r["losses"], label=f"{label}: final {r['final_loss']:.3f}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title("tiny-cpu preset, bundled CodeV sample, tiny Gemma 4")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemes", nargs="+", default=["none", "int8", "int4", "nf4"])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--set", nargs="*", default=["max_length=512", "grad_accum=1"], metavar="KEY=VALUE",
                    help="training settings beside the preset's (default: max_length=512 grad_accum=1, for a curve "
                         "of many steps on the small sample)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "qlora_loss_tiny.json"))
    ap.add_argument("--plot", default=os.path.join(ROOT, "docs", "img", "qlora_loss.png"))
    args = ap.parse_args()
    from ckptbridge.testing import build_checkpoint

    with tempfile.TemporaryDirectory(prefix="qlora-loss-") as tmp:
        base = build_checkpoint(os.path.join(tmp, "hf"), family="gemma4")
        rows = []
        for scheme in args.schemes:
            rows.append(train(base, os.path.join(tmp, scheme), scheme, args.epochs, args.set))
            print(f"{scheme}: {rows[-1]['steps']} steps, final loss {rows[-1]['final_loss']:.4f}, "
                  f"{rows[-1]['wall_seconds']:.0f} s", flush=True)
    plot(rows, args.plot)
    from results_file import append_run

    append_run(args.out, {"preset": "tiny-cpu", "epochs": args.epochs, "settings": args.set,
                          "data": os.path.relpath(SAMPLE, ROOT), "machine": f"{os.cpu_count()} cores, CPU",
                          "rows": rows})
    print(f"wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
