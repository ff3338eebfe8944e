"""A Tunix/qwix LoRA checkpoint (Orbax), validated against its base and read in batches."""

from __future__ import annotations

import dataclasses

import numpy as np

from ckptbridge import mapping
from ckptbridge.errors import ConfigError, MismatchError, UnsupportedError
from ckptbridge.io.files import close_on_error
from ckptbridge.io.orbax import OrbaxCheckpoint, resolve_checkpoint
from ckptbridge.lora.base import Base
from ckptbridge.lora.modules import LoraModule, Scaling
from ckptbridge.lora.rules import scaling_from_rules
from ckptbridge.metadata import Metadata
from ckptbridge.qwix_lora import is_lora_leaf


@dataclasses.dataclass
class OrbaxLora:
    """A Tunix/qwix LoRA checkpoint, validated against the base."""

    path: str
    ckpt: OrbaxCheckpoint
    base: Base
    suffix: tuple[str, ...]
    scaling: dict[LoraModule, Scaling]
    metadata: Metadata
    batch_bytes: int = 128 << 20  # factors per read batch
    _ahead: dict = dataclasses.field(default_factory=dict)
    _pending: tuple | None = None  # (modules, result of OrbaxCheckpoint.start_read) of the next batch

    def factors(self, mod: LoraModule) -> tuple[np.ndarray, np.ndarray]:
        """(A, B) of ``mod`` in Tunix layout. Modules are read in batches of about ``batch_bytes``
        (one read call per batch: with Orbax each call has a fixed cost, which made a 31B rank-64
        export 4x slower), in the order of ``scaling``; once a batch is collected, the next one
        is started, so it is read and decoded while this one is converted and written. A factor
        is dropped once handed out."""
        if mod not in self._ahead:
            if self._pending is None or mod not in self._pending[0]:
                self._pending = self._start_batch(mod)
            batch, result = self._pending
            got = result()
            for m in batch:
                self._ahead[m] = tuple(got[p] for p in self._leaves(m))
            rest = self._order[self._order.index(batch[-1]) + 1:] if batch[-1] in self.scaling else []
            self._pending = self._start_batch(rest[0]) if rest else None
        return self._ahead.pop(mod)

    @property
    def _order(self) -> list[LoraModule]:
        return list(self.scaling)

    def _leaves(self, mod: LoraModule) -> tuple[tuple[str, ...], tuple[str, ...]]:
        a, b = (leaf + self.suffix for leaf in mod.leaves)
        return a, b

    def _start_batch(self, first: LoraModule) -> tuple:
        order = self._order
        batch: list[LoraModule] = []
        total = 0
        for mod in order[order.index(first):] if first in self.scaling else [first]:
            size = sum(int(np.prod(self.ckpt.leaves[p][0])) * np.dtype(self.ckpt.leaves[p][1]).itemsize
                       for p in self._leaves(mod))
            if batch and total + size > self.batch_bytes:
                break
            if mod not in self._ahead:
                batch.append(mod)
                total += size
        return batch, self.ckpt.start_read([p for mod in batch for p in self._leaves(mod)])

    def dtype(self, mod: LoraModule) -> np.dtype:
        return self.ckpt.leaves[mod.leaves[0] + self.suffix][1]

    def close(self) -> None:
        self._ahead.clear()
        self._pending = None
        self.ckpt.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_orbax_lora(src: str, base: Base, *, step: int | None = None, alpha: float | None = None) -> OrbaxLora:
    path = resolve_checkpoint(src, step)
    with close_on_error(OrbaxCheckpoint(path)) as ckpt:
        return _validate_orbax_lora(path, ckpt, base, alpha)


def _validate_orbax_lora(path: str, ckpt, base: Base, alpha: float | None) -> OrbaxLora:
    meta = ckpt.metadata
    leaves = dict(ckpt.leaves)
    if not any(is_lora_leaf(p) for p in leaves):
        raise UnsupportedError(f"{path}: has no LoRA parameters (*_lora_a/*_lora_b); for full weights use "
                               "orbax-to-safetensors")
    if meta.family not in (None, base.spec.name):
        raise MismatchError(f"{path}: LoRA of family {meta.family!r}, but the base {base.path} is {base.spec.name!r}")
    suffix = ckpt.value_suffix
    by_leaf = base.by_leaf()
    weights = {e.tunix_path for e in mapping.entries(base.cfg, base.spec, base.prefix)}
    present: dict[LoraModule, list] = {}
    for p in sorted(leaves):
        key = p[: len(p) - len(suffix)]
        if key not in by_leaf:
            param = key[:-1] + (key[-1].rsplit("_lora_", 1)[0],) if is_lora_leaf(key) else None
            if param in weights:
                raise UnsupportedError(
                    f"{path}: leaf {'/'.join(p)} is a LoRA on {'/'.join(param)}, which ckptbridge does not carry "
                    f"(the {base.spec.name} LoRA targets are {', '.join(base.spec.lora_targets)}; vLLM serves no "
                    "LoRA there): train without it, e.g. with module_path "
                    f"'.*({'|'.join(base.spec.lora_targets)})'"
                )
            raise MismatchError(
                f"{path}: leaf {'/'.join(p)} is not a LoRA factor of any {base.spec.name} module of the base "
                f"{base.path}; the adapter belongs to another model"
            )
        mod, i = by_leaf[key]
        present.setdefault(mod, [None, None])[i] = leaves[p]
    rules = meta.lora.rules if meta.lora else None
    scaling: dict[LoraModule, Scaling] = {}
    for mod, (a, b) in present.items():
        name = "/".join(mod.path)
        if a is None or b is None:
            raise MismatchError(f"{path}: {name} has only one of its LoRA factors (A and B are both needed)")
        rank = a[0][-1] if a[0] else 0
        shapes = mod.shapes(rank)
        if rank < 1 or a[0] != shapes["a_tunix"] or b[0] != shapes["b_tunix"]:
            raise MismatchError(
                f"{path}: {name} LoRA shapes A {a[0]} / B {b[0]} do not fit the base {base.path} "
                f"(expected A {shapes['a_tunix']}, B {shapes['b_tunix']} at rank {rank}); wrong base (--base)?"
            )
        if alpha is not None:
            scaling[mod] = Scaling(rank, float(alpha))
            continue
        sc = scaling_from_rules(mod, rules, path) if rules else None
        if sc is None:
            raise ConfigError(
                f"{path}: no LoRA alpha recorded for {name}; pass alpha (--alpha), the alpha used in training ("
                f"the scale is alpha / rank, rank here {rank})"
            )
        if sc.rank != rank:
            raise MismatchError(f"{path}: metadata gives {name} rank {sc.rank}, its tensors have rank {rank}")
        scaling[mod] = sc
    ordered = {m: scaling[m] for m in base.modules if m in scaling}
    return OrbaxLora(path, ckpt, base, suffix, ordered, meta)

