"""``merge_lora``: base HF model + LoRA adapter -> merged HF model, streaming.

Every base tensor is written in turn: tensors without LoRA are copied as raw bytes, in
pieces; LoRA targets are merged a block of rows at a time, ``W + scale * B @ A`` accumulated
in float32 and written in the base tensor's dtype. Memory stays at about one block plus the
LoRA factors, whatever the model size.
"""

from __future__ import annotations

import time

import numpy as np

from ckptbridge import lora
from ckptbridge.convert import DEFAULT_MAX_SHARD_SIZE
from ckptbridge.errors import ConfigError, MismatchError
from ckptbridge.io.atomic import check_destination
from ckptbridge.io.hf import HFModelDir, write_model_directory
from ckptbridge.io.safetensors import PlannedTensor, numpy_dtype, parse_size

BLOCK_BYTES = 32 << 20  # float32 bytes of one block of merged rows


def _merged_rows(model: HFModelDir, key: str, scale: float, a: np.ndarray, b: np.ndarray):
    info = model.info(key)
    out_dim, in_dim = info.shape
    rows = max(1, BLOCK_BYTES // (4 * in_dim))
    a32 = a.astype(np.float32)
    b32 = b.astype(np.float32) * np.float32(scale)
    dtype = numpy_dtype(info.dtype)
    f = model.file_of(key)
    for start in range(0, out_dim, rows):
        w = f.rows(key, start, start + rows).astype(np.float32)
        w += b32[start:start + rows] @ a32
        yield w.astype(dtype)


def merge_lora(base: str, adapter: str, dst: str, *, step: int | None = None, alpha: float | None = None,
               max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE, overwrite: bool = False,
               progress: bool | None = None) -> dict:
    """Merge ``adapter`` (a PEFT directory or a Tunix/qwix Orbax LoRA checkpoint) into the HF
    model ``base`` and write the merged model to ``dst`` (sharded safetensors + index,
    config.json and the base's non-weight files). Returns a report."""
    t0 = time.perf_counter()
    try:
        shard_bytes = parse_size(max_shard_size)
    except ValueError as e:
        raise ConfigError(f"--max-shard-size: {e}") from None
    check_destination(dst, [base, adapter], overwrite)
    b = lora.open_base(base)
    with HFModelDir(base) as model, lora.open_adapter(adapter, b, step=step, alpha=alpha) as ad:
        deltas: dict[str, tuple[float, np.ndarray, np.ndarray]] = {}
        for module, scale, (a, b_) in lora.hf_deltas(ad):
            key = f"{module}.weight"
            if key not in model:
                raise MismatchError(f"{adapter}: LoRA for {module}, which the base {base} does not have")
            deltas[key] = (scale, np.array(a), np.array(b_))
        planned = []
        for key in model.keys():
            info = model.info(key)
            dtype = numpy_dtype(info.dtype)
            if key in deltas:
                scale, a, b_ = deltas[key]
                chunks = lambda key=key, scale=scale, a=a, b_=b_: _merged_rows(model, key, scale, a, b_)  # noqa: E731
            else:
                chunks = lambda key=key: model.file_of(key).raw_chunks(key)  # noqa: E731
            planned.append(PlannedTensor(key, dtype, info.shape, chunks=chunks))
        files = write_model_directory(dst, planned, model.config, shard_bytes, assets_from=base,
                                      overwrite=overwrite, desc="merge", progress=progress)
        return {
            "direction": "merge",
            "base": base,
            "adapter": adapter,
            "destination": dst,
            "family": b.spec.name,
            "merged_tensors": len(deltas),
            "copied_tensors": len(planned) - len(deltas),
            "bytes": sum(t.nbytes for t in planned),
            "files": files,
            "seconds": round(time.perf_counter() - t0, 3),
        }
