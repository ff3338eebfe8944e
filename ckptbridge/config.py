"""HF ``config.json`` -> the family config that the spec table is evaluated against.

Gemma 4 configs come in two model types and two dialects, all read here:

* ``model_type: gemma4`` wraps the text model in ``text_config`` (plus ``vision_config`` /
  ``audio_config``); ``model_type: gemma4_text`` is the text model itself.
* Global (full-attention) layers override head dim and kv heads either with the legacy fields
  ``global_head_dim`` / ``num_global_key_value_heads`` or with ``per_layer_config``
  (``{"<layer>": {"head_dim": .., "num_key_value_heads": ..}}``, transformers >= 5.15).

Defaults are transformers' own, so a config means here what it means to transformers.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from ckptbridge.errors import ConfigError, CorruptFileError, InputNotFoundError, UnsupportedError

SLIDING = "sliding_attention"
FULL = "full_attention"

# transformers' Gemma4TextConfig defaults.
_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_144,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "sliding_window": 512,
    "final_logit_softcapping": None,
    "use_bidirectional_attention": None,
    "hidden_size_per_layer_input": 256,
    "num_global_key_value_heads": None,
    "global_head_dim": 512,
    "attention_k_eq_v": False,
    "num_kv_shared_layers": 0,
    "enable_moe_block": False,
    "use_double_wide_mlp": False,
}
_DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """What one decoder layer looks like."""

    index: int
    attention: str  # "sliding_attention" | "full_attention"
    head_dim: int
    num_kv_heads: int
    k_eq_v: bool

    @property
    def is_global(self) -> bool:
        return self.attention == FULL

    @property
    def kind(self) -> str:
        if not self.is_global:
            return "sliding"
        return "global (k_eq_v)" if self.k_eq_v else "global"

    @property
    def flags(self) -> dict[str, bool]:
        return {"k_eq_v": self.k_eq_v, "kv_fused": not self.k_eq_v, "global": self.is_global}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The text model of an HF config, resolved per layer."""

    family: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    layers: tuple[LayerConfig, ...]
    sliding_window: int
    final_logit_softcapping: float | None
    rms_norm_eps: float
    hidden_activation: str
    tie_word_embeddings: bool
    rope: dict
    dialect: str  # "legacy" | "per_layer_config"
    towers: tuple[str, ...]  # configured non-text towers: "vision", "audio"
    hf_config: dict

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def default_key_prefix(self) -> str:
        return "model.language_model." if self.model_type == "gemma4" else "model."

    def model_sizes(self) -> dict[str, int]:
        return {"v": self.vocab_size, "d": self.hidden_size, "one": 1}

    def layer_sizes(self, layer: LayerConfig) -> dict[str, int]:
        return {
            "d": self.hidden_size,
            "n": self.num_heads,
            "h": layer.head_dim,
            "k": layer.num_kv_heads,
            "f": self.intermediate_size,
            "c": 2,
            "one": 1,
        }

    def layer_kinds(self) -> dict[str, int]:
        kinds: dict[str, int] = {}
        for layer in self.layers:
            kinds[layer.kind] = kinds.get(layer.kind, 0) + 1
        return kinds


def read_config_file(path: str) -> dict:
    """Read a config.json, with one-line errors for a missing or malformed file."""
    if not os.path.isfile(path):
        raise InputNotFoundError(f"{path}: no such file; an HF model directory needs its config.json")
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptFileError(f"{path}: not valid JSON ({e}); restore the model's config.json") from None
    if not isinstance(data, dict):
        raise CorruptFileError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _int(cfg: dict, key: str, where: str, minimum: int = 1) -> int:
    value = cfg.get(key, _TEXT_DEFAULTS.get(key))
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where}: {key} must be an integer >= {minimum}, found {value!r}")
    return value


