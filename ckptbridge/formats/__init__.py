"""Every checkpoint format ckptbridge reads or writes, in one registry.

A format is one module (or small package) under ``ckptbridge/formats/``: how to recognise its
files, how to open them as the family's rows (a model, :class:`ckptbridge.rows.ModelRows`; an
adapter, :class:`ckptbridge.lora.factors.AdapterRows`) and how to write such rows. The registry
says, as data, what each format is, which of its options apply when reading or writing, and how
exact each way through it is; the CLI, ``ckptbridge formats``, ``inspect`` and the test matrix
all read it. It imports no format module (they are loaded by name when used), so that
``--help`` stays light. Adding a format: its module, its record here, its tests in the matrix.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from typing import Any

from ckptbridge import options

MODEL, ADAPTER = "model", "adapter"


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of a format (or of every conversion): its Python name, CLI flag, help, and how
    argparse takes it (``kind``: ``str``, ``int``, ``float``, ``size`` or ``flag``)."""

    name: str
    help: str
    kind: str = "str"
    default: Any = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    flag: str | None = None  # default: --name-with-dashes (for a flag option that negates: --no-x)

    @property
    def cli(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    def add_to(self, parser) -> None:
        """This option as an argument of the argparse ``parser``."""
        if self.kind == "flag":
            parser.add_argument(self.cli, dest=self.name, action="store_const",
                                const=not self.default if self.default else True, default=None, help=self.help)
            return
        kind = {"int": int, "float": float}.get(self.kind, str)
        default = f" (default {self.default})" if self.default is not None else ""
        parser.add_argument(self.cli, dest=self.name, type=kind, choices=self.choices, metavar=self.metavar,
                            help=self.help + default)


@dataclasses.dataclass(frozen=True)
class Format:
    """A checkpoint format: ``kind`` (``model`` or ``adapter``), what it is, the module that reads
    and writes it, the options it takes when read and when written, and how exact writing it is
    (``bound``: None when a round trip through it is bitwise with ``lossless`` options, else what
    is lost and why)."""

    name: str
    kind: str
    title: str
    module: str
    reads: bool = True
    writes: bool = True
    read_options: tuple[str, ...] = ()
    write_options: tuple[str, ...] = ()
    orbax: bool = False  # stored through Orbax/TensorStore (pieces are stored chunks; codec threads)
    # a multimodal model's vision/audio towers: "keep" (written with the model; the format's module
    # may still refuse a tower it has no place for: ``tower_refusal``), "drop" (the text model, as the
    # format's own converter writes it) or "refuse" (unless --skip-multimodal says to drop them)
    towers: str = "refuse"
    suffix: str | None = None  # the file name ending that names it as a destination
    bound: str | None = None
    lossless: tuple[tuple[str, Any], ...] = ()  # write options for the most exact output
    read_module: str | None = None  # where the reader lives, when not in ``module``
    reader: str = "open_source"
    writer: str = "write"

    def impl(self):
        return importlib.import_module(self.module)

    def open(self, src: str, *args, **options):
        return getattr(importlib.import_module(self.read_module or self.module), self.reader)(src, *args, **options)

    def write(self, rows, dst: str, req, **options):
        return getattr(self.impl(), self.writer)(rows, dst, req, **options)

    def tower_refusal(self, rows) -> str | None:
        """Why this format cannot hold the towers ``rows`` carries (one line), or None when it can."""
        if not rows.tower_entries or self.towers == "drop":
            return None
        names = list(dict.fromkeys(e.tower for e in rows.tower_entries))
        if self.towers == "refuse":
            return f"{self.name} has no place for the {' and '.join(names)} tower{'s' * (len(names) > 1)}"
        fn = getattr(self.impl(), "tower_refusal", None)
        return fn(rows.spec, rows.cfg, names) if fn is not None else None

    def inexact(self, spec, cfg, **options) -> dict[str, str]:
        """The family's rows that a round trip through this format (written with ``options``) does
        not give back bit for bit, each with why (the pair's bound, from the family's spec); a
        tower's rows as ``tower:rule``."""
        fn = getattr(self.impl(), "inexact_rules", None)
        return fn(spec, cfg, **options) if fn is not None else {}


SCHEMES = options.QUANT_SCHEMES
OUTTYPES = ("auto", "f32", "f16", "bf16", "q8_0")  # the GGUF writer's (formats.gguf.model.OUTTYPES) and auto

OPTIONS: dict[str, Option] = {o.name: o for o in (
    # reading
    Option("config", "the model's HF config.json (or its directory) for a checkpoint that does not carry it (a "
           "GGUF file, an Orbax or MaxText checkpoint not written by ckptbridge); non-weight files beside it go "
           "with the model", metavar="HF_CONFIG"),
    Option("step", "step of a checkpoint-manager root (default: the latest)", "int", metavar="N"),
    Option("skip_multimodal", "leave out a multimodal checkpoint's vision/audio towers (default: they are converted "
           "with the text model to every format that can hold them)", "flag"),
    Option("dtype", "dtype of the tensors read from a GGUF file (default: its weights' type; float32 for Q8_0)",
           choices=("float32", "float16", "bfloat16")),
    Option("alpha", "LoRA alpha of a Tunix or MaxText LoRA checkpoint that does not record it (scale = alpha / "
           "rank)", "float"),
    Option("as_trained", "merge into the base as a QLoRA run held it: each LoRA module's weight quantized and "
           "dequantized by qwix as the adapter's metadata records (scheme, tile, dtype), so that the merged model "
           "is the model trained; default: into the base as it is", "flag"),
    # writing
    Option("max_shard_size", "largest safetensors shard (units B, KB, MB, GB, KiB, MiB, GiB)", "size",
           options.DEFAULT_MAX_SHARD_SIZE,
           metavar="SIZE"),
    Option("quantize", "HF and compressed-tensors: int8: W8A8 (int8 weights, one scale per output channel, int8 "
           "activations per token at run time: vLLM on x86 CPUs, TPUs, GPUs); fp8: FP8_DYNAMIC (float8 e4m3 "
           "weights: Hopper/Ada GPUs), as llm-compressor writes it, the decoder's linear projections only. Tunix: "
           "int8, int4 or nf4: a QLoRA base, every LoRA target's weight stored as qwix's quantized arrays (what "
           "training with base_quant computes as it loads), for `python -m training --base`",
           choices=tuple(dict.fromkeys((*SCHEMES, *options.QLORA_SCHEMES)))),
    Option("tile", "with --to tunix --quantize: qwix's sub-channel tiles of this many inputs (training's "
           "base_quant_tile; default: one scale per output channel)", "int", metavar="N"),
    Option("base_id", "the base's Hub id for the model card or adapter config (default: found from a Hub cache "
           "path or the base's config.json)", metavar="ORG/NAME"),
    Option("tunix_version", "write the parameter layouts of this google-tunix version (default: the installed "
           "one), recorded in the checkpoint", metavar="VERSION"),
    Option("compression", "store the Orbax chunks without zstd: faster to write and read, larger on disk", "flag",
           True, flag="--no-compression"),
    Option("scan_layers", "stack the layers on axis 1, for MaxText's scan_layers=true (default: "
           "decoder/layers_{i})", "flag"),
    Option("vocab_size", "MaxText's vocab_size where its model config pads the embedding (default: what its "
           "model config gives for the model's vocabulary)", "int", metavar="N"),
    Option("outtype", "stored type of a GGUF file's weights (auto: the source's float type); norms and 1-D "
           "tensors are float32, rows not whole Q8_0 blocks float16, as ggml's converter stores them",
           default="bf16", choices=OUTTYPES),
    Option("tokenizer", "write no tokenizer into the GGUF file", "flag", True, flag="--no-tokenizer"),
    Option("name", "general.name of a GGUF file (default: the source directory's name)"),
    Option("target", "hf: for transformers/PEFT; vllm: also repeat k_proj LoRA as v_proj on k_eq_v layers and "
           "make rank/alpha uniform", default="hf", choices=options.TARGETS),
    Option("kv", "k/v with different lora_A: exact stacks them at rank r_k + r_v; svd keeps rank r with the "
           "best shared A and reports the error", default="exact", choices=options.KV_MODES),
    Option("save_step", "step number a Tunix LoRA checkpoint is written at", "int", 0, metavar="N"),
    Option("mmproj", "ggml's projector file of a multimodal model's vision/audio towers, beside the text GGUF "
           "(default: mmproj-<its name> in its directory)", metavar="PATH"),
)}

# Options of every conversion (the streaming engine's), never refused
COMMON = (
    Option("chunk_size", "a tensor larger than this is moved in row blocks of at most this size (an Orbax chunk "
           "each); memory is a few of them", "size", options.DEFAULT_CHUNK_SIZE, metavar="SIZE"),
    Option("workers", "threads that read, compute and write ahead (default: the usable cores, at most 4 where "
           "Orbax is read or written; the output does not depend on it)", "int", metavar="N"),
    Option("memory_budget", "bytes of pieces read, computed or being written at once, over all workers (peak "
           "memory within 1.5 GB at 31B scale)", "size", options.DEFAULT_MEMORY_BUDGET, metavar="SIZE"),
    Option("revision", "branch, tag or commit of the model when it is a Hub id (default: main; ORG/NAME@REV works "
           "for any Hub id)", metavar="REV"),
)

_Q8 = ("q8_0 is ggml's 8-bit quantization (a float16 scale per 32 values): values come back dequantized, each "
       "within half a step of its block")
_NORMS = ("families whose norms ggml stores as 1 + w get w back from 1 + w rounded to float32 "
          "(float16 for a float16 model): exact for bfloat16 weights of magnitude 2^-16 or more")

FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("hf", MODEL, "HF safetensors directory (transformers, vLLM)", "ckptbridge.formats.hf",
           read_options=("skip_multimodal",), write_options=("max_shard_size", "quantize", "base_id"), towers="keep"),
    Format("compressed-tensors", MODEL, "HF safetensors, int8 (W8A8) or fp8 (FP8_DYNAMIC) weights, as "
           "llm-compressor writes them", "ckptbridge.formats.hf", reads=False,
           write_options=("max_shard_size", "quantize", "base_id"), towers="keep",
           bound="the decoder's projections are quantized (one scale per output channel)"),
    Format("tunix", MODEL, "Orbax checkpoint of the Tunix parameters (Flax NNX)", "ckptbridge.formats.tunix",
           read_options=("config", "step", "skip_multimodal"),
           write_options=("tunix_version", "compression", "quantize", "tile"), orbax=True, towers="keep"),
    Format("maxtext", MODEL, "MaxText checkpoint (Orbax; scanned or not)", "ckptbridge.formats.maxtext.model",
           read_options=("config", "step", "skip_multimodal"), write_options=("scan_layers", "vocab_size",
                                                                                "compression"),
           orbax=True, towers="keep",
           bound="a tensor MaxText stores scaled by a family's value transform (an embedding times sqrt(hidden), a "
           "query times 1/sqrt(head_dim)) comes back within one rounding of its dtype"),
    Format("gguf", MODEL, "GGUF file (ggml's runtimes: its CLI and server, Ollama, LM Studio)",
           "ckptbridge.formats.gguf.model",
           read_options=("config", "dtype", "skip_multimodal", "mmproj"),
           write_options=("outtype", "tokenizer", "name", "mmproj"), suffix=".gguf",
           bound=f"{_NORMS}; {_Q8}", lossless=(("outtype", "auto"),), read_module="ckptbridge.formats.gguf.reader",
           towers="keep"),
    Format("peft", ADAPTER, "PEFT LoRA adapter directory (transformers, vLLM)", "ckptbridge.formats.peft",
           write_options=("target", "base_id")),
    Format("tunix-lora", ADAPTER, "Tunix/qwix LoRA checkpoint (Orbax)", "ckptbridge.formats.tunix_lora",
           read_options=("step", "alpha"), write_options=("kv", "save_step"), orbax=True),
    Format("maxtext-lora", ADAPTER, "MaxText LoRA checkpoint (qwix factors beside the kernels)",
           "ckptbridge.formats.maxtext.lora", read_options=("step", "alpha"),
           write_options=("scan_layers", "compression"), orbax=True,
           bound="one rank and alpha for every module: modules of other ranks or scales are padded and their "
           "scale folded into B"),
    Format("gguf-lora", ADAPTER, "GGUF LoRA adapter (ggml's --lora)", "ckptbridge.formats.gguf.adapter",
           reads=False, write_options=("outtype", "name"), suffix=".gguf"),
)}


