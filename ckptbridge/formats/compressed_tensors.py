"""Weight quantization of one linear projection, as compressed-tensors computes it.

The two schemes are llm-compressor's data-free presets in the compressed-tensors format, the one
vLLM loads:

* ``int8`` (``W8A8``): int8 weights, symmetric, one scale per output channel; activations
  quantized per token at run time (nothing stored for them).
* ``fp8`` (``FP8_DYNAMIC``): float8 e4m3 weights, one scale per output channel; activations per
  token at run time.

For a weight ``w`` (out x in) in its source dtype (bfloat16, float16 or float32), as
compressed-tensors does on a CPU:

* ``amax`` per output row = max(|min(row, 0)|, |max(row, 0)|), exact in the source dtype;
* ``scale = amax / ((q_max - q_min) / 2)``: the divisor is 127.5 for int8 (q in [-128, 127]) and
  448 for e4m3 (q in [-448, 448]); computed in float32 and rounded (to nearest even) to the source
  dtype, the dtype the scale is stored in; a zero scale becomes the source dtype's epsilon;
* ``q = round(clamp(w / scale, q_min, q_max))``: ``w / scale`` is computed in float32 and rounded
  to the source dtype first (as torch divides reduced-precision tensors), then clamped and rounded
  half to even for int8, or cast (to nearest even) to e4m3 for fp8.

So the row's largest magnitude maps to 127 when positive and to -128 when negative. The stored
tensors are ``weight`` (int8 / float8_e4m3fn, out x in) and ``weight_scale`` (source dtype,
out x 1); a symmetric scheme stores no zero point.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Iterable, Iterator

import ml_dtypes
import numpy as np

from ckptbridge.errors import UnsupportedError


@dataclasses.dataclass(frozen=True)
class Scheme:
    """A weight quantization scheme: its name here, the compressed-tensors preset and format it
    is, the stored weight dtype and the quantized range."""

    name: str
    preset: str  # llm-compressor's scheme name
    ct_type: str  # compressed-tensors QuantizationType: "int" or "float"
    format: str  # compressed-tensors CompressionFormat
    dtype: np.dtype
    q_min: float
    q_max: float

    @property
    def divisor(self) -> float:
        return (self.q_max - self.q_min) / 2


SCHEMES: dict[str, Scheme] = {
    "int8": Scheme("int8", "W8A8", "int", "int-quantized", np.dtype(np.int8), -128.0, 127.0),
    "fp8": Scheme("fp8", "FP8_DYNAMIC", "float", "float-quantized", np.dtype(ml_dtypes.float8_e4m3fn), -448.0, 448.0),
}

# the source dtypes a scale can be stored in (compressed-tensors keeps the weight's)
_BF16, _F16 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)
_LITTLE = sys.byteorder == "little"
SOURCE_DTYPES = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32))


def get_scheme(name: str, parameter: str = "scheme (--scheme)") -> Scheme:
    """The scheme called ``name``; an UnsupportedError naming ``parameter`` for any other."""
    if name not in SCHEMES:
        raise UnsupportedError(f"{parameter} {name!r}: choose one of {', '.join(SCHEMES)}")
    return SCHEMES[name]


# rows quantized at a time inside one call: about 256 KiB of float32, so that the passes below stay in cache
_CACHE_ELEMENTS = 1 << 16


@functools.cache
def _fp8_table(src: np.dtype, scheme: Scheme) -> np.ndarray:
    """The quantized byte of every 16-bit value of ``src``: clamped and cast (nearest even)."""
    values = np.arange(1 << 16, dtype=np.uint16).view(src).astype(np.float32)
    with np.errstate(invalid="ignore"):
        return np.clip(values, scheme.q_min, scheme.q_max).astype(scheme.dtype).view(np.uint8)


def _round_to_bfloat16(f: np.ndarray) -> None:
    """Round float32 values in place to the nearest bfloat16 (ties to even), kept as float32."""
    u = f.view(np.uint32)
    t = u >> 16
    t &= 1
    t += 0x7FFF
    u += t
    u &= np.uint32(0xFFFF0000)


def quantize_weight(w: np.ndarray, scheme: Scheme, where: str = "weight") -> tuple[np.ndarray, np.ndarray]:
    """``(weight, weight_scale)`` of the 2-D weight ``w`` (out x in) under ``scheme``.

    Runs a few rows at a time through one float32 buffer the size of a cache; about 1.6 ns a value
    for int8 and 2.3 for fp8 on one x86 core (docs/benchmarks.md)."""
    src = np.dtype(w.dtype)
    if src not in SOURCE_DTYPES:
        raise UnsupportedError(f"{where}: dtype {src} cannot be quantized to {scheme.name}; the source must be "
                               "bfloat16, float16 or float32: store it as bfloat16 first")
    if w.ndim != 2:
        raise UnsupportedError(f"{where}: shape {w.shape} is not a matrix (out x in)")
    out_dim, in_dim = w.shape
    q = np.empty(w.shape, scheme.dtype)
    scale = np.empty((out_dim, 1), src)
    eps = ml_dtypes.finfo(src).eps
    table = _fp8_table(src, scheme) if scheme.ct_type == "float" and src.itemsize == 2 else None
    rows = max(1, _CACHE_ELEMENTS // max(1, in_dim))
    buf = np.empty((min(rows, out_dim), in_dim), np.float32)
    for r0 in range(0, out_dim, rows):
        r1 = min(r0 + rows, out_dim)
        f = buf[: r1 - r0]
        np.copyto(f, w[r0:r1], casting="unsafe")  # exact for every source dtype
        amax = np.maximum(f.max(axis=1, keepdims=True), 0)
        np.maximum(amax, -f.min(axis=1, keepdims=True), out=amax)
        if not np.isfinite(amax).all():
            row = r0 + int(np.argmin(np.isfinite(amax[:, 0])))
            raise UnsupportedError(f"{where}: row {row} holds NaN or infinite values, which no scale can represent; "
                                   "fix the weights before quantizing")
        s = (amax / np.float32(scheme.divisor)).astype(src)
        s[s == 0] = eps
        scale[r0:r1] = s
        np.divide(f, s.astype(np.float32), out=f)
        half = None  # the 16-bit patterns of w / scale in the source dtype
        if src == _BF16:
            _round_to_bfloat16(f)
            if table is not None:
                half = f.view(np.uint16)[:, 1::2] if _LITTLE else (f.view(np.uint32) >> 16).astype(np.uint16)
        elif src == _F16:
            h = f.astype(np.float16)
            if table is not None:
                half = h.view(np.uint16)
            else:
                np.copyto(f, h)
        if scheme.ct_type == "int":
            np.clip(f, scheme.q_min, scheme.q_max, out=f)
            np.rint(f, out=f)  # half to even, as torch.round
            np.copyto(q[r0:r1], f, casting="unsafe")
        elif half is not None and table is not None:
            np.take(table, half, out=q[r0:r1].view(np.uint8))
        else:
            np.clip(f, scheme.q_min, scheme.q_max, out=f)
            q[r0:r1] = f.astype(scheme.dtype)
    return q, scale


# --------------------------------------------------------------------------- a model's quantization

# the compressed-tensors release whose format and config this writes (the reference the tests compare with)
COMPRESSED_TENSORS_VERSION = "0.19.0"
SCALE_SUFFIX = "weight_scale"


def _args(scheme: Scheme, *, weights: bool) -> dict:
    """compressed-tensors QuantizationArgs, as llm-compressor's presets serialize them."""
    return {"actorder": None, "block_structure": None, "dynamic": not weights, "group_size": None, "num_bits": 8,
            "observer": "memoryless_minmax" if weights else None, "observer_kwargs": {}, "scale_dtype": None,
            "strategy": "channel" if weights else "token", "symmetric": True, "type": scheme.ct_type,
            "zp_dtype": None}


