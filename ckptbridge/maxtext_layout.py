"""MaxText's parameter tree for a model, from its family's rows and :class:`MaxTextSpec`.

Unscanned, each row of each layer is one MaxText parameter at ``decoder/layers_{i}/<path>``.
With ``scan_layers`` the rows of every layer are one parameter at ``decoder/layers/<path>``,
stacked on axis 1 (MaxText's ``param_scan_axis``): the layout gains a layer axis ``l`` after its
first axis (a query ``d n h`` is ``d l n h``, a stacked expert ``e d m`` is ``e l d m``).
``tests/data/maxtext/expected.json`` holds what MaxText's own mapping gives for the same configs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import numpy as np

from ckptbridge import layout, mapping
from ckptbridge.errors import MismatchError
from ckptbridge.specs.maxtext import MaxTextSpec

SCAN_AXIS = 1  # MaxText's param_scan_axis (base.yml)
LAYER_AXIS = "l"


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One MaxText parameter: its path under ``params/params``, its layout and axis sizes, and the
    rows it holds (one, or one per layer in layer order when scanned)."""

    path: tuple[str, ...]
    layout: str
    sizes: dict
    entries: tuple[mapping.Entry, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return layout.shape(self.layout, self.sizes)

    @property
    def key(self) -> str:
        """MaxText's flat name of the parameter (``params-decoder-layers-...``)."""
        return "-".join(("params", *self.path))


def scanned_layout(unscanned: str) -> str:
    """``unscanned`` with the layer axis inserted at :data:`SCAN_AXIS`."""
    groups = [g[0] if len(g) == 1 else f"({' '.join(g)})" for g in layout.parse(unscanned)]
    return " ".join(groups[:SCAN_AXIS] + [LAYER_AXIS] + groups[SCAN_AXIS:])


def plan(entries: list[mapping.Entry], spec: MaxTextSpec, scan_layers: bool) -> list[Leaf]:
    """The MaxText parameters of ``entries`` (:func:`ckptbridge.mapping.entries`), model-scope
    first, then layer rows in rule order. A MismatchError when a row has no MaxText name, or when
    scanning meets layers whose rows or sizes differ (MaxText scans identical layers only)."""
    out: list[Leaf] = []
    by_rule: dict[str, list[mapping.Entry]] = {}
    for e in entries:
        name = spec.names.get(e.rule.name)
        if name is None:
            raise MismatchError(f"{e.hf_keys[0] if e.hf_keys else e.rule.name}: MaxText has no parameter for "
                                f"this tensor ({e.rule.name})")
        path, lay = name
        if e.layer is None:
            out.append(Leaf(tuple(path.split("/")), lay, e.sizes, (e,)))
        elif not scan_layers:
            out.append(Leaf(("decoder", f"layers_{e.layer.index}", *path.split("/")), lay, e.sizes, (e,)))
        else:
            by_rule.setdefault(e.rule.name, []).append(e)
    layers = {e.layer.index for e in entries if e.layer is not None}
    for rule, rows in by_rule.items():
        path, lay = spec.names[rule]
        if len(rows) != len(layers) or any(layout.shape(lay, r.sizes) != layout.shape(lay, rows[0].sizes)
                                           for r in rows):
            raise MismatchError(f"{rows[0].hf_keys[0]}: the layers differ in this tensor ({rule}), and MaxText "
                                "scans identical layers only; convert without --scan-layers")
        out.append(Leaf(("decoder", "layers", *path.split("/")), scanned_layout(lay),
                        {**rows[0].sizes, LAYER_AXIS: len(rows)}, tuple(rows)))
    return out


# --------------------------------------------------------------------------- value transforms


@dataclasses.dataclass(frozen=True)
class Transform:
    """A change of values MaxText's conversion makes on the way to MaxText, and its inverse, as
    MaxText computes them (dtype rules included). ``axis``: the axis it acts along, which a piece
    must hold whole; ``exact``: the inverse gives back every bit (a permutation), else each way
    rounds once to the stored dtype."""

    name: str
    axis: str
    exact: bool
    to_maxtext: Callable[[np.ndarray, int, int], np.ndarray]  # (values, axis index, axis size)
    to_hf: Callable[[np.ndarray, int, int], np.ndarray]
    maxtext_hook: str  # the hook of MaxText's param_mapping.py that makes it


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


def _scaled(x: np.ndarray, factor: float) -> np.ndarray:
    """``x * factor`` computed in float32 and cast back to ``x``'s dtype (MaxText's
    ``scale_query_layer``: a float32 scalar, float32 arithmetic)."""
    return (x.astype(np.float32) * np.float32(factor)).astype(x.dtype)


TRANSFORMS = {t.name: t for t in (
    Transform("rope_interleave", "h", True, _interleave, _deinterleave, "adjust_rope"),
    Transform("query_scale", "h", False,
              lambda x, ax, n: _scaled(x, 1 / np.sqrt(n)), lambda x, ax, n: _scaled(x, np.sqrt(n)),
              "scale_query_layer"),
)}


def transforms_of(spec: MaxTextSpec, rule: str) -> list[Transform]:
    return [TRANSFORMS[n] for n in spec.transforms.get(rule, ())]


def apply(x: np.ndarray, lay: str, sizes: Mapping[str, int], names: list[Transform], to_maxtext: bool) -> np.ndarray:
    """``x`` (in the unscanned MaxText layout ``lay``) through ``names`` towards MaxText, or back
    towards HF in reverse order."""
    groups = layout.parse(lay)
    for t in (names if to_maxtext else reversed(names)):
        ax = groups.index((t.axis,))  # a dimension of its own (the spec's layouts keep it so)
        x = (t.to_maxtext if to_maxtext else t.to_hf)(x, ax, int(sizes[t.axis]))
    return x
