"""MaxText Orbax: MaxText checkpoints (scanned and unscanned) read as the family's rows and written
from any model's rows, streaming, through the same rows as every other layout.

MaxText's converters (``to_maxtext``, ``to_huggingface``) hold every weight in memory at once; this
format holds a few pieces. A MaxText checkpoint is an Orbax CheckpointManager root with one item,
``<dir>/<step>/items``, whose tree is ``params/params/{token_embedder,decoder}/...``
(:mod:`ckptbridge.formats.maxtext.layout` gives each parameter's path and layout from the
family's rows, ``ckptbridge.specs.maxtext`` the names, layouts and value transforms per family);
SFT checkpoints of MaxText's NNX trainers keep the same tree at ``<step>/model_params`` without
the ``params/params`` levels and with a ``value`` level under each leaf. The step's custom
metadata records ``scan_layers`` as MaxText does; ckptbridge adds the HF config, so that the way
back needs no ``--config``. What MaxText itself does: docs/maxtext-reference.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import time
from collections import Counter
from collections.abc import Callable, Collection

import numpy as np

from ckptbridge import deps, layout, mapping, specs
from ckptbridge.config import ModelConfig
from ckptbridge.errors import ConfigError, InputNotFoundError, MismatchError, UnsupportedError
from ckptbridge.formats.maxtext import layout as maxtext_layout
from ckptbridge.formats.maxtext.layout import Leaf, apply, stored_dtype, transforms_of
from ckptbridge.formats.tunix import stored_assets
from ckptbridge.io import orbax as orbax_io
from ckptbridge.io import storage
from ckptbridge.io.atomic import atomic_directory
from ckptbridge.io.hf import copy_assets
from ckptbridge.progress import progress_over
from ckptbridge.rows import (
    ASSETS_DIR,
    HELD_PER_BYTE,
    ConversionReport,
    HFPlan,
    HFTensor,
    ModelRows,
    Part,
    Request,
    config_from_option,
    more,
    per_block,
    tower_record,
    towers_line,
)
from ckptbridge.specs.base import FamilySpec
from ckptbridge.stream import Job

NAME = "maxtext"
ITEM = "items"  # MaxText's one CheckpointManager item
NNX_ITEM = "model_params"  # MaxText's NNX SFT trainers' item
ROOT = ("params", "params")  # the Linen tree's levels above token_embedder and decoder
SCAN_KEY = "scan_layers"  # MaxText's custom metadata of the step
TOP = (("decoder",), ("token_embedder",), ("vision_encoder",), ("audio_encoder",))  # the model's modules


def supported() -> list[str]:
    return sorted(s.name for s in specs.FAMILIES.values() if s.maxtext is not None)


def maxtext_spec(spec: FamilySpec, where: str):
    if spec.maxtext is None:
        raise UnsupportedError(f"{where}: {spec.name} has no MaxText layout in ckptbridge yet "
                               f"(supported: {', '.join(supported())})")
    return spec.maxtext


def _as(entry: mapping.Entry, lay: str) -> mapping.Entry:
    """``entry`` with MaxText's layout ``lay`` in place of Tunix's: the blocks and rearrangements of
    :mod:`ckptbridge.mapping` then go between HF and MaxText."""
    return dataclasses.replace(entry, tunix_variant=lay)


def _whole_layout(leaf: Leaf) -> str:
    """The layout ``leaf``'s rows are read or written in: the part's own, with the axis it is
    selected along in front where the row fuses several parts."""
    sel = leaf.part.select
    return f"{sel[0]} {leaf.part.layout}" if sel else leaf.part.layout


def _blocks(e: mapping.Entry, nbytes: int, chunk_bytes: int, transforms) -> mapping.Blocks | None:
    """How ``e`` (in its MaxText layout) splits into row blocks, when larger than ``chunk_bytes``
    and no value transform needs the cut axis whole."""
    blocks = mapping.blocks(e) if nbytes > chunk_bytes else None
    if blocks is None or any(t.axis == blocks.axis for t in transforms):
        return None
    return blocks


# --------------------------------------------------------------------------- HF -> MaxText


def _leaf_to_maxtext(source: ModelRows, leaf: Leaf, spec, chunk_bytes: int) -> orbax_io.LazyArray:
    """The MaxText parameter ``leaf`` as pieces made from the HF tensors: one per stacked layer
    (a chunk of the stacked tensor each), or row blocks of at most ``chunk_bytes`` of one layer's
    tensor where it is larger (and its transforms allow). A part of a fused row is made from the
    whole row, of which it takes its index."""
    lay, whole_lay, sel = leaf.part.layout, _whole_layout(leaf), leaf.part.select
    transforms = transforms_of(spec, leaf.entries[0])
    dtype = stored_dtype(source.dtype(leaf.entries[0]), transforms)

    def pick(x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x[sel[1]]) if sel else x

    def whole(e: mapping.Entry) -> np.ndarray:
        return leaf.stacked(apply(pick(source.tunix_value(e)), lay, e.sizes, transforms, True))

    def block(blocks: mapping.Blocks, i: int, j: int) -> np.ndarray:
        x = pick(source.tunix_block(blocks, i, j))
        return leaf.stacked(apply(x, lay, blocks.sizes(i, j), transforms, True))

    if leaf.part.pad and leaf.sizes[leaf.part.pad] != leaf.entries[0].sizes[leaf.part.pad]:
        return _padded_leaf(source, leaf, dtype, transforms, chunk_bytes)
    pieces: list = []
    chunks: tuple[int, ...] = ()
    skip = 1 if sel else 0  # the selected axis leads the blocks' regions
    for pos, entry in enumerate(leaf.entries):
        e = _as(entry, whole_lay)
        nbytes = math.prod(e.tunix_shape) * dtype.itemsize
        blocks = _blocks(e, nbytes, chunk_bytes, transforms)
        if blocks is not None and blocks.tunix_dim < skip:
            blocks = None
        if blocks is None:
            if not leaf.stack:
                return orbax_io.LazyArray(leaf.shape, dtype, produce=functools.partial(whole, e), held=HELD_PER_BYTE)
            regions = [(leaf.region(pos), functools.partial(whole, e))]
            chunks = layout.shape(lay, e.sizes)
        else:
            per = per_block(blocks, nbytes, chunk_bytes)
            regions = [(leaf.region(pos, blocks.tunix_region(i, j)[skip:]), functools.partial(block, blocks, i, j))
                       for i, j in blocks.ranges(per)]
            chunks = blocks.tunix_block_shape(per)[skip:]
        pieces += regions
    chunks = chunks[:maxtext_layout.SCAN_AXIS] + (1,) * len(leaf.stack) + chunks[maxtext_layout.SCAN_AXIS:]
    return orbax_io.LazyArray(leaf.shape, dtype, chunks=chunks, pieces=pieces, held=HELD_PER_BYTE)


def _padded_leaf(source: ModelRows, leaf: Leaf, dtype: np.dtype, transforms,
                 chunk_bytes: int) -> orbax_io.LazyArray:
    """A model tensor that MaxText holds more of along its first axis (the vocabulary): in row
    blocks of MaxText's length, the rows past HF's zeros (as to_maxtext pads)."""
    e = _as(leaf.entries[0], leaf.part.layout)
    blocks = mapping.blocks(e)
    if layout.parse(leaf.part.layout)[0] != (leaf.part.pad,) or blocks is None or blocks.axis != leaf.part.pad:
        raise UnsupportedError(f"{e.hf_keys[0]}: MaxText pads it along an axis ckptbridge cannot pad")
    have, want = blocks.count, leaf.shape[0]
    row_bytes = math.prod(leaf.shape[1:]) * dtype.itemsize
    per = max(1, chunk_bytes // max(1, row_bytes))

    def rows(a: int, b: int) -> np.ndarray:
        out = np.zeros((b - a, *leaf.shape[1:]), dtype)
        if a < have:
            x = source.tunix_block(blocks, a, min(b, have))
            out[:len(x)] = apply(x, leaf.part.layout, blocks.sizes(a, min(b, have)), transforms, True)
        return out

    pieces = [((slice(a, min(a + per, want)),) + tuple(slice(None) for _ in leaf.shape[1:]),
               functools.partial(rows, a, min(a + per, want))) for a in range(0, want, per)]
    return orbax_io.LazyArray(leaf.shape, dtype, chunks=(per, *leaf.shape[1:]), pieces=pieces, held=HELD_PER_BYTE)


# --------------------------------------------------------------------------- MaxText -> HF


@dataclasses.dataclass(frozen=True)
class Tree:
    """MaxText's parameters in a checkpoint's tree, by their Linen path under ``params/params``
    (``decoder/layers_0/mlp/wo/kernel``): their (shape, dtype) and where each is stored (under
    ``params/params`` or at the top of an NNX tree, with or without a ``value`` level under it,
    NNX layer lists ``layers/0`` as Linen's ``layers_0``, as MaxText's ``to_huggingface`` reads them)."""

    nnx: bool
    params: dict[tuple[str, ...], tuple[tuple[int, ...], np.dtype]]
    stored: dict[tuple[str, ...], tuple[str, ...]]

    @property
    def scanned(self) -> bool:
        """Whether the layers are stacked (no ``decoder/layers_{i}``)."""
        return not any(len(p) > 1 and p[0] == "decoder" and re.fullmatch(r"layers_[0-9]+", p[1])
                       for p in self.params)

    @property
    def lora(self) -> list[tuple[str, ...]]:
        """The LoRA factors' paths (``kernel_lora_a`` / ``kernel_lora_b``), sorted."""
        return sorted(p for p in self.params if p[-1].endswith(LORA_SUFFIXES))


