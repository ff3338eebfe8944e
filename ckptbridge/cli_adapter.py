"""The ``ckptbridge adapter`` verbs: combine, resize and extract LoRA adapters of any format
(:mod:`ckptbridge.adapter`)."""

from __future__ import annotations

from ckptbridge import formats, options
from ckptbridge.errors import EXIT_CODES_HELP as EPILOG
from ckptbridge.report import emit as _emit

ADAPTER_FORMATS = [n for n, f in formats.FORMATS.items() if f.kind == formats.ADAPTER and f.writes]
WRITE_OPTIONS = [o for n in ADAPTER_FORMATS for o in formats.FORMATS[n].write_options]


def _common(sp, *, to_default: str, orbax_inputs: bool = True) -> None:
    """Options every adapter verb takes: the destination's format and its options, the output
    dtype, Orbax LoRA inputs' step/alpha, workers, and the output flags."""
    sp.add_argument("--to", metavar="FORMAT", choices=ADAPTER_FORMATS,
                    help=f"the format written: {', '.join(ADAPTER_FORMATS)} (default: {to_default})")
    sp.add_argument("--dtype", choices=options.ADAPTER_DTYPES, help="dtype of the factors written (default: " +
                    ("the input's)" if to_default.startswith("SRC") else "float32)"))
    for name in [*dict.fromkeys(WRITE_OPTIONS), "step", *(["alpha"] if orbax_inputs else [])]:
        formats.OPTIONS[name].add_to(sp)
    sp.add_argument("--workers", type=int, metavar="N", help="threads that compute modules at once (default: the "
                    "usable cores)")
    sp.add_argument("--revision", metavar="REV", help="branch, tag or commit of an input that is a Hub id")
    sp.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    sp.add_argument("--quiet", action="store_true", help="no progress bar")
    sp.add_argument("--json", action="store_true", help="print the report as JSON")


def _rank_options(sp, what: str) -> None:
    g = sp.add_mutually_exclusive_group(required=True)
    g.add_argument("--rank", type=int, metavar="R", help=f"the rank of every module {what}")
    g.add_argument("--energy", type=float, metavar="F", help="per module, the smallest rank keeping the fraction F "
                   "of its squared Frobenius norm (e.g. 0.99)")


def _write_kw(args) -> dict:
    out = {n: getattr(args, n) for n in dict.fromkeys(WRITE_OPTIONS) if getattr(args, n, None) is not None}
    return {**out, "to": args.to, "dtype": args.dtype, "overwrite": args.overwrite, "workers": args.workers,
            "progress": False if args.quiet else None, "revision": args.revision}


def cmd_combine(args) -> int:
    from ckptbridge.adapter import combine

    _emit(combine(args.adapters, args.dst, method=args.method, weights=args.weights, rank=args.rank,
                  density=args.density, majority_sign=args.majority_sign, seed=args.seed, base=args.base,
                  step=args.step, alpha=args.alpha, **_write_kw(args)), args.json)
    return 0


def cmd_resize(args) -> int:
    from ckptbridge.adapter import resize

    _emit(resize(args.src, args.dst, rank=args.rank, energy=args.energy, base=args.base, step=args.step,
                 alpha=args.alpha, **_write_kw(args)), args.json)
    return 0


def cmd_extract(args) -> int:
    from ckptbridge.adapter import extract

    kw = _write_kw(args)
    kw["to"] = kw["to"] or "peft"
    _emit(extract(args.model, args.dst, base=args.base, rank=args.rank, energy=args.energy, modules=args.modules,
                  randomized=args.randomized, seed=args.seed, keep_full=args.keep_full, config=args.config,
                  step=args.step, **kw), args.json)
    return 0


