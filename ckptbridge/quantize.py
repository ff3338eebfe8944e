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
SOURCE_DTYPES = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32))


def get_scheme(name: str) -> Scheme:
    if name not in SCHEMES:
        raise UnsupportedError(f"--quantize {name!r}: choose one of {', '.join(SCHEMES)}")
    return SCHEMES[name]


def quantize_weight(w: np.ndarray, scheme: Scheme, where: str = "weight") -> tuple[np.ndarray, np.ndarray]:
    """``(weight, weight_scale)`` of the 2-D weight ``w`` (out x in) under ``scheme``."""
    src = np.dtype(w.dtype)
    if src not in SOURCE_DTYPES:
        raise UnsupportedError(f"{where}: dtype {src} cannot be quantized to {scheme.name}; the source must be "
                               "bfloat16, float16 or float32")
    if w.ndim != 2:
        raise UnsupportedError(f"{where}: shape {w.shape} is not a matrix (out x in)")
    wide = w.astype(np.float32)  # exact for every source dtype
    amax = np.maximum(np.abs(np.minimum(wide.min(axis=1, keepdims=True), 0)),
                      np.abs(np.maximum(wide.max(axis=1, keepdims=True), 0)))
    scale = (amax / np.float32(scheme.divisor)).astype(src)
    scale[scale == 0] = ml_dtypes.finfo(src).eps
    scaled = (wide / scale.astype(np.float32)).astype(src).astype(np.float32)
    clamped = np.clip(scaled, scheme.q_min, scheme.q_max)
    if scheme.ct_type == "int":
        q = np.rint(clamped).astype(scheme.dtype)  # rint: half to even, as torch.round
    else:
        q = clamped.astype(scheme.dtype)
    return q, scale