LORA_SUFFIXES = ("_lora_a", "_lora_b")  # qwix's factors beside a weight, named after it


def _linen_path(path: tuple[str, ...]) -> tuple[str, ...]:
    """A stored path as Linen names it: no ``value`` level under the leaf, ``layers/0`` as ``layers_0``."""
    if path[-1:] == ("value",):
        path = path[:-1]
    out: list[str] = []
    for name in path:
        if name.isdigit() and out:
            out[-1] = f"{out[-1]}_{name}"
        else:
            out.append(name)
    return tuple(out)


def read_tree(ckpt: orbax_io.OrbaxCheckpoint) -> Tree:
    """MaxText's parameters in ``ckpt``; a MismatchError when it holds none (not a MaxText checkpoint)."""
    paths = list(ckpt.leaves)
    if any(p[:3] in (ROOT + ("decoder",), ROOT + ("token_embedder",)) for p in paths):
        root: tuple[str, ...] = ROOT
    elif any(p[:1] in (("decoder",), ("token_embedder",)) for p in paths):
        root = ()
    else:
        raise MismatchError(f"{ckpt.path}: not a MaxText checkpoint (no params/params/decoder tree, nor an NNX "
                            "decoder tree); for a Tunix checkpoint use `ckptbridge convert orbax-to-safetensors`")
    params, stored = {}, {}
    for p, v in ckpt.leaves.items():
        if p[:len(root)] == root and p[len(root):len(root) + 1] in TOP \
                and not any(n == "rngs" or n.endswith("_rngs") for n in p):  # NNX's random state
            name = _linen_path(p[len(root):])
            params[name], stored[name] = v, p
    return Tree(not root, params, stored)


