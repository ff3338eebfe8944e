"""One conversion for every pair of formats: source -> [adapters merged] -> [quantized] -> destination.

:func:`convert` finds the source's format from its files (:func:`ckptbridge.formats.detect`) and
the destination's from ``to`` (or a ``.gguf`` name), opens the source as its family's rows,
puts the merge stage around them when adapters are given, and hands the rows to the
destination's writer, all on one streaming engine with one memory budget. A model goes to every
model format and an adapter (with its ``base``) to every adapter format; no function is written
per pair. Every option is a format's (:data:`ckptbridge.formats.OPTIONS`): one a pair does not
use is refused in one line before anything is read.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

from ckptbridge import formats, hub, options
from ckptbridge.errors import ConfigError, MismatchError
from ckptbridge.formats import ADAPTER, MODEL, Format
from ckptbridge.report import Report
from ckptbridge.stream import Engine, Parallelism


def _given(opts: dict[str, Any]) -> dict[str, Any]:
    known = set(formats.OPTIONS) | {o.name for o in formats.COMMON}
    unknown = sorted(set(opts) - known)
    if unknown:
        raise ConfigError(f"{unknown[0]}: not an option of convert; the options are {', '.join(sorted(known))} "
                          "(`ckptbridge formats` says which format takes which)")
    return {k: v for k, v in opts.items() if v is not None}


def _takers(name: str, read: bool) -> list[str]:
    return [f.name for f in formats.FORMATS.values() if name in (f.read_options if read else f.write_options)]


def _check_applies(opts: dict[str, Any], source: Format, dest: Format, adapters: bool) -> None:
    """Refuse, in one line, an option neither the source's format reads with nor the destination's
    writes with (``step`` and ``alpha`` also go to the adapters merged)."""
    for name in opts:
        if name in {o.name for o in formats.COMMON} or name in source.read_options or name in dest.write_options:
            continue
        if adapters and name in ("step", "alpha", "as_trained"):
            continue
        if name == "as_trained":
            raise ConfigError("--as-trained applies to a merge: give the QLoRA adapter with --adapter")
        if name == "quantize" and dest.name == "hf":
            continue
        opt = formats.OPTIONS[name]
        where = [f"reading {n}" for n in _takers(name, True)] + [f"writing {n}" for n in _takers(name, False)]
        raise ConfigError(f"{opt.cli} is an option of {' and '.join(where) or 'nothing'}; this conversion is "
                          f"{source.name} -> {dest.name}: drop it")


def _check_values(opts: dict[str, Any]) -> None:
    """The engine's options, checked before any input is looked at."""
    options.workers("workers (--workers)", opts.get("workers"))
    for name, flag in (("memory_budget", "--memory-budget"), ("chunk_size", "--chunk-size"),
                       ("max_shard_size", "--max-shard-size")):
        if name in opts:
            options.size(f"{name} ({flag})", opts[name])
    for name in ("quantize", "target", "kv", "outtype", "dtype"):
        choices = formats.OPTIONS[name].choices
        if name in opts and choices is not None:
            options.choice(f"{name} ({formats.OPTIONS[name].cli})", opts[name], choices)


def parallelism(opts: dict[str, Any], orbax: bool) -> tuple[int, bool, Parallelism]:
    """The conversion's piece size, whether pieces are Orbax chunks, and its workers and budget."""
    chunk_size = opts.get("chunk_size", options.DEFAULT_CHUNK_SIZE)
    if orbax:
        chunk_bytes, parallel = Parallelism.for_chunks(chunk_size, opts.get("workers"), opts.get("memory_budget"))
        return chunk_bytes, True, parallel
    return options.size("chunk_size", chunk_size), False, Parallelism.of(opts.get("workers"), opts.get("memory_budget"))


def open_model(src: str, fmt: Format, opts: dict[str, Any], *, towers: str = "refuse",
               quantized_fix: str | None = None):
    """``src`` opened as the rows of a model of format ``fmt`` with the read options in ``opts``;
    a multimodal model's towers as the destination takes them (``towers``: keep, drop or refuse;
    ``skip_multimodal`` in ``opts`` drops them)."""
    read = {k: v for k, v in opts.items() if k in fmt.read_options and k != "skip_multimodal"}
    drop = towers == "drop" or bool(opts.get("skip_multimodal"))
    if fmt.name == "hf":
        read.update(keep_towers=towers == "keep", quantized_fix=quantized_fix, skip_multimodal=drop)
        return fmt.open(src, **read)
    rows = fmt.open(src, **read)
    if drop:
        rows.drop_towers()
    return rows


