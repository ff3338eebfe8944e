"""MaxText's parameter tree for a model, from its family's rows and :class:`MaxTextSpec`.

Unscanned, each row of each layer is a MaxText parameter at ``decoder/layers_{i}/<path>`` (or
several: a row that fuses MaxText's parameters, :class:`~ckptbridge.specs.maxtext.Part`). With
``scan_layers`` the layers stack as the spec's :class:`~ckptbridge.specs.maxtext.Scan` says: all
at ``decoder/layers/<path>`` on axis 1 (MaxText's ``param_scan_axis``), so that the layout gains
a layer axis after its first axis (a query ``d n h`` is ``d blk n h``), or in blocks whose
positions nest on axis 2 (``d blk sub n h``). ``tests/data/maxtext/expected.json``
holds what MaxText's own mapping gives for the same configs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import ml_dtypes
import numpy as np

from ckptbridge import layout, mapping
from ckptbridge.errors import MismatchError, UnsupportedError
from ckptbridge.specs.maxtext import MaxTextSpec, Part

SCAN_AXIS = 1  # MaxText's param_scan_axis (base.yml)
_BF16 = np.dtype(ml_dtypes.bfloat16)
STACK_AXES = ("blk", "sub")  # the stacked layer axes: blocks (axis 1), positions in a block (axis 2)


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One MaxText parameter: its path under ``params/params``, its stored layout and axis sizes,
    the row's :class:`Part` it is, and the rows it holds: one, or one per stacked layer in order
    (blocks, then positions in a block) with ``stack`` the sizes of the stacked axes."""

    path: tuple[str, ...]
    layout: str
    sizes: dict
    entries: tuple[mapping.Entry, ...]
    part: Part
    stack: tuple[int, ...] = ()

    @property
    def shape(self) -> tuple[int, ...]:
        return layout.shape(self.layout, self.sizes)

    @property
    def key(self) -> str:
        """MaxText's flat name of the parameter (``params-decoder-layers-...``)."""
        return "-".join(("params", *self.path))

    def index(self, pos: int) -> tuple[int, ...]:
        """Where the ``pos``-th of :attr:`entries` sits along the stacked axes."""
        return divmod(pos, self.stack[1]) if len(self.stack) == 2 else (pos,) if self.stack else ()

    def region(self, pos: int, inner: tuple[slice, ...] | None = None) -> tuple[slice, ...]:
        """The box of the stored tensor that the ``pos``-th entry's box ``inner`` (default: all of
        it) fills."""
        if inner is None:  # the entry's own extent (short of a padded axis's end)
            inner = tuple(slice(0, n) for n in layout.shape(self.part.layout, self.entries[pos].sizes))
        return inner[:SCAN_AXIS] + tuple(slice(i, i + 1) for i in self.index(pos)) + inner[SCAN_AXIS:]

    def stacked(self, x: np.ndarray) -> np.ndarray:
        """One entry's values with the stacked axes (of length 1) inserted."""
        for _ in self.stack:
            x = np.expand_dims(x, SCAN_AXIS)
        return x

    def one(self, x: np.ndarray) -> np.ndarray:
        """The values of one entry from its box of the stored tensor (:meth:`stacked` undone)."""
        for _ in self.stack:
            x = np.take(x, 0, axis=SCAN_AXIS)
        return x


def scanned_layout(unscanned: str, n: int = 1) -> str:
    """``unscanned`` with ``n`` stacked axes inserted at :data:`SCAN_AXIS`."""
    groups = [g[0] if len(g) == 1 else f"({' '.join(g)})" for g in layout.parse(unscanned)]
    return " ".join(groups[:SCAN_AXIS] + list(STACK_AXES[:n]) + groups[SCAN_AXIS:])


def _first_key(e: mapping.Entry) -> str:
    return (e.hf_keys or e.absent_keys or (e.rule.name,))[0]


def _suffixed(path: str, suffix: str) -> tuple[str, ...]:
    names = path.split("/")
    return (names[0] + suffix, *names[1:])