class MaxTextSource(ModelRows):
    """A MaxText checkpoint checked against its family's rows (no leaf read yet): each row's HF
    tensors read, untransformed and cast as MaxText's ``to_huggingface`` writes them with
    ``weight_dtype`` the stored dtype (its transforms undone in float32, cast back)."""

    format = NAME

    def __init__(self, ckpt: orbax_io.OrbaxCheckpoint, cfg: ModelConfig, spec: FamilySpec, prefix: str,
                 entries: list[mapping.Entry], leaves: list[Leaf], tree: Tree, config_dir: str | None,
                 towers: list[mapping.Entry] | None = None, spelling: dict[str, str] | None = None):
        self.ckpt, self.cfg, self.spec, self.prefix, self.entries = ckpt, cfg, spec, prefix, entries
        self.path = ckpt.path
        self.leaves, self.tree = leaves, tree
        self.tower_entries, self.tower_spelling = list(towers or []), dict(spelling or {})
        self.towers_dropped = ckpt.metadata.towers_dropped or 0
        self.scan_layers = tree.scanned
        self.config_dir = config_dir  # where non-weight files come from when not stored with the checkpoint
        self.units = _units(self)
        self._where: dict[tuple, tuple[list[Leaf], int]] = {}
        for unit in self.units:
            for pos, e in enumerate(unit[0].entries):
                self._where[e.ident] = (unit, pos)
        others = Counter(self.leaf_dtype(x) for x in leaves if not _widened(self, x))
        self._model_dtype = others.most_common(1)[0][0] if others else np.dtype(np.float32)

    def leaf_path(self, leaf: Leaf) -> tuple[str, ...]:
        return self.tree.stored[leaf.path]

    def leaf_dtype(self, leaf: Leaf) -> np.dtype:
        return self.ckpt.leaves[self.leaf_path(leaf)][1]

    def hf_dtype(self, leaf: Leaf) -> np.dtype:
        """The dtype ``leaf``'s HF tensors are written in: as stored, but for the tensors MaxText
        widens to float32 (norms stored as 1 + w), which take the dtype of the checkpoint's others."""
        return self._model_dtype if _widened(self, leaf) else self.leaf_dtype(leaf)

    def _unit(self, entry: mapping.Entry) -> tuple[list[Leaf], int]:
        return self._where[entry.ident]

    def drop_towers(self) -> None:
        super().drop_towers()
        held = {id(e) for e in self.entries}
        self.units = [u for u in self.units if id(u[0].entries[0]) in held]

    def dtype(self, entry: mapping.Entry) -> np.dtype:
        if not entry.hf_keys:
            return self._model_dtype
        return self.hf_dtype(self._unit(entry)[0][0])

    def arrays(self, entry: mapping.Entry) -> list[np.ndarray]:
        unit, pos = self._unit(entry)
        transforms = transforms_of(self.spec.maxtext, entry)
        return [v for _, _, v in _unit_pieces(self, unit, transforms, self.dtype(entry), pos, pos + 1)]

    def hf_rows(self, blocks: mapping.Blocks, i: int, j: int) -> np.ndarray | None:
        unit, pos = self._unit(blocks.entry)
        if len(unit) != 1:
            return None
        leaf = unit[0]
        stored = mapping.blocks(_as(leaf.entries[pos], leaf.part.layout))
        if stored is None or stored.axis != blocks.axis:
            return None
        transforms = transforms_of(self.spec.maxtext, leaf.entries[pos])
        pieces = _box_pieces(self, leaf, pos, stored, transforms, self.dtype(blocks.entry), i, j)
        return np.stack([v for _, _, v in pieces]) if stored.keyed else pieces[0][2]

    def hf_plan(self, chunk_bytes: int, computed: Collection[str] = (), towers: bool = True) -> HFPlan:
        """The HF tensors leaf by leaf (the parts of a fused row together): one layer of a scanned
        tensor at a time where it is stored so (else the layers of one stored chunk at once, read
        once), row blocks of about ``chunk_bytes`` of larger ones (``towers``: False for the text
        model's alone)."""
        jobs: list[Job] = []
        tensors: list[HFTensor] = []
        text = None if towers else {id(e) for e in self.entries}
        for unit in self.units:
            if text is not None and id(unit[0].entries[0]) not in text:
                continue
            dtype = self.hf_dtype(unit[0])
            unit_jobs, unit_tensors = _unit_jobs(self, unit, chunk_bytes, dtype)
            jobs += unit_jobs
            tensors += [HFTensor(key, dtype, e.hf_shape, n) for e, key, n in unit_tensors]
        return HFPlan(tensors, jobs)

    def assets(self) -> tuple[list[str], str] | None:
        from ckptbridge.formats.tunix import _config_assets

        return stored_assets(self.ckpt.path) or _config_assets(self.config_dir)

    def close(self) -> None:
        self.ckpt.close()