def parse_gemma4_config(hf_config: dict, where: str = "config.json") -> ModelConfig:
    """Resolve a Gemma 4 HF config (either model type, either dialect) per layer."""
    model_type = hf_config.get("model_type")
    towers: list[str] = []
    if model_type == "gemma4":
        text = hf_config.get("text_config")
        if text is None:
            text = {}
        if not isinstance(text, dict):
            raise ConfigError(f"{where}: text_config must be an object")
        for tower in ("vision", "audio"):
            if hf_config.get(f"{tower}_config"):
                towers.append(tower)
        tie = hf_config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    elif model_type == "gemma4_text":
        text = hf_config
        tie = text.get("tie_word_embeddings", True)
    else:
        raise UnsupportedError(
            f"{where}: model_type {model_type!r} is not Gemma 4; supported model types: gemma4, gemma4_text"
        )
    w = f"{where} ({'text_config' if model_type == 'gemma4' else 'gemma4_text'})"
    get = lambda k: text.get(k, _TEXT_DEFAULTS.get(k))  # noqa: E731

    unsupported = []
    if get("enable_moe_block"):
        unsupported.append("enable_moe_block (MoE, e.g. 26B-A4B)")
    if get("hidden_size_per_layer_input"):
        unsupported.append("hidden_size_per_layer_input > 0 (per-layer embeddings, E2B/E4B)")
    if get("num_kv_shared_layers"):
        unsupported.append("num_kv_shared_layers > 0 (kv-shared layers, E2B/E4B)")
    if get("use_double_wide_mlp"):
        unsupported.append("use_double_wide_mlp")
    if get("attention_bias"):
        unsupported.append("attention_bias")
    if get("use_bidirectional_attention") == "all":
        unsupported.append("use_bidirectional_attention='all'")
    if unsupported:
        raise UnsupportedError(
            f"{w}: {', '.join(unsupported)} not supported; ckptbridge handles the dense Gemma 4 text "
            "model (31B-style); set hidden_size_per_layer_input: 0 if the model has no per-layer embeddings"
        )

    num_layers = _int(text, "num_hidden_layers", w)
    head_dim = _int(text, "head_dim", w)
    kv_heads = _int(text, "num_key_value_heads", w)
    num_heads = _int(text, "num_attention_heads", w)
    k_eq_v = bool(get("attention_k_eq_v"))

    layer_types = text.get("layer_types")
    if layer_types is None:
        layer_types = [SLIDING if (i + 1) % 6 else FULL for i in range(num_layers)]
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise ConfigError(f"{w}: layer_types must list {num_layers} entries (num_hidden_layers)")
    bad = sorted({t for t in layer_types if t not in (SLIDING, FULL)})
    if bad:
        raise ConfigError(f"{w}: unknown layer_types {bad}; expected {SLIDING!r} or {FULL!r}")
    layer_types = list(layer_types)
    layer_types[-1] = FULL  # transformers forces the last layer to full attention

    per_layer = text.get("per_layer_config")
    layers = []
    if per_layer is not None:
        dialect = "per_layer_config"
        if not isinstance(per_layer, dict):
            raise ConfigError(f"{w}: per_layer_config must be an object keyed by layer index")
        overrides: dict[int, dict] = {}
        for key, value in per_layer.items():
            if not (str(key).isdigit() and int(key) < num_layers) or not isinstance(value, dict):
                raise ConfigError(
                    f"{w}: per_layer_config key {key!r} must be a layer index < {num_layers} "
                    "mapping to an object of overrides"
                )
            overrides[int(key)] = value
        for i, lt in enumerate(layer_types):
            o = overrides.get(i, {})
            hd = o.get("head_dim", head_dim)
            kv = o.get("num_key_value_heads", kv_heads)
            layers.append(LayerConfig(i, lt, int(hd), int(kv), k_eq_v and lt == FULL))
    else:
        dialect = "legacy"
        global_hd = text.get("global_head_dim", _TEXT_DEFAULTS["global_head_dim"]) or head_dim
        global_kv = text.get("num_global_key_value_heads")
        for i, lt in enumerate(layer_types):
            if lt == FULL:
                kv = global_kv if (k_eq_v and global_kv is not None) else kv_heads
                layers.append(LayerConfig(i, lt, int(global_hd), int(kv), k_eq_v))
            else:
                layers.append(LayerConfig(i, lt, head_dim, kv_heads, False))
    for layer in layers:
        if layer.head_dim < 1 or layer.num_kv_heads < 1 or num_heads % layer.num_kv_heads:
            raise ConfigError(
                f"{w}: layer {layer.index} has head_dim {layer.head_dim} and {layer.num_kv_heads} kv heads; "
                f"kv heads must divide num_attention_heads ({num_heads})"
            )

    rope = text.get("rope_parameters") or _DEFAULT_ROPE
    sliding_window = text.get("sliding_window", _TEXT_DEFAULTS["sliding_window"])
    return ModelConfig(
        family="gemma4",
        model_type=model_type,
        vocab_size=_int(text, "vocab_size", w),
        hidden_size=_int(text, "hidden_size", w),
        intermediate_size=_int(text, "intermediate_size", w),
        num_heads=num_heads,
        layers=tuple(layers),
        sliding_window=int(sliding_window),
        final_logit_softcapping=get("final_logit_softcapping"),
        rms_norm_eps=float(get("rms_norm_eps")),
        hidden_activation=str(get("hidden_activation")),
        tie_word_embeddings=bool(tie),
        rope=rope,
        dialect=dialect,
        towers=tuple(towers),
        hf_config=hf_config,
    )


def family_of(hf_config: dict, where: str = "config.json") -> str:
    """The family name for an HF config's model_type."""
    from ckptbridge.specs import FAMILIES

    model_type = hf_config.get("model_type")
    for spec in FAMILIES.values():
        if model_type in spec.model_types:
            return spec.name
    supported = sorted(t for s in FAMILIES.values() for t in s.model_types)
    raise UnsupportedError(
        f"{where}: model_type {model_type!r} is not supported; supported model types: {', '.join(supported)}"
    )


def parse_config(hf_config: dict, where: str = "config.json") -> ModelConfig:
    """Parse an HF config with its family's parser."""
    from ckptbridge.specs import get_family

    return get_family(family_of(hf_config, where)).parse_config(hf_config, where)
