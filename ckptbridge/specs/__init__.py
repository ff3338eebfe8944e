"""Model-family specs: each family is one table of tensor rules (data, not code paths)."""

from ckptbridge.specs.base import FamilySpec, TensorRule
from ckptbridge.specs.gemma4 import GEMMA4

FAMILIES: dict[str, FamilySpec] = {GEMMA4.name: GEMMA4}


def get_family(name: str) -> FamilySpec:
    from ckptbridge.errors import UnsupportedError

    try:
        return FAMILIES[name]
    except KeyError:
        raise UnsupportedError(
            f"unknown model family {name!r}; supported: {', '.join(sorted(FAMILIES))}"
        ) from None


__all__ = ["FAMILIES", "FamilySpec", "TensorRule", "get_family", "GEMMA4"]
