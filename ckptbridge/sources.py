"""Opening what ckptbridge reads, validated against the family spec before any weight is read.

* :func:`open_hf_source`: an HF model directory (keys, shapes, dtypes against the config).
* :func:`open_orbax_source`: an Orbax checkpoint of Tunix weights (its tree against the config).
* :func:`open_base`: the HF base model an adapter belongs to (config and key names only).

The family comes from the config's model type; the key prefix from the files (any of the
family's prefixes is read; the one found is recorded and written back).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator
from typing import Protocol

import numpy as np

from ckptbridge import mapping
from ckptbridge.config import ModelConfig, read_config_file
from ckptbridge.errors import ConfigError, MismatchError, UnsupportedError
from ckptbridge.io import orbax as orbax_io
from ckptbridge.io.files import close_on_error
from ckptbridge.io.hf import HFModelDir
from ckptbridge.io.safetensors import numpy_dtype
from ckptbridge.metadata import Metadata
from ckptbridge.qwix_lora import is_lora_leaf
from ckptbridge.specs import FamilySpec, family_for

ASSETS_DIR = "hf_assets"


def _layer_note(entry: mapping.Entry) -> str:
    if entry.layer is None:
        return ""
    return (f" (layer {entry.layer.index} is {entry.layer.kind}: head_dim {entry.layer.head_dim}, "
            f"{entry.layer.num_kv_heads} kv heads)")


def more(items: list, what: str = "") -> str:
    """`` (and N more)`` after the first of ``items``, or nothing."""
    return f" (and {len(items) - 1} more{what})" if len(items) > 1 else ""


def is_hf_directory(path: str) -> bool:
    """An HF model directory (config.json, no Orbax ``_METADATA``) rather than an Orbax checkpoint
    (which is what a ``gs://`` path is)."""
    if orbax_io.storage.is_remote(path):
        return False
    return os.path.isfile(os.path.join(path, "config.json")) and not os.path.isfile(os.path.join(path, "_METADATA"))


class RowSource(Protocol):
    """What the writers of a layout need of a source: each row's values in any of its layouts
    (``entry`` with a ``tunix_variant``, or a MaxText layout), whole or in row blocks
    (:class:`ckptbridge.mapping.Blocks`), and the dtype they are written in."""

    def dtype(self, entry: mapping.Entry) -> np.dtype: ...

    def tunix_value(self, entry: mapping.Entry) -> np.ndarray: ...

    def tunix_block(self, blocks: mapping.Blocks, i: int, j: int) -> np.ndarray: ...


class HFRows:
    """:class:`RowSource` over a source that gives each row's HF tensors (``arrays``) and, where it
    can, runs of their rows (``hf_rows``: the HF stacked layout's indices ``i:j``, or None to have
    them cut from the whole)."""

    def arrays(self, entry: mapping.Entry) -> list[np.ndarray]:
        raise NotImplementedError

    def hf_rows(self, blocks: mapping.Blocks, i: int, j: int) -> np.ndarray | None:
        return None

    def dtype(self, entry: mapping.Entry) -> np.dtype:
        raise NotImplementedError

    def tunix_value(self, entry: mapping.Entry) -> np.ndarray:
        if not entry.hf_keys:  # a parameter Tunix keeps unused where HF has none (``hf_absent``)
            return np.zeros(entry.tunix_shape, self.dtype(entry))
        return mapping.hf_to_tunix(entry, self.arrays(entry))

    def tunix_block(self, blocks: mapping.Blocks, i: int, j: int) -> np.ndarray:
        hf = self.hf_rows(blocks, i, j)
        if hf is None:
            arrays = self.arrays(blocks.entry)
            whole = np.stack(arrays) if blocks.entry.rule.stack_axis else arrays[0]
            hf = whole[i:j] if blocks.keyed else whole[i * blocks.hf_rows:j * blocks.hf_rows]
        return blocks.to_tunix(hf, i, j)


class HFRowsOfTunix(HFRows):
    """The HF tensors of an Orbax (Tunix) checkpoint's rows, for writing them in another layout:
    ``arrays`` and ``hf_rows`` of any entry of the same row and layer."""

    def __init__(self, source: OrbaxSource):
        self.source = source
        self._stored = {(e.rule.name, e.layer.index if e.layer else None): e for e in source.entries}

    def _orig(self, entry: mapping.Entry) -> mapping.Entry:
        return self._stored[(entry.rule.name, entry.layer.index if entry.layer else None)]

    def dtype(self, entry: mapping.Entry) -> np.dtype:
        return self.source.dtype(self._orig(entry))

    def arrays(self, entry: mapping.Entry) -> list[np.ndarray]:
        e = self._orig(entry)
        return mapping.tunix_to_hf(e, self.source.tunix_value(e))

    def hf_rows(self, blocks: mapping.Blocks, i: int, j: int) -> np.ndarray | None:
        stored = mapping.blocks(self._orig(blocks.entry))
        if stored is None or stored.axis != blocks.axis or self.source.ckpt.chunks(
                self.source.path_of(stored.entry)) is None:
            return None
        return stored.to_hf(self.source.tunix_box(stored, i, j), i, j)


@dataclasses.dataclass
class HFSource:
    """An HF model directory checked against its family spec."""

    model: HFModelDir
    cfg: ModelConfig
    spec: FamilySpec
    prefix: str
    entries: list[mapping.Entry]
    tower_keys: list[str]
    tied_keys: list[str]
    quantization: str | None = None  # a quantized model's format (compressed-tensors), see quantize.describe

    def arrays(self, entry: mapping.Entry, *, mapped: bool = False) -> list[np.ndarray]:
        read = self.model.mapped if mapped else self.model.array
        return [read(k) for k in entry.hf_keys]

    def tunix_value(self, entry: mapping.Entry, *, mapped: bool = False) -> np.ndarray:
        """The Tunix parameter of ``entry`` (safe to call from several threads). With ``mapped``
        the HF tensors are read over their files mapped into memory: where no rearrangement is
        needed the value is a read-only view of the file, copied only by whoever uses it."""
        if not entry.hf_keys:  # a parameter Tunix keeps unused where HF has none (``hf_absent``)
            return np.zeros(entry.tunix_shape, self.dtype(entry))
        if entry.rule.stack is not None:  # one expert at a time
            read = self.model.mapped if mapped else self.model.array
            return mapping.stack_to_tunix(entry, (read(k) for k in entry.hf_keys))
        return mapping.hf_to_tunix(entry, self.arrays(entry, mapped=mapped))

    def dtype(self, entry: mapping.Entry) -> np.dtype:
        keys = entry.hf_keys or next(e.hf_keys for e in self.entries if e.hf_keys)
        return numpy_dtype(self.model.info(keys[0]).dtype)

    def hf_block(self, blocks: mapping.Blocks, i: int, j: int) -> np.ndarray:
        """Indices ``i:j`` of the leading axis of ``blocks.entry``, in its HF stacked layout, read
        from disk (rows of its one tensor, or its tensors ``i:j``)."""
        keys = blocks.entry.hf_keys
        if not blocks.keyed:
            return self.model.file_of(keys[0]).rows(keys[0], i * blocks.hf_rows, j * blocks.hf_rows)
        out = np.empty((j - i, *blocks.entry.hf_shape), self.dtype(blocks.entry))
        for n, key in enumerate(keys[i:j]):
            out[n] = self.model.array(key)
        return out

    def tunix_block(self, blocks: mapping.Blocks, i: int, j: int) -> np.ndarray:
        """The box of the Tunix parameter that indices ``i:j`` of ``blocks.axis`` fill (read and
        rearranged; safe to call from several threads)."""
        return blocks.to_tunix(self.hf_block(blocks, i, j), i, j)

    def close(self) -> None:
        self.model.close()

    def __enter__(self) -> HFSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_hf_source(src: str, *, skip_multimodal: bool = False, quantized_ok: bool = False) -> HFSource:
    """Open and fully validate an HF model directory (keys, shapes, dtypes) without reading weights.
    A quantized model (compressed-tensors: its weights' scales beside them) is refused unless
    ``quantized_ok`` (for what needs its names and shapes only)."""
    from ckptbridge import quantize  # (imports ml_dtypes: only when opening a model)

    with close_on_error(HFModelDir(src)) as model:
        if not quantized_ok:  # before validating: other formats store tensors the family table does not name
            why = quantize.already_quantized(model.config, {k: model.info(k).dtype for k in model.keys()})
            if why:
                raise UnsupportedError(f"{src}: a quantized model ({why}); ckptbridge converts unquantized "
                                       "checkpoints: use the model it was quantized from")
        return _validate_hf(model, skip_multimodal)


def find_prefix(spec: FamilySpec, keys) -> str | None:
    """The family key prefix most of ``keys`` use (None when they use none of them)."""
    model_keys = [s for r in spec.rules if r.scope == "model" and not r.absolute for s in r.hf]
    counts = {p: sum(1 for k in keys if k.startswith(p + "layers.") or k[len(p):] in model_keys and k.startswith(p))
              for p in spec.key_prefixes}
    best = max(counts, key=lambda p: counts[p])
    return best if counts[best] else None


def _validate_hf(model: HFModelDir, skip_multimodal: bool) -> HFSource:
    where = os.path.join(model.path, "config.json")
    spec = family_for(model.config, where)
    cfg = spec.parse_config(model.config, where)
    keys = model.keys()
    tower_keys = [k for k in keys if k.startswith(spec.foreign_prefixes)]
    if (tower_keys or cfg.towers) and not skip_multimodal:
        what = ", ".join(cfg.towers) or "multimodal"
        raise UnsupportedError(
            f"{model.path}: has {what} towers ({len(tower_keys)} tensors, e.g. "
            f"{tower_keys[0] if tower_keys else 'in config.json'}); ckptbridge converts the text model only: "
            "pass --skip-multimodal (skip_multimodal=True) to convert it and drop the towers"
        )
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
    from ckptbridge.quantize import describe

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
                f"{model.path}: tensor {key!r} is missing{_layer_note(entry)}; the checkpoint is incomplete "
                "or config.json belongs to another model"
            )
        info = model.info(key)
        if info.shape != entry.hf_shape:
            raise MismatchError(
                f"{model.file_of(key).path}: tensor {key!r} has shape {info.shape}, config.json implies "
                f"{entry.hf_shape}{_layer_note(entry)}; the weights and config.json disagree"
            )
    for entry in ents:
        dts = {model.info(k).dtype for k in entry.hf_keys}
        if len(dts) > 1:  # (none for hf_absent rows)
            raise MismatchError(
                f"{model.path}: {' and '.join(entry.hf_keys)} have different dtypes {sorted(dts)}; "
                "they are fused into one Tunix parameter and must match"
            )
    return HFSource(model, cfg, spec, prefix, ents, tower_keys, tied, quantization)