def resolve(src: str, step: int | None = None) -> str:
    """The Orbax item of a MaxText checkpoint: ``src`` itself, or ``items`` / ``model_params`` of
    the given (default: latest) step of a checkpoint-manager root or of a step directory."""
    try:
        return orbax_io.resolve_checkpoint(src, step, item=ITEM)
    except InputNotFoundError:
        try:
            return orbax_io.resolve_checkpoint(src, step, item=NNX_ITEM)
        except InputNotFoundError:
            pass
        raise


def describe(ckpt: orbax_io.OrbaxCheckpoint) -> dict | None:
    """What ``inspect`` says of a MaxText checkpoint (None when ``ckpt`` is not one): its tree
    (Linen ``params/params`` or NNX SFT), whether its layers are scanned, and whether it holds LoRA."""
    try:
        tree = read_tree(ckpt)
    except MismatchError:
        return None
    return {"tree": "nnx (model_params)" if tree.nnx else "linen (params/params)", "scan_layers": tree.scanned,
            "lora": bool(tree.lora)}


def model_plan(tree: Tree, cfg: ModelConfig, spec: FamilySpec, prefix: str, where: str,
               spelling: dict[str, str] | None = None) -> tuple[list[mapping.Entry], list[Leaf], list[mapping.Entry]]:
    """The rows of the model ``cfg`` describes and their MaxText parameters in the form ``tree``
    has (scanned or not; MaxText's vocabulary where the tree holds a padded embedding), and the
    rows of each tower the tree holds a parameter of (their parameters last)."""
    mt = maxtext_spec(spec, where)
    ents = mapping.entries(cfg, spec, prefix)
    leaves = maxtext_layout.plan(ents, mt, tree.scanned, cfg.flags)
    padded = [leaf for leaf in leaves if leaf.part.pad and leaf.path in tree.params]
    if padded:  # MaxText's vocabulary is what its embedding holds
        leaves = maxtext_layout.plan(ents, mt, tree.scanned, cfg.flags, vocab=tree.params[padded[0].path][0][0])
    towers: list[mapping.Entry] = []
    if any(p[:1] in TOP[2:] for p in tree.params) and cfg.towers and prefix in spec.tower_roots:
        rows = mapping.tower_entries(cfg, spec, prefix, spelling=spelling)
        held = {e.tower for e in rows if e.rule.name in mt.towers.get(e.tower or "", {})
                and tuple(mt.towers[e.tower][e.rule.name][0].replace("{i}", str(e.tower_layer)).split("/"))
                in tree.params}
        towers = [e for e in rows if e.tower in held]
        leaves += maxtext_layout.tower_plan(towers, mt)
    return ents, leaves, towers


