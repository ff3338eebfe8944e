"""The spec table evaluated against a config: every tensor of a model, in both namings.

:func:`entries` expands a family's rules over the model and its layers; :func:`hf_to_tunix`
and :func:`tunix_to_hf` are the two directions of one entry, both derived from its layouts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from ckptbridge import layout
from ckptbridge.config import LayerConfig, ModelConfig
from ckptbridge.specs.base import BESIDE, FamilySpec, TensorRule, TowerConfig

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
    tower: str | None = None  # the tower (``vision``, ``audio``) of a tower row; None: the text model
    tower_layer: int | None = None  # the tower layer of a tower row of layer scope

    @property
    def ident(self) -> tuple:
        """What tells the row apart from every other of the model: (tower, rule, layer)."""
        index = self.layer.index if self.layer is not None else self.tower_layer
        return self.tower, self.rule.name, index

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


def tower_entries(cfg: ModelConfig, spec: FamilySpec, prefix: str,
                  towers: dict[str, TowerConfig] | None = None, spelling: dict[str, str] | None = None) -> list[Entry]:
    """Every tensor of the towers ``cfg`` configures (``towers``: their parsed configs, default
    :meth:`FamilySpec.tower_configs`), the text model's key ``prefix`` telling where they are
    (:attr:`FamilySpec.tower_roots`; none under a prefix of a text-only checkpoint). The Tunix side
    is the family's Tunix paths where its Tunix model holds the tower, else the HF tensor as it is
    under ``towers/`` (:data:`ckptbridge.specs.base.BESIDE`) followed by its key past the root.
    ``spelling``: the towers' :attr:`~ckptbridge.specs.base.Tower.aliases` a checkpoint uses
    (prefix -> its other spelling; default: the rules' own)."""
    if not cfg.towers or prefix not in spec.tower_roots:
        return []
    root = spec.tower_roots[prefix]
    towers = spec.tower_configs(cfg) if towers is None else towers
    out = []
    for name, tcfg in towers.items():
        tower = spec.tower(name)
        assert tower is not None  # tower_configs names only the family's towers
        rules = [r for r in tower.rules if r.applies(tcfg.flags)]
        model = [(r, None) for r in rules if r.scope == "model"]
        layers = [(r, i) for i in range(tcfg.num_layers) for r in rules if r.scope == "layer"]
        for r, i in model + layers:
            suffix = respell(r.hf[0] if i is None else f"{tower.layer_prefix}.{i}.{r.hf[0]}", spelling)
            if tower.tunix:
                path = tuple(r.tunix.replace("{i}", str(i)).split("."))
                rule = r
            else:
                path = (BESIDE, *suffix.split("."))
                rule = dataclasses.replace(r, tunix=".".join(path), tunix_layout=r.hf_layout)
            out.append(Entry(rule, None, (root + suffix,), path, dict(tcfg.sizes), tower=name, tower_layer=i))
    return out


def respell(suffix: str, spelling: dict[str, str] | None) -> str:
    """A tower key past its root in a checkpoint's spelling (``spelling``: prefix -> its other form)."""
    for prefix, other in (spelling or {}).items():
        if suffix.startswith(prefix):
            return other + suffix[len(prefix):]
    return suffix


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
    if out is None:
        raise ValueError(f"{entry.tunix_name}: no HF tensors to stack")
    return out


def tunix_to_hf(entry: Entry, value: np.ndarray) -> list[np.ndarray]:
    """The Tunix parameter of one entry -> its HF tensor(s), in ``entry.hf_keys`` order."""
    y = layout.rearrange(value, entry.tunix_layout, entry.hf_stacked_layout, entry.sizes)
    return [y[i] for i in range(len(entry.hf_keys))] if entry.rule.stack_axis else [y]


# --------------------------------------------------------------------------- row blocks


@dataclasses.dataclass(frozen=True)
class Blocks:
    """``entry`` cut along the first axis of its HF layout (``axis``; the stack axis when there is
    one HF key per index), so that a range ``i:j`` of that axis is a contiguous run of rows on
    the HF side and a box on the Tunix side: every layout change of the spec tables keeps ``axis``
    first in its Tunix axis group. Tensors larger than memory should hold are converted block by
    block this way, each block rearranged on its own."""

    entry: Entry
    axis: str
    count: int  # size of ``axis``
    hf_rows: int  # rows of the HF tensor per index of ``axis`` (0 when each index is one HF key)
    tunix_dim: int  # the Tunix dimension ``axis`` lies in
    tunix_step: int  # length along ``tunix_dim`` per index of ``axis``

    @property
    def keyed(self) -> bool:
        """Each index of ``axis`` is one HF key (a fused or stacked row)."""
        return self.hf_rows == 0

    def sizes(self, i: int, j: int) -> dict:
        return {**self.entry.sizes, self.axis: j - i}

    def tunix_region(self, i: int, j: int) -> tuple[slice, ...]:
        """The box of the Tunix parameter that indices ``i:j`` of ``axis`` fill."""
        ndim = len(self.entry.tunix_shape)
        return tuple(slice(i * self.tunix_step, j * self.tunix_step) if d == self.tunix_dim else slice(None)
                     for d in range(ndim))

    def tunix_block_shape(self, n: int) -> tuple[int, ...]:
        """The shape of the Tunix box of ``n`` indices."""
        shape = list(self.entry.tunix_shape)
        shape[self.tunix_dim] = n * self.tunix_step
        return tuple(shape)

    def to_tunix(self, hf_block: np.ndarray, i: int, j: int) -> np.ndarray:
        """Indices ``i:j`` in the HF stacked layout -> the Tunix box."""
        return layout.rearrange(hf_block, self.entry.hf_stacked_layout, self.entry.tunix_layout, self.sizes(i, j))

    def to_hf(self, tunix_block: np.ndarray, i: int, j: int) -> np.ndarray:
        """The Tunix box of indices ``i:j`` -> those indices in the HF stacked layout."""
        return layout.rearrange(tunix_block, self.entry.tunix_layout, self.entry.hf_stacked_layout, self.sizes(i, j))

    def ranges(self, per_block: int, align: int = 1) -> list[tuple[int, int]]:
        """``(i, j)`` ranges of ``axis`` of ``per_block`` indices each (a multiple of ``align``, at
        least ``align``), the last one shorter."""
        step = max(align, per_block // align * align)
        return [(i, min(i + step, self.count)) for i in range(0, self.count, step)]


def blocks(entry: Entry) -> Blocks | None:
    """How ``entry`` splits into row blocks (None when it cannot: HF has no tensor of it here, or
    its leading axis is not first in its Tunix group)."""
    if not entry.hf_keys:
        return None
    hf_groups = layout.parse(entry.hf_stacked_layout)
    if not hf_groups:  # a scalar
        return None
    axis = hf_groups[0][0]
    tunix_groups = layout.parse(entry.tunix_layout)
    dim = next(d for d, g in enumerate(tunix_groups) if axis in g)
    if tunix_groups[dim][0] != axis:
        return None
    prod = lambda names: int(np.prod([entry.sizes[a] for a in names], dtype=np.int64))  # noqa: E731
    keyed = entry.rule.stack_axis is not None
    return Blocks(entry, axis, int(entry.sizes[axis]), 0 if keyed else prod(hf_groups[0][1:]), dim,
                  prod(tunix_groups[dim][1:]))
