"""A model as a stream of its family's rows, whatever format holds it.

Every model format opens its files as a :class:`ModelRows`: the family's rows (``entries``) with
their HF-named tensors, read lazily, whole (:meth:`ModelRows.arrays`) or in runs of rows
(:meth:`ModelRows.hf_rows`), and in any layout of the row (:meth:`ModelRows.tunix_value`: the
Tunix layout, or any other a writer puts in the entry, such as MaxText's). Every writer takes a
``ModelRows``, so that any model format goes to any other through the same rows, and a stage
(an adapter merged, :mod:`ckptbridge.merge`) is one more ``ModelRows`` around a source.

Writers of HF-named tensors (safetensors, GGUF) ask for a source's :meth:`ModelRows.hf_plan`:
the tensors in the source's own order and the jobs that make them, each job a list of
:data:`Part` (an HF key, the first row it starts at, its values), as the
:class:`~ckptbridge.stream.Engine` runs them ahead of the writer within the memory budget.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from collections.abc import Callable, Collection, Iterable

import numpy as np

from ckptbridge import mapping
from ckptbridge.config import ModelConfig, read_config_file
from ckptbridge.io.files import Opened
from ckptbridge.metadata import KEY, Metadata
from ckptbridge.report import Report, human_bytes
from ckptbridge.specs import FamilySpec
from ckptbridge.stream import Engine, Job

ASSETS_DIR = "hf_assets"  # where an Orbax checkpoint keeps the HF model's non-weight files

# What a piece of a conversion holds at its peak, in bytes per byte of it, for the memory budget:
# the piece and TensorStore's encoded copy of it while it is stored (writing Orbax), or the chunk
# TensorStore decoded it from while it is rearranged (reading Orbax). Counting one would let twice
# the pieces start, and peak RSS grow with the workers past the budget.
HELD_PER_BYTE = 2

# A part of an HF tensor that a job makes: (HF key, first row, values), the values being rows
# ``first row:`` of the tensor seen as a matrix ``(prod(shape[:-1]), shape[-1])`` (all of it for
# a whole tensor, first row 0).
Part = tuple[str, int, np.ndarray]


def layer_note(entry: mapping.Entry) -> str:
    if entry.layer is None:
        return ""
    return (f" (layer {entry.layer.index} is {entry.layer.kind}: head_dim {entry.layer.head_dim}, "
            f"{entry.layer.num_kv_heads} kv heads)")


def more(items: list, what: str = "") -> str:
    """`` (and N more)`` after the first of ``items``, or nothing."""
    return f" (and {len(items) - 1} more{what})" if len(items) > 1 else ""


def config_from_option(config: str) -> tuple[dict, str, str]:
    """The HF config given as ``config`` (``--config``: a config.json or its directory): (config,
    its path, the directory other files are taken from)."""
    path = os.path.join(config, "config.json") if os.path.isdir(config) else config
    return read_config_file(path), path, os.path.dirname(os.path.abspath(path))


def per_block(blocks: mapping.Blocks, nbytes: int, chunk_bytes: int) -> int:
    """Indices of ``blocks.axis`` per block of at most ``chunk_bytes`` (at least one)."""
    return max(1, chunk_bytes // max(1, nbytes // blocks.count))


def matrix_rows(shape: tuple[int, ...]) -> int:
    """Rows of a tensor of ``shape`` seen as a matrix of its last axis."""
    return math.prod(shape[:-1])


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One HF tensor of a plan: written from ``parts`` parts of the plan's jobs, in order, or (``raw``)
    copied as stored."""

    key: str
    dtype: np.dtype
    shape: tuple[int, ...]
    parts: int = 1
    raw: Callable[[], object] | None = None  # the stored bytes (a FileRange) of an untouched tensor

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclasses.dataclass
class HFPlan:
    """The HF tensors of a source in the order it makes them, and the jobs (``(bytes, fn)``, taken
    lazily) whose lists of :data:`Part` give every part of the tensors that are not ``raw``."""

    tensors: list[HFTensor]
    jobs: Iterable[Job]


