"""Tunix Orbax: an Orbax checkpoint of the Tunix nnx state of a family (a nested dict of its
parameters in their Tunix layouts, source dtypes), read as the family's rows and written from
any model's rows.

The checkpoint carries ``custom_metadata["ckptbridge"]`` (family, HF config, key prefix, the Tunix
version whose layouts it holds, its non-weight files under ``hf_assets/``), so the way back needs
no flag; a checkpoint saved by Tunix itself needs ``--config``. Writing is streaming: a tensor
larger than ``chunk_size`` is read, rearranged and stored in row blocks of at most that size,
each one chunk of the stored array, so memory stays a few chunks however large the tensor;
reading takes boxes of whole stored chunks the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import numpy as np

from ckptbridge import deps, mapping, specs
from ckptbridge.errors import ConfigError, MismatchError, UnsupportedError
from ckptbridge.formats.qwix import is_lora_leaf
from ckptbridge.io import orbax as orbax_io
from ckptbridge.io import storage
from ckptbridge.io.files import close_on_error
from ckptbridge.io.hf import copy_assets
from ckptbridge.metadata import Metadata, installed_tunix_version
from ckptbridge.progress import progress_over
from ckptbridge.qlora_base import QVALUE, SCALE
from ckptbridge.rows import (
    ASSETS_DIR,
    HELD_PER_BYTE,
    ConversionReport,
    ModelRows,
    Request,
    config_from_option,
    layer_note,
    more,
    per_block,
    tower_record,
    towers_line,
)
from ckptbridge.specs import family_for
from ckptbridge.specs.base import BESIDE, tunix_version_key

NAME = "tunix"


def detect(probe) -> bool:
    """An Orbax checkpoint of a Tunix model's weights (a checkpoint-manager root, a step, or its item)."""
    ckpt = probe.checkpoint
    return ckpt is not None and not is_lora(ckpt) and not is_maxtext_tree(ckpt)


def is_lora(ckpt: orbax_io.OrbaxCheckpoint) -> bool:
    return ckpt.metadata.kind == "lora" or any(is_lora_leaf(p) for p in ckpt.leaves)


def is_maxtext_tree(ckpt: orbax_io.OrbaxCheckpoint) -> bool:
    """MaxText's tree: ``params/params/{decoder,token_embedder}``, or an NNX ``decoder`` at the top."""
    return any(p[:3] in (("params", "params", "decoder"), ("params", "params", "token_embedder"))
               or p[:1] in (("decoder",), ("token_embedder",)) for p in ckpt.leaves)


