"""The merge stage: LoRA adapters added to a model's rows on their way to any writer.

:class:`Merged` is the source's :class:`~ckptbridge.rows.ModelRows` with every LoRA delta
``scale * B @ A`` added to the HF tensors it targets, in float32, the sum rounded to the tensor's
dtype: whole tensors, runs of rows and the pieces of the source's HF plan alike, each piece on
the worker that makes it, so that a merge is as streaming as the conversion it is part of.
Memory stays at the conversion's budget plus the adapters' factors, whatever the model size:
the factors are read once; a piece turns only its own rows of B into float32.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable, Iterator

import numpy as np

from ckptbridge import mapping
from ckptbridge.errors import MismatchError
from ckptbridge.rows import HFPlan, ModelRows, Part

Delta = tuple[int, float, np.ndarray, np.ndarray]  # (first row, scale, A, B) in PEFT layout
Deltas = dict[str, list[Delta]]  # HF key -> its deltas


def collect_deltas(keys: Collection[str], adapter, name: str, into: Deltas | None = None) -> Deltas:
    """Every LoRA delta of the opened ``adapter`` by the HF key it adds to (factors as stored,
    added to ``into``); a key the model lacks is a one-line MismatchError naming ``name``."""
    deltas: Deltas = {} if into is None else into
    for key, row, scale, (a, b) in adapter.deltas():
        if key not in keys:
            raise MismatchError(f"{name}: LoRA for {key}, which the base does not have")
        deltas.setdefault(key, []).append((row, scale, np.array(a), np.array(b)))
    return deltas


def add_deltas(values: np.ndarray, deltas: list[Delta], start: int) -> np.ndarray:
    """``values`` (rows ``start:`` of an HF tensor seen as a matrix of its last axis, any shape)
    with ``deltas`` added: the products and the sum in float32, rounded to ``values``' dtype."""
    base = values.reshape(-1, values.shape[-1])
    stop = start + len(base)
    if len(deltas) == 1 and deltas[0][0] == 0 and len(deltas[0][3]) >= stop:  # one delta on every row
        _, scale, a, b = deltas[0]
        merged = (b[start:stop].astype(np.float32) * np.float32(scale)) @ a.astype(np.float32)
        merged += base  # W becomes float32 inside the ufunc, piecewise
    else:  # deltas on row ranges (one per expert)
        merged = base.astype(np.float32)
        for row, scale, a, b in deltas:
            lo, hi = max(start, row), min(stop, row + len(b))
            if lo < hi:
                merged[lo - start:hi - start] += (b[lo - row:hi - row].astype(np.float32) * np.float32(scale)) \
                    @ a.astype(np.float32)
    return merged.astype(values.dtype).reshape(values.shape)


class AsTrained:
    """The weights a QLoRA run trained its LoRA modules against: qwix's quantization of the base's
    rows in the run's parameter dtype, dequantized by qwix. qwix keeps a scale per output channel
    (HF's (out, in) rows) and, with ``tile``, per tile of the last axis its weight contracts over:
    absmax over the tile and over the other contracted axes (the heads of an output projection,
    whose inputs are HF's ``heads x head_dim`` columns). Either way a row's scales depend on that
    row alone, so row blocks give the same values as whole tensors. ``contracted``: by HF key, the
    axes the Tunix weight contracts over, in HF's column order (the module's Tunix LoRA A shape
    without its rank), needed with a tile. Needs qwix (``pip install 'ckptbridge[verify]'``); runs
    on the host's CPU."""

    def __init__(self, scheme: str, tile: int | None, param_dtype: str,
                 contracted: dict[str, tuple[int, ...]] | None = None):
        from ckptbridge.options import QLORA_SCHEMES

        if scheme not in QLORA_SCHEMES:
            raise MismatchError(f"--as-trained: base quantization {scheme!r} is not one this version rebuilds "
                                f"({', '.join(QLORA_SCHEMES)})")
        self.scheme, self.tile, self.dtype = scheme, tile, np.dtype(_dtype(param_dtype))
        self.contracted = contracted or {}

    def __call__(self, values: np.ndarray, key: str = "") -> np.ndarray:
        import jax
        import jax.numpy as jnp
        import qwix

        matrix = values.reshape(-1, values.shape[-1])
        how: dict = {"channelwise_axes": [0]}
        if self.tile:  # rows x the contracted axes; the last one in tiles, the others reduced
            axes = self.contracted.get(key, (matrix.shape[1],))
            if int(np.prod(axes)) != matrix.shape[1] or axes[-1] % self.tile:
                raise MismatchError(f"--as-trained: {key} {values.shape}: its inputs {axes} do not take tiles of "
                                    f"{self.tile}; the adapter was not trained on this base")
            matrix = matrix.reshape(len(matrix), *axes)
            how["tiled_axes"] = {len(axes): self.tile}
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            q = qwix.quantize(jnp.asarray(matrix.astype(self.dtype)), self.scheme, **how)
            return np.asarray(qwix.dequantize(q)).reshape(values.shape)


