"""``convert_to_gguf``: a model (HF directory, Tunix Orbax checkpoint, or an HF base with a PEFT or
Tunix LoRA adapter merged on the way) -> one GGUF file for ggml's runtimes (its reference CLI and
server, Ollama, LM Studio), streaming.

What is written follows ggml's own converter (``convert_hf_to_gguf.py``) for the same model: the
family's GGUF names, value changes and metadata (:class:`ckptbridge.specs.ggml.GGUFSpec`), the
tokenizer and chat template (:mod:`ckptbridge.io.gguf_tokenizer`), and its choice of stored
type per tensor: 1-D tensors, norms and routers in float32 whatever the output type; Q8_0 where
rows are whole blocks of 32, else float16. Values are read, changed and quantized a block of
rows at a time on the workers of a :class:`~ckptbridge.stream.Engine`, within its memory
budget, ahead of the writer; the file is written under a temporary name and renamed at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ckptbridge import hub, lora, mapping, specs
from ckptbridge.errors import ConfigError, MismatchError, UnsupportedError
from ckptbridge.io import gguf, storage
from ckptbridge.io.atomic import check_destination
from ckptbridge.io.gguf_tokenizer import tokenizer_metadata
from ckptbridge.io.hf import HFModelDir
from ckptbridge.merge import Deltas, collect_deltas, float32_factors, merged_rows
from ckptbridge.progress import Progress
from ckptbridge.report import Report, human_bytes
from ckptbridge.sources import ASSETS_DIR, is_hf_directory, open_hf_source, open_orbax_source
from ckptbridge.specs.ggml import FILE_TYPE, PRE_TOKENIZERS, SPM_MODEL, GGUFSpec, interleaved_rope_rows, text_config
from ckptbridge.stream import Parallelism, Parts

OUTTYPES = {  # --outtype -> (stored type of the weights, general.file_type as ggml's converter writes it)
    "f32": (gguf.TensorType.F32, 0), "f16": (gguf.TensorType.F16, 1),
    "bf16": (gguf.TensorType.BF16, 32), "q8_0": (gguf.TensorType.Q8_0, 7),
}
BLOCK_BYTES = 32 << 20  # float32 bytes of one block of rows (at most half the memory budget)
GGML_QUANT_VERSION = 2


@dataclasses.dataclass(frozen=True)
class GGUFReport(Report):
    direction: str
    source: str
    adapter: str | None
    destination: str
    family: str
    architecture: str
    outtype: str
    tensors: int
    tensor_types: dict[str, int]
    bytes: int
    tokenizer: str | None
    seconds: float

    def summary(self) -> str:
        merged = f" with {self.adapter} merged" if self.adapter else ""
        types = ", ".join(f"{n} {k}" for k, n in self.tensor_types.items())
        tok = f"tokenizer {self.tokenizer}" if self.tokenizer else "no tokenizer"
        return (f"to-gguf: {self.source}{merged} -> {self.destination}\n"
                f"  {self.family} as GGUF {self.architecture}, {self.outtype}: {self.tensors} tensors ({types}), "
                f"{human_bytes(self.bytes)} in {self.seconds:.2f} s; {tok}")


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One GGUF tensor: its name, shape and stored type, and the HF keys it is made of (several:
    experts stacked), with what is done to the values on the way."""

    name: str
    shape: tuple[int, ...]
    type: gguf.TensorType
    keys: tuple[str, ...]
    hf_shape: tuple[int, ...]
    shift: float = 0.0  # added to the values (norms stored as 1 + w)
    rope_heads: int | None = None  # rows reordered to ggml's interleaved rotation, in this many heads

    @property
    def whole(self) -> bool:
        """Made in one piece (reordered rows, or shifted values) rather than in row blocks."""
        return self.rope_heads is not None or bool(self.shift) or len(self.hf_shape) < 2


