"""How MaxText names and lays out a family's rows: one more column of the same table.

A :class:`MaxTextSpec` gives, for each rule of a family, the parameter's path in MaxText's Linen
tree (under ``params/params`` in a checkpoint) and its layout as an axis pattern over the rule's
own axis names. Model-scope paths are whole (``token_embedder/embedding``); layer-scope paths are
relative to the layer's module: ``decoder/layers_{i}`` unscanned, ``decoder/layers`` with
``scan_layers``, where every layer's tensor is stacked on axis 1 (MaxText's ``param_scan_axis``;
``ckptbridge.formats.maxtext.layout``). What MaxText does, family by family: docs/maxtext-reference.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class Part:
    """One MaxText parameter of a row: its path (relative to the layer's module for layer rows),
    its layout over the row's axes, and ``select`` = (axis, index) where the row fuses several of
    MaxText's parameters along one of its axes (Gemma's ``kv``: key and value along ``c``; fused
    expert gate and up along ``g``): this parameter is that index of the row."""

    path: str
    layout: str
    select: tuple[str, int] | None = None
    pad: str | None = None  # an axis MaxText may hold more of than HF (the vocabulary): zeros past HF's


@dataclasses.dataclass(frozen=True)
class Scan:
    """How MaxText stacks the layers with ``scan_layers``: in blocks of ``period`` layers, each
    group of positions in a block one module (``groups``: module path under ``decoder`` ->
    positions). A group of one position stacks its layers on axis 1; a group of several nests
    them, blocks on axis 1 and positions on axis 2 (Gemma 4's ``scanned_blocks/local_layers``).
    Layers past the last whole block sit in ``remainder`` (``{r}``: their index past it), unstacked;
    None: MaxText has no form for them. With ``suffixes`` a block is one MaxText layer, scanned or
    not, whose positions are told apart by a suffix (Gemma 2: ``self_attention_local`` and
    ``self_attention_global`` in ``layers_{i}``)."""

    period: int = 1
    groups: tuple[tuple[str, tuple[int, ...]], ...] = (("layers", (0,)),)
    remainder: str | None = None
    suffixes: tuple[str, ...] = ()  # per position, on the first name of each path: one MaxText layer per block


@dataclasses.dataclass(frozen=True)
class MaxTextSpec:
    """``names``: rule name -> (MaxText path, MaxText layout), or the :class:`Part` tuple of a row
    that is several MaxText parameters. A rule without a name has no MaxText parameter (the
    family's MaxText model has none). ``when``: layer flag -> names that replace those of
    ``names`` on layers with the flag (Gemma 4's dense MLP sits under ``moe_block/shared_experts``
    in its MoE layers). ``transforms``: rule name -> the value transforms MaxText's conversion
    applies to it, by name (``ckptbridge.formats.maxtext.layout.TRANSFORMS``), on the way to MaxText,
    after the layout change. ``scan``: how ``scan_layers`` stacks the layers; ``no_scan_when``:
    a model flag under which MaxText has no scanned form (Gemma 4 E2B/E4B); ``vocab``: the
    vocabulary MaxText's model configs give where HF's is smaller (a :class:`Part` with ``pad``
    is padded with zero rows to it). ``towers``: tower -> its rows' (path, layout) in MaxText's tree
    (``vision_encoder/...``, ``{i}`` the tower layer: never scanned), ``tower_transforms`` their
    value transforms; ``tower_refusal``: ``(cfg, tower configs) -> why`` MaxText's model cannot
    hold the towers of this config (None: it can)."""

    names: Mapping[str, tuple[str, str] | tuple[Part, ...]]
    transforms: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    when: Mapping[str, Mapping[str, tuple[str, str] | tuple[Part, ...]]] = dataclasses.field(default_factory=dict)
    scan: Scan = Scan()
    no_scan_when: str | None = None
    vocab: Mapping[int, int] = dataclasses.field(default_factory=dict)  # HF vocab -> MaxText's, where they differ
    towers: Mapping[str, Mapping[str, tuple[str, str]]] = dataclasses.field(default_factory=dict)
    tower_transforms: Mapping[str, Mapping[str, tuple[str, ...]]] = dataclasses.field(default_factory=dict)
    tower_refusal: Callable[[Any, Mapping[str, Any]], str | None] | None = None

    def parts(self, rule: str, flags: Mapping[str, bool]) -> tuple[Part, ...] | None:
        """The MaxText parameters of ``rule`` on a layer with ``flags`` (None: MaxText has none)."""
        name = self.names.get(rule)
        for flag, names in self.when.items():
            if flags.get(flag) and rule in names:
                name = names[rule]
        if name is None:
            return None
        if isinstance(name[0], Part):
            return tuple(name)
        path, lay = name
        return (Part(path, lay),)


# The rows of ckptbridge.specs.dfirst (Qwen 3 dense and MoE, Qwen 2.5, Llama 3), as MaxText's
# Qwen and Llama 3.1 decoders hold them (param_mapping.py QWEN_* and LLAMA31_*): Linen DenseGeneral
# kernels are [in..., out...], biases [heads, head_dim], experts [experts, in, out].
DFIRST = MaxTextSpec({
    "embed": ("token_embedder/embedding", "v d"),
    "final_norm": ("decoder/decoder_norm/scale", "d"),
    "lm_head": ("decoder/logits_dense/kernel", "d v"),
    "q": ("self_attention/query/kernel", "d n h"),
    "k": ("self_attention/key/kernel", "d k h"),
    "v": ("self_attention/value/kernel", "d k h"),
    "o": ("self_attention/out/kernel", "n h d"),
    "q_bias": ("self_attention/query/bias", "n h"),
    "k_bias": ("self_attention/key/bias", "k h"),
    "v_bias": ("self_attention/value/bias", "k h"),
    "q_norm": ("self_attention/query_norm/scale", "h"),
    "k_norm": ("self_attention/key_norm/scale", "h"),
    "gate": ("mlp/wi_0/kernel", "d f"),
    "up": ("mlp/wi_1/kernel", "d f"),
    "down": ("mlp/wo/kernel", "f d"),
    "pre_attn_norm": ("pre_self_attention_layer_norm/scale", "d"),
    "post_attn_norm": ("post_self_attention_layer_norm/scale", "d"),
    "router": ("moe_block/gate/kernel", "d e"),
    "experts_gate": ("moe_block/wi_0", "e d m"),
    "experts_up": ("moe_block/wi_1", "e d m"),
    "experts_down": ("moe_block/wo", "e m d"),
})

# Llama 3.1 (LLAMA31_MAXTEXT_TO_HF_PARAM_HOOK_FN): MaxText's Llama attention does not scale the
# query at run time, so 1/sqrt(head_dim) is folded into the query kernel, and its RoPE pairs
# adjacent features, so q and k go from HF's half-split order to interleaved.
LLAMA3 = dataclasses.replace(DFIRST, transforms={"q": ("rope_interleave", "query_scale"), "k": ("rope_interleave",)})

# Gemma 4 (GEMMA4_MAXTEXT_TO_HF_PARAM_MAPPING and GEMMA4_SMALL_...): separate key and value kernels
# (none for the value on k_eq_v layers), the fused expert gate/up split in two, the embedding
# stored times sqrt(hidden) (a float32 scalar), norms as HF stores them. Scanned: blocks of five
# local layers nested under one global layer (31B, 26B-A4B); E2B/E4B have no scanned form.
_NORMS = {"pre_attn_norm": ("pre_self_attention_norm/scale", "d"),
          "post_attn_norm": ("post_self_attention_norm/scale", "d"),
          "pre_ffw_norm": ("pre_ffw_norm/scale", "d"), "post_ffw_norm": ("post_ffw_norm/scale", "d")}
# Gemma 4's vision tower (GEMMA4_MAXTEXT_TO_HF_PARAM_MAPPING with use_multimodal): MaxText's
# Gemma4VisionEncoderLayer and projector, Linen DenseGeneral kernels [in..., out...], the patch
# projection transposed, the position table's two axes after its length, norms as HF stores them.
_G4V = "vision_encoder/Gemma4VisionEncoderLayer_0/"
_G4L = _G4V + "layer_{i}/"
GEMMA4_VISION = {
    "patch": (_G4V + "vision_entry/input_projection/kernel", "(y x c) w"),
    "positions": (_G4V + "vision_entry/pos_emb_param", "s two w"),
    "std_scale": (_G4V + "std_scale", "w"),
    "std_bias": (_G4V + "std_bias", "w"),
    "projection": ("vision_encoder/Gemma4VisionProjector_0/projection/kernel", "w d"),
    "q": (_G4L + "attention/query/kernel", "w n h"),
    "k": (_G4L + "attention/key/kernel", "w k h"),
    "v": (_G4L + "attention/value/kernel", "w k h"),
    "o": (_G4L + "attention/out/kernel", "n h w"),
    "q_norm": (_G4L + "attention/query_norm/scale", "h"),
    "k_norm": (_G4L + "attention/key_norm/scale", "h"),
    "gate": (_G4L + "mlp/wi_0/kernel", "w f"),
    "up": (_G4L + "mlp/wi_1/kernel", "w f"),
    "down": (_G4L + "mlp/wo/kernel", "f w"),
    "input_layernorm": (_G4L + "pre_attention_norm/scale", "w"),
    "post_attention_layernorm": (_G4L + "post_attention_norm/scale", "w"),
    "pre_feedforward_layernorm": (_G4L + "pre_ffw_norm/scale", "w"),
    "post_feedforward_layernorm": (_G4L + "post_ffw_norm/scale", "w"),
}


def _gemma4_towers(cfg: Any, towers: Mapping[str, Any]) -> str | None:
    """What of a Gemma 4's towers MaxText's model has no form for (its E2B/E4B mapping has no
    multimodal tensors; its vision encoder has heads of hidden / heads, no kv groups, no clipped
    linears, and the standardizing scale and bias)."""
    if cfg.flags.get("ple"):
        return "MaxText's Gemma 4 E2B/E4B model (per-layer embeddings) has no vision or audio tower yet"
    vision = towers.get("vision")
    if vision is not None:
        sizes, flags = vision.sizes, vision.flags
        if flags.get("clipped") or not flags.get("standardize") or sizes["k"] != sizes["n"] \
                or sizes["n"] * sizes["h"] != sizes["w"]:
            return ("MaxText's Gemma 4 vision encoder holds towers of head_dim = hidden_size / heads, as many kv "
                    "heads, standardize true and no clipped linears; this vision_config is not one")
    return None


GEMMA4 = MaxTextSpec(
    names={
        "embed": ("token_embedder/embedding", "v d"),
        "final_norm": ("decoder/decoder_norm/scale", "d"),
        "ple_embed": ("decoder/per_layer_embedder/embed_tokens_per_layer", "u (l p)"),
        "ple_projection": ("decoder/per_layer_embedder/per_layer_model_projection/kernel", "d (l p)"),
        "ple_norm": ("decoder/per_layer_embedder/per_layer_projection_norm/scale", "p"),
        "q": ("self_attention/query/kernel", "d n h"),
        "kv": (Part("self_attention/key/kernel", "d k h", ("c", 0)),
               Part("self_attention/value/kernel", "d k h", ("c", 1))),
        "k": ("self_attention/key/kernel", "d k h"),
        "o": ("self_attention/out/kernel", "n h d"),
        "q_norm": ("self_attention/query_norm/scale", "h"),
        "k_norm": ("self_attention/key_norm/scale", "h"),
        "gate": ("mlp/wi_0/kernel", "d f"),
        "up": ("mlp/wi_1/kernel", "d f"),
        "down": ("mlp/wo/kernel", "f d"),
        **_NORMS,
        "layer_scalar": ("layer_scalar", "one"),
        "ple_gate": ("per_layer_input_gate/kernel", "d p"),
        "ple_proj": ("per_layer_projection/kernel", "p d"),
        "ple_post_norm": ("post_per_layer_input_norm/scale", "d"),
        "router": ("mlp/moe_block/MoeBlock_0/gate/kernel", "d e"),
        "router_scale": ("mlp/pre_forward_scale_2", "d"),
        "expert_scale": ("mlp/moe_block/MoeBlock_0/per_expert_scale", "e"),
        "experts_gate_up": (Part("mlp/moe_block/MoeBlock_0/wi_0", "e d m", ("g", 0)),
                            Part("mlp/moe_block/MoeBlock_0/wi_1", "e d m", ("g", 1))),
        "experts_down": ("mlp/moe_block/MoeBlock_0/wo", "e m d"),
        "moe_pre_ffw_norm": ("mlp/pre_feedforward_layernorm_2/scale", "d"),
        "dense_post_ffw_norm": ("mlp/post_feedforward_layernorm_1/scale", "d"),
        "moe_post_ffw_norm": ("mlp/post_feedforward_layernorm_2/scale", "d"),
    },
    when={"moe": {"gate": ("mlp/moe_block/shared_experts/wi_0/kernel", "d f"),
                  "up": ("mlp/moe_block/shared_experts/wi_1/kernel", "d f"),
                  "down": ("mlp/moe_block/shared_experts/wo/kernel", "f d")}},
    transforms={"embed": ("embed_scale",)},
    scan=Scan(6, (("scanned_blocks/local_layers", (0, 1, 2, 3, 4)), ("scanned_blocks/global_layer", (5,)))),
    no_scan_when="ple",
    towers={"vision": GEMMA4_VISION},
    tower_refusal=_gemma4_towers,
)

# Gemma 3 (GEMMA3_MAXTEXT_TO_HF_PARAM_MAPPING): the same tree as Gemma 4's dense layers; norms
# stored as 1 + w in float32, the embedding times sqrt(hidden) rounded to bf16. Scanned: blocks of
# six layers, each position its own module (layers/layers_{b}, stacked on axis 1), the layers past
# the last whole block unstacked in layers_remainder.
_GEMMA3_NORMS = ("final_norm", "pre_attn_norm", "post_attn_norm", "pre_ffw_norm", "post_ffw_norm", "q_norm", "k_norm")
# Gemma 3's SigLIP tower (GEMMA3_MAXTEXT_TO_HF_PARAM_MAPPING with use_multimodal): Linen
# DenseGeneral kernels [in..., out...] with biases [heads, head_dim], the patch convolution
# (y, x, in, out), the position table with a leading axis of 1; the projector's norm stored as
# 1 + w in float32, as the text model's.
_G3V = "vision_encoder/Gemma3VisionEncoderLayer_0/"
_G3B = _G3V + "Transformer/encoderblock_{i}/"
_G3A = _G3B + "MultiHeadDotProductAttention_0/"
GEMMA3_VISION = {
    "patch": (_G3V + "embedding/kernel", "y x c w"),
    "patch_bias": (_G3V + "embedding/bias", "w"),
    "positions": (_G3V + "pos_embedding", "one t w"),
    "ln1": (_G3B + "LayerNorm_0/scale", "w"), "ln1_bias": (_G3B + "LayerNorm_0/bias", "w"),
    "ln2": (_G3B + "LayerNorm_1/scale", "w"), "ln2_bias": (_G3B + "LayerNorm_1/bias", "w"),
    "q": (_G3A + "query/kernel", "w n h"), "q_bias": (_G3A + "query/bias", "n h"),
    "k": (_G3A + "key/kernel", "w n h"), "k_bias": (_G3A + "key/bias", "n h"),
    "v": (_G3A + "value/kernel", "w n h"), "v_bias": (_G3A + "value/bias", "n h"),
    "o": (_G3A + "out/kernel", "n h w"), "o_bias": (_G3A + "out/bias", "w"),
    "fc1": (_G3B + "MlpBlockViT_0/Dense_0/kernel", "w f"), "fc1_bias": (_G3B + "MlpBlockViT_0/Dense_0/bias", "f"),
    "fc2": (_G3B + "MlpBlockViT_0/Dense_1/kernel", "f w"), "fc2_bias": (_G3B + "MlpBlockViT_0/Dense_1/bias", "w"),
    "post_norm": (_G3V + "Transformer/encoder_norm/scale", "w"),
    "post_norm_bias": (_G3V + "Transformer/encoder_norm/bias", "w"),
    "mm_projection": ("vision_encoder/VisionEmbedder_0/mm_input_projection/w", "w d"),
    "mm_norm": ("vision_encoder/VisionEmbedder_0/mm_soft_embedding_norm/scale", "w"),
}
GEMMA3 = MaxTextSpec(
    names={
        **{r: GEMMA4.names[r] for r in ("embed", "final_norm", "q", "kv", "o", "q_norm", "k_norm", "gate", "up",
                                        "down", *_NORMS)},
        "qkv": (Part("self_attention/query/kernel", "d n h", ("c", 0)),
                Part("self_attention/key/kernel", "d n h", ("c", 1)),
                Part("self_attention/value/kernel", "d n h", ("c", 2))),
    },
    transforms={"embed": ("embed_scale_bf16",), **dict.fromkeys(_GEMMA3_NORMS, ("norm_plus_one",))},
    scan=Scan(6, tuple((f"layers/layers_{b}", (b,)) for b in range(6)), remainder="layers_remainder/layers_{r}"),
    towers={"vision": GEMMA3_VISION},
    tower_transforms={"vision": {"mm_norm": ("norm_plus_one",)}},
)

# Gemma 2 (GEMMA2_MAXTEXT_TO_HF_PARAM_MAPPING): one MaxText layer per pair of HF layers (local,
# global), told apart by suffixes; norms 1 + w in float32, the embedding times sqrt(hidden) (a
# float32 scalar) and padded to MaxText's vocabulary (256000 -> 256128, gemma2-*.yml), the
# query times 1/sqrt(head_dim) (a float32 scalar).
GEMMA2 = MaxTextSpec(
    names={
        **{r: v for r, v in GEMMA3.names.items() if r not in ("q_norm", "k_norm", "embed", "qkv")},
        "embed": (Part("token_embedder/embedding", "v d", pad="v"),),
    },
    transforms={"embed": ("embed_scale",), "q": ("query_scale",),
                **dict.fromkeys(_GEMMA3_NORMS[:5], ("norm_plus_one",))},
    scan=Scan(2, (("layers", (0,)), ("layers", (1,))), suffixes=("_local", "_global")),
    vocab={256000: 256128},
)
