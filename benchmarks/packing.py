"""Training data efficiency: real-token fraction and tokens/s with and without sequence packing.

Generates a CodeV-like length mix (log-normal, mean ~920 tokens, long tail to ~3000, rows over
3072 dropped as in the paper; no dataset is shipped), runs it through the training pipeline with
packing on and off, and reports the fraction of real (non-pad) tokens. Then times LoRA training
steps (forward + backward + AdamW) of the tiny CPU model on the same batches and reports real
tokens per second for both, measured in the same run.

    .venv/bin/python benchmarks/packing.py [--rows 400] [--steps 6] [--seq-len 3072] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np


def codev_like_lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(mean=np.log(800), sigma=0.55, size=n)
    return np.clip(lengths, 64, 3200).astype(int)


def examples(lengths: np.ndarray, vocab: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        tokens = rng.integers(3, vocab, size=n).astype(np.int32)
        mask = np.zeros(n, np.int32)
        mask[n // 3:] = 1  # prompt then answer
        out.append({"tokens": tokens, "loss_mask": mask})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--steps", type=int, default=6, help="timed micro-batches per mode")
    ap.add_argument("--seq-len", type=int, default=3072)
    ap.add_argument("--out", help="write results JSON here")
    args = ap.parse_args()

    from training import data as data_lib
    from training.config import TrainConfig

    lengths = codev_like_lengths(args.rows)
    kept = lengths[lengths <= args.seq_len]
    exs = examples(kept, vocab=300)
    results = {"rows": int(args.rows), "kept": int(len(kept)), "mean_length": float(kept.mean()),
               "p99_length": float(np.percentile(kept, 99)), "max_length": int(kept.max()), "seq_len": args.seq_len}
    batches = {}
    for packing in (True, False):
        b = list(data_lib.pipeline(exs, seq_len=args.seq_len, batch=1, packing=packing, seed=0,
                                   num_packing_bins=TrainConfig().num_packing_bins))
        real = sum(int((x["segment_ids"] > 0).sum()) for x in b)
        results[f"{'packed' if packing else 'unpacked'}_batches"] = len(b)
        results[f"{'packed' if packing else 'unpacked'}_real_fraction"] = real / (len(b) * args.seq_len)
        batches[packing] = b

    # time training steps of the tiny model on both kinds of batches
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from ckptbridge.testing import lora_targets, build_checkpoint
    from ckptbridge.tunix_model import apply_lora_rules, load_tunix_model
    from training.loss import lm_loss

    with tempfile.TemporaryDirectory() as tmp:
        base = build_checkpoint(os.path.join(tmp, "base"), tokenizer=False)
        model, _ = load_tunix_model(base, param_dtype=np.float32)
    model = apply_lora_rules(model, [{"module_path": lora_targets(), "rank": 8, "alpha": 16.0}])
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.LoRAParam)

    @nnx.jit
    def step(model, optimizer, batch):
        grad_fn = nnx.value_and_grad(lm_loss, argnums=nnx.DiffState(0, nnx.LoRAParam), has_aux=True)
        (loss, _), grads = grad_fn(model, batch)
        optimizer.update(model, grads)
        return loss

    for packing in (True, False):
        name = "packed" if packing else "unpacked"
        todo = batches[packing][: args.steps + 1]
        as_jax = [{k: jnp.asarray(v, jnp.int32) for k, v in x.items()} for x in todo]
        step(model, optimizer, as_jax[0]).block_until_ready()  # compile
        t0 = time.perf_counter()
        for x in as_jax[1:]:
            step(model, optimizer, x).block_until_ready()
        dt = time.perf_counter() - t0
        real = sum(int((x["segment_ids"] > 0).sum()) for x in todo[1:])
        step_s = dt / (len(todo) - 1)
        results[f"{name}_seconds_per_step"] = step_s
        results[f"{name}_tokens_per_s"] = real / dt
        # every step has the same shape, so its time does not depend on the rows in it: the whole
        # epoch takes batches x step time, for the same real tokens in both modes
        epoch_real = sum(int((x["segment_ids"] > 0).sum()) for x in batches[packing])
        results[f"{name}_epoch_tokens_per_s"] = epoch_real / (len(batches[packing]) * step_s)
    results["tokens_per_s_ratio"] = results["packed_tokens_per_s"] / results["unpacked_tokens_per_s"]
    results["epoch_tokens_per_s_ratio"] = results["packed_epoch_tokens_per_s"] / results["unpacked_epoch_tokens_per_s"]

    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"rows {results['rows']} (kept {results['kept']} <= {args.seq_len} tokens), mean length "
          f"{results['mean_length']:.0f}, p99 {results['p99_length']:.0f}, max {results['max_length']}")
    print(f"{'mode':>9} {'batches':>8} {'real-token fraction':>20} {'real tokens/s':>14}")
    for name in ("packed", "unpacked"):
        print(f"{name:>9} {results[name + '_batches']:>8} {results[name + '_real_fraction']:>20.3f} "
              f"{results[name + '_tokens_per_s']:>14.0f}")
    print(f"seconds per step: packed {results['packed_seconds_per_step']:.2f}, unpacked "
          f"{results['unpacked_seconds_per_step']:.2f}")
    print(f"packed / unpacked real tokens per second over the epoch: {results['epoch_tokens_per_s_ratio']:.2f}x "
          f"({results['packed_batches']} vs {results['unpacked_batches']} steps of the same shape)")
    print(f"packed / unpacked real tokens per second on the {args.steps} timed steps only: "
          f"{results['tokens_per_s_ratio']:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