class ModelRows(Opened):
    """A model source: the rows of its family (``entries``) over files of some format.

    A format implements :meth:`dtype` and :meth:`arrays` (every HF tensor of a row), and where it
    can, :meth:`hf_rows` (a run of a row's HF rows read on its own) and :meth:`block_ranges` (the
    runs its storage reads best). The rest follows: a row in any of its layouts, whole or by
    blocks, and the HF plan. Every method that reads is safe to call from several threads.
    """

    format = ""  # the name of its format in the registry (ckptbridge.formats)
    path: str  # the checkpoint as opened (the item of a checkpoint-manager root, the directory, the file)
    cfg: ModelConfig
    spec: FamilySpec
    prefix: str
    entries: list[mapping.Entry]
    towers_dropped = 0  # vision/audio tensors left out (an HF source opened with skip_multimodal)
    tower_entries: list[mapping.Entry] = []  # the rows of the vision/audio towers it holds (none: text only)
    tower_spelling: dict[str, str] = {}  # the towers' other key spellings its HF names use (Tower.aliases)
    row_addressable = False  # whether key_rows reads runs of rows of one HF tensor on its own
    merged_keys: Collection[str] = ()  # HF keys an adapter was merged into (a stage's rows)
    scan_layers: bool | None = None  # a MaxText source's layout (reports say it)

    def dtype(self, entry: mapping.Entry) -> np.dtype:
        raise NotImplementedError

    def arrays(self, entry: mapping.Entry) -> list[np.ndarray]:
        """The HF tensors of ``entry``, in ``entry.hf_keys`` order."""
        raise NotImplementedError

    def hf_rows(self, blocks: mapping.Blocks, i: int, j: int) -> np.ndarray | None:
        """Indices ``i:j`` of ``blocks.axis`` in the HF stacked layout of ``blocks.entry``, read on
        their own; None to have them cut from the whole."""
        return None

    def key_rows(self, key: str, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of HF tensor ``key`` as a matrix of its last axis (where
        :attr:`row_addressable`)."""
        raise NotImplementedError(f"{self.format} sources are read a row of the family at a time")

    def block_ranges(self, blocks: mapping.Blocks, max_bytes: int) -> list[tuple[int, int]] | None:
        """Ranges of ``blocks.axis`` of at most ``max_bytes`` to read ``blocks.entry`` in (None: only whole)."""
        e = blocks.entry
        nbytes = math.prod(e.hf_shape) * max(1, len(e.hf_keys)) * self.dtype(e).itemsize
        return blocks.ranges(per_block(blocks, nbytes, max_bytes))

    def position(self, key: str) -> tuple | None:
        """Where ``key`` lies in the source's files (for writers that follow the source's order), or None."""
        return None

    def byte_range(self, key: str):
        """The stored bytes of HF tensor ``key`` (an :class:`~ckptbridge.io.output.FileRange`), for
        writers that store it as it is, where the source's files hold exactly them; else None."""
        return None

    def assets(self) -> tuple[list[str], str] | None:
        """The model's non-weight files (tokenizer, chat template, ...) and their directory, or None."""
        return None

    def asset_dir(self) -> str | None:
        """The directory the model's non-weight files are read from (it may hold none)."""
        found = self.assets()
        return found[1] if found else None

    def drop_towers(self) -> None:
        """Leave the towers out (``--skip-multimodal``): the text model alone is read."""
        self.towers_dropped += sum(len(e.hf_keys) for e in self.tower_entries)
        self.tower_entries = []
        self.__dict__.pop("_by_key", None)

    @property
    def all_entries(self) -> list[mapping.Entry]:
        """The text model's rows, then the towers'."""
        return [*self.entries, *self.tower_entries]

    def hf_keys(self) -> list[str]:
        """Every HF key the source holds, in its order (the towers' too)."""
        return [k for e in self.all_entries for k in e.hf_keys]

    def key_info(self, key: str) -> tuple[np.dtype, tuple[int, ...]]:
        """The dtype and shape of HF tensor ``key``."""
        by_key = self.__dict__.get("_by_key")
        if by_key is None:
            by_key = self.__dict__["_by_key"] = {k: e for e in self.all_entries for k in e.hf_keys}
        e = by_key[key]
        return self.dtype(e), e.hf_shape

    # ------------------------------------------------------------------ derived

    def tunix_value(self, entry: mapping.Entry) -> np.ndarray:
        """``entry``'s parameter in its Tunix layout (``entry.tunix_layout``: any layout of the row)."""
        if not entry.hf_keys:  # a parameter Tunix keeps unused where HF has none (``hf_absent``)
            return np.zeros(entry.tunix_shape, self.dtype(entry))
        return mapping.hf_to_tunix(entry, self.arrays(entry))

    def tunix_block(self, blocks: mapping.Blocks, i: int, j: int) -> np.ndarray:
        """The box of ``blocks.entry``'s parameter that indices ``i:j`` of ``blocks.axis`` fill."""
        return blocks.to_tunix(self.hf_block(blocks, i, j), i, j)

    def hf_block(self, blocks: mapping.Blocks, i: int, j: int) -> np.ndarray:
        hf = self.hf_rows(blocks, i, j)
        if hf is None:
            arrays = self.arrays(blocks.entry)
            whole = np.stack(arrays) if blocks.entry.rule.stack_axis else arrays[0]
            hf = whole[i:j] if blocks.keyed else whole[i * blocks.hf_rows:j * blocks.hf_rows]
        return hf

    def hf_plan(self, chunk_bytes: int, computed: Collection[str] = (), towers: bool = True) -> HFPlan:
        """Every HF tensor of the rows in entry order: a row at most ``chunk_bytes`` in one job, a
        larger one in runs of rows (:meth:`block_ranges`), each job counted at :data:`HELD_PER_BYTE`
        times its bytes. (``computed``: keys that must come as values, for sources that can copy
        stored bytes; ``towers``: False for the text model's tensors alone.)"""
        jobs: list[Job] = []
        tensors: list[HFTensor] = []
        for e in self.all_entries if towers else self.entries:
            if not e.hf_keys:
                continue
            dtype = self.dtype(e)
            nbytes = math.prod(e.hf_shape) * len(e.hf_keys) * dtype.itemsize
            blocks = mapping.blocks(e) if nbytes > chunk_bytes else None
            ranges = self.block_ranges(blocks, chunk_bytes) if blocks is not None else None
            if blocks is None or ranges is None or len(ranges) < 2:
                jobs.append((HELD_PER_BYTE * nbytes, functools.partial(self._whole_parts, e)))
                tensors += [HFTensor(k, dtype, e.hf_shape) for k in e.hf_keys]
                continue
            jobs += [(HELD_PER_BYTE * nbytes * (j - i) // blocks.count,
                      functools.partial(self._block_parts, blocks, i, j)) for i, j in ranges]
            tensors += ([HFTensor(e.hf_keys[0], dtype, e.hf_shape, len(ranges))] if not blocks.keyed
                        else [HFTensor(k, dtype, e.hf_shape) for k in e.hf_keys])
        return HFPlan(tensors, jobs)

    def _whole_parts(self, e: mapping.Entry) -> list[Part]:
        return [(k, 0, v) for k, v in zip(e.hf_keys, self.arrays(e))]

    def _block_parts(self, blocks: mapping.Blocks, i: int, j: int) -> list[Part]:
        hf = self.hf_block(blocks, i, j)
        keys = blocks.entry.hf_keys
        if not blocks.keyed:  # rows of the one HF tensor
            per_index = blocks.hf_rows * math.prod(blocks.entry.hf_shape[1:-1])
            return [(keys[0], i * per_index, hf)]
        return [(keys[n], 0, hf[n - i]) for n in range(i, j)]  # one HF tensor per index

    def metadata(self, kind: str, tunix_version: str | None, base_quant: dict | None = None) -> dict:
        """The ckptbridge metadata a checkpoint written from these rows carries (``base_quant``: a
        QLoRA base's quantization)."""
        found = self.assets()
        return {KEY: Metadata(
            kind=kind, family=self.spec.name, hf_config=self.cfg.hf_config, key_prefix=self.prefix,
            config_dialect=self.cfg.dialect, towers_dropped=self.towers_dropped,
            towers=tower_record(self.tower_entries, self.key_info, self.tower_spelling) or None,
            assets=found[0] if found else [], source=_absolute(self.path), tunix_version=tunix_version,
            base_quant=base_quant,
        ).to_json()}


