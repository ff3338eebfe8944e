"""MaxText checkpoints <-> HF safetensors, streaming, through the same rows as every other layout.

MaxText's converters (``to_maxtext``, ``to_huggingface``) hold every weight in memory at once; these
verbs hold a few pieces. A MaxText checkpoint is an Orbax CheckpointManager root with one item,
``<dir>/<step>/items``, whose tree is ``params/params/{token_embedder,decoder}/...``
(``ckptbridge.maxtext_layout`` gives each parameter's path and layout from the family's rows,
``ckptbridge.specs.maxtext`` the names, layouts and value transforms per family); SFT checkpoints
of MaxText's NNX trainers keep the same tree at ``<step>/model_params`` without the
``params/params`` levels and with a ``value`` level under each leaf. The step's custom metadata
records ``scan_layers`` as MaxText does; ckptbridge adds the HF config, so that the way back
needs no ``--config``. What MaxText itself does: docs/maxtext-reference.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import numpy as np

from ckptbridge import deps, hub, mapping, maxtext_layout, options, specs
from ckptbridge.config import ModelConfig
from ckptbridge.convert import HELD_PER_BYTE, ConversionReport, _metadata, _per_block
from ckptbridge.errors import ConfigError, InputNotFoundError, MismatchError, UnsupportedError
from ckptbridge.io import DEFAULT_CHUNK_SIZE, storage
from ckptbridge.io import orbax as orbax_io
from ckptbridge.io.atomic import atomic_directory, check_destination
from ckptbridge.io.hf import copy_assets, write_model_directory
from ckptbridge.io.safetensors import PlannedTensor
from ckptbridge.maxtext_layout import Leaf, apply, transforms_of
from ckptbridge.options import DEFAULT_MAX_SHARD_SIZE
from ckptbridge.progress import Progress
from ckptbridge.sources import ASSETS_DIR, HFSource, _config_from_option, more, open_hf_source
from ckptbridge.specs.base import FamilySpec
from ckptbridge.stream import CODEC_VERB_WORKERS, Job, Parallelism, Parts

ITEM = "items"  # MaxText's one CheckpointManager item
NNX_ITEM = "model_params"  # MaxText's NNX SFT trainers' item
ROOT = ("params", "params")  # the Linen tree's levels above token_embedder and decoder
SCAN_KEY = "scan_layers"  # MaxText's custom metadata of the step


def supported() -> list[str]:
    return sorted(s.name for s in specs.FAMILIES.values() if s.maxtext is not None)


def _maxtext_spec(spec: FamilySpec, where: str):
    if spec.maxtext is None:
        raise UnsupportedError(f"{where}: {spec.name} has no MaxText layout in ckptbridge yet "
                               f"(supported: {', '.join(supported())})")
    return spec.maxtext


def _unscanned(leaf: Leaf, spec) -> str:
    """The MaxText layout of one layer of ``leaf`` (its own layout when unscanned)."""
    return spec.names[leaf.entries[0].rule.name][1]


def _as(entry: mapping.Entry, lay: str) -> mapping.Entry:
    """``entry`` with MaxText's layout ``lay`` in place of Tunix's: the blocks and rearrangements of
    :mod:`ckptbridge.mapping` then go between HF and MaxText."""
    return dataclasses.replace(entry, tunix_variant=lay)


def _scanned(leaf: Leaf) -> bool:
    return leaf.path[:2] == ("decoder", "layers")


def _with_layer(region: tuple[slice, ...], pos: int) -> tuple[slice, ...]:
    """A box of one layer's tensor -> the same box of layer ``pos`` in the stacked tensor."""
    return region[:maxtext_layout.SCAN_AXIS] + (slice(pos, pos + 1),) + region[maxtext_layout.SCAN_AXIS:]


