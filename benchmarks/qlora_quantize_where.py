"""Where to quantize a QLoRA base as it loads: on the host's cores, or on the chip.

For the weights of one Gemma 4 31B decoder layer (random bf16, HF's shapes), each way quantizes
every weight with qwix (absmax, one scale per output channel) and leaves its quantized values and
scales on the accelerator:

- host: ``qwix.quantize`` on the CPU backend, one weight per thread on ``--workers`` threads
  (the loader's way), then the quantized arrays to the chip;
- chip: the bf16 weight to the chip, then ``qwix.quantize`` compiled for the chip.

Prints the bf16 bytes per second of each way (median of ``--runs``, after a run that compiles)
and how many quantized values and scales of the two differ. Needs qwix (and flax) beside JAX;
run it on the TPU machine.

    python benchmarks/qlora_quantize_where.py [--schemes int8 int4] [--runs 3] [--workers N] [--out FILE]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import time

import numpy as np

# one sliding decoder layer of Gemma 4 31B, HF's (out, in): q, k, v, o, gate, up, down
LAYER = [(8192, 5376), (4096, 5376), (4096, 5376), (5376, 8192), (21504, 5376), (21504, 5376), (5376, 21504)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemes", nargs="+", default=["int8", "int4"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--out", help="append the results to this JSON file")
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    import qwix

    chip = jax.devices()[0]
    cpu = jax.local_devices(backend="cpu")[0]
    rng = np.random.default_rng(0)
    weights = [(rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16) for shape in LAYER]
    nbytes = sum(w.nbytes for w in weights)
    rows = []
    for scheme in args.schemes:
        quantize = jax.jit(lambda x, s=scheme: qwix.quantize(x, s, channelwise_axes=[0]))

        def on_host(w, quantize=quantize):
            with jax.default_device(cpu):
                q = quantize(jax.device_put(w, cpu))
            return jax.device_put(q, chip)

        def host():
            with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
                out = list(pool.map(on_host, weights))
            jax.block_until_ready(out)
            return out

        def on_chip(quantize=quantize):
            out = [quantize(jax.device_put(w, chip)) for w in weights]
            jax.block_until_ready(out)
            return out

        seconds: dict[str, list[float]] = {"host": [], "chip": []}
        results = {}
        for i in range(args.runs + 1):  # the first run compiles
            for name, way in (("host", host), ("chip", on_chip)):
                t = time.perf_counter()
                results[name] = way()
                if i:
                    seconds[name].append(time.perf_counter() - t)
        pairs = [(np.asarray(a.qvalue.astype(jnp.int8)), np.asarray(b.qvalue.astype(jnp.int8)),
                  np.asarray(a.scale), np.asarray(b.scale)) for a, b in zip(results["host"], results["chip"])]
        values = sum(qa.size for qa, *_ in pairs)
        scales = sum(sa.size for *_, sa, _ in pairs)
        differ_q = sum(int(np.sum(qa != qb)) for qa, qb, _, _ in pairs)
        differ_s = sum(int(np.sum(sa != sb)) for _, _, sa, sb in pairs)
        same = differ_q == 0 and differ_s == 0
        row = {"scheme": scheme, "bf16_bytes": nbytes, "same_values": same, "values_that_differ": differ_q,
               "values": values, "scales_that_differ": differ_s, "scales": scales,
               **{f"{k}_seconds": statistics.median(v) for k, v in seconds.items()},
               **{f"{k}_gb_per_s": nbytes / statistics.median(v) / 1e9 for k, v in seconds.items()}}
        rows.append(row)
        print(f"{scheme}: host ({args.workers} threads) {row['host_gb_per_s']:.2f} GB/s, chip "
              f"{row['chip_gb_per_s']:.2f} GB/s of bf16; values that differ {differ_q} of {values}, "
              f"scales {differ_s} of {scales}", flush=True)
    record = {"device": chip.device_kind, "cores": os.cpu_count(), "workers": args.workers, "jax": jax.__version__,
              "layer_shapes": LAYER, "rows": rows}
    print(json.dumps(record))
    if args.out:
        from results_file import append_run

        append_run(args.out, record)


if __name__ == "__main__":
    main()
