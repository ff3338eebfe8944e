"""The ``ckptbridge`` command line, built from the format registry (:mod:`ckptbridge.formats`).

    ckptbridge convert SRC DST [--to FORMAT] [--adapter ADAPTER ...] [--quantize int8|fp8] [--base BASE] [...]
    ckptbridge formats [--json]
    ckptbridge merge BASE ADAPTER DST [--quantize int8|fp8]
    ckptbridge quantize SRC DST --scheme int8|fp8
    ckptbridge inspect PATH [--json]
    ckptbridge verify logits|quantized|tensors|gguf|adapter|served ...
    ckptbridge adapter combine|resize|extract ...
    ckptbridge env [--json]

Every option of ``convert`` is a format's (``ckptbridge formats`` says whose); one the conversion's
formats do not take is refused. The verbs of earlier releases (``convert safetensors-to-orbax``,
``convert orbax-to-peft``, ``convert to-gguf``, ...: :data:`ALIASES`) are ``convert`` with their
formats pinned. Errors end in one line on stderr (``ckptbridge: error: ...``) and a non-zero exit
code that tells the kind of failure (see ``docs/reliability.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Sequence

from ckptbridge import __version__, deps, formats
from ckptbridge.errors import EXIT_CODES_HELP as EPILOG
from ckptbridge.errors import CkptBridgeError, ConfigError
from ckptbridge.options import parse_size
from ckptbridge.report import emit as _emit


@dataclasses.dataclass(frozen=True)
class Alias:
    """A verb of earlier releases: ``convert`` from ``source`` (None: found from the files) to ``to``."""

    help: str
    source: str | None
    to: str
    positionals: tuple[str, ...] = ("src", "dst")
    renames: tuple[tuple[str, str], ...] = ()  # (flag's option, convert's option)
    defaults: tuple[tuple[str, object], ...] = ()
    extra: tuple[str, ...] = ()  # options beyond the two formats' (and convert's adapter options)
    needs: str | None = None  # the extra its inputs need beyond the two formats' (Orbax LoRA sources)


ALIASES: dict[str, Alias] = {
    "safetensors-to-orbax": Alias("HF model directory -> Orbax checkpoint of the Tunix state", "hf", "tunix"),
    "orbax-to-safetensors": Alias("Orbax checkpoint -> HF model directory", "tunix", "hf"),
    "safetensors-to-maxtext": Alias("HF model directory -> MaxText checkpoint", "hf", "maxtext"),
    "maxtext-to-safetensors": Alias("MaxText checkpoint -> HF model directory", "maxtext", "hf"),
    "orbax-to-maxtext": Alias("Orbax checkpoint of Tunix parameters -> MaxText checkpoint", "tunix", "maxtext"),
    "maxtext-to-orbax": Alias("MaxText checkpoint -> Orbax checkpoint of the Tunix parameters", "maxtext", "tunix"),
    "orbax-to-peft": Alias("Tunix/qwix or MaxText LoRA checkpoint -> PEFT adapter", None, "peft",
                           extra=("base", "step", "alpha"), needs="orbax"),
    "peft-to-orbax": Alias("PEFT adapter -> Tunix/qwix LoRA checkpoint", "peft", "tunix-lora",
                           renames=(("step", "save_step"),), extra=("base", "step")),
    "peft-to-maxtext": Alias("PEFT adapter -> MaxText LoRA checkpoint", "peft", "maxtext-lora", extra=("base",)),
    "to-gguf": Alias("model (any format, or base + LoRA) -> GGUF file for ggml's runtimes", None, "gguf",
                     extra=("adapter", "step", "alpha", "config")),
    "adapter-to-gguf": Alias("LoRA adapter (PEFT, Tunix or MaxText) -> GGUF LoRA (--lora, Ollama ADAPTER)", None,
                             "gguf-lora", extra=("base", "step", "alpha"), defaults=(("outtype", "f32"),)),
    "merge": Alias("merge a LoRA adapter into the base model (an HF directory)", None, "hf",
                   ("base", "adapter", "dst"), extra=("step", "alpha", "as_trained")),
    "quantize": Alias("quantize an HF model to int8 or fp8 (compressed-tensors, for vLLM)", "hf", "hf",
                      renames=(("scheme", "quantize"),), extra=("scheme",)),
}
SPECIAL = {  # the options that are not a format's: (flag, help)
    "adapter": ("--adapter", "a LoRA adapter (PEFT, Tunix/qwix or MaxText LoRA; local, gs:// or a Hub id) merged into "
                "the model on the way; repeat it to merge several"),
    "base": ("--base", "the adapter's HF base model directory or Hub id (its config and key names; weights are not "
             "read)"),
    "scheme": ("--scheme", "int8 (W8A8) or fp8 (FP8_DYNAMIC)"),
}


def _quiet_libraries(cpu: bool = True) -> None:
    """Quiet third-party logging; with ``cpu``, JAX on the CPU unless JAX_PLATFORMS says otherwise
    (conversions and checks need no accelerator, and must not take one from a running job)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if cpu:
        os.environ["JAX_PLATFORMS"] = os.environ.get("JAX_PLATFORMS") or "cpu"
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:
        pass
    for name in ("absl", "jax", "orbax", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)