@dataclasses.dataclass(frozen=True)
class Plan:
    """What quantizing a model writes: the weights quantized (HF keys, in file order) and the linear
    modules left in the source dtype (compressed-tensors' ``ignore``)."""

    scheme: Scheme
    weights: tuple[str, ...]
    ignore: tuple[str, ...]

    @staticmethod
    def scale_key(weight_key: str) -> str:
        return weight_key[: -len("weight")] + SCALE_SUFFIX

    def config(self) -> dict:
        """``quantization_config`` of config.json, key for key what llm-compressor writes."""
        s = self.scheme
        return {
            "config_groups": {"group_0": {"format": s.format, "input_activations": _args(s, weights=False),
                                          "output_activations": None, "targets": ["Linear"],
                                          "weights": _args(s, weights=True)}},
            "format": s.format, "global_compression_ratio": None, "ignore": list(self.ignore),
            "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
            "sparsity_config": {}, "transform_config": {}, "version": COMPRESSED_TENSORS_VERSION,
        }

    def tensors(self, key: str, shape: tuple[int, ...], dtype: np.dtype, pieces: Callable[[], Iterable]) -> list:
        """The two PlannedTensors that store weight ``key`` (source ``dtype``, ``shape``): the weight,
        then its scale. ``pieces()`` gives its ``(weight, weight_scale)`` row blocks in order; the
        scales are kept until the scale tensor is written."""
        from ckptbridge.io.safetensors import PlannedTensor

        scales: list = []
        return [PlannedTensor(key, self.scheme.dtype, shape, chunks=lambda: weight_rows(pieces(), scales)),
                PlannedTensor(self.scale_key(key), dtype, (shape[0], 1), chunks=functools.partial(scale_rows, scales))]

    def hf_config(self, config: dict) -> dict:
        return {**config, "quantization_config": self.config()}

    def describe(self) -> str:
        s = self.scheme
        what = "int8" if s.ct_type == "int" else "float8 e4m3"
        return (f"{len(self.weights)} linear projections of the decoder layers stored as {what} with one "
                f"scale per output channel (compressed-tensors `{s.format}`, llm-compressor's `{s.preset}`: "
                f"activations quantized per token at run time); embeddings, norms and the LM head keep the "
                f"source dtype")


