"""A GGUF model file read as its family's rows (F32, F16, BF16 and Q8_0 tensors).

Each GGUF tensor is found from the family's GGUF names (:class:`ckptbridge.specs.ggml.GGUFSpec`,
the same table the writer uses), and ggml's value changes are undone: q/k rows reordered back
from ggml's interleaved rotation (an exact permutation), norms stored as ``1 + w`` shifted back
(in float32, or float16 for a float16 model, as the writer computed them), experts stacked into
one tensor split again. Q8_0 is dequantized to float32 as gguf-py's ``gguf.quants.dequantize``
computes it (``d * q``); another dtype on request (``dtype``, rounded to nearest even).

A GGUF file does not carry the HF config, so the model's ``config.json`` is given (``--config``:
the file or its directory; non-weight files beside it go with the model). A multimodal model's
towers are read from ggml's projector file beside it (``mmproj-`` before its name, or
``--mmproj``), their value changes undone (:mod:`ckptbridge.formats.gguf.mmproj`). The HF dtype is the
weights' stored type (F32, F16, BF16; float32 for Q8_0) unless ``dtype`` says otherwise: norms,
which ggml stores in float32 whatever the weights, come back in it.
"""

from __future__ import annotations

import functools
import math
import threading
from collections import Counter
from collections.abc import Collection

import numpy as np