def _blocks(e: mapping.Entry, nbytes: int, chunk_bytes: int, transforms) -> mapping.Blocks | None:
    """How ``e`` (in its MaxText layout) splits into row blocks, when larger than ``chunk_bytes``
    and no value transform needs the cut axis whole."""
    blocks = mapping.blocks(e) if nbytes > chunk_bytes else None
    if blocks is None or any(t.axis == blocks.axis for t in transforms):
        return None
    return blocks


# --------------------------------------------------------------------------- HF -> MaxText


@dataclasses.dataclass(frozen=True)
class ToMaxTextReport(ConversionReport):
    scan_layers: bool
    chunk_bytes: int
    transformed: dict[str, str]  # rule -> the value transforms applied to it
    seconds: float

    def summary(self) -> str:
        lay = "scanned (layers stacked on axis 1)" if self.scan_layers else "unscanned (decoder/layers_{i})"
        text = self._head(self.seconds) + f"\n  MaxText layout: {lay}; load it with load_parameters_path=" \
            f"{self.destination.rstrip('/')}/0/{ITEM}"
        if self.transformed:
            text += "\n  values transformed as MaxText's to_maxtext does: " + ", ".join(
                f"{rule} ({how})" for rule, how in self.transformed.items())
        return text


def _leaf_to_maxtext(source: HFSource, leaf: Leaf, spec, chunk_bytes: int) -> orbax_io.LazyArray:
    """The MaxText parameter ``leaf`` as pieces made from the HF tensors: one per layer when
    scanned (a chunk of the stacked tensor each), or row blocks of at most ``chunk_bytes`` of one
    layer's tensor where it is larger (and its transforms allow)."""
    lay = _unscanned(leaf, spec)
    transforms = transforms_of(spec, leaf.entries[0].rule.name)
    dtype = source.dtype(leaf.entries[0])
    scanned = _scanned(leaf)

    def whole(e: mapping.Entry) -> np.ndarray:
        x = apply(source.tunix_value(e), lay, e.sizes, transforms, True)
        return np.expand_dims(x, maxtext_layout.SCAN_AXIS) if scanned else x

    def block(blocks: mapping.Blocks, i: int, j: int) -> np.ndarray:
        x = apply(source.tunix_block(blocks, i, j), lay, blocks.sizes(i, j), transforms, True)
        return np.expand_dims(x, maxtext_layout.SCAN_AXIS) if scanned else x

    pieces: list = []
    chunks: tuple[int, ...] = ()
    for pos, entry in enumerate(leaf.entries):
        e = _as(entry, lay)
        nbytes = math.prod(e.tunix_shape) * dtype.itemsize
        blocks = _blocks(e, nbytes, chunk_bytes, transforms)
        if blocks is None:
            if not scanned:
                return orbax_io.LazyArray(leaf.shape, dtype, produce=functools.partial(whole, e), held=HELD_PER_BYTE)
            regions = [(tuple(slice(None) for _ in e.tunix_shape), functools.partial(whole, e))]
            chunks = e.tunix_shape
        else:
            per = _per_block(blocks, nbytes, chunk_bytes)
            regions = [(blocks.tunix_region(i, j), functools.partial(block, blocks, i, j))
                       for i, j in blocks.ranges(per)]
            chunks = blocks.tunix_block_shape(per)
        pieces += [(_with_layer(r, pos) if scanned else r, make) for r, make in regions]
    if scanned:  # one layer per chunk
        chunks = chunks[:maxtext_layout.SCAN_AXIS] + (1,) + chunks[maxtext_layout.SCAN_AXIS:]
    return orbax_io.LazyArray(leaf.shape, dtype, chunks=chunks, pieces=pieces, held=HELD_PER_BYTE)


