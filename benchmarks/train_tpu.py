"""LoRA training at Gemma 4 31B's real width on the chip this runs on (a TPU: one v5e chip here), by
itself: no torch, no network, the machine's PYTHONPATH kept for every process it starts.

For each layer count: a random bfloat16 Gemma 4 text model at 31B's width (hidden 5376, vocab
262144, 5 sliding : 1 global layers, k_eq_v), written fast (its values repeat a pool of random
numbers), and a byte-level tokenizer; what the disk does with the same files (``cp -r`` + sync,
and a read); then ``python -m training --preset gemma4-31b-v5p8 tp=1 grad_accum=1`` (packed
sequences of ``--seq`` tokens, LoRA rank ``--rank`` on every projection), fresh for ``--steps``
steps and resumed for 2 more. Printed per run: launch -> first step, base load (seconds, GB/s),
compile seconds per program, steady step, tokens/s, MFU (the project's FLOP count, see
docs/benchmarks.md), peak device memory and XLA's memory analysis of the step. With ``--fit``:
the largest layer count whose step fits the device, from ``--dry-run`` (the step compiled from
the config alone; no weights), on the device here or for ``--topology`` (ahead of time).

    python benchmarks/train_tpu.py [--layers 2 8] [--remat decoder_dots] [--seq 3072] [--rank 64]
        [--steps 10] [--resume-steps 2] [--fit] [--fit-from 8] [--topology v5e:1x1] [--work DIR]
        [--out FILE] [--set key=value ...]

It needs the train extra only (``pip install -e '.[train]' 'jax[tpu]'``, or the same packages on
PYTHONPATH); ``--width tiny`` tries it out on any CPU in a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from merge_31b import GEMMA4_31B  # noqa: E402
from serving.watch import committed  # noqa: E402  (what `serving watch` counts as a committed checkpoint)

PRESET = "gemma4-31b-v5p8"
WIDTHS = {"31b": GEMMA4_31B, "tiny": {}}  # tiny: the family's tiny config (a try-out of this script on a CPU)
WRITE = r"""
import json, sys, time
from ckptbridge import testing
out, layers, width = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
types = ["full_attention" if (i + 1) % 6 == 0 or i == layers - 1 else "sliding_attention" for i in range(layers)]
t = time.perf_counter()
if len(sys.argv) > 4:  # the config alone
    import os
    os.makedirs(out, exist_ok=True)
    config = {**testing.hf_config("gemma4", prefix="model.", num_hidden_layers=layers, layer_types=types,
                                  max_position_embeddings=262144, **width), "dtype": "bfloat16"}
    json.dump(config, open(os.path.join(out, "config.json"), "w"), indent=2)
else:
    testing.write_random_checkpoint(out, family="gemma4", dtype="bfloat16", prefix="model.", num_hidden_layers=layers,
                                    layer_types=types, max_position_embeddings=262144, pool=1 << 22, **width)
    testing.build_tokenizer(out, width.get("vocab_size") or testing.hf_config("gemma4", prefix="model.")["vocab_size"])
print(json.dumps({"seconds": time.perf_counter() - t}))
"""


def env() -> dict:
    """This process's environment with the checkout first on PYTHONPATH and the machine's entries kept."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}


def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env(), cwd=ROOT)


