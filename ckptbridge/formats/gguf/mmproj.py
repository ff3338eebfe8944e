"""ggml's projector file (``mmproj``): a multimodal model's vision and audio towers as the GGUF
file of architecture ``clip`` that ggml's runtimes load beside the text model's (``--mmproj``).

What is written follows ggml's converter with ``--mmproj`` for the same model: the family's names,
layouts, value changes, stored types and ``clip.*`` metadata (:class:`ckptbridge.specs.ggml.Projector`),
the tensors in the order the converter reads them (by their place in the model's files), the image
normalization from the model's processor config (``preprocessor_config.json`` /
``processor_config.json``). ``convert SRC model.gguf`` writes the text model to ``model.gguf`` and
the towers to ``mmproj-model.gguf`` beside it (or where ``--mmproj`` says); reading ``model.gguf``
reads that file back with it.

Two value changes are not exact both ways: a norm stored as ``1 + w`` (a projector's norm, as a
family's text norms may be) and a scale stored through softplus (``log(1 + e^x)``: computed as
ggml's converter computes it, with torch, where torch is installed, else in float64 and rounded,
which can differ from torch's float32 result in the last bit; read back as ``log(e^y - 1)``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Callable

import numpy as np

from ckptbridge import layout, mapping
from ckptbridge.errors import ConfigError, UnsupportedError
from ckptbridge.io import gguf, storage
from ckptbridge.rows import HELD_PER_BYTE, ModelRows
from ckptbridge.specs.ggml import FILE_TYPE, Projector

PREFIX = "mmproj-"  # ggml's name of a model's projector file, before the text file's name
ARCH = "clip"


def projector_path(dst: str, mmproj: str | None = None) -> str:
    """Where a model's projector file goes beside the text file ``dst``: ``mmproj`` where given,
    else ggml's name, ``mmproj-`` before the text file's name."""
    if mmproj:
        return mmproj
    head, name = os.path.split(dst)
    return os.path.join(head, PREFIX + name)


def projector_of(spec, cfg) -> Projector | None:
    found = spec.gguf.get(cfg.model_type)
    return found.projector if found is not None else None


def tower_refusal(spec, cfg, names: list[str]) -> str | None:
    """Why GGUF cannot hold the towers ``names`` of a model of ``spec`` (None: the projector file can)."""
    projector = projector_of(spec, cfg)
    if projector is None:
        return None  # a family with no GGUF form: the writer says so
    missing = [n for n in names if n not in projector.names]
    if missing:
        return f"ggml's converter writes no projector for the {' and '.join(missing)} tower of {spec.name}"
    if "vision" in projector.names and "vision" not in names:
        return f"ggml's converter writes no {spec.name} projector without its vision tower"
    return None


@dataclasses.dataclass(frozen=True)
class ProjTensor:
    """One tensor of the projector file: its GGUF name, stored shape and type, the HF tensor it is
    made of, and how (a layout change, a value change)."""

    name: str
    shape: tuple[int, ...]
    type: gguf.TensorType
    entry: mapping.Entry
    gguf_layout: str | None
    change: str | None

    @property
    def key(self) -> str:
        return self.entry.hf_keys[0]


def _softplus(x: np.ndarray) -> np.ndarray:
    """``log(1 + e^x)`` in float32, as ggml's converter computes it (torch's, threshold 20)."""
    try:
        import torch
    except ImportError:
        x64 = x.astype(np.float64)
        return np.where(x64 > 20, x64, np.log1p(np.exp(np.minimum(x64, 20)))).astype(np.float32)
    return torch.nn.functional.softplus(torch.from_numpy(np.ascontiguousarray(x, np.float32))).numpy()


def _softplus_inverse(y: np.ndarray) -> np.ndarray:
    y64 = y.astype(np.float64)
    return np.where(y64 > 20, y64, np.log(np.expm1(np.maximum(y64, 1e-300)))).astype(np.float32)


def _work(dtype: np.dtype) -> np.dtype:
    """The dtype ggml's converter computes a value change in: float16 stays, every other is float32."""
    return np.dtype(np.float16 if np.dtype(dtype) == np.float16 else np.float32)


