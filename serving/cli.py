"""``python -m serving``: serve with vLLM, benchmark an endpoint, evaluate on verilog-eval.

    python -m serving serve --profile cpu --model MODEL_DIR [--adapter NAME=DIR ...] [--port 8000] [--dry-run]
    python -m serving bench --url http://127.0.0.1:8000 --model NAME [--qps 1,2,4] [--shapes 512x256,1024x512]
    python -m serving eval generate --url URL --model NAME --problems DIR --out samples.jsonl
    python -m serving eval score --problems DIR --samples samples.jsonl --out result.json [--k 1,5]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from ckptbridge import deps
from ckptbridge.errors import CkptBridgeError, ConfigError, InputNotFoundError

EPILOG = ("exit codes: 0 ok, 2 usage, 3 input not found, 4 corrupt file, 5 unsupported, 6 mismatch, 7 output, "
          "8 configuration, 9 server failed")


def _adapters(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items or []:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--adapter {item!r}: expected NAME=DIR")
        if name in out:
            raise ConfigError(f"--adapter {name}: given twice")
        out[name] = path
    return out


def _check_adapters(args, adapters: dict[str, str], local_model: bool, profile) -> int | None:
    """Lint every adapter for vLLM on the model (files only); refuse one that vLLM would serve wrong.
    Returns the smallest --max-lora-rank that fits them all."""
    from ckptbridge.adapter_check import lint_adapter
    from ckptbridge.verify import adapter_kind

    rank = args.max_lora_rank
    for name, path in adapters.items():
        if not os.path.isdir(path):
            if profile.local or local_model:
                raise InputNotFoundError(f"--adapter {name}={path}: no such adapter directory")
            continue
        if not local_model:
            continue
        if adapter_kind(path) == "orbax":
            raise ConfigError(f"--adapter {name}={path} is a Tunix/Orbax LoRA checkpoint; vLLM serves PEFT adapters: "
                              f"`ckptbridge convert orbax-to-peft {path} ADAPTER_DIR --base {args.model} --target vllm`")
        lint = lint_adapter(path, args.model, target="vllm")
        for f in lint.findings:
            if f.severity == "warning" or (f.severity == "error" and args.no_adapter_check):
                print(f"serving: {f.severity}: --adapter {name}: {f.message}", file=sys.stderr)
        if lint.errors and not args.no_adapter_check:
            more = f" ({len(lint.errors)} errors)" if len(lint.errors) > 1 else ""
            raise ConfigError(f"--adapter {name}: {lint.errors[0].message}{more}; all findings: `ckptbridge verify "
                              f"adapter {path} --base {args.model} --target vllm --lint-only`")
        if args.max_lora_rank and lint.max_rank > args.max_lora_rank:
            raise ConfigError(f"--adapter {name}: rank {lint.max_rank} exceeds --max-lora-rank {args.max_lora_rank}; "
                              f"use --max-lora-rank {lint.max_lora_rank}")
        rank = max(rank or 0, lint.max_lora_rank)
    return rank


def _length_and_dtype(args, profile, local_model: bool, model: str, stored_dtype: bool = False) -> tuple[int, str]:
    """The max model length to pass (the profile's, capped at the model's own limit) and the
    --dtype (``stored_dtype``: by default the checkpoint's own), with one line each on what vLLM will do."""
    from serving.vllm_facts import MANTISSA_BITS, compute_dtype, model_limits

    dtype = args.dtype or profile.dtype
    if not local_model:
        return args.max_model_len or profile.max_model_len, dtype
    limits = model_limits(model)
    if stored_dtype and not args.dtype:
        dtype = limits.weights_dtype or limits.config_dtype or dtype
    limit, where = limits.max_len, limits.max_len_from
    if args.max_model_len:
        if limit is not None and args.max_model_len > limit:
            raise ConfigError(f"--max-model-len {args.max_model_len} exceeds the model's limit {limit} ({where}); "
                              f"pass --max-model-len {limit} or less")
        length = args.max_model_len
    elif limit is not None and limit < profile.max_model_len:
        length = limit
        print(f"serving: max model length {length}: the model's limit ({where}; profile {profile.name} would use "
              f"{profile.max_model_len})", file=sys.stderr)
    else:
        length = profile.max_model_len
    computed = compute_dtype(dtype, limits)
    stored = limits.weights_dtype or limits.config_dtype
    print(f"serving: vLLM will compute in {computed} (--dtype {dtype}; checkpoint {stored or 'dtype unknown'})",
          file=sys.stderr)
    if stored in MANTISSA_BITS and MANTISSA_BITS[computed] < MANTISSA_BITS[stored]:
        print(f"serving: warning: the {stored} checkpoint is served in {computed}: greedy tokens can differ from "
              f"{stored} references (transformers, PEFT); pass --dtype {stored} to keep {stored}", file=sys.stderr)
    return length, dtype


def _check_quantized(args, profile) -> None:
    """A quantized model: one line on how vLLM takes it, or a ConfigError when the profile's
    hardware cannot run its scheme."""
    from ckptbridge.io.files import read_json_object
    from ckptbridge.formats.compressed_tensors import describe, scheme_of

    config = read_json_object(os.path.join(args.model, "config.json"), "")
    what = describe(config)
    if what is None:
        return
    scheme = scheme_of(config)
    if scheme is not None and scheme.name not in profile.quant_schemes:
        raise ConfigError(f"profile {profile.name} cannot run {scheme.name} ({scheme.preset}) weights: its hardware "
                          f"runs {', '.join(profile.quant_schemes)}; quantize the unquantized model with `ckptbridge "
                          f"quantize SRC DST --scheme {profile.quant_schemes[0]}`")
    named = f"{scheme.name}, {scheme.preset}" if scheme else "not one of ckptbridge's schemes"
    print(f"serving: quantized model ({what}; {named}): vLLM reads its quantization_config, no --quantization "
          "needed", file=sys.stderr)


def cmd_serve(args) -> int:
    from serving.profiles import PROFILES, RUNTIME_LORA_ENV, build_command
    from serving.server import LocalServer, serve_forever

    profile = PROFILES[args.profile]
    adapters = _adapters(args.adapter)
    local_model = os.path.isdir(args.model)
    if profile.local and not local_model:
        raise InputNotFoundError(f"{args.model}: no such model directory")
    if local_model and not os.path.isfile(os.path.join(args.model, "config.json")):
        raise InputNotFoundError(f"{args.model}: no config.json; not a Hugging Face model directory")
    if args.runtime_lora and not profile.lora:
        raise ConfigError(f"--runtime-lora: profile {profile.name} serves no LoRA adapters (vLLM's TPU model path "
                          "has none); use a profile that does (cpu, gpu-h100x2)")
    if args.runtime_lora and not adapters and not args.max_lora_rank:
        raise ConfigError("--runtime-lora: pass --max-lora-rank (the rank of the adapters to come, e.g. the training "
                          "run's)")
    if adapters and not profile.lora:
        name, path = next(iter(adapters.items()))
        raise ConfigError(f"profile {profile.name} cannot serve LoRA adapters (vLLM's TPU model path has none); "
                          f"merge first: `ckptbridge merge {args.model} {path} MERGED_DIR`, then serve MERGED_DIR")
    if local_model:
        _check_quantized(args, profile)
    rank = _check_adapters(args, adapters, local_model, profile)
    max_model_len, dtype = _length_and_dtype(args, profile, local_model, args.model)
    extra = list(args.vllm_arg)
    if args.runtime_lora and not adapters:
        extra = ["--enable-lora", "--max-lora-rank", str(args.max_lora_rank), *extra]
    cmd = build_command(profile, args.model, adapters=adapters, port=args.port, host=args.host,
                        served_name=args.name, max_lora_rank=rank, max_model_len=max_model_len,
                        kv_cache_gib=args.kv_cache_gib, dtype=dtype, extra_args=extra)
    if args.runtime_lora:
        cmd.env[RUNTIME_LORA_ENV] = "True"
    if args.dry_run or not profile.local:
        print(cmd.shell())
        if not args.dry_run:
            print(f"# profile {profile.name} runs on its own machine ({profile.description}); run the command above "
                  "there", file=sys.stderr)
        return 0
    return serve_forever(LocalServer(cmd, args.log))


def cmd_bench(args) -> int:
    from serving import bench
    from serving.cost import format_tco

    train_cost = args.train_cost
    if args.train_run:
        path = os.path.join(args.train_run, "run.json") if os.path.isdir(args.train_run) else args.train_run
        if not os.path.isfile(path):
            raise InputNotFoundError(f"{path}: no run.json from `python -m training`")
        with open(path) as f:
            train_cost = json.load(f).get("cost_usd")
    if train_cost is not None and not args.usd_per_hour:
        raise ConfigError("the TCO table needs the serving rate: add --usd-per-hour")
    weights = None
    if args.model_dir:  # read before the sweep: a wrong directory fails now, not after it
        from serving.vllm_facts import weights_memory

        weights = weights_memory(args.model_dir)
    result = bench.run_sweep(args.url.rstrip("/"), args.model, qps=bench.parse_qps(args.qps),
                             shapes=bench.parse_shapes(args.shapes), num_prompts=args.num_prompts, seed=args.seed,
                             timeout=args.timeout, max_concurrency=args.max_concurrency,
                             usd_per_hour=args.usd_per_hour, prompt_format=args.prompt_format,
                             progress=None if args.json else lambda line: print(line, file=sys.stderr))
    if weights is not None:
        result["weights"] = weights
    hours = tuple(float(h) for h in args.tco_hours.split(","))
    if args.out:
        bench.write_outputs(result, args.out, train_cost=train_cost, hours=hours)
    elif train_cost is not None and args.usd_per_hour:
        from serving.cost import tco_table

        result["tco"] = tco_table(train_cost, args.usd_per_hour, hours)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(bench.table(result))
        if result.get("tco"):
            print(f"\nTCO: training ${train_cost:.2f} + serving at ${args.usd_per_hour:g}/h\n" + format_tco(result["tco"]))
        if args.out:
            print(f"\nwrote {os.path.join(args.out, 'bench.json')}, bench.txt and "
                  f"{', '.join(os.path.basename(p) for p in result['plots'])}")
    return 1 if any(p["failed"] for p in result["points"]) and args.fail_on_error else 0


def cmd_generate(args) -> int:
    from serving.evaluate import generate

    r = generate(args.url.rstrip("/"), args.model, args.problems, args.out, n=args.n, temperature=args.temperature,
                 top_p=args.top_p, max_tokens=args.max_tokens, workers=args.workers, seed=args.seed)
    print(f"eval generate: {r['written']} new samples for {r['requested']} problem(s) -> {r['samples']} "
          f"({r['already_there']} were there already)")
    return 0


def cmd_score(args) -> int:
    from serving.evaluate import score

    try:
        ks = tuple(int(k) for k in args.k.split(","))
    except ValueError:
        raise ConfigError(f"--k {args.k!r}: expected integers such as 1,5") from None
    r = score(args.problems, args.samples, args.out, ks=ks, workers=args.workers, timeout=args.timeout)
    if args.json:
        print(json.dumps({k: v for k, v in r.items() if k != "problems"}, indent=2))
        return 0
    print(f"{r['num_problems']} problems, {r['num_samples']} samples ({r['iverilog']})")
    for k in r["k"]:
        v = r[f"pass@{k}"]
        print(f"pass@{k}: {'-' if v is None else f'{v:.4f}'} over {r[f'problems_with_{k}_samples']} problems")
    print("sample outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(r["reasons"].items())))
    if r["missing"]:
        print(f"{len(r['missing'])} problem(s) had no samples: {', '.join(r['missing'][:5])}")
    print(f"wrote {args.out}")
    return 0


def cmd_watch(args) -> int:
    from serving.profiles import PROFILES
    from serving.watch import Watch, checkpoints_dir, watch

    checkpoints_dir(args.run_dir)  # a directory that is not a training run: one line, exit 3
    if not os.path.isdir(args.base) or not os.path.isfile(os.path.join(args.base, "config.json")):
        raise InputNotFoundError(f"--base {args.base}: no HF model directory (config.json) there")
    from serving.evaluate import iverilog_version, list_problems

    list_problems(args.problems, need_tests=True)  # problems without tests, or none: refused now, not after training
    iverilog_version()  # scoring needs Icarus Verilog
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ConfigError(f"--out {args.out}: a file is there; give a directory")
    for flag, value, least in (("--keep", args.keep, 1), ("--samples", args.samples, 1),
                               ("--max-tokens", args.max_tokens, 1), ("--parity-tokens", args.parity_tokens, 0)):
        if value < least:
            raise ConfigError(f"{flag} {value}: give at least {least}")
    if args.poll <= 0:
        raise ConfigError(f"--poll {args.poll:g}: give a positive number of seconds")
    try:
        ks = tuple(int(k) for k in args.k.split(","))
    except ValueError:
        raise ConfigError(f"--k {args.k}: give whole numbers, comma-separated (e.g. 1,5)") from None
    if any(k < 1 or k > args.samples for k in ks):
        raise ConfigError(f"--k {args.k}: each k must be 1..--samples ({args.samples}); pass@k needs k samples")
    if 1 not in ks:
        raise ConfigError(f"--k {args.k}: include 1 (the best step is chosen by pass@1)")
    w = Watch(args.run_dir, args.base, args.problems, args.out, samples=args.samples, keep=args.keep, ks=ks,
              max_tokens=args.max_tokens, parity_tokens=args.parity_tokens, say=lambda line: print(line, flush=True))
    profile = PROFILES[args.profile]
    if not args.server and not profile.lora:
        raise ConfigError(f"profile {profile.name} serves no LoRA adapters (vLLM's TPU model path has none): watch "
                          "needs a server that loads them at run time (--profile cpu here, or --server URL of one "
                          "started with `python -m serving serve --runtime-lora`)")
    if not args.server:
        if not profile.local:
            raise ConfigError(f"profile {profile.name} runs on its own machine: start it there with `python -m serving "
                              f"serve --profile {profile.name} --model {args.base} --runtime-lora --max-lora-rank "
                              "RANK` and pass its URL with --server")
    # in the checkpoint's own dtype by default: the served-parity probe compares with transformers in float32
    max_model_len, dtype = _length_and_dtype(args, profile, not args.server, args.base, stored_dtype=True)
    n = watch(w, server_url=args.server, profile=profile, once=args.once, poll=args.poll, dtype=dtype,
              max_model_len=max_model_len)
    print(f"watch: {n} checkpoint(s) scored; rows in {os.path.join(args.out, 'watch.jsonl')}")
    return 0


def cmd_profiles(args) -> int:
    from serving.profiles import PROFILES

    for p in PROFILES.values():
        print(f"{p.name:<11} {p.description}; tp {p.tensor_parallel}, max model len {p.max_model_len}, KV cache "
              f"{p.kv_cache_dtype if p.kv_cache_dtype != 'auto' else 'model dtype'}, LoRA {'yes' if p.lora else 'no'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from serving.evaluate import BUNDLED_PROBLEMS
    from serving.profiles import PROFILES

    p = argparse.ArgumentParser(prog="python -m serving", description=__doc__.split("\n\n")[0], epilog=EPILOG)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve a model (and LoRA adapters) with vLLM", epilog=EPILOG,
                       description="Serve MODEL_DIR with vLLM. The cpu profile runs here and stops cleanly on "
                       "Ctrl-C/SIGTERM; remote profiles print their exact command.")
    s.add_argument("--profile", required=True, choices=sorted(PROFILES))
    s.add_argument("--model", required=True, help="HF model directory (a base, or a merged model)")
    s.add_argument("--adapter", action="append", metavar="NAME=DIR",
                   help="LoRA adapter to serve under NAME (PEFT, exported with --target vllm); repeatable")
    s.add_argument("--name", help="served model name (default: the model directory's name)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--host", help="listen address (default 127.0.0.1 for cpu, 0.0.0.0 for remote profiles)")
    s.add_argument("--max-lora-rank", type=int, help="default: the smallest vLLM accepts that fits the adapters")
    s.add_argument("--max-model-len", type=int,
                   help="longest sequence (default: the profile's, capped at the model's own limit)")
    s.add_argument("--dtype", help="dtype vLLM computes in (default: the profile's; `auto` serves float32 "
                   "checkpoints in bfloat16, --dtype float32 keeps float32)")
    s.add_argument("--kv-cache-gib", type=float, default=2.0, help="cpu profile: KV cache space (GiB)")
    s.add_argument("--log", help="cpu profile: write the server's output here instead of the terminal")
    s.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="extra argument passed to vLLM as is (repeat; e.g. --vllm-arg=--seed=0)")
    s.add_argument("--no-adapter-check", action="store_true",
                   help="serve adapters even when ckptbridge finds vLLM would serve them wrong (for comparisons); "
                   "the findings are printed")
    s.add_argument("--runtime-lora", action="store_true",
                   help="let clients load and unload adapters while it runs (/v1/load_lora_adapter; what `watch "
                   "--server` needs); with no --adapter, give --max-lora-rank")
    s.add_argument("--dry-run", action="store_true", help="print the command and exit")
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="load benchmark: a QPS sweep at several shapes", epilog=EPILOG,
                       description="Streaming load benchmark against an OpenAI-compatible vLLM endpoint.")
    b.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    b.add_argument("--model", required=True, help="served model (or adapter) name")
    b.add_argument("--model-dir", metavar="DIR", help="the served model's directory: the table adds the memory its "
                   "weights take, by dtype, and how they are quantized")
    b.add_argument("--qps", default="1,2,4,8,16,32,64", help="request rates, comma-separated (inf: all at once)")
    b.add_argument("--shapes", default="512x256,1024x512,4096x512,8192x512,16000x512",
                   help="INPUTxOUTPUT token lengths, comma-separated")
    b.add_argument("--num-prompts", type=int, default=30, help="requests per point")
    b.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    b.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--prompt-format", choices=("text", "ids"), default="text",
                   help="text that tokenizes to exactly the input length (default; the server tokenizes it, as "
                   "for real clients), or the token ids themselves")
    b.add_argument("--usd-per-hour", type=float, help="serving rate, for $/1M output tokens and the TCO table")
    b.add_argument("--train-cost", type=float, help="training cost ($) for the TCO table")
    b.add_argument("--train-run", help="training RUN_DIR (or its run.json): take the training cost from it")
    b.add_argument("--tco-hours", default="1,8,24", help="serving hours of the TCO table")
    b.add_argument("--out", help="directory for bench.json, bench.txt and the PNG plots")
    b.add_argument("--json", action="store_true", help="print the result as JSON")
    b.add_argument("--fail-on-error", action="store_true", help="exit 1 when any request failed")
    b.set_defaults(func=cmd_bench)

    e = sub.add_parser("eval", help="verilog-eval: generate samples, score them").add_subparsers(
        dest="eval_command", required=True)
    g = e.add_parser("generate", help="ask a served model for completions of every problem (resumable)",
                     epilog=EPILOG)
    g.add_argument("--url", required=True)
    g.add_argument("--model", required=True)
    g.add_argument("--problems", default=BUNDLED_PROBLEMS, help="verilog-eval spec-to-rtl directory (default: "
                   "the bundled problems)")
    g.add_argument("--out", required=True, metavar="SAMPLES.jsonl")
    g.add_argument("--n", type=int, default=5, help="samples per problem")
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--max-tokens", type=int, default=1024)
    g.add_argument("--workers", type=int, default=4, help="requests in flight")
    g.add_argument("--seed", type=int, help="sampling seed sent to the server")
    g.set_defaults(func=cmd_generate)
    sc = e.add_parser("score", help="compile and simulate samples with iverilog; pass@k", epilog=EPILOG)
    sc.add_argument("--problems", default=BUNDLED_PROBLEMS)
    sc.add_argument("--samples", required=True, metavar="SAMPLES.jsonl",
                    help='lines {"task_id": "Prob001_zero", "completion": "..."}')
    sc.add_argument("--out", required=True, metavar="RESULT.json")
    sc.add_argument("--k", default="1,5")
    sc.add_argument("--workers", type=int, help="parallel simulations (default: CPU count)")
    sc.add_argument("--timeout", type=float, default=30.0, help="seconds for each compile and each run")
    sc.add_argument("--json", action="store_true")
    sc.set_defaults(func=cmd_score)

    wa = sub.add_parser("watch", help="score every checkpoint of a training run on a running vLLM as it lands",
                        epilog=EPILOG,
                        description="Follow RUN_DIR's checkpoints: each committed one is exported to a --target vllm "
                        "adapter, linted, loaded into one vLLM server at run time, checked against transformers + "
                        "PEFT and scored on the problems; a row per checkpoint in OUT/watch.jsonl, the best step in "
                        "OUT/best.json, pass@k and loss vs step in OUT/watch.png. Restartable with the same --out.")
    wa.add_argument("run_dir", metavar="RUN_DIR", help="the training run's directory (`python -m training --out`)")
    wa.add_argument("--base", required=True, help="the HF base model the run fine-tunes")
    wa.add_argument("--problems", default=BUNDLED_PROBLEMS, help="verilog-eval problems (default: the bundled ones)")
    wa.add_argument("--server", metavar="URL", help="a running vLLM that takes adapters at run time (`serve "
                    "--runtime-lora`; default: start one here with --profile)")
    wa.add_argument("--profile", default="cpu", choices=sorted(PROFILES), help="profile of the server started here")
    wa.add_argument("--samples", type=int, default=5, help="samples per problem")
    wa.add_argument("--k", default="1,5", help="pass@k reported")
    wa.add_argument("--keep", type=int, default=2, help="adapters kept loaded (the newest; the best one stays too)")
    wa.add_argument("--max-tokens", type=int, default=1024)
    wa.add_argument("--parity-tokens", type=int, default=8,
                    help="greedy tokens compared with transformers + PEFT per checkpoint, which runs the base in "
                    "float32 here (0: no probe; a 31B needs about 4 bytes a parameter of memory for it)")
    wa.add_argument("--max-model-len", type=int, help="(default: the profile's, capped at the model's limit)")
    wa.add_argument("--dtype", help="dtype vLLM computes in (default: the checkpoint's)")
    wa.add_argument("--poll", type=float, default=10.0, help="seconds between looks at the run")
    wa.add_argument("--once", action="store_true", help="score the checkpoints there now and exit")
    wa.add_argument("--out", required=True, help="directory of watch.jsonl, best.json, watch.png and adapters")
    wa.set_defaults(func=cmd_watch)

    pr = sub.add_parser("profiles", help="list the deployment profiles")
    pr.set_defaults(func=cmd_profiles)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return args.func(args)
    except CkptBridgeError as e:
        print(f"serving: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("serving: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a package that does not import with the versions beside it: one line
        code = deps.import_failure_exit("serving", e, "serve")
        if code is None:
            raise
        return code

