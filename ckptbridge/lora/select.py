"""One regex builder for the two places a LoRA's modules are named by a pattern: qwix rules
(``module_path``, ``/``-joined Tunix paths) and PEFT's ``target_modules`` (``.``-joined names)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable


def module_regex(names: Iterable[str], *, head: str, sep: str, layers_of: Callable[[str], set[str]]) -> str:
    """A regex that full-matches exactly ``names``. A layer module ``<head><sep><i><sep><rest>`` is
    grouped with the others of the same layer set: ``\\d+`` where it is in every layer
    ``layers_of(rest)`` names, else the alternation of its layers; other names are matched
    literally. Several parts are each wrapped in ``(?:...)``."""
    lead = head + sep
    in_layers: dict[str, set[str]] = {}
    top = []
    for name in names:
        idx, _, rest = name[len(lead):].partition(sep) if name.startswith(lead) else ("", "", "")
        if idx.isdigit() and rest:
            in_layers.setdefault(rest, set()).add(idx)
        else:
            top.append(re.escape(name))
    by_layers: dict[str, list[str]] = {}
    for rest, layers in sorted(in_layers.items()):
        key = r"\d+" if layers == layers_of(rest) else "(?:" + "|".join(sorted(layers, key=int)) + ")"
        by_layers.setdefault(key, []).append(re.escape(rest))
    parts = [f"{re.escape(lead)}{key}{re.escape(sep)}(?:{'|'.join(rests)})" for key, rests in by_layers.items()]
    parts += sorted(set(top))
    return parts[0] if len(parts) == 1 else "|".join(f"(?:{p})" for p in parts)