def weight_rows(pieces: Iterable[tuple[np.ndarray, np.ndarray]], scales: list) -> Iterator[np.ndarray]:
    """The quantized rows of ``(weight, weight_scale)`` row blocks, in order, their scales kept in
    ``scales`` for :func:`scale_rows` (the scale tensor is written after its weight)."""
    for q, scale in pieces:
        scales.append(scale)
        yield q


def scale_rows(scales: list) -> Iterator[np.ndarray]:
    out = np.concatenate(scales)
    scales.clear()
    yield out


def _quantized(make: Callable[[], list], plan: Plan, shapes: dict[str, tuple[int, ...]]) -> list:
    weights = set(plan.weights)
    return [(key, row, quantize_weight(np.ascontiguousarray(v).reshape(-1, shapes[key][-1]), plan.scheme, key)
             if key in weights else v) for key, row, v in make()]


def quantized_jobs(jobs: Iterable, plan: Plan, shapes: dict[str, tuple[int, ...]]) -> Iterator:
    """The quantization stage: ``jobs`` (making :data:`~ckptbridge.rows.Part` lists: whole HF
    tensors or blocks of their rows) with the parts of the plan's weights quantized to
    ``(weight, weight_scale)`` rows."""
    for cost, make in jobs:
        yield cost, functools.partial(_quantized, make, plan, shapes)


def quantization_config(config: dict):
    """The ``quantization_config`` of a config.json (top level, or a multimodal model's text config)."""
    text = config.get("text_config")
    return config.get("quantization_config") or (text.get("quantization_config") if isinstance(text, dict) else None)