# value change -> (to GGUF, from GGUF), on values in :func:`_work`'s dtype
CHANGES: dict[str, tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray]]] = {
    "plus_one": (lambda x: x + np.asarray(1, x.dtype), lambda y: y - np.asarray(1, y.dtype)),
    "softplus": (_softplus, _softplus_inverse),
}


def stored_type(name: str, shape: tuple[int, ...], forced: str | None, wanted: gguf.TensorType) -> gguf.TensorType:
    """The type ggml's converter stores a projector tensor as: the family's forced type (``f32``,
    ``f16``; ``patch``: float16 in a float16 file, else float32), but float32 for 1-D tensors, norms
    and names not ending ``.weight``; Q8_0 where rows are whole blocks of 32, else float16."""
    if len(shape) <= 1 or name.endswith("_norm.weight"):
        return gguf.TensorType.F32
    if forced is not None:
        return {"f32": gguf.TensorType.F32, "f16": gguf.TensorType.F16}.get(
            forced, gguf.TensorType.F16 if wanted is gguf.TensorType.F16 else gguf.TensorType.F32)
    if not name.endswith(".weight"):
        return gguf.TensorType.F32
    if wanted is gguf.TensorType.Q8_0 and shape[-1] % gguf.QK8_0:
        return gguf.TensorType.F16
    return wanted


def plan(rows: ModelRows, wanted: gguf.TensorType, where: str) -> list[ProjTensor]:
    """The projector file's tensors of ``rows``' towers, in the order ggml's converter writes them
    (by their HF tensors' place in the source's files where it says; else the rows' order)."""
    out = plan_entries(rows.spec, rows.cfg, rows.tower_entries, wanted, where)
    if out and rows.position(out[0].key) is not None:
        out.sort(key=lambda t: rows.position(t.key))  # type: ignore[arg-type, return-value]
    return out


def plan_entries(spec, cfg, entries: list[mapping.Entry], wanted: gguf.TensorType, where: str) -> list[ProjTensor]:
    """The projector file's tensors of the tower rows ``entries``, in their order."""
    projector = projector_of(spec, cfg)
    if projector is None:
        raise UnsupportedError(f"{where}: ggml has no projector file for {spec.name}")
    out = []
    for e in entries:
        tower = projector.names.get(e.tower or "", {})
        if e.rule.name not in tower:
            raise UnsupportedError(f"{e.hf_keys[0]}: no GGUF name for this tensor of the {e.tower} tower "
                                   f"({spec.name}); ggml's converter does not write it")
        template, lay = tower[e.rule.name]
        name = template.replace("{i}", str(e.tower_layer))
        shape = layout.shape(lay, e.sizes) if lay else (e.hf_shape or (1,))
        forced = projector.types.get((e.tower or "", e.rule.name))
        out.append(ProjTensor(name, tuple(shape), stored_type(name, tuple(shape), forced, wanted), e, lay,
                              projector.values.get((e.tower or "", e.rule.name))))
    return out


def to_gguf(t: ProjTensor, values: np.ndarray) -> np.ndarray:
    """An HF tensor's values as ``t`` stores them (value change, layout, stored type)."""
    if t.change is not None:
        values = CHANGES[t.change][0](values.astype(_work(values.dtype)))
    if t.gguf_layout:
        values = layout.rearrange(values, t.entry.rule.hf_layout, t.gguf_layout, t.entry.sizes)
    return gguf.store(np.ascontiguousarray(values).reshape(t.shape), t.type)


