"""What one decoder layer of Gemma 4 31B costs a TPU chip under each base quantization (QLoRA).

Compiles the training step of the ``gemma4-31b-v6e1-qlora`` recipe (3072 tokens, rank 64 on every
projection, remat=decoder) for a Gemma 4 of 31B's width with 2 and with 3 decoder layers, ahead of
time for one v6e chip (libtpu's compiler, no TPU needed: ``pip install libtpu``), each in a fresh
process, under ``base_quant=none`` (bf16), ``int8``, ``int4`` and ``nf4``, and prints XLA's memory
analysis of the gradient program: arguments (the weights as the chip holds them, 4-bit values
packed two to a byte, their scales, the LoRA factors and their gradient sums), temporaries and
outputs, and what the third layer adds to each. Results go to ``--out`` as a numbered run.

    PYTHONPATH=LIBTPU_DIR .venv/bin/python benchmarks/qlora_memory.py [--schemes none int8 int4 nf4]
        [--topology v6e:1x1] [--out benchmarks/results/qlora_memory_v6e.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

COMPILE = r"""
import json, sys, time
import numpy as np
from jax.sharding import Mesh
from ckptbridge import testing
from ckptbridge.specs import get_family
from training import step
from training.config import build_config
from training.mesh import topology_devices
layers, width, topology, overrides = int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3], sys.argv[4:]
types = ["full_attention" if (i + 1) % 6 == 0 or i == layers - 1 else "sliding_attention" for i in range(layers)]
spec = get_family("gemma4")
model_cfg = spec.parse_config(testing.hf_config("gemma4", prefix="model.", num_hidden_layers=layers, layer_types=types,
                                                **width), "config.json")
cfg = build_config("gemma4-31b-v6e1-qlora", None, overrides)
mesh = Mesh(np.asarray(topology_devices(topology)).reshape(1, 1), ("fsdp", "tp"))
t = time.perf_counter()
programs, plan = step.analyze(model_cfg, cfg, mesh, cfg.lora_rules(spec.lora_targets))
print(json.dumps({"compile_seconds": round(time.perf_counter() - t, 1), "weights": plan.weights_bytes(),
                  **programs.memory["train_grad_step"]}))
"""

KEYS = ("argument", "temp", "output")


def measure(layers: int, scheme: str, topology: str) -> dict:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from merge_31b import GEMMA4_31B

    width = {k: v for k, v in GEMMA4_31B.items() if k != "num_hidden_layers"}
    proc = subprocess.run([sys.executable, "-c", COMPILE, str(layers), json.dumps(width), topology,
                           f"base_quant={scheme}"], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if proc.returncode != 0:
        raise SystemExit(f"{scheme}, {layers} layers:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemes", nargs="+", default=["none", "int8", "int4", "nf4"])
    ap.add_argument("--topology", default="v6e:1x1")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "qlora_memory_v6e.json"))
    args = ap.parse_args()
    rows = []
    for scheme in args.schemes:
        two, three = measure(2, scheme, args.topology), measure(3, scheme, args.topology)
        layer = {k: three[k] - two[k] for k in KEYS}
        rows.append({"base_quant": scheme, "two_layers": two, "three_layers": three, "layer_adds": layer,
                     "layer_bytes": sum(layer.values())})
        print(f"{scheme}: a layer adds {sum(layer.values()) / 1e9:.3f} GB (arguments {layer['argument'] / 1e9:.3f}, "
              f"temporaries {layer['temp'] / 1e9:+.3f}, outputs {layer['output'] / 1e9:.3f})", flush=True)
    plain = next((r["layer_bytes"] for r in rows if r["base_quant"] == "none"), None)
    for r in rows:
        r["vs_bf16"] = None if plain is None else round(r["layer_bytes"] / plain, 3)
    import jax
    from results_file import append_run

    append_run(args.out, {"topology": args.topology, "jax": jax.__version__, "libtpu": _version("libtpu"),
                          "preset": "gemma4-31b-v6e1-qlora", "tokens": 3072, "rank": 64, "remat": "decoder",
                          "rows": rows})
    print(f"wrote {args.out}")


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