def get(name: str) -> Format:
    """The format named ``name`` (a ConfigError naming the known ones otherwise)."""
    if name not in FORMATS:
        from ckptbridge.errors import ConfigError

        raise ConfigError(f"format {name!r}: not one ckptbridge knows; choose one of {', '.join(FORMATS)} "
                          "(`ckptbridge formats` lists them)")
    return FORMATS[name]


class Probe:
    """What a path looks like, found once for every format's ``detect(probe)``: a local file's first
    bytes, a directory's files, an Orbax checkpoint's item (``model_params`` or MaxText's
    ``items``, of the given or latest step) opened once."""

    ITEMS = ("model_params", "items")

    def __init__(self, path: str, step: int | None = None):
        from ckptbridge.io import storage

        self.path, self.step = path, step
        self.remote = storage.is_remote(path)
        self._ckpt: Any = None
        self.error: Exception | None = None  # why no Orbax checkpoint was found

    @functools.cached_property
    def magic(self) -> bytes:
        if self.remote or not os.path.isfile(self.path):
            return b""
        with open(self.path, "rb") as f:
            return f.read(4)

    def has(self, name: str) -> bool:
        """Whether the (local) directory holds the file ``name``."""
        return not self.remote and os.path.isfile(os.path.join(self.path, name))

    @property
    def checkpoint(self):
        """The Orbax checkpoint at the path (an OrbaxCheckpoint), or None when there is none."""
        if self._ckpt is None and self.error is None and (self.remote or os.path.isdir(self.path)):
            from ckptbridge import deps
            from ckptbridge.errors import InputNotFoundError
            from ckptbridge.io.orbax import OrbaxCheckpoint, resolve_checkpoint

            deps.require("orbax")
            first: Exception | None = None
            for item in self.ITEMS:
                try:
                    self._ckpt = OrbaxCheckpoint(resolve_checkpoint(self.path, self.step, item=item))
                    break
                except InputNotFoundError as e:
                    first = first or e
            if self._ckpt is None:
                self.error = first
        return self._ckpt

    def close(self) -> None:
        if self._ckpt is not None:
            self._ckpt.close()


