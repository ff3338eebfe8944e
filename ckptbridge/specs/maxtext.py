"""How MaxText names and lays out a family's rows: one more column of the same table.

A :class:`MaxTextSpec` gives, for each rule of a family, the parameter's path in MaxText's Linen
tree (under ``params/params`` in a checkpoint) and its layout as an axis pattern over the rule's
own axis names. Model-scope paths are whole (``token_embedder/embedding``); layer-scope paths are
relative to the layer's module: ``decoder/layers_{i}`` unscanned, ``decoder/layers`` with
``scan_layers``, where every layer's tensor is stacked on axis 1 (MaxText's ``param_scan_axis``;
``ckptbridge.maxtext_layout``). What MaxText does, family by family: docs/maxtext-reference.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class MaxTextSpec:
    """``names``: rule name -> (MaxText path, MaxText layout). A rule without a name has no
    MaxText parameter (the family's MaxText model has none). ``transforms``: rule name -> the
    value transforms MaxText's conversion applies to it, by name
    (``ckptbridge.maxtext_layout.TRANSFORMS``), on the way to MaxText, after the layout change."""

    names: Mapping[str, tuple[str, str]]
    transforms: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


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