def check_scan_metadata(ckpt: orbax_io.OrbaxCheckpoint, tree: Tree) -> None:
    recorded = ckpt.custom_metadata.get(SCAN_KEY)
    if isinstance(recorded, bool) and recorded != tree.scanned:
        raise MismatchError(f"{ckpt.path}: its metadata says scan_layers={recorded}, but its tree is "
                            f"{'scanned' if tree.scanned else 'unscanned'}; the checkpoint is inconsistent")


def open_maxtext_source(src: str, *, config: str | None = None, step: int | None = None) -> MaxTextSource:
    """Open a MaxText checkpoint and check every parameter's path and shape against the rows of
    the model its HF config describes (stored by ckptbridge, or ``config``)."""
    deps.require("orbax")
    path = resolve(src, step)
    ckpt = orbax_io.OrbaxCheckpoint(path)
    try:
        return _validate(ckpt, config)
    except BaseException:
        ckpt.close()
        raise


def _validate(ckpt: orbax_io.OrbaxCheckpoint, config: str | None) -> MaxTextSource:
    path = ckpt.path
    tree = read_tree(ckpt)
    if tree.lora:
        raise UnsupportedError(f"{path}: holds LoRA parameters ({'/'.join(tree.lora[0])}{more(tree.lora)}); merge "
                               "them into the base with `ckptbridge merge BASE " + path + " DST`, or export them "
                               "with `ckptbridge convert orbax-to-peft`")
    meta = ckpt.metadata
    config_dir = None
    if config is not None:
        hf_config, where, config_dir = config_from_option(config)
        prefix = None
    elif meta.hf_config is not None:
        hf_config, where, prefix = meta.hf_config, f"{path} (ckptbridge metadata)", meta.key_prefix
    else:
        raise ConfigError(f"{path}: a MaxText checkpoint carries no HF config; pass config (--config) with the "
                          "model's config.json (or its directory)")
    spec = specs.family_for(hf_config, where)
    maxtext_spec(spec, where)
    cfg = spec.parse_config(hf_config, where)
    prefix = prefix if prefix in spec.key_prefixes else cfg.default_key_prefix
    check_scan_metadata(ckpt, tree)
    record = meta.towers if config is None and isinstance(meta.towers, dict) else {}
    found = record.get("spelling")
    if isinstance(found, dict):
        spelling = found
    else:  # a MaxText checkpoint with --config: the spelling of the model beside the config, if any
        from ckptbridge.formats.hf import spelling_beside

        spelling = spelling_beside(config_dir, spec, prefix)
    ents, leaves, towers = model_plan(tree, cfg, spec, prefix, where, spelling)
    params = tree.params
    expected = {leaf.path: leaf for leaf in leaves}
    form = "scanned" if tree.scanned else "unscanned"
    missing = [p for p in expected if p not in params]
    if missing:
        raise MismatchError(f"{path}: MaxText parameter {'/'.join(missing[0])} is missing{more(missing)}; the "
                            f"checkpoint ({form}) does not match the config (wrong config (--config), or an "
                            "incomplete checkpoint)")
    extra = sorted(p for p in params if p not in expected)
    if extra:
        raise MismatchError(f"{path}: unexpected MaxText parameter {'/'.join(extra[0])}{more(extra)}: not part of "
                            f"the {spec.name} model that the config describes ({form})")
    for p, leaf in expected.items():
        if params[p][0] != leaf.shape:
            raise MismatchError(f"{path}: MaxText parameter {'/'.join(p)} has shape {params[p][0]}, the config "
                                f"implies {leaf.shape} ({form}, layout {leaf.layout}); the checkpoint and the config "
                                "disagree")
    return MaxTextSource(ckpt, cfg, spec, prefix, ents, leaves, tree, config_dir, towers, spelling)