def base_digest(rows: ModelRows) -> str | None:
    """A digest of the weights of ``rows``' LoRA-able modules: the first row of each (HF layout, as
    float32), by key without the source's prefix. A QLoRA run records it with its base quantization,
    and ``merge --as-trained`` compares it with the base it is given, so that another base of the
    same shapes (another fine-tune) is refused rather than merged into silently. None for a source
    that cannot read a row on its own (an Orbax checkpoint)."""
    import hashlib

    from ckptbridge.lora.base import make_base

    if not rows.row_addressable:
        return None
    base = make_base(rows.path, rows.cfg, rows.spec, rows.prefix)
    held = set(rows.hf_keys())
    keys = sorted((k for k in map(base.weight_key, base.by_hf_module()) if k in held),
                  key=lambda k: k[len(rows.prefix):])
    digest = hashlib.blake2b(digest_size=16)
    for key in keys:
        digest.update(key[len(rows.prefix):].encode())
        digest.update(np.ascontiguousarray(rows.key_rows(key, 0, 1), np.float32).tobytes())
    return digest.hexdigest()


def check_trained_base(rows: ModelRows, record: dict, adapter: str) -> None:
    """Refuse, in one line, a base other than the one ``adapter``'s QLoRA run quantized (its
    ``base_digest``; nothing to compare where the run or this source could not take one)."""
    recorded = record.get("base_digest")
    if not recorded:
        return
    found = base_digest(rows)
    if found is not None and found != recorded:
        raise MismatchError(f"--as-trained: {rows.path} is not the base {adapter} was trained on (the weights of its "
                            f"LoRA modules differ: digest {found}, the run recorded {recorded}); merge into the base "
                            "the run quantized, or leave out --as-trained")


def _dtype(name: str):
    import ml_dtypes

    return ml_dtypes.bfloat16 if name == "bfloat16" else name


class Merged(ModelRows):
    """``inner``'s rows with ``deltas`` added (see the module docstring); with ``as_trained``, the
    rows the deltas go to are first the quantized base a QLoRA run held (:class:`AsTrained`)."""

    def __init__(self, inner: ModelRows, deltas: Deltas, as_trained: AsTrained | None = None):
        self.inner, self.deltas, self.as_trained = inner, deltas, as_trained
        self.format, self.path = inner.format, inner.path
        self.cfg, self.spec, self.prefix, self.entries = inner.cfg, inner.spec, inner.prefix, inner.entries
        self.towers_dropped, self.scan_layers = inner.towers_dropped, inner.scan_layers
        self.tower_entries, self.tower_spelling = inner.tower_entries, inner.tower_spelling  # (passed through)
        self.row_addressable = inner.row_addressable
        self.merged_keys = list(deltas)

    def _add(self, key: str, start: int, values: np.ndarray) -> np.ndarray:
        found = self.deltas.get(key)
        if not found:
            return values
        if self.as_trained is not None:
            return add_deltas(self.as_trained(values, key), found, start).astype(values.dtype)
        return add_deltas(values, found, start)

    def dtype(self, entry: mapping.Entry) -> np.dtype:
        return self.inner.dtype(entry)

    def key_info(self, key: str):
        return self.inner.key_info(key)

    def arrays(self, entry: mapping.Entry) -> list[np.ndarray]:
        return [self._add(k, 0, v) for k, v in zip(entry.hf_keys, self.inner.arrays(entry))]

    def hf_rows(self, blocks: mapping.Blocks, i: int, j: int) -> np.ndarray | None:
        hf = self.inner.hf_rows(blocks, i, j)
        if hf is None:
            return None
        keys = blocks.entry.hf_keys
        if not blocks.keyed:
            per_index = blocks.hf_rows * int(np.prod(blocks.entry.hf_shape[1:-1], dtype=np.int64))
            return self._add(keys[0], i * per_index, hf)
        return np.stack([self._add(keys[n], 0, hf[n - i]) for n in range(i, j)])

    def key_rows(self, key: str, start: int, stop: int) -> np.ndarray:
        return self._add(key, start, self.inner.key_rows(key, start, stop))

    def block_ranges(self, blocks: mapping.Blocks, max_bytes: int):
        return self.inner.block_ranges(blocks, max_bytes)

    def position(self, key: str):
        return self.inner.position(key)

    def byte_range(self, key: str):
        return None if key in self.deltas else self.inner.byte_range(key)

    def assets(self):
        return self.inner.assets()

    def asset_dir(self):
        return self.inner.asset_dir()

    def hf_keys(self) -> list[str]:
        return self.inner.hf_keys()

    def hf_plan(self, chunk_bytes: int, computed: Collection[str] = (), towers: bool = True) -> HFPlan:
        """The inner source's plan with every delta's tensor computed, each piece merged by its job
        (counted twice where the source's pieces do not count their float32 rows already)."""
        plan = self.inner.hf_plan(chunk_bytes, set(computed) | set(self.deltas), towers)
        weight = 1 if self.inner.row_addressable else 2
        return HFPlan(plan.tensors, self._merged_jobs(plan.jobs, weight))

    def _merged_jobs(self, jobs: Iterable, weight: int) -> Iterator:
        for cost, make in jobs:
            yield cost * weight, functools.partial(self._merged_parts, make)

    def _merged_parts(self, make) -> list[Part]:
        return [(key, row, self._add(key, row, v)) for key, row, v in make()]

    def close(self) -> None:
        self.inner.close()


__all__ = ["Deltas", "Merged", "add_deltas", "collect_deltas"]
