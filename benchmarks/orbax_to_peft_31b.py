"""orbax-to-peft on a full-size Gemma 4 31B rank-64 LoRA checkpoint, side by side with the naive way
and with the copy limit, in one run.

Writes a 31B config (no weights: orbax-to-peft reads only the base's config) and a LoRA checkpoint
in the on-disk layout of Tunix's CheckpointManager (``<root>/<step>/model_params``, leaves
``.../w_lora_a/value``): bf16 random factors of the real shapes on all 60 layers and all seven
targets incl. the global layers' ``k_einsum``. Then, each in a fresh process with its peak RSS:

* ours: ``ckptbridge convert orbax-to-peft ROOT DST --base BASE``;
* naive: restore the whole tree with Orbax (``StandardCheckpointer``), then write one
  safetensors file of it (``safetensors.numpy.save_file``), no layout change;
* ``cp -r`` of the checkpoint, ``cp -r`` + ``sync`` (ours fsyncs what it writes), and reading it
  once (``cat > /dev/null``) after dropping nothing (the page cache is warm for every contender
  alike).

The contenders alternate ``--repeat`` times, each after ``sync``; medians are shown. Peak RSS is
each process's high-water mark (VmHWM).

    .venv/bin/python benchmarks/orbax_to_peft_31b.py [--rank 64] [--repeat 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from merge_31b import timed_shell  # noqa: E402

GEMMA4_31B = dict(vocab_size=262144, hidden_size=5376, intermediate_size=21504, num_hidden_layers=60,
                  num_attention_heads=32, num_key_value_heads=16, head_dim=256, global_head_dim=512,
                  num_global_key_value_heads=4, sliding_window=1024)

RUN = r"""
import json, sys, time
t = time.perf_counter()
what = sys.argv[1]
if what == "ours":
    from ckptbridge.cli import main
    code = main(["convert", "orbax-to-peft", sys.argv[2], sys.argv[3], "--base", sys.argv[4], "--quiet"])
    assert code == 0
elif what == "naive":
    import numpy as np
    import orbax.checkpoint as ocp
    from safetensors.numpy import save_file
    tree = ocp.StandardCheckpointer().restore(sys.argv[2])
    flat = {}
    def walk(node, path):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, path + [str(k)])
        else:
            flat[".".join(path)] = np.asarray(node)
    walk(tree, [])
    save_file(flat, sys.argv[3])
elif what == "imports":  # what the naive way imports before it reads a byte
    import orbax.checkpoint, jax  # noqa
elif what == "imports-ours":  # what ours imports before it reads a byte
    import tensorstore  # noqa
    from ckptbridge import cli, conversion  # noqa
    from ckptbridge.formats import peft, tunix_lora  # noqa
# peak RSS of this program: VmHWM (ru_maxrss would include the parent's peak at fork)
with open("/proc/self/status") as f:
    hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