def convert_safetensors_to_maxtext(src: str, dst: str, *, scan_layers: bool = False, overwrite: bool = False,
                                   skip_multimodal: bool = False, chunk_size: str | int = DEFAULT_CHUNK_SIZE,
                                   compression: bool = True, workers: int | None = None,
                                   memory_budget: str | int | None = None, progress: bool | None = None,
                                   revision: str | None = None) -> ToMaxTextReport:
    """HF model directory -> MaxText checkpoint (``dst/0/items``, what MaxText's ``to_maxtext``
    writes for the same model: same tree, shapes and value transforms, in the source dtype as its
    default lazy loading keeps it). ``scan_layers``: the layers stacked on axis 1 (MaxText's
    ``scan_layers=true``; each layer stored as a chunk of its own), else ``decoder/layers_{i}``.
    Streaming as :func:`ckptbridge.convert.convert_safetensors_to_orbax`: pieces of at most
    ``chunk_size`` (one layer of a scanned tensor, or row blocks of a larger one) made on
    ``workers`` threads within ``memory_budget``. ``compression=False`` stores the chunks without
    zstd (Orbax and MaxText read either)."""
    t0 = time.perf_counter()
    deps.require("orbax")
    chunk_bytes = options.size("chunk_size", chunk_size)
    parallel = Parallelism.of(workers, memory_budget, least=chunk_bytes, least_what="chunk_size (--chunk-size)",
                              default_cap=CODEC_VERB_WORKERS)
    src = hub.local(src, hub.MODEL, revision=revision)
    check_destination(dst, [src], overwrite)
    with open_hf_source(src, skip_multimodal=skip_multimodal) as source, parallel.engine("s2m") as engine:
        spec = _maxtext_spec(source.spec, src)
        specs.note_mismatch(source.cfg)
        leaves = maxtext_layout.plan(source.entries, spec, scan_layers)
        flat = {ROOT + leaf.path: _leaf_to_maxtext(source, leaf, spec, chunk_bytes) for leaf in leaves}
        total = sum(leaf.nbytes for leaf in flat.values())
        bar = Progress(total, "safetensors -> maxtext", enabled=progress)
        for lazy in flat.values():
            lazy.on_written = bar.update
        tree = {**orbax_io.nest(flat), "step": np.asarray(0, np.int64)}  # MaxText's TrainState step
        custom = {SCAN_KEY: scan_layers, **_metadata(source, "weights", source.model.asset_files(), None)}
        assets = source.model.asset_files()
        with atomic_directory(dst, overwrite) as tmp:
            orbax_io.save_manager_step(tmp, 0, tree, custom, item=ITEM, compression=compression, engine=engine)
            if assets:
                copy_assets(assets, source.model.path, storage.join(tmp, ASSETS_DIR))
        bar.close()
        return ToMaxTextReport(
            direction="safetensors-to-maxtext", source=src, destination=dst, family=source.spec.name,
            key_prefix=source.prefix, layer_kinds=source.cfg.layer_kinds(), tensors=len(flat), bytes=total,
            scan_layers=scan_layers, chunk_bytes=chunk_bytes,
            transformed={r: " then ".join(t) for r, t in spec.transforms.items()
                         if any(e.rule.name == r for e in source.entries)},
            seconds=round(time.perf_counter() - t0, 3))


# --------------------------------------------------------------------------- MaxText -> HF


@dataclasses.dataclass
class MaxTextSource:
    """A MaxText checkpoint checked against its family's rows (no leaf read yet)."""

    ckpt: orbax_io.OrbaxCheckpoint
    cfg: ModelConfig
    spec: FamilySpec
    prefix: str
    entries: list[mapping.Entry]
    leaves: list[Leaf]
    root: tuple[str, ...]  # ROOT (Linen tree) or () (NNX SFT tree)
    suffix: tuple[str, ...]  # ("value",) in NNX trees
    scan_layers: bool
    config_dir: str | None  # where non-weight files come from when not stored with the checkpoint

    def path(self, leaf: Leaf) -> tuple[str, ...]:
        return self.root + leaf.path + self.suffix

    def dtype(self, leaf: Leaf) -> np.dtype:
        return self.ckpt.leaves[self.path(leaf)][1]

    def close(self) -> None:
        self.ckpt.close()

    def __enter__(self) -> MaxTextSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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


