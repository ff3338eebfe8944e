"""The spec table evaluated against a config: every tensor of a model, in both namings.

:func:`entries` expands a family's rules over the model and its layers; :func:`hf_to_tunix`
and :func:`tunix_to_hf` are the two directions of one entry, both derived from its layouts.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np

from ckptbridge import layout
from ckptbridge.config import LayerConfig, ModelConfig
from ckptbridge.specs.base import FamilySpec, TensorRule

Path = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Entry:
    rule: TensorRule
    layer: LayerConfig | None
    hf_keys: tuple[str, ...]
    tunix_path: Path
    sizes: dict
    absent_keys: tuple[str, ...] = ()  # HF keys of a row HF does not have here (``hf_absent``)
    tunix_variant: str | None = None  # a later Tunix layout of the row (``tunix_layouts_after``) used here

    @property
    def tunix_layout(self) -> str:
        return self.tunix_variant or self.rule.tunix_layout

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return layout.shape(self.rule.hf_layout, self.sizes)

    @property
    def tunix_shape(self) -> tuple[int, ...]:
        return layout.shape(self.tunix_layout, self.sizes)

    @property
    def hf_stacked_layout(self) -> str:
        axis = self.rule.stack_axis
        return f"{axis} {self.rule.hf_layout}" if axis else self.rule.hf_layout

    @property
    def tunix_name(self) -> str:
        return ".".join(self.tunix_path)

    @property
    def key_prefix(self) -> str:
        """The HF key prefix of this entry (up to and including ``layers.{i}.``; empty for absolute keys)."""
        key = (self.hf_keys or self.absent_keys)[0]
        return key[: len(key) - len(self.rule.suffixes(self.sizes)[0])]


def with_tunix_layout(entry: Entry, tunix_layout: str) -> Entry:
    """``entry`` with the Tunix side in ``tunix_layout`` (one of its rule's ``tunix_layouts``)."""
    if tunix_layout not in entry.rule.tunix_layouts:
        raise ValueError(f"{entry.rule.name}: {tunix_layout!r} is not one of its Tunix layouts")
    return dataclasses.replace(entry, tunix_variant=None if tunix_layout == entry.rule.tunix_layout else tunix_layout)


def for_tunix_version(ents: list[Entry], version: str | None) -> list[Entry]:
    """``ents`` in the Tunix layouts of Tunix ``version`` (None: the rules' ``tunix_layout``)."""
    return [with_tunix_layout(e, e.rule.tunix_layout_for(version)) for e in ents]


def layout_with_shape(entry: Entry, shape: tuple[int, ...]) -> str | None:
    """The Tunix layout of ``entry``'s rule whose shape is ``shape`` (its own first), or None."""
    for lay in (entry.tunix_layout,) + entry.rule.tunix_layouts:
        if layout.shape(lay, entry.sizes) == tuple(shape):
            return lay
    return None


def entries(cfg: ModelConfig, spec: FamilySpec, prefix: str) -> list[Entry]:
    """Every tensor of the text model: model-level tensors, then each layer's. HF keys are
    ``prefix + suffix`` (model tensors), ``prefix + layers.{i}. + suffix`` (layer tensors), or the
    suffix alone (rules with absolute keys). The Tunix side is in each rule's ``tunix_layout``
    (see :func:`for_tunix_version` for another Tunix version's)."""
    out = []
    for r in spec.rules:
        if r.scope == "model" and r.applies(cfg.flags):
            sizes = cfg.model_sizes()
            keys = tuple(k if r.absolute else prefix + k for k in r.suffixes(sizes))
            out.append(Entry(r, None, keys, tuple(r.tunix.split(".")), sizes))
    layer_rules = [r for r in spec.rules if r.scope == "layer"]
    for layer in cfg.layers:
        sizes, flags = cfg.layer_sizes(layer), cfg.layer_flags(layer)
        for r in layer_rules:
            if r.applies(flags):
                keys = tuple(f"{prefix}layers.{layer.index}.{k}" for k in r.suffixes(sizes))
                path = ("layers", str(layer.index), *r.tunix.split("."))
                if r.hf_absent is not None and flags[r.hf_absent]:
                    out.append(Entry(r, layer, (), path, sizes, absent_keys=keys))
                else:
                    out.append(Entry(r, layer, keys, path, sizes))
    return out


def hf_to_tunix(entry: Entry, arrays: list[np.ndarray]) -> np.ndarray:
    """HF tensor(s) of one entry -> the Tunix parameter (stacked along ``c`` or the row's stack axis
    when several)."""
    x = np.stack(arrays) if entry.rule.stack_axis else arrays[0]
    return layout.rearrange(x, entry.hf_stacked_layout, entry.tunix_layout, entry.sizes)


def stack_to_tunix(entry: Entry, arrays: Iterable[np.ndarray]) -> np.ndarray:
    """The Tunix parameter of a stacked row (``TensorRule.stack``, the stack axis leading the Tunix
    layout) from its HF tensors read one at a time: the output and one HF tensor are in memory,
    never the whole stack twice. Equal to :func:`hf_to_tunix` on the list."""
    groups = layout.parse(entry.tunix_layout)
    if groups[0] != (entry.rule.stack,):
        return hf_to_tunix(entry, list(arrays))
    inner = " ".join(g[0] if len(g) == 1 else f"({' '.join(g)})" for g in groups[1:])
    out = None
    for i, x in enumerate(arrays):
        y = layout.rearrange(x, entry.rule.hf_layout, inner, entry.sizes)
        if out is None:
            out = np.empty(entry.tunix_shape, y.dtype)
        out[i] = y
        del x, y
    return out


def tunix_to_hf(entry: Entry, value: np.ndarray) -> list[np.ndarray]:
    """The Tunix parameter of one entry -> its HF tensor(s), in ``entry.hf_keys`` order."""
    y = layout.rearrange(value, entry.tunix_layout, entry.hf_stacked_layout, entry.sizes)
    return [y[i] for i in range(len(entry.hf_keys))] if entry.rule.stack_axis else [y]
