"""Conversions between HF safetensors and Tunix/Orbax, one function per direction.

Both directions validate the whole source against the spec table before writing a byte,
stream tensor by tensor (peak memory about one tensor), write into a temporary sibling of the
destination and rename it into place at the end.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time

import numpy as np

from ckptbridge import deps, hub, lora, mapping, options, specs
from ckptbridge import quantize as quantization
from ckptbridge.errors import ConfigError
from ckptbridge.io import DEFAULT_CHUNK_SIZE, storage
from ckptbridge.io import orbax as orbax_io
from ckptbridge.io.atomic import atomic_directory, check_destination
from ckptbridge.io.hf import copy_assets, write_model_directory
from ckptbridge.io.safetensors import PlannedTensor, dtype_code
from ckptbridge.metadata import KEY, Metadata, installed_tunix_version
from ckptbridge.options import DEFAULT_MAX_SHARD_SIZE
from ckptbridge.progress import progress_over
from ckptbridge.report import Report, human_bytes
from ckptbridge.sources import ASSETS_DIR, HFSource, OrbaxSource, RowSource, open_hf_source, open_orbax_source
from ckptbridge.specs.base import tunix_version_key
from ckptbridge.stream import Job, Parallelism, Parts

log = logging.getLogger(__name__)
__all__ = ["convert_orbax_to_safetensors", "convert_safetensors_to_orbax", "open_hf_source", "open_orbax_source"]


def _metadata(source: HFSource, kind: str, assets: list[str], tunix_version: str | None) -> dict:
    return {KEY: Metadata(
        kind=kind, family=source.spec.name, hf_config=source.model.config, key_prefix=source.prefix,
        config_dialect=source.cfg.dialect, towers_dropped=len(source.tower_keys), assets=assets,
        source=os.path.abspath(source.model.path), tunix_version=tunix_version,
    ).to_json()}



@dataclasses.dataclass(frozen=True)
class ConversionReport(Report):
    """A weights conversion: where from and to, what it held, how long it took."""

    direction: str
    source: str
    destination: str
    family: str
    key_prefix: str
    layer_kinds: dict[str, int]
    tensors: int
    bytes: int

    def _head(self, seconds: float) -> str:
        kinds = ", ".join(f"{v} {k}" for k, v in self.layer_kinds.items())
        return (f"{self.direction}: {self.source} -> {self.destination}\n"
                f"  {self.family}, key prefix {self.key_prefix}, layers: {kinds}\n"
                f"  {self.tensors} tensors, {human_bytes(self.bytes)} in {seconds:.2f} s")


@dataclasses.dataclass(frozen=True)
class SafetensorsToOrbaxReport(ConversionReport):
    towers_dropped: int
    tunix_version: str | None
    chunk_bytes: int
    compression: bool
    orbax_writer: str
    config_mismatch: str | None
    seconds: float

    def summary(self) -> str:
        text = self._head(self.seconds)
        if self.towers_dropped:
            text += f"\n  dropped {self.towers_dropped} vision/audio tensors (--skip-multimodal)"
        return text


@dataclasses.dataclass(frozen=True)
class OrbaxToSafetensorsReport(ConversionReport):
    OMIT_NONE = ("quantized", "quantized_tensors")

    files: list[str]
    config_mismatch: str | None
    seconds: float
    quantized: str | None = None  # the scheme the decoder's projections were quantized to
    quantized_tensors: int | None = None

    def summary(self) -> str:
        q = f"\n  {self.quantized_tensors} weights quantized to {self.quantized}" if self.quantized else ""
        return self._head(self.seconds) + q + f"\n  files: {', '.join(self.files)}"


# What a piece of safetensors-to-orbax or orbax-to-safetensors holds at its peak, in bytes per byte
# of it, for the memory budget: the piece and TensorStore's encoded copy of it while it is stored
# (s2o), or the chunk TensorStore decoded it from while it is rearranged (o2s). Counting one would
# let twice the pieces start, and peak RSS grow with the workers past the budget.
HELD_PER_BYTE = 2


def _per_block(blocks: mapping.Blocks, nbytes: int, chunk_bytes: int) -> int:
    """Indices of ``blocks.axis`` per block of at most ``chunk_bytes`` (at least one)."""
    return max(1, chunk_bytes // max(1, nbytes // blocks.count))


def _leaf(source: RowSource, e: mapping.Entry, chunk_bytes: int) -> orbax_io.LazyArray:
    """The Orbax leaf of ``e``: whole, or in row blocks of at most ``chunk_bytes`` when larger
    (each block read and rearranged on its own, on any worker). The rearranged copy is ours, tiled
    (``layout.transpose_copy``): handing TensorStore strided views to copy while encoding instead
    took 18-19 s of user CPU for a 31B-width k = 4 base against 12-14 s (docs/benchmarks.md)."""
    dtype = source.dtype(e)
    nbytes = int(np.prod(e.tunix_shape, dtype=np.int64)) * dtype.itemsize
    blocks = mapping.blocks(e)
    if blocks is None or nbytes <= chunk_bytes:
        return orbax_io.LazyArray(e.tunix_shape, dtype, produce=functools.partial(source.tunix_value, e),
                                  held=HELD_PER_BYTE)
    per = _per_block(blocks, nbytes, chunk_bytes)
    pieces = [(blocks.tunix_region(i, j), functools.partial(source.tunix_block, blocks, i, j))
              for i, j in blocks.ranges(per)]
    return orbax_io.LazyArray(e.tunix_shape, dtype, chunks=blocks.tunix_block_shape(per), pieces=pieces,
                              held=HELD_PER_BYTE)


def target_tunix_version(tunix_version: str | None) -> str | None:
    """The Tunix version whose layouts a verb writes: ``tunix_version`` (checked), else the
    installed google-tunix's (None without one: the layouts the specs were written against)."""
    if tunix_version is not None:
        try:
            tunix_version_key(tunix_version)
        except ValueError as e:
            raise ConfigError(f"tunix_version (--tunix-version): {e}") from None
    return tunix_version or installed_tunix_version()


