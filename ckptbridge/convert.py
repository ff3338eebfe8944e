"""Conversions between HF safetensors and Tunix/Orbax, one function per direction.

Both directions validate the whole source against the spec table before writing a byte,
stream tensor by tensor (peak memory about one tensor), write into a temporary sibling of the
destination and rename it into place at the end.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Iterator

import numpy as np

from ckptbridge import mapping
from ckptbridge.config import ModelConfig, parse_config, read_config_file
from ckptbridge.errors import ConfigError, MismatchError, UnsupportedError
from ckptbridge.io import orbax as orbax_io
from ckptbridge.io.atomic import atomic_directory, check_destination
from ckptbridge.io.hf import HFModelDir, copy_assets, write_model_directory
from ckptbridge.io.safetensors import PlannedTensor, numpy_dtype, parse_size
from ckptbridge.progress import Progress
from ckptbridge.specs import FamilySpec, get_family

log = logging.getLogger(__name__)
ASSETS_DIR = "hf_assets"
DEFAULT_MAX_SHARD_SIZE = "5GB"


def _layer_note(entry: mapping.Entry) -> str:
    if entry.layer is None:
        return ""
    s = entry.sizes
    return f" (layer {entry.layer.index} is {entry.layer.kind}: head_dim {s['h']}, {s['k']} kv heads)"


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

    def arrays(self, entry: mapping.Entry) -> list[np.ndarray]:
        return [self.model.array(k) for k in entry.hf_keys]

    def tunix_value(self, entry: mapping.Entry) -> np.ndarray:
        return mapping.hf_to_tunix(entry, self.arrays(entry))

    def dtype(self, entry: mapping.Entry) -> np.dtype:
        return numpy_dtype(self.model.info(entry.hf_keys[0]).dtype)

    def close(self) -> None:
        self.model.close()

    def __enter__(self) -> "HFSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_hf_source(src: str, *, skip_multimodal: bool = False) -> HFSource:
    """Open and fully validate an HF model directory (keys, shapes, dtypes) without reading weights."""
    model = HFModelDir(src)
    try:
        return _validate_hf(model, skip_multimodal)
    except BaseException:
        model.close()
        raise


def _validate_hf(model: HFModelDir, skip_multimodal: bool) -> HFSource:
    where = os.path.join(model.path, "config.json")
    cfg = parse_config(model.config, where)
    spec = get_family(cfg.family)
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
    prefix = next((p for p in spec.key_prefixes if p + spec.rules[0].hf[0] in text_keys), None)
    if prefix is None:
        raise MismatchError(
            f"{model.path}: no {spec.rules[0].hf[0]} under any of the prefixes "
            f"{', '.join(spec.key_prefixes)}; not a {spec.name} text model checkpoint"
        )
    ents = mapping.entries(cfg, spec, prefix)
    expected = {k: e for e in ents for k in e.hf_keys}
    tied = [k for k in text_keys if k in spec.tied_keys]
    if tied and not cfg.tie_word_embeddings:
        raise UnsupportedError(
            f"{model.file_of(tied[0]).path}: {tied[0]} is untied from the embedding "
            "(tie_word_embeddings false); Tunix ties the output head to the embedding"
        )
    unknown = sorted(text_keys - set(expected) - set(tied))
    if unknown:
        raise MismatchError(
            f"{model.file_of(unknown[0]).path}: unexpected tensor {unknown[0]!r}"
            f"{f' (and {len(unknown) - 1} more)' if len(unknown) > 1 else ''}: not part of the "
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
        if len(dts) > 1:
            raise MismatchError(
                f"{model.path}: {' and '.join(entry.hf_keys)} have different dtypes {sorted(dts)}; "
                "they are fused into one Tunix parameter and must match"
            )
    return HFSource(model, cfg, spec, prefix, ents, tower_keys, tied)


def _metadata(source: HFSource, kind: str, assets: list[str]) -> dict:
    return {
        orbax_io.METADATA_KEY: orbax_io.metadata_json({
            "format_version": orbax_io.FORMAT_VERSION,
            "kind": kind,
            "family": source.spec.name,
            "hf_config": source.model.config,
            "key_prefix": source.prefix,
            "config_dialect": source.cfg.dialect,
            "towers_dropped": len(source.tower_keys),
            "assets": assets,
            "source": os.path.abspath(source.model.path),
        })
    }


def convert_safetensors_to_orbax(src: str, dst: str, *, overwrite: bool = False,
                                 skip_multimodal: bool = False, progress: bool | None = None) -> dict:
    """HF model directory -> Orbax checkpoint of the Tunix nnx state (nested dict, source dtypes).

    Returns a report dict (tensors, bytes, seconds, key prefix, layer kinds).
    """
    t0 = time.perf_counter()
    check_destination(dst, [src], overwrite)
    with open_hf_source(src, skip_multimodal=skip_multimodal) as source:
        flat = {
            e.tunix_path: orbax_io.LazyArray(e.tunix_shape, source.dtype(e), produce=lambda e=e: source.tunix_value(e))
            for e in source.entries
        }
        total = sum(leaf.nbytes for leaf in flat.values())
        bar = Progress(total, "safetensors -> orbax", enabled=progress)
        for leaf in flat.values():
            leaf.on_written = lambda n=leaf.nbytes: bar.update(n)
        assets = source.model.asset_files()
        with atomic_directory(dst, overwrite) as tmp:
            orbax_io.save_tree(tmp, orbax_io.nest(flat), _metadata(source, "weights", assets))
            if assets:
                copy_assets(assets, source.model.path, os.path.join(tmp, ASSETS_DIR))
        bar.close()
        return {
            "direction": "safetensors-to-orbax",
            "source": src,
            "destination": dst,
            "family": source.spec.name,
            "key_prefix": source.prefix,
            "layer_kinds": source.cfg.layer_kinds(),
            "tensors": len(flat),
            "bytes": total,
            "towers_dropped": len(source.tower_keys),
            "seconds": round(time.perf_counter() - t0, 3),
        }


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
    _pending: tuple | None = None  # (entry, started read) of the leaf read ahead
    _next: dict | None = None

    def path_of(self, entry: mapping.Entry) -> tuple[str, ...]:
        return entry.tunix_path + self.suffix

    def dtype(self, entry: mapping.Entry) -> np.dtype:
        return self.ckpt.leaves[self.path_of(entry)][1]

    def tunix_value(self, entry: mapping.Entry) -> np.ndarray:
        """The leaf of ``entry``; the next entry's leaf is then read in the background (direct
        reader), so reading and decoding overlap the conversion and writing of this one."""
        p = self.path_of(entry)
        pending, self._pending = self._pending, None
        got = pending[1]() if pending is not None and pending[0] is entry else self.ckpt.read([p])
        following = self._following().get(id(entry))
        if following is not None:
            self._pending = (following, self.ckpt.start_read([self.path_of(following)]))
        return got[p]

    def _following(self) -> dict[int, mapping.Entry]:
        if self._next is None:
            self._next = {id(a): b for a, b in zip(self.entries, self.entries[1:])}
        return self._next

    def tunix_values(self) -> Iterator[tuple[mapping.Entry, np.ndarray]]:
        for e in self.entries:
            yield e, self.tunix_value(e)

    def close(self) -> None:
        self._pending = None
        self.ckpt.close()

    def __enter__(self) -> "OrbaxSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _config_from_option(config: str) -> tuple[dict, str, str]:
    path = os.path.join(config, "config.json") if os.path.isdir(config) else config
    return read_config_file(path), path, os.path.dirname(os.path.abspath(path))


def open_orbax_source(src: str, *, config: str | None = None, step: int | None = None) -> OrbaxSource:
    """Open an Orbax weights checkpoint and validate its tree against the spec (no leaf is read)."""
    path = orbax_io.resolve_checkpoint(src, step)
    ckpt = orbax_io.OrbaxCheckpoint(path)
    try:
        return _validate_orbax(ckpt, config)
    except BaseException:
        ckpt.close()
        raise


def _validate_orbax(ckpt: orbax_io.OrbaxCheckpoint, config: str | None) -> OrbaxSource:
    meta = ckpt.ckptbridge_metadata
    path = ckpt.path
    from ckptbridge.lora import is_lora_leaf

    if meta.get("kind") == "lora" or any(is_lora_leaf(p) for p in ckpt.leaves):
        raise UnsupportedError(f"{path}: is a LoRA checkpoint, not full weights; use `ckptbridge convert orbax-to-peft`")
    config_dir = None
    if config is not None:
        hf_config, where, config_dir = _config_from_option(config)
        prefix = None
    elif isinstance(meta.get("hf_config"), dict):
        hf_config, where = meta["hf_config"], f"{path} (ckptbridge metadata)"
        prefix = meta.get("key_prefix")
    else:
        raise ConfigError(
            f"{path}: carries no ckptbridge metadata with the HF config; pass --config with the base "
            "model's config.json (or its directory)"
        )
    cfg = parse_config(hf_config, where)
    spec = get_family(cfg.family)
    if meta.get("family") not in (None, spec.name):
        raise MismatchError(f"{path}: metadata says family {meta['family']!r} but the config is {spec.name!r}")
    prefix = prefix if prefix in spec.key_prefixes else cfg.default_key_prefix
    ents = mapping.entries(cfg, spec, prefix)
    leaves = ckpt.leaves
    suffix = ckpt.value_suffix
    expected = {e.tunix_path + suffix: e for e in ents}
    missing = [p for p in expected if p not in leaves]
    if missing:
        e = expected[missing[0]]
        raise MismatchError(
            f"{path}: leaf {'/'.join(missing[0])} is missing{_layer_note(e)}"
            f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; the checkpoint does not "
            "match the config (wrong --config, or an incomplete checkpoint)"
        )
    extra = sorted(p for p in leaves if p not in expected)
    if extra:
        raise MismatchError(
            f"{path}: unexpected leaf {'/'.join(extra[0])}"
            f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}: not part of the {spec.name} "
            "text model that the config describes"
        )
    for p, e in expected.items():
        if leaves[p][0] != e.tunix_shape:
            raise MismatchError(
                f"{path}: leaf {'/'.join(p)} has shape {leaves[p][0]}, the config implies "
                f"{e.tunix_shape}{_layer_note(e)}; the checkpoint and the config disagree"
            )
    return OrbaxSource(ckpt, cfg, spec, prefix, ents, suffix, config_dir)


def convert_orbax_to_safetensors(src: str, dst: str, *, config: str | None = None,
                                 max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
                                 step: int | None = None, overwrite: bool = False,
                                 progress: bool | None = None) -> dict:
    """Orbax weights checkpoint -> HF model directory (sharded safetensors + index, config.json,
    and the non-weight files stored with the checkpoint or next to ``config``)."""
    t0 = time.perf_counter()
    try:
        shard_bytes = parse_size(max_shard_size)
    except ValueError as e:
        raise ConfigError(f"--max-shard-size: {e}") from None
    check_destination(dst, [src] + ([config] if config else []), overwrite)
    with open_orbax_source(src, config=config, step=step) as source:
        cache: dict = {}

        def produce(entry: mapping.Entry, i: int) -> np.ndarray:
            if cache.get("entry") is not entry:
                cache.clear()
                cache["entry"], cache["values"] = entry, mapping.tunix_to_hf(entry, source.tunix_value(entry))
            return cache["values"][i]

        planned = [
            PlannedTensor(key, source.dtype(e), e.hf_shape, lambda e=e, i=i: produce(e, i))
            for e in source.entries
            for i, key in enumerate(e.hf_keys)
        ]
        stored_assets = os.path.join(source.ckpt.path, ASSETS_DIR)
        files = write_model_directory(
            dst, planned, source.cfg.hf_config, shard_bytes,
            assets_from=stored_assets if os.path.isdir(stored_assets) else source.config_dir,
            overwrite=overwrite, desc="orbax -> safetensors", progress=progress,
        )
        return {
            "direction": "orbax-to-safetensors",
            "source": src,
            "destination": dst,
            "family": source.spec.name,
            "key_prefix": source.prefix,
            "layer_kinds": source.cfg.layer_kinds(),
            "tensors": len(planned),
            "bytes": sum(t.nbytes for t in planned),
            "files": files,
            "seconds": round(time.perf_counter() - t0, 3),
        }
