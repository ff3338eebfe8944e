"""Gemma 4's towers as rows: the vision encoder (every size) and the audio encoder (E2B/E4B),
each with the embedder that projects its output into the text model.

HF keys (transformers' ``Gemma4ForConditionalGeneration``) are under ``model.``: the vision tower's
``vision_tower.`` and ``embed_vision.``, the audio tower's ``audio_tower.`` and ``embed_audio.``.
Tunix has no Gemma 4 towers, so a Tunix checkpoint keeps them as HF stores them under ``towers/``
(the rows' Tunix columns are unused). Linear layers of ``use_clipped_linears`` towers carry four
scalars each (the bounds their inputs and outputs are clamped to); ``standardize`` adds a scale
and bias per channel to the vision tower's output.

Axis sizes: ``w`` the tower's width, ``f`` the vision MLP's width, ``n``/``k`` heads and kv heads,
``h`` head dim, ``y``/``x`` a patch (vision) or the subsampling kernel (audio), ``c`` the image's
three channels, ``s`` the position table's length and ``two`` its two axes, ``d`` the text
model's width; audio: ``a``/``b`` the two subsampling convolutions' channels, ``m`` = a / 4
(their output's frequency bins per channel), ``u`` = 4 w (feed-forward), ``z`` = 2 w (the light
convolution's gated input), ``e`` = w (a square projection's input), ``r`` the depthwise kernel,
``o`` the output projection's width.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptbridge.config import int_field
from ckptbridge.errors import ConfigError, UnsupportedError
from ckptbridge.specs import ggml
from ckptbridge.specs.base import TensorRule, Tower, TowerConfig

CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")


def _row(name: str, hf: str, lay: str, scope: str = "layer", when: str | None = None) -> TensorRule:
    """A tower row Tunix does not hold (its Tunix column is the HF layout, under ``towers/``)."""
    return TensorRule(name, (hf,), lay, "", lay, scope=scope, when=when)


def _linear(name: str, module: str, lay: str) -> tuple[TensorRule, ...]:
    """A clippable linear layer (``module.linear.weight``) and, with ``clipped``, its four bounds."""
    return (_row(name, f"{module}.linear.weight", lay),
            *(_row(f"{name}_{b}", f"{module}.{b}", "", when="clipped") for b in CLIP_BOUNDS))


# --------------------------------------------------------------------------- vision

VISION_DEFAULTS: dict[str, Any] = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 16,
                                   "num_attention_heads": 12, "num_key_value_heads": 12, "head_dim": 64,
                                   "patch_size": 16, "position_embedding_size": 10 * 1024}
_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
VISION_RULES: tuple[TensorRule, ...] = (
    _row("patch", "vision_tower.patch_embedder.input_proj.weight", "w (y x c)", "model"),
    _row("positions", "vision_tower.patch_embedder.position_embedding_table", "two s w", "model"),
    _row("std_scale", "vision_tower.std_scale", "w", "model", "standardize"),
    _row("std_bias", "vision_tower.std_bias", "w", "model", "standardize"),
    _row("projection", "embed_vision.embedding_projection.weight", "d w", "model"),
    *_linear("q", "self_attn.q_proj", "(n h) w"),
    *_linear("k", "self_attn.k_proj", "(k h) w"),
    *_linear("v", "self_attn.v_proj", "(k h) w"),
    *_linear("o", "self_attn.o_proj", "w (n h)"),
    _row("q_norm", "self_attn.q_norm.weight", "h"),
    _row("k_norm", "self_attn.k_norm.weight", "h"),
    *_linear("gate", "mlp.gate_proj", "f w"),
    *_linear("up", "mlp.up_proj", "f w"),
    *_linear("down", "mlp.down_proj", "w f"),
    *(_row(norm, f"{norm}.weight", "w") for norm in _NORMS),
)


def parse_vision(vision: dict, cfg: Any, where: str) -> TowerConfig:
    """The vision tower's sizes and flags (transformers' Gemma4VisionConfig defaults)."""
    def size(k: str) -> int:
        return int_field(vision, k, where, VISION_DEFAULTS)
    if vision.get("attention_bias"):
        raise UnsupportedError(f"{where}: attention_bias true: Gemma 4's vision tower has no biases in any released "
                               "model; pass --skip-multimodal to convert the text model")
    sizes = {"w": size("hidden_size"), "f": size("intermediate_size"), "n": size("num_attention_heads"),
             "k": size("num_key_value_heads"), "h": size("head_dim"), "y": size("patch_size"),
             "x": size("patch_size"), "c": 3, "s": size("position_embedding_size"), "two": 2,
             "d": cfg.hidden_size, "one": 1}
    flags = {"clipped": bool(vision.get("use_clipped_linears", False)),
             "standardize": bool(vision.get("standardize", False))}
    return TowerConfig("vision", size("num_hidden_layers"), sizes, flags, vision)


VISION = Tower("vision", VISION_RULES, "vision_tower.encoder.layers", parse_vision,
               axes=("w", "f", "n", "k", "h", "y", "x", "c", "s", "two", "d"), flags=("clipped", "standardize"))

# --------------------------------------------------------------------------- audio

AUDIO_DEFAULTS: dict[str, Any] = {"hidden_size": 1024, "num_hidden_layers": 12, "num_attention_heads": 8,
                                  "conv_kernel_size": 5, "output_proj_dims": 1536}
_SUB = "audio_tower.subsample_conv_projection."
AUDIO_RULES: tuple[TensorRule, ...] = (
    _row("conv0", _SUB + "layer0.conv.weight", "a one y x", "model"),
    _row("conv0_norm", _SUB + "layer0.norm.weight", "a", "model"),
    _row("conv1", _SUB + "layer1.conv.weight", "b a y x", "model"),
    _row("conv1_norm", _SUB + "layer1.norm.weight", "b", "model"),
    _row("input_proj", _SUB + "input_proj_linear.weight", "w (m b)", "model"),
    *(r for ff in ("feed_forward1", "feed_forward2") for r in (
        *_linear(f"{ff}_in", f"{ff}.ffw_layer_1", "u w"),
        *_linear(f"{ff}_out", f"{ff}.ffw_layer_2", "w u"),
        _row(f"{ff}_pre_norm", f"{ff}.pre_layer_norm.weight", "w"),
        _row(f"{ff}_post_norm", f"{ff}.post_layer_norm.weight", "w"))),
    _row("per_dim_scale", "self_attn.per_dim_scale", "h"),
    *_linear("q", "self_attn.q_proj", "(n h) w"),
    *_linear("k", "self_attn.k_proj", "(n h) w"),
    *_linear("v", "self_attn.v_proj", "(n h) w"),
    *_linear("post", "self_attn.post", "w e"),
    _row("relative_k", "self_attn.relative_k_proj.weight", "(n h) w"),
    *_linear("conv_start", "lconv1d.linear_start", "z w"),
    *_linear("conv_end", "lconv1d.linear_end", "w e"),
    _row("depthwise", "lconv1d.depthwise_conv1d.weight", "w one r"),
    _row("conv_pre_norm", "lconv1d.pre_layer_norm.weight", "w"),
    _row("conv_norm", "lconv1d.conv_norm.weight", "w"),
    *(_row(norm, f"{norm}.weight", "w") for norm in ("norm_pre_attn", "norm_post_attn", "norm_out")),
    _row("output_proj", "audio_tower.output_proj.weight", "o w", "model"),
    _row("output_proj_bias", "audio_tower.output_proj.bias", "o", "model"),
    _row("projection", "embed_audio.embedding_projection.weight", "d o", "model"),
)


def parse_audio(audio: dict, cfg: Any, where: str) -> TowerConfig:
    """The audio tower's sizes and flags (transformers' Gemma4AudioConfig defaults)."""
    def size(k: str) -> int:
        return int_field(audio, k, where, AUDIO_DEFAULTS)
    width, heads = size("hidden_size"), size("num_attention_heads")
    if width % heads:
        raise ConfigError(f"{where}: hidden_size {width} is not a multiple of num_attention_heads {heads}")
    channels = audio.get("subsampling_conv_channels", [128, 32])
    if not (isinstance(channels, (list, tuple)) and len(channels) == 2
            and all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in channels)):
        raise ConfigError(f"{where}: subsampling_conv_channels must be two positive integers (got {channels!r})")
    sizes = {"w": width, "n": heads, "h": width // heads, "e": width, "u": 4 * width, "z": 2 * width,
             "a": channels[0], "b": channels[1], "m": channels[0] // 4, "y": 3, "x": 3,
             "r": size("conv_kernel_size"), "o": size("output_proj_dims"), "d": cfg.hidden_size, "one": 1}
    if not sizes["m"]:
        raise ConfigError(f"{where}: subsampling_conv_channels[0] {channels[0]} is below 4")
    return TowerConfig("audio", size("num_hidden_layers"), sizes,
                       {"clipped": bool(audio.get("use_clipped_linears", True))}, audio)


AUDIO = Tower("audio", AUDIO_RULES, "audio_tower.layers", parse_audio,
              axes=("w", "n", "h", "e", "u", "z", "a", "b", "m", "y", "x", "r", "o", "d"), flags=("clipped",))

# the towers of the tiny multimodal Gemma 4 (all dims distinct within each; clipped linears and
# standardized soft tokens, as the released E2B/E4B and 31B have them)
TINY_VISION: dict[str, Any] = dict(hidden_size=32, intermediate_size=44, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, head_dim=12, patch_size=4, position_embedding_size=24,
                                   pooling_kernel_size=2, use_clipped_linears=True, standardize=True)
TINY_AUDIO: dict[str, Any] = dict(hidden_size=24, num_hidden_layers=2, num_attention_heads=2,
                                  subsampling_conv_channels=[8, 6], conv_kernel_size=5, output_proj_dims=20,
                                  attention_chunk_size=4, attention_context_left=5, use_clipped_linears=True)

# --------------------------------------------------------------------------- ggml's projector file

def mmproj_metadata(cfg: Any, towers: Mapping[str, Any], processor: Mapping[str, Any]) -> list:
    """The projector file's ``clip.*`` keys as ggml's converter writes them for Gemma 4
    (``Gemma4VisionAudioModel``): the vision tower's (its image size fixed at 224, unused), the
    audio tower's (feed-forward 4 x hidden), the projector types, 128 mel bins, norms' epsilon."""
    from ckptbridge.specs.ggml import f32, string, u32

    out = ggml.clip_vision_metadata(cfg, towers["vision"], 224, processor)
    audio = towers.get("audio")
    if audio is not None:
        out += ggml.clip_audio_metadata(cfg, audio, 4 * audio.sizes["w"])
    out += [("clip.vision.projector_type", string("gemma4v")),
            ("clip.vision.attention.layer_norm_epsilon", f32(towers["vision"].hf_config.get("layer_norm_eps", 1e-6)))]
    if audio is not None:
        out += [("clip.audio.projector_type", string("gemma4a")),
                ("clip.audio.num_mel_bins", u32(audio.hf_config.get("input_feat_size", 128))),
                ("clip.audio.attention.layer_norm_epsilon", f32(audio.hf_config.get("layer_norm_eps", 1e-6)))]
    return out


_V, _A = "v.blk.{i}.", "a.blk.{i}."
_FF = (("feed_forward1", ""), ("feed_forward2", "_1"))
PROJECTOR = ggml.Projector(
    names={
        "vision": ggml.clipped({
            "patch": ("v.patch_embd.weight", "w c y x"), "positions": ("v.position_embd.weight", None),
            "std_scale": ("v.std_scale", None), "std_bias": ("v.std_bias", None),
            "projection": ("mm.input_projection.weight", None),
            **{r: (f"{_V}attn_{n}.weight", None) for r, n in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "out"))},
            "q_norm": (_V + "attn_q_norm.weight", None), "k_norm": (_V + "attn_k_norm.weight", None),
            **{r: (f"{_V}ffn_{r}.weight", None) for r in ("gate", "up", "down")},
            "input_layernorm": (_V + "ln1.weight", None),
            "post_attention_layernorm": (_V + "attn_post_norm.weight", None),
            "pre_feedforward_layernorm": (_V + "ln2.weight", None),
            "post_feedforward_layernorm": (_V + "ffn_post_norm.weight", None)}),
        "audio": ggml.clipped({
            "conv0": ("a.conv1d.0.weight", None), "conv0_norm": ("a.conv1d.0.norm.weight", None),
            "conv1": ("a.conv1d.1.weight", None), "conv1_norm": ("a.conv1d.1.norm.weight", None),
            "input_proj": ("a.input_projection.weight", None),
            **{f"{ff}{part}": (f"{_A}{name}{n}.weight", None) for ff, n in _FF
               for part, name in (("_in", "ffn_up"), ("_out", "ffn_down"), ("_pre_norm", "ffn_norm"),
                                  ("_post_norm", "ffn_post_norm"))},
            "per_dim_scale": (_A + "per_dim_scale.weight", None),
            **{r: (f"{_A}attn_{n}.weight", None) for r, n in (("q", "q"), ("k", "k"), ("v", "v"), ("post", "out"))},
            "relative_k": (_A + "attn_k_rel.weight", None),
            "conv_start": (_A + "conv_pw1.weight", None), "conv_end": (_A + "conv_pw2.weight", None),
            "depthwise": (_A + "conv_dw.weight", "w (one r)"), "conv_pre_norm": (_A + "conv_norm.weight", None),
            "conv_norm": (_A + "norm_conv.weight", None), "norm_pre_attn": (_A + "attn_pre_norm.weight", None),
            "norm_post_attn": (_A + "attn_post_norm.weight", None), "norm_out": (_A + "ln2.weight", None),
            "output_proj": ("a.pre_encode.out.weight", None), "output_proj_bias": ("a.pre_encode.out.bias", None),
            "projection": ("mm.a.input_projection.weight", None)}),
    },
    metadata=mmproj_metadata,
    values={("audio", "per_dim_scale"): "softplus"},
    types={("vision", "patch"): "patch", ("vision", "positions"): "f32",
           **{("audio", r): "f32" for r in ("conv0", "conv1", "input_proj", "depthwise")}},
)
