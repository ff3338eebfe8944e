"""A Tunix/qwix LoRA checkpoint (Orbax), validated against its base and read in batches."""

from __future__ import annotations

import dataclasses
import functools
from collections import deque

import numpy as np

from ckptbridge import mapping
from ckptbridge.errors import ConfigError, MismatchError, UnsupportedError
from ckptbridge.io import storage
from ckptbridge.io.files import close_on_error
from ckptbridge.io.orbax import OrbaxCheckpoint, resolve_checkpoint
from ckptbridge.lora.base import Base
from ckptbridge.lora.modules import LoraModule, Scaling, in_batches, tunix_to_peft
from ckptbridge.lora.rules import scaling_from_rules
from ckptbridge.metadata import Metadata
from ckptbridge.qwix_lora import is_lora_leaf
from ckptbridge.stream import Engine, Stream


@dataclasses.dataclass
class OrbaxLora:
    """A Tunix/qwix LoRA checkpoint, validated against the base."""

    path: str
    ckpt: OrbaxCheckpoint
    base: Base
    suffix: tuple[str, ...]
    scaling: dict[LoraModule, Scaling]
    metadata: Metadata
    batch_bytes: int = 32 << 20  # factors per read batch (a piece of the engine)
    engine: Engine | None = None  # reads batches ahead on its workers (one of its own when None)
    _own_engine: Engine | None = None
    _stream: Stream | None = None
    _coming: deque = dataclasses.field(default_factory=deque)  # batches the stream hands out next, in order
    _ready: dict = dataclasses.field(default_factory=dict)  # factors read and not yet asked for

    def _leaves(self, mod: LoraModule) -> tuple[tuple[str, ...], tuple[str, ...]]:
        a, b = (leaf + self.suffix for leaf in mod.leaves)
        return a, b

    def module_bytes(self, mod: LoraModule) -> int:
        return sum(int(np.prod(self.ckpt.leaves[p][0], dtype=np.int64)) * np.dtype(self.ckpt.leaves[p][1]).itemsize
                   for p in self._leaves(mod))

    def batches(self) -> list[list[LoraModule]]:
        """The modules in the order of ``scaling``, in batches of about ``batch_bytes``, each read in one call."""
        return in_batches(self.scaling, self.module_bytes, self.batch_bytes)

    def read_batch(self, batch: list[LoraModule]) -> dict[LoraModule, tuple[np.ndarray, np.ndarray]]:
        """(A, B) in Tunix layout of every module of ``batch``, in one read (safe to call from
        several threads)."""
        got = self.ckpt.read([p for mod in batch for p in self._leaves(mod)])
        return {mod: (got[self._leaves(mod)[0]], got[self._leaves(mod)[1]]) for mod in batch}

    def factors(self, mod: LoraModule) -> tuple[np.ndarray, np.ndarray]:
        """(A, B) of ``mod`` in Tunix layout. Asked for in the order of ``scaling``, the batches
        are read on the engine's workers ahead of the caller (a module asked for out of that
        order is read on its own); a factor is dropped once handed out."""
        if mod in self._ready:
            return self._ready.pop(mod)
        if self._stream is None:
            if self.engine is None:
                self.engine = self._own_engine = Engine(name="lora-read")
            batches = self.batches()
            self._coming.extend(batches)
            self._stream = self.engine.stream(
                (sum(self.module_bytes(m) for m in b), functools.partial(self.read_batch, b)) for b in batches)
        if any(mod in batch for batch in self._coming):
            while mod not in self._ready:
                self._coming.popleft()
                self._ready.update(next(self._stream))
            if not self._coming:  # the last batch: its bytes go back to the budget now
                self._stream.close()
            return self._ready.pop(mod)
        return self.read_batch([mod])[mod]

    def dtype(self, mod: LoraModule) -> np.dtype:
        return self.ckpt.leaves[mod.leaves[0] + self.suffix][1]

    def targets(self) -> list[tuple[LoraModule, int]]:
        """Every (module, index of one of its HF modules) with factors."""
        return [(m, i) for m in self.scaling for i in range(len(m.hf_modules))]

    def peft_reads(self) -> list[tuple[int, functools.partial]]:
        """The factors in batches (:meth:`batches`): (bytes, a read that gives the PEFT
        ``(lora_A, lora_B)`` of each of the batch's targets)."""
        return [(sum(self.module_bytes(m) for m in b), functools.partial(self._peft_batch, b)) for b in self.batches()]

    def _peft_batch(self, batch: list[LoraModule]) -> dict[tuple[LoraModule, int], tuple[np.ndarray, np.ndarray]]:
        return {(mod, i): pair for mod, f in self.read_batch(batch).items()
                for i, pair in enumerate(tunix_to_peft(mod, *f))}

    @property
    def dropout(self) -> float:
        return self.metadata.lora.dropout if self.metadata.lora else 0.0

    @property
    def step(self) -> int | None:
        """The training step: recorded, or the name of the step directory."""
        if self.metadata.step is not None:
            return self.metadata.step
        name = storage.basename(storage.dirname(storage.absolute(self.path)))
        return int(name) if name.isdigit() else None

    def close(self) -> None:
        self._ready.clear()
        if self._stream is not None:
            self._stream.close()
        if self._own_engine is not None:
            self._own_engine.close()
        self.ckpt.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_orbax_lora(src: str, base: Base, *, step: int | None = None, alpha: float | None = None,
                    engine: Engine | None = None) -> OrbaxLora:
    """A Tunix/qwix LoRA checkpoint validated against ``base``; its factors are read ahead on
    ``engine`` (one of its own, closed with the adapter, when None)."""
    path = resolve_checkpoint(src, step)
    return orbax_lora_of(path, OrbaxCheckpoint(path), base, alpha=alpha, engine=engine)


def orbax_lora_of(path: str, ckpt: OrbaxCheckpoint, base: Base, *, alpha: float | None = None,
                  engine: Engine | None = None) -> OrbaxLora:
    """The Tunix/qwix LoRA checkpoint ``ckpt`` opened at ``path`` (closed with the adapter, or on
    an error) validated against ``base``."""
    with close_on_error(ckpt):
        ad = _validate_orbax_lora(path, ckpt, base, alpha)
    ad.engine = engine
    return ad


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

