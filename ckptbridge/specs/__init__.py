"""Model families: one spec module per family, registered here.

Adding a family is one module that builds a :class:`FamilySpec` plus one line below
(``docs/adding_a_family.md``). Everything else finds the family through :func:`family_for`.
"""

from __future__ import annotations

import logging

from ckptbridge.config import ModelConfig
from ckptbridge.errors import UnsupportedError
from ckptbridge.specs.base import FamilySpec, ModelType, TensorRule, TunixModel
from ckptbridge.specs.gemma import GEMMA, GEMMA2
from ckptbridge.specs.gemma3 import GEMMA3
from ckptbridge.specs.gemma4 import GEMMA4
from ckptbridge.specs.llama3 import LLAMA3
from ckptbridge.specs.qwen2 import QWEN2
from ckptbridge.specs.qwen3 import QWEN3

log = logging.getLogger(__name__)
FAMILIES: dict[str, FamilySpec] = {}
DEFAULT_FAMILY = GEMMA4.name  # the family the main job and the examples use unless told otherwise


def register(spec: FamilySpec) -> FamilySpec:
    """Add a family; its model types must not belong to another one."""
    for other in FAMILIES.values():
        clash = set(other.model_types) & set(spec.model_types)
        if other.name != spec.name and clash:
            raise ValueError(f"family {spec.name}: model types {sorted(clash)} already belong to {other.name}")
    FAMILIES[spec.name] = spec
    return spec


for _spec in (GEMMA4, GEMMA3, GEMMA2, GEMMA, QWEN3, QWEN2, LLAMA3):
    register(_spec)


def get_family(name: str) -> FamilySpec:
    try:
        return FAMILIES[name]
    except KeyError:
        raise UnsupportedError(
            f"unknown model family {name!r}; supported: {', '.join(sorted(FAMILIES))}"
        ) from None


def family_for(hf_config: dict, where: str = "config.json") -> FamilySpec:
    """The family whose model types include the HF config's model_type."""
    model_type = hf_config.get("model_type")
    for spec in FAMILIES.values():
        if model_type in spec.model_types:
            return spec
    supported = sorted(t for s in FAMILIES.values() for t in s.model_types)
    raise UnsupportedError(
        f"{where}: model_type {model_type!r} is not supported; supported model types: {', '.join(supported)}"
    )


def family_of(hf_config: dict, where: str = "config.json") -> str:
    """The family name for an HF config's model_type."""
    return family_for(hf_config, where).name


def parse_config(hf_config: dict, where: str = "config.json") -> ModelConfig:
    """Parse an HF config with its family's parser."""
    return family_for(hf_config, where).parse_config(hf_config, where)


def note_mismatch(cfg: ModelConfig) -> str | None:
    """For conversions, which go on (every tensor converts exactly): log what the Tunix model of
    ``cfg``'s family computes differently from transformers, if anything, and return that line."""
    line = get_family(cfg.family).mismatch_line(cfg)
    if line is not None:
        log.warning("%s", line)
    return line


__all__ = ["DEFAULT_FAMILY", "FAMILIES", "FamilySpec", "ModelType", "TensorRule", "TunixModel", "family_for",
           "family_of", "get_family", "note_mismatch", "parse_config", "register", "GEMMA3", "GEMMA4", "LLAMA3",
           "QWEN2", "QWEN3"]
