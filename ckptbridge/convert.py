"""Conversions between HF safetensors and Tunix/Orbax, one function per direction.

Both directions validate the whole source against the spec table before writing a byte,
stream tensor by tensor (peak memory about one tensor), write into a temporary sibling of the
destination and rename it into place at the end.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from ckptbridge import hub, mapping
from ckptbridge.errors import ConfigError
from ckptbridge.io import orbax as orbax_io
from ckptbridge.io import storage
from ckptbridge.io.atomic import atomic_directory, check_destination
from ckptbridge.io.hf import DEFAULT_MAX_SHARD_SIZE, copy_assets, write_model_directory
from ckptbridge.io.safetensors import PlannedTensor, parse_size
from ckptbridge.metadata import KEY, Metadata, installed_tunix_version
from ckptbridge.progress import Progress
from ckptbridge.specs.base import tunix_version_key
from ckptbridge.sources import ASSETS_DIR, HFSource, open_hf_source, open_orbax_source
from ckptbridge.tunix_model import note_mismatch

log = logging.getLogger(__name__)
__all__ = ["convert_orbax_to_safetensors", "convert_safetensors_to_orbax", "open_hf_source", "open_orbax_source"]


def _metadata(source: HFSource, kind: str, assets: list[str], tunix_version: str | None) -> dict:
    return {KEY: Metadata(
        kind=kind, family=source.spec.name, hf_config=source.model.config, key_prefix=source.prefix,
        config_dialect=source.cfg.extras.get("dialect"), towers_dropped=len(source.tower_keys), assets=assets,
        source=os.path.abspath(source.model.path), tunix_version=tunix_version,
    ).to_json()}


def convert_safetensors_to_orbax(src: str, dst: str, *, overwrite: bool = False,
                                 skip_multimodal: bool = False, tunix_version: str | None = None,
                                 progress: bool | None = None) -> dict:
    """HF model directory -> Orbax checkpoint of the Tunix nnx state (nested dict, source dtypes).

    The tree has the layouts of Tunix ``tunix_version`` (default: the installed google-tunix;
    without one, the layouts of the version the specs were written against), recorded in the
    checkpoint's metadata. Returns a report dict (tensors, bytes, seconds, key prefix, layer kinds).
    """
    t0 = time.perf_counter()
    if tunix_version is not None:
        try:
            tunix_version_key(tunix_version)
        except ValueError as e:
            raise ConfigError(f"--tunix-version: {e}") from None
    target = tunix_version or installed_tunix_version()
    src = hub.local(src, hub.MODEL)
    check_destination(dst, [src], overwrite)
    with open_hf_source(src, skip_multimodal=skip_multimodal) as source:
        mismatch = note_mismatch(source.cfg)
        flat = {
            e.tunix_path: orbax_io.LazyArray(e.tunix_shape, source.dtype(e), produce=lambda e=e: source.tunix_value(e))
            for e in mapping.for_tunix_version(source.entries, target)
        }
        total = sum(leaf.nbytes for leaf in flat.values())
        bar = Progress(total, "safetensors -> orbax", enabled=progress)
        for leaf in flat.values():
            leaf.on_written = lambda n=leaf.nbytes: bar.update(n)
        assets = source.model.asset_files()
        with atomic_directory(dst, overwrite) as tmp:
            orbax_io.save_tree(tmp, orbax_io.nest(flat), _metadata(source, "weights", assets, target))
            if assets:
                copy_assets(assets, source.model.path, storage.join(tmp, ASSETS_DIR))
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
            "tunix_version": target,
            "config_mismatch": mismatch,
            "seconds": round(time.perf_counter() - t0, 3),
        }


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
        mismatch = note_mismatch(source.cfg)
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
        stored_assets = storage.join(source.ckpt.path, ASSETS_DIR)
        files = write_model_directory(
            dst, planned, source.cfg.hf_config, shard_bytes,
            assets_from=stored_assets if storage.isdir(stored_assets) else source.config_dir,
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
            "config_mismatch": mismatch,
            "seconds": round(time.perf_counter() - t0, 3),
        }
