"""Axis-pattern layouts in the style of einops, and the transforms between them.

A layout names the axes of a tensor, with parentheses for axes stored flattened together:
``"(k h) d"`` is a 2-D tensor whose first axis holds ``k`` blocks of ``h``. Given the axis
sizes, a layout gives the tensor's shape, and two layouts over the same axis names give the
rearrangement between them (and its inverse, by swapping the two).

Only reshapes and transposes are used, so any dtype (``ml_dtypes.bfloat16`` included) passes
through bit for bit.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Mapping

import numpy as np

_TOKEN = re.compile(r"\(|\)|[A-Za-z_][A-Za-z0-9_]*")


@functools.lru_cache(maxsize=None)
def parse(layout: str) -> tuple[tuple[str, ...], ...]:
    """``"(k h) d"`` -> ``(("k", "h"), ("d",))``: one tuple of axis names per tensor dimension."""
    groups: list[tuple[str, ...]] = []
    current: list[str] | None = None
    rest = layout
    for tok in _TOKEN.findall(layout):
        rest = rest.replace(tok, "", 1)
        if tok == "(":
            if current is not None:
                raise ValueError(f"nested parentheses in layout {layout!r}")
            current = []
        elif tok == ")":
            if current is None or not current:
                raise ValueError(f"unbalanced or empty parentheses in layout {layout!r}")
            groups.append(tuple(current))
            current = None
        elif current is not None:
            current.append(tok)
        else:
            groups.append((tok,))
    if current is not None or rest.strip():
        raise ValueError(f"malformed layout {layout!r}")
    names = [a for g in groups for a in g]
    if len(names) != len(set(names)):
        raise ValueError(f"repeated axis in layout {layout!r}")
    return tuple(groups)


def axes(layout: str) -> tuple[str, ...]:
    """All axis names of a layout, in storage order."""
    return tuple(a for g in parse(layout) for a in g)


def shape(layout: str, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """The tensor shape of ``layout`` for the given axis sizes."""
    try:
        return tuple(math.prod(sizes[a] for a in g) for g in parse(layout))
    except KeyError as e:  # a programming error in a spec, not a user error
        raise ValueError(f"layout {layout!r}: no size for axis {e.args[0]!r}") from None


def rearrange(x: np.ndarray, src: str, dst: str, sizes: Mapping[str, int]) -> np.ndarray:
    """Rearrange ``x`` from layout ``src`` to layout ``dst`` (same axis names)."""
    src_axes, dst_axes = axes(src), axes(dst)
    if sorted(src_axes) != sorted(dst_axes):
        raise ValueError(f"layouts {src!r} and {dst!r} name different axes")
    expected = shape(src, sizes)
    if tuple(x.shape) != expected:
        raise ValueError(f"tensor of shape {tuple(x.shape)} does not match layout {src!r} = {expected}")
    flat = x.reshape([sizes[a] for a in src_axes])
    perm = [src_axes.index(a) for a in dst_axes]
    if perm != list(range(len(perm))):
        flat = flat.transpose(perm)
    return flat.reshape(shape(dst, sizes))