def from_gguf(t: ProjTensor, stored: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``t``'s stored values (float32 for Q8_0) back as the HF tensor, in ``dtype``."""
    x = stored
    if t.gguf_layout:
        x = layout.rearrange(x.reshape(t.shape), t.gguf_layout, t.entry.rule.hf_layout, t.entry.sizes)
    x = x.reshape(t.entry.hf_shape)
    if t.change is not None:
        x = CHANGES[t.change][1](x.astype(_work(dtype)))
    return x.astype(dtype, copy=False)


def processor_config(directory: str | None, where: str) -> dict:
    """The model's processor config as ggml's converter reads it: preprocessor_config.json, then
    processor_config.json over it (its ``image_processor`` lifted to the top), and the image
    normalization it needs, or a one-line error naming what is missing."""
    merged: dict = {}
    for name, inner in (("preprocessor_config.json", "media_proc_cfg"), ("processor_config.json", "image_processor")):
        path = os.path.join(directory, name) if directory and not storage.is_remote(directory) else ""
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                found = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path}: not a JSON object ({e})") from None
        if isinstance(found, dict):
            lifted = found.get(inner)
            merged = {**merged, **found, **(lifted if isinstance(lifted, dict) else {})}
    missing = [k for k in ("image_mean", "image_std") if not isinstance(merged.get(k), list)]
    if missing:
        raise ConfigError(f"{where}: no {missing[0]} in a preprocessor_config.json or processor_config.json beside "
                          "the model; ggml's projector file records the image normalization: give the model's "
                          "processor config (or --skip-multimodal for the text model alone)")
    return merged


def _job(rows: ModelRows, t: ProjTensor) -> list:
    return [(t.name, to_gguf(t, rows.arrays(t.entry)[0]))]


def jobs(rows: ModelRows, tensors: list[ProjTensor]):
    """One job per tensor (the towers' tensors are each a few tens of MB at most)."""
    return ((HELD_PER_BYTE * 4 * max(1, math.prod(t.entry.hf_shape)), functools.partial(_job, rows, t))
            for t in tensors)


def metadata(rows: ModelRows, name: str, size: str, file_type: int, processor: dict,
             sampling: dict[str, gguf.Value]) -> dict[str, gguf.Value]:
    """The projector file's metadata in ggml's order: the general keys, the family's ``clip.*``."""
    projector = projector_of(rows.spec, rows.cfg)
    assert projector is not None
    out: dict[str, gguf.Value] = {"general.architecture": gguf.string(ARCH), "general.type": gguf.string("mmproj"),
                                  **sampling, "general.name": gguf.string(name),
                                  "general.size_label": gguf.string(size)}
    towers = rows.spec.tower_configs(rows.cfg)
    for key, value in projector.metadata(rows.cfg, towers, processor):
        out[key] = gguf.u32(file_type) if key == FILE_TYPE else gguf.spec_value(value)
    out["general.quantization_version"] = gguf.u32(gguf.GGML_QUANT_VERSION)
    return out


def inexact_rules(spec, cfg, outtype: str = "bf16") -> dict[tuple[str, str], str]:
    """The tower rows a projector file does not give back bit for bit, each with why: value
    changes, float16 where ggml's converter stores it whatever the output type (exact for bfloat16
    values in float16's range), every weight under q8_0."""
    projector = projector_of(spec, cfg)
    if projector is None:
        return {}
    out = {}
    if outtype == "q8_0":
        out = {(t, r): "q8_0: each value within half a step of its block" for t, rules in projector.names.items()
               for r in rules}
    out.update({key: "stored as float16 by ggml's converter" for key, t in projector.types.items() if t == "f16"})
    why = {"plus_one": "stored as 1 + w in float32", "softplus": "stored through softplus in float32"}
    out.update({key: why[change] for key, change in projector.values.items()})
    return out


__all__ = ["ARCH", "CHANGES", "PREFIX", "ProjTensor", "from_gguf", "inexact_rules", "jobs", "metadata", "plan",
           "plan_entries", "processor_config", "projector_of", "projector_path", "stored_type", "to_gguf",
           "tower_refusal"]
