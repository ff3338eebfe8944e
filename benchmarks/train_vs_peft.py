"""LoRA training through ``python -m training`` (Tunix + qwix, JAX) against transformers + PEFT (PyTorch).

The same random model (family, width, layers), sequence length, LoRA rank, alpha, targets (every
LoRA target of the family), dropout, rematerialisation (``remat=decoder`` / gradient checkpointing)
and AdamW, one sequence per optimizer step. Each side runs in a fresh process; this script
prints, per side, the first step (with its compilation), the steady step time, tokens/s and peak
memory, and the ratio of the two throughputs.

Throughput is counted in sequence positions per second: both sides compute every position of a
``--seq``-long sequence per step (the training package packs rows into it; the real-token fraction
of its packing is printed beside). Peak memory: the device's peak bytes on a GPU or TPU (jax's
memory stats, torch.cuda.max_memory_allocated), the process's peak RSS on a CPU.

    .venv/bin/python benchmarks/train_vs_peft.py [--family gemma4] [--width tiny|small|31b] [--layers 6]
        [--seq 1024] [--rank 16] [--steps 8] [--remat decoder|none] [--dtype float32|bfloat16]
        [--out FILE]

On a CUDA machine (jax with CUDA and torch with CUDA installed) the same command runs both on the
GPU; ``--width 31b --layers 6 --seq 3072 --rank 64 --dtype bfloat16`` is the issue's setting.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from merge_31b import GEMMA4_31B  # noqa: E402

# text-config fields over the family's tiny config
WIDTHS = {"tiny": {}, "small": dict(vocab_size=32768, hidden_size=1024, intermediate_size=4096, num_attention_heads=8,
                                    num_key_value_heads=4, head_dim=128),
          "31b": GEMMA4_31B}

# the training package in this process: argv after "--", then peak RSS and device memory
TRAIN = r"""
import json, resource, runpy, sys
sys.argv = ["training", *sys.argv[1:]]
try:
    runpy.run_module("training", run_name="__main__")
except SystemExit as e:
    if e.code not in (0, None):
        raise
