"""The shape of a family spec: a table of tensor rules plus the family's key prefixes.

One :class:`TensorRule` describes one Tunix parameter and the HF tensor(s) it is made of:
its HF key suffixes, both layouts as axis patterns (see :mod:`ckptbridge.layout`) and, for
layer tensors, the kind of layer it belongs to. Everything else (conversion in both
directions, shape validation, LoRA factor layouts) is derived from these rows.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping


@dataclasses.dataclass(frozen=True)
class TensorRule:
    """One row of a family table.

    Attributes:
      name: short id of the tensor (``"q"``, ``"kv"``, ...).
      hf: HF key suffixes (after the prefix and, for layer tensors, ``layers.{i}.``). More
        than one suffix means the HF tensors are stacked along the fused axis ``c`` on the
        Tunix side, in this order.
      hf_layout: layout of each HF tensor.
      tunix: Tunix parameter path (dot separated, after ``layers.{i}.`` for layer tensors).
      tunix_layout: layout of the Tunix parameter; names ``c`` when ``hf`` has several keys.
      scope: ``"model"`` (one tensor) or ``"layer"`` (one per decoder layer).
      when: for layer tensors, the layer flag that must be true for the tensor to exist
        (``None``: every layer).
      lora: qwix name of the module when the tensor can carry a LoRA adapter.
      vllm_lora_aliases: HF key suffixes that must also receive this module's LoRA factors in an
        adapter exported for vLLM (a module whose output vLLM computes from a separate projection).
    """

    name: str
    hf: tuple[str, ...]
    hf_layout: str
    tunix: str
    tunix_layout: str
    scope: str = "layer"
    when: str | None = None
    lora: str | None = None
    vllm_lora_aliases: tuple[str, ...] = ()

    def applies(self, flags: Mapping[str, bool]) -> bool:
        return self.when is None or bool(flags[self.when])

    @property
    def fused(self) -> bool:
        return len(self.hf) > 1


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """A model family: its table, HF model types, and the key prefixes its checkpoints use."""

    name: str
    model_types: tuple[str, ...]
    rules: tuple[TensorRule, ...]
    # HF key prefixes of the text model, in order of preference when reading.
    key_prefixes: tuple[str, ...]
    # Key prefixes of towers that are not part of the text model (vision, audio, ...).
    foreign_prefixes: tuple[str, ...]
    # HF keys that may be present but carry no information of their own (e.g. a tied head).
    tied_keys: tuple[str, ...]
    parse_config: Callable[[dict, str], object]

    def rule(self, name: str) -> TensorRule:
        for r in self.rules:
            if r.name == name:
                return r
        raise KeyError(name)
