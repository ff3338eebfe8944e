"""Family-neutral model configs: what a family's parser makes of an HF ``config.json``.

A :class:`ModelConfig` holds the sizes every decoder-only transformer has, one
:class:`LayerConfig` per decoder layer, the axis sizes and flags the family's table is
evaluated against, and the family's own settings in ``extras``. The parsers live with their
families (``ckptbridge/specs/``); :func:`ckptbridge.specs.parse_config` picks one by model type.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from ckptbridge.errors import ConfigError, InputNotFoundError
from ckptbridge.io.files import read_json_object

# HF layer_types values
SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """What one decoder layer looks like.

    Attributes:
      index: layer index.
      attention: ``"sliding_attention"`` or ``"full_attention"`` (HF's ``layer_types``).
      head_dim, num_kv_heads: of this layer.
      kind: short name of the layer kind, for reports (``"sliding"``, ``"global (k_eq_v)"``).
      flags: the family's layer flags (which rows exist in this layer).
      sizes: axis sizes of this layer's tensors (on top of the model's).
    """

    index: int
    attention: str
    head_dim: int
    num_kv_heads: int
    kind: str
    flags: Mapping[str, bool] = dataclasses.field(default_factory=dict)
    sizes: Mapping[str, int] = dataclasses.field(default_factory=dict)

    @property
    def is_global(self) -> bool:
        return self.attention == FULL


@dataclasses.dataclass(frozen=True)
class Experts:
    """A mixture-of-experts MLP as an HF config describes it (in a family's extras)."""

    num_experts: int
    top_k: int  # experts per token
    norm_topk_prob: bool = True  # the top-k routing weights renormalised to sum to 1
    dense_layers: tuple[int, ...] = ()  # decoder layers with a dense MLP instead


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The text model of an HF config, resolved per layer.

    Attributes:
      family, model_type: the family spec's name and the HF model type.
      vocab_size, hidden_size, intermediate_size, num_heads: model-wide sizes.
      layers: one LayerConfig per decoder layer.
      rms_norm_eps: as in the HF config.
      tie_word_embeddings: whether the output head is the embedding.
      sliding_window: window of the sliding layers (None: no sliding layers).
      key_prefix: the HF key prefix transformers writes for this model type.
      towers: configured non-text towers ("vision", "audio").
      sizes: model-level axis sizes; flags: model-level flags (both the family's vocabulary).
      extras: the family's own settings (rope, softcaps, experts, ...): a frozen dataclass defined by
        the family's spec module, read only there.
      hf_config: the HF config itself.
      dialect: which of the family's config dialects the HF config is written in (None: it has one).
    """

    family: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    layers: tuple[LayerConfig, ...]
    rms_norm_eps: float
    tie_word_embeddings: bool
    sliding_window: int | None
    key_prefix: str
    towers: tuple[str, ...]
    sizes: Mapping[str, int]
    flags: Mapping[str, bool]
    extras: Any
    hf_config: dict
    dialect: str | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def default_key_prefix(self) -> str:
        return self.key_prefix

    def model_sizes(self) -> dict[str, int]:
        return dict(self.sizes)

    def layer_sizes(self, layer: LayerConfig) -> dict[str, int]:
        return {**self.sizes, **layer.sizes}

    def layer_flags(self, layer: LayerConfig) -> dict[str, bool]:
        return {**self.flags, **layer.flags}

    def layer_kinds(self) -> dict[str, int]:
        kinds: dict[str, int] = {}
        for layer in self.layers:
            kinds[layer.kind] = kinds.get(layer.kind, 0) + 1
        return kinds


def read_config_file(path: str) -> dict:
    """Read a config.json, with one-line errors for a missing or malformed file."""
    missing = "no such file; an HF model directory needs its config.json"
    if not os.path.isfile(path):
        raise InputNotFoundError(f"{path}: {missing}")
    return read_json_object(path, "restore the model's config.json", missing=missing)


def int_field(cfg: Mapping, key: str, where: str, defaults: Mapping | None = None, minimum: int = 1) -> int:
    """An integer setting of an HF config (or its default), with a one-line error naming it."""
    value = cfg.get(key, (defaults or {}).get(key))
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where}: {key} must be an integer >= {minimum}, found {value!r}")
    return value


def check_heads(layers: list[LayerConfig], num_heads: int, where: str) -> None:
    """Every layer's kv heads divide the query heads, and its sizes are positive."""
    for layer in layers:
        if layer.head_dim < 1 or layer.num_kv_heads < 1 or num_heads % layer.num_kv_heads:
            raise ConfigError(
                f"{where}: layer {layer.index} has head_dim {layer.head_dim} and {layer.num_kv_heads} kv heads; "
                f"kv heads must divide num_attention_heads ({num_heads})"
            )


def layer_types(text: Mapping, num_layers: int, default: list[str], where: str) -> list[str]:
    """HF ``layer_types`` (or ``default``), checked: one known entry per layer."""
    types = text.get("layer_types")
    if types is None:
        types = default
    if not isinstance(types, list) or len(types) != num_layers:
        raise ConfigError(f"{where}: layer_types must list {num_layers} entries (num_hidden_layers)")
    bad = sorted({str(t) for t in types if t not in (SLIDING, FULL)})
    if bad:
        raise ConfigError(f"{where}: unknown layer_types {bad}; expected {SLIDING!r} or {FULL!r}")
    return list(types)