Tensors = list[tuple[mapping.Entry, str, int]]  # (entry, HF key, pieces it is written from)


def _position_groups(source: MaxTextSource, leaf: Leaf) -> list[tuple[int, int]]:
    """Runs of ``leaf``'s entries read at once: one entry where the stored chunks hold one layer
    each along the stacked axes (as ckptbridge writes them), else all of them (as Orbax stores
    MaxText's own checkpoints, in chunks of up to 2 GiB over every layer: a chunk read is decoded
    whole, so it is read once)."""
    n = len(leaf.entries)
    chunks = source.ckpt.chunks(source.leaf_path(leaf))
    ax = maxtext_layout.SCAN_AXIS
    if not leaf.stack or (chunks is not None and all(c == 1 for c in chunks[ax:ax + len(leaf.stack)])):
        return [(i, i + 1) for i in range(n)]
    return [(0, n)]


def _read(source: MaxTextSource, leaf: Leaf, region: tuple[slice, ...] | None) -> np.ndarray:
    p = source.leaf_path(leaf)
    return source.ckpt.start_read([p], region)()[p]


def _span(leaf: Leaf, i: int, j: int) -> tuple[tuple[slice, ...] | None, Callable[[np.ndarray, int], np.ndarray]]:
    """The box of the stored tensor that entries ``i:j`` fill, and how to take entry ``pos`` out of it."""
    if j - i == 1:
        return leaf.region(i), lambda x, pos: leaf.one(x)
    return None, lambda x, pos: leaf.one(x[leaf.region(pos)])


def _unit_pieces(source: MaxTextSource, leaves: list[Leaf], transforms, dtype: np.dtype, i: int,
                 j: int) -> list[Part]:
    """The HF tensors of entries ``i:j`` of ``leaves`` (one leaf, or the parts of a fused row in
    order), read from the stored tensors."""
    region, take = _span(leaves[0], i, j)
    xs = [_read(source, leaf, region) for leaf in leaves]
    out: list[Part] = []
    for pos in range(i, j):
        vals = [apply(take(x, pos), leaf.part.layout, leaf.entries[pos].sizes, transforms, False)
                for x, leaf in zip(xs, leaves)]
        e = _as(leaves[0].entries[pos], _whole_layout(leaves[0]))
        value = np.stack(vals) if leaves[0].part.select else vals[0]
        out += [(k, 0, v.astype(dtype, copy=False)) for k, v in zip(e.hf_keys, mapping.tunix_to_hf(e, value))]
    return out


def _box_pieces(source: MaxTextSource, leaf: Leaf, pos: int, blocks: mapping.Blocks, transforms, dtype: np.dtype,
                i: int, j: int) -> list[Part]:
    box = leaf.one(_read(source, leaf, leaf.region(pos, blocks.tunix_region(i, j))))
    hf = blocks.to_hf(apply(box, leaf.part.layout, blocks.sizes(i, j), transforms, False), i, j)
    hf = hf.astype(dtype, copy=False)
    keys = blocks.entry.hf_keys
    if not blocks.keyed:
        return [(keys[0], i * blocks.hf_rows * math.prod(blocks.entry.hf_shape[1:-1]), hf)]
    return [(keys[n], 0, hf[n - i]) for n in range(i, j)]


def _units(source: MaxTextSource) -> list[list[Leaf]]:
    """The leaves in write order, the parts of a fused row together (in their order)."""
    out: list[list[Leaf]] = []
    fused: dict[tuple, list[Leaf]] = {}
    for leaf in source.leaves:
        if leaf.part.select is None:
            out.append([leaf])
            continue
        key = (tuple(id(e) for e in leaf.entries), leaf.part.select[0])  # the same rows, split
        if key not in fused:
            fused[key] = []
            out.append(fused[key])
        fused[key].append(leaf)
    for unit in out:
        unit.sort(key=lambda leaf: leaf.part.select[1] if leaf.part.select else 0)
    return out