def tower_record(entries: list[mapping.Entry], key_info, spelling: dict[str, str] | None = None) -> dict:
    """What a checkpoint holds of each tower (tensors and bytes, by tower), and the other key
    spellings its HF names use (``spelling``), for metadata, inspect and reports."""
    out: dict = {}
    for e in entries:
        held = out.setdefault(e.tower, {"tensors": 0, "bytes": 0})
        for k in e.hf_keys:
            dtype, shape = key_info(k)
            held["tensors"] += 1
            held["bytes"] += math.prod(shape) * np.dtype(dtype).itemsize
    if out and spelling:
        out["spelling"] = dict(spelling)
    return out


def towers_line(towers: dict | None) -> str:
    """The towers a report's model holds (a :func:`tower_record`), as a summary line (nothing
    for a text model)."""
    held = {k: v for k, v in (towers or {}).items() if k != "spelling"}
    if not held:
        return ""
    return "\n  towers: " + ", ".join(f"{k} ({v['tensors']} tensors, {human_bytes(v['bytes'])})" if isinstance(v, dict)
                                     else f"{k} ({v})" for k, v in held.items())


def _absolute(path: str) -> str:
    from ckptbridge.io import storage

    return storage.absolute(path)


@dataclasses.dataclass
class Request:
    """What a writer is asked besides the rows: where from and to as the user named them, the
    report's ``direction``, the engine every piece is made on, and the piece size (``chunk_bytes``:
    Orbax chunks when ``chunked``, else float32 blocks of rows of at most half the budget)."""

    source: str
    destination: str
    direction: str
    engine: Engine
    chunk_bytes: int
    chunked: bool
    overwrite: bool = False
    progress: bool | None = None
    desc: str = "write"
    adapters: tuple[str, ...] = ()  # merged on the way
    adapter_step: int | None = None
    t0: float = dataclasses.field(default_factory=time.perf_counter)


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


__all__ = ["ASSETS_DIR", "HELD_PER_BYTE", "ConversionReport", "HFPlan", "HFTensor", "ModelRows", "Part", "Request",
           "config_from_option", "layer_note", "matrix_rows", "more", "per_block", "tower_record", "towers_line"]
