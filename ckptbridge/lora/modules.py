"""LoRA modules of a base model and their factor layouts in both worlds, and LoRA scales.

Layouts. An HF linear weight is ``(out, in)``; PEFT stores ``lora_A (r, in)`` and
``lora_B (out, r)``. qwix puts the weight's input-side axes (in Tunix order) plus ``r`` into A,
and ``r`` plus the output-side axes into B. A rule's HF layout names its output group first and
its input group second (``"(n h) d"``: out ``n h``, in ``d``), so all four factor layouts follow
from the rule: for ``q`` (Tunix ``n d h``) A is ``d r`` / ``r d`` and B is ``r n h`` / ``(n h) r``;
for the fused ``kv`` the Tunix B keeps the ``c`` axis (``r c k h``) and one A serves K and V.

Scale. qwix computes ``y + (alpha / rank) * x A B``; PEFT ``lora_alpha / r`` (rsLoRA:
``lora_alpha / sqrt(r)``). Conversions keep the scale of every module exactly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import TypeVar

import numpy as np

from ckptbridge import layout, mapping
from ckptbridge.config import ModelConfig
from ckptbridge.formats.qwix import lora_leaves
from ckptbridge.specs import FamilySpec

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class LoraLayouts:
    a_tunix: str
    b_tunix: str
    a_peft: str
    b_peft: str  # of each HF tensor
    b_peft_stacked: str  # of the HF tensors stacked along c (fused rules), else b_peft


def lora_layouts(rule) -> LoraLayouts:
    """The four factor layouts of a rule, derived from its weight layouts."""
    groups = layout.parse(rule.hf_layout)
    if len(groups) != 2:
        raise ValueError(f"rule {rule.name}: LoRA needs a 2-D HF weight, layout is {rule.hf_layout!r}")
    out_axes, in_axes = groups
    t_axes = layout.axes(rule.tunix_layout)
    a_tunix = " ".join([a for a in t_axes if a in in_axes] + ["r"])
    b_tunix = " ".join(["r"] + [a for a in t_axes if a not in in_axes])
    a_peft = f"r ({' '.join(in_axes)})"
    b_peft = f"({' '.join(out_axes)}) r"
    return LoraLayouts(a_tunix, b_tunix, a_peft, b_peft, f"c {b_peft}" if rule.fused else b_peft)


@dataclasses.dataclass(frozen=True, eq=False)
class LoraModule:
    """One module that can carry LoRA: its Tunix parameter entry and its HF/PEFT module names."""

    entry: mapping.Entry

    def __eq__(self, other) -> bool:
        return isinstance(other, LoraModule) and other.entry.tunix_path == self.entry.tunix_path

    def __hash__(self) -> int:
        return hash(self.entry.tunix_path)

    @property
    def path(self) -> tuple[str, ...]:
        return self.entry.tunix_path[:-1]

    @property
    def qwix_path(self) -> str:
        """The module path qwix matches rules against (``layers/5/attn/k_einsum``)."""
        return "/".join(self.path)

    @property
    def leaves(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return lora_leaves(self.entry.tunix_path)

    @property
    def layer(self) -> str | None:
        """The layer index of a layer module (as in its path), None for a model-level one."""
        return self.entry.tunix_path[1] if self.entry.layer is not None else None

    @property
    def in_layer(self) -> tuple[str, ...]:
        """The module path inside its layer (the whole path for a model-level module)."""
        return self.path[2:] if self.entry.layer is not None else self.path

    @property
    def hf_modules(self) -> tuple[str, ...]:
        return tuple(k[: -len(".weight")] if k.endswith(".weight") else k for k in self.entry.hf_keys)

    @property
    def vllm_aliases(self) -> tuple[str, ...]:
        """HF modules that repeat this module's factors in an adapter exported for vLLM."""
        return tuple(self.entry.key_prefix + k.removesuffix(".weight") for k in self.entry.rule.vllm_lora_aliases)

    @property
    def layouts(self) -> LoraLayouts:
        return lora_layouts(self.entry.rule)

    def sizes(self, rank: int) -> dict:
        return {**self.entry.sizes, "r": rank}

    def shapes(self, rank: int) -> dict[str, tuple[int, ...]]:
        s, L = self.sizes(rank), self.layouts
        return {name: layout.shape(getattr(L, name), s) for name in ("a_tunix", "b_tunix", "a_peft", "b_peft")}


def lora_modules(cfg: ModelConfig, spec: FamilySpec, prefix: str) -> list[LoraModule]:
    return [LoraModule(e) for e in mapping.entries(cfg, spec, prefix) if e.rule.lora and e.hf_keys]


def tunix_to_peft(mod: LoraModule, a: np.ndarray, b: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """qwix factors of one module -> PEFT ``(lora_A, lora_B)`` per HF module (A shared by k and v)."""
    rank = a.shape[-1]
    s, L = mod.sizes(rank), mod.layouts
    a_p = layout.rearrange(a, L.a_tunix, L.a_peft, s)
    b_p = layout.rearrange(b, L.b_tunix, L.b_peft_stacked, s)
    if mod.entry.rule.fused:
        return [(a_p, b_p[i]) for i in range(len(mod.hf_modules))]
    return [(a_p, b_p)]


def peft_to_tunix(mod: LoraModule, pairs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """PEFT factors (one pair per HF module, sharing A) -> qwix ``(A, B)`` of one module."""
    a_p = pairs[0][0]
    rank = a_p.shape[0]
    s, L = mod.sizes(rank), mod.layouts
    a = layout.rearrange(a_p, L.a_peft, L.a_tunix, s)
    b_p = np.stack([p[1] for p in pairs]) if mod.entry.rule.fused else pairs[0][1]
    return a, layout.rearrange(b_p, L.b_peft_stacked, L.b_tunix, s)


@dataclasses.dataclass(frozen=True)
class Scaling:
    rank: int
    alpha: float
    rslora: bool = False

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def in_batches(items: Iterable[T], size: Callable[[T], int], limit: int) -> list[list[T]]:
    """``items`` in order, in batches of about ``limit`` bytes (``size`` of each; one item at least
    per batch): one read call per batch (with Orbax each call has a fixed cost, which made a 31B
    rank-64 export 4x slower read module by module)."""
    out: list[list[T]] = [[]]
    total = 0
    for item in items:
        n = size(item)
        if out[-1] and total + n > limit:
            out.append([])
            total = 0
        out[-1].append(item)
        total += n
    return [b for b in out if b]


def plain_number(x: float) -> float | int:
    """12.0 -> 12, 0.5 -> 0.5: how a rank or alpha is written to JSON."""
    return int(x) if float(x).is_integer() else float(x)