class TunixSource(ModelRows):
    """An Orbax checkpoint of Tunix weights checked against its family spec. Any entry of the same
    row and layer is read, whatever its layout: a leaf stored in the asked layout is read as it is."""

    format = NAME

    def __init__(self, ckpt: orbax_io.OrbaxCheckpoint, cfg, spec, prefix: str, entries: list[mapping.Entry],
                 suffix: tuple[str, ...], config_dir: str | None, towers: list[mapping.Entry] | None = None,
                 spelling: dict[str, str] | None = None):
        self.ckpt, self.cfg, self.spec, self.prefix, self.entries = ckpt, cfg, spec, prefix, entries
        self.path = ckpt.path
        self.suffix = suffix  # ("value",) for trees saved from an nnx state with value levels
        self.config_dir = config_dir  # where non-weight files come from when not stored in the checkpoint
        self.tower_entries = list(towers or [])
        self.tower_spelling = dict(spelling or {})
        self.towers_dropped = ckpt.metadata.towers_dropped or 0
        self._stored = {e.ident: e for e in [*entries, *self.tower_entries]}
        # a QLoRA base (ckptbridge.qlora_base): the weights stored as qwix's arrays, read dequantized
        self.quantized = {e.ident for e in entries if e.tunix_path + QVALUE + suffix in ckpt.leaves}
        self.base_quant = (ckpt.metadata.base_quant or {}) if self.quantized else None
        self._scheme = str((self.base_quant or {}).get("scheme"))

    def stored(self, entry: mapping.Entry) -> mapping.Entry:
        """The entry of ``entry``'s row and layer in the layout its leaf is stored in."""
        return self._stored[entry.ident]

    def path_of(self, entry: mapping.Entry) -> tuple[str, ...]:
        return self.stored(entry).tunix_path + self.suffix

    def dtype(self, entry: mapping.Entry) -> np.dtype:
        if entry.ident in self.quantized:
            return np.dtype(self.ckpt.leaves[self._part_path(entry, SCALE)][1])
        return self.ckpt.leaves[self.path_of(entry)][1]

    def _part_path(self, entry: mapping.Entry, part: tuple[str, ...]) -> tuple[str, ...]:
        return self.stored(entry).tunix_path + part + self.suffix

    def quantized_parts(self, entry: mapping.Entry) -> tuple[np.ndarray, np.ndarray] | None:
        """A QLoRA base's quantized values (in qwix's dtype) and scales of ``entry``'s weight, as
        stored; None for a weight stored as it is."""
        if entry.ident not in self.quantized:
            return None
        from ckptbridge import qlora_base

        q, s = self._part_path(entry, QVALUE), self._part_path(entry, SCALE)
        read = self.ckpt.read([q, s])
        return qlora_base.restored(read[q], self._scheme), read[s]

    def leaf(self, entry: mapping.Entry) -> np.ndarray:
        """The stored leaf of ``entry``'s row (its stored layout; a quantized weight dequantized
        by qwix)."""
        parts = self.quantized_parts(entry)
        if parts is not None:
            from ckptbridge import qlora_base

            return qlora_base.dequantize(*parts, self._scheme)
        p = self.path_of(entry)
        return self.ckpt.read([p])[p]

    def tunix_value(self, entry: mapping.Entry, *, mapped: bool = False) -> np.ndarray:
        """``entry``'s parameter in its layout: the leaf as stored when the layouts agree
        (``mapped`` is for the interface: TensorStore reads the chunks)."""
        stored = self.stored(entry)
        if stored.tunix_layout == entry.tunix_layout:
            return self.leaf(entry)
        return super().tunix_value(entry)

    def arrays(self, entry: mapping.Entry) -> list[np.ndarray]:
        stored = self.stored(entry)
        return mapping.tunix_to_hf(stored, self.leaf(stored))

    def nbytes(self, entry: mapping.Entry) -> int:
        if entry.ident in self.quantized:
            return int(np.prod(entry.tunix_shape, dtype=np.int64)) * self.dtype(entry).itemsize
        shape, dtype = self.ckpt.leaves[self.path_of(entry)]
        return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize

    def block_ranges(self, blocks: mapping.Blocks, max_bytes: int) -> list[tuple[int, int]] | None:
        """Ranges of ``blocks.axis`` to read ``blocks.entry`` in, each whole stored chunks along the
        Tunix dimension it cuts and at most ``max_bytes`` where the chunks allow; None when the
        leaf can only be read whole."""
        if blocks.entry.ident in self.quantized:
            return None  # dequantized whole
        stored = mapping.blocks(self.stored(blocks.entry))
        chunks = self.ckpt.chunks(self.path_of(blocks.entry))
        if chunks is None or stored is None or stored.axis != blocks.axis:
            return None
        chunk = chunks[stored.tunix_dim]
        align = chunk // math.gcd(chunk, stored.tunix_step)  # indices per whole number of chunks
        return stored.ranges(per_block(stored, self.nbytes(blocks.entry), max_bytes), align)

    def tunix_box(self, blocks: mapping.Blocks, i: int, j: int) -> np.ndarray:
        """The box of the leaf of ``blocks.entry`` (as stored) that indices ``i:j`` of ``blocks.axis``
        fill (a range of :meth:`block_ranges`)."""
        p = self.path_of(blocks.entry)
        return self.ckpt.start_read([p], blocks.tunix_region(i, j))()[p]

    def hf_rows(self, blocks: mapping.Blocks, i: int, j: int) -> np.ndarray | None:
        if blocks.entry.ident in self.quantized:
            return None
        stored = mapping.blocks(self.stored(blocks.entry))
        if stored is None or stored.axis != blocks.axis or self.ckpt.chunks(self.path_of(blocks.entry)) is None:
            return None
        return stored.to_hf(self.tunix_box(stored, i, j), i, j)

    def assets(self) -> tuple[list[str], str] | None:
        return stored_assets(self.ckpt.path) or _config_assets(self.config_dir)

    def close(self) -> None:
        self.ckpt.close()


def stored_assets(path: str) -> tuple[list[str], str] | None:
    """The non-weight files ckptbridge stored with a checkpoint (in ``path`` or up to two levels
    above: an item, its step, the root), and where."""
    for up in (path, storage.dirname(path), storage.dirname(storage.dirname(path))):
        where = storage.join(up, ASSETS_DIR)
        if storage.isdir(where):
            return storage.listdir(where), where
    return None


