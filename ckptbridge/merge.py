"""``merge_lora``: base HF model + LoRA adapter -> merged HF model, streaming.

Every base tensor is written in turn: tensors without LoRA are copied as raw bytes, file to
file in the kernel (``copy_file_range``); LoRA targets are merged a block of rows at a time,
``W + scale * B @ A`` accumulated in float32 and written in the base tensor's dtype, on the
workers of a :class:`~ckptbridge.stream.Engine` ahead of the writer (also while it copies the
tensors in between), within its memory budget. Memory stays at that budget plus the LoRA
factors, whatever the model size.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from collections.abc import Iterator

import numpy as np
from threadpoolctl import threadpool_limits

from ckptbridge import hub, lora, model_card, options
from ckptbridge.errors import MismatchError, UnsupportedError
from ckptbridge.io.atomic import check_destination
from ckptbridge.io.hf import HFModelDir, write_model_directory
from ckptbridge.io.safetensors import PlannedTensor, numpy_dtype
from ckptbridge.options import DEFAULT_MAX_SHARD_SIZE
from ckptbridge.quantize import Plan, Scheme, already_quantized, get_scheme, plan_model, quantize_weight
from ckptbridge.report import Report, human_bytes
from ckptbridge.stream import Job, Parallelism, Stream

BLOCK_BYTES = 32 << 20  # float32 bytes of one block of merged rows (at most half the memory budget)


def _merged_block(model: HFModelDir, key: str, factors: list[tuple[int, np.ndarray, np.ndarray]],
                  start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of ``key`` (seen as a matrix of its last axis) with every delta added:
    read, the float32 product and sum, rounded to the base dtype."""
    base = model.file_of(key).rows(key, start, stop, matrix=True)
    if len(factors) == 1 and factors[0][0] == 0 and len(factors[0][2]) >= stop:  # one delta on every row
        _, a32, b32 = factors[0]
        merged = b32[start:stop] @ a32
        merged += base  # W becomes float32 inside the ufunc, piecewise
    else:  # deltas on row ranges (one per expert)
        merged = base.astype(np.float32)
        for row, a32, b32 in factors:
            lo, hi = max(start, row), min(stop, row + len(b32))
            if lo < hi:
                merged[lo - start:hi - start] += b32[lo - row:hi - row] @ a32
    return merged.astype(numpy_dtype(model.info(key).dtype))


Deltas = dict[str, list[tuple[int, float, np.ndarray, np.ndarray]]]  # HF key -> (first row, scale, A, B) each


def collect_deltas(model: HFModelDir, ad, adapter: str) -> Deltas:
    """Every LoRA delta of the opened adapter ``ad`` by the base tensor it adds to (factors as
    stored; a key the base lacks is a one-line MismatchError)."""
    deltas: Deltas = {}
    for key, row, scale, (a, b) in lora.hf_deltas(ad):
        if key not in model:
            raise MismatchError(f"{adapter}: LoRA for {key}, which the base {model.path} does not have")
        deltas.setdefault(key, []).append((row, scale, np.array(a), np.array(b)))
    return deltas


def float32_factors(deltas: list[tuple[int, float, np.ndarray, np.ndarray]]) -> list:
    """One tensor's deltas as the block arithmetic takes them: ``(first row, float32 A, float32 scale * B)``
    (made when the tensor's first block is planned, not for every tensor at once)."""
    return [(row, a.astype(np.float32), b.astype(np.float32) * np.float32(scale)) for row, scale, a, b in deltas]