def stored_type(name: str, shape: tuple[int, ...], wanted: gguf.TensorType) -> gguf.TensorType:
    """The type ggml's converter stores a tensor as: float32 for 1-D tensors, norms, routers and
    anything not named ``*.weight``; float16 where Q8_0 is asked for and rows are not whole blocks."""
    if len(shape) <= 1 or name.endswith("_norm.weight") or ".ffn_gate_inp." in f".{name}" \
            or not name.endswith((".weight", ".lora_a", ".lora_b")):
        return gguf.TensorType.F32
    if wanted is gguf.TensorType.Q8_0 and shape[-1] % gguf.QK8_0:
        return gguf.TensorType.F16
    return wanted


def store(values: np.ndarray, t: gguf.TensorType) -> np.ndarray:
    """``values`` in the stored form of ``t`` (float16 and bfloat16 rounded to nearest even from
    float32, as gguf-py's quantizer does; Q8_0 as ggml's reference)."""
    if t is gguf.TensorType.Q8_0:
        return gguf.quantize_q8_0(values)
    want = t.storage(values.shape)[0]
    if values.dtype == want:
        return values
    return values.astype(np.float32).astype(want)


def _plan(cfg, spec_gguf: GGUFSpec, ents: list[mapping.Entry], type_of: Callable, h: dict) -> list[_Tensor]:
    out: list[_Tensor] = []
    for e in ents:
        if not e.hf_keys:
            continue  # a parameter HF does not have here (kv-shared layers): ggml's converter writes none
        prefix = f"blk.{e.layer.index}." if e.rule.scope == "layer" and e.layer is not None else ""
        groups = ([(e.rule.hf[0], e.hf_keys)] if e.rule.stack is not None
                  else list(zip(e.rule.hf, ((k,) for k in e.hf_keys))))
        for suffix, keys in groups:
            try:
                name = prefix + spec_gguf.names[suffix]
            except KeyError:
                raise UnsupportedError(f"{keys[0]}: no GGUF name for this tensor of {cfg.family} "
                                       f"({spec_gguf.arch}); ggml's converter does not write it") from None
            shape = (len(keys), *e.hf_shape) if e.rule.stack is not None else tuple(e.hf_shape)
            heads = spec_gguf.rope_rows.get(suffix)
            out.append(_Tensor(name, shape, type_of(name, shape), tuple(keys), tuple(e.hf_shape),
                               shift=spec_gguf.norm_shift if suffix.endswith("norm.weight") else 0.0,
                               rope_heads=int(h[heads]) if heads else None))
    return out


def converter_order(tensors: list[_Tensor], position: Callable[[str], tuple]) -> list[_Tensor]:
    """``tensors`` in the order ggml's converter writes them: by the place of their HF tensor in
    the files (``position``: file, then name), experts stored one tensor each being stacked when the
    last of their layer's arrives (the stacks in the order of their names)."""
    last: dict[str, tuple] = {}
    for t in tensors:
        if len(t.keys) > 1:
            layer = t.name.split(".", 2)[1] if t.name.startswith("blk.") else ""
            last[layer] = max([last.get(layer, ()), *map(position, t.keys)])

    def key(t: _Tensor) -> tuple:
        if len(t.keys) > 1:
            return (last[t.name.split(".", 2)[1] if t.name.startswith("blk.") else ""], 1, t.keys[0])
        return (position(t.keys[0]), 0, "")

    return sorted(tensors, key=key)


def title(directory_name: str) -> str:
    """``general.name`` as ggml's converter makes it from a directory's name (words capitalized
    unless acronyms or versions)."""
    words = directory_name.strip().replace("-", " ").split()
    return " ".join(w.title() if w.islower() and not re.match(r"^(v\d+(?:\.\d+)*|\d.*)$", w) else w for w in words)


