"""The metadata ckptbridge stores with what it writes, as one typed record.

Orbax checkpoints carry it in their ``custom_metadata`` under ``"ckptbridge"`` (weights from
``safetensors-to-orbax``, LoRA from ``peft-to-orbax`` and the training package), PEFT adapters in
the safetensors header of ``adapter_model.safetensors``. It makes outputs self-describing: an
Orbax checkpoint knows its family, HF config and key prefix, a LoRA checkpoint its qwix rules,
so converting them back needs no flags. Reading is tolerant: a field of the wrong type reads as
absent (the caller then asks for the flag that replaces it), unknown fields are kept.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

KEY = "ckptbridge"
FORMAT_VERSION = 1


@dataclasses.dataclass
class LoraRules:
    """qwix LoRA rules (``[{module_path, rank, alpha}, ...]``) and the dropout they were trained with."""

    rules: list[dict]
    dropout: float = 0.0


@dataclasses.dataclass
class Metadata:
    """What a ckptbridge output says about itself.

    Attributes:
      kind: ``"weights"`` (Orbax full weights) or ``"lora"`` (Orbax LoRA); None for PEFT adapters.
      family: the family spec's name.
      hf_config: the HF config.json of the model (weights).
      key_prefix: the HF key prefix the source used, written back on the way out.
      config_dialect: the config's dialect, where a family has several (weights).
      towers_dropped: tensors of non-text towers left out (weights).
      towers: the towers a checkpoint holds (weights): tower name -> ``{"tensors", "bytes"}``, and
        ``"spelling"``: the other key spellings of the HF names the towers came with.
      assets: non-weight files stored with the checkpoint (weights).
      source: absolute path of what was converted.
      base: absolute path of the HF base model (LoRA).
      lora: the qwix rules that rebuild the LoRA model (LoRA).
      kv: how fused modules were made from separate PEFT modules (``exact`` / ``svd``).
      target: what a PEFT export was made for (``hf`` / ``vllm``).
      step, tokens_seen, data_state: training progress (training checkpoints).
      tunix_version: the google-tunix version an Orbax checkpoint was written for: the installed
        one, or the one ``safetensors-to-orbax --tunix-version`` named (layouts and computations
        differ between Tunix versions).
      base_quant: how a QLoRA run held its base (``scheme``, ``tile``, ``param_dtype``,
        ``qwix_version``): the weights its LoRA modules were trained against were qwix's
        quantization of the base's in ``param_dtype`` (``merge --as-trained`` rebuilds them).
      other: fields this version does not know, kept as they are.
    """

    kind: str | None = None
    family: str | None = None
    format_version: int | None = FORMAT_VERSION
    hf_config: dict | None = None
    key_prefix: str | None = None
    config_dialect: str | None = None
    towers_dropped: int | None = None
    towers: dict | None = None
    assets: list[str] | None = None
    source: str | None = None
    base: str | None = None
    lora: LoraRules | None = None
    kv: str | None = None
    target: str | None = None
    step: int | None = None
    tokens_seen: int | None = None
    data_state: Any = None
    tunix_version: str | None = None
    base_quant: dict | None = None
    other: dict = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        """A JSON object (fields that are None left out), exactly as it will be read back."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if v is not None and k != "other"}
        out.update(self.other)
        return json.loads(json.dumps(out))

    @classmethod
    def from_json(cls, obj: Any) -> Metadata:
        """Read a stored record; anything not a JSON object reads as an empty record."""
        if isinstance(obj, str):
            try:
                obj = json.loads(obj)
            except json.JSONDecodeError:
                obj = None
        if not isinstance(obj, dict):
            return cls(format_version=None)
        types = {"kind": str, "family": str, "format_version": int, "hf_config": dict, "key_prefix": str,
                 "config_dialect": str, "towers_dropped": int, "towers": dict, "assets": list, "source": str,
                 "base": str, "kv": str, "target": str, "step": int, "tokens_seen": int, "tunix_version": str,
                 "base_quant": dict}
        values: dict[str, Any] = {}
        other = {}
        for key, value in obj.items():
            if key in types:
                if isinstance(value, types[key]) and not isinstance(value, bool):
                    values[key] = value
            elif key == "lora":
                rules = value.get("rules") if isinstance(value, dict) else None
                if isinstance(rules, list) and all(isinstance(r, dict) for r in rules):
                    dropout = value.get("dropout", 0.0)
                    values["lora"] = LoraRules(rules, float(dropout) if isinstance(dropout, (int, float)) else 0.0)
            elif key == "data_state":
                values[key] = value
            else:
                other[key] = value
        values.setdefault("format_version", None)
        return cls(**values, other=other)


def installed_tunix_version() -> str | None:
    """The installed google-tunix version (None where Tunix is not installed)."""
    from importlib import metadata

    try:
        return metadata.version("google-tunix")
    except metadata.PackageNotFoundError:
        return None