print(json.dumps({"seconds": time.perf_counter() - t, "peak_rss_mb": hwm / 1024}))
"""


def measure(*args: str) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", RUN, *args], check=True, capture_output=True, text=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["wall_s"] = time.perf_counter() - t0  # including the interpreter and its imports
    return r


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--alpha", type=float, default=64.0)
    ap.add_argument("--repeat", type=int, default=5, help="alternating runs of each contender (medians shown)")
    ap.add_argument("--out", help="write results JSON here")
    ap.add_argument("--keep", help="keep the generated files in this directory")
    args = ap.parse_args()

    import numpy as np

    from ckptbridge.io import orbax as orbax_io
    from ckptbridge.io.safetensors import DTYPES
    from ckptbridge.metadata import KEY, LoraRules, Metadata
    from ckptbridge.lora.base import open_base
    from ckptbridge.specs.gemma4 import text_config_kwargs

    tmp = args.keep or tempfile.mkdtemp(prefix="o2p-31b-")
    os.makedirs(tmp, exist_ok=True)
    base = os.path.join(tmp, "gemma-4-31b-config")
    os.makedirs(base, exist_ok=True)
    with open(os.path.join(base, "config.json"), "w") as f:
        json.dump({"model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"], "dtype": "bfloat16",
                   **text_config_kwargs(True, **GEMMA4_31B)}, f, indent=2)
    b = open_base(base)
    bf16 = DTYPES["BF16"]
    flat = {}
    for i, mod in enumerate(b.modules):
        shapes = mod.shapes(args.rank)
        for leaf, shape in zip(mod.leaves, (shapes["a_tunix"], shapes["b_tunix"])):
            def produce(shape=shape, s=i * 2 + len(flat)):
                return (np.random.default_rng(s).standard_normal(shape, dtype=np.float32) * 0.01).astype(bf16)

            flat[leaf + ("value",)] = orbax_io.LazyArray(shape, bf16, produce)
    rules = [{"module_path": ".*(q_einsum|kv_einsum|k_einsum|attn_vec_einsum|gate_proj|up_proj|down_proj)",
              "rank": args.rank, "alpha": args.alpha}]
    root = os.path.join(tmp, "lora-ckpt")
    t = time.perf_counter()
    meta = Metadata(kind="lora", family=b.spec.name, lora=LoraRules(rules))
    item = orbax_io.save_manager_step(root, 100, orbax_io.nest(flat), {KEY: meta.to_json()})
    gen_s = time.perf_counter() - t
    params = sum(v.size for v in flat.values())
    size = dir_bytes(root)
    print(f"generated {len(b.modules)} LoRA modules, {params / 1e6:.0f} M parameters, {size / 2**30:.2f} GiB on disk "
          f"in {gen_s:.0f} s", flush=True)

    results = {"rank": args.rank, "modules": len(b.modules), "params": params, "checkpoint_bytes": size}
    subprocess.run(f"find {root} -type f -exec cat {{}} + > /dev/null", shell=True, check=True)
    results["read_once_s"] = timed_shell(f"find {root} -type f -exec cat {{}} + > /dev/null")
    runs: dict[str, list] = {"cp_s": [], "cp_sync_s": [], "imports": [], "imports_ours": [], "ours": [], "naive": []}
    adapter, naive = os.path.join(tmp, "adapter"), os.path.join(tmp, "naive.safetensors")
    for n in range(args.repeat):  # alternating, so that each contender meets the disk in every state
        runs["cp_s"].append(timed_shell(f"cp -r {root} {root}.cp"))
        shutil.rmtree(root + ".cp")
        runs["cp_sync_s"].append(timed_shell(f"cp -r {root} {root}.cp && sync"))
        shutil.rmtree(root + ".cp")
        runs["imports"].append(measure("imports"))
        runs["imports_ours"].append(measure("imports-ours"))
        runs["ours"].append(measure("ours", root, adapter, base))
        results["adapter_bytes"] = dir_bytes(adapter)
        shutil.rmtree(adapter)
        runs["naive"].append(measure("naive", item, naive))
        os.remove(naive)
        print(f"  run {n + 1}: cp {runs['cp_s'][-1]:.2f} s, cp + sync {runs['cp_sync_s'][-1]:.2f} s, ours "
              f"{runs['ours'][-1]['wall_s']:.2f} s, naive {runs['naive'][-1]['wall_s']:.2f} s", flush=True)
    results["runs"] = runs
    for key, values in runs.items():
        results[key] = (statistics.median(values) if not isinstance(values[0], dict)
                        else {k: statistics.median(v[k] for v in values) for k in values[0]})
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)

    o, n = results["ours"], results["naive"]
    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"{'':>22} {'wall s':>8} {'in-process s':>13} {'peak RSS MB':>12}")
    print(f"{'cp -r':>22} {results['cp_s']:>8.2f}")
    print(f"{'cp -r + sync':>22} {results['cp_sync_s']:>8.2f}")
    print(f"{'read once':>22} {results['read_once_s']:>8.2f}")
    for key, label in (("imports", "python + jax/orbax"), ("imports_ours", "python + ours")):
        print(f"{label:>22} {results[key]['wall_s']:>8.2f} {'':>13} {results[key]['peak_rss_mb']:>12.0f}")
    print(f"{'ckptbridge orbax-to-peft':>22} {o['wall_s']:>8.2f} {o['seconds']:>13.2f} {o['peak_rss_mb']:>12.0f}")
    print(f"{'naive restore + save':>22} {n['wall_s']:>8.2f} {n['seconds']:>13.2f} {n['peak_rss_mb']:>12.0f}")
    print(f"ours / naive wall: {o['wall_s'] / n['wall_s']:.2f}x (target <= 0.8x); ours / cp: "
          f"{o['wall_s'] / results['cp_s']:.1f}x (target <= 5x), ours / cp + sync {o['wall_s'] / results['cp_sync_s']:.1f}x; "
          f"peak RSS {o['peak_rss_mb']:.0f} MB (target <= 1024)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