def size_label(planned: list[gguf.PlannedTensor]) -> str:
    """``general.size_label`` as gguf-py counts it: parameters rounded to 2 digits (``8.0B``), or
    ``{experts}x{per expert and shared}`` for mixtures of experts."""
    total = shared = expert = expert_sum = n_expert = 0
    for t in planned:
        size = math.prod(t.shape)
        if "_exps." in t.name and len(t.shape) >= 3:
            count = t.shape[-2 if ".bias" in t.name else -3]
            expert += size // count
            expert_sum += count
            n_expert += 1
        else:
            shared += size
        total += size
    n = shared + expert if n_expert else total
    scale, suffix = next((s, x) for limit, s, x in ((1e12, 1e-12, "T"), (1e9, 1e-9, "B"), (1e6, 1e-6, "M"),
                                                    (-1, 1e-3, "K")) if n > limit)
    scaled = n * scale
    fix = max(2 - len(str(round(scaled)).lstrip("0")), 0)
    label = f"{scaled:.{fix}f}{suffix}"
    return f"{expert_sum // n_expert}x{label}" if n_expert else label


def _finish(t: _Tensor, values: np.ndarray, src_dtype: np.dtype) -> np.ndarray:
    """Values of ``t`` (whole, or rows) changed as ggml's converter changes them, in its stored form."""
    if t.shift:  # in float32 (in float16 for float16 sources, as the converter computes)
        work = np.dtype(np.float16 if src_dtype == np.float16 else np.float32)
        values = values.astype(work) + np.asarray(t.shift, work)
    if t.rope_heads is not None:
        values = interleaved_rope_rows(values.reshape(t.hf_shape), t.rope_heads)
    return store(values, t.type)