def convert_safetensors_to_orbax(src: str, dst: str, *, overwrite: bool = False,
                                 skip_multimodal: bool = False, tunix_version: str | None = None,
                                 chunk_size: str | int = DEFAULT_CHUNK_SIZE, compression: bool = True,
                                 workers: int | None = None, memory_budget: str | int | None = None,
                                 progress: bool | None = None, revision: str | None = None) -> SafetensorsToOrbaxReport:
    """HF model directory -> Orbax checkpoint of the Tunix nnx state (nested dict, source dtypes).

    The tree has the layouts of Tunix ``tunix_version`` (default: the installed google-tunix;
    without one, the layouts of the version the specs were written against), recorded in the
    checkpoint's metadata. A tensor larger than ``chunk_size`` is read, rearranged and written
    in row blocks of at most that size, each one chunk of the stored array, so memory stays a
    few chunks however large the tensor; smaller ones are one chunk each, as Orbax writes them.
    ``compression=False`` stores the chunks without zstd (faster, larger). Blocks are read and
    rearranged on ``workers`` threads (default: the usable cores, at most 4) while TensorStore encodes and
    writes earlier ones, with at most ``memory_budget`` bytes of them (default 256 MiB) made and
    not yet stored, each counted twice (:data:`HELD_PER_BYTE`: with TensorStore's encoded copy);
    the checkpoint does not depend on either. ``src`` may be a Hub id
    (``revision``: its branch, tag or commit).
    """
    t0 = time.perf_counter()
    deps.require("orbax")
    chunk_bytes, parallel = Parallelism.for_chunks(chunk_size, workers, memory_budget)
    target = target_tunix_version(tunix_version)
    src = hub.local(src, hub.MODEL, revision=revision)
    check_destination(dst, [src], overwrite)
    with open_hf_source(src, skip_multimodal=skip_multimodal) as source, \
            parallel.engine("s2o") as engine:
        mismatch = specs.note_mismatch(source.cfg)
        flat = {e.tunix_path: _leaf(source, e, chunk_bytes)
                for e in mapping.for_tunix_version(source.entries, target)}
        bar = progress_over(flat.values(), "safetensors -> orbax", progress)
        total = bar.total
        assets = source.model.asset_files()
        with atomic_directory(dst, overwrite) as tmp:
            writer = orbax_io.save_tree(tmp, orbax_io.nest(flat), _metadata(source, "weights", assets, target),
                                        compression=compression, engine=engine)
            if assets:
                copy_assets(assets, source.model.path, storage.join(tmp, ASSETS_DIR))
        bar.close()
        return SafetensorsToOrbaxReport(
            direction="safetensors-to-orbax", source=src, destination=dst, family=source.spec.name,
            key_prefix=source.prefix, layer_kinds=source.cfg.layer_kinds(), tensors=len(flat), bytes=total,
            towers_dropped=len(source.tower_keys), tunix_version=target, chunk_bytes=chunk_bytes,
            compression=compression, orbax_writer=writer, config_mismatch=mismatch,
            seconds=round(time.perf_counter() - t0, 3))


Part = tuple[str, np.ndarray]  # an HF key and values of it: the whole tensor or a run of its rows


def _whole_parts(source: OrbaxSource, e: mapping.Entry) -> list[Part]:
    return list(zip(e.hf_keys, mapping.tunix_to_hf(e, source.tunix_value(e))))


def _box_parts(source: OrbaxSource, blocks: mapping.Blocks, i: int, j: int) -> list[Part]:
    hf = blocks.to_hf(source.tunix_box(blocks, i, j), i, j)
    keys = blocks.entry.hf_keys
    if not blocks.keyed:  # rows of the one HF tensor
        return [(keys[0], hf)]
    return [(keys[n], hf[n - i]) for n in range(i, j)]  # one HF tensor per index


