"""The ``ckptbridge verify`` checks: their parsers and what each runs (:mod:`ckptbridge.verify`,
:mod:`ckptbridge.adapter_check`). A check that finds a difference exits 6."""

from __future__ import annotations

from ckptbridge.errors import EXIT_CODES_HELP as EPILOG
from ckptbridge.errors import ConfigError
from ckptbridge.options import EXACT_TOLERANCE, LIVE_TOLERANCE, LOGITS_TOLERANCE, SERVED_TOKENS, TARGETS, parse_size
from ckptbridge.report import emit as _emit


def emit(args, report) -> None:
    _emit(report, getattr(args, "json", False))


def _json_option(sp) -> None:
    sp.add_argument("--json", action="store_true", help="print the report as JSON")


def _revision_option(sp, first: str) -> None:
    sp.add_argument("--revision", metavar="REV", help=f"branch, tag or commit of {first} when it is a Hub id")


def _base_option(sp, what: str = "HF base model directory or Hub id") -> None:
    sp.add_argument("--base", required=True, help=what)


def _target_option(sp, what: str) -> None:
    sp.add_argument("--target", choices=TARGETS, default=TARGETS[0], help=what)


def _orbax_lora_options(sp) -> None:
    """--step and --alpha of a check that also takes a Tunix/qwix or MaxText LoRA checkpoint."""
    sp.add_argument("--step", type=int, help="step of an Orbax checkpoint root (default: latest)")
    sp.add_argument("--alpha", type=float, help="LoRA alpha of an Orbax or MaxText checkpoint that does not record "
                    "it (scale = alpha / rank)")


def _parallel_options(sp, what: str) -> None:
    sp.add_argument("--workers", type=int, metavar="N", help=f"threads that {what} (default: the usable cores)")
    sp.add_argument("--memory-budget", metavar="SIZE", help="bytes of pieces held at once (default 256MiB)")


def _parallel(args) -> dict:
    budget = args.memory_budget
    if budget is not None:
        try:
            budget = parse_size(budget)
        except ValueError as e:
            raise ConfigError(f"--memory-budget: {e}") from None
    return {"workers": args.workers, "memory_budget": budget}


def cmd_verify_logits(args) -> int:
    from ckptbridge.verify import logits_parity

    report = logits_parity(args.hf_dir, args.tunix, seq_len=args.seq_len, tolerance=args.tolerance,
                           allow_config_mismatch=args.allow_config_mismatch, revision=args.revision)
    emit(args, report)
    return 0 if report.ok else 6


def cmd_verify_quantized(args) -> int:
    from ckptbridge.verify import quantized_cost

    report = quantized_cost(args.quantized, args.source, seq_len=args.seq_len, tolerance=args.tolerance)
    emit(args, report)
    return 0 if report.ok else 6


def cmd_verify_tensors(args) -> int:
    from ckptbridge.verify import compare_tensors

    report = compare_tensors(args.a, args.b, revision=args.revision)
    emit(args, report)
    return 0 if report.identical else 6


def cmd_verify_gguf(args) -> int:
    from ckptbridge.verify import verify_gguf

    report = verify_gguf(args.gguf, args.src, adapter=args.adapter, step=args.step, alpha=args.alpha,
                         **_parallel(args), revision=args.revision)
    emit(args, report)
    return 0 if report.identical else 6


def cmd_verify_adapter(args) -> int:
    from ckptbridge.adapter_check import verify_adapter
    from ckptbridge.verify import parse_ids

    report = verify_adapter(args.adapter, args.base, target=args.target,
                            ids=parse_ids(args.ids) if args.ids else None, prompt=args.prompt, step=args.step,
                            alpha=args.alpha, lint_only=args.lint_only, exact=not args.no_exact,
                            live_tolerance=args.live_tolerance, tolerance=args.tolerance, revision=args.revision)
    emit(args, report)
    return 0 if report.ok else 6


def cmd_verify_served(args) -> int:
    from ckptbridge.verify import parse_ids, served_parity

    if args.tokens < 1:
        raise ConfigError("--tokens must be at least 1")
    report = served_parity(args.url, args.model, args.base, adapter=args.adapter,
                           ids=parse_ids(args.ids) if args.ids else None, tokens=args.tokens, step=args.step,
                           alpha=args.alpha)
    emit(args, report)
    return 0 if report.equal else 6


def add_verify_logits(vsub) -> None:
    sp = vsub.add_parser("logits", help="transformers vs Tunix logits on the same tokens", epilog=EPILOG,
                         description="Run transformers on HF_DIR and Tunix on --tunix (default HF_DIR) in float32 "
                         "over a sequence longer than the sliding window; compare logits.")
    sp.add_argument("hf_dir", metavar="HF_DIR", help="HF model directory or Hub id")
    sp.add_argument("--tunix", metavar="SRC", help="HF directory or Orbax checkpoint to load into Tunix")
    sp.add_argument("--seq-len", type=int, help="tokens per sequence (default 2 x window + 3)")
    sp.add_argument("--tolerance", type=float, default=LOGITS_TOLERANCE,
                    help=f"largest relative L2 accepted (default {LOGITS_TOLERANCE:g})")
    sp.add_argument("--allow-config-mismatch", action="store_true",
                    help="build the Tunix model even where it computes something else than the HF config says "
                    "(e.g. a RoPE theta Tunix ignores) and measure the gap")
    _json_option(sp)
    _revision_option(sp, "HF_DIR")
    sp.set_defaults(extra="verify", func=cmd_verify_logits)