def emit(args, report) -> None:
    """Print a verb's report: ``--json`` as JSON, else its summary."""
    _emit(report, getattr(args, "json", False))


def _add_option(sp, opt: formats.Option, seen: set[str]) -> None:
    if opt.cli not in seen:
        seen.add(opt.cli)
        opt.add_to(sp)


def _options_of(names, sp, seen: set[str]) -> None:
    for name in names:
        if name in SPECIAL:
            flag, text = SPECIAL[name]
            if flag not in seen:
                seen.add(flag)
                if name == "adapter":
                    sp.add_argument(flag, action="append", metavar="ADAPTER", help=text)
                else:
                    sp.add_argument(flag, required=name == "scheme", choices=formats.SCHEMES if name == "scheme"
                                    else None, help=text)
        else:
            _add_option(sp, formats.OPTIONS[name], seen)


def _output(sp, seen: set[str]) -> None:
    for opt in formats.COMMON:
        _add_option(sp, opt, seen)
    sp.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    sp.add_argument("--quiet", action="store_true", help="no progress bar")
    sp.add_argument("--json", action="store_true", help="print the report as JSON")


def add_convert(sub) -> argparse.ArgumentParser:
    sp = sub.add_parser(
        "convert", help="convert a checkpoint or adapter from any format to any other", epilog=EPILOG + (
            " The verbs of earlier releases: convert " + ", ".join(a for a in ALIASES if a not in ("merge", "quantize"))
            + " SRC DST (see convert DIRECTION --help)."),
        description="Convert SRC (a model: HF directory, Tunix or MaxText Orbax checkpoint, GGUF file; or an "
        "adapter: PEFT directory, Tunix/qwix or MaxText LoRA checkpoint; local, gs:// or a Hub id) into DST in "
        "the format --to names (or a .gguf file), streaming, exactly. A model may have adapters merged and be "
        "quantized on the way; an adapter needs --base. `ckptbridge formats` lists the formats and their options.")
    sp.add_argument("src", metavar="SRC", help="the checkpoint or adapter to convert")
    sp.add_argument("dst", metavar="DST", help="what to create (a directory; a file for GGUF)")
    sp.add_argument("--to", metavar="FORMAT", help="the destination's format: "
                    + ", ".join(n for n, f in formats.FORMATS.items() if f.writes))
    seen: set[str] = set()
    _options_of(("adapter", "base", "quantize", "as_trained"), sp, seen)
    _options_of([o for f in formats.FORMATS.values() for o in f.read_options + f.write_options], sp, seen)
    _output(sp, seen)
    sp.set_defaults(func=cmd_convert, alias=None, huge_pages=True)
    return sp


def add_alias(sub, name: str, alias: Alias) -> None:
    sp = sub.add_parser(name, help=alias.help, epilog=EPILOG,
                        description=f"{alias.help}: `ckptbridge convert SRC DST --to {alias.to}`"
                        + (" --quantize SCHEME" if name == "quantize" else " --adapter ADAPTER" if name == "merge"
                           else "") + ", with the formats of earlier releases' verb.")
    for pos in alias.positionals:
        sp.add_argument(pos, metavar=pos.upper())
    seen: set[str] = set()
    src = formats.FORMATS[alias.source].read_options if alias.source else ()
    dest = [o for o in formats.FORMATS[alias.to].write_options if not (name == "quantize" and o == "quantize")]
    _options_of([*alias.extra, *src, *dest], sp, seen)
    _output(sp, seen)
    sp.set_defaults(func=cmd_convert, alias=name, extra=_needs(alias), huge_pages=_needs(alias) == "orbax")


