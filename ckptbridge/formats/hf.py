"""HF safetensors: a model directory (``config.json`` + ``model.safetensors``, or shards with
``model.safetensors.index.json``) read as the family's rows, and any model's rows written as one.

Reading validates the whole directory against the family spec before any weight is read (keys,
shapes, dtypes against the config); the family comes from the config's model type, the key
prefix from the files (any of the family's prefixes is read; the one found is written back).
Writing is streaming: an untouched tensor of an HF source is copied file to file in the kernel
(``copy_file_range``), every other is written from the pieces the source's plan makes on the
engine's workers ahead of the writer (merged, quantized on the way), in shards of at most
``max_shard_size``, with ``config.json`` and the model's non-weight files.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from collections.abc import Collection, Iterator

import numpy as np

from ckptbridge import mapping, model_card, options, specs
from ckptbridge.config import ModelConfig
from ckptbridge.errors import CkptBridgeError, MismatchError, UnsupportedError
from ckptbridge.io import storage
from ckptbridge.io.files import close_on_error
from ckptbridge.io.hf import HFModelDir, write_model_directory
from ckptbridge.io.safetensors import PlannedTensor, dtype_code, numpy_dtype
from ckptbridge.report import Report, human_bytes
from ckptbridge.rows import (
    ConversionReport,
    HFPlan,
    HFTensor,
    ModelRows,
    Part,
    Request,
    layer_note,
    matrix_rows,
    more,
    tower_record,
    towers_line,
)
from ckptbridge.specs import FamilySpec, family_for
from ckptbridge.stream import Job, Parts, Stream

NAME = "hf"


def is_hf_directory(path: str) -> bool:
    """An HF model directory (config.json, no Orbax ``_METADATA``) rather than an Orbax checkpoint
    (which is what a ``gs://`` path is)."""
    if storage.is_remote(path):
        return False
    return os.path.isfile(os.path.join(path, "config.json")) and not os.path.isfile(os.path.join(path, "_METADATA"))


def detect(probe) -> bool:
    """An HF model directory: config.json, and neither an adapter's config nor an Orbax checkpoint."""
    return probe.has("config.json") and not probe.has("_METADATA") and not probe.has("adapter_config.json")


class HFSource(ModelRows):
    """An HF model directory checked against its family spec."""

    format = NAME
    row_addressable = True

    def __init__(self, model: HFModelDir, cfg: ModelConfig, spec: FamilySpec, prefix: str,
                 entries: list[mapping.Entry], tower_keys: list[str], tied_keys: list[str],
                 quantization: str | None = None, skip_multimodal: bool = False,
                 towers: list[mapping.Entry] | None = None, spelling: dict[str, str] | None = None):
        self.model, self.cfg, self.spec, self.prefix, self.entries = model, cfg, spec, prefix, entries
        self.path = model.path
        self.tower_keys, self.tied_keys = tower_keys, tied_keys
        self.quantization = quantization  # a quantized model's format (compressed-tensors)
        self.skip_multimodal = skip_multimodal
        self.tower_entries = [] if skip_multimodal else list(towers or [])
        self.tower_spelling = dict(spelling or {})

    @property
    def towers_dropped(self) -> int:  # type: ignore[override]
        return len(self.tower_keys) if self.skip_multimodal else 0

    def text_only(self) -> None:
        """Refuse a model with towers unless opened with ``skip_multimodal`` (for writers of the text model)."""
        if (self.tower_keys or self.cfg.towers) and not self.skip_multimodal:
            what = ", ".join(self.cfg.towers) or "multimodal"
            raise UnsupportedError(
                f"{self.path}: has {what} towers ({len(self.tower_keys)} tensors, e.g. "
                f"{self.tower_keys[0] if self.tower_keys else 'in config.json'}); this reads the text model "
                "only: pass --skip-multimodal (skip_multimodal=True) to use it and leave the towers out"
            )

    def arrays(self, entry: mapping.Entry, *, mapped: bool = False) -> list[np.ndarray]:
        read = self.model.mapped if mapped else self.model.array
        return [read(k) for k in entry.hf_keys]

    def tunix_value(self, entry: mapping.Entry, *, mapped: bool = False) -> np.ndarray:
        """The parameter of ``entry`` in its Tunix layout. With ``mapped`` the HF tensors are read
        over their files mapped into memory: where no rearrangement is needed the value is a
        read-only view of the file, copied only by whoever uses it. A stacked row is made one of
        its HF tensors at a time."""
        if not entry.hf_keys:  # a parameter Tunix keeps unused where HF has none (``hf_absent``)
            return np.zeros(entry.tunix_shape, self.dtype(entry))
        if entry.rule.stack is not None:  # one expert at a time
            read = self.model.mapped if mapped else self.model.array
            return mapping.stack_to_tunix(entry, (read(k) for k in entry.hf_keys))
        return mapping.hf_to_tunix(entry, self.arrays(entry, mapped=mapped))

    def dtype(self, entry: mapping.Entry) -> np.dtype:
        keys = entry.hf_keys or next(e.hf_keys for e in self.entries if e.hf_keys)
        return numpy_dtype(self.model.info(keys[0]).dtype)

    def hf_rows(self, blocks: mapping.Blocks, i: int, j: int) -> np.ndarray:
        """Indices ``i:j`` of the leading axis of ``blocks.entry``, in its HF stacked layout, read
        from disk (rows of its one tensor, or its tensors ``i:j``)."""
        keys = blocks.entry.hf_keys
        if not blocks.keyed:
            return self.model.file_of(keys[0]).rows(keys[0], i * blocks.hf_rows, j * blocks.hf_rows)
        out = np.empty((j - i, *blocks.entry.hf_shape), self.dtype(blocks.entry))
        for n, key in enumerate(keys[i:j]):
            out[n] = self.model.array(key)
        return out

    def key_rows(self, key: str, start: int, stop: int) -> np.ndarray:
        return self.model.file_of(key).rows(key, start, stop, matrix=True)

    def key_info(self, key: str) -> tuple[np.dtype, tuple[int, ...]]:
        info = self.model.info(key)
        return numpy_dtype(info.dtype), tuple(info.shape)

    def hf_keys(self) -> list[str]:
        """Every tensor of the files (towers too, unless opened with ``skip_multimodal``)."""
        if not self.tower_entries and self.tower_keys:
            towers = set(self.tower_keys)
            return [k for k in self.model.keys() if k not in towers]
        return self.model.keys()

    def position(self, key: str) -> tuple:
        files = sorted(self.model.files)
        return files.index(os.path.basename(self.model.file_of(key).path)), key

    def assets(self) -> tuple[list[str], str] | None:
        names = self.model.asset_files()
        return (names, self.model.path) if names else None

    def asset_dir(self) -> str:
        return self.model.path

    def hf_plan(self, chunk_bytes: int, computed: Collection[str] = (), towers: bool = True) -> HFPlan:
        """Every tensor of the files in their order (towers and stored tied heads too): those in
        ``computed`` read in blocks of rows of at most ``chunk_bytes`` as float32 (each counted at
        what a block holds at its peak: the float32 rows, the rows read and the rows returned),
        the others copied as stored (``towers``: False for the text model's alone)."""
        tensors: list[HFTensor] = []
        jobs: list[Job] = []
        skip = set() if towers else {k for e in self.tower_entries for k in e.hf_keys}
        for key in self.hf_keys():
            if key in skip:
                continue
            dtype, shape = self.key_info(key)
            if key not in computed:
                tensors.append(HFTensor(key, dtype, shape, 0, functools.partial(self.byte_range, key)))
                continue
            out_dim, in_dim = matrix_rows(shape), shape[-1]
            rows = max(1, chunk_bytes // (4 * in_dim))
            held = 4 + 2 * dtype.itemsize  # float32 rows, and the source rows read and written
            starts = range(0, out_dim, rows)
            tensors.append(HFTensor(key, dtype, shape, len(starts)))
            jobs += [((min(s + rows, out_dim) - s) * in_dim * held,
                      functools.partial(self._rows_part, key, s, min(s + rows, out_dim))) for s in starts]
        return HFPlan(tensors, jobs)

    def _rows_part(self, key: str, start: int, stop: int) -> list[Part]:
        rows = self.key_rows(key, start, stop)
        shape = self.key_info(key)[1]
        return [(key, start, rows.reshape(shape) if start == 0 and stop >= matrix_rows(shape) else rows)]

    def byte_range(self, key: str):
        return self.model.file_of(key).byte_range(key)

    def close(self) -> None:
        self.model.close()


def open_hf_source(src: str, *, skip_multimodal: bool = False, quantized_ok: bool = False,
                   keep_towers: bool = False, quantized_fix: str | None = None) -> HFSource:
    """Open and fully validate an HF model directory (keys, shapes, dtypes) without reading weights.
    A model with vision/audio towers needs ``skip_multimodal`` (its text model is read, the towers
    dropped) unless ``keep_towers`` (an HF destination copies them). A quantized model
    (compressed-tensors: its weights' scales beside them) is refused (``quantized_fix``: what to do
    instead) unless ``quantized_ok`` (for what needs its names and shapes only)."""
    from ckptbridge.formats import compressed_tensors  # (imports ml_dtypes: only when opening a model)

    with close_on_error(HFModelDir(src)) as model:
        if not quantized_ok:  # before validating: other formats store tensors the family table does not name
            why = compressed_tensors.already_quantized(model.config, {k: model.info(k).dtype for k in model.keys()})
            if why:
                fix = quantized_fix or ("ckptbridge converts unquantized checkpoints: use the model it was "
                                        "quantized from")
                raise UnsupportedError(f"{src}: already quantized ({why}); {fix}")
        source = _validate_hf(model, skip_multimodal or not keep_towers)
        if not keep_towers:
            source.skip_multimodal = skip_multimodal
            source.text_only()
        return source


def open_source(src: str, *, skip_multimodal: bool = False, keep_towers: bool = False,
                quantized_fix: str | None = None, **_) -> HFSource:
    return open_hf_source(src, skip_multimodal=skip_multimodal, keep_towers=keep_towers, quantized_fix=quantized_fix)


def find_prefix(spec: FamilySpec, keys) -> str | None:
    """The family key prefix most of ``keys`` use (None when they use none of them)."""
    model_keys = [s for r in spec.rules if r.scope == "model" and not r.absolute for s in r.hf]
    counts = {p: sum(1 for k in keys if k.startswith(p + "layers.") or k[len(p):] in model_keys and k.startswith(p))
              for p in spec.key_prefixes}
    best = max(counts, key=lambda p: counts[p])
    return best if counts[best] else None


def _validate_hf(model: HFModelDir, skip_towers: bool) -> HFSource:
    from ckptbridge.formats.compressed_tensors import describe

    where = os.path.join(model.path, "config.json")
    spec = family_for(model.config, where)
    cfg = spec.parse_config(model.config, where)
    keys = model.keys()
    tower_keys = [k for k in keys if k.startswith(spec.foreign_prefixes)]
    text_keys = set(keys) - set(tower_keys)
    prefix = find_prefix(spec, text_keys)
    if prefix is None:
        first = next(s for r in spec.rules if r.scope == "model" and not r.absolute for s in r.hf)
        raise MismatchError(
            f"{model.path}: no {first} or layers.* under any of the prefixes "
            f"{', '.join(spec.key_prefixes)}; not a {spec.name} text model checkpoint"
        )
    ents = mapping.entries(cfg, spec, prefix)
    expected = {k: e for e in ents for k in e.hf_keys}
    tied = [k for k in text_keys if k in spec.tied_keys and k not in expected]
    absent = {k for e in ents for k in e.absent_keys}  # present in older writers' files; unused
    if tied and not cfg.tie_word_embeddings:
        raise UnsupportedError(
            f"{model.file_of(tied[0]).path}: {tied[0]} is untied from the embedding "
            f"(tie_word_embeddings false); Tunix's {spec.name} ties the output head to the embedding"
        )
    quantization = describe(model.config)
    scales = {k for k in text_keys if k.endswith(".weight_scale") and k[: -len("_scale")] in expected} \
        if quantization else set()
    unknown = sorted(text_keys - set(expected) - set(tied) - absent - scales)
    if unknown:
        raise MismatchError(
            f"{model.file_of(unknown[0]).path}: unexpected tensor {unknown[0]!r}{more(unknown)}: not part of the "
            f"{spec.name} text model that config.json describes; the weights and config.json disagree"
        )
    for key, entry in expected.items():
        if key not in model:
            raise MismatchError(
                f"{model.path}: tensor {key!r} is missing{layer_note(entry)}; the checkpoint is incomplete "
                "or config.json belongs to another model"
            )
        info = model.info(key)
        if info.shape != entry.hf_shape:
            raise MismatchError(
                f"{model.file_of(key).path}: tensor {key!r} has shape {info.shape}, config.json implies "
                f"{entry.hf_shape}{layer_note(entry)}; the weights and config.json disagree"
            )
    for entry in ents:
        dts = {model.info(k).dtype for k in entry.hf_keys}
        if len(dts) > 1:  # (none for hf_absent rows)
            raise MismatchError(
                f"{model.path}: {' and '.join(entry.hf_keys)} have different dtypes {sorted(dts)}; "
                "they are fused into one Tunix parameter and must match"
            )
    towers, spelling = ([], {}) if skip_towers else _validate_towers(model, cfg, spec, prefix, tower_keys)
    return HFSource(model, cfg, spec, prefix, ents, tower_keys, tied, quantization, skip_towers, towers, spelling)


def tower_spelling(spec: FamilySpec, root: str, keys: Collection[str]) -> dict[str, str]:
    """The towers' other key spellings (:attr:`~ckptbridge.specs.base.Tower.aliases`) ``keys`` use."""
    found = {}
    for tower in spec.towers:
        for prefix, other in tower.aliases:
            if not any(k.startswith(root + prefix) for k in keys) and any(k.startswith(root + other) for k in keys):
                found[prefix] = other
    return found


def spelling_beside(directory: str | None, spec: FamilySpec, prefix: str) -> dict[str, str]:
    """The towers' key spellings of the HF model in ``directory`` (a ``--config`` directory that
    holds the model's weights too), for a source that does not record its own (a GGUF or MaxText
    checkpoint made by other tools): read from its tensors' names, no weight read; none where the
    directory holds no weights (the rules' own spelling is written)."""
    if not directory or storage.is_remote(directory) or prefix not in spec.tower_roots \
            or not os.path.isfile(os.path.join(directory, "config.json")):
        return {}
    try:
        with HFModelDir(directory) as model:
            return tower_spelling(spec, spec.tower_roots[prefix], model.keys())
    except CkptBridgeError:  # no weights there (a config alone), or weights of no use: the rules' spelling
        return {}


def _validate_towers(model: HFModelDir, cfg: ModelConfig, spec: FamilySpec, prefix: str,
                     tower_keys: list[str]) -> tuple[list[mapping.Entry], dict[str, str]]:
    """The towers' rows, every tensor of them checked against config.json (keys and shapes)."""
    where = os.path.join(model.path, "config.json")
    if not cfg.towers:
        if tower_keys:
            raise UnsupportedError(f"{model.file_of(tower_keys[0]).path}: tensor {tower_keys[0]!r}{more(tower_keys)} "
                                   "belongs to a vision/audio tower that config.json does not configure; pass "
                                   "--skip-multimodal to convert the text model without it")
        return [], {}
    if prefix not in spec.tower_roots:
        raise MismatchError(f"{where}: configures {', '.join(cfg.towers)} towers, but the text model's keys "
                            f"({prefix}...) are those of a text-only checkpoint; the weights and config.json disagree")
    spelling = tower_spelling(spec, spec.tower_roots[prefix], tower_keys)
    towers = mapping.tower_entries(cfg, spec, prefix, spec.tower_configs(cfg, where), spelling)
    expected = {e.hf_keys[0]: e for e in towers}
    unknown = [k for k in tower_keys if k not in expected]
    if unknown:
        raise MismatchError(f"{model.file_of(unknown[0]).path}: unexpected tensor {unknown[0]!r}{more(unknown)}: not "
                            f"part of the {spec.name} towers config.json describes; the weights and config.json "
                            "disagree")
    for key, entry in expected.items():
        if key not in model:
            raise MismatchError(f"{model.path}: tensor {key!r} of the {entry.tower} tower is missing; the checkpoint "
                                "is incomplete or config.json belongs to another model")
        if model.info(key).shape != entry.hf_shape:
            raise MismatchError(f"{model.file_of(key).path}: tensor {key!r} has shape {model.info(key).shape}, "
                                f"config.json ({entry.tower}_config) implies {entry.hf_shape}; the weights and "
                                "config.json disagree")
    return towers, spelling


# --------------------------------------------------------------------------- writing


@dataclasses.dataclass(frozen=True)
class ToHFReport(ConversionReport):
    """A model written as an HF directory."""

    OMIT_NONE = ("quantized", "quantized_tensors", "scan_layers", "towers")

    files: list[str]
    config_mismatch: str | None
    seconds: float
    quantized: str | None = None  # the scheme the decoder's projections were quantized to
    quantized_tensors: int | None = None
    scan_layers: bool | None = None  # a MaxText source's layout
    towers: dict | None = None  # the vision/audio towers written (tensors, bytes by tower)

    def summary(self) -> str:
        q = f"\n  {self.quantized_tensors} weights quantized to {self.quantized}" if self.quantized else ""
        lay = f"\n  MaxText layout: {'scanned' if self.scan_layers else 'unscanned'}" \
            if self.scan_layers is not None else ""
        return self._head(self.seconds) + towers_line(self.towers) + lay + q + f"\n  files: {', '.join(self.files)}"


@dataclasses.dataclass(frozen=True)
class MergeReport(Report):
    """Adapters merged into their base, written as an HF directory."""

    direction: str
    base: str
    adapter: str
    destination: str
    family: str
    merged_tensors: int
    copied_tensors: int
    bytes: int
    files: list[str]
    seconds: float
    quantized: str | None = None  # the scheme the merged weights were quantized to
    quantized_tensors: int = 0

    def summary(self) -> str:
        q = f", {self.quantized_tensors} quantized to {self.quantized}" if self.quantized else ""
        return (f"merge: {self.base} + {self.adapter} -> {self.destination}\n"
                f"  {self.merged_tensors} tensors merged{q}, {self.copied_tensors} copied, "
                f"{human_bytes(self.bytes)} in {self.seconds:.2f} s\n  files: {', '.join(self.files)}")


@dataclasses.dataclass(frozen=True)
class QuantizeReport(Report):
    """An HF model quantized."""

    direction: str
    source: str
    destination: str
    family: str
    scheme: str
    quantized_tensors: int
    copied_tensors: int
    bytes: int
    source_bytes: int
    files: list[str]
    seconds: float

    def summary(self) -> str:
        return (f"quantize: {self.source} -> {self.destination} ({self.scheme})\n"
                f"  {self.quantized_tensors} weights quantized, {self.copied_tensors} tensors copied, "
                f"{human_bytes(self.source_bytes)} -> {human_bytes(self.bytes)} in {self.seconds:.2f} s\n"
                f"  files: {', '.join(self.files)}")


def quantization_plan(rows: ModelRows, quantize: str, where: str):
    """What quantizing ``rows`` under ``quantize`` writes (a one-line error first for a model that
    cannot be: experts, weights that are not bf16, f16 or f32, ...)."""
    from ckptbridge.formats import compressed_tensors as ct

    scheme = ct.get_scheme(quantize, "quantize (--quantize)")
    infos = {k: rows.key_info(k) for k in rows.hf_keys()}
    return ct.plan_model(rows.spec, rows.cfg, rows.prefix, {k: dtype_code(d) for k, (d, _) in infos.items()},
                         {k: s for k, (_, s) in infos.items()}, scheme, where)


def _copied(stream: Stream, raw) -> Iterator:
    """The bytes of an untouched tensor, copied file to file while computed pieces are made ahead."""
    stream.prefetch()
    yield raw()


def _named(make) -> list[tuple[str, object]]:
    return [(key, value) for key, _, value in make()]


def write(rows: ModelRows, dst: str, req: Request, *, max_shard_size: str | int = options.DEFAULT_MAX_SHARD_SIZE,
          quantize: str | None = None, base_id: str | None = None) -> Report:
    """Write ``rows`` as the HF model directory ``dst``: every HF tensor of the source's plan
    (:meth:`~ckptbridge.rows.ModelRows.hf_plan`), ``quantize`` (``"int8"``, ``"fp8"``) quantizing
    the decoder's linear projections in the same pass (compressed-tensors, as llm-compressor
    writes them), config.json, the source's non-weight files, and a model card when adapters were
    merged or the model quantized (``base_id``: the base's Hub id it names)."""
    from ckptbridge.formats import compressed_tensors as ct

    shard_bytes = options.size("max_shard_size", max_shard_size)
    model_card.check_repo_id("base_id", base_id)
    mismatch = specs.note_mismatch(rows.cfg)
    engine = req.engine
    keys = rows.hf_keys()
    qplan = quantization_plan(rows, quantize, req.source) if quantize is not None else None
    block_bytes = req.chunk_bytes if req.chunked else min(req.chunk_bytes, engine.budget.limit // 2)
    plan = rows.hf_plan(block_bytes, computed=set(qplan.weights) if qplan else ())
    jobs = plan.jobs if qplan is None else ct.quantized_jobs(plan.jobs, qplan, {t.key: t.shape for t in plan.tensors})
    stream = engine.stream((cost, functools.partial(_named, make)) for cost, make in jobs)
    parts: Parts = Parts(stream)
    planned: list[PlannedTensor] = []
    for t in plan.tensors:
        if t.raw is not None:
            planned.append(PlannedTensor(t.key, t.dtype, t.shape, chunks=functools.partial(_copied, stream, t.raw)))
        elif qplan is not None and t.key in qplan.weights:
            planned += qplan.tensors(t.key, t.shape, t.dtype, functools.partial(parts.take_many, t.key, t.parts))
        elif t.parts == 1:
            planned.append(PlannedTensor(t.key, t.dtype, t.shape, functools.partial(parts.take, t.key)))
        else:
            planned.append(PlannedTensor(t.key, t.dtype, t.shape, chunks=functools.partial(parts.take_many, t.key,
                                                                                         t.parts)))
    merged = rows.merged_keys
    card = _card(rows, req, base_id, qplan, len(merged))
    found = rows.assets()
    config = qplan.hf_config(rows.cfg.hf_config) if qplan else rows.cfg.hf_config
    files = write_model_directory(dst, planned, config, shard_bytes, assets_from=found[1] if found else None,
                                  card=card, overwrite=req.overwrite, desc=req.desc, progress=req.progress)
    total = sum(t.nbytes for t in planned)
    seconds = round(time.perf_counter() - req.t0, 3)
    if req.adapters:
        quantized = qplan.weights if qplan else ()
        return MergeReport(
            direction=req.direction, base=req.source, adapter=", ".join(req.adapters), destination=dst,
            family=rows.spec.name, merged_tensors=len(merged),
            copied_tensors=len(keys) - len(set(merged) | set(quantized)),
            bytes=total, files=files, seconds=seconds, quantized=qplan.scheme.name if qplan else None,
            quantized_tensors=len(quantized))
    if qplan is not None and rows.format == NAME:
        return QuantizeReport(
            direction=req.direction, source=req.source, destination=dst, family=rows.spec.name,
            scheme=qplan.scheme.name, quantized_tensors=len(qplan.weights),
            copied_tensors=len(keys) - len(qplan.weights), bytes=total,
            source_bytes=sum(math.prod(s) * d.itemsize for d, s in map(rows.key_info, keys)), files=files,
            seconds=seconds)
    return ToHFReport(
        direction=req.direction, source=req.source, destination=dst, family=rows.spec.name, key_prefix=rows.prefix,
        layer_kinds=rows.cfg.layer_kinds(), tensors=len(planned), bytes=total, files=files, config_mismatch=mismatch,
        seconds=seconds, quantized=qplan.scheme.name if qplan else None,
        quantized_tensors=len(qplan.weights) if qplan else None, scan_layers=rows.scan_layers,
        towers=tower_record(rows.tower_entries, rows.key_info) or None)


def _card(rows: ModelRows, req, base_id: str | None, qplan, merged: int) -> str | None:
    """The model card of a merged or quantized model (None otherwise: the source's is copied)."""
    if not req.adapters and qplan is None:
        return None
    towers = tower_record(rows.tower_entries, rows.key_info)
    base_path = rows.path
    found_id = model_card.hub_id(base_path, base_id) if os.path.isdir(base_path) else base_id
    if req.adapters:
        adapter = ", ".join(req.adapters)
        single = req.adapters[0] if len(req.adapters) == 1 else None
        return model_card.merged_card(
            base_id=found_id, base_path=base_path, adapter=adapter,
            adapter_id=model_card.hub_id(single) if single and os.path.isdir(single) else None,
            step=req.adapter_step, family=rows.spec.name, merged_tensors=merged,
            quantized=qplan.describe() if qplan else None, towers=towers)
    return model_card.quantized_card(base_id=found_id, base_path=base_path, family=rows.spec.name,
                                     description=qplan.describe(), towers=towers)


__all__ = ["HFSource", "MergeReport", "QuantizeReport", "ToHFReport", "detect", "find_prefix", "is_hf_directory",
           "open_hf_source", "write"]