def _config_assets(config_dir: str | None) -> tuple[list[str], str] | None:
    """The non-weight files beside a ``--config``."""
    if config_dir is None:
        return None
    from ckptbridge.io.hf import non_weight_files

    names = non_weight_files(config_dir)
    return (names, config_dir) if names else None


def open_orbax_source(src: str, *, config: str | None = None, step: int | None = None) -> TunixSource:
    """Open an Orbax weights checkpoint and validate its tree against the spec (no leaf is read)."""
    path = orbax_io.resolve_checkpoint(src, step)
    with close_on_error(orbax_io.OrbaxCheckpoint(path)) as ckpt:
        return _validate_orbax(ckpt, config)


def _validate_orbax(ckpt: orbax_io.OrbaxCheckpoint, config: str | None) -> TunixSource:
    meta: Metadata = ckpt.metadata
    path = ckpt.path
    if meta.kind == "lora" or any(is_lora_leaf(p) for p in ckpt.leaves):
        raise UnsupportedError(f"{path}: is a LoRA checkpoint, not full weights; use "
                               "`ckptbridge convert orbax-to-peft`")
    config_dir = None
    if config is not None:
        hf_config, where, config_dir = config_from_option(config)
        prefix = None
    elif meta.hf_config is not None:
        hf_config, where = meta.hf_config, f"{path} (ckptbridge metadata)"
        prefix = meta.key_prefix
    else:
        raise ConfigError(
            f"{path}: carries no ckptbridge metadata with the HF config; pass config (--config) with the base "
            "model's config.json (or its directory)"
        )
    spec = family_for(hf_config, where)
    cfg = spec.parse_config(hf_config, where)
    if meta.family not in (None, spec.name):
        raise MismatchError(f"{path}: metadata says family {meta.family!r} but the config is {spec.name!r}")
    prefix = prefix if prefix in spec.key_prefixes else cfg.default_key_prefix
    # the layouts of the Tunix version the checkpoint was written for; each leaf is then read in
    # whichever of its row's layouts it is stored (files that predate the recorded version)
    ents = mapping.entries(cfg, spec, prefix)
    try:
        ents = mapping.for_tunix_version(ents, meta.tunix_version)
    except ValueError:  # an unreadable version string: the stored shapes alone decide
        pass
    leaves = ckpt.leaves
    suffix = ckpt.value_suffix
    ents = [_stored_layout(e, leaves.get(e.tunix_path + suffix) or leaves.get(e.tunix_path + QVALUE + suffix))
            for e in ents]
    towers, spelling = _stored_towers(path, cfg, spec, prefix, meta, leaves, suffix)
    expected: dict[tuple, mapping.Entry | None] = {e.tunix_path + suffix: e for e in [*ents, *towers]}
    for e in ents:  # a QLoRA base's weights: qwix's quantized values (the weight's shape) and scales
        if e.tunix_path + QVALUE + suffix in leaves:
            del expected[e.tunix_path + suffix]
            expected[e.tunix_path + QVALUE + suffix] = e
            scale = e.tunix_path + SCALE + suffix
            if scale not in leaves:
                raise MismatchError(f"{path}: leaf {'/'.join(scale)} is missing: a quantized weight without its "
                                    "scales (an incomplete checkpoint)")
            if len(leaves[scale][0]) != len(e.tunix_shape):
                raise MismatchError(f"{path}: leaf {'/'.join(scale)} has shape {leaves[scale][0]}, not the scales of "
                                    f"a weight of shape {e.tunix_shape}")
            expected[scale] = None
    if any(p[:3] == ("params", "params", "decoder") for p in leaves):  # MaxText's Linen tree
        raise MismatchError(f"{path}: is a MaxText checkpoint, not Tunix; use `ckptbridge convert "
                            "maxtext-to-safetensors`")
    missing = [p for p in expected if p not in leaves]
    if missing:
        gone = expected[missing[0]]
        raise MismatchError(
            f"{path}: leaf {'/'.join(missing[0])} is missing{layer_note(gone) if gone else ''}{more(missing)}; the "
            "checkpoint does not "
            "match the config (wrong config (--config), or an incomplete checkpoint)"
        )
    extra = sorted(p for p in leaves if p not in expected)
    if extra:
        raise MismatchError(
            f"{path}: unexpected leaf {'/'.join(extra[0])}{more(extra)}: not part of the {spec.name} "
            "text model that the config describes"
        )
    if any(x is None for x in expected.values()) and not (meta.base_quant or {}).get("scheme"):
        raise MismatchError(f"{path}: holds quantized weights but its metadata records no base_quant (scheme); "
                            "write it again with `ckptbridge convert ... --to tunix --quantize`")
    for p, want in expected.items():
        if want is not None and leaves[p][0] != want.tunix_shape:
            raise MismatchError(
                f"{path}: leaf {'/'.join(p)} has shape {leaves[p][0]}, the config implies "
                f"{want.tunix_shape}{layer_note(want)}; the checkpoint and the config disagree"
            )
    return TunixSource(ckpt, cfg, spec, prefix, ents, suffix, config_dir, towers, spelling)


