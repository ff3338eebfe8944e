"""MaxText LoRA: qwix's factors beside MaxText's kernels (``kernel_lora_a``, ``kernel_lora_b``).

qwix's ``dot_general`` LoRA on a MaxText kernel ``[in..., out...]`` (a query ``d n h`` contracts
``d``; an attention output ``n h d`` contracts ``n h``) holds A as ``[prod(in), r]`` and B as
``[r, prod(out)]``, each in the kernel's axis order; with ``scan_layers`` both stack like their
kernel, blocks on axis 1 (and positions in a block on axis 2). So ``kernel_lora_a`` is PEFT's
``lora_A`` transposed and ``kernel_lora_b`` is ``lora_B`` transposed, the kernel's value transforms
along its output axes (a RoPE reordering, a folded query scale: the family's MaxText spec) applied to
B, as MaxText's ``to_maxtext`` writes an adapter. The scale is ``lora_alpha / lora_rank`` of the
step's custom metadata (``"lora"``), MaxText's one rank and alpha for every module.

Writing any adapter as MaxText's: MaxText has one rank and alpha, so where the adapter's modules
differ every module is padded to the largest rank and its scale folded into B (exact).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections import Counter

import numpy as np

from ckptbridge import deps, layout, mapping, specs
from ckptbridge.errors import ConfigError, MismatchError, UnsupportedError
from ckptbridge.formats.maxtext import layout as maxtext_layout
from ckptbridge.formats.maxtext import model as maxtext
from ckptbridge.formats.maxtext.layout import Leaf, Transform, transforms_of
from ckptbridge.io import orbax as orbax_io
from ckptbridge.io import storage
from ckptbridge.io.atomic import atomic_directory
from ckptbridge.io.files import close_on_error
from ckptbridge.lora.base import Base
from ckptbridge.lora.factors import AdapterRows, ModuleLora, Pair, Target
from ckptbridge.lora.modules import LoraModule, Scaling, in_batches, plain_number
from ckptbridge.metadata import KEY, Metadata
from ckptbridge.progress import progress_over
from ckptbridge.report import Report, human_bytes
from ckptbridge.rows import Request, more
from ckptbridge.stream import Shared

NAME = "maxtext-lora"
LORA_KEY = "lora"  # MaxText's custom metadata of a LoRA run: {"lora_rank", "lora_alpha", ...}
A_SUFFIX, B_SUFFIX = maxtext.LORA_SUFFIXES
log = logging.getLogger(__name__)


def _group(axes: list[str] | tuple[str, ...]) -> str:
    return axes[0] if len(axes) == 1 else f"({' '.join(axes)})"


@dataclasses.dataclass(frozen=True, eq=False)
class FactorLeaves:
    """The two LoRA factors of one MaxText kernel (:class:`~ckptbridge.formats.maxtext.layout.Leaf`) and
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
        transforms = tuple(transforms_of(mt, leaf.entries[0]))
        if any(t.axis not in mt_out for t in transforms):  # not on B's axes: no LoRA form
            continue
        i = sel[1] if sel else 0
        out.append(FactorLeaves(
            leaf, f"{_group(mt_in)} r", f"r {_group(mt_out)}", "r " + " ".join(mt_out),
            f"r {_group(in_axes)}", f"{_group(out_axes)} r", transforms,
            tuple((m, i) for m in mods)))  # type: ignore[misc]  # no None left
    return out


