"""An adapter of any format as its base's rows see it: PEFT pairs ``(lora_A, lora_B)`` with a
scale per HF module, read in batches or one module at a time.

Every adapter format opens its files as an :class:`AdapterRows`, and every adapter writer takes
one, so that any adapter format goes to any other, and into any model (its deltas,
:meth:`AdapterRows.deltas`). A format that stores factors per LoRA module of the family (one A
for k and v in Tunix's fused ``kv_einsum``; a stacked tensor of every layer in MaxText) is a
:class:`ModuleLora`: it says which module targets it holds and reads them in batches; the rest
follows.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ckptbridge.io.files import Opened
from ckptbridge.lora.base import Base
from ckptbridge.lora.modules import LoraModule, Scaling, in_batches

Pair = tuple[np.ndarray, np.ndarray]  # (lora_A (r, in), lora_B (out, r)) in PEFT layout
Target = tuple[LoraModule, int]  # a LoRA module and the index of one of its HF modules
BATCH_BYTES = 32 << 20  # factors per read batch (a piece of the engine)


class AdapterRows(Opened):
    """An adapter validated against its base: the HF modules it adapts (:meth:`names`, in the
    base's order), each module's :class:`Scaling`, dtype and PEFT pair."""

    format = ""  # the name of its format in the registry (ckptbridge.formats)
    path: str
    base: Base
    config: Any = None  # PEFT's AdapterConfig, for a PEFT adapter
    vllm_repeats = 0  # v_proj copies of k_proj factors (a vLLM export) that were dropped
    params: dict = {}  # LoRA on expert parameters (PEFT's target_parameters), by parameter name

    @property
    def dropout(self) -> float:
        return 0.0

    @property
    def step(self) -> int | None:
        """The training step the adapter was saved at, where it says."""
        return None

    @property
    def base_quant(self) -> dict | None:
        """How the QLoRA run that trained the adapter held its base (``scheme``, ``tile``,
        ``param_dtype``, ``qwix_version``, ``base_digest``), where it says; None: a plain base."""
        return None

    def names(self) -> list[str]:
        raise NotImplementedError

    def scaling_of(self, name: str) -> Scaling:
        raise NotImplementedError

    def dtype_of(self, name: str) -> np.dtype:
        raise NotImplementedError

    def pair(self, name: str) -> Pair:
        """``name``'s PEFT pair (safe to call from several threads)."""
        raise NotImplementedError

    def reads(self) -> list[tuple[int, Callable[[], dict[str, Pair]]]]:
        """Every pair, in batches in the adapter's order: (bytes, a read giving the batch's pairs)."""
        names = self.names()
        sizes = {n: self._nbytes(n) for n in names}
        return [(sum(sizes[n] for n in batch), functools.partial(self._read_names, batch))
                for batch in in_batches(names, sizes.__getitem__, BATCH_BYTES)]

    def _nbytes(self, name: str) -> int:
        mod, _ = self.base.by_hf_module()[name]
        shapes = mod.shapes(self.scaling_of(name).rank)
        return (int(np.prod(shapes["a_peft"])) + int(np.prod(shapes["b_peft"]))) * self.dtype_of(name).itemsize

    def _read_names(self, names: list[str]) -> dict[str, Pair]:
        return {n: self.pair(n) for n in names}

    def deltas(self) -> Iterator[tuple[str, int, float, Pair]]:
        """(HF key, first row, scale, (lora_A, lora_B)) of every LoRA delta: ``scale * B @ A`` adds to
        rows ``first row :`` ``+ len(B)`` of the key's tensor seen as a matrix of its last axis; read
        a batch at a time."""
        for _, read in self.reads():
            for name, pair in read().items():
                yield self.base.weight_key(name), 0, self.scaling_of(name).scale, pair


class ModuleLora(AdapterRows):
    """An adapter stored per LoRA module of the family, read in batches (one read call each: a
    format's calls have a fixed cost). A format gives its :meth:`batches`, the targets of each and
    how to read one as PEFT pairs, ``scaling`` (per module) and :meth:`module_dtype`. A pair asked
    for on its own reads its batch, whose pairs are then kept (an adapter converted to another
    format is read whole)."""

    scaling: dict[LoraModule, Scaling]

    def batches(self) -> list:
        raise NotImplementedError

    def batch_targets(self, batch) -> list[Target]:
        raise NotImplementedError

    def batch_bytes(self, batch) -> int:
        raise NotImplementedError

    def read_peft(self, batch) -> dict[Target, Pair]:
        """PEFT pairs of every target of ``batch`` (safe to call from several threads)."""
        raise NotImplementedError

    def module_dtype(self, mod: LoraModule) -> np.dtype:
        raise NotImplementedError

    def targets(self) -> list[Target]:
        """Every (module, index of one of its HF modules) with factors, in the order they are read."""
        return [t for b in self.batches() for t in self.batch_targets(b)]

    def peft_reads(self) -> list[tuple[int, Callable[[], dict[Target, Pair]]]]:
        return [(self.batch_bytes(b), functools.partial(self.read_peft, b)) for b in self.batches()]

    def _targets(self) -> dict[str, Target]:
        found = self.__dict__.get("_by_name")
        if found is None:
            found = self.__dict__["_by_name"] = {m.hf_modules[i]: (m, i) for m, i in self.targets()}
        return found

    def names(self) -> list[str]:
        return list(self._targets())

    def scaling_of(self, name: str) -> Scaling:
        return self.scaling[self._targets()[name][0]]

    def dtype_of(self, name: str) -> np.dtype:
        return self.module_dtype(self._targets()[name][0])

    def reads(self) -> list[tuple[int, Callable[[], dict[str, Pair]]]]:
        return [(self.batch_bytes(b), functools.partial(self._named, b)) for b in self.batches()]

    def _named(self, batch) -> dict[str, Pair]:
        return {mod.hf_modules[i]: pair for (mod, i), pair in self.read_peft(batch).items()}

    def pair(self, name: str) -> Pair:
        with self.__dict__.setdefault("_lock", threading.Lock()):
            ready: dict[str, Pair] = self.__dict__.setdefault("_pairs", {})
            if name not in ready:
                where = self.__dict__.get("_batch_of")
                if where is None:
                    where = self.__dict__["_batch_of"] = {
                        m.hf_modules[i]: b for b in self.batches() for m, i in self.batch_targets(b)}
                ready.update(self._named(where[name]))
            return ready[name]


class ComputedLora(AdapterRows):
    """An adapter whose pairs are computed (a combination, a resize, an extraction) by ``compute``
    when a writer reads them, on the engine's workers. ``modules``: every HF module it has, in the
    base's order, with its scaling and dtype. A pair asked for on its own (:meth:`pair`) is computed
    once and kept; pairs read in batches are not kept."""

    format = "computed"

    def __init__(self, path: str, base: Base, modules: dict[str, tuple[Scaling, np.dtype]],
                 compute: Callable[[str], Pair]):
        self.path = path
        self.base = base
        self.modules = modules
        self.compute = compute
        self._kept: dict[str, Pair] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return list(self.modules)

    def scaling_of(self, name: str) -> Scaling:
        return self.modules[name][0]

    def dtype_of(self, name: str) -> np.dtype:
        return np.dtype(self.modules[name][1])

    def pair(self, name: str) -> Pair:
        with self._lock:
            if name in self._kept:
                return self._kept[name]
        value = self.compute(name)
        with self._lock:
            return self._kept.setdefault(name, value)

    def _read_names(self, names: list[str]) -> dict[str, Pair]:
        with self._lock:
            kept = {n: self._kept[n] for n in names if n in self._kept}
        return {n: kept[n] if n in kept else self.compute(n) for n in names}


__all__ = ["AdapterRows", "BATCH_BYTES", "ComputedLora", "ModuleLora", "Pair", "Target"]
