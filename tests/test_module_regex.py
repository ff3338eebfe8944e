"""The one regex builder (ckptbridge.lora.select) behind qwix rules and PEFT's target_modules: for
every family and model type, each module a LoRA covers is matched by exactly its own rule (with
its rank and alpha) or by target_modules, and no other module is matched."""

import re

import pytest

from ckptbridge.formats.peft import target_modules_regex
from ckptbridge.lora.base import Base
from ckptbridge.lora.modules import Scaling, lora_modules
from ckptbridge.lora.rules import rules_for, scaling_from_rules
from ckptbridge.specs import FAMILIES

CASES = [(spec.name, t) for spec in FAMILIES.values() for t in spec.model_types]


def _base(family: str, model_type: str) -> Base:
    spec = FAMILIES[family]
    cfg = spec.parse_config(spec.tiny_config(model_type), "config.json")
    prefix = spec.module_prefix(cfg.default_key_prefix)
    return Base("base", cfg, spec, cfg.default_key_prefix, lora_modules(cfg, spec, prefix), prefix)


@pytest.mark.parametrize("family,model_type", CASES)
def test_qwix_rules_name_exactly_their_modules(family, model_type):
    b = _base(family, model_type)
    mods = b.modules
    # every other module, in two scale groups, and one module of layer 0 alone (a partial layer set)
    assigned = {m: Scaling(4, 8.0) if i % 3 else Scaling(2, 3.0) for i, m in enumerate(mods) if i % 2 == 0}
    assigned[mods[1]] = Scaling(6, 1.5)
    rules = rules_for(assigned, mods)
    for m in mods:
        matched = [r for r in rules if re.fullmatch(r["module_path"], m.qwix_path)]
        if m in assigned:
            assert len(matched) == 1, (m.qwix_path, rules)
            got = scaling_from_rules(m, rules, "test")
            assert got is not None and (got.rank, got.scale) == (assigned[m].rank, assigned[m].scale)
        else:
            assert not matched, (m.qwix_path, matched)


@pytest.mark.parametrize("family,model_type", CASES)
def test_target_modules_name_exactly_their_modules(family, model_type):
    b = _base(family, model_type)
    names = [n for m in b.modules for n in m.hf_modules]
    every = sorted(names)
    some = every[::2] + every[1:2]
    for chosen in (every, some):
        regex = target_modules_regex(chosen, b)
        assert {n for n in names if re.fullmatch(regex, n)} == set(chosen), regex
