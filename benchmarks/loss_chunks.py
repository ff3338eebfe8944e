"""Peak memory and time of the training loss with the output head in sequence chunks (``loss_chunk``)
against the plain form (the forward's full float32 logits), at Gemma's real vocabulary.

A tiny Gemma 4 (hidden 40, the given vocabulary) with LoRA on every target; one micro-batch of
``--seq`` tokens; the loss and its LoRA gradients under ``jit``, each setting in a fresh process.
Prints XLA's temporary-buffer size of the compiled program, the process's peak RSS after one run,
and the time of a run (after the compiling one).

    .venv/bin/python benchmarks/loss_chunks.py [--vocab 262144] [--seq 3072] [--chunks 0 512 128]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RUN = r"""
import json, resource, sys, time
import numpy as np, jax, jax.numpy as jnp
from flax import nnx
from ckptbridge.specs import get_family
from ckptbridge.tunix_model import apply_lora_rules, keep_hidden_states, load_tunix_model
from training.loss import lm_loss
base, seq, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model, _ = load_tunix_model(base, param_dtype=np.float32)
targets = get_family("gemma4").lora_targets
model = keep_hidden_states(apply_lora_rules(model, [{"module_path": ".*(%s)" % "|".join(targets), "rank": 8,
                                                     "alpha": 16.0}]))
vocab = model.embedder.input_embedding.shape[0]
rng = np.random.default_rng(0)
batch = {"tokens": rng.integers(3, vocab, (1, seq)), "segment_ids": np.ones((1, seq)),
         "positions": np.arange(seq)[None], "loss_mask": np.ones((1, seq))}
batch = {k: jnp.asarray(v, jnp.int32) for k, v in batch.items()}
graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
fn = jax.jit(jax.value_and_grad(lambda lora, rest, b: lm_loss(nnx.merge(graphdef, lora, rest), b, chunk)[0]))
compiled = fn.lower(lora, rest, batch).compile()
temp = compiled.memory_analysis().temp_size_in_bytes
jax.block_until_ready(compiled(lora, rest, batch))
t = time.perf_counter()
loss, grads = compiled(lora, rest, batch)
jax.block_until_ready(grads)
seconds = time.perf_counter() - t
print(json.dumps({"chunk": chunk, "loss": float(loss), "temp_bytes": int(temp), "seconds": seconds,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=262_144)
    ap.add_argument("--seq", type=int, default=3072)
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 512, 128], help="loss_chunk values (0: plain)")
    ap.add_argument("--out", help="append the results as one JSON line to this file")
    a = ap.parse_args(argv)

    from ckptbridge.testing import build_checkpoint

    with tempfile.TemporaryDirectory(prefix="loss-chunks-") as work:
        base = build_checkpoint(os.path.join(work, "base"), family="gemma4", model_type="gemma4_text",
                                dtype="float32", seed=0, vocab_size=a.vocab, tokenizer=False)
        logits = a.seq * a.vocab * 4
        print(f"tiny Gemma 4, vocab {a.vocab}, one sequence of {a.seq}: full float32 logits {logits / 2**30:.2f} GiB")
        print("| loss_chunk | XLA temporary buffers | peak RSS | seconds per loss + gradients | loss |")
        print("|---|---|---|---|---|")
        rows = []
        for chunk in a.chunks:
            p = subprocess.run([sys.executable, "-c", RUN, base, str(a.seq), str(chunk)], capture_output=True,
                               text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
            if p.returncode != 0:
                raise SystemExit(f"loss_chunk={chunk} failed:\n{p.stderr[-3000:]}")
            r = json.loads(p.stdout.strip().splitlines()[-1])
            rows.append(r)
            print(f"| {chunk or 'plain'} | {r['temp_bytes'] / 2**30:.2f} GiB | {r['peak_rss_bytes'] / 2**30:.2f} GiB | "
                  f"{r['seconds']:.2f} | {r['loss']:.6f} |", flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps({"vocab": a.vocab, "seq": a.seq, "results": rows}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
