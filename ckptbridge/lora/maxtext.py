"""MaxText LoRA: qwix's factors beside MaxText's kernels (``kernel_lora_a``, ``kernel_lora_b``).

qwix's ``dot_general`` LoRA on a MaxText kernel ``[in..., out...]`` (a query ``d n h`` contracts
``d``; an attention output ``n h d`` contracts ``n h``) holds A as ``[prod(in), r]`` and B as
``[r, prod(out)]``, each in the kernel's axis order; with ``scan_layers`` both stack like their
kernel, blocks on axis 1 (and positions in a block on axis 2). So ``kernel_lora_a`` is PEFT's
``lora_A`` transposed and ``kernel_lora_b`` is ``lora_B`` transposed, the kernel's value transforms
along its output axes (a RoPE reordering, a folded query scale: the family's MaxText spec) applied to
B, as MaxText's ``to_maxtext`` writes an adapter. The scale is ``lora_alpha / lora_rank`` of the
step's custom metadata (``"lora"``), MaxText's one rank and alpha for every module.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import numpy as np

from ckptbridge import layout, maxtext, maxtext_layout
from ckptbridge.errors import ConfigError, MismatchError, UnsupportedError
from ckptbridge.io import orbax as orbax_io
from ckptbridge.io import storage
from ckptbridge.io.files import close_on_error
from ckptbridge.lora.base import Base
from ckptbridge.lora.modules import LoraModule, Scaling, in_batches
from ckptbridge.maxtext_layout import Leaf, Transform, transforms_of
from ckptbridge.sources import more

LORA_KEY = "lora"  # MaxText's custom metadata of a LoRA run: {"lora_rank", "lora_alpha", ...}
A_SUFFIX, B_SUFFIX = maxtext.LORA_SUFFIXES
Target = tuple[LoraModule, int]  # a module and the index of one of its HF modules


def _group(axes: list[str] | tuple[str, ...]) -> str:
    return axes[0] if len(axes) == 1 else f"({' '.join(axes)})"


@dataclasses.dataclass(frozen=True, eq=False)
class FactorLeaves:
    """The two LoRA factors of one MaxText kernel (:class:`~ckptbridge.maxtext_layout.Leaf`) and
    their layouts: MaxText's (``a``, ``b``, unscanned; ``b_open`` with the output axes apart, for
    the transforms), PEFT's (``a_peft``, ``b_peft``), and the HF modules of its entries."""

    leaf: Leaf
    a: str
    b: str
    b_open: str
    a_peft: str
    b_peft: str
    transforms: tuple[Transform, ...]
    targets: tuple[Target, ...]  # per entry of the leaf (stacked layers in order)

    @property
    def paths(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        *head, name = self.leaf.path
        return (*head, name + A_SUFFIX), (*head, name + B_SUFFIX)

    def sizes(self, pos: int, rank: int) -> dict:
        return {**self.leaf.entries[pos].sizes, "r": rank}

    def shapes(self, rank: int, lead: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The stored shapes of A and B (stacked where the kernel is; with ``lead``, on axis 0)."""
        n = len(self.leaf.stack)
        sizes = {**self.leaf.sizes, "r": rank}
        if lead:
            return tuple((*self.leaf.stack, *layout.shape(lay, sizes)) for lay in (self.a, self.b))  # type: ignore[return-value]
        return (layout.shape(maxtext_layout.scanned_layout(self.a, n), sizes),
                layout.shape(maxtext_layout.scanned_layout(self.b, n), sizes))

    def region(self, pos: int, ndim: int) -> tuple[slice, ...]:
        """Entry ``pos``'s box of a stored factor (all of it, but one index along the stacked axes)."""
        ax = maxtext_layout.SCAN_AXIS
        return ((slice(None),) * ax + tuple(slice(i, i + 1) for i in self.leaf.index(pos))
                + (slice(None),) * (ndim - ax - len(self.leaf.stack)))

    def to_peft(self, pos: int, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Entry ``pos``'s MaxText factors (stacked axes taken out) -> PEFT ``(lora_A, lora_B)``."""
        rank = a.shape[-1]
        sizes = self.sizes(pos, rank)
        if self.transforms:
            b = layout.rearrange(b, self.b, self.b_open, sizes)
            b = maxtext_layout.apply(b, self.b_open, sizes, list(self.transforms), False)
            b = layout.rearrange(b, self.b_open, self.b, sizes)
        return (layout.rearrange(a, self.a, self.a_peft, sizes), layout.rearrange(b, self.b, self.b_peft, sizes))

    def to_maxtext(self, pos: int, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """PEFT ``(lora_A, lora_B)`` -> entry ``pos``'s MaxText factors (unstacked)."""
        rank = a.shape[0]
        sizes = self.sizes(pos, rank)
        b = layout.rearrange(b, self.b_peft, self.b_open, sizes)
        if self.transforms:
            b = maxtext_layout.apply(b, self.b_open, sizes, list(self.transforms), True)
        return (layout.rearrange(a, self.a_peft, self.a, sizes), layout.rearrange(b, self.b_open, self.b, sizes))


def factor_leaves(base: Base, leaves: list[Leaf]) -> list[FactorLeaves]:
    """The MaxText kernels of ``leaves`` that can carry LoRA (those of ``base``'s LoRA modules),
    with their factor layouts."""
    mt = base.spec.maxtext
    modules = {m: m for m in base.modules}
    out = []
    for leaf in leaves:
        rule = leaf.entries[0].rule
        mods = [modules.get(LoraModule(e)) for e in leaf.entries]
        if not rule.lora or any(m is None for m in mods):
            continue
        sel = leaf.part.select
        if sel is not None and (not rule.fused or sel[0] != "c"):
            continue  # a part of a row fused along another axis: no LoRA module of its own
        out_axes, in_axes = layout.parse(rule.hf_layout)
        part_axes = layout.axes(leaf.part.layout)
        mt_in = [a for a in part_axes if a in in_axes]
        mt_out = [a for a in part_axes if a not in in_axes]
        transforms = tuple(transforms_of(mt, rule.name))
        if any(t.axis not in mt_out for t in transforms):  # not on B's axes: no LoRA form
            continue
        i = sel[1] if sel else 0
        out.append(FactorLeaves(
            leaf, f"{_group(mt_in)} r", f"r {_group(mt_out)}", "r " + " ".join(mt_out),
            f"r {_group(in_axes)}", f"{_group(out_axes)} r", transforms,
            tuple((m, i) for m in mods)))  # type: ignore[misc]  # no None left
    return out


@dataclasses.dataclass
class MaxTextLora:
    """A MaxText LoRA checkpoint (LoRA only, or beside the kernels), validated against the base."""

    path: str
    ckpt: orbax_io.OrbaxCheckpoint
    base: Base
    tree: maxtext.Tree
    factors: list[tuple[FactorLeaves, tuple[int, ...]]]  # factor leaves present, and their entries with LoRA
    scaling: dict[LoraModule, Scaling]
    step: int | None
    leading: set[FactorLeaves] = dataclasses.field(default_factory=set)  # stacked on axis 0, not as the kernel
    dropout: float = 0.0
    batch_bytes: int = 32 << 20

    def targets(self) -> list[Target]:
        """Every (module, HF module index) with factors, in the order they are read: a stored
        tensor at a time (all layers of a rule, where they are stacked)."""
        return [f.targets[pos] for f, positions in self.factors for pos in positions]

    def dtype(self, mod: LoraModule) -> np.dtype:
        for f, positions in self.factors:
            if any(f.targets[p][0] == mod for p in positions):
                return self.ckpt.leaves[self.tree.stored[f.paths[0]]][1]
        raise KeyError(mod)

    def _bytes(self, f: FactorLeaves) -> int:
        return sum(int(np.prod(self.tree.params[p][0], dtype=np.int64)) * np.dtype(self.tree.params[p][1]).itemsize
                   for p in f.paths)

    def batches(self) -> list[list[tuple[FactorLeaves, tuple[int, ...]]]]:
        """The factor leaves in batches of about ``batch_bytes``, each read in one call (a stacked
        leaf whole: its layers are one stored tensor)."""
        return in_batches(self.factors, lambda item: self._bytes(item[0]), self.batch_bytes)

    def peft_reads(self) -> list[tuple[int, functools.partial]]:
        """The factors in batches (:meth:`batches`): (bytes, a read that gives the PEFT
        ``(lora_A, lora_B)`` of each of the batch's targets)."""
        return [(sum(self._bytes(f) for f, _ in b), functools.partial(self.read, b)) for b in self.batches()]

    def read(self, batch) -> dict[Target, tuple[np.ndarray, np.ndarray]]:
        """PEFT ``(lora_A, lora_B)`` of every target of ``batch`` (safe to call from several threads)."""
        got = self.ckpt.read([self.tree.stored[p] for f, _ in batch for p in f.paths])
        out = {}
        for f, positions in batch:
            a, b = (got[self.tree.stored[p]] for p in f.paths)
            if f in self.leading:
                a, b = np.moveaxis(a, 0, 1), np.moveaxis(b, 0, 1)
            for pos in positions:
                one = [f.leaf.one(x[f.region(pos, x.ndim)]) for x in (a, b)]
                out[f.targets[pos]] = f.to_peft(pos, *one)
        return out

    def deltas(self) -> Iterator[tuple[str, float, tuple[np.ndarray, np.ndarray]]]:
        """(HF module, scale, PEFT pair) of every target, a batch read at a time."""
        for batch in self.batches():
            for (mod, i), pair in self.read(batch).items():
                yield mod.hf_modules[i], self.scaling[mod].scale, pair

    def close(self) -> None:
        self.ckpt.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def is_maxtext(ckpt: orbax_io.OrbaxCheckpoint) -> bool:
    return maxtext.describe(ckpt) is not None


def open_maxtext_lora(ckpt: orbax_io.OrbaxCheckpoint, base: Base, *, alpha: float | None = None) -> MaxTextLora:
    """The LoRA factors of the MaxText checkpoint ``ckpt`` (opened; closed with the adapter, or on
    an error), checked against ``base``: every factor a LoRA of one of the base's modules in the
    form of the tree (scanned or not), of one rank, with an alpha (recorded or ``alpha``)."""
    with close_on_error(ckpt):
        return _validate(ckpt, base, alpha)


def _validate(ckpt: orbax_io.OrbaxCheckpoint, base: Base, alpha: float | None) -> MaxTextLora:
    path = ckpt.path
    tree = maxtext.read_tree(ckpt)
    lora = tree.lora
    if not lora:
        raise UnsupportedError(f"{path}: a MaxText checkpoint without LoRA factors (*_lora_a/*_lora_b); for its "
                               "weights use `ckptbridge convert maxtext-to-safetensors`")
    meta = ckpt.metadata
    if meta.family not in (None, base.spec.name):
        raise MismatchError(f"{path}: LoRA of family {meta.family!r}, but the base {base.path} is {base.spec.name!r}")
    maxtext.check_scan_metadata(ckpt, tree)
    _, leaves = maxtext.model_plan(tree, base.cfg, base.spec, base.prefix, base.path)
    by_path = {p: f for f in factor_leaves(base, leaves) for p in f.paths}
    kernels = {leaf.path for leaf in leaves}
    form = "scanned" if tree.scanned else "unscanned"
    for p in lora:
        if p not in by_path:
            kernel = (*p[:-1], p[-1].rsplit("_lora_", 1)[0])
            if kernel in kernels:
                raise UnsupportedError(f"{path}: {'/'.join(p)} is a LoRA on {'/'.join(kernel)}, which ckptbridge "
                                       f"does not carry (the {base.spec.name} LoRA targets are "
                                       f"{', '.join(base.spec.lora_targets)})")
            raise MismatchError(f"{path}: {'/'.join(p)} is not a LoRA factor of any {base.spec.name} module of the "
                                f"base {base.path} ({form}); the adapter belongs to another model")
    present: list[FactorLeaves] = []
    leading: set[FactorLeaves] = set()
    ranks: dict[int, str] = {}
    for f in dict.fromkeys(by_path.values()):
        a, b = (p in tree.params for p in f.paths)
        if not (a or b):
            continue
        name = "/".join(f.leaf.path)
        if not (a and b):
            raise MismatchError(f"{path}: {name} has only one of its LoRA factors (A and B are both needed)")
        sa, sb = (tree.params[p][0] for p in f.paths)
        rank = sa[-1] if sa else 0
        want = f.shapes(rank)
        if rank >= 1 and len(f.leaf.stack) == 1 and (sa, sb) != want and (sa, sb) == f.shapes(rank, lead=True):
            leading.add(f)  # the layers stacked in front (as MaxText's to_huggingface also reads them)
        elif rank < 1 or (sa, sb) != want:
            raise MismatchError(f"{path}: {name} LoRA shapes A {sa} / B {sb} do not fit the base {base.path} "
                                f"(expected A {want[0]}, B {want[1]} at rank {rank}, {form}); wrong base (--base)?")
        ranks.setdefault(rank, name)
        present.append(f)
    if len(ranks) > 1:
        (r1, n1), (r2, n2) = list(ranks.items())[:2]
        raise MismatchError(f"{path}: LoRA ranks differ ({n1}: {r1}, {n2}: {r2}); MaxText trains one rank")
    rank = next(iter(ranks))
    recorded = ckpt.custom_metadata.get(LORA_KEY)
    recorded = recorded if isinstance(recorded, dict) else {}
    if recorded.get("lora_rank") not in (None, 0, rank):
        raise MismatchError(f"{path}: its metadata says lora_rank={recorded['lora_rank']}, its factors have "
                            f"rank {rank}")
    if alpha is None:
        alpha = recorded.get("lora_alpha") or None
    if alpha is None:
        raise ConfigError(f"{path}: no LoRA alpha recorded; pass alpha (--alpha), MaxText's lora.lora_alpha of "
                          f"the run (the scale is alpha / rank, rank here {rank})")
    sc = Scaling(rank, float(alpha))
    factors = [(f, tuple(range(len(f.targets)))) for f in present]
    scaling = {m: sc for m in dict.fromkeys(f.targets[p][0] for f, positions in factors for p in positions)}
    unknown = [p for p in tree.params if p not in by_path and p not in kernels]
    if unknown and not any(p in kernels for p in tree.params):  # a LoRA-only tree with strays
        raise MismatchError(f"{path}: unexpected MaxText parameter {'/'.join(unknown[0])}{more(unknown)} beside "
                            "the LoRA factors")
    step = meta.step
    if step is None:
        name = storage.basename(storage.dirname(storage.absolute(path)))
        step = int(name) if name.isdigit() else None
    return MaxTextLora(path, ckpt, base, tree, factors, scaling, step, leading)


__all__ = ["FactorLeaves", "MaxTextLora", "factor_leaves", "is_maxtext", "open_maxtext_lora"]