def detect(path: str, step: int | None = None) -> Format:
    """The format of the checkpoint at ``path`` (a local path or ``gs://``): the readable format
    whose ``detect(probe)`` recognises it (a GGUF file by its magic, a PEFT adapter by
    ``adapter_config.json``, an HF model by ``config.json``, an Orbax checkpoint by its tree)."""
    from ckptbridge.errors import CorruptFileError, InputNotFoundError, UnsupportedError

    if not path.startswith("gs://") and not os.path.exists(path):
        raise InputNotFoundError(f"{path}: no such file or directory")
    probe = Probe(path, step)
    try:
        # formats told by a file name first: an Orbax one needs the orbax extra to be looked at
        for f in sorted((f for f in FORMATS.values() if f.reads), key=lambda f: f.orbax):
            if importlib.import_module(f.read_module or f.module).detect(probe):
                return f
        if probe.magic == b"GGUF":
            raise UnsupportedError(f"{path}: a GGUF LoRA adapter; ckptbridge writes those but does not read them: "
                                   "convert the adapter it was made from")
        if probe.error is not None and "no step" in str(probe.error):
            raise probe.error
        raise CorruptFileError(f"{path}: not a checkpoint ckptbridge reads: no config.json (HF model), no "
                               "adapter_config.json (PEFT adapter), not a GGUF file, and no Orbax checkpoint of a "
                               "Tunix or MaxText model or LoRA")
    finally:
        probe.close()