def plan(entries: list[mapping.Entry], spec: MaxTextSpec, scan_layers: bool,
         flags: Mapping[str, bool] | None = None, vocab: int | None = None) -> list[Leaf]:
    """The MaxText parameters of ``entries`` (:func:`ckptbridge.mapping.entries`) of a model with
    model flags ``flags``, model-scope first, then layer rows. Rows HF lacks on a layer
    (``hf_absent``: kv-shared layers) have no MaxText parameter either. A MismatchError
    when a row has no MaxText name, or when scanning meets stacked layers whose rows or sizes
    differ (MaxText scans identical layers only) or layers past the last whole block. A part
    with ``pad`` holds ``vocab`` (default: the spec's MaxText vocabulary for HF's) along it."""
    flags = dict(flags or {})
    if scan_layers and spec.no_scan_when and flags.get(spec.no_scan_when):
        raise UnsupportedError("MaxText has no scanned form of this model (its decoder block does not scan); "
                               "convert without --scan-layers")
    out: list[Leaf] = []
    stacks: dict[tuple[int, str], dict[int, mapping.Entry]] = {}  # (group, part path) -> layer -> row
    scan = spec.scan
    n_layers = len({e.layer.index for e in entries if e.layer is not None})
    blocks = n_layers // scan.period
    if scan.suffixes and n_layers % scan.period:
        raise MismatchError(f"MaxText holds this model's layers in groups of {scan.period} and it has {n_layers}")
    for e in entries:
        if e.layer is not None and not e.hf_keys:
            continue
        parts = spec.parts(e.rule.name, {**flags, **(e.layer.flags if e.layer is not None else {})})
        if parts is None:
            raise MismatchError(f"{_first_key(e)}: MaxText has no parameter for this tensor ({e.rule.name})")
        for part in parts:
            sizes = dict(e.sizes)
            if part.pad:
                sizes[part.pad] = _padded(spec, part, e, vocab)
            if e.layer is None:
                out.append(Leaf(tuple(part.path.split("/")), part.layout, sizes, (e,), part))
                continue
            i = e.layer.index
            b, pos = divmod(i, scan.period)
            path = _suffixed(part.path, scan.suffixes[pos]) if scan.suffixes else tuple(part.path.split("/"))
            if not scan_layers:
                module = f"layers_{b if scan.suffixes else i}"
                out.append(Leaf(("decoder", module, *path), part.layout, sizes, (e,), part))
                continue
            if b >= blocks:
                if scan.remainder is None:
                    raise MismatchError(f"{_first_key(e)}: MaxText scans whole blocks of {scan.period} layers and "
                                        f"this model has {n_layers}; convert without --scan-layers")
                rest = scan.remainder.format(r=i - blocks * scan.period).split("/")
                out.append(Leaf(("decoder", *rest, *path), part.layout, sizes, (e,), part))
                continue
            group = next(g for g, (_, positions) in enumerate(scan.groups) if pos in positions)
            stacks.setdefault((group, part.path), {})[i] = e
    for (group, part_path), layers in stacks.items():
        module, positions = scan.groups[group]
        rows = [layers.get(b * scan.period + p) for b in range(blocks) for p in positions]
        first = next(r for r in rows if r is not None)
        layer_flags = first.layer.flags if first.layer is not None else {}
        part = next(pt for pt in spec.parts(first.rule.name, {**flags, **layer_flags}) or () if pt.path == part_path)
        path = (_suffixed(part_path, scan.suffixes[positions[0]]) if scan.suffixes
                else tuple(part_path.split("/")))
        if any(r is None or r.rule.name != first.rule.name
               or layout.shape(part.layout, r.sizes) != layout.shape(part.layout, first.sizes) for r in rows):
            raise MismatchError(f"{_first_key(first)}: the layers differ in this tensor ({first.rule.name}), and "
                                "MaxText scans identical layers only; convert without --scan-layers")
        stack = (blocks,) if len(positions) == 1 else (blocks, len(positions))
        sizes = {**first.sizes, **dict(zip(STACK_AXES, stack))}
        out.append(Leaf(("decoder", *module.split("/"), *path), scanned_layout(part.layout, len(stack)),
                        sizes, tuple(rows), part, stack))  # type: ignore[arg-type]  # no None left
    return out