class MaxTextLora(ModuleLora):
    """A MaxText LoRA checkpoint (LoRA only, or beside the kernels), validated against the base."""

    format = NAME

    def __init__(self, path: str, ckpt: orbax_io.OrbaxCheckpoint, base: Base, tree: maxtext.Tree,
                 factors: list[tuple[FactorLeaves, tuple[int, ...]]], scaling: dict[LoraModule, Scaling],
                 step: int | None, leading: set[FactorLeaves] | None = None, batch_bytes: int = 32 << 20,
                 base_quant: dict | None = None):
        self.path, self.ckpt, self.base, self.tree = path, ckpt, base, tree
        self._base_quant = base_quant  # ckptbridge's record, for a checkpoint it wrote from a QLoRA adapter
        self.factors = factors  # factor leaves present, and their entries with LoRA
        self.scaling = scaling
        self._step = step
        self.leading = leading or set()  # stacked on axis 0, not as the kernel
        self.batch_bytes_limit = batch_bytes

    @property
    def step(self) -> int | None:
        return self._step

    @property
    def base_quant(self) -> dict | None:
        return self._base_quant

    def module_dtype(self, mod: LoraModule) -> np.dtype:
        for f, positions in self.factors:
            if any(f.targets[p][0] == mod for p in positions):
                return self.ckpt.leaves[self.tree.stored[f.paths[0]]][1]
        raise KeyError(mod)

    def _bytes(self, f: FactorLeaves) -> int:
        return sum(int(np.prod(self.tree.params[p][0], dtype=np.int64)) * np.dtype(self.tree.params[p][1]).itemsize
                   for p in f.paths)

    def batches(self) -> list[list[tuple[FactorLeaves, tuple[int, ...]]]]:
        """The factor leaves in batches of about ``batch_bytes``, each read in one call (a stacked
        leaf whole: its layers are one stored tensor); the targets in the order they are read."""
        return in_batches(self.factors, lambda item: self._bytes(item[0]), self.batch_bytes_limit)

    def batch_targets(self, batch) -> list[Target]:
        return [f.targets[pos] for f, positions in batch for pos in positions]

    def batch_bytes(self, batch) -> int:
        return sum(self._bytes(f) for f, _ in batch)

    def read_peft(self, batch) -> dict[Target, Pair]:
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

    def close(self) -> None:
        self.ckpt.close()


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
    _, leaves, _ = maxtext.model_plan(tree, base.cfg, base.spec, base.prefix, base.path)
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
    return MaxTextLora(path, ckpt, base, tree, factors, scaling, step, leading, base_quant=meta.base_quant)


def detect(probe) -> bool:
    """A MaxText checkpoint holding LoRA factors (``kernel_lora_a`` / ``kernel_lora_b``)."""
    found = maxtext.describe(probe.checkpoint) if probe.checkpoint is not None else None
    return found is not None and found["lora"]


def open_source(src: str, base: Base, *, step: int | None = None, alpha: float | None = None, **_) -> MaxTextLora:
    path = maxtext.resolve(src, step)
    return open_maxtext_lora(orbax_io.OrbaxCheckpoint(path), base, alpha=alpha)


# --------------------------------------------------------------------------- writing


@dataclasses.dataclass(frozen=True)
class MaxTextLoraReport(Report):
    """An adapter written as a MaxText LoRA checkpoint."""

    direction: str
    source: str
    destination: str
    family: str
    config_mismatch: str | None
    scan_layers: bool
    modules: int
    zero_layers: int  # stacked layers the adapter has no LoRA on, written as zero factors
    lora_rank: int
    lora_alpha: float | int
    bytes: int
    warnings: list[str]
    seconds: float

    def summary(self) -> str:
        lay = "scanned" if self.scan_layers else "unscanned"
        text = (f"{self.direction}: {self.source} -> {self.destination}/0/{maxtext.ITEM}\n"
                f"  {self.modules} modules ({lay}), lora_rank={self.lora_rank}, lora_alpha={self.lora_alpha}, "
                f"{human_bytes(self.bytes)} in {self.seconds:.2f} s\n"
                f"  MaxText: lora.lora_restore_path={self.destination.rstrip('/')}/0/{maxtext.ITEM} with "
                f"scan_layers={str(self.scan_layers).lower()}")
        if self.zero_layers:
            text += f"\n  {self.zero_layers} stacked layer factors without LoRA in the adapter written as zeros"
        return text + "".join(f"\n  warning: {w}" for w in self.warnings)