from ckptbridge import mapping
from ckptbridge.errors import ConfigError, CorruptFileError, InputNotFoundError, MismatchError, UnsupportedError
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
                 tensors: list[_Tensor], dtype: np.dtype, config_dir: str | None,
                 projector: tuple[gguf.GGUFFile, list, dict] | None = None):
        self.file, self.cfg, self.spec, self.prefix, self.entries = file, cfg, spec, prefix, entries
        self.path = file.path
        self._dtype = dtype
        self.config_dir = config_dir
        self._of_key = {k: (t, i) for t in tensors for i, k in enumerate(t.keys)}
        self._whole = threading.local()
        self.projector_file: gguf.GGUFFile | None = projector[0] if projector is not None else None
        proj = projector[1] if projector is not None else []
        self.tower_spelling = projector[2] if projector is not None else {}
        self._proj = {t.key: t for t in proj}
        self.tower_entries = [t.entry for t in proj]

    def dtype(self, entry: mapping.Entry) -> np.dtype:
        return self._dtype

    def key_info(self, key: str) -> tuple[np.dtype, tuple[int, ...]]:
        if key in self._proj:
            return self._dtype, self._proj[key].entry.hf_shape
        t, _ = self._of_key[key]
        return self._dtype, t.hf_shape

    def _tower(self, key: str) -> np.ndarray:
        from ckptbridge.formats.gguf.mmproj import from_gguf

        t = self._proj[key]
        assert self.projector_file is not None
        stored = self.projector_file.array(t.name)
        if self.projector_file.tensors[t.name].type is gguf.TensorType.Q8_0:
            stored = gguf.dequantize_q8_0(stored, t.shape)
        return from_gguf(t, np.array(stored), self._dtype)

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
        if key in self._proj:
            whole = self._tower(key)
            return whole.reshape(-1, whole.shape[-1] if whole.ndim else 1)[start:stop]
        t, i = self._of_key[key]
        return self._hf(t, i, start, min(stop, matrix_rows(t.hf_shape)))

    def arrays(self, entry: mapping.Entry) -> list[np.ndarray]:
        if entry.tower is not None:
            return [self._tower(entry.hf_keys[0])]
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

    def hf_plan(self, chunk_bytes: int, computed=(), towers: bool = True):
        """Every HF tensor in entry order, in blocks of rows of at most ``chunk_bytes`` (``towers``:
        False for the text model's alone)."""
        from ckptbridge.rows import HFPlan, HFTensor

        tensors, jobs = [], []
        for e in self.tower_entries if towers else ():  # (ggml's converter reads the projector's tensors first too)
            key = e.hf_keys[0]
            tensors.append(HFTensor(key, self._dtype, e.hf_shape))
            jobs.append((4 * max(1, math.prod(e.hf_shape)), functools.partial(self._tower_part, key)))
        for e in self.entries:
            for key in e.hf_keys:
                n, cols = matrix_rows(e.hf_shape), e.hf_shape[-1]
                per = max(1, chunk_bytes // (4 * cols))
                starts = range(0, n, per)
                tensors.append(HFTensor(key, self._dtype, e.hf_shape, len(starts)))
                jobs += [(4 * (min(s + per, n) - s) * cols, functools.partial(self._part, key, s, min(s + per, n)))
                         for s in starts]
        return HFPlan(tensors, jobs)

    def _tower_part(self, key: str):
        return [(key, 0, self._tower(key))]

    def _part(self, key: str, start: int, stop: int):
        rows = self.key_rows(key, start, stop)
        shape = self._of_key[key][0].hf_shape
        return [(key, start, rows.reshape(shape) if start == 0 and stop >= matrix_rows(shape) else rows)]


def open_source(src: str, *, config: str | None = None, dtype: str | None = None, mmproj: str | None = None,
                **_) -> GGUFSource:
    """Open the GGUF model file ``src`` with the model's HF ``config`` (config.json or its
    directory) and check every tensor it must hold (names, shapes, types) before any is read; a
    multimodal model's towers from its projector file (``mmproj``, default: beside ``src`` under
    ggml's name, where there is one)."""
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
    _check_tensors(src, file, {n: t.shape for n, t in expected.items()}, f"{spec.name} model", where, extra_names)
    types: Counter = Counter()
    for name, t in expected.items():
        info = file.tensors[name]
        if len(t.shape) >= 2 and not name.endswith("_norm.weight"):
            types[info.type] += 1
    if not types:
        raise CorruptFileError(f"{src}: holds no weight matrix")
    stored = _STORED_DTYPE[types.most_common(1)[0][0]]
    return GGUFSource(file, cfg, spec, prefix, ents, tensors, numpy_dtype(DTYPES.get(dtype or "", stored)),
                      config_dir, _projector(src, mmproj, cfg, spec, prefix, where, config_dir))


def _projector(src: str, path: str | None, cfg, spec, prefix: str, where: str, config_dir: str):
    """The projector file of ``src``'s towers checked against the tower rows ``cfg`` configures
    (names, shapes, types): ``path``, or ggml's name beside ``src`` where that exists; None for a
    text model or where there is none (the text model alone is read)."""
    import logging
    import os

    from ckptbridge.formats.gguf import mmproj

    found = path or mmproj.projector_path(src)
    if not cfg.towers or prefix not in spec.tower_roots:
        if path:
            raise ConfigError(f"--mmproj {path}: the model {where} describes has no vision or audio tower")
        return None
    if not os.path.isfile(found):
        if path:
            raise InputNotFoundError(f"--mmproj {path}: no such file")
        logging.getLogger(__name__).warning("%s: no projector file %s beside it: the %s towers are not read", src,
                                            found, " and ".join(cfg.towers))
        return None
    file = gguf.read_gguf(found)
    if file.metadata.get("general.architecture") != mmproj.ARCH:
        raise MismatchError(f"{found}: general.architecture is {file.metadata.get('general.architecture')!r}, not "
                            f"{mmproj.ARCH!r}: not a projector file (give the projector with --mmproj)")
    from ckptbridge.formats.hf import spelling_beside

    spelling = spelling_beside(config_dir, spec, prefix)
    tensors = mmproj.plan_entries(spec, cfg, mapping.tower_entries(cfg, spec, prefix, spelling=spelling),
                                  gguf.TensorType.F32, where)
    _check_tensors(found, file, {t.name: t.shape for t in tensors}, "towers", where)
    return file, tensors, spelling


def _check_tensors(path: str, file: gguf.GGUFFile, expected: dict[str, tuple[int, ...]], what: str, where: str,
                   extra: Collection[str] = ()) -> None:
    """Every tensor ``expected`` (name -> shape) in the GGUF ``file`` at ``path``, of its shape and of a
    type ckptbridge reads, and no other (but ``extra``); one line naming the first that is not."""
    missing = [n for n in expected if n not in file.tensors]
    if missing:
        raise MismatchError(f"{path}: tensor {missing[0]!r} is missing{more(missing)}; the file does not hold the "
                            f"{what} {where} describes (wrong --config, or an incomplete file)")
    unexpected = sorted(n for n in file.tensors if n not in expected and n not in extra)
    if unexpected:
        raise MismatchError(f"{path}: unexpected tensor {unexpected[0]!r}{more(unexpected)}: not part of the "
                            f"{what} that {where} describes")
    for name, shape in expected.items():
        info = file.tensors[name]
        if tuple(info.shape) != tuple(shape):
            raise MismatchError(f"{path}: tensor {name!r} has shape {list(info.shape)}, the config implies "
                                f"{list(shape)}; the file and the config disagree")
        if not isinstance(info.type, gguf.TensorType):
            raise UnsupportedError(f"{path}: tensor {name!r} is of ggml type {info.type}; ckptbridge reads F32, F16, "
                                   "BF16 and Q8_0 (re-export the model with one of them)")


__all__ = ["DTYPES", "GGUFSource", "detect", "open_source"]
_ = interleaved_rope_rows  # the permutation undone here