def tower_plan(entries: list[mapping.Entry], spec: MaxTextSpec) -> list[Leaf]:
    """The MaxText parameters of a model's tower rows (:func:`ckptbridge.mapping.tower_entries`):
    one each, unstacked (MaxText scans no tower's layers), at the path the spec gives its row
    (``{i}``: its tower layer). A MismatchError for a row MaxText has no parameter for."""
    out = []
    for e in entries:
        name = spec.towers.get(e.tower or "", {}).get(e.rule.name)
        if name is None:
            raise MismatchError(f"{_first_key(e)}: MaxText has no parameter for this tensor of the {e.tower} tower")
        path, lay = name
        part = Part(path, lay)
        out.append(Leaf(tuple(path.replace("{i}", str(e.tower_layer)).split("/")), lay, dict(e.sizes), (e,), part))
    return out


def _padded(spec: MaxTextSpec, part: Part, e: mapping.Entry, vocab: int | None) -> int:
    """The length of ``part``'s padded axis in MaxText: ``vocab``, or the spec's for HF's."""
    have = int(e.sizes[part.pad])
    want = vocab if vocab is not None else spec.vocab.get(have, have)
    if want < have:
        raise MismatchError(f"{_first_key(e)}: MaxText's vocabulary ({want}) is smaller than the model's ({have}); "
                            "give one at least as large")
    return want


# --------------------------------------------------------------------------- value transforms


@dataclasses.dataclass(frozen=True)
class Transform:
    """A change of values MaxText's conversion makes on the way to MaxText, and its inverse, as
    MaxText computes them (dtype rules included). ``axis``: the axis it acts along, which a piece
    must hold whole; ``exact``: the inverse gives back every bit (a permutation), else each way
    rounds once to the stored dtype."""

    name: str
    axis: str  # "" for element by element
    exact: bool
    to_maxtext: Callable[[np.ndarray, int, int], np.ndarray]  # (values, axis index, axis size)
    to_hf: Callable[[np.ndarray, int, int], np.ndarray]
    maxtext_hook: str  # the hook of MaxText's param_mapping.py that makes it
    widens: bool = False  # MaxText stores its result as float32 whatever the source dtype


def _pairs(x: np.ndarray, ax: int, n: int, split: tuple[int, int]) -> np.ndarray:
    """``x`` with axis ``ax`` (length ``n``) seen as ``split`` and the two parts swapped."""
    y = np.moveaxis(x, ax, -1)
    y = y.reshape(*y.shape[:-1], *split).swapaxes(-1, -2).reshape(*y.shape[:-1], n)
    return np.ascontiguousarray(np.moveaxis(y, -1, ax))


