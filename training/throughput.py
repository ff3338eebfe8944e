"""Model FLOPs of a LoRA training step and the MFU they give on the chip the run is on.

Model FLOPs per token (what the model needs, not what rematerialisation recomputes):

* a matmul weight of W parameters costs 2W in the forward and 2W in the backward pass (the
  gradient of its input); the frozen base weights get no weight gradient. Matmul weights are the
  layers' tensors of two or more axes and the output head (vocab x hidden, tied or not); tables
  read by token id are not (the spec's ``vocab_axes``). A stack of experts (an ``e`` axis among
  three or more) counts ``top_k / num_experts`` of its parameters (the spec's ``experts``); the
  router runs in full.
* attention: 4 x heads x head_dim x context per layer in the forward (scores and values; context
  = the sequence, or the window on sliding layers), twice that in the backward pass.
* the LoRA factors: 6 per parameter (forward, input and factor gradients).

MFU = FLOPs per token x tokens/s / (chips x the chip's dense bf16 peak). The peaks are the
vendors' figures; a chip not in the table (a CPU) gets no MFU.
"""

from __future__ import annotations

import dataclasses
import math
import re

from ckptbridge import layout, mapping
from ckptbridge.config import ModelConfig
from ckptbridge.specs import FamilySpec

# dense bf16 TFLOP/s per chip, by jax's device_kind (first match wins)
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"TPU v5 ?lite|TPU v5e", 197.0),
    (r"TPU v5p|TPU v5", 459.0),
    (r"TPU v6", 918.0),
    (r"TPU v4", 275.0),
    (r"H200", 989.0),
    (r"H100.*PCIe", 756.0),
    (r"H100", 989.0),
    (r"A100", 312.0),
)


def chip_peak_tflops(device_kind: str) -> float | None:
    """The dense bf16 peak of one chip of ``device_kind`` (``jax.devices()[0].device_kind``)."""
    for pattern, peak in PEAK_TFLOPS:
        if re.search(pattern, device_kind, re.IGNORECASE):
            return peak
    return None


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """Model FLOPs per trained token of a LoRA step, by part."""

    weights: float  # forward + input gradients of the matmul weights
    attention: float
    lora: float
    matmul_params: float  # active matmul parameters (experts scaled by top_k / num_experts)

    @property
    def total(self) -> float:
        return self.weights + self.attention + self.lora


def lora_step_flops(cfg: ModelConfig, spec: FamilySpec, seq_len: int, lora_params: int) -> StepFlops:
    """Model FLOPs per token of a LoRA training step on ``cfg`` at sequence length ``seq_len``."""
    experts = spec.experts(cfg) if spec.experts is not None else None
    params = float(cfg.vocab_size * cfg.hidden_size)  # the output head
    for e in mapping.entries(cfg, spec, ""):
        axes = layout.axes(e.tunix_layout)
        if len(e.tunix_shape) < 2 or set(axes) & set(spec.vocab_axes) or e.absent_keys:
            continue  # no matmul, or a row HF lacks that the layer does not use (kv-shared layers)
        n = float(math.prod(e.tunix_shape))
        if experts is not None and "e" in axes and len(axes) >= 3:  # an expert stack, not the router (d e)
            n *= experts.top_k / experts.num_experts
        params += n
    attention = 0.0
    for lay in cfg.layers:
        context = min(seq_len, cfg.sliding_window) if not lay.is_global and cfg.sliding_window else seq_len
        attention += 4.0 * cfg.num_heads * lay.head_dim * context
    return StepFlops(weights=2 * 2 * params, attention=3 * attention, lora=6.0 * lora_params, matmul_params=params)


def mfu(flops_per_token: float, tokens_per_s: float, chips: int, peak_tflops: float | None) -> float | None:
    if not peak_tflops or not tokens_per_s:
        return None
    return flops_per_token * tokens_per_s / (chips * peak_tflops * 1e12)