def write(ad: AdapterRows, dst: str, req: Request, *, scan_layers: bool = False,
          compression: bool = True) -> MaxTextLoraReport:
    """Write ``ad`` as the MaxText LoRA checkpoint ``dst/0/items`` (``kernel_lora_a`` = ``lora_A``
    transposed, ``kernel_lora_b`` = ``lora_B`` transposed with the kernel's value transforms, as
    MaxText's ``to_maxtext`` converts an adapter; stacked on axis 1 with ``scan_layers``), with
    ``lora_rank`` and ``lora_alpha`` in the step's metadata as MaxText's trainer records them."""
    from ckptbridge.formats.peft import padded
    from ckptbridge.formats.tunix_lora import no_expert_lora

    deps.require("orbax")
    b = ad.base
    mt = maxtext.maxtext_spec(b.spec, b.path)
    mismatch = specs.note_mismatch(b.cfg)
    no_expert_lora(ad, "MaxText's experts take no LoRA in ckptbridge")
    names = ad.names()
    leaves = maxtext_layout.plan(mapping.entries(b.cfg, b.spec, b.prefix), mt, scan_layers, b.cfg.flags)
    where: dict[str, tuple[FactorLeaves, int]] = {}
    for f in factor_leaves(b, leaves):
        for pos, (mod, i) in enumerate(f.targets):
            where[mod.hf_modules[i]] = (f, pos)
    missing = [n for n in names if n not in where]
    if missing:
        raise UnsupportedError(f"{ad.path}: LoRA on {missing[0]}{more(missing)}, which has no LoRA form in MaxText's "
                               f"layout of {b.spec.name}; merge the adapter into the base instead")
    counts = Counter(ad.scaling_of(n).scale for n in names)
    scale = counts.most_common(1)[0][0]
    rank = max(ad.scaling_of(n).rank for n in names)
    warnings: list[str] = []
    if len(counts) > 1 or len({ad.scaling_of(n).rank for n in names}) > 1:
        warnings.append(f"ranks/scales differ between modules: padded every module to rank {rank} and folded "
                        "the per-module scales into kernel_lora_b (MaxText has one rank and alpha)")
    elif any(ad.scaling_of(n).rslora for n in names):
        warnings.append("rsLoRA: lora_alpha written as the scale times the rank (MaxText scales by alpha / rank)")
    for w in warnings:
        log.warning(w)
    alpha = plain_number(scale * rank)
    users: dict[FactorLeaves, dict[int, str]] = {}
    for n in names:
        f, pos = where[n]
        users.setdefault(f, {})[pos] = n

    def made(f: FactorLeaves) -> tuple[np.ndarray, np.ndarray]:
        dtype = ad.dtype_of(next(iter(users[f].values())))
        out = [np.zeros(s, dtype) for s in f.shapes(rank)]
        for pos, n in users[f].items():
            a0, b0 = ad.pair(n)
            for full, x in zip(out, f.to_maxtext(pos, *padded(a0, b0, ad.scaling_of(n), rank, scale))):
                full[f.region(pos, full.ndim)] = f.leaf.stacked(x.astype(dtype, copy=False))
        return out[0], out[1]

    shared = {f: Shared(functools.partial(made, f), uses=2) for f in users}

    def factor(f: FactorLeaves, which: int) -> np.ndarray:
        return shared[f].get()[which]

    flat: dict[tuple[str, ...], orbax_io.LazyArray] = {}
    for f, at in users.items():
        dtype = ad.dtype_of(next(iter(at.values())))
        for which, (path, shape) in enumerate(zip(f.paths, f.shapes(rank))):
            flat[maxtext.ROOT + path + ("value",)] = orbax_io.LazyArray(shape, dtype,
                                                                        functools.partial(factor, f, which))
    tree = {**orbax_io.nest(flat), "step": np.asarray(0, np.int64)}  # MaxText's TrainState step
    meta = {maxtext.SCAN_KEY: scan_layers,
            LORA_KEY: {"enable_lora": True, "lora_rank": rank, "lora_alpha": alpha},
            KEY: Metadata(kind="lora", family=b.spec.name, base=os.path.abspath(b.path), key_prefix=b.prefix,
                          source=storage.absolute(ad.path), base_quant=ad.base_quant).to_json()}
    bar = progress_over(flat.values(), req.desc, req.progress)
    total = bar.total
    with atomic_directory(dst, req.overwrite) as tmp:
        orbax_io.save_manager_step(tmp, 0, tree, meta, item=maxtext.ITEM, compression=compression, engine=req.engine)
    bar.close()
    return MaxTextLoraReport(
        direction=req.direction, source=req.source, destination=dst, family=b.spec.name, config_mismatch=mismatch,
        scan_layers=scan_layers, modules=len(names),
        zero_layers=sum(len(f.targets) - len(at) for f, at in users.items()), lora_rank=rank,
        lora_alpha=alpha, bytes=total, warnings=warnings, seconds=round(time.perf_counter() - req.t0, 3))


__all__ = ["FactorLeaves", "MaxTextLora", "MaxTextLoraReport", "factor_leaves", "is_maxtext", "open_maxtext_lora",
           "open_source", "write"]