def check_towers(rows, dest: Format, dst: str) -> None:
    """Refuse, in one line, towers the destination's format has no place for (before anything is written)."""
    why = dest.tower_refusal(rows)
    if why:
        from ckptbridge.errors import UnsupportedError

        held = " and ".join(dict.fromkeys(e.tower or "" for e in rows.tower_entries))
        raise UnsupportedError(f"{dst}: {why} ({rows.path} has {held} towers); pass --skip-multimodal to write the "
                               "text model without them")


def open_adapter(src: str, base, *, step: int | None = None, alpha: float | None = None, fmt: Format | None = None):
    """``src`` (a local path or ``gs://``) opened as an adapter of ``base``, its format found from its files."""
    fmt = fmt or formats.detect(src, step)
    if fmt.kind != ADAPTER:
        raise ConfigError(f"{src}: a {fmt.name} model, not an adapter; give a PEFT adapter or a Tunix or MaxText "
                          "LoRA checkpoint")
    if fmt.name == "peft" and (alpha is not None or step is not None):
        raise ConfigError(f"{src}: alpha/step (--alpha, --step) apply to Orbax LoRA checkpoints; "
                          "a PEFT adapter records its own")
    return fmt.open(src, base, step=step, alpha=alpha)


def merged(rows, adapters: Sequence[str], *, step: int | None = None, alpha: float | None = None,
           as_trained: bool = False):
    """``rows`` with every adapter's deltas added (the merge stage), the factors read now. With
    ``as_trained``, the weights of the adapters' modules are first the QLoRA base they were trained
    against (:class:`ckptbridge.merge.AsTrained`, from the adapters' ``base_quant`` metadata)."""
    from ckptbridge.lora.base import make_base
    from ckptbridge.merge import AsTrained, Deltas, Merged, check_trained_base, collect_deltas

    base = make_base(rows.path, rows.cfg, rows.spec, rows.prefix)
    keys = set(rows.hf_keys())
    deltas: Deltas = {}
    quant: list[dict] = []
    held = getattr(rows, "base_quant", None)  # a QLoRA base stored quantized: its weights are as trained
    for name in adapters:
        with open_adapter(name, base, step=step, alpha=alpha) as ad:
            collect_deltas(keys, ad, name, deltas)
            found = ad.base_quant
            if as_trained and not found:
                raise ConfigError(f"--as-trained: {name} was not trained on a quantized base (it records no "
                                  "base_quant); merge it without --as-trained")
            if found:
                quant.append(found)
                if as_trained and held:
                    _check_held(rows.path, held, found, name)
                elif as_trained:
                    check_trained_base(rows, found, name)
    if as_trained and any(_as_trained_fields(q) != _as_trained_fields(quant[0]) for q in quant):
        raise ConfigError("--as-trained: the adapters were trained on differently quantized bases; merge them "
                          "one at a time")
    if not as_trained or held:
        return Merged(rows, deltas)
    contracted = {base.weight_key(name): tuple(mod.shapes(1)["a_tunix"][:-1])
                  for name, (mod, _) in base.by_hf_module().items()}
    return Merged(rows, deltas, AsTrained(**_as_trained_fields(quant[0]), contracted=contracted))


def _check_quantize(dest: Format, quantize: str | None, tile: int | None) -> None:
    """``--quantize`` (and ``--tile``) as the destination takes them, refused in one line otherwise."""
    if dest.name == "tunix":
        if quantize is not None and quantize not in options.QLORA_SCHEMES:
            raise ConfigError(f"--quantize {quantize}: a Tunix QLoRA base is quantized as "
                              f"{', '.join(options.QLORA_SCHEMES)} (qwix's types)")
        if tile is not None and quantize is None:
            raise ConfigError("--tile: the tiles of --quantize; give the scheme (--quantize int8|int4|nf4)")
        if tile is not None and tile < 1:
            raise ConfigError(f"--tile {tile}: a tile is at least 1 input")
    elif quantize is not None and dest.name in ("hf", "compressed-tensors") and quantize not in options.QUANT_SCHEMES:
        raise ConfigError(f"--quantize {quantize}: {dest.name} is written as {' or '.join(options.QUANT_SCHEMES)}; "
                          f"{quantize} is a QLoRA base's (--to tunix)")


