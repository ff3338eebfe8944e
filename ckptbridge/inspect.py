"""``ckptbridge inspect``: say what a path is and summarise it."""

from __future__ import annotations

import json
import os
from collections import Counter

import numpy as np

from ckptbridge.errors import CorruptFileError, InputNotFoundError
from ckptbridge.qwix_lora import is_lora_a, is_lora_leaf
from ckptbridge.sources import is_hf_directory
from ckptbridge.specs import get_family, parse_config


def _count(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _inspect_hf(path: str) -> dict:
    from ckptbridge.io.hf import HFModelDir
    from ckptbridge.sources import open_hf_source

    with HFModelDir(path) as model:
        cfg = parse_config(model.config, os.path.join(path, "config.json"))
        dtypes = Counter(model.info(k).dtype for k in model.keys())
        params = sum(_count(model.info(k).shape) for k in model.keys())
        nbytes = sum(model.info(k).nbytes for k in model.keys())
        files = sorted(model.files)
    out = {
        "kind": "hf-model",
        "path": path,
        "family": cfg.family,
        "model_type": cfg.model_type,
        "config_dialect": cfg.extras.get("dialect"),
        "layers": cfg.num_layers,
        "layer_kinds": cfg.layer_kinds(),
        "dtypes": dict(dtypes),
        "parameters": params,
        "bytes": nbytes,
        "files": files,
        "towers": list(cfg.towers),
        "tunix_mismatch": get_family(cfg.family).config_mismatches(cfg),  # what the family's Tunix model computes otherwise
    }
    try:
        with open_hf_source(path, skip_multimodal=True) as source:
            out["key_prefix"] = source.prefix
            out["valid"] = True
    except Exception as e:  # report, do not fail: inspect is for looking at broken things too
        out["valid"] = False
        out["problem"] = str(e)
    return out


def _inspect_orbax(path: str, step: int | None) -> dict:
    from ckptbridge.io.orbax import OrbaxCheckpoint, resolve_checkpoint

    item = resolve_checkpoint(path, step)
    with OrbaxCheckpoint(item) as ckpt:
        leaves = ckpt.leaves
        meta = ckpt.ckptbridge_metadata
        lora = any(is_lora_leaf(p) for p in leaves)
        out = {
            "kind": "orbax-lora" if lora else "orbax-weights",
            "path": item,
            "leaves": len(leaves),
            "dtypes": dict(Counter(str(d) for _, d in leaves.values())),
            "parameters": sum(_count(s) for s, _ in leaves.values()),
            "bytes": sum(_count(s) * d.itemsize for s, d in leaves.values()),
            "metadata": {k: v for k, v in meta.items() if k != "hf_config"},
        }
        if isinstance(meta.get("hf_config"), dict):
            cfg = parse_config(meta["hf_config"], f"{item} (metadata)")
            out.update(family=cfg.family, layers=cfg.num_layers, layer_kinds=cfg.layer_kinds(),
                       tunix_mismatch=get_family(cfg.family).config_mismatches(cfg))
        if lora:
            ranks = Counter()
            for p, (shape, _) in leaves.items():
                if is_lora_a(p):
                    ranks[int(shape[-1])] += 1
            out["lora_ranks"] = {str(r): n for r, n in ranks.items()}
        return out


def _inspect_peft(path: str) -> dict:
    from ckptbridge.io.safetensors import SafetensorsFile

    cfg_path = os.path.join(path, "adapter_config.json")
    try:
        with open(cfg_path, "rb") as f:
            cfg = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CorruptFileError(f"{cfg_path}: not valid JSON") from None
    out = {
        "kind": "peft-adapter",
        "path": path,
        "peft_type": cfg.get("peft_type"),
        "r": cfg.get("r"),
        "lora_alpha": cfg.get("lora_alpha"),
        "target_modules": cfg.get("target_modules"),
        "base_model_name_or_path": cfg.get("base_model_name_or_path"),
    }
    for key in ("rank_pattern", "alpha_pattern", "use_rslora", "use_dora", "modules_to_save"):
        if cfg.get(key):
            out[key] = cfg[key]
    weights = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(weights):
        with SafetensorsFile(weights) as f:
            if "ckptbridge" in f.metadata:
                try:
                    out["ckptbridge"] = json.loads(f.metadata["ckptbridge"])
                except json.JSONDecodeError:
                    out["ckptbridge"] = f.metadata["ckptbridge"]
            out["tensors"] = len(f.keys())
            out["parameters"] = sum(_count(f.info(k).shape) for k in f.keys())
            out["dtypes"] = dict(Counter(f.info(k).dtype for k in f.keys()))
    return out


def inspect_path(path: str, step: int | None = None) -> dict:
    """Identify ``path`` (HF model, Orbax weights, Orbax LoRA, PEFT adapter) and summarise it; an
    Orbax checkpoint may be on Cloud Storage (``gs://``)."""
    from ckptbridge.io import storage

    if storage.is_remote(path):
        return _inspect_orbax(path, step)
    if not os.path.exists(path):
        raise InputNotFoundError(f"{path}: no such file or directory")
    if os.path.isfile(path) and path.endswith(".safetensors"):
        from ckptbridge.io.safetensors import SafetensorsFile

        with SafetensorsFile(path) as f:
            return {
                "kind": "safetensors-file",
                "path": path,
                "tensors": len(f.keys()),
                "parameters": sum(_count(f.info(k).shape) for k in f.keys()),
                "dtypes": dict(Counter(f.info(k).dtype for k in f.keys())),
                "metadata": f.metadata,
            }
    if not os.path.isdir(path):
        raise InputNotFoundError(f"{path}: not a directory or a .safetensors file")
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        return _inspect_peft(path)
    if is_hf_directory(path):
        return _inspect_hf(path)
    return _inspect_orbax(path, step)


def format_report(info: dict) -> str:
    """Human-readable lines for an inspect result."""
    lines = [f"{info['path']}: {info['kind']}"]
    for key in ("family", "model_type", "config_dialect", "key_prefix", "layers", "layer_kinds", "towers",
                "tunix_mismatch", "peft_type", "r", "lora_alpha", "rank_pattern", "alpha_pattern", "use_rslora",
                "use_dora", "modules_to_save", "target_modules", "base_model_name_or_path", "ckptbridge",
                "lora_ranks", "leaves", "tensors", "dtypes", "parameters", "bytes", "files", "metadata", "valid",
                "problem"):
        if key in info and info[key] not in (None, [], {}):
            value = info[key]
            if key in ("parameters", "bytes"):
                value = f"{value:,}"
            elif isinstance(value, dict):
                value = ", ".join(f"{k}: {v}" for k, v in value.items())
            elif isinstance(value, list):
                value = ", ".join(map(str, value))
            lines.append(f"  {key:<24} {value}")
    return "\n".join(lines)