def _tree_root(ckpt: orbax_io.OrbaxCheckpoint) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Where MaxText's parameters sit in the checkpoint's tree, and the level under each leaf."""
    paths = list(ckpt.leaves)
    if any(p[:3] in (ROOT + ("decoder",), ROOT + ("token_embedder",)) for p in paths):
        return ROOT, ()
    if any(p[:1] in (("decoder",), ("token_embedder",)) for p in paths):
        return (), ("value",) if any(p[-1] == "value" for p in paths) else ()
    raise MismatchError(f"{ckpt.path}: not a MaxText checkpoint (no params/params/decoder tree, nor an NNX "
                        "decoder tree); for a Tunix checkpoint use `ckptbridge convert orbax-to-safetensors`")


def describe(ckpt: orbax_io.OrbaxCheckpoint) -> dict | None:
    """What ``inspect`` says of a MaxText checkpoint (None when ``ckpt`` is not one): its tree
    (Linen ``params/params`` or NNX SFT), whether its layers are scanned, and whether it holds LoRA."""
    try:
        root, suffix = _tree_root(ckpt)
    except MismatchError:
        return None
    params = [p[len(root):] for p in ckpt.leaves if p[:len(root)] == root]
    return {"tree": "linen (params/params)" if root else "nnx (model_params)",
            "scan_layers": any(p[:2] == ("decoder", "layers") for p in params),
            "lora": any(p[-1 - len(suffix)].endswith(("_lora_a", "_lora_b")) for p in params)}


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
    root, suffix = _tree_root(ckpt)
    params = {p[len(root):len(p) - len(suffix)]: v for p, v in ckpt.leaves.items()
              if p[:len(root)] == root and p[len(p) - len(suffix):] == suffix
              and p[len(root):len(root) + 1] in (("decoder",), ("token_embedder",))}
    lora = sorted(p for p in params if p[-1].endswith(("_lora_a", "_lora_b")))
    if lora:
        raise UnsupportedError(f"{path}: holds LoRA parameters ({'/'.join(lora[0])}{more(lora)}); "
                               "MaxText LoRA checkpoints are not converted yet")
    meta = ckpt.metadata
    config_dir = None
    if config is not None:
        hf_config, where, config_dir = _config_from_option(config)
        prefix = None
    elif meta.hf_config is not None:
        hf_config, where, prefix = meta.hf_config, f"{path} (ckptbridge metadata)", meta.key_prefix
    else:
        raise ConfigError(f"{path}: a MaxText checkpoint carries no HF config; pass config (--config) with the "
                          "model's config.json (or its directory)")
    spec = specs.family_for(hf_config, where)
    mt = _maxtext_spec(spec, where)
    cfg = spec.parse_config(hf_config, where)
    prefix = prefix if prefix in spec.key_prefixes else cfg.default_key_prefix
    scanned = any(p[:2] == ("decoder", "layers") for p in params)
    recorded = ckpt.custom_metadata.get(SCAN_KEY)
    if isinstance(recorded, bool) and recorded != scanned:
        raise MismatchError(f"{path}: its metadata says scan_layers={recorded}, but its tree is "
                            f"{'scanned' if scanned else 'unscanned'}; the checkpoint is inconsistent")
    ents = mapping.entries(cfg, spec, prefix)
    leaves = maxtext_layout.plan(ents, mt, scanned)
    expected = {leaf.path: leaf for leaf in leaves}
    form = "scanned" if scanned else "unscanned"
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
    return MaxTextSource(ckpt, cfg, spec, prefix, ents, leaves, root, suffix, scanned, config_dir)


@dataclasses.dataclass(frozen=True)
class FromMaxTextReport(ConversionReport):
    scan_layers: bool
    files: list[str]
    seconds: float

    def summary(self) -> str:
        lay = "scanned" if self.scan_layers else "unscanned"
        return self._head(self.seconds) + f"\n  MaxText layout: {lay}\n  files: {', '.join(self.files)}"


Part = tuple[str, np.ndarray]


def _layer_groups(source: MaxTextSource, leaf: Leaf) -> list[tuple[int, int]]:
    """Runs of layers of a scanned ``leaf`` read at once: one layer where the stored chunks hold
    one layer each (as ckptbridge writes them), else the layers of each stored chunk along the
    layer axis (as Orbax stores MaxText's own: a chunk read is decoded whole)."""
    n = len(leaf.entries)
    chunks = source.ckpt.chunks(source.path(leaf))
    step = 1 if chunks is not None and chunks[maxtext_layout.SCAN_AXIS] == 1 else \
        (chunks[maxtext_layout.SCAN_AXIS] if chunks is not None else n)
    return [(i, min(i + step, n)) for i in range(0, n, step)]


def _to_hf_parts(e: mapping.Entry, x: np.ndarray, transforms) -> list[Part]:
    x = apply(x, e.tunix_layout, e.sizes, transforms, False)
    return list(zip(e.hf_keys, mapping.tunix_to_hf(e, x)))


def _read(source: MaxTextSource, leaf: Leaf, region: tuple[slice, ...] | None) -> np.ndarray:
    p = source.path(leaf)
    return source.ckpt.start_read([p], region)()[p]


def _group_parts(source: MaxTextSource, leaf: Leaf, lay: str, transforms, i: int, j: int) -> list[Part]:
    ax = maxtext_layout.SCAN_AXIS
    region = tuple(slice(i, j) if d == ax else slice(None) for d in range(len(leaf.shape)))
    x = _read(source, leaf, region)
    out: list[Part] = []
    for pos in range(i, j):
        out += _to_hf_parts(_as(leaf.entries[pos], lay), np.take(x, pos - i, axis=ax), transforms)
    return out


def _box_parts(source: MaxTextSource, leaf: Leaf, pos: int | None, blocks: mapping.Blocks, transforms,
               i: int, j: int) -> list[Part]:
    region = blocks.tunix_region(i, j)
    box = _read(source, leaf, _with_layer(region, pos) if pos is not None else region)
    if pos is not None:
        box = np.take(box, 0, axis=maxtext_layout.SCAN_AXIS)
    box = apply(box, blocks.entry.tunix_layout, blocks.sizes(i, j), transforms, False)
    hf = blocks.to_hf(box, i, j)
    keys = blocks.entry.hf_keys
    return [(keys[0], hf)] if not blocks.keyed else [(keys[n], hf[n - i]) for n in range(i, j)]


Tensors = list[tuple[mapping.Entry, str, int]]  # (entry, HF key, parts it is written from)


def _leaf_jobs(source: MaxTextSource, leaf: Leaf, chunk_bytes: int) -> tuple[list[Job], Tensors]:
    """The jobs that make ``leaf``'s HF tensors, and (entry, HF key, parts) in the order they come."""
    lay = _unscanned(leaf, source.spec.maxtext)
    transforms = transforms_of(source.spec.maxtext, leaf.entries[0].rule.name)
    itemsize = source.dtype(leaf).itemsize
    scanned = _scanned(leaf)
    stored = source.ckpt.chunks(source.path(leaf))
    groups = _layer_groups(source, leaf) if scanned else [(0, 1)]
    jobs: list[Job] = []
    tensors: Tensors = []
    for i, j in groups:
        e = _as(leaf.entries[i], lay)
        nbytes = math.prod(e.tunix_shape) * itemsize
        blocks = _blocks(e, nbytes, chunk_bytes, transforms) if j - i == 1 and stored is not None else None
        ranges = None
        if blocks is not None and stored is not None:
            chunk = stored[blocks.tunix_dim + (1 if scanned and blocks.tunix_dim >= maxtext_layout.SCAN_AXIS else 0)]
            align = chunk // math.gcd(chunk, blocks.tunix_step)
            ranges = blocks.ranges(_per_block(blocks, nbytes, chunk_bytes), align)
        if blocks is None or ranges is None or len(ranges) < 2:
            make = (functools.partial(_group_parts, source, leaf, lay, transforms, i, j) if scanned else
                    (lambda e=e: _to_hf_parts(e, _read(source, leaf, None), transforms)))
            jobs.append((HELD_PER_BYTE * nbytes * (j - i), make))
            tensors += [(leaf.entries[p], key, 1) for p in range(i, j) for key in leaf.entries[p].hf_keys]
            continue
        for a, b in ranges:
            jobs.append((HELD_PER_BYTE * nbytes * (b - a) // blocks.count,
                         functools.partial(_box_parts, source, leaf, i if scanned else None, blocks, transforms, a, b)))
        tensors += ([(leaf.entries[i], e.hf_keys[0], len(ranges))] if not blocks.keyed
                    else [(leaf.entries[i], key, 1) for key in e.hf_keys])
    return jobs, tensors


def convert_maxtext_to_safetensors(src: str, dst: str, *, config: str | None = None, step: int | None = None,
                                   max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE, overwrite: bool = False,
                                   chunk_size: str | int = DEFAULT_CHUNK_SIZE, workers: int | None = None,
                                   memory_budget: str | int | None = None,
                                   progress: bool | None = None) -> FromMaxTextReport:
    """MaxText checkpoint (a CheckpointManager root, a step, or its ``items`` / ``model_params``
    item; scanned or not) -> HF model directory, the values as MaxText's ``to_huggingface`` with
    ``weight_dtype`` set to the stored dtype makes them (its transforms undone in float32, cast
    back). Streaming: one layer of a scanned tensor at a time where it is stored so (else the
    layers of one stored chunk), row blocks of about ``chunk_size`` of larger ones, read and
    rearranged on ``workers`` threads within ``memory_budget``."""
    t0 = time.perf_counter()
    chunk_bytes = options.size("chunk_size", chunk_size)
    shard_bytes = options.size("max_shard_size", max_shard_size)
    parallel = Parallelism.of(workers, memory_budget, least=chunk_bytes, least_what="chunk_size (--chunk-size)",
                              default_cap=CODEC_VERB_WORKERS)
    check_destination(dst, [src] + ([config] if config else []), overwrite)
    with open_maxtext_source(src, config=config, step=step) as source, parallel.engine("m2s") as engine:
        specs.note_mismatch(source.cfg)
        jobs: list[Job] = []
        tensors: list[tuple[mapping.Entry, str, int, np.dtype]] = []
        for leaf in source.leaves:
            leaf_jobs, leaf_tensors = _leaf_jobs(source, leaf, chunk_bytes)
            jobs += leaf_jobs
            tensors += [(e, key, n, source.dtype(leaf)) for e, key, n in leaf_tensors]
        parts: Parts = Parts(engine.stream(jobs))
        planned = [PlannedTensor(key, dtype, e.hf_shape, functools.partial(parts.take, key)) if n == 1 else
                   PlannedTensor(key, dtype, e.hf_shape, chunks=functools.partial(parts.take_many, key, n))
                   for e, key, n, dtype in tensors]
        root = source.ckpt.path
        for up in (root, storage.dirname(root), storage.dirname(storage.dirname(root))):
            stored_assets = storage.join(up, ASSETS_DIR)
            if storage.isdir(stored_assets):
                break
        files = write_model_directory(
            dst, planned, source.cfg.hf_config, shard_bytes,
            assets_from=stored_assets if storage.isdir(stored_assets) else source.config_dir,
            overwrite=overwrite, desc="maxtext -> safetensors", progress=progress)
        return FromMaxTextReport(
            direction="maxtext-to-safetensors", source=src, destination=dst, family=source.spec.name,
            key_prefix=source.prefix, layer_kinds=source.cfg.layer_kinds(), tensors=len(planned),
            bytes=sum(t.nbytes for t in planned), scan_layers=source.scan_layers, files=files,
            seconds=round(time.perf_counter() - t0, 3))


__all__ = ["convert_maxtext_to_safetensors", "convert_safetensors_to_maxtext", "open_maxtext_source", "supported"]
