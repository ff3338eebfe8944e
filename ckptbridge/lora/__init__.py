"""LoRA adapters in both worlds, derived from the same spec table as the weights.

- :mod:`.modules`: the LoRA-able modules of a base and their factor layouts (qwix and PEFT), scales;
- :mod:`.select`: the one regex builder for module patterns; :mod:`.rules`: qwix rules;
- :mod:`.peft`: PEFT's format (the typed ``adapter_config.json``, factor keys) and PEFT adapters;
- :mod:`.orbax`: Tunix/qwix LoRA checkpoints; :mod:`.base`: the base model an adapter belongs to;
- :mod:`.adapter`: an adapter of either kind and its deltas in HF layout.
"""

from ckptbridge.lora.adapter import Adapter, hf_deltas, open_adapter, open_checkpoint_lora
from ckptbridge.lora.base import Base, make_base, open_base
from ckptbridge.lora.modules import (
                                     LoraLayouts,
                                     LoraModule,
                                     Scaling,
                                     lora_layouts,
                                     lora_modules,
                                     peft_to_tunix,
                                     plain_number,
                                     tunix_to_peft,
)
from ckptbridge.lora.orbax import OrbaxLora, open_orbax_lora
from ckptbridge.lora.peft import (
                                     ADAPTER_CONFIG,
                                     ADAPTER_WEIGHTS,
                                     PEFT_PREFIX,
                                     AdapterConfig,
                                     ParamLora,
                                     PeftLora,
                                     export_config,
                                     factor_key,
                                     open_peft_lora,
                                     parse_factor_key,
                                     pattern_value,
                                     target_modules_regex,
)
from ckptbridge.lora.rules import rules_for, scaling_from_rules
from ckptbridge.lora.select import module_regex

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "PEFT_PREFIX", "Adapter", "AdapterConfig", "Base", "LoraLayouts",
           "LoraModule", "OrbaxLora", "ParamLora", "PeftLora", "Scaling", "export_config", "factor_key",
           "hf_deltas", "lora_layouts", "lora_modules", "make_base", "module_regex", "open_adapter", "open_base",
           "open_checkpoint_lora",
           "open_orbax_lora", "open_peft_lora", "parse_factor_key", "pattern_value", "peft_to_tunix",
           "plain_number", "rules_for", "scaling_from_rules", "target_modules_regex", "tunix_to_peft"]