def _stored_towers(path: str, cfg, spec, prefix: str, meta: Metadata, leaves: dict,
                   suffix: tuple[str, ...]) -> tuple[list[mapping.Entry], dict[str, str]]:
    """The towers' rows a checkpoint holds: all of each tower it has a leaf of (the missing ones
    are then named by the caller), none when it has none (a checkpoint of the text model)."""
    if not cfg.towers or prefix not in spec.tower_roots:
        return [], {}
    record = meta.towers or {}
    found = record.get("spelling")
    spelling: dict[str, str] = found if isinstance(found, dict) else {}
    try:
        rows = mapping.tower_entries(cfg, spec, prefix, spelling=spelling)
    except UnsupportedError:
        if any(p[:1] == (BESIDE,) for p in leaves):
            raise
        return [], {}  # towers this version has no rows for, and the checkpoint holds none of them
    held = {e.tower for e in rows if e.tunix_path + suffix in leaves}
    return [e for e in rows if e.tower in held], spelling if held else {}


def _stored_layout(entry: mapping.Entry, leaf) -> mapping.Entry:
    """``entry`` in the Tunix layout its stored leaf has (unchanged when none fits: the shape check says so)."""
    lay = mapping.layout_with_shape(entry, leaf[0]) if leaf is not None else None
    return mapping.with_tunix_layout(entry, lay) if lay is not None else entry


def open_source(src: str, *, config: str | None = None, step: int | None = None, **_) -> TunixSource:
    return open_orbax_source(src, config=config, step=step)


# --------------------------------------------------------------------------- writing


def target_tunix_version(tunix_version: str | None) -> str | None:
    """The Tunix version whose layouts a verb writes: ``tunix_version`` (checked), else the
    installed google-tunix's (None without one: the layouts the specs were written against)."""
    if tunix_version is not None:
        try:
            tunix_version_key(tunix_version)
        except ValueError as e:
            raise ConfigError(f"tunix_version (--tunix-version): {e}") from None
    return tunix_version or installed_tunix_version()


@dataclasses.dataclass(frozen=True)
class ToTunixReport(ConversionReport):
    """A model written as an Orbax checkpoint of the Tunix state."""

    OMIT_NONE = ("scan_layers", "adapters", "towers", "tower_notes", "base_quant")

    towers_dropped: int
    towers: dict | None
    tunix_version: str | None
    chunk_bytes: int
    compression: bool
    orbax_writer: str
    config_mismatch: str | None
    seconds: float
    scan_layers: bool | None = None  # a MaxText source's layout
    adapters: list[str] | None = None  # merged on the way
    tower_notes: list[str] | None = None  # what Tunix's own loader does wrong with the towers written
    base_quant: dict | None = None  # a QLoRA base: how its weights are quantized (ckptbridge.qlora_base)

    def summary(self) -> str:
        text = self._head(self.seconds) + towers_line(self.towers)
        if self.base_quant:
            q = self.base_quant
            text += (f"\n  QLoRA base: {q['weights']} weights of {', '.join(q['targets'])} stored as qwix's "
                     f"{q['scheme']}{' (tile ' + str(q['tile']) + ')' if q['tile'] else ''} arrays, "
                     f"from {q['param_dtype']}")
        for note in self.tower_notes or ():
            text += f"\n  note: {note}"
        if self.towers_dropped:
            text += f"\n  dropped {self.towers_dropped} vision/audio tensors (--skip-multimodal)"
        if self.scan_layers is not None:
            text += f"\n  MaxText layout: {'scanned' if self.scan_layers else 'unscanned'}"
        if self.adapters:
            text += f"\n  merged: {', '.join(self.adapters)}"
        return text


def tower_notes(rows: ModelRows) -> list[str]:
    """What Tunix's own loader does wrong with the towers ``rows`` carries (logged, and in the report)."""
    import logging

    notes = []
    for name in dict.fromkeys(e.tower for e in rows.tower_entries):
        tower = rows.spec.tower(name or "")
        if tower is not None and tower.tunix_note:
            logging.getLogger(__name__).warning("%s", tower.tunix_note)
            notes.append(tower.tunix_note)
    return notes