def _check_held(path: str, held: dict, found: dict, adapter: str) -> None:
    """Refuse, in one line, an adapter trained on another quantization or another base than the
    pre-quantized base ``path`` holds."""
    if _as_trained_fields(held) != _as_trained_fields(found):
        f, h = _as_trained_fields(found), _as_trained_fields(held)
        raise MismatchError(f"--as-trained: {adapter} was trained on a base held as {f}; {path} holds {h}")
    if held.get("base_digest") and found.get("base_digest") and held["base_digest"] != found["base_digest"]:
        raise MismatchError(f"--as-trained: {path} was quantized from another base than the one {adapter} was trained "
                            f"on (digest {held['base_digest']}, the run recorded {found['base_digest']})")


def _as_trained_fields(record: dict) -> dict:
    return {"scheme": record.get("scheme"), "tile": record.get("tile"),
            "param_dtype": record.get("param_dtype") or "float32"}


def _local(ref: str, patterns, revision: str | None, what: str) -> str:
    return hub.local(ref, patterns, revision=revision, what=what)


def convert(src: str, dst: str, *, to: str | None = None, adapter: str | Sequence[str] | None = None,
            quantize: str | None = None, base: str | None = None, overwrite: bool = False,
            progress: bool | None = None, source_format: str | None = None, direction: str | None = None,
            desc: str | None = None, **format_options: Any) -> Report:
    """Convert the checkpoint ``src`` into ``dst`` in the format ``to``; returns the writer's report.

    ``src`` is a model (HF directory, Tunix or MaxText Orbax checkpoint, GGUF file) or an adapter
    (PEFT directory, Tunix/qwix or MaxText LoRA checkpoint), local, on Cloud Storage (``gs://``)
    or a Hub id, its format found from its files (``source_format`` pins it). ``to``: a format of
    :data:`ckptbridge.formats.FORMATS` of the same kind (default: what ``dst``'s name says, a
    ``.gguf`` file). A model may have ``adapter`` (one or several) merged on the way and the result
    ``quantize``\\ d (``int8``, ``fp8``: compressed-tensors); an adapter needs its HF ``base``
    (config and key names; weights are not read). ``format_options`` are the formats' options
    (:data:`ckptbridge.formats.OPTIONS`, :data:`ckptbridge.formats.COMMON`; ``ckptbridge formats``
    lists which format takes which). ``direction`` and ``desc`` name the conversion in the report
    and the progress bar. Nothing is written at ``dst`` unless the whole conversion succeeds.

    Example::

        convert("base-model", "merged.gguf", adapter="runs/31b/checkpoints", outtype="q8_0")
    """
    t0 = time.perf_counter()
    adapters = [adapter] if isinstance(adapter, str) else list(adapter or [])
    opts = _given({**format_options, "quantize": quantize})
    _check_values(opts)
    revision = opts.get("revision")
    source_kind = ADAPTER if base is not None and not adapters else MODEL
    src = _local(src, hub.ADAPTER if source_kind == ADAPTER else hub.MODEL,
                 revision if source_kind == MODEL else None, "adapter" if source_kind == ADAPTER else "model")
    fmt = formats.get(source_format) if source_format else formats.detect(src, opts.get("step"))
    if not fmt.reads:
        raise ConfigError(f"{src}: ckptbridge writes {fmt.name} but does not read it")
    dest = formats.destination(dst, to, fmt.kind)
    if not dest.writes:
        raise ConfigError(f"--to {dest.name}: ckptbridge reads {dest.name} but does not write it")
    if dest.kind != fmt.kind:
        holds = "an adapter" if dest.kind == ADAPTER else "a model"
        kinds = ", ".join(n for n, f in formats.FORMATS.items() if f.writes and f.kind == fmt.kind)
        raise ConfigError(f"{src}: a {fmt.name} {fmt.kind}; --to {dest.name} holds {holds}: write it as one of {kinds}")
    if dest.name == "compressed-tensors" and quantize is None:
        raise ConfigError("--to compressed-tensors: say the scheme with --quantize int8|fp8")
    _check_quantize(dest, quantize, opts.get("tile"))
    if fmt.kind == ADAPTER and adapters:
        raise ConfigError(f"{src}: an adapter; --adapter merges adapters into a model")
    if fmt.kind == MODEL and base is not None:
        raise ConfigError(f"{src}: a {fmt.name} model; --base names the HF base of an adapter SRC: drop it (adapters "
                          "merged into the model go with --adapter)")
    _check_applies(opts, fmt, dest, bool(adapters))
    if adapters:
        adapters = [_local(a, hub.ADAPTER, None, "adapter") for a in adapters]
    config = opts.get("config")
    if fmt.kind == ADAPTER:
        if base is None:
            raise ConfigError(f"{src}: a {fmt.name} adapter; pass base (--base) with its HF base model directory")
        base = _local(base, hub.CONFIG, revision, "base model")
    chunk_bytes, chunked, parallel = parallelism(opts, fmt.kind == MODEL and (fmt.orbax or dest.orbax))
    from ckptbridge.io.atomic import check_destination

    check_destination(dst, [src, *adapters, *([base] if base else []), *([config] if config else [])], overwrite)
    write_opts = {k: v for k, v in opts.items() if k in dest.write_options or (k == "quantize" and dest.name == "hf")}
    if quantize is not None and dest.name == "tunix":  # a QLoRA base: qwix quantizes against the Tunix model
        from ckptbridge.qlora_leaves import quantized_leaves

        write_opts["quantized_leaves"] = quantized_leaves
    with contextlib.ExitStack() as stack:
        engine: Engine = stack.enter_context(parallel.engine(f"{fmt.name}-{dest.name}"))
        req = _request(src, dst, fmt, dest, engine, chunk_bytes, chunked, overwrite, progress, direction, desc,
                       adapters, opts.get("step"), t0)
        if fmt.kind == ADAPTER:
            from ckptbridge.lora.base import open_base

            ad = stack.enter_context(open_adapter(src, open_base(str(base)), step=opts.get("step"),
                                                  alpha=opts.get("alpha"), fmt=fmt))
            return dest.write(ad, dst, req, **write_opts)
        fix = None
        if adapters:
            fix = "merge into the unquantized model it was made from (--quantize quantizes the result)"
        elif quantize is not None:
            fix = "quantize the unquantized model it was made from"
        rows = stack.enter_context(open_model(src, fmt, opts, towers="keep" if dest.towers == "refuse" else dest.towers,
                                              quantized_fix=fix))
        check_towers(rows, dest, dst)
        held = getattr(rows, "base_quant", None)
        if held and not (adapters and opts.get("as_trained")):
            from ckptbridge.errors import UnsupportedError

            raise UnsupportedError(
                f"{src}: a QLoRA base (its LoRA targets' weights stored as qwix's {held.get('scheme')} arrays); "
                "convert the model it was quantized from, or merge an adapter trained on it with --adapter ... "
                "--as-trained")
        if quantize is not None and dest.name != "tunix":  # what cannot be quantized is refused before the adapters
            from ckptbridge.formats.hf import quantization_plan

            quantization_plan(rows, quantize, src)
        if adapters:
            from threadpoolctl import threadpool_limits

            rows = merged(rows, adapters, step=opts.get("step") if "step" not in fmt.read_options else None,
                          alpha=opts.get("alpha"), as_trained=bool(opts.get("as_trained")))
            stack.enter_context(threadpool_limits(1, user_api="blas"))  # one BLAS thread per worker: 1.5x faster
        return dest.write(rows, dst, req, **write_opts)


def _request(src: str, dst: str, fmt: Format, dest: Format, engine: Engine, chunk_bytes: int, chunked: bool,
             overwrite: bool, progress: bool | None, direction: str | None, desc: str | None, adapters: list[str],
             step: int | None, t0: float):
    from ckptbridge.rows import Request

    return Request(source=src, destination=dst, direction=direction or f"{fmt.name}-to-{dest.name}", engine=engine,
                   chunk_bytes=chunk_bytes, chunked=chunked, overwrite=overwrite, progress=progress,
                   desc=desc or f"{fmt.name} -> {dest.name}", adapters=tuple(adapters), adapter_step=step, t0=t0)


__all__ = ["check_towers", "convert", "merged", "open_adapter", "open_model", "parallelism"]