def add_adapter(sub) -> None:
    ap = sub.add_parser("adapter", help="combine, resize or extract LoRA adapters (any adapter format)",
                        epilog=EPILOG, description="Adapter algebra on PEFT, Tunix/qwix LoRA and MaxText LoRA "
                        "adapters, written in any adapter format: combine several, change their rank, or extract "
                        "one from a fine-tuned model. One module at a time, on the CPU, without loading a model.")
    verbs = ap.add_subparsers(dest="verb", metavar="VERB", required=True)

    cp = verbs.add_parser("combine", help="several adapters into one (PEFT's add_weighted_adapter)", epilog=EPILOG,
                          description="Combine ADAPTERS (PEFT, Tunix/qwix or MaxText LoRA; mixed, each with its own "
                          "rank and alpha) into DST with PEFT's add_weighted_adapter semantics: cat (rank: the sum), "
                          "linear, ties, dare_linear, dare_ties, magnitude_prune (equal ranks), svd and the _svd "
                          "forms (the best factors of the combined delta at --rank). The result has lora_alpha = r.")
    cp.add_argument("adapters", nargs="+", metavar="ADAPTER",
                    help="the adapters (two or more; local, gs:// or Hub ids)")
    cp.add_argument("dst", metavar="DST", help="the adapter to create")
    cp.add_argument("--method", required=True, choices=options.COMBINE_METHODS, help="how the adapters are combined")
    cp.add_argument("--weights", type=float, nargs="+", metavar="W", help="one weight per adapter (default: 1 each)")
    cp.add_argument("--rank", type=int, metavar="R", help="rank of svd and the _svd methods (default: the largest "
                    "adapter's)")
    cp.add_argument("--density", type=float, metavar="D",
                    help=f"fraction of entries kept by {', '.join(options.COMBINE_PRUNING)}")
    cp.add_argument("--majority-sign", choices=options.SIGN_METHODS,
                    help="how ties elects each entry's sign (default: total)")
    cp.add_argument("--seed", type=int, default=0, help="seed of dare's random pruning (default 0)")
    cp.add_argument("--base", help="the adapters' HF base model directory or Hub id (default: the one the first "
                    "adapter records)")
    _common(cp, to_default="the first adapter's format")
    cp.set_defaults(func=cmd_combine, extra=None)

    rp = verbs.add_parser("resize", help="an adapter at another rank (per module: the best factors of its delta)",
                          epilog=EPILOG, description="Write SRC with every module's delta cut to its best rank-R "
                          "factors (Eckart-Young, from the factors' small QR; a rank above a module's pads with "
                          "zeros), or to the smallest rank keeping the fraction F of its squared norm. Each module "
                          "keeps its alpha; the report gives every module's rank and the relative error left.")
    rp.add_argument("src", metavar="SRC", help="the adapter (PEFT, Tunix/qwix or MaxText LoRA)")
    rp.add_argument("dst", metavar="DST", help="the adapter to create")
    _rank_options(rp, "(at most its smaller dimension)")
    rp.add_argument("--base", help="the adapter's HF base model directory or Hub id (default: the one it records)")
    _common(rp, to_default="SRC's format")
    rp.set_defaults(func=cmd_resize, extra=None)

    ep = verbs.add_parser("extract", help="a LoRA adapter from a fine-tuned model and its base", epilog=EPILOG,
                          description="Extract a LoRA from MODEL (HF, Tunix, MaxText or GGUF F32/F16/BF16) minus "
                          "BASE: per LoRA module of the family, the best rank-R factors of the delta in float32 "
                          "(or the smallest rank keeping F of its squared norm), one module at a time. Modules that "
                          "did not change are left out; other tensors that differ are listed (--keep-full keeps them "
                          "whole as PEFT modules_to_save).")
    ep.add_argument("model", metavar="MODEL", help="the fine-tuned or merged model (any model format)")
    ep.add_argument("dst", metavar="DST", help="the adapter to create")
    ep.add_argument("--base", required=True, help="the model it was fine-tuned from (any model format)")
    _rank_options(ep, "")
    ep.add_argument("--modules", metavar="REGEX", help="only the HF modules this regex finds (e.g. "
                    "'self_attn\\.(q|v)_proj')")
    ep.add_argument("--randomized", action="store_true", help="a randomized SVD (faster on wide modules; the exact "
                    "error it left is reported)")
    ep.add_argument("--seed", type=int, default=0, help="seed of --randomized (default 0)")
    ep.add_argument("--keep-full", action="store_true", help="write the other tensors that differ (norms, "
                    "embeddings) whole, as PEFT modules_to_save, so that nothing is lost")
    ep.add_argument("--config", metavar="HF_CONFIG", help=formats.OPTIONS["config"].help)
    _common(ep, to_default="peft", orbax_inputs=False)
    ep.set_defaults(func=cmd_extract, extra=None)


__all__ = ["add_adapter"]