def leaf(rows: ModelRows, e: mapping.Entry, chunk_bytes: int) -> orbax_io.LazyArray:
    """The Orbax leaf of ``e``: whole, or in row blocks of at most ``chunk_bytes`` when larger
    (each block read and rearranged on its own, on any worker). The rearranged copy is ours, tiled
    (``layout.transpose_copy``): handing TensorStore strided views to copy while encoding instead
    took 18-19 s of user CPU for a 31B-width k = 4 base against 12-14 s (docs/benchmarks.md)."""
    dtype = rows.dtype(e)
    nbytes = int(np.prod(e.tunix_shape, dtype=np.int64)) * dtype.itemsize
    blocks = mapping.blocks(e)
    if blocks is None or nbytes <= chunk_bytes:
        return orbax_io.LazyArray(e.tunix_shape, dtype, produce=functools.partial(rows.tunix_value, e),
                                  held=HELD_PER_BYTE)
    per = per_block(blocks, nbytes, chunk_bytes)
    pieces = [(blocks.tunix_region(i, j), functools.partial(rows.tunix_block, blocks, i, j))
              for i, j in blocks.ranges(per)]
    return orbax_io.LazyArray(e.tunix_shape, dtype, chunks=blocks.tunix_block_shape(per), pieces=pieces,
                              held=HELD_PER_BYTE)


def write(rows: ModelRows, dst: str, req: Request, *, tunix_version: str | None = None,
          compression: bool = True, quantize: str | None = None, tile: int | None = None,
          quantized_leaves=None) -> ToTunixReport:
    """Write ``rows`` as an Orbax checkpoint of the Tunix state at ``dst``: the layouts of Tunix
    ``tunix_version`` (default: the installed google-tunix; without one, the layouts the specs
    were written against), recorded in the metadata with the HF config; the non-weight files under
    ``hf_assets/``. ``compression=False`` stores the chunks without zstd (faster, larger).
    ``quantize`` (``int8``, ``int4``, ``nf4``; ``tile``): a QLoRA base, the weights of the family's
    LoRA targets stored as qwix's quantized arrays made by ``quantized_leaves`` (the conversion
    gives :func:`ckptbridge.qlora_leaves.quantized_leaves`)."""
    deps.require("orbax")
    target = target_tunix_version(tunix_version)
    mismatch = specs.note_mismatch(rows.cfg)
    ents = [*mapping.for_tunix_version(rows.entries, target), *rows.tower_entries]
    if quantize and quantized_leaves is None:
        raise ConfigError("--quantize: a QLoRA base is written through ckptbridge.convert (the conversion gives "
                          "the writer qwix's quantization against the Tunix model)")
    quantized, base_quant = (quantized_leaves(rows, ents, quantize, tile, target, req.chunk_bytes) if quantize
                             else ({}, None))
    done = {path[:-2] for path in quantized}
    flat = {e.tunix_path: leaf(rows, e, req.chunk_bytes) for e in ents if e.tunix_path not in done}
    flat.update(quantized)
    notes = tower_notes(rows)
    bar = progress_over(flat.values(), req.desc, req.progress)
    total = bar.total
    found = rows.assets()
    from ckptbridge.io.atomic import atomic_directory

    with atomic_directory(dst, req.overwrite) as tmp:
        writer = orbax_io.save_tree(tmp, orbax_io.nest(flat), rows.metadata("weights", target, base_quant=base_quant),
                                    compression=compression, engine=req.engine)
        if found:
            copy_assets(found[0], found[1], storage.join(tmp, ASSETS_DIR))
    bar.close()
    return ToTunixReport(
        direction=req.direction, source=req.source, destination=dst, family=rows.spec.name, key_prefix=rows.prefix,
        layer_kinds=rows.cfg.layer_kinds(), tensors=len(flat), bytes=total, towers_dropped=rows.towers_dropped,
        towers=tower_record(rows.tower_entries, rows.key_info) or None, tower_notes=notes or None,
        tunix_version=target, chunk_bytes=req.chunk_bytes, compression=compression, orbax_writer=writer,
        config_mismatch=mismatch, seconds=round(time.perf_counter() - req.t0, 3),
        scan_layers=rows.scan_layers, adapters=list(req.adapters) or None, base_quant=base_quant)


__all__ = ["TunixSource", "ToTunixReport", "detect", "leaf", "open_orbax_source", "open_source", "stored_assets",
           "target_tunix_version", "tower_notes", "write"]