def describe(config: dict) -> str | None:
    """A line on how the model of ``config`` is quantized (its ``quantization_config``), or None."""
    q = quantization_config(config)
    if not q:
        return None
    if not isinstance(q, dict):
        return "quantization_config present"
    fmt = q.get("format") or next((g.get("format") for g in (q.get("config_groups") or {}).values()
                                   if isinstance(g, dict)), None)
    return ", ".join(str(x) for x in (q.get("quant_method", "unknown method"), fmt) if x)


def scheme_of(config: dict) -> Scheme | None:
    """The scheme of this module a model's config.json says its weights are stored in
    (compressed-tensors 8-bit int or float weights), None for any other (or none)."""
    q = quantization_config(config)
    if not isinstance(q, dict) or q.get("quant_method") != "compressed-tensors":
        return None
    groups = [g for g in (q.get("config_groups") or {}).values() if isinstance(g, dict)]
    for scheme in SCHEMES.values():
        if groups and all(g.get("format", q.get("format")) == scheme.format
                          and (g.get("weights") or {}).get("num_bits") == 8 for g in groups):
            return scheme
    return None


def already_quantized(config: dict, dtypes: dict[str, str]) -> str | None:
    """Why a model is quantized already (its config or a tensor says so), or None."""
    q = describe(config)
    if q:
        return f"its config.json has a quantization_config: {q}"
    for key, code in dtypes.items():
        if key.endswith(("." + SCALE_SUFFIX, ".weight_packed")) or code in ("I8", "U8", "F8_E4M3", "F8_E5M2"):
            return f"tensor {key} is {code}"
    return None


def plan_model(spec, cfg, prefix: str, dtypes: dict[str, str], shapes: dict[str, tuple[int, ...]], scheme: Scheme,
               where: str) -> Plan:
    """The quantization plan of the model of family ``spec``, config ``cfg`` and key ``prefix`` whose
    tensors are ``dtypes``/``shapes`` (HF key -> dtype code, shape; in file order). The weights of the decoder's
    linear projections (the modules LoRA can target) are quantized; every other matrix named
    ``*.weight`` that is not a table read by token id is a linear module left alone and goes to
    ``ignore``, as does ``lm_head`` (as compressed-tensors lists the unquantized linear modules)."""
    from ckptbridge import layout, mapping
    from ckptbridge.io.safetensors import DTYPES
    from ckptbridge.lora.modules import lora_modules

    if spec.experts is not None and spec.experts(cfg) is not None:
        raise UnsupportedError(f"{where}: {spec.name} with mixture-of-experts layers cannot be quantized to "
                               f"{scheme.name} here (its experts are 3-D tensors, not linear modules); quantize a "
                               "dense model")
    targets = {k for m in lora_modules(cfg, spec, prefix) for k in m.entry.hf_keys}
    weights = tuple(k for k in dtypes if k in targets)
    if not weights:
        raise UnsupportedError(f"{where}: no linear projection of the decoder layers found to quantize")
    for key in weights:
        if len(shapes[key]) != 2:
            raise UnsupportedError(f"{where}: {key} has shape {list(shapes[key])}, not a matrix (out x in); "
                                   "the weights and config.json disagree")
        if DTYPES.get(dtypes[key]) not in SOURCE_DTYPES:
            raise UnsupportedError(f"{where}: {key} is {dtypes[key]}; {scheme.name} quantizes BF16, F16 or F32 "
                                   "weights: store the model as bfloat16 first")
    vocab = set(spec.vocab_axes)
    tables = {k for e in mapping.entries(cfg, spec, prefix) if vocab & set(layout.axes(e.rule.hf_layout))
              for k in e.hf_keys}
    chosen = set(weights)
    ignore = [k[: -len(".weight")] for k in dtypes
              if k.endswith(".weight") and k not in chosen and k not in tables and len(shapes[k]) == 2
              and k != "lm_head.weight"]
    return Plan(scheme, weights, tuple(ignore) + ("lm_head",))