def add_verify_quantized(vsub) -> None:
    sp = vsub.add_parser("quantized", help="what quantization cost: logits of a quantized model vs its source",
                         epilog=EPILOG,
                         description="Compute the logits of the unquantized SOURCE and of the same model with the "
                         "quantized weights of QUANTIZED (weight x scale) and its activations rounded per token as the "
                         "scheme does when served, in float32 with transformers, on the same random tokens; report "
                         "relative L2 and argmax agreement.")
    sp.add_argument("quantized", metavar="QUANTIZED",
                    help="quantized model directory (int8 or fp8, compressed-tensors)")
    sp.add_argument("--source", required=True, help="the unquantized HF model directory it was made from")
    sp.add_argument("--seq-len", type=int, help="tokens per sequence (default 2 x window + 3)")
    sp.add_argument("--tolerance", type=float, help="fail (exit 6) above this relative L2 of the logits (default: "
                    "report only)")
    _json_option(sp)
    sp.set_defaults(extra="verify", func=cmd_verify_quantized)


def add_verify_tensors(vsub) -> None:
    sp = vsub.add_parser("tensors", help="bitwise comparison of two HF model directories", epilog=EPILOG)
    sp.add_argument("a", metavar="A", help="HF model directory or Hub id")
    sp.add_argument("b", metavar="B", help="HF model directory or Hub id")
    _json_option(sp)
    _revision_option(sp, "A")
    sp.set_defaults(func=cmd_verify_tensors)


def add_verify_gguf(vsub) -> None:
    sp = vsub.add_parser(
        "gguf", help="a GGUF file against the model it was made from, tensor by tensor", epilog=EPILOG,
        description="Check that every tensor of a GGUF file (ours or ggml's converter's) holds the source model's "
        "values in its stored type (F32/F16/BF16 bit for bit, Q8_0 equal to quantizing them again), with ggml's "
        "value changes, and that no tensor is missing or extra. Exit 6 when they differ.")
    sp.add_argument("gguf", metavar="GGUF", help="the GGUF file")
    sp.add_argument("src", metavar="SRC", help="the model it was made from: HF model directory or Hub id, or a Tunix "
                    "Orbax weights checkpoint")
    sp.add_argument("--adapter", metavar="ADAPTER", help="the LoRA adapter merged into it (PEFT, or Tunix/qwix Orbax)")
    _orbax_lora_options(sp)
    _parallel_options(sp, "read, merge and quantize row blocks ahead of the comparison")
    _json_option(sp)
    _revision_option(sp, "SRC")
    sp.set_defaults(func=cmd_verify_gguf)


def add_verify_adapter(vsub) -> None:
    sp = vsub.add_parser(
        "adapter", help="prove a LoRA adapter is live and exact for its base", epilog=EPILOG,
        description="lint (files only): targets, shapes, ranks, vLLM needs (k_eq_v v_proj copies, --max-lora-rank), "
        "DoRA / modules_to_save / biases, the recorded base; live: the adapter moves BASE's logits "
        "(transformers+PEFT); exact: transformers+PEFT vs Tunix+qwix logits of the same adapter, converted through "
        "ckptbridge (float32). One line per finding with its fix; exit 6 when the adapter is wrong in its target.")
    sp.add_argument("adapter", metavar="ADAPTER", help="PEFT adapter directory or Hub id, or a Tunix/qwix Orbax LoRA "
                    "checkpoint")
    _base_option(sp, "HF base model directory or Hub id")
    _target_option(sp, "where the adapter will run: hf (transformers/PEFT, default) or vllm")
    toks = sp.add_mutually_exclusive_group()
    toks.add_argument("--prompt", metavar="TEXT", help="text to check on (BASE's tokenizer)")
    toks.add_argument("--ids", metavar="1,2,3", help="token ids to check on (default: 24 random ids, seed 0)")
    sp.add_argument("--lint-only", action="store_true", help="files only: no model is loaded")
    sp.add_argument("--no-exact", action="store_true", help="skip the Tunix+qwix comparison")
    _orbax_lora_options(sp)
    sp.add_argument("--tolerance", type=float, default=EXACT_TOLERANCE,
                    help=f"largest relative L2 between the two frameworks (default {EXACT_TOLERANCE:g})")
    sp.add_argument("--live-tolerance", type=float, default=LIVE_TOLERANCE,
                    help=f"smallest relative change of the logits that counts as live (default {LIVE_TOLERANCE:g})")
    _json_option(sp)
    _revision_option(sp, "BASE")
    sp.set_defaults(func=cmd_verify_adapter)


def add_verify_served(vsub) -> None:
    sp = vsub.add_parser(
        "served", help="greedy tokens of a running server vs transformers (+PEFT)", epilog=EPILOG,
        description="Ask a running OpenAI-compatible server (vLLM) for the greedy token ids of a prompt and compare "
        "them with transformers (+ PEFT with --adapter) on the same ids, in float32; reports the first divergent "
        "position.")
    sp.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    sp.add_argument("--model", required=True, help="served model or adapter name")
    _base_option(sp, "HF base model directory the server serves")
    sp.add_argument("--adapter", help="the adapter served as --model (PEFT directory or Orbax LoRA checkpoint)")
    sp.add_argument("--ids", metavar="1,2,3", help="prompt token ids (default: 12 random ids, seed 0)")
    sp.add_argument("--tokens", type=int, default=SERVED_TOKENS,
                    help=f"greedy tokens to compare (default {SERVED_TOKENS})")
    _orbax_lora_options(sp)
    _json_option(sp)
    sp.set_defaults(extra="verify", func=cmd_verify_served)


def add_verify(sub) -> None:
    ver = sub.add_parser("verify", help="check a conversion", description="Check a conversion.", epilog=EPILOG)
    vsub = ver.add_subparsers(dest="check", metavar="CHECK", required=True)
    for add_check in (add_verify_logits, add_verify_quantized, add_verify_tensors, add_verify_gguf, add_verify_adapter,
                      add_verify_served):
        add_check(vsub)
