"""Weight quantization (ckptbridge/quantize.py) against the torch operations compressed-tensors runs.

The reference below is compressed-tensors' own sequence on a CPU, written with torch: min/max per
output row (llm-compressor's observer), ``calculate_qparams`` (symmetric: the larger magnitude
over half the quantized range, zero scales to the dtype's epsilon), then ``quantize`` (``x /
scale`` in the weight's dtype, clamp, ``torch.round`` or the cast to float8_e4m3fn).
"""

import ml_dtypes
import numpy as np
import pytest

from ckptbridge.errors import UnsupportedError
from ckptbridge.quantize import SCHEMES, get_scheme, quantize_weight


def _torch_reference(w, scheme):
    import torch

    x = torch.from_numpy(w.astype(np.float32)).to({np.dtype(ml_dtypes.bfloat16): torch.bfloat16,
                                                    np.dtype(np.float16): torch.float16,
                                                    np.dtype(np.float32): torch.float32}[w.dtype])
    min_vals = torch.amin(x, dim=1, keepdim=True)
    max_vals = torch.amax(x, dim=1, keepdim=True)
    min_vals = torch.min(min_vals, torch.zeros_like(min_vals))
    max_vals = torch.max(max_vals, torch.zeros_like(max_vals))
    if scheme.ct_type == "int":
        q_min, q_max, dtype = torch.tensor(-128.0), torch.tensor(127.0), torch.int8
    else:
        q_min, q_max, dtype = torch.tensor(-448.0), torch.tensor(448.0), torch.float8_e4m3fn
    bit_range = q_max - q_min
    max_val_pos = torch.max(torch.abs(min_vals), torch.abs(max_vals))
    scales = max_val_pos / (float(bit_range) / 2)
    scales = torch.where(scales == 0, torch.tensor(torch.finfo(scales.dtype).eps, dtype=scales.dtype), scales)
    scaled = x / scales
    clamped = torch.clamp(scaled, q_min, q_max)
    rounded = torch.round(clamped) if scheme.ct_type == "int" else clamped.to(dtype)
    q = rounded.to(dtype)
    q_np = q.view(torch.int8).numpy().view(np.int8 if dtype == torch.int8 else ml_dtypes.float8_e4m3fn)
    return q_np, scales.to(torch.float32).numpy().astype(w.dtype)


def _weights(dtype, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((64, 96)).astype(np.float32) * rng.uniform(1e-4, 30, size=(64, 1)).astype(np.float32)
    w[3] = 0.0  # a zero row: the scale becomes the dtype's epsilon
    w[4] = np.abs(w[4])  # all positive: the largest maps to 127
    w[5] = -np.abs(w[5])  # all negative: the largest magnitude maps to -128
    w[6, :] = 0.0
    w[6, 0] = 1e-30 if dtype == np.float32 else 0.0
    w[7] = np.linspace(-1, 1, 96)  # many values near a rounding tie after the first rounding
    return w.astype(dtype)


@pytest.mark.parametrize("name", sorted(SCHEMES))
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, np.float32], ids=["bf16", "f16", "f32"])
def test_quantized_weight_and_scale_equal_compressed_tensors_operations(name, dtype):
    scheme = SCHEMES[name]
    for seed in range(3):
        w = _weights(dtype, seed)
        q, scale = quantize_weight(w, scheme)
        q_ref, scale_ref = _torch_reference(w, scheme)
        assert q.dtype == scheme.dtype and q.shape == w.shape
        assert scale.dtype == w.dtype and scale.shape == (w.shape[0], 1)
        assert scale.tobytes() == scale_ref.tobytes()
        assert q.tobytes() == q_ref.tobytes()
    if scheme.ct_type == "int":
        assert q[4].max() == 127 and q[5].min() == -128 and not q[3].any()


def test_dequantized_error_is_within_half_a_step():
    w = _weights(np.float32)
    for scheme in SCHEMES.values():
        q, scale = quantize_weight(w, scheme)
        back = q.astype(np.float32) * scale
        rel = np.linalg.norm(back - w) / np.linalg.norm(w)
        assert rel < (0.01 if scheme.name == "int8" else 0.05), (scheme.name, rel)


def test_bad_inputs_are_one_line():
    with pytest.raises(UnsupportedError, match="choose one of int8, fp8"):
        get_scheme("int4")
    with pytest.raises(UnsupportedError, match="layers.0.q_proj.weight: dtype int8 cannot be quantized"):
        quantize_weight(np.zeros((2, 2), np.int8), SCHEMES["int8"], "layers.0.q_proj.weight")
    with pytest.raises(UnsupportedError, match="not a matrix"):
        quantize_weight(np.zeros((2, 2, 2), np.float32), SCHEMES["fp8"])