def merged_rows(model: HFModelDir, key: str, factors, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of ``key`` (as a matrix of its last axis) with the deltas ``factors``
    (``(first row, float32 A, float32 scale * B)``) added as the merge adds them; as stored without."""
    return _block(model, key, list(factors), start, stop, None)


def _rows_per_block(model: HFModelDir, key: str, block_bytes: int) -> int:
    return max(1, block_bytes // (4 * model.info(key).shape[-1]))


def _block(model: HFModelDir, key: str, factors: list, start: int, stop: int, scheme: Scheme | None):
    """Rows ``start:stop`` of ``key`` as written: merged when it has factors, else as stored; quantized
    to ``(weight, weight_scale)`` rows under ``scheme``."""
    rows = (_merged_block(model, key, factors, start, stop) if factors
            else model.file_of(key).rows(key, start, stop, matrix=True))
    return quantize_weight(rows, scheme, key) if scheme is not None else rows


def _jobs(model: HFModelDir, deltas: Deltas, plan: Plan | None, block_bytes: int) -> Iterator[Job]:
    """The computed row blocks of every LoRA target and quantized weight in write order, each job
    counted at what it holds at its peak (the float32 block, the base rows it read and the rows it
    returns); a target's float32 factors are made when its first block is started."""
    quantized = set(plan.weights) if plan else set()
    for key in model.keys():
        if key not in deltas and key not in quantized:
            continue
        info = model.info(key)
        out_dim, in_dim = math.prod(info.shape[:-1]), info.shape[-1]  # (e, out, in): experts' rows in turn
        rows = _rows_per_block(model, key, block_bytes)
        factors = float32_factors(deltas.get(key, []))
        scheme = plan.scheme if plan is not None and key in quantized else None
        held = 4 + 2 * np.dtype(numpy_dtype(info.dtype)).itemsize  # float32 rows, and the base's rows read and written
        for start in range(0, out_dim, rows):
            stop = min(start + rows, out_dim)
            yield (stop - start) * in_dim * held, functools.partial(_block, model, key, factors, start, stop, scheme)


def _blocks_of(model: HFModelDir, key: str, block_bytes: int) -> int:
    return math.ceil(math.prod(model.info(key).shape[:-1]) / _rows_per_block(model, key, block_bytes))


def _computed_rows(stream: Stream, count: int) -> Iterator:
    for _ in range(count):
        yield next(stream)


def _copied(model: HFModelDir, stream: Stream, key: str) -> Iterator:
    """The bytes of an untouched tensor, copied file to file while computed blocks are made ahead."""
    stream.prefetch()
    yield model.file_of(key).byte_range(key)


def _planned(model: HFModelDir, deltas: dict, plan: Plan | None, engine, block_bytes: int) -> list[PlannedTensor]:
    """Every tensor of the output in order: copied, merged, or quantized (weight then its scale)."""
    stream = engine.stream(_jobs(model, deltas, plan, block_bytes))
    quantized = set(plan.weights) if plan else set()
    planned = []
    for key in model.keys():
        info = model.info(key)
        count = _blocks_of(model, key, block_bytes) if key in quantized or key in deltas else 0
        if plan is not None and key in quantized:
            planned += plan.tensors(key, info.shape, numpy_dtype(info.dtype),
                                    functools.partial(_computed_rows, stream, count))
        elif key in deltas:
            planned.append(PlannedTensor(key, numpy_dtype(info.dtype), info.shape,
                                         chunks=functools.partial(_computed_rows, stream, count)))
        else:
            planned.append(PlannedTensor(key, numpy_dtype(info.dtype), info.shape,
                                         chunks=functools.partial(_copied, model, stream, key)))
    return planned


def _open_base(path: str, verb: str) -> lora.Base:
    """The base model at ``path``; a quantized one is refused first (its weights are not values to add
    to or to quantize again)."""
    if os.path.isdir(path):
        with HFModelDir(path) as model:
            why = already_quantized(model.config, {k: model.info(k).dtype for k in model.keys()})
        if why:
            fix = ("merge into the unquantized model it was made from (--quantize quantizes the result)"
                   if verb == "merge" else "quantize the unquantized model it was made from")
            raise UnsupportedError(f"{path}: already quantized ({why}); {fix}")
    return lora.open_base(path)


def quantization_plan(b: lora.Base, model: HFModelDir, scheme: Scheme, where: str) -> Plan:
    keys = model.keys()
    return plan_model(b, {k: model.info(k).dtype for k in keys},
                      {k: tuple(model.info(k).shape) for k in keys}, scheme, where)


@dataclasses.dataclass(frozen=True)
class MergeReport(Report):
    """An adapter merged into its base."""

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


def _write(model: HFModelDir, deltas: dict, plan: Plan | None, engine, dst: str, *, shard_bytes: int,
           card: str, overwrite: bool, desc: str, progress: bool | None) -> tuple[list[PlannedTensor], list[str]]:
    block_bytes = min(BLOCK_BYTES, engine.budget.limit // 2)  # (the values written do not depend on it)
    planned = _planned(model, deltas, plan, engine, block_bytes)
    config = plan.hf_config(model.config) if plan else model.config
    files = write_model_directory(dst, planned, config, shard_bytes, assets_from=model.path, card=card,
                                  overwrite=overwrite, desc=desc, progress=progress)
    return planned, files


def merge_lora(base: str, adapter: str, dst: str, *, step: int | None = None, alpha: float | None = None,
               max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE, base_id: str | None = None,
               overwrite: bool = False, workers: int | None = None, memory_budget: str | int | None = None,
               progress: bool | None = None, revision: str | None = None, quantize: str | None = None) -> MergeReport:
    """Merge ``adapter`` (a PEFT directory or a Tunix/qwix Orbax LoRA checkpoint) into the HF
    model ``base`` and write the merged model to ``dst`` (sharded safetensors + index,
    config.json, the base's non-weight files, and a model card naming the base, its Hub id
    ``base_id`` or the one found from its path or config). Merged row blocks are computed on
    ``workers`` threads (default: every usable core) ahead of the writer, with at most
    ``memory_budget`` bytes of them (default 256 MiB) held; the files written do not depend on
    either. ``base`` and ``adapter`` may be Hub ids (``revision``: the base's branch, tag or commit).
    ``quantize`` (``"int8"`` or ``"fp8"``): the merged decoder projections are written quantized in
    the same pass (compressed-tensors, as ``quantize_model`` writes them)."""
    t0 = time.perf_counter()
    shard_bytes = options.size("max_shard_size", max_shard_size)
    parallel = Parallelism.of(workers, memory_budget)
    scheme = get_scheme(quantize, "quantize (--quantize)") if quantize is not None else None
    model_card.check_repo_id("base_id", base_id)
    base = hub.local(base, hub.MODEL, revision=revision, what="base model")
    adapter = hub.local(adapter, hub.ADAPTER, what="adapter")
    check_destination(dst, [base, adapter], overwrite)
    b = _open_base(base, "merge")
    with HFModelDir(base) as model:
        plan = quantization_plan(b, model, scheme, base) if scheme is not None else None  # refusals first
        with parallel.engine("merge") as engine, \
                lora.open_adapter(adapter, b, step=step, alpha=alpha, engine=engine) as ad, \
                threadpool_limits(1, user_api="blas"):  # one BLAS thread per worker: 1.5x faster than 2 x 2 here
            return _merge(model, b, ad, adapter, engine, dst, plan=plan, step=step, base_id=base_id,
                          shard_bytes=shard_bytes, overwrite=overwrite, progress=progress, t0=t0)


def _merge(model: HFModelDir, b: lora.Base, ad, adapter: str, engine, dst: str, *, plan: Plan | None,
           step: int | None, base_id: str | None, shard_bytes: int, overwrite: bool, progress: bool | None,
           t0: float) -> MergeReport:
    base = model.path
    deltas = collect_deltas(model, ad, adapter)
    card = model_card.merged_card(base_id=model_card.hub_id(base, base_id), base_path=base, adapter=adapter,
                                  adapter_id=model_card.hub_id(adapter) if os.path.isdir(adapter) else None,
                                  step=step, family=b.spec.name, merged_tensors=len(deltas),
                                  quantized=plan.describe() if plan else None)
    planned, files = _write(model, deltas, plan, engine, dst, shard_bytes=shard_bytes, card=card,
                            overwrite=overwrite, desc="merge", progress=progress)
    quantized = plan.weights if plan else ()
    return MergeReport(
        direction="merge", base=base, adapter=adapter, destination=dst, family=b.spec.name,
        merged_tensors=len(deltas), copied_tensors=len(model.keys()) - len(set(deltas) | set(quantized)),
        bytes=sum(t.nbytes for t in planned), files=files, seconds=round(time.perf_counter() - t0, 3),
        quantized=plan.scheme.name if plan else None, quantized_tensors=len(quantized))


def quantize_model(src: str, dst: str, *, scheme: str, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
                   base_id: str | None = None, overwrite: bool = False, workers: int | None = None,
                   memory_budget: str | int | None = None, progress: bool | None = None,
                   revision: str | None = None) -> QuantizeReport:
    """Quantize the HF model ``src`` (a directory or Hub id) to ``dst`` under ``scheme`` (``"int8"``:
    W8A8 int8, ``"fp8"``: FP8_DYNAMIC e4m3), streaming: the decoder's linear projections are read,
    quantized and written a block of rows at a time on ``workers`` threads within ``memory_budget``;
    every other tensor is copied byte for byte. The output is the compressed-tensors format
    llm-compressor writes for the same data-free scheme (the same bytes), with its
    ``quantization_config`` in config.json, the source's other files and a model card."""
    t0 = time.perf_counter()
    shard_bytes = options.size("max_shard_size", max_shard_size)
    parallel = Parallelism.of(workers, memory_budget)
    chosen = get_scheme(scheme, "scheme (--scheme)")
    model_card.check_repo_id("base_id", base_id)
    src = hub.local(src, hub.MODEL, revision=revision, what="model")
    check_destination(dst, [src], overwrite)
    b = _open_base(src, "quantize")
    with HFModelDir(src) as model, parallel.engine("quantize") as engine:
        plan = quantization_plan(b, model, chosen, src)
        card = model_card.quantized_card(base_id=model_card.hub_id(src, base_id), base_path=src, family=b.spec.name,
                                         description=plan.describe())
        planned, files = _write(model, {}, plan, engine, dst, shard_bytes=shard_bytes, card=card,
                                overwrite=overwrite, desc="quantize", progress=progress)
        return QuantizeReport(
            direction="quantize", source=src, destination=dst, family=b.spec.name, scheme=chosen.name,
            quantized_tensors=len(plan.weights), copied_tensors=len(model.keys()) - len(plan.weights),
            bytes=sum(t.nbytes for t in planned), source_bytes=sum(model.info(k).nbytes for k in model.keys()),
            files=files, seconds=round(time.perf_counter() - t0, 3))