def _unit_jobs(source: MaxTextSource, leaves: list[Leaf], chunk_bytes: int,
               dtype: np.dtype) -> tuple[list[Job], Tensors]:
    """The jobs that make the HF tensors of ``leaves`` (one leaf, or the parts of a fused row) in
    ``dtype``, and (entry, HF key, pieces) in the order they come."""
    leaf = leaves[0]
    transforms = transforms_of(source.spec.maxtext, leaf.entries[0])
    itemsize = source.leaf_dtype(leaf).itemsize
    stored = source.ckpt.chunks(source.leaf_path(leaf))
    jobs: list[Job] = []
    tensors: Tensors = []
    for i, j in _position_groups(source, leaf):
        e = _as(leaf.entries[i], leaf.part.layout)
        nbytes = math.prod(e.tunix_shape) * itemsize * len(leaves)
        blocks = _blocks(e, nbytes, chunk_bytes, transforms) if j - i == 1 and len(leaves) == 1 else None
        ranges = None
        if blocks is not None and stored is not None:
            dim = blocks.tunix_dim + (len(leaf.stack) if blocks.tunix_dim >= maxtext_layout.SCAN_AXIS else 0)
            align = stored[dim] // math.gcd(stored[dim], blocks.tunix_step)
            ranges = blocks.ranges(per_block(blocks, nbytes, chunk_bytes), align)
        if blocks is None or ranges is None or len(ranges) < 2:
            jobs.append((HELD_PER_BYTE * nbytes * (j - i),
                         functools.partial(_unit_pieces, source, leaves, transforms, dtype, i, j)))
            tensors += [(leaf.entries[p], key, 1) for p in range(i, j) for key in leaf.entries[p].hf_keys]
            continue
        for a, b in ranges:
            jobs.append((HELD_PER_BYTE * nbytes * (b - a) // blocks.count,
                         functools.partial(_box_pieces, source, leaf, i, blocks, transforms, dtype, a, b)))
        tensors += ([(leaf.entries[i], e.hf_keys[0], len(ranges))] if not blocks.keyed
                    else [(leaf.entries[i], key, 1) for key in e.hf_keys])
    return jobs, tensors


def _widened(source: MaxTextSource, leaf: Leaf) -> bool:
    return any(t.widens for t in transforms_of(source.spec.maxtext, leaf.entries[0]))


def detect(probe) -> bool:
    """A MaxText checkpoint of weights (Linen ``items`` or NNX ``model_params``; no LoRA factors)."""
    found = describe(probe.checkpoint) if probe.checkpoint is not None else None
    return found is not None and not found["lora"]


def inexact_rules(spec: FamilySpec, cfg: ModelConfig, **_) -> dict[str, str]:
    """The rows MaxText stores through a value transform that rounds (a scale), and which."""
    if spec.maxtext is None:
        return {}
    mt = spec.maxtext
    names = {rule: [maxtext_layout.TRANSFORMS[n] for n in mt.transforms[rule]] for rule in mt.transforms}
    return {rule: f"stored {' then '.join(t.name for t in ts)}: rounded once each way"
            for rule, ts in names.items() if not all(t.exact for t in ts)}


def tower_refusal(spec: FamilySpec, cfg: ModelConfig, names: list[str]) -> str | None:
    """Why MaxText's model of ``spec`` cannot hold the towers ``names`` of ``cfg`` (None: it can)."""
    mt = spec.maxtext
    if mt is None:
        return None  # (the writer says that the family has no MaxText layout)
    missing = [n for n in names if n not in mt.towers]
    if missing:
        return f"MaxText's {spec.name} has no {' or '.join(missing)} tower"
    return mt.tower_refusal(cfg, spec.tower_configs(cfg)) if mt.tower_refusal is not None else None


def open_source(src: str, *, config: str | None = None, step: int | None = None, **_) -> MaxTextSource:
    return open_maxtext_source(src, config=config, step=step)


# --------------------------------------------------------------------------- writing