def timed_shell(command: str) -> float:
    t = time.perf_counter()
    subprocess.run(["bash", "-c", command], check=True)
    return time.perf_counter() - t


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def make_model(path: str, layers: int, width: dict, config_only: bool = False) -> float:
    if os.path.isfile(os.path.join(path, "config.json")) and (config_only or os.path.isfile(
            os.path.join(path, "tokenizer.json"))):
        return 0.0
    p = run([sys.executable, "-c", WRITE, path, str(layers), json.dumps(width), *(["config"] * config_only)], 900)
    if p.returncode != 0:
        raise SystemExit(f"writing the model failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])["seconds"]


def write_rows(path: str, base: str, seq: int, rows: int) -> None:
    from train_vs_peft import synthetic_rows
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    with open(path, "w") as f:
        for row in synthetic_rows(tokenizer, seq, rows):
            f.write(json.dumps(row) + "\n")


def overrides(a, extra: list[str]) -> list[str]:
    return ["tp=1", "grad_accum=1", f"max_length={a.seq}", f"rank={a.rank}", f"alpha={a.rank}", "keep_checkpoints=1",
            *a.set, *extra]


def launch(a, base: str, data: str, out: str, remat: str) -> subprocess.Popen:
    total = a.steps + a.resume_steps
    cmd = [sys.executable, "-m", "training", "--preset", PRESET, "--base", base, "--data", data, "--out", out,
           "--max-steps", str(total), "--quiet", *overrides(a, [f"remat={remat}", f"checkpoint_every={a.steps}"])]
    log = open(out + ".log", "a")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env(), cwd=ROOT)


