"""GGUF, the format of ggml's runtimes (its reference CLI and server, Ollama, LM Studio): any
model's rows written as one GGUF file, streaming, and a GGUF file read back as the family's rows
(:mod:`ckptbridge.formats.gguf.reader`).

What is written follows ggml's own converter (``convert_hf_to_gguf.py``) for the same model: the
family's GGUF names, value changes and metadata (:class:`ckptbridge.specs.ggml.GGUFSpec`), the
tokenizer and chat template (:mod:`ckptbridge.formats.gguf.tokenizer`), and its choice of stored
type per tensor: 1-D tensors, norms and routers in float32 whatever the output type; Q8_0 where
rows are whole blocks of 32, else float16. Values are read, changed and quantized a block of
rows at a time on the workers of a :class:`~ckptbridge.stream.Engine`, within its memory
budget, ahead of the writer (a row of the family at a time from a source that cannot read one
tensor's rows on its own); the file is written under a temporary name and renamed at the end.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterator

import numpy as np

from ckptbridge import mapping, specs
from ckptbridge.errors import ConfigError, UnsupportedError
from ckptbridge.formats.gguf.tokenizer import tokenizer_metadata
from ckptbridge.io import gguf, storage
from ckptbridge.io.gguf import GGML_QUANT_VERSION, spec_value, store
from ckptbridge.progress import Progress
from ckptbridge.report import Report, human_bytes
from ckptbridge.rows import HELD_PER_BYTE, ModelRows, Request, matrix_rows, tower_record, towers_line
from ckptbridge.specs.ggml import (
    FILE_TYPE,
    PRE_TOKENIZERS,
    SPM_MODEL,
    GGUFSpec,
    interleaved_rope_rows,
    text_config,
)
from ckptbridge.stream import Engine, Parts, Stream

NAME = "gguf"
OUTTYPES = {  # --outtype -> (stored type of the weights, general.file_type as ggml's converter writes it)
    "f32": (gguf.TensorType.F32, 0), "f16": (gguf.TensorType.F16, 1),
    "bf16": (gguf.TensorType.BF16, 32), "q8_0": (gguf.TensorType.Q8_0, 7),
}
BLOCK_BYTES = 32 << 20  # float32 bytes of one block of rows (at most half the memory budget)


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


def _finish(t: _Tensor, values: np.ndarray, src_dtype: np.dtype, first_row: int = 0) -> np.ndarray:
    """Values of ``t`` (whole, or its rows from ``first_row``) changed as ggml's converter changes
    them, in its stored form (rows to reorder for ggml's rotation must be whole heads)."""
    if t.shift:  # in float32 (in float16 for float16 sources, as the converter computes)
        work = np.dtype(np.float16 if src_dtype == np.float16 else np.float32)
        values = values.astype(work) + np.asarray(t.shift, work)
    if t.rope_heads is not None:
        values = values.reshape(-1, *t.hf_shape[1:])
        per_head = t.hf_shape[0] // t.rope_heads
        if first_row % per_head or len(values) % per_head:
            raise RuntimeError(f"{t.name}: rows {first_row}:{first_row + len(values)} are not whole heads")
        values = interleaved_rope_rows(values, len(values) // per_head)
    return store(values, t.type)


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
        out[key.replace("{arch}", arch)] = gguf.u32(file_type) if key == FILE_TYPE else spec_value(value)
    out["general.quantization_version"] = gguf.u32(GGML_QUANT_VERSION)
    for key, value in tokenizer:
        out[key] = value
    return out


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


def family(cfg, where: str) -> tuple[GGUFSpec, dict]:
    """The family's GGUF form of the model of ``cfg`` and the HF config as ggml's converter reads it."""
    return _family(cfg, where)


@dataclasses.dataclass
class Planned:
    """A model made ready for GGUF: its family's form, the GGUF tensors in write order, and their
    stored forms coming in order (``parts.take_many(name, counts[name])``)."""

    rows: ModelRows
    spec_gguf: GGUFSpec
    h: dict
    tensors: list[_Tensor]
    parts: Parts
    counts: dict[str, int]
    stream: Stream | None = None
    stored: dict[str, list] = dataclasses.field(default_factory=dict)  # copied as stored: name -> FileRanges

    def produce(self, t: _Tensor) -> Callable:
        """What makes the stored form of ``t``: its pieces from the workers, or its stored bytes."""
        if t.name in self.stored:
            return functools.partial(_copied, self.stream, self.stored[t.name])
        return functools.partial(self.parts.take_many, t.name, self.counts[t.name])

    def extra(self) -> list[tuple[str, np.ndarray]]:
        """Tensors ggml's converter computes and writes first (``rope_freqs``)."""
        return list(self.spec_gguf.extra(self.h)) if self.spec_gguf.extra else []


def _whole_job(rows: ModelRows, t: _Tensor) -> list:
    key = t.keys[0]
    values = rows.key_rows(key, 0, matrix_rows(t.hf_shape))
    return [(t.name, _finish(t, values.reshape(t.hf_shape), values.dtype))]


def _rows_job(rows: ModelRows, t: _Tensor, key: str, start: int, stop: int) -> list:
    values = rows.key_rows(key, start, stop)
    return [(t.name, _finish(t, values, values.dtype))]


def _copied(stream: Stream | None, ranges: list) -> Iterator:
    """The stored bytes of a tensor written as they are, copied file to file while the workers
    make the next computed pieces."""
    if stream is not None:
        stream.prefetch()
    yield from ranges


def _stored_ranges(rows: ModelRows, t: _Tensor) -> list | None:
    """The source's stored bytes of ``t``, where they are its GGUF bytes as they are (a float type
    the source has, values unchanged), else None."""
    if t.whole or t.type is gguf.TensorType.Q8_0:
        return None
    want = t.type.storage(t.shape)[0]
    if any(np.dtype(rows.key_info(k)[0]) != want for k in t.keys):
        return None
    ranges = [rows.byte_range(k) for k in t.keys]
    return ranges if all(r is not None for r in ranges) else None


def _row_jobs(rows: ModelRows, tensors: list[_Tensor], block_bytes: int,
              stored: dict[str, list]) -> tuple[Iterator, dict[str, int]]:
    """Jobs tensor by tensor, a block of rows of at most ``block_bytes`` float32 at a time (a
    tensor whose values change as a whole, in one job; none for one copied as ``stored``)."""
    counts: dict[str, int] = {}
    jobs: list[Iterator] = []
    for t in tensors:
        if t.name in stored:
            continue
        if t.whole:
            counts[t.name] = 1
            jobs.append(iter([(4 * math.prod(t.shape), functools.partial(_whole_job, rows, t))]))
            continue
        cols, n_rows = t.hf_shape[-1], matrix_rows(t.hf_shape)
        per = max(1, block_bytes // (4 * cols))
        starts = range(0, n_rows, per)
        counts[t.name] = len(t.keys) * len(starts)
        jobs.append(iter([(4 * (min(s + per, n_rows) - s) * cols,
                           functools.partial(_rows_job, rows, t, key, s, min(s + per, n_rows)))
                          for key in t.keys for s in starts]))
    return itertools.chain.from_iterable(jobs), counts


def _plan_job(make: Callable[[], list], by_key: dict[str, _Tensor]) -> list:
    out = []
    for key, first_row, v in make():
        t = by_key[key]
        out.append((t.name, _finish(t, v, v.dtype, first_row)))
    return out


def _work_per_byte(t: _Tensor, src: np.dtype) -> float:
    """What finishing rows of ``t`` holds beside the rows read, per byte of them: their stored form
    (none where it is the rows themselves), and a float32 copy where the type changes through one
    (Q8_0 quantizes through small buffers of its own)."""
    want = t.type.storage(t.shape)[0]
    if t.type is not gguf.TensorType.Q8_0 and want == src:
        return 0.0
    values, size = t.type.block
    through = 4 if t.type not in (gguf.TensorType.Q8_0, gguf.TensorType.F32) else 0
    return (size / values + through) / src.itemsize


def _plan_jobs(rows: ModelRows, tensors: list[_Tensor],
               block_bytes: int) -> tuple[list[_Tensor], Iterator, dict[str, int]]:
    """``tensors`` in the order of the source's own HF plan of the text model, and its jobs (a row
    of the family, or a run of its rows where larger than ``block_bytes``), each part as its GGUF
    tensor stores it: each costs what its values hold read, and their float32 work and stored form."""
    by_key = {k: t for t in tensors for k in t.keys}
    hf = rows.hf_plan(block_bytes // 2, computed=by_key, towers=False)
    parts = {t.key: t.parts for t in hf.tensors}
    order = {t.key: n for n, t in enumerate(hf.tensors)}
    src = np.dtype(rows.dtype(rows.entries[0]))
    extra = max((_work_per_byte(t, src) for t in tensors if len(t.shape) > 1), default=0.0)
    jobs = ((cost + int(cost // HELD_PER_BYTE * extra), functools.partial(_plan_job, make, by_key))
            for cost, make in hf.jobs)
    return (sorted(tensors, key=lambda t: order[t.keys[0]]), jobs,
            {t.name: sum(parts[k] for k in t.keys) for t in tensors})


def plan(rows: ModelRows, type_of: Callable[[str, tuple[int, ...]], gguf.TensorType], engine: Engine,
         block_bytes: int, copy_stored: bool = False) -> Planned:
    """Plan ``rows`` as GGUF tensors (each stored as ``type_of(name, shape)`` says), in ggml's
    converter's order where the source says where its tensors lie, and start making them; with
    ``copy_stored``, a tensor whose source bytes are its GGUF bytes is copied file to file."""
    spec_gguf, h = _family(rows.cfg, rows.path)
    tensors = _plan(rows.cfg, spec_gguf, rows.entries, type_of, h)
    stored: dict[str, list] = {}
    if rows.row_addressable:
        if tensors and rows.position(tensors[0].keys[0]) is not None:
            tensors = converter_order(tensors, rows.position)  # type: ignore[arg-type]
        if copy_stored:
            stored = {t.name: r for t in tensors if (r := _stored_ranges(rows, t)) is not None}
        jobs, counts = _row_jobs(rows, tensors, block_bytes, stored)
    else:
        tensors, jobs, counts = _plan_jobs(rows, tensors, block_bytes)
    stream = engine.stream(jobs)
    return Planned(rows, spec_gguf, h, tensors, Parts(stream), counts, stream, stored)


@dataclasses.dataclass(frozen=True)
class GGUFReport(Report):
    OMIT_NONE = ("projector", "projector_tensors", "projector_bytes", "towers")

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
    projector: str | None = None  # the projector file of a multimodal model's towers
    projector_tensors: int | None = None
    projector_bytes: int | None = None
    towers: dict | None = None

    def summary(self) -> str:
        merged = f" with {self.adapter} merged" if self.adapter else ""
        types = ", ".join(f"{n} {k}" for k, n in self.tensor_types.items())
        tok = f"tokenizer {self.tokenizer}" if self.tokenizer else "no tokenizer"
        text = (f"{self.direction}: {self.source}{merged} -> {self.destination}\n"
                f"  {self.family} as GGUF {self.architecture}, {self.outtype}: {self.tensors} tensors ({types}), "
                f"{human_bytes(self.bytes)} in {self.seconds:.2f} s; {tok}")
        if self.projector:
            text += (f"\n  projector (mmproj): {self.projector}: {self.projector_tensors} tensors, "
                     f"{human_bytes(self.projector_bytes or 0)}" + towers_line(self.towers).replace("\n  towers:", ";"))
        return text


def inexact_rules(spec, cfg, *, outtype: str = "bf16", **_) -> dict[str, str]:
    """The rows a GGUF file does not give back bit for bit: every weight under q8_0 (and under a
    narrower float type than the source's), and norms ggml stores as 1 + w (in float32); the
    towers' rows of the projector file as ``tower:rule``."""
    from ckptbridge.formats.gguf import mmproj

    spec_gguf = spec.gguf.get(cfg.model_type)
    if spec_gguf is None:
        return {}
    out = {f"{tower}:{rule}": why for (tower, rule), why in mmproj.inexact_rules(spec, cfg, outtype).items()}
    if outtype == "q8_0":
        out.update({r.name: "q8_0: each value within half a step of its block" for r in spec.rules})
    if spec_gguf.norm_shift:
        out.update({r.name: "stored as 1 + w in float32" for r in spec.rules
                    if any(s.endswith("norm.weight") for s in r.hf)})
    return out


def outtype_of(outtype: str, rows: ModelRows) -> str:
    """``outtype`` checked (``auto``: the source's float type, f32, f16 or bf16)."""
    if outtype == "auto":
        dtype = next(rows.dtype(e) for e in rows.entries if e.hf_keys)
        return {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}.get(np.dtype(dtype).name, "f32")
    if outtype not in OUTTYPES:
        raise ConfigError(f"outtype (--outtype) {outtype!r}: one of {', '.join(['auto', *OUTTYPES])}")
    return outtype


def tower_refusal(spec, cfg, names: list[str]) -> str | None:
    """Why a GGUF projector file cannot hold the towers ``names`` (None: it can)."""
    from ckptbridge.formats.gguf import mmproj

    return mmproj.tower_refusal(spec, cfg, names)


def write(rows: ModelRows, dst: str, req: Request, *, outtype: str = "bf16", tokenizer: bool = True,
          name: str | None = None, mmproj: str | None = None) -> GGUFReport:
    """Write ``rows`` as the GGUF file ``dst``, and a multimodal model's towers as ggml's projector
    file beside it (``mmproj-`` before its name, or the path ``mmproj``), both or neither.
    ``outtype``: the stored type of the weights (``f32``, ``f16``, ``bf16``, ``q8_0``; ``auto``: the
    source's). ``tokenizer``: include the tokenizer and chat template found with the model (an Orbax
    checkpoint's stored files). ``name``: ``general.name`` (default: the source directory's name)."""
    from ckptbridge.formats.gguf import mmproj as projector

    outtype = outtype_of(outtype, rows)
    wanted, file_type = OUTTYPES[outtype]
    block_bytes = min(BLOCK_BYTES, req.chunk_bytes, req.engine.budget.limit // 2)
    assets_dir = rows.asset_dir()
    towers: list = []
    if rows.tower_entries:  # everything a projector file needs checked before anything is made
        towers = projector.plan(rows, wanted, req.source)
        processor = projector.processor_config(assets_dir, req.source)
    elif mmproj:
        raise ConfigError(f"--mmproj {mmproj}: {req.source} has no vision or audio tower to write there")
    p = plan(rows, lambda n, shape: stored_type(n, shape, wanted), req.engine, block_bytes, copy_stored=True)
    tok: list = []
    if tokenizer:
        if assets_dir is None or storage.is_remote(assets_dir):
            raise UnsupportedError(f"{req.source}: its tokenizer files are not on this machine; export with "
                                   "--no-tokenizer or from a local copy")
        cfg = rows.cfg
        tok = tokenizer_metadata(assets_dir, cfg.hf_config, cfg.vocab_size, req.source, pre_tokenizers=PRE_TOKENIZERS,
                                 spm_model=SPM_MODEL, family_model=p.spec_gguf.tokenizer,
                                 visible=p.spec_gguf.visible_tokens, spm_ids=p.spec_gguf.spm_ids)
    planned = [gguf.PlannedTensor(n, v.shape, gguf.TensorType.F32, functools.partial(lambda v: v, v))
               for n, v in p.extra()]
    for t in p.tensors:
        planned.append(gguf.PlannedTensor(t.name, t.shape, t.type, p.produce(t)))
    model_name = name or title(os.path.basename(os.path.normpath(req.source)))
    sampling = sampling_metadata(assets_dir)
    metadata = _metadata(p.spec_gguf, p.h, rows.cfg.num_layers, model_name, size_label(planned), file_type, tok,
                         sampling)
    files = [(dst, metadata, planned)]
    if towers:  # made after the text model's tensors, on the same engine
        parts = Parts(req.engine.stream(projector.jobs(rows, towers)))
        tower_planned = [gguf.PlannedTensor(t.name, t.shape, t.type, functools.partial(parts.take, t.name))
                         for t in towers]
        files.append((projector.projector_path(dst, mmproj),
                      projector.metadata(rows, model_name, size_label(tower_planned), file_type, processor, sampling),
                      tower_planned))
    total = sum(t.nbytes for _, _, ts in files for t in ts)
    bar = Progress(total, req.desc, enabled=req.progress)
    sizes = gguf.write_gguf_files(files, overwrite=req.overwrite, sources=[req.source, *req.adapters],
                                  on_written=bar.update)
    bar.close()
    types: dict[str, int] = {}
    for p_t in planned:
        types[p_t.type.name] = types.get(p_t.type.name, 0) + 1
    tok_model = next((v.value for k, v in tok if k == "tokenizer.ggml.model"), None)
    return GGUFReport(direction=req.direction, source=req.source, adapter=", ".join(req.adapters) or None,
                      destination=dst, family=rows.cfg.family, architecture=p.spec_gguf.arch, outtype=outtype,
                      tensors=len(planned), tensor_types=types, bytes=sizes[0], tokenizer=tok_model,
                      seconds=round(time.perf_counter() - req.t0, 3),
                      projector=files[1][0] if towers else None, projector_tensors=len(towers) or None,
                      projector_bytes=sizes[1] if towers else None,
                      towers=tower_record(rows.tower_entries, rows.key_info) or None)


__all__ = ["GGUFReport", "OUTTYPES", "Planned", "family", "plan", "stored_type", "store", "tower_refusal", "write"]
