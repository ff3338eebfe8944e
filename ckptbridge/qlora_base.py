"""A QLoRA base written quantized once: qwix's arrays of the weights a QLoRA run holds quantized.

Training with ``base_quant`` quantizes every weight its LoRA rules match as it loads, on the host,
with qwix's own ``quantize_params`` against the abstract QLoRA model (:class:`Quantizer`). A
pre-quantized base (``convert HF DST --to tunix --quantize int8|int4|nf4 [--tile N]``) stores
what that computes, for every LoRA target of the family, as leaves of the Orbax checkpoint beside
the other parameters: ``<weight path>/array/qvalue`` and ``<weight path>/array/scale`` (4-bit
values one to a byte: TensorStore has no 4-bit type), and the run's settings in the metadata's
``base_quant`` (scheme, tile, parameter dtype, qwix version, the HF base's digest and the
quantized modules). Training loads those arrays as they are; ``merge --as-trained`` reads them
dequantized by qwix, which is the model the run trained against.
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np

from ckptbridge.errors import ConfigError

# stored forms of 4-bit values (int4; nf4's bucket indices, uint4), one to a byte
STORED = {"int4": np.dtype(np.int8), "uint4": np.dtype(np.uint8)}
QVALUE, SCALE = ("array", "qvalue"), ("array", "scale")


def rule(targets: tuple[str, ...], scheme: str, tile: int | None) -> dict:
    """The qwix LoRA rule of a QLoRA run on ``targets`` (its rank does not change the quantization)."""
    out: dict[str, Any] = {"module_path": f".*({'|'.join(targets)})", "rank": 1, "alpha": 1.0,
                           "weight_qtype": scheme}
    if tile:
        out["tile_size"] = tile
    return out


def logical_dtype(scheme: str) -> str:
    """The dtype of the quantized values qwix keeps for ``scheme``."""
    return {"nf4": "uint4"}.get(scheme, scheme)


def stored(value: np.ndarray) -> np.ndarray:
    """``value`` as a checkpoint stores it (4-bit values one to a byte)."""
    wide = STORED.get(str(value.dtype))
    return value.astype(wide) if wide is not None else value


def restored(value: np.ndarray, scheme: str) -> np.ndarray:
    """A stored quantized value back in qwix's dtype for ``scheme``."""
    import ml_dtypes

    dtype = logical_dtype(scheme)
    return value.astype(getattr(ml_dtypes, dtype)) if dtype in STORED else value


class Quantizer:
    """A base weight as the QLoRA model holds it: qwix's own ``quantize_params`` against the
    abstract model (which knows how each weight is quantized), on the host's CPU device, one
    tensor at a time; the result as numpy arrays (``{"array": {"qvalue", "scale"}}``)."""

    def __init__(self, abstract_model):
        import jax

        self.model = abstract_model
        self.cpu = jax.local_devices(backend="cpu")[0]

    def _quantized(self, real_path: tuple, value):
        import qwix

        tree: dict = {}
        node = tree
        for k in real_path[:-1]:
            node = node.setdefault(k, {})
        node[real_path[-1]] = value
        found = qwix.quantize_params(tree, self.model)
        for k in real_path:
            found = found[k]
        return found

    def __call__(self, path: tuple[str, ...], real_path: tuple, value: np.ndarray) -> dict:
        import jax

        out = jax.tree.map(np.asarray, self._quantized(real_path, jax.device_put(value, self.cpu)))
        # qwix's intermediates hold their buffers in reference cycles: freed now, not at the next
        # full collection (a 4-layer 31B base grew by 0.8 GB between collections)
        gc.collect()
        return out

    def produces(self, real_path: tuple, shape: tuple, dtype) -> dict:
        """The parts' shapes and dtypes that quantizing a ``dtype`` weight gives (the scale takes
        the weight's dtype, whatever the abstract model says), computed without any data."""
        import jax

        return jax.eval_shape(lambda v: self._quantized(real_path, v), jax.ShapeDtypeStruct(tuple(shape), dtype))


def dequantize(qvalue: np.ndarray, scale: np.ndarray, scheme: str) -> np.ndarray:
    """qwix's dequantization of a stored weight (the values the QLoRA model computes with), in
    the scale's dtype, on the host's CPU device."""
    import jax
    import jax.numpy as jnp
    import qwix

    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        q = qwix.QArray(qvalue=jnp.asarray(restored(qvalue, scheme)), scale=jnp.asarray(scale), qtype=scheme)
        return np.asarray(qwix.dequantize(q))


def check_settings(record: dict, base: str, scheme: str, tile: int | None, param_dtype: str) -> tuple[str, int | None]:
    """A run's ``base_quant`` and ``base_quant_tile`` on a pre-quantized ``base`` (its ``record``):
    the base's when the run names none; one that disagrees is refused in one line."""
    want = record.get("scheme")
    if scheme not in ("none", want):
        raise ConfigError(f"base_quant={scheme}: {base} is a QLoRA base quantized as {want}; leave base_quant out "
                          f"(it is read from the base) or set base_quant={want}, or train on the HF model")
    if tile is not None and tile != record.get("tile"):
        raise ConfigError(f"base_quant_tile={tile}: {base} was quantized with "
                          f"{'tile ' + str(record.get('tile')) if record.get('tile') else 'one scale per channel'}; "
                          "leave base_quant_tile out (it is read from the base)")
    if param_dtype != record.get("param_dtype"):
        raise ConfigError(f"param_dtype={param_dtype}: {base} was quantized from {record.get('param_dtype')} weights "
                          f"(qwix's scales are in that dtype); set param_dtype={record.get('param_dtype')} or "
                          "quantize the base again with that dtype")
    return str(want), record.get("tile")


__all__ = ["QVALUE", "SCALE", "STORED", "Quantizer", "check_settings", "dequantize", "logical_dtype", "restored",
           "rule", "stored"]