def _o2s_jobs(source: OrbaxSource, e: mapping.Entry, chunk_bytes: int) -> tuple[list[Job], dict[str, int]]:
    """The jobs that make the HF tensors of ``e`` (in write order) and the parts each HF key is
    written from: the whole leaf, or boxes of about ``chunk_bytes`` (whole stored chunks) when it
    is larger and can be read in boxes (then one part per box for a single HF tensor)."""
    nbytes = source.nbytes(e)
    blocks = mapping.blocks(e) if nbytes > chunk_bytes else None
    ranges = source.block_ranges(blocks, chunk_bytes) if blocks is not None else None
    if blocks is None or ranges is None or len(ranges) < 2:
        return [(HELD_PER_BYTE * nbytes, functools.partial(_whole_parts, source, e))], dict.fromkeys(e.hf_keys, 1)
    jobs: list[Job] = [(HELD_PER_BYTE * nbytes * (j - i) // blocks.count,
                        functools.partial(_box_parts, source, blocks, i, j))
                       for i, j in ranges]
    return jobs, ({e.hf_keys[0]: len(ranges)} if not blocks.keyed else dict.fromkeys(e.hf_keys, 1))


def convert_orbax_to_safetensors(src: str, dst: str, *, config: str | None = None,
                                 max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
                                 step: int | None = None, overwrite: bool = False,
                                 chunk_size: str | int = DEFAULT_CHUNK_SIZE, workers: int | None = None,
                                 memory_budget: str | int | None = None,
                                 progress: bool | None = None, quantize: str | None = None) -> OrbaxToSafetensorsReport:
    """Orbax weights checkpoint -> HF model directory (sharded safetensors + index, config.json,
    and the non-weight files stored with the checkpoint or next to ``config``). A leaf larger
    than ``chunk_size`` is read, rearranged and written in boxes of about that size (whole
    stored chunks, so memory follows the checkpoint's chunk size, not its largest tensor). Leaves
    and boxes are read, decoded and rearranged on ``workers`` threads (default: the usable cores, at most 4)
    ahead of the writer, holding at most ``memory_budget`` bytes of them (default 256 MiB), each
    counted twice (:data:`HELD_PER_BYTE`: with the chunk TensorStore decoded it from); the files
    written do not depend on either. ``quantize`` (``"int8"`` or ``"fp8"``): the decoder's
    linear projections are written quantized in the same pass, as ``ckptbridge quantize`` writes them."""
    t0 = time.perf_counter()
    scheme = quantization.get_scheme(quantize, "quantize (--quantize)") if quantize is not None else None
    shard_bytes = options.size("max_shard_size", max_shard_size)
    chunk_bytes, parallel = Parallelism.for_chunks(chunk_size, workers, memory_budget)
    check_destination(dst, [src] + ([config] if config else []), overwrite)
    with open_orbax_source(src, config=config, step=step) as source, \
            parallel.engine("o2s") as engine:
        mismatch = specs.note_mismatch(source.cfg)
        jobs: list[Job] = []
        tensors: list[tuple[mapping.Entry, str, int]] = []  # (entry, HF key, parts it is written from)
        for e in source.entries:
            e_jobs, counts = _o2s_jobs(source, e, chunk_bytes)
            jobs += e_jobs
            tensors += [(e, key, n) for key, n in counts.items()]
        plan = None
        if scheme is not None:
            base = lora.make_base(src, source.cfg, source.spec, source.prefix)
            shapes = {key: e.hf_shape for e, key, _ in tensors}
            plan = quantization.plan_model(base, {key: dtype_code(source.dtype(e)) for e, key, _ in tensors},
                                           shapes, scheme, src)
            jobs = [(cost, functools.partial(quantization.quantized_parts, make, plan, shapes)) for cost, make in jobs]
        parts: Parts = Parts(engine.stream(jobs))
        planned = []
        for e, key, n in tensors:
            if plan is not None and key in plan.weights:
                planned += plan.tensors(key, e.hf_shape, source.dtype(e), functools.partial(parts.take_many, key, n))
            elif n == 1:
                planned.append(PlannedTensor(key, source.dtype(e), e.hf_shape, functools.partial(parts.take, key)))
            else:
                planned.append(PlannedTensor(key, source.dtype(e), e.hf_shape,
                                             chunks=functools.partial(parts.take_many, key, n)))
        stored_assets = storage.join(source.ckpt.path, ASSETS_DIR)
        files = write_model_directory(
            dst, planned, plan.hf_config(source.cfg.hf_config) if plan else source.cfg.hf_config, shard_bytes,
            assets_from=stored_assets if storage.isdir(stored_assets) else source.config_dir,
            overwrite=overwrite, desc="orbax -> safetensors", progress=progress,
        )
        return OrbaxToSafetensorsReport(
            direction="orbax-to-safetensors", source=src, destination=dst, family=source.spec.name,
            key_prefix=source.prefix, layer_kinds=source.cfg.layer_kinds(), tensors=len(planned),
            bytes=sum(t.nbytes for t in planned), files=files, config_mismatch=mismatch,
            seconds=round(time.perf_counter() - t0, 3), quantized=plan.scheme.name if plan else None,
            quantized_tensors=len(plan.weights) if plan else None)