@dataclasses.dataclass(frozen=True)
class ToMaxTextReport(ConversionReport):
    """A model written as a MaxText checkpoint."""

    OMIT_NONE = ("adapters", "towers")

    scan_layers: bool
    chunk_bytes: int
    transformed: dict[str, str]  # rule -> the value transforms applied to it
    seconds: float
    adapters: list[str] | None = None  # merged on the way
    towers: dict | None = None  # the towers written (tensors, bytes by tower)
    towers_dropped: int = 0  # vision/audio tensors left out (--skip-multimodal)

    def summary(self) -> str:
        lay = "scanned (layers stacked on axis 1)" if self.scan_layers else "unscanned (decoder/layers_{i})"
        text = self._head(self.seconds) + towers_line(self.towers) + \
            f"\n  MaxText layout: {lay}; load it with load_parameters_path={self.destination.rstrip('/')}/0/{ITEM}"
        if self.transformed:
            text += "\n  values transformed as MaxText's to_maxtext does: " + ", ".join(
                f"{rule} ({how})" for rule, how in self.transformed.items())
        if self.adapters:
            text += f"\n  merged: {', '.join(self.adapters)}"
        if self.towers_dropped:
            text += f"\n  dropped {self.towers_dropped} vision/audio tensors (--skip-multimodal)"
        return text


def write(rows: ModelRows, dst: str, req: Request, *, scan_layers: bool = False, vocab_size: int | None = None,
          compression: bool = True) -> ToMaxTextReport:
    """Write ``rows`` as the MaxText checkpoint ``dst/0/items``: what MaxText's ``to_maxtext``
    writes for the same model (same tree, shapes and value transforms, in the source dtype as its
    default lazy loading keeps it). ``scan_layers``: the layers stacked on axis 1 (MaxText's
    ``scan_layers=true``; each layer stored as a chunk of its own), else ``decoder/layers_{i}``.
    Pieces of at most the conversion's chunk size (one layer of a scanned tensor, or row blocks of
    a larger one). ``compression=False`` stores the chunks without zstd (Orbax and MaxText read
    either). ``vocab_size``: MaxText's vocabulary where its model config pads the embedding
    (default: what its published configs use for the model's, from the family's spec; otherwise
    the model's own)."""
    deps.require("orbax")
    specs.note_mismatch(rows.cfg)
    spec = maxtext_spec(rows.spec, rows.path)
    leaves = maxtext_layout.plan(rows.entries, spec, scan_layers, rows.cfg.flags, vocab=vocab_size)
    leaves += maxtext_layout.tower_plan(rows.tower_entries, spec)
    flat = {ROOT + leaf.path: _leaf_to_maxtext(rows, leaf, spec, req.chunk_bytes) for leaf in leaves}
    bar = progress_over(flat.values(), req.desc, req.progress)
    total = bar.total
    tree = {**orbax_io.nest(flat), "step": np.asarray(0, np.int64)}  # MaxText's TrainState step
    found = rows.assets()
    with atomic_directory(dst, req.overwrite) as tmp:
        orbax_io.save_manager_step(tmp, 0, tree, {SCAN_KEY: scan_layers, **rows.metadata("weights", None)},
                                   item=ITEM, compression=compression, engine=req.engine)
        if found:
            copy_assets(found[0], found[1], storage.join(tmp, ASSETS_DIR))
    bar.close()
    transformed = {r: " then ".join(t) for r, t in spec.transforms.items()
                   if any(e.rule.name == r for e in rows.entries)}
    held = {(e.tower, e.rule.name) for e in rows.tower_entries}
    transformed.update({f"{tower} {r}": " then ".join(t) for tower, ts in spec.tower_transforms.items()
                        for r, t in ts.items() if (tower, r) in held})
    return ToMaxTextReport(
        direction=req.direction, source=req.source, destination=dst, family=rows.spec.name, key_prefix=rows.prefix,
        layer_kinds=rows.cfg.layer_kinds(), tensors=len(flat), bytes=total, scan_layers=scan_layers,
        towers=tower_record(rows.tower_entries, rows.key_info) or None, towers_dropped=rows.towers_dropped,
        chunk_bytes=req.chunk_bytes, transformed=transformed, seconds=round(time.perf_counter() - req.t0, 3),
        adapters=list(req.adapters) or None)


__all__ = ["ITEM", "LORA_SUFFIXES", "NNX_ITEM", "ROOT", "SCAN_KEY", "MaxTextSource", "ToMaxTextReport", "Tree",
           "check_scan_metadata", "describe", "maxtext_spec", "model_plan", "open_maxtext_source", "open_source",
           "read_tree", "resolve", "supported", "write"]
