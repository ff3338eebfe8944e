"""A GGUF model file read as its family's rows (F32, F16, BF16 and Q8_0 tensors).

Each GGUF tensor is found from the family's GGUF names (:class:`ckptbridge.specs.ggml.GGUFSpec`,
the same table the writer uses), and ggml's value changes are undone: q/k rows reordered back
from ggml's interleaved rotation (an exact permutation), norms stored as ``1 + w`` shifted back
(in float32, or float16 for a float16 model, as the writer computed them), experts stacked into
one tensor split again. Q8_0 is dequantized to float32 as gguf-py's ``gguf.quants.dequantize``
computes it (``d * q``); another dtype on request (``dtype``, rounded to nearest even).

A GGUF file does not carry the HF config, so the model's ``config.json`` is given (``--config``:
the file or its directory; non-weight files beside it go with the model). The HF dtype is the
weights' stored type (F32, F16, BF16; float32 for Q8_0) unless ``dtype`` says otherwise: norms,
which ggml stores in float32 whatever the weights, come back in it.
"""

from __future__ import annotations

import functools
import math
import threading
from collections import Counter

import numpy as np

from ckptbridge import mapping
from ckptbridge.errors import ConfigError, CorruptFileError, MismatchError, UnsupportedError
from ckptbridge.formats.gguf.model import NAME, _plan, _Tensor, family
from ckptbridge.io import gguf
from ckptbridge.io.safetensors import numpy_dtype
from ckptbridge.rows import ModelRows, config_from_option, matrix_rows, more
from ckptbridge.specs import family_for
from ckptbridge.specs.ggml import interleaved_rope_rows

# --dtype -> numpy dtype name (ml_dtypes' bfloat16)
DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
_STORED_DTYPE = {gguf.TensorType.F32: "F32", gguf.TensorType.F16: "F16", gguf.TensorType.BF16: "BF16",
                 gguf.TensorType.Q8_0: "F32"}


def detect(probe) -> bool:
    """A GGUF file holding a model (not a LoRA adapter)."""
    return probe.magic == gguf.MAGIC and gguf.read_gguf(probe.path).metadata.get("general.type") != "adapter"


