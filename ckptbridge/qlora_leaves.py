"""The leaves of a QLoRA base written quantized (``convert HF DST --to tunix --quantize
int8|int4|nf4 [--tile N]``): for every weight the QLoRA model of the family's LoRA targets holds
quantized, qwix's arrays of it, computed once by qwix's own ``quantize_params`` against the
abstract QLoRA model (what training's loader computes, bit for bit), each part an Orbax leaf of
its own.

It needs the Tunix model builder (qwix quantizes a weight as the model's LoRA rules say), which no
file conversion loads: the conversion layer hands :func:`quantized_leaves` to the Tunix writer
(its ``quantized_leaves`` argument) only when ``--quantize`` asks for a QLoRA base.
"""

from __future__ import annotations

import functools
import math
import threading

import numpy as np

from ckptbridge import deps, layout, mapping, qlora_base
from ckptbridge.deps import installed_version
from ckptbridge.errors import ConfigError
from ckptbridge.io import orbax as orbax_io
from ckptbridge.metadata import installed_tunix_version
from ckptbridge.rows import HELD_PER_BYTE, ModelRows

# What quantizing one weight holds at its peak, per byte of its quantized values: the weight read
# (2 bytes a value in bfloat16), its float32 copy and qwix's float32 temporaries
QUANTIZE_HELD = 12


def quantized_leaves(rows: ModelRows, ents: list[mapping.Entry], scheme: str, tile: int | None,
                      target: str | None, chunk_bytes: int) -> tuple[dict, dict]:
    """The leaves of a QLoRA base (``qlora_base``): for every weight the QLoRA model of the
    family's LoRA targets holds quantized, qwix's arrays of it (computed once per weight, each
    part a leaf), and the metadata's ``base_quant`` record."""
    deps.require("verify")
    from ckptbridge.merge import base_digest
    from ckptbridge.tunix_model import TunixModelPlan, _flat, _lookup, _real_path

    if target != installed_tunix_version():
        raise ConfigError(f"--quantize: the quantized layouts are the installed google-tunix's "
                          f"({installed_tunix_version()}); drop --tunix-version {target}")
    pdtype = np.dtype(rows.dtype(rows.entries[0]))
    targets = rows.spec.lora_targets
    plan = TunixModelPlan.of_config(rows.cfg, param_dtype=pdtype, allow_config_mismatch=True,
                                    lora_rules=[qlora_base.rule(targets, scheme, tile)])
    pure = plan.abstract_state.to_pure_dict()
    quantize = qlora_base.Quantizer(plan.abstract_model())
    out: dict = {}
    for e in ents:
        node = _lookup(pure, e.tunix_path) if not e.tower else None
        if not isinstance(node, dict):
            continue
        real_path = _real_path(pure, e.tunix_path)
        shape = dict(_flat(node))[qlora_base.QVALUE].shape
        parts = dict(_flat(quantize.produces(real_path, shape, pdtype)))  # the scale in the weights' dtype
        qvalue = parts[qlora_base.QVALUE]
        per = max(1, chunk_bytes // max(1, math.prod(qvalue.shape[1:]))) if qvalue.shape else 1
        blocks = [(i, min(i + per, qvalue.shape[0])) for i in range(0, qvalue.shape[0], per)] if qvalue.shape else []
        held = _Quantized(functools.partial(_quantize_one, rows, e, quantize, real_path, shape, pdtype),
                          {sub: (max(1, len(blocks)) if sub == qlora_base.QVALUE else 1) for sub in parts})
        for sub, abstract in parts.items():
            dtype = qlora_base.STORED.get(str(abstract.dtype), np.dtype(abstract.dtype))
            if sub == qlora_base.QVALUE and len(blocks) > 1:
                # in row blocks of about a chunk, each an Orbax chunk of its own (as every large
                # leaf is written): the first holds the quantization of the whole weight
                pieces = [((slice(i, j),) + (slice(None),) * (len(abstract.shape) - 1),
                           functools.partial(_part, held, sub, slice(i, j))) for i, j in blocks]
                out[e.tunix_path + sub] = orbax_io.LazyArray(
                    abstract.shape, dtype, chunks=(per,) + tuple(abstract.shape[1:]), pieces=pieces,
                    held=HELD_PER_BYTE, first_held=QUANTIZE_HELD * math.prod(abstract.shape) * dtype.itemsize)
                continue
            out[e.tunix_path + sub] = orbax_io.LazyArray(
                abstract.shape, dtype, produce=functools.partial(_part, held, sub, slice(None)),
                held=QUANTIZE_HELD if sub == qlora_base.QVALUE else HELD_PER_BYTE)
    record = {"scheme": scheme, "tile": tile, "param_dtype": pdtype.name, "qwix_version": installed_version("qwix"),
              "base_digest": base_digest(rows), "targets": list(targets), "weights": len({p[:-2] for p in out})}
    return out, record


def _quantize_one(rows: ModelRows, e: mapping.Entry, quantize, real_path: tuple, shape: tuple, pdtype) -> dict:
    from ckptbridge.tunix_model import _flat

    value = np.asarray(rows.tunix_value(e))
    lay = mapping.layout_with_shape(e, tuple(shape))
    if lay is not None and lay != e.tunix_layout:  # the installed Tunix lays it out otherwise
        value = layout.rearrange(value, e.tunix_layout, lay, e.sizes)
    return dict(_flat(quantize(e.tunix_path, real_path, value.astype(pdtype, copy=False))))


class _Quantized:
    """The parts of one quantized weight, computed by the first piece asked for and each part
    dropped once its pieces are made (Orbax may write a weight's scale long after its values)."""

    def __init__(self, fn, uses: dict):
        self._fn, self._uses, self._parts = fn, dict(uses), None
        self._lock = threading.Lock()

    def get(self, sub: tuple[str, ...]) -> np.ndarray:
        with self._lock:
            if self._fn is not None:
                self._parts, self._fn = self._fn(), None
            assert self._parts is not None
            value = self._parts[sub]
            self._uses[sub] -= 1
            if self._uses[sub] <= 0:
                del self._parts[sub]
        return value


def _part(held: _Quantized, sub: tuple[str, ...], rows: slice) -> np.ndarray:
    value = held.get(sub)
    return qlora_base.stored(value[rows] if value.ndim else value)


__all__ = ["QUANTIZE_HELD", "quantized_leaves"]
