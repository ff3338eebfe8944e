"""`python -m serving bench` side by side with vLLM's own `vllm bench serve`, on the same server.

Starts the cpu profile on a tiny random Gemma 4 (or uses --url/--model of a running server), then
for each (shape, QPS) runs both clients with the same number of prompts, Poisson arrivals,
random prompts of the same token lengths and ignore_eos, alternating, ``--repeats`` times each,
and prints the median over runs of output throughput and median TTFT/TPOT, and their ratios.

    .venv/bin/python benchmarks/bench_vs_vllm.py [--qps 2,8] [--shapes 64x32,256x64] [--num-prompts 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VLLM_BENCH = """
import argparse, sys
from vllm.benchmarks import serve
p = argparse.ArgumentParser()
serve.add_cli_args(p)
serve.main(p.parse_args(sys.argv[1:]))
"""

FIELDS = ("output_tok_s", "median_ttft_ms", "median_tpot_ms", "failed")


def vllm_bench(url: str, model: str, tokenizer: str, in_len: int, out_len: int, qps: float, n: int, seed: int,
               tmp: str) -> dict:
    from serving.profiles import SERVE_PYTHON

    result_dir = tempfile.mkdtemp(dir=tmp)
    argv = [SERVE_PYTHON, "-c", VLLM_BENCH, "--backend", "vllm", "--base-url", url, "--model", model,
            "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", str(in_len),
            "--random-output-len", str(out_len), "--num-prompts", str(n), "--request-rate", str(qps), "--ignore-eos",
            "--seed", str(seed), "--save-result", "--result-dir", result_dir]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    files = glob.glob(os.path.join(result_dir, "*.json"))
    if not files:
        raise SystemExit(f"vllm bench serve wrote no result:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    with open(files[0]) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running server (default: start the cpu profile on a tiny model)")
    ap.add_argument("--model", help="served name (with --url)")
    ap.add_argument("--tokenizer", help="tokenizer directory for vLLM's client (with --url)")
    ap.add_argument("--qps", default="2,8")
    ap.add_argument("--shapes", default="64x32,256x64")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each client per point (median reported)")
    ap.add_argument("--out", help="write results JSON here")
    args = ap.parse_args()

    from serving import bench
    from serving.profiles import PROFILES, build_command
    from serving.server import LocalServer, free_port

    tmp = tempfile.mkdtemp(prefix="bench-vs-vllm-")
    server = None
    if args.url:
        url, model, tokenizer = args.url.rstrip("/"), args.model, args.tokenizer
    else:
        from ckptbridge.specs.gemma4 import VLLM_DIMS
        from ckptbridge.testing import build_checkpoint

        tokenizer = build_checkpoint(os.path.join(tmp, "tiny-gemma4"), prefix="model.", **VLLM_DIMS)
        cmd = build_command(PROFILES["cpu"], tokenizer, port=free_port(), dtype="float32")
        server = LocalServer(cmd, os.path.join(tmp, "server.log")).__enter__()
        url, model = server.url, cmd.served_name
    rows = []
    try:
        for in_len, out_len in bench.parse_shapes(args.shapes):
            for qps in bench.parse_qps(args.qps):
                runs = {"ours": [], "vllm": []}
                for rep in range(args.repeats):  # alternate the two clients: the machine's drift hits both
                    for tool in (("ours", "vllm") if rep % 2 == 0 else ("vllm", "ours")):
                        if tool == "ours":
                            p = bench.run_sweep(url, model, qps=[qps], shapes=[(in_len, out_len)],
                                                num_prompts=args.num_prompts, seed=args.seed + rep,
                                                progress=None)["points"][0]
                            runs["ours"].append({k: p[k] for k in FIELDS})
                        else:
                            t = vllm_bench(url, model, tokenizer, in_len, out_len, qps, args.num_prompts,
                                           args.seed + rep, tmp)
                            runs["vllm"].append({"output_tok_s": t["output_throughput"],
                                                 "median_ttft_ms": t["median_ttft_ms"],
                                                 "median_tpot_ms": t["median_tpot_ms"], "failed": t["failed"]})
                row = {"shape": f"{in_len}x{out_len}", "qps": qps, "runs": runs,
                       **{tool: {k: float(np.median([r[k] for r in rs])) for k in FIELDS} for tool, rs in runs.items()}}
                row["ratio"] = {k: row["ours"][k] / row["vllm"][k] for k in ("output_tok_s", "median_ttft_ms",
                                                                              "median_tpot_ms") if row["vllm"][k]}
                rows.append(row)
                print(f"{row['shape']:>8} qps {qps:>4g}: out tok/s {row['ours']['output_tok_s']:7.1f} vs "
                      f"{row['vllm']['output_tok_s']:7.1f} ({row['ratio']['output_tok_s']:.3f}x), TTFT p50 "
                      f"{row['ours']['median_ttft_ms']:6.1f} vs {row['vllm']['median_ttft_ms']:6.1f} ms "
                      f"({row['ratio']['median_ttft_ms']:.3f}x), TPOT p50 {row['ours']['median_tpot_ms']:5.1f} vs "
                      f"{row['vllm']['median_tpot_ms']:5.1f} ms", flush=True)
    finally:
        if server is not None:
            server.stop()
    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"num_prompts": args.num_prompts, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
