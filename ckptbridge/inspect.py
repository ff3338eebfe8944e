"""``ckptbridge inspect``: say what a path is and summarise it."""

from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter
from typing import Any

import numpy as np

from ckptbridge.errors import InputNotFoundError
from ckptbridge.formats.hf import is_hf_directory
from ckptbridge.formats.qwix import is_lora_a, is_lora_leaf
from ckptbridge.report import Report
from ckptbridge.rows import tower_record, towers_line
from ckptbridge.specs import get_family, parse_config

SUMMARY_ORDER = ("format", "architecture", "name", "gguf_version", "adapter_type", "block_count", "context_length",
                 "tokenizer", "vocab", "chat_template", "tensor_types", "family", "model_type", "config_dialect",
                 "key_prefix", "layers", "layer_kinds", "towers",
                 "tunix_mismatch", "peft_type", "r", "lora_alpha", "rank_pattern", "alpha_pattern", "use_rslora",
                 "use_dora", "modules_to_save", "target_modules", "base_model_name_or_path", "ckptbridge",
                 "lora_ranks", "maxtext", "leaves", "tensors", "dtypes", "quantization", "parameters", "bytes", "files",
                 "metadata", "valid", "problem")


class Info(Report):
    """What ``inspect`` says of a path; ``summary()`` is one line per field that holds something."""

    kind: str

    def summary(self) -> str:
        info = self.to_json()
        lines = [f"{info['path']}: {info['kind']}"]
        for key in SUMMARY_ORDER:
            value = info.get(key)
            if value in (None, [], {}):
                continue
            if key in ("parameters", "bytes"):
                value = f"{value:,}"
            elif key == "towers":
                value = towers_line(value).split(": ", 1)[1]
            elif isinstance(value, dict):
                value = ", ".join(f"{k}: {v}" for k, v in value.items())
            elif isinstance(value, list):
                value = ", ".join(map(str, value))
            lines.append(f"  {key:<24} {value}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class HFModelInfo(Info):
    OMIT_NONE = ("format", "key_prefix", "problem", "quantization")

    kind: str
    path: str
    family: str
    model_type: str
    config_dialect: str | None
    layers: int
    layer_kinds: dict[str, int]
    dtypes: dict[str, int]
    parameters: int
    bytes: int
    files: list[str]
    towers: dict  # tower -> {"tensors", "bytes"} (or the towers config.json configures, where unreadable)
    tunix_mismatch: list[str]  # what the family's Tunix model computes otherwise
    key_prefix: str | None
    valid: bool
    problem: str | None
    quantization: str | None = None  # how a quantized model is stored
    format: str | None = None  # its format in the registry (ckptbridge formats), as convert finds it


@dataclasses.dataclass(frozen=True)
class OrbaxInfo(Info):
    OMIT_NONE = ("format", "family", "layers", "layer_kinds", "tunix_mismatch", "lora_ranks", "maxtext", "towers",
                 "quantization")

    kind: str
    path: str
    leaves: int
    dtypes: dict[str, int]
    parameters: int
    bytes: int
    metadata: dict
    family: str | None = None
    layers: int | None = None
    layer_kinds: dict[str, int] | None = None
    tunix_mismatch: list[str] | None = None
    lora_ranks: dict[str, int] | None = None
    maxtext: dict | None = None  # a MaxText checkpoint's tree, scan_layers and LoRA (formats.maxtext.model.describe)
    format: str | None = None  # its format in the registry (ckptbridge formats), as convert finds it
    towers: dict | None = None  # the towers it holds (tensors, bytes), as its metadata records them
    quantization: str | None = None  # a QLoRA base stored quantized: how (ckptbridge.qlora_base)


@dataclasses.dataclass(frozen=True)
class PeftInfo(Info):
    OMIT_NONE = ("format", "rank_pattern", "alpha_pattern", "use_rslora", "use_dora", "modules_to_save", "ckptbridge",
                 "tensors", "parameters", "dtypes")

    kind: str
    path: str
    peft_type: str | None
    r: Any
    lora_alpha: Any
    target_modules: str | list[str] | None
    base_model_name_or_path: str | None
    rank_pattern: dict | None = None
    alpha_pattern: dict | None = None
    use_rslora: bool | None = None
    use_dora: bool | None = None
    modules_to_save: list[str] | None = None
    ckptbridge: Any = None
    tensors: int | None = None
    parameters: int | None = None
    dtypes: dict[str, int] | None = None
    format: str | None = None  # its format in the registry (ckptbridge formats), as convert finds it


@dataclasses.dataclass(frozen=True)
class SafetensorsInfo(Info):
    OMIT_NONE = ("format",)

    kind: str
    path: str
    tensors: int
    parameters: int
    dtypes: dict[str, int]
    metadata: dict | None
    format: str | None = None  # its format in the registry (ckptbridge formats), as convert finds it


@dataclasses.dataclass(frozen=True)
class GGUFInfo(Info):
    OMIT_NONE = ("format", "name", "adapter_type", "lora_alpha", "block_count", "context_length", "tokenizer", "vocab")

    kind: str  # gguf-model or gguf-adapter (general.type)
    path: str
    gguf_version: int
    architecture: str | None
    tensors: int
    tensor_types: dict[str, int]
    parameters: int
    bytes: int
    chat_template: bool
    name: str | None = None
    adapter_type: str | None = None
    lora_alpha: float | None = None
    block_count: int | None = None
    context_length: int | None = None
    tokenizer: str | None = None  # tokenizer.ggml.model (e.g. gpt2 for BPE)
    vocab: int | None = None
    format: str | None = None  # its format in the registry (ckptbridge formats), as convert finds it


def _inspect_gguf(path: str) -> GGUFInfo:
    from ckptbridge.io.gguf import TensorType, read_gguf

    f = read_gguf(path)
    m = f.metadata
    arch = m.get("general.architecture")
    kind = "gguf-adapter" if m.get("general.type") == "adapter" else "gguf-model"
    types = Counter(t.type.name if isinstance(t.type, TensorType) else f"ggml type {t.type}"
                    for t in f.tensors.values())
    tokens = m.get("tokenizer.ggml.tokens")
    return GGUFInfo(kind=kind, path=path, gguf_version=f.version, architecture=arch, name=m.get("general.name"),
                    tensors=len(f.tensors), tensor_types=dict(types),
                    parameters=sum(_count(t.shape) for t in f.tensors.values()),
                    bytes=sum(t.nbytes or 0 for t in f.tensors.values()),
                    chat_template="tokenizer.chat_template" in m, adapter_type=m.get("adapter.type"),
                    lora_alpha=m.get("adapter.lora.alpha"), block_count=m.get(f"{arch}.block_count"),
                    context_length=m.get(f"{arch}.context_length"), tokenizer=m.get("tokenizer.ggml.model"),
                    vocab=len(tokens) if isinstance(tokens, list) else None)


def _count(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _inspect_hf(path: str) -> HFModelInfo:
    from ckptbridge.formats.hf import open_hf_source
    from ckptbridge.io.hf import HFModelDir

    with HFModelDir(path) as model:
        cfg = parse_config(model.config, os.path.join(path, "config.json"))
        dtypes = Counter(model.info(k).dtype for k in model.keys())
        params = sum(_count(model.info(k).shape) for k in model.keys())
        nbytes = sum(model.info(k).nbytes for k in model.keys())
        files = sorted(model.files)
    prefix = problem = quantization = None
    towers: dict = {name: "configured" for name in cfg.towers}
    try:
        with open_hf_source(path, keep_towers=True, quantized_ok=True) as source:
            prefix, quantization = source.prefix, source.quantization
            towers = tower_record(source.tower_entries, source.key_info) or towers
    except Exception as e:  # report, do not fail: inspect is for looking at broken things too
        problem = str(e)
    return HFModelInfo(kind="hf-model", path=path, family=cfg.family, model_type=cfg.model_type,
                       config_dialect=cfg.dialect, layers=cfg.num_layers, layer_kinds=cfg.layer_kinds(),
                       dtypes=dict(dtypes), parameters=params, bytes=nbytes, files=files, towers=towers,
                       tunix_mismatch=get_family(cfg.family).config_mismatches(cfg), key_prefix=prefix,
                       valid=problem is None, problem=problem, quantization=quantization)


def _inspect_orbax(path: str, step: int | None) -> OrbaxInfo:
    from ckptbridge.formats.maxtext import model as maxtext
    from ckptbridge.io.orbax import OrbaxCheckpoint, resolve_checkpoint

    try:
        item = resolve_checkpoint(path, step)
    except InputNotFoundError:  # a MaxText run's directory: <step>/items
        item = maxtext.resolve(path, step)
    with OrbaxCheckpoint(item) as ckpt:
        leaves = ckpt.leaves
        meta = ckpt.ckptbridge_metadata
        mt = maxtext.describe(ckpt)
    lora = any(is_lora_leaf(p) for p in leaves) or bool(mt and mt["lora"])
    described: dict[str, Any] = {}
    if isinstance(meta.get("hf_config"), dict):
        cfg = parse_config(meta["hf_config"], f"{item} (metadata)")
        described = dict(family=cfg.family, layers=cfg.num_layers, layer_kinds=cfg.layer_kinds(),
                         tunix_mismatch=get_family(cfg.family).config_mismatches(cfg))
    ranks: Counter = Counter(int(shape[-1]) for p, (shape, _) in leaves.items() if is_lora_a(p))
    kind = ("maxtext" if mt else "orbax") + ("-lora" if lora else "-weights")
    return OrbaxInfo(kind=kind, path=item, leaves=len(leaves), maxtext=mt,
                     dtypes=dict(Counter(str(d) for _, d in leaves.values())),
                     parameters=sum(_count(s) for s, _ in leaves.values()),
                     bytes=sum(_count(s) * d.itemsize for s, d in leaves.values()),
                     metadata={k: v for k, v in meta.items() if k not in ("hf_config", "towers")}, **described,
                     towers=meta.get("towers") if isinstance(meta.get("towers"), dict) else None,
                     quantization=_qlora_base(meta.get("base_quant")) if not lora else None,
                     lora_ranks={str(r): n for r, n in ranks.items()} if lora else None)


def _qlora_base(record) -> str | None:
    """What a QLoRA base stored quantized holds, in one line (None for another checkpoint)."""
    if not isinstance(record, dict) or not record.get("scheme"):
        return None
    tile = f" in tiles of {record['tile']}" if record.get("tile") else " (one scale per output channel)"
    return (f"QLoRA base: {record.get('weights')} weights of {', '.join(record.get('targets') or [])} stored as "
            f"qwix's {record['scheme']} arrays{tile}, from {record.get('param_dtype')} (python -m training --base)")


def _inspect_peft(path: str) -> PeftInfo:
    from ckptbridge.formats.peft import ADAPTER_WEIGHTS, AdapterConfig
    from ckptbridge.io.safetensors import SafetensorsFile

    cfg = AdapterConfig.read(path)
    weights: dict[str, Any] = {}
    weights_path = os.path.join(path, ADAPTER_WEIGHTS)
    if os.path.isfile(weights_path):
        with SafetensorsFile(weights_path) as f:
            if "ckptbridge" in f.metadata:
                try:
                    weights["ckptbridge"] = json.loads(f.metadata["ckptbridge"])
                except json.JSONDecodeError:
                    weights["ckptbridge"] = f.metadata["ckptbridge"]
            weights.update(tensors=len(f.keys()), parameters=sum(_count(f.info(k).shape) for k in f.keys()),
                           dtypes=dict(Counter(f.info(k).dtype for k in f.keys())))
    return PeftInfo(kind="peft-adapter", path=path, peft_type=cfg.peft_type, r=cfg.r, lora_alpha=cfg.lora_alpha,
                    target_modules=cfg.target_modules, base_model_name_or_path=cfg.base_model_name_or_path,
                    rank_pattern=cfg.rank_pattern or None, alpha_pattern=cfg.alpha_pattern or None,
                    use_rslora=cfg.use_rslora or None, use_dora=cfg.use_dora or None,
                    modules_to_save=cfg.modules_to_save or None, **weights)


def inspect_path(path: str, step: int | None = None, *, revision: str | None = None) -> Info:
    """Identify ``path`` (HF model, Orbax weights, Orbax LoRA, MaxText, PEFT adapter, safetensors or
    GGUF file) and summarise it, with its ``format`` as ``convert`` finds it (the registry's
    detection; None for what convert does not read); an Orbax checkpoint may be on Cloud Storage
    (``gs://``), a model a Hub id (at ``revision``)."""
    from ckptbridge import hub

    path = hub.local(path, hub.MODEL, revision=revision)
    info = _inspect(path, step)
    return dataclasses.replace(info, format=_format(path, step, info.kind))  # type: ignore[call-arg]


def _format(path: str, step: int | None, kind: str) -> str | None:
    from ckptbridge import formats
    from ckptbridge.errors import CkptBridgeError

    if kind == "gguf-adapter":
        return "gguf-lora"
    try:
        return formats.detect(path, step).name
    except CkptBridgeError:
        return None


def _inspect(path: str, step: int | None) -> Info:
    from ckptbridge.io import storage

    if storage.is_remote(path):
        return _inspect_orbax(path, step)
    if not os.path.exists(path):
        raise InputNotFoundError(f"{path}: no such file or directory")
    if os.path.isfile(path) and path.endswith(".safetensors"):
        from ckptbridge.io.safetensors import SafetensorsFile

        with SafetensorsFile(path) as f:
            return SafetensorsInfo(kind="safetensors-file", path=path, tensors=len(f.keys()),
                                   parameters=sum(_count(f.info(k).shape) for k in f.keys()),
                                   dtypes=dict(Counter(f.info(k).dtype for k in f.keys())), metadata=f.metadata)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return _inspect_gguf(path)
    if not os.path.isdir(path):
        raise InputNotFoundError(f"{path}: not a directory, a .safetensors or a .gguf file")
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        return _inspect_peft(path)
    if is_hf_directory(path):
        return _inspect_hf(path)
    return _inspect_orbax(path, step)