def _needs(alias: Alias) -> str | None:
    orbax = any(formats.FORMATS[f].orbax for f in (alias.source, alias.to) if f)
    return alias.needs or ("orbax" if orbax else None)


def _size(args, name: str):
    """A size flag parsed here, at the edge: a ConfigError (exit 8) naming the flag when it is not one."""
    value = getattr(args, name, None)
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as e:
        raise ConfigError(f"--{name.replace('_', '-')}: {e}") from None


def cmd_convert(args) -> int:
    from ckptbridge.conversion import convert

    alias = ALIASES.get(args.alias) if args.alias else None
    names = {o.name for o in formats.COMMON} | set(formats.OPTIONS) | {"scheme"}
    kw = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    for n in ("chunk_size", "memory_budget", "max_shard_size"):
        if n in kw:
            kw[n] = _size(args, n)
    for old, new in alias.renames if alias else ():
        if old in kw:
            kw[new] = kw.pop(old)
    for n, v in alias.defaults if alias else ():
        kw.setdefault(n, v)
    adapters = getattr(args, "adapter", None)
    adapters = [adapters] if isinstance(adapters, str) else adapters
    src = args.base if args.alias == "merge" else args.src
    base = getattr(args, "base", None) if args.alias != "merge" else None
    emit(args, convert(src, args.dst, to=getattr(args, "to", None) or (alias.to if alias else None),
                       adapter=adapters, base=base, source_format=alias.source if alias else None,
                       direction=args.alias, desc=args.alias.replace("-to-", " -> ").replace("-", " ") if alias
                       else None, overwrite=args.overwrite,
                       progress=False if args.quiet else None, **kw))
    return 0


def cmd_formats(args) -> int:
    if args.json:
        print(json.dumps(formats.table(), indent=2))
        return 0
    print(f"{'format':<20}{'kind':<9}{'reads':<7}{'writes':<8}description")
    for f in formats.FORMATS.values():
        print(f"{f.name:<20}{f.kind:<9}{'yes' if f.reads else '-':<7}{'yes' if f.writes else '-':<8}{f.title}")
    print("\nEvery format that reads goes to every format of its kind that writes; a model takes --adapter "
          "(merged) and --quantize (hf, compressed-tensors) on the way.\n\noptions (reading / writing), exactness:")
    for f in formats.FORMATS.values():
        opts = " / ".join(", ".join(formats.OPTIONS[o].cli for o in names) or "-"
                          for names in (f.read_options, f.write_options))
        print(f"  {f.name}: {opts}; {f.bound or 'bitwise'}")
    return 0


def cmd_inspect(args) -> int:
    from ckptbridge.inspect import inspect_path

    emit(args, inspect_path(args.path, step=args.step, revision=args.revision))
    return 0