def _interleave(x: np.ndarray, ax: int, n: int) -> np.ndarray:
    """HF's half-split RoPE order -> interleaved: out[2i] = x[i], out[2i + 1] = x[i + n/2]."""
    return _pairs(x, ax, n, (2, n // 2))


def _deinterleave(x: np.ndarray, ax: int, n: int) -> np.ndarray:
    return _pairs(x, ax, n, (n // 2, 2))


_PASS = 1 << 16  # elements per pass of :func:`_times`: its float32 working copy stays in cache


def _times(x: np.ndarray, factor, divide: bool = False) -> np.ndarray:
    """``x * factor`` (or ``x / factor``) with a float32 scalar in float32 arithmetic, rounded back
    to ``x``'s dtype. bfloat16 goes in cache-sized passes with both casts as integer operations (to
    float32: a shift; back: round to nearest even on the bits, as ml_dtypes rounds), the same bytes
    as NumPy's casts in a third of the time (a 31B embedding: 1.4 G values each way)."""
    f = np.float32(factor)
    if x.dtype != _BF16 or x.size < _PASS:
        y = x.astype(np.float32)
        return (np.divide(y, f, out=y) if divide else np.multiply(y, f, out=y)).astype(x.dtype)
    src = np.ascontiguousarray(x).view(np.uint16).reshape(-1)
    out = np.empty(src.shape, np.uint16)
    wide, low = np.empty(_PASS, np.uint32), np.empty(_PASS, np.uint32)
    op = np.divide if divide else np.multiply
    for i in range(0, len(src), _PASS):
        n = min(_PASS, len(src) - i)
        b, t = wide[:n], low[:n]
        b[...] = src[i:i + n]
        b <<= 16
        v = b.view(np.float32)
        with np.errstate(over="ignore"):  # to infinity, as NumPy's float32 product rounds it
            op(v, f, out=v)
        np.right_shift(b, 16, out=t)  # round to nearest, ties to even: + 0x7fff + the kept part's lowest bit
        t &= 1
        t += 0x7FFF
        b += t
        b >>= 16
        out[i:i + n] = b
    return out.view(x.dtype).reshape(x.shape)


def _scaled(x: np.ndarray, factor: float) -> np.ndarray:
    """``x * factor`` computed in float32 and cast back to ``x``'s dtype (MaxText's
    ``scale_query_layer``: a float32 scalar, float32 arithmetic)."""
    return _times(x, factor)


def _embed_scaled(x: np.ndarray, ax: int, n: int) -> np.ndarray:
    """``x * sqrt(n)`` with a float32 scalar, in float32, cast back (MaxText's
    ``pad_hf_embedding_layer``: NumPy 2 promotes a bf16 array times a float32 scalar to float32)."""
    return _times(x, np.sqrt(n))


def _embed_unscaled(x: np.ndarray, ax: int, n: int) -> np.ndarray:
    """``x / sqrt(n)`` the same way (its way back: a division, not a product with the inverse)."""
    return _times(x, np.sqrt(n), divide=True)


def _embed_scaled_bf16(x: np.ndarray, ax: int, n: int) -> np.ndarray:
    """``x * sqrt(n)`` with the scalar rounded to bfloat16 first (MaxText's
    ``pad_and_scale_embedding``, as HF's model casts ``embed_scale`` to the weights' dtype)."""
    return _times(x, _bf16(np.sqrt(n)))


def _embed_unscaled_bf16(x: np.ndarray, ax: int, n: int) -> np.ndarray:
    return _times(x, _bf16(np.sqrt(n)), divide=True)


def _bf16(v: float):
    return _BF16.type(v)


def _plus_one(x: np.ndarray, ax: int, n: int) -> np.ndarray:
    """An RMSNorm weight ``w`` (HF computes ``x * (1 + w)``) as MaxText's scale ``1 + w``,
    in float32 and kept so (MaxText's ``scale_rmsnorm``: NumPy 2 widens ``bf16 + 1.0``)."""
    return x.astype(np.float32) + np.float32(1)


def _minus_one(x: np.ndarray, ax: int, n: int) -> np.ndarray:
    return x.astype(np.float32) - np.float32(1)


TRANSFORMS = {t.name: t for t in (
    Transform("rope_interleave", "h", True, _interleave, _deinterleave, "adjust_rope"),
    Transform("query_scale", "h", False,
              lambda x, ax, n: _scaled(x, 1 / np.sqrt(n)), lambda x, ax, n: _scaled(x, np.sqrt(n)),
              "scale_query_layer"),
    Transform("embed_scale", "d", False, _embed_scaled, _embed_unscaled, "pad_hf_embedding_layer"),
    Transform("embed_scale_bf16", "d", False, _embed_scaled_bf16, _embed_unscaled_bf16, "pad_and_scale_embedding"),
    Transform("norm_plus_one", "", True, _plus_one, _minus_one, "scale_rmsnorm", widens=True),
)}


def transforms_of(spec: MaxTextSpec, entry: mapping.Entry) -> list[Transform]:
    """The value transforms MaxText's conversion applies to ``entry``'s row (a text or a tower row)."""
    if entry.tower is not None:
        return [TRANSFORMS[n] for n in spec.tower_transforms.get(entry.tower, {}).get(entry.rule.name, ())]
    return [TRANSFORMS[n] for n in spec.transforms.get(entry.rule.name, ())]


def apply(x: np.ndarray, lay: str, sizes: Mapping[str, int], names: list[Transform], to_maxtext: bool) -> np.ndarray:
    """``x`` (in the unscanned MaxText layout ``lay``) through ``names`` towards MaxText, or back
    towards HF in reverse order."""
    groups = layout.parse(lay)
    for t in (names if to_maxtext else reversed(names)):
        if not t.axis:  # element by element
            x = (t.to_maxtext if to_maxtext else t.to_hf)(x, -1, 0)
            continue
        ax = groups.index((t.axis,))  # a dimension of its own (the spec's layouts keep it so)
        x = (t.to_maxtext if to_maxtext else t.to_hf)(x, ax, int(sizes[t.axis]))
    return x


def stored_dtype(dtype: np.dtype, names: list[Transform]) -> np.dtype:
    """The dtype MaxText stores a tensor of ``dtype`` in after ``names``."""
    return np.dtype(np.float32) if any(t.widens for t in names) else np.dtype(dtype)
