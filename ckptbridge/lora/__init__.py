"""LoRA adapters in both worlds, derived from the same spec table as the weights; format-free.

- :mod:`.modules`: the LoRA-able modules of a base and their factor layouts (qwix and PEFT), scales;
- :mod:`.select`: the one regex builder for module patterns; :mod:`.rules`: qwix rules;
- :mod:`.base`: the HF base model an adapter belongs to;
- :mod:`.factors`: an adapter of any format as PEFT pairs per HF module (what every adapter
  format reads into and writes from; the formats themselves are in :mod:`ckptbridge.formats`).
"""