def cmd_env(args) -> int:
    emit(args, deps.environment(args.verbs, accelerators=not args.no_accelerators))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from ckptbridge.cli_adapter import add_adapter
    from ckptbridge.cli_verify import add_verify

    p = argparse.ArgumentParser(prog="ckptbridge", epilog=EPILOG, description="Convert LLM checkpoints and LoRA "
                                "adapters between HF, Tunix, MaxText, GGUF and PEFT, exactly and streaming.")
    p.add_argument("--version", action="version", version=f"ckptbridge {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_convert(sub)
    fp = sub.add_parser("formats", help="what reads and writes what", epilog=EPILOG,
                        description="The formats ckptbridge reads and writes, their options and how exact each is.")
    fp.add_argument("--json", action="store_true", help="print the table as JSON")
    fp.set_defaults(func=cmd_formats)
    for name in ("merge", "quantize"):
        add_alias(sub, name, ALIASES[name])
    ip = sub.add_parser("inspect", help="say what a checkpoint is", epilog=EPILOG,
                        description="Identify PATH (HF model, Orbax weights, Orbax LoRA, MaxText, PEFT adapter, GGUF "
                        "model or adapter) and summarise it: family or architecture, layer kinds, dtypes or tensor "
                        "types, parameter count, tokenizer, metadata.")
    ip.add_argument("path", metavar="PATH", help="a checkpoint or adapter (local, gs://, a .safetensors or .gguf "
                    "file, or a Hub id)")
    ip.add_argument("--step", type=int, help="step of a checkpoint-manager root (default: latest)")
    ip.add_argument("--revision", metavar="REV", help="branch, tag or commit of PATH when it is a Hub id")
    ip.add_argument("--json", action="store_true", help="print the report as JSON")
    ip.set_defaults(func=cmd_inspect, extra=None)
    add_verify(sub)
    add_adapter(sub)
    ep = sub.add_parser("env", help="this environment, for bug reports", epilog=EPILOG,
                        description="Print what a bug report needs: Python, platform, CPUs, memory, the version of "
                        "every package ckptbridge uses against its supported range, which extras and verbs work "
                        "here, and the accelerators JAX and torch see.")
    ep.add_argument("--json", action="store_true", help="print the report as JSON")
    ep.add_argument("--no-accelerators", action="store_true", help="do not import jax and torch to list devices")
    ep.set_defaults(func=cmd_env)
    verbs = {}
    for name, sp in sub.choices.items():
        checks = [a for a in sp._actions if isinstance(a, argparse._SubParsersAction)]
        leaves: dict = checks[0].choices if checks else {"": sp}
        for leaf_name, leaf in leaves.items():
            verbs[f"{name} {leaf_name}".strip()] = leaf.get_default("extra")
    verbs.update({f"convert {a}": _needs(x) for a, x in ALIASES.items() if a not in ("merge", "quantize")})
    for verb, needs in INPUT_EXTRAS.items():
        verbs.update({f"{verb} ({what})": extra for what, extra in needs})
    p.set_defaults(verbs=verbs)
    return p


# Verbs that need more than their own extra for some inputs: (which inputs, the extra).
INPUT_EXTRAS = {
    "convert": [("Orbax checkpoint or adapter", "orbax"), ("Hub id", "hub"), ("gs:// path", "gcs")],
    "merge": [("Orbax adapter", "orbax")],
    "inspect": [("Orbax checkpoint", "orbax")],
    "verify gguf": [("Orbax checkpoint or adapter", "orbax")],
    "verify adapter": [("Orbax adapter", "orbax"), ("live and exact checks", "verify")],
}


def _alias_parser(name: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckptbridge convert", epilog=EPILOG)
    add_alias(p.add_subparsers(dest="direction", required=True), name, ALIASES[name])
    return p


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """``convert DIRECTION ...`` of an earlier release goes to its alias, the rest to the parser."""
    if len(argv) >= 2 and argv[0] == "convert" and argv[1] in ALIASES and argv[1] not in ("merge", "quantize"):
        args = _alias_parser(argv[1]).parse_args(argv[1:])
        args.verbs = build_parser().get_default("verbs")
        return args
    return build_parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else list(argv))
    if argv is None and getattr(args, "huge_pages", False):
        from ckptbridge import hugepages

        if hugepages.wanted():
            hugepages.reexec(sys.argv[1:])
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    _quiet_libraries(cpu=args.func is not cmd_env)  # env reports the accelerators JAX finds by itself
    extra = getattr(args, "extra", None)
    try:
        if args.func is not cmd_env:  # env reports what is wrong instead
            deps.require(extra)
        return args.func(args)
    except CkptBridgeError as e:
        print(f"ckptbridge: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("ckptbridge: interrupted; the destination was not written", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout went away (`ckptbridge inspect X | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as e:  # a missing module, a version skew at import, or an internal error
        line = deps.missing_line(e, extra) if isinstance(e, ModuleNotFoundError) else None
        line = line or deps.import_failure(e, extra)
        if os.environ.get("CKPTBRIDGE_DEBUG"):
            raise
        if line is not None:
            print(f"ckptbridge: error: {line}", file=sys.stderr)
            return 8
        print(f"ckptbridge: internal error: {type(e).__name__}: {e} (set CKPTBRIDGE_DEBUG=1 for a traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