def destination(dst: str, to: str | None, source_kind: str) -> Format:
    """The destination format: ``to``, else what ``dst``'s name says (``.gguf``: GGUF, for a model
    source, or a GGUF LoRA, for an adapter)."""
    from ckptbridge.errors import ConfigError

    if to is not None:
        return get(to)
    if dst.endswith(".gguf"):
        return FORMATS["gguf" if source_kind == MODEL else "gguf-lora"]
    kinds = ", ".join(n for n, f in FORMATS.items() if f.writes and f.kind == source_kind)
    raise ConfigError(f"{dst}: say which format to write with --to (to=...): one of {kinds} for a {source_kind} "
                      "(only a .gguf name says it by itself)")


def table() -> list[dict]:
    """What reads and writes what: one row per format."""
    return [{"format": f.name, "kind": f.kind, "reads": f.reads, "writes": f.writes, "description": f.title,
             "read_options": [OPTIONS[o].cli for o in f.read_options],
             "write_options": [OPTIONS[o].cli for o in f.write_options], "exactness": f.bound or "bitwise"}
            for f in FORMATS.values()]


def pairs(kind: str | None = None) -> list[tuple[Format, Format]]:
    """Every (source, destination) pair the registry declares: every format that reads to every
    format of the same kind that writes."""
    return [(s, d) for s in FORMATS.values() for d in FORMATS.values()
            if s.reads and d.writes and s.kind == d.kind and (kind is None or s.kind == kind)]


__all__ = ["ADAPTER", "COMMON", "FORMATS", "MODEL", "OPTIONS", "Format", "Option", "Probe", "destination", "detect",
           "get", "pairs", "table"]