def read_jsonl(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n") and line.strip()]


def session_figures(session: dict, records: list[dict]) -> dict:
    """A session's start-up (sessions.jsonl) and its steady steps (metrics.jsonl: after its first)."""
    import statistics

    grad = session["memory"]["programs"].get("train_grad_step", {})
    steady = [r for r in records if r.get("session_step", 0) > 1 and not r.get("compiles")]
    def med(key: str):
        values = [r[key] for r in steady if r.get(key) is not None]
        return statistics.median(values) if values else None

    return {
        "launch_to_first_step_s": session["launch_to_first_step_seconds"], "load_s": session["load_seconds"],
        "load_gb_per_s": session["load_gb_per_s"], "compile_wait_s": session["compile_wait_seconds"],
        "programs": {k: v for k, v in session["programs"].items() if v["seconds"] >= 0.05},
        "first_step_s": session["first_step"]["seconds"], "steady_step_s": med("seconds"),
        "tokens_per_s": med("tokens_per_s"), "mfu": med("mfu"),
        "peak_device_bytes": session.get("device_peak_bytes_after_first_step"),
        "step_peak_bytes": session["memory"]["step_peak_bytes"], "step_temp_bytes": grad.get("temp"),
        "device_limit_bytes": session["memory"]["device_limit_bytes"],
        "weights_bytes": session["memory"]["weights_bytes"], "steps": len(records),
        "steps_compiling": [r["step"] for r in records if r.get("compiles")],
        "losses": [round(r["loss"], 4) for r in records], "phases": session.get("phases"),
    }


def train(a, base: str, data: str, out: str, remat: str) -> dict:
    """A fresh run of --steps + --resume-steps steps, killed once the checkpoint at --steps is
    committed (a preemption), then the same command again: it resumes from that checkpoint."""
    t = time.perf_counter()
    proc = launch(a, base, data, out, remat)
    metrics = os.path.join(out, "metrics.jsonl")
    deadline = time.time() + a.timeout
    while proc.poll() is None and time.time() < deadline:
        if a.resume_steps and any(c.step == a.steps for c in committed(os.path.join(out, "checkpoints"))):
            proc.kill()
            break
        time.sleep(0.2)
    else:
        if proc.poll() is None:
            proc.kill()
    proc.wait()
    row: dict = {"fresh_wall_s": round(time.perf_counter() - t, 1)}
    sessions = read_jsonl(os.path.join(out, "sessions.jsonl"))
    if not sessions:
        with open(out + ".log") as f:
            tail = f.read().strip().splitlines()
        return {**row, "error": (tail[-1] if tail else f"exit {proc.returncode}")[:400]}
    row["fresh"] = session_figures(sessions[0], [r for r in read_jsonl(metrics) if r["step"] <= a.steps])
    if a.resume_steps:
        t = time.perf_counter()
        proc = launch(a, base, data, out, remat)
        proc.wait(timeout=a.timeout)
        row["resumed_wall_s"] = round(time.perf_counter() - t, 1)
        sessions = read_jsonl(os.path.join(out, "sessions.jsonl"))
        if proc.returncode != 0 or len(sessions) < 2:
            with open(out + ".log") as f:
                tail = f.read().strip().splitlines()
            row["resumed"] = {"error": (tail[-1] if tail else f"exit {proc.returncode}")[:400]}
        else:
            row["resumed"] = session_figures(sessions[1], [r for r in read_jsonl(metrics) if r["step"] > a.steps])
            with open(os.path.join(out, "run.json")) as f:
                summary = json.load(f)
            row["run"] = {k: summary.get(k) for k in ("chip", "flops_per_token", "peak_tflops_per_chip",
                                                       "peak_memory_bytes", "steady_mfu", "steady_tokens_per_s")}
    return row


def dry_run(a, layers: int, remat: str) -> dict:
    cfg_dir = os.path.join(a.work, f"config-{layers}")
    make_model(cfg_dir, layers, WIDTHS[a.width], config_only=True)
    cmd = [sys.executable, "-m", "training", "--preset", PRESET, "--base", cfg_dir, "--dry-run",
           *(["--topology", a.topology] if a.topology else []), *overrides(a, [f"remat={remat}"])]
    p = run(cmd, a.timeout)
    if p.returncode != 0:
        raise SystemExit(f"--dry-run failed:\n{p.stderr[-3000:]}")
    r = json.loads(p.stdout)
    verdict = {True: "fits", False: "does not fit", None: "memory unknown"}[r["fits"]]
    print(f"  fit {layers} layers, remat={remat}: {verdict} "
          f"({(r.get('step_peak_bytes') or 0) / 1e9:.2f} GB of {(r['device_memory_bytes'] or 0) / 1e9:.2f} GB; "
          f"{r['compile_seconds']} s)", flush=True)
    return r


def largest_fit(a, remat: str) -> dict:
    """The largest layer count whose step fits: up from --fit-from while it fits (the step's memory
    grows by about one layer's weights per layer, so the search takes a few compilations)."""
    tried: dict[int, dict] = {}
    layers = a.fit_from
    while True:
        tried[layers] = dry_run(a, layers, remat)
        if tried[layers]["fits"] is None:  # the device's memory is not known (a CPU)
            break
        if not tried[layers]["fits"]:
            if layers == a.fit_from:
                layers -= 1
                if layers < 1:
                    break
                continue
            break
        if layers - 1 in tried and not tried[layers - 1]["fits"]:
            break
        if layers + 1 in tried:
            break
        layers += 1
    fits = [n for n, r in tried.items() if r["fits"]]
    return {"remat": remat, "largest": max(fits) if fits else None, "device": next(iter(tried.values()))["device_kind"],
            "topology": a.topology, "tried": {n: {"fits": r["fits"], "step_peak_bytes": r.get("step_peak_bytes"),
                                                  "device_memory_bytes": r["device_memory_bytes"]}
                                              for n, r in sorted(tried.items())}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="*", default=[2], help="layer counts to train (none: --fit only)")
    ap.add_argument("--remat", nargs="+", default=["decoder_dots"], help="remat settings to train each count with")
    ap.add_argument("--width", default="31b", choices=sorted(WIDTHS), help="31b: Gemma 4 31B's widths; tiny: the "
                    "tiny config, to try this script out on a CPU")
    ap.add_argument("--seq", type=int, default=3072)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10, help="steps of the fresh run (steady figures from step 2)")
    ap.add_argument("--resume-steps", type=int, default=2, help="steps of the resumed run (0: no resume)")
    ap.add_argument("--fit", action="store_true", help="find the largest layer count that fits (per --remat)")
    ap.add_argument("--fit-from", type=int, default=8, help="layer count the fit search starts from")
    ap.add_argument("--topology", help="--fit for this TPU slice ahead of time (e.g. v5e:1x1), not the device here")
    ap.add_argument("--set", nargs="*", default=[], metavar="key=value", help="more training settings")
    ap.add_argument("--work", help="where models and runs go (default: a temporary directory, removed)")
    ap.add_argument("--keep", action="store_true", help="keep the models in --work for another call")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per training process")
    ap.add_argument("--out", help="append the results as one JSON line to this file")
    a = ap.parse_args(argv)
    temporary = a.work is None
    a.work = a.work or tempfile.mkdtemp(prefix="train-tpu-")
    os.makedirs(a.work, exist_ok=True)
    result: dict = {"setting": {k: v for k, v in vars(a).items() if k not in ("work", "out", "keep", "timeout")},
                    "width_config": WIDTHS[a.width], "runs": [], "fit": []}
    try:
        for layers in a.layers:
            base = os.path.join(a.work, f"m{layers}")
            wrote = make_model(base, layers, WIDTHS[a.width])
            size = dir_bytes(base)
            disk = {"write_s": round(wrote, 1) if wrote else None,
                    "cp_sync_s": round(timed_shell(f"sync; cp -r {base} {base}.cp && sync"), 2)}
            shutil.rmtree(base + ".cp")
            disk["read_s"] = round(timed_shell(f"cat {base}/*.safetensors > /dev/null"), 2)
            disk["cp_sync_gb_per_s"] = round(size / 1e9 / disk["cp_sync_s"], 2)
            print(f"{layers} layers: {size / 1e9:.2f} GB; cp -r + sync {disk['cp_sync_s']} s "
                  f"({disk['cp_sync_gb_per_s']} GB/s), read {disk['read_s']} s", flush=True)
            data = os.path.join(a.work, f"rows-{a.seq}.jsonl")
            if not os.path.isfile(data):
                write_rows(data, base, a.seq, rows=8 * (a.steps + a.resume_steps + 4))
            for remat in a.remat:
                out = os.path.join(a.work, f"run-{layers}-{remat}")
                shutil.rmtree(out, ignore_errors=True)
                row = {"layers": layers, "remat": remat, "base_bytes": size, "disk": disk,
                       **train(a, base, data, out, remat)}
                result["runs"].append(row)
                report(row)
            if not a.keep:
                shutil.rmtree(base, ignore_errors=True)
        if a.fit:
            for remat in a.remat:
                fit = largest_fit(a, remat)
                result["fit"].append(fit)
                print(f"largest layer count that fits one {fit['device']} with remat={remat}: {fit['largest']}",
                      flush=True)
    finally:
        if temporary and not a.keep:
            shutil.rmtree(a.work, ignore_errors=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


def report(row: dict) -> None:
    head = f"  {row['layers']} layers, remat={row['remat']}"
    if "error" in row:
        print(f"{head}: {row['error']}", flush=True)
    for kind in ("fresh", "resumed"):
        r = row.get(kind)
        if r is None:
            continue
        if "error" in r:
            print(f"{head} {kind}: {r['error']}", flush=True)
            continue
        programs = ", ".join(f"{k} {v['seconds']:.1f} s" + (" (cache)" if v["cache_hits"] else "")
                             for k, v in r["programs"].items())
        print(f"{head} {kind}: launch -> first step {r['launch_to_first_step_s']} s; base load {r['load_s']} s "
              f"({r['load_gb_per_s']} GB/s); compiled {programs}; waited {r['compile_wait_s']} s for it", flush=True)
        if kind == "fresh" and r["steady_step_s"] is not None:
            peak = (r["peak_device_bytes"] or 0) / 1e9
            print(f"{head}: steady step {r['steady_step_s']:.4f} s, {r['tokens_per_s']:.0f} tokens/s, MFU "
                  f"{(r['mfu'] or 0):.1%}; peak device memory {peak:.2f} GB (XLA: step {r['step_peak_bytes'] / 1e9:.2f}"
                  f" GB, temporaries {r['step_temp_bytes'] / 1e9:.2f} GB); steps that compiled: "
                  f"{r['steps_compiling'] or 'none'}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