print(json.dumps({"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""

PEFT = r"""
import json, resource, sys, time
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
a = json.loads(sys.argv[1])
torch.manual_seed(0)
cuda = torch.cuda.is_available()
device = "cuda" if cuda else "cpu"
model = AutoModelForCausalLM.from_pretrained(a["base"], dtype=getattr(torch, a["dtype"]),
                                             attn_implementation="sdpa").to(device)
if a["remat"] != "none":
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
model = get_peft_model(model, LoraConfig(r=a["rank"], lora_alpha=a["alpha"], lora_dropout=a["dropout"],
                                         target_modules=a["targets"], task_type="CAUSAL_LM"))
model.train()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.001)
ids = torch.randint(3, a["vocab"], (1, a["seq"]), generator=torch.Generator().manual_seed(0)).to(device)
steps = []
for step in range(a["steps"]):
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    steps.append(time.perf_counter() - t0)
print(json.dumps({"step_seconds": steps, "loss": float(loss),
                  "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else None,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "device": torch.cuda.get_device_name() if cuda else "cpu"}))
"""


def peft_targets(spec) -> list[str]:
    """HF module names of the family's LoRA targets (the rules' HF keys, less ``.weight``)."""
    names = set()
    for r in spec.rules:
        if r.lora in spec.lora_targets:
            for key in r.hf:
                if "{" not in key:
                    names.add(key.rsplit(".", 2)[-2])
    return sorted(names)


def synthetic_rows(tokenizer, seq: int, rows: int, seed: int = 0) -> list[dict]:
    """Prompt/response rows of random words, each about a fifth of ``seq`` tokens once templated,
    so that packing fills the sequences almost completely."""
    from training import data as data_lib

    words = [w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 2][:2000] or ["alpha", "beta", "gamma"]
    rng = random.Random(seed)
    n = 16
    while True:  # words per row so that one row encodes to about seq / 5 tokens
        row = {"prompt": " ".join(rng.choices(words, k=n // 4)), "response": " ".join(rng.choices(words, k=n))}
        enc = data_lib.encode_rows(tokenizer, [row], 10 * seq)
        length = len(enc.examples[0]["tokens"]) if enc.examples else 0
        if length >= seq // 5 or n > 100_000:
            break
        n *= 2
    scale = max(1, n * (seq // 5) // max(1, length))
    return [{"prompt": " ".join(rng.choices(words, k=scale // 4)), "response": " ".join(rng.choices(words, k=scale))}
            for _ in range(rows)]


def run_training(a, base: str, data: str, out: str) -> dict:
    preset = "tiny-cpu" if a.dtype == "float32" else "gemma4-31b-v5p8"
    overrides = [f"rank={a.rank}", f"alpha={a.alpha}", f"dropout={a.dropout}", f"max_length={a.seq}",
                 "micro_batch=1", "grad_accum=1", "fsdp=1", "tp=1", f"remat={a.remat}", f"param_dtype={a.dtype}",
                 f"dtype={a.dtype}", "targets=", "warmup_steps=1", "learning_rate=1e-4", "weight_decay=0.001",
                 f"checkpoint_every={10 * a.steps}", "compile_cache=off", "xla_flags="]
    cmd = [sys.executable, "-c", TRAIN, "--preset", preset, "--base", base, "--data", data, "--out", out,
           "--max-steps", str(a.steps), "--quiet", *overrides]
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)  # the machine's JAX may live there
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": path})
    if p.returncode != 0:
        raise SystemExit(f"training failed:\n{p.stderr[-4000:]}")
    rss = json.loads(p.stdout.strip().splitlines()[-1])["peak_rss_bytes"]
    with open(os.path.join(out, "run.json")) as f:
        summary = json.load(f)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    if len(records) < 3:
        raise SystemExit(f"training ran {len(records)} steps; give it more rows or --steps (need 3+)")
    steady = [r for r in records[2:] if not r["compiles"]]
    return {
        "first_step_s": records[0]["seconds"], "compile_s": summary["compile_seconds"],
        "steady_step_s": float(np.median([r["seconds"] for r in steady])),
        "positions_per_s": float(np.median([a.seq / r["seconds"] for r in steady])),
        "real_tokens_per_s": summary["steady_tokens_per_s"], "real_token_fraction": summary["real_token_fraction"],
        "peak_bytes": summary["peak_memory_bytes"] or rss, "peak_kind": "device" if summary["peak_memory_bytes"]
        else "RSS", "mfu": summary["steady_mfu"], "device": f"{summary['chips']} x {summary['chip']}",
        "steps": len(records), "final_loss": records[-1]["loss"],
    }


def run_peft(a, base: str, targets: list[str], vocab: int) -> dict:
    args = dict(base=base, dtype=a.dtype, remat=a.remat, rank=a.rank, alpha=a.alpha, dropout=a.dropout,
                targets=targets, seq=a.seq, steps=a.steps, vocab=vocab)
    p = subprocess.run([sys.executable, "-c", PEFT, json.dumps(args)], capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"transformers + PEFT failed:\n{p.stderr[-4000:]}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    steady = r["step_seconds"][2:]
    return {"first_step_s": r["step_seconds"][0], "compile_s": None, "steady_step_s": float(np.median(steady)),
            "positions_per_s": float(np.median([a.seq / s for s in steady])), "real_tokens_per_s": None,
            "real_token_fraction": 1.0, "peak_bytes": r["peak_device_bytes"] or r["peak_rss_bytes"],
            "peak_kind": "device" if r["peak_device_bytes"] else "RSS", "mfu": None, "device": r["device"],
            "steps": len(r["step_seconds"]), "final_loss": r["loss"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="gemma4")
    ap.add_argument("--width", default="tiny", choices=sorted(WIDTHS), help="tiny: the family's tiny config; "
                    "small: hidden 1024, MLP 4096, 8 heads of 128, vocab 32768; 31b: Gemma 4 31B's real widths "
                    "(gemma4 only)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--seq", type=int, default=1024, help="sequence length (one sequence per step)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=None, help="default: the rank")
    ap.add_argument("--dropout", type=float, default=0.05)
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps per side (steady figures: from step 3)")
    ap.add_argument("--remat", default="decoder", choices=("decoder", "none"),
                    help="decoder: Tunix remat per decoder layer and transformers' gradient checkpointing")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--dir", help="where to build the model (default: a temporary directory)")
    ap.add_argument("--out", help="append the result as one JSON line to this file")
    a = ap.parse_args(argv)
    a.alpha = a.alpha if a.alpha is not None else float(a.rank)
    if a.steps < 4:
        ap.error("--steps must be at least 4 (the steady figures start at step 3)")
    if a.width == "31b" and a.family != "gemma4":
        ap.error("--width 31b is Gemma 4 31B's widths: use it with --family gemma4")

    from transformers import AutoTokenizer

    from ckptbridge.specs import get_family
    from ckptbridge.testing import build_checkpoint

    spec = get_family(a.family)
    work = tempfile.mkdtemp(prefix="train-vs-peft-", dir=a.dir)
    text_type = [t.name for t in spec.types if "text" in t.name or t.hf_class.endswith("ForCausalLM")]
    base = build_checkpoint(os.path.join(work, "base"), family=a.family, dtype=a.dtype, seed=0,
                            model_type=text_type[0] if text_type else None, num_hidden_layers=a.layers,
                            **WIDTHS[a.width])
    with open(os.path.join(base, "config.json")) as f:
        config = json.load(f)
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    tokenizer = AutoTokenizer.from_pretrained(base)
    data = os.path.join(work, "rows.jsonl")
    with open(data, "w") as f:
        for row in synthetic_rows(tokenizer, a.seq, rows=8 * (a.steps + 2)):
            f.write(json.dumps(row) + "\n")
    targets = peft_targets(spec)
    print(f"{a.family} {a.width} width, {a.layers} layers, vocab {vocab}; seq {a.seq}, rank {a.rank}, alpha "
          f"{a.alpha:g}, dropout {a.dropout}, remat {a.remat}, {a.dtype}; targets {', '.join(targets)}",
          file=sys.stderr)
    ours = run_training(a, base, data, os.path.join(work, "run"))
    theirs = run_peft(a, base, targets, vocab)
    result = {"setting": {k: v for k, v in vars(a).items() if k not in ("dir", "out")}, "vocab": vocab,
              "training": ours, "transformers_peft": theirs,
              "ratio": ours["positions_per_s"] / theirs["positions_per_s"]}
    print("| | first step (compile) | steady step | positions/s | peak memory | device |")
    print("|---|---|---|---|---|---|")
    for name, r in (("python -m training", ours), ("transformers + PEFT", theirs)):
        compile_s = f" ({r['compile_s']:.1f} s compiling)" if r["compile_s"] is not None else ""
        print(f"| {name} | {r['first_step_s']:.2f} s{compile_s} | {r['steady_step_s']:.3f} s | "
              f"{r['positions_per_s']:.0f} | {r['peak_bytes'] / 2**20:.0f} MiB {r['peak_kind']} | {r['device']} |")
    print(f"training / PEFT throughput: {result['ratio']:.2f}x; training's packing: real-token fraction "
          f"{ours['real_token_fraction']:.3f} ({ours['real_tokens_per_s']:.0f} real tokens/s)"
          + (f"; MFU {ours['mfu']:.1%}" if ours["mfu"] is not None else ""))
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