@dataclasses.dataclass
class OrbaxSource:
    """An Orbax weights checkpoint checked against its family spec."""

    ckpt: orbax_io.OrbaxCheckpoint
    cfg: ModelConfig
    spec: FamilySpec
    prefix: str
    entries: list[mapping.Entry]
    suffix: tuple[str, ...]  # ("value",) for trees saved from an nnx state with value levels
    config_dir: str | None  # where non-weight files come from when not stored in the checkpoint

    def path_of(self, entry: mapping.Entry) -> tuple[str, ...]:
        return entry.tunix_path + self.suffix

    def dtype(self, entry: mapping.Entry) -> np.dtype:
        return self.ckpt.leaves[self.path_of(entry)][1]

    def tunix_value(self, entry: mapping.Entry, *, mapped: bool = False) -> np.ndarray:
        """The leaf of ``entry`` (safe to call from several threads; ``mapped`` is for the
        interface: TensorStore reads the chunks)."""
        p = self.path_of(entry)
        return self.ckpt.read([p])[p]

    def nbytes(self, entry: mapping.Entry) -> int:
        shape, dtype = self.ckpt.leaves[self.path_of(entry)]
        return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize

    def block_ranges(self, blocks: mapping.Blocks, max_bytes: int) -> list[tuple[int, int]] | None:
        """Ranges of ``blocks.axis`` to read ``blocks.entry`` in, each whole stored chunks along the
        Tunix dimension it cuts and at most ``max_bytes`` where the chunks allow; None when the
        leaf can only be read whole."""
        chunks = self.ckpt.chunks(self.path_of(blocks.entry))
        if chunks is None:
            return None
        chunk = chunks[blocks.tunix_dim]
        align = chunk // math.gcd(chunk, blocks.tunix_step)  # indices per whole number of chunks
        per = max(1, max_bytes // max(1, self.nbytes(blocks.entry) // blocks.count))
        return blocks.ranges(per, align)

    def tunix_box(self, blocks: mapping.Blocks, i: int, j: int) -> np.ndarray:
        """The box of the leaf of ``blocks.entry`` that indices ``i:j`` of ``blocks.axis`` fill
        (a range of :meth:`block_ranges`; safe to call from several threads)."""
        p = self.path_of(blocks.entry)
        return self.ckpt.start_read([p], blocks.tunix_region(i, j))()[p]

    def tunix_values(self) -> Iterator[tuple[mapping.Entry, np.ndarray]]:
        for e in self.entries:
            yield e, self.tunix_value(e)

    def close(self) -> None:
        self.ckpt.close()

    def __enter__(self) -> OrbaxSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _config_from_option(config: str) -> tuple[dict, str, str]:
    path = os.path.join(config, "config.json") if os.path.isdir(config) else config
    return read_config_file(path), path, os.path.dirname(os.path.abspath(path))


def open_orbax_source(src: str, *, config: str | None = None, step: int | None = None) -> OrbaxSource:
    """Open an Orbax weights checkpoint and validate its tree against the spec (no leaf is read)."""
    path = orbax_io.resolve_checkpoint(src, step)
    with close_on_error(orbax_io.OrbaxCheckpoint(path)) as ckpt:
        return _validate_orbax(ckpt, config)


def _validate_orbax(ckpt: orbax_io.OrbaxCheckpoint, config: str | None) -> OrbaxSource:
    meta: Metadata = ckpt.metadata
    path = ckpt.path
    if meta.kind == "lora" or any(is_lora_leaf(p) for p in ckpt.leaves):
        raise UnsupportedError(f"{path}: is a LoRA checkpoint, not full weights; use "
                               "`ckptbridge convert orbax-to-peft`")
    config_dir = None
    if config is not None:
        hf_config, where, config_dir = _config_from_option(config)
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
    ents = [_stored_layout(e, leaves.get(e.tunix_path + suffix)) for e in ents]
    expected = {e.tunix_path + suffix: e for e in ents}
    if any(p[:3] == ("params", "params", "decoder") for p in leaves):  # MaxText's Linen tree (ckptbridge.maxtext)
        raise MismatchError(f"{path}: is a MaxText checkpoint, not Tunix; use `ckptbridge convert "
                            "maxtext-to-safetensors`")
    missing = [p for p in expected if p not in leaves]
    if missing:
        e = expected[missing[0]]
        raise MismatchError(
            f"{path}: leaf {'/'.join(missing[0])} is missing{_layer_note(e)}{more(missing)}; the checkpoint does not "
            "match the config (wrong config (--config), or an incomplete checkpoint)"
        )
    extra = sorted(p for p in leaves if p not in expected)
    if extra:
        raise MismatchError(
            f"{path}: unexpected leaf {'/'.join(extra[0])}{more(extra)}: not part of the {spec.name} "
            "text model that the config describes"
        )
    for p, e in expected.items():
        if leaves[p][0] != e.tunix_shape:
            raise MismatchError(
                f"{path}: leaf {'/'.join(p)} has shape {leaves[p][0]}, the config implies "
                f"{e.tunix_shape}{_layer_note(e)}; the checkpoint and the config disagree"
            )
    return OrbaxSource(ckpt, cfg, spec, prefix, ents, suffix, config_dir)


def _stored_layout(entry: mapping.Entry, leaf) -> mapping.Entry:
    """``entry`` in the Tunix layout its stored leaf has (unchanged when none fits: the shape check says so)."""
    lay = mapping.layout_with_shape(entry, leaf[0]) if leaf is not None else None
    return mapping.with_tunix_layout(entry, lay) if lay is not None else entry


def open_model_source(src: str, *, step: int | None = None, skip_multimodal: bool = False):
    """An HF model directory or a ckptbridge Orbax weights checkpoint, whichever ``src`` is."""
    if is_hf_directory(src):
        return open_hf_source(src, skip_multimodal=skip_multimodal)
    return open_orbax_source(src, step=step)


__all__ = ["ASSETS_DIR", "HFRows", "HFRowsOfTunix", "HFSource", "OrbaxSource", "RowSource", "find_prefix",
           "is_hf_directory",
           "open_hf_source", "open_model_source", "open_orbax_source"]