class _HFRows:
    """Rows of an HF directory's tensors as the export reads them, with LoRA deltas added where an
    adapter has them (the merge's own block arithmetic; a tensor's float32 factors made when its
    jobs are reached)."""

    def __init__(self, model: HFModelDir, deltas: Deltas, block_bytes: int):
        self.model, self.deltas, self.block_bytes = model, deltas, block_bytes

    def _per(self, t: _Tensor) -> int:
        return max(1, self.block_bytes // (4 * (t.hf_shape[-1] if t.hf_shape else 1)))

    def count(self, t: _Tensor) -> int:
        """How many pieces :meth:`jobs` makes of ``t``."""
        if t.whole:
            return 1
        return len(t.keys) * math.ceil(math.prod(t.hf_shape[:-1]) / self._per(t))

    def jobs(self, t: _Tensor) -> Iterator[tuple[int, Callable]]:
        if t.whole:
            factors = float32_factors(self.deltas.get(t.keys[0], []))
            yield 4 * math.prod(t.shape), functools.partial(self._whole, t, factors)
            return
        cols, n_rows, per = t.hf_shape[-1], math.prod(t.hf_shape[:-1]), self._per(t)
        for key in t.keys:
            factors = float32_factors(self.deltas.get(key, []))
            for start in range(0, n_rows, per):
                stop = min(start + per, n_rows)
                yield 4 * (stop - start) * cols, functools.partial(self._block, t, key, factors, start, stop)

    def _whole(self, t: _Tensor, factors: list) -> list:
        key = t.keys[0]
        values = (merged_rows(self.model, key, factors, 0, math.prod(t.hf_shape[:-1])) if factors
                  else self.model.array(key))
        return [(t.name, _finish(t, values.reshape(t.hf_shape), values.dtype))]

    def _block(self, t: _Tensor, key: str, factors: list, start: int, stop: int) -> list:
        rows = merged_rows(self.model, key, factors, start, stop)
        return [(t.name, _finish(t, rows, rows.dtype))]


def _orbax_jobs(source, tensors: dict[str, _Tensor]) -> Iterator[tuple[int, Callable]]:
    """One job per Orbax leaf: its HF tensors, each as its GGUF tensor stores it."""
    by_key = {k: t for t in tensors.values() for k in t.keys}

    def make(e: mapping.Entry) -> list:
        values = list(mapping.tunix_to_hf(e, source.tunix_value(e)))
        out = []
        for key, v in zip(e.hf_keys, values):
            t = by_key[key]
            out.append((t.name, _finish(t, v, v.dtype)))
        return out

    for e in source.entries:
        if e.hf_keys:
            yield source.nbytes(e) * 2, functools.partial(make, e)


# generation_config.json field -> (general.sampling.* key, GGUF type): the defaults ggml's runtimes sample with
SAMPLING = {"sequence": ("sequence", gguf.ValueType.STRING), "top_k": ("top_k", gguf.ValueType.INT32),
            "top_p": ("top_p", gguf.ValueType.FLOAT32), "min_p": ("min_p", gguf.ValueType.FLOAT32),
            "xtc_probability": ("xtc_probability", gguf.ValueType.FLOAT32),
            "xtc_threshold": ("xtc_threshold", gguf.ValueType.FLOAT32),
            "temperature": ("temp", gguf.ValueType.FLOAT32), "penalty_last_n": ("penalty_last_n", gguf.ValueType.INT32),
            "penalty_repeat": ("penalty_repeat", gguf.ValueType.FLOAT32),
            "mirostat": ("mirostat", gguf.ValueType.INT32), "mirostat_tau": ("mirostat_tau", gguf.ValueType.FLOAT32),
            "mirostat_eta": ("mirostat_eta", gguf.ValueType.FLOAT32)}


def sampling_metadata(directory: str | None) -> dict[str, gguf.Value]:
    """``general.sampling.*`` from the model's generation_config.json, as ggml's converter writes them."""
    path = os.path.join(directory, "generation_config.json") if directory and not storage.is_remote(directory) else ""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    out = {}
    for field, (key, kind) in SAMPLING.items():
        v = config.get(field)
        if v is not None and not isinstance(v, bool):
            out[f"general.sampling.{key}"] = gguf.Value(kind, str(v) if kind is gguf.ValueType.STRING
                                                        else int(v) if kind is gguf.ValueType.INT32 else float(v))
    return out


def _metadata(spec_gguf: GGUFSpec, h: dict, block_count: int, name: str, size: str, file_type: int,
              tokenizer: list[tuple[str, gguf.Value]], sampling: dict[str, gguf.Value]) -> dict[str, gguf.Value]:
    arch = spec_gguf.arch
    out: dict[str, gguf.Value] = {"general.architecture": gguf.string(arch), "general.type": gguf.string("model"),
                                  **sampling, "general.name": gguf.string(name),
                                  "general.size_label": gguf.string(size)}
    for key, value in spec_gguf.metadata(h, block_count):
        out[key.replace("{arch}", arch)] = gguf.u32(file_type) if key == FILE_TYPE else value
    out["general.quantization_version"] = gguf.u32(GGML_QUANT_VERSION)
    for key, value in tokenizer:
        out[key] = value
    return out


@dataclasses.dataclass
class _Opened:
    """A source made ready for GGUF: its config and family spec, the GGUF tensors in write order,
    and their stored forms coming in order (``parts.take_many(name, counts[name])``)."""

    cfg: Any
    spec_gguf: GGUFSpec
    h: dict
    tensors: list[_Tensor]
    parts: Parts
    counts: dict[str, int]
    assets_dir: str | None


@contextlib.contextmanager
def _open(src: str, adapter: str | None, type_of: Callable[[str, tuple[int, ...]], gguf.TensorType], *,
          step: int | None, alpha: float | None, parallel: Parallelism, name: str) -> Iterator[_Opened]:
    """Open ``src`` (HF directory, with ``adapter`` merged, or a Tunix Orbax checkpoint) and start
    making its GGUF tensors, each stored as ``type_of(name, shape)`` says."""
    if adapter is not None and not is_hf_directory(src):
        raise ConfigError(f"{src}: --adapter needs the HF base model directory as the source (the model the "
                          "adapter was trained on)")
    if adapter is None and (alpha is not None or (step is not None and is_hf_directory(src))):
        raise ConfigError("step/alpha (--step, --alpha) apply with --adapter (--step also to an Orbax source)")
    with contextlib.ExitStack() as stack:
        if is_hf_directory(src):
            with open_hf_source(src, skip_multimodal=True) as source:
                spec_gguf, h = _family(source.cfg, src)
                tensors = _plan(source.cfg, spec_gguf, source.entries, type_of, h)
                files = sorted({source.model.file_of(k).path for t in tensors for k in t.keys})
                tensors = converter_order(tensors, lambda k: (files.index(source.model.file_of(k).path), k))
            cfg = source.cfg
            model = stack.enter_context(HFModelDir(src))
            engine = stack.enter_context(parallel.engine(name))
            deltas: Deltas = {}
            if adapter is not None:
                ad = stack.enter_context(lora.open_adapter(adapter, lora.open_base(src), step=step, alpha=alpha,
                                                           engine=engine))
                deltas = collect_deltas(model, ad, adapter)
            reader = _HFRows(model, deltas, min(BLOCK_BYTES, engine.budget.limit // 2))
            jobs = itertools.chain.from_iterable(reader.jobs(t) for t in tensors)  # taken as the budget allows
            yield _Opened(cfg, spec_gguf, h, tensors, Parts(engine.stream(jobs)),
                          {t.name: reader.count(t) for t in tensors}, src)
        else:
            orbax = stack.enter_context(open_orbax_source(src, step=step))
            spec_gguf, h = _family(orbax.cfg, src)
            tensors = _plan(orbax.cfg, spec_gguf, orbax.entries, type_of, h)
            assets = storage.join(orbax.ckpt.path, ASSETS_DIR)
            engine = stack.enter_context(parallel.engine(name))
            parts = Parts(engine.stream(_orbax_jobs(orbax, {t.name: t for t in tensors})))
            yield _Opened(orbax.cfg, spec_gguf, h, tensors, parts, {t.name: len(t.keys) for t in tensors},
                          assets if storage.isdir(assets) else orbax.config_dir)


def convert_to_gguf(src: str, dst: str, *, adapter: str | None = None, outtype: str = "bf16",
                    step: int | None = None, alpha: float | None = None, tokenizer: bool = True,
                    name: str | None = None, overwrite: bool = False, workers: int | None = None,
                    memory_budget: str | int | None = None, progress: bool | None = None,
                    revision: str | None = None) -> GGUFReport:
    """Write the model ``src`` (an HF model directory or Hub id, or a Tunix Orbax weights
    checkpoint) as the GGUF file ``dst``, with ``adapter`` (PEFT directory or Tunix/qwix Orbax
    LoRA checkpoint; ``src`` then an HF directory) merged into it on the way. ``outtype``: the
    stored type of the weights (``f32``, ``f16``, ``bf16``, ``q8_0``). ``tokenizer``: include the
    tokenizer and chat template found beside the weights (in the checkpoint's stored files for
    Orbax). ``name``: ``general.name`` (default: the source directory's name). Row blocks are made
    on ``workers`` threads (default: every usable core) within ``memory_budget`` bytes (default
    256 MiB); the file does not depend on either."""
    t0 = time.perf_counter()
    if outtype not in OUTTYPES:
        raise ConfigError(f"outtype (--outtype) {outtype!r}: one of {', '.join(OUTTYPES)}")
    wanted, file_type = OUTTYPES[outtype]
    parallel = Parallelism.of(workers, memory_budget)
    src = hub.local(src, hub.MODEL, revision=revision)
    if adapter is not None:
        adapter = hub.local(adapter, hub.ADAPTER, what="adapter")
    sources = [src] + ([adapter] if adapter else [])
    check_destination(dst, sources, overwrite)
    with _open(src, adapter, lambda n, shape: stored_type(n, shape, wanted), step=step, alpha=alpha,
               parallel=parallel, name="to-gguf") as o:
        return _write(o, dst, src=src, adapter=adapter, outtype=outtype, file_type=file_type, tokenizer=tokenizer,
                      name=name, overwrite=overwrite, sources=sources, progress=progress, t0=t0)


def _family(cfg, where: str) -> tuple[GGUFSpec, dict]:
    spec = specs.get_family(cfg.family)
    spec_gguf = spec.gguf.get(cfg.model_type)
    if spec_gguf is None:
        raise UnsupportedError(f"{where}: {cfg.family} ({cfg.model_type}) has no GGUF form: ggml's runtimes do not run "
                               "it; GGUF export covers " + ", ".join(sorted(
                                   t for f in specs.FAMILIES.values() for t in f.gguf)))
    h = text_config(cfg.hf_config)
    if spec_gguf.defaults is not None:
        h = {**spec_gguf.defaults(cfg), **h}
    if spec_gguf.unsupported is not None and (why := spec_gguf.unsupported(h)):
        raise UnsupportedError(f"{where}: {why}")
    return spec_gguf, h


def _write(o: _Opened, dst: str, *, src: str, adapter: str | None, outtype: str, file_type: int, tokenizer: bool,
           name, overwrite: bool, sources: list[str], progress, t0: float) -> GGUFReport:
    tok: list = []
    if tokenizer:
        if o.assets_dir is None or storage.is_remote(o.assets_dir):
            raise UnsupportedError(f"{src}: its tokenizer files are not on this machine; export with --no-tokenizer "
                                   "or from a local copy")
        tok = tokenizer_metadata(o.assets_dir, o.cfg.hf_config, o.cfg.vocab_size, src, pre_tokenizers=PRE_TOKENIZERS,
                                 spm_model=SPM_MODEL, family_model=o.spec_gguf.tokenizer,
                                 visible=o.spec_gguf.visible_tokens, spm_ids=o.spec_gguf.spm_ids)
    planned = [gguf.PlannedTensor(n, v.shape, gguf.TensorType.F32, functools.partial(lambda v: v, v))
               for n, v in _extra(o)]
    for t in o.tensors:
        planned.append(gguf.PlannedTensor(t.name, t.shape, t.type,
                                          functools.partial(o.parts.take_many, t.name, o.counts[t.name])))
    model_name = name or title(os.path.basename(os.path.normpath(src)))
    metadata = _metadata(o.spec_gguf, o.h, o.cfg.num_layers, model_name, size_label(planned), file_type, tok,
                         sampling_metadata(o.assets_dir))
    total = sum(t.nbytes for t in planned)
    bar = Progress(total, "to gguf", enabled=progress)
    size = gguf.write_gguf(dst, metadata, planned, overwrite=overwrite, sources=sources, on_written=bar.update)
    bar.close()
    types: dict[str, int] = {}
    for p in planned:
        types[p.type.name] = types.get(p.type.name, 0) + 1
    tok_model = next((v.value for k, v in tok if k == "tokenizer.ggml.model"), None)
    return GGUFReport(direction="to-gguf", source=src, adapter=adapter, destination=dst, family=o.cfg.family,
                      architecture=o.spec_gguf.arch, outtype=outtype, tensors=len(planned), tensor_types=types,
                      bytes=size, tokenizer=tok_model, seconds=round(time.perf_counter() - t0, 3))


def _extra(o: _Opened) -> list[tuple[str, np.ndarray]]:
    return list(o.spec_gguf.extra(o.h)) if o.spec_gguf.extra else []


@dataclasses.dataclass(frozen=True)
class GGUFVerifyReport(Report):
    """A GGUF file against the model it was made from, tensor by tensor."""

    gguf: str
    source: str
    adapter: str | None
    architecture: str
    tensors: int
    identical: bool
    differing: list[str]
    missing: list[str]
    unexpected: list[str]
    seconds: float

    def summary(self) -> str:
        head = f"verify gguf: {self.gguf} against {self.source}" + (f" + {self.adapter}" if self.adapter else "")
        if self.identical:
            return (f"{head}\n  identical: {self.tensors} tensors ({self.architecture}), each the source's values as "
                    "stored (float types bit for bit, Q8_0 as quantized again)")
        lines = [f"{head}\n  DIFFERENT ({self.tensors} tensors compared)"]
        for what, names in (("differ", self.differing), ("missing from the file", self.missing),
                            ("not made from the source", self.unexpected)):
            if names:
                lines.append(f"  {len(names)} {what}: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}")
        return "\n".join(lines)


def verify_gguf(path: str, src: str, *, adapter: str | None = None, step: int | None = None,
                alpha: float | None = None, workers: int | None = None, memory_budget: str | int | None = None,
                revision: str | None = None) -> GGUFVerifyReport:
    """Compare the GGUF file ``path`` (written by ckptbridge or by ggml's converter) with the model
    ``src`` it was made from (an adapter merged as ``convert_to_gguf`` would), tensor by tensor: each
    tensor must hold the source's values in its stored type (F32, F16, BF16 bit for bit; Q8_0 equal
    to quantizing them again), with ggml's value changes (norms + 1, reordered q/k rows, stacked
    experts). Streaming, as the export."""
    t0 = time.perf_counter()
    file = gguf.read_gguf(path)
    src = hub.local(src, hub.MODEL, revision=revision)
    if adapter is not None:
        adapter = hub.local(adapter, hub.ADAPTER, what="adapter")
    parallel = Parallelism.of(workers, memory_budget)

    def type_of(name: str, shape: tuple[int, ...]) -> gguf.TensorType:
        info = file.tensors.get(name)
        if info is not None and isinstance(info.type, gguf.TensorType):
            return info.type
        return stored_type(name, shape, gguf.TensorType.F32)

    differing: list[str] = []
    with _open(src, adapter, type_of, step=step, alpha=alpha, parallel=parallel, name="verify-gguf") as o:
        arch = file.metadata.get("general.architecture")
        if arch != o.spec_gguf.arch:
            raise MismatchError(f"{path}: general.architecture is {arch!r}; {src} is GGUF {o.spec_gguf.arch!r}")
        made = {t.name: t for t in o.tensors}
        extra = dict(_extra(o))
        missing = [n for n in list(extra) + list(made) if n not in file.tensors]
        unexpected = [n for n in file.tensors if n not in made and n not in extra]
        for n, v in extra.items():
            if n in file.tensors and not _same(file, n, [v], v.shape):
                differing.append(n)
        for t in o.tensors:
            pieces = o.parts.take_many(t.name, o.counts[t.name])
            if t.name not in file.tensors:
                for _ in pieces:
                    pass
                continue
            if not _same(file, t.name, pieces, t.shape):
                differing.append(t.name)
    return GGUFVerifyReport(gguf=path, source=src, adapter=adapter, architecture=o.spec_gguf.arch,
                            tensors=len(made) + len(extra), identical=not (differing or missing or unexpected),
                            differing=differing, missing=missing, unexpected=unexpected,
                            seconds=round(time.perf_counter() - t0, 3))


def _same(file, name: str, pieces, shape: tuple[int, ...]) -> bool:
    """Whether tensor ``name`` of ``file`` has ``shape`` and the bytes of ``pieces`` (consumed)."""
    info = file.tensors[name]
    ok = tuple(info.shape) == tuple(shape) and isinstance(info.type, gguf.TensorType)
    stored = file.array(name).reshape(-1).view(np.uint8) if ok else None
    at = 0
    for piece in pieces:
        if not ok or stored is None:
            ok = False
            continue
        b = np.ascontiguousarray(piece).reshape(-1).view(np.uint8)
        ok = at + b.size <= stored.size and np.array_equal(stored[at:at + b.size], b)
        at += b.size
    return ok and stored is not None and at == stored.size


__all__ = ["GGUFReport", "GGUFVerifyReport", "OUTTYPES", "convert_to_gguf", "stored_type", "store", "verify_gguf"]
