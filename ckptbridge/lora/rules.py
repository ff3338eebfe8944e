"""qwix LoRA rules (``module_path`` regex, rank, alpha) of a set of modules, and back."""

from __future__ import annotations

import re

from ckptbridge.errors import CorruptFileError
from ckptbridge.lora.modules import LoraModule, Scaling, plain_number
from ckptbridge.lora.select import module_regex


def rules_for(assigned: dict[LoraModule, Scaling], all_modules: list[LoraModule]) -> list[dict]:
    """qwix rules (``module_path`` regex, rank, alpha) that give every module in ``assigned`` its
    rank and alpha and match no other module. Each regex names exactly its modules, so order
    does not matter; a layer module present in every layer it exists in gets ``\\d+``."""
    layers_of: dict[str, set[str]] = {}
    for m in all_modules:
        if m.layer is not None:
            layers_of.setdefault("/".join(m.in_layer), set()).add(m.layer)
    groups: dict[tuple, list[LoraModule]] = {}
    for m, sc in assigned.items():
        qwix_alpha = sc.scale * sc.rank  # qwix scale is alpha / rank
        groups.setdefault((sc.rank, plain_number(round(qwix_alpha, 12))), []).append(m)
    return [{"module_path": module_regex([m.qwix_path for m in mods], head="layers", sep="/",
                                         layers_of=lambda rest: layers_of.get(rest, set())),
             "rank": rank, "alpha": alpha}
            for (rank, alpha), mods in sorted(groups.items(), key=lambda kv: -len(kv[1]))]


def scaling_from_rules(mod: LoraModule, rules: list[dict], where: str) -> Scaling | None:
    """The (rank, alpha) qwix gives ``mod`` under ``rules`` (first full match wins), or None."""
    for rule in rules:
        try:
            if re.fullmatch(rule["module_path"], mod.qwix_path):
                return Scaling(int(rule["rank"]), float(rule["alpha"]))
        except (KeyError, TypeError, ValueError, re.error):
            raise CorruptFileError(
                f"{where}: LoRA rule {rule!r} is malformed (needs module_path, rank, alpha)") from None
    return None