def _uninterleave(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of :func:`ckptbridge.specs.ggml.interleaved_rope_rows`."""
    return (w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


class GGUFSource(ModelRows):
    """A GGUF model file checked against the rows of the model its HF config describes."""

    format = NAME
    row_addressable = True

    def __init__(self, file: gguf.GGUFFile, cfg, spec, prefix: str, entries: list[mapping.Entry],
                 tensors: list[_Tensor], dtype: np.dtype, config_dir: str | None):
        self.file, self.cfg, self.spec, self.prefix, self.entries = file, cfg, spec, prefix, entries
        self.path = file.path
        self._dtype = dtype
        self.config_dir = config_dir
        self._of_key = {k: (t, i) for t in tensors for i, k in enumerate(t.keys)}
        self._whole = threading.local()

    def dtype(self, entry: mapping.Entry) -> np.dtype:
        return self._dtype

    def key_info(self, key: str) -> tuple[np.dtype, tuple[int, ...]]:
        t, _ = self._of_key[key]
        return self._dtype, t.hf_shape

    def _values(self, t: _Tensor, index: int, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` (of the HF tensor as a matrix) of the ``index``-th HF tensor of ``t``,
        stored values (float32 for Q8_0)."""
        info = self.file.tensors[t.name]
        stored = self.file.array(t.name)
        n = matrix_rows(t.hf_shape)
        flat = stored.reshape(-1, stored.shape[-1]) if stored.ndim > 1 else stored.reshape(1, -1)
        part = flat[index * n + start:index * n + stop]
        if info.type is gguf.TensorType.Q8_0:
            return gguf.dequantize_q8_0(part, (len(part), t.hf_shape[-1]))
        return np.array(part)

    def _hf(self, t: _Tensor, index: int, start: int, stop: int) -> np.ndarray:
        """The same rows as HF stores them: ggml's value changes undone, in the source's dtype."""
        if t.rope_heads is not None and (start, stop) != (0, matrix_rows(t.hf_shape)):
            return self._hf(t, index, 0, matrix_rows(t.hf_shape))[start:stop]
        x = self._values(t, index, start, stop)
        if t.rope_heads is not None:
            x = _uninterleave(x.reshape(t.hf_shape), t.rope_heads).reshape(x.shape)
        if t.shift:
            work = np.dtype(np.float16 if self._dtype == np.float16 else np.float32)
            x = x.astype(work) - np.asarray(t.shift, work)
        return x.astype(self._dtype, copy=False)

    def key_rows(self, key: str, start: int, stop: int) -> np.ndarray:
        t, i = self._of_key[key]
        return self._hf(t, i, start, min(stop, matrix_rows(t.hf_shape)))

    def arrays(self, entry: mapping.Entry) -> list[np.ndarray]:
        out = []
        for key in entry.hf_keys:
            t, i = self._of_key[key]
            out.append(self._hf(t, i, 0, matrix_rows(t.hf_shape)).reshape(t.hf_shape))
        return out

    def hf_rows(self, blocks: mapping.Blocks, i: int, j: int) -> np.ndarray | None:
        if blocks.keyed:
            return np.stack([self.arrays_of(k) for k in blocks.entry.hf_keys[i:j]])
        key = blocks.entry.hf_keys[0]
        per = blocks.hf_rows * math.prod(blocks.entry.hf_shape[1:-1])
        rows = self.key_rows(key, i * per, j * per)
        return rows.reshape((j - i) * blocks.hf_rows, *blocks.entry.hf_shape[1:])

    def arrays_of(self, key: str) -> np.ndarray:
        t, i = self._of_key[key]
        return self._hf(t, i, 0, matrix_rows(t.hf_shape)).reshape(t.hf_shape)

    def assets(self) -> tuple[list[str], str] | None:
        from ckptbridge.formats.tunix import _config_assets

        return _config_assets(self.config_dir)

    def hf_plan(self, chunk_bytes: int, computed=()):
        """Every HF tensor in entry order, in blocks of rows of at most ``chunk_bytes``."""
        from ckptbridge.rows import HFPlan, HFTensor

        tensors, jobs = [], []
        for e in self.entries:
            for key in e.hf_keys:
                n, cols = matrix_rows(e.hf_shape), e.hf_shape[-1]
                per = max(1, chunk_bytes // (4 * cols))
                starts = range(0, n, per)
                tensors.append(HFTensor(key, self._dtype, e.hf_shape, len(starts)))
                jobs += [(4 * (min(s + per, n) - s) * cols, functools.partial(self._part, key, s, min(s + per, n)))
                         for s in starts]
        return HFPlan(tensors, jobs)

    def _part(self, key: str, start: int, stop: int):
        rows = self.key_rows(key, start, stop)
        shape = self._of_key[key][0].hf_shape
        return [(key, start, rows.reshape(shape) if start == 0 and stop >= matrix_rows(shape) else rows)]


def open_source(src: str, *, config: str | None = None, dtype: str | None = None, **_) -> GGUFSource:
    """Open the GGUF model file ``src`` with the model's HF ``config`` (config.json or its
    directory) and check every tensor it must hold (names, shapes, types) before any is read."""
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"dtype (--dtype) {dtype!r}: one of {', '.join(DTYPES)}")
    file = gguf.read_gguf(src)
    if file.metadata.get("general.type") == "adapter":
        raise UnsupportedError(f"{src}: a GGUF LoRA adapter, not a model; ckptbridge reads GGUF models (merge the "
                               "adapter into its base in the base's own format instead)")
    if config is None:
        raise ConfigError(f"{src}: a GGUF file carries no HF config; pass config (--config) with the model's "
                          "config.json (or its directory)")
    hf_config, where, config_dir = config_from_option(config)
    spec = family_for(hf_config, where)
    cfg = spec.parse_config(hf_config, where)
    spec_gguf, h = family(cfg, where)
    arch = file.metadata.get("general.architecture")
    if arch != spec_gguf.arch:
        raise MismatchError(f"{src}: general.architecture is {arch!r}, the config ({where}) is GGUF "
                            f"{spec_gguf.arch!r}; the file and the config belong to different models")
    prefix = cfg.default_key_prefix
    ents = mapping.entries(cfg, spec, prefix)
    tensors = _plan(cfg, spec_gguf, ents, lambda n, s: gguf.TensorType.F32, h)
    expected = {t.name: t for t in tensors}
    extra_names = {n for n, _ in (spec_gguf.extra(h) if spec_gguf.extra else [])}
    missing = [n for n in expected if n not in file.tensors]
    if missing:
        raise MismatchError(f"{src}: tensor {missing[0]!r} is missing{more(missing)}; the file does not hold the "
                            f"model {where} describes (wrong --config, or an incomplete file)")
    unexpected = sorted(n for n in file.tensors if n not in expected and n not in extra_names)
    if unexpected:
        raise MismatchError(f"{src}: unexpected tensor {unexpected[0]!r}{more(unexpected)}: not part of the "
                            f"{spec.name} model that {where} describes")
    types: Counter = Counter()
    for name, t in expected.items():
        info = file.tensors[name]
        if tuple(info.shape) != tuple(t.shape):
            raise MismatchError(f"{src}: tensor {name!r} has shape {list(info.shape)}, the config implies "
                                f"{list(t.shape)}; the file and the config disagree")
        if not isinstance(info.type, gguf.TensorType):
            raise UnsupportedError(f"{src}: tensor {name!r} is of ggml type {info.type}; ckptbridge reads F32, F16, "
                                   "BF16 and Q8_0 (re-export the model with one of them)")
        if len(t.shape) >= 2 and not name.endswith("_norm.weight"):
            types[info.type] += 1
    if not types:
        raise CorruptFileError(f"{src}: holds no weight matrix")
    stored = _STORED_DTYPE[types.most_common(1)[0][0]]
    return GGUFSource(file, cfg, spec, prefix, ents, tensors, numpy_dtype(DTYPES.get(dtype or "", stored)),
                      config_dir)


__all__ = ["DTYPES", "GGUFSource", "detect", "open_source"]
_ = interleaved_rope_rows  # the permutation undone here
