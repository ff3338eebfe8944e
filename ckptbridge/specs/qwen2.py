"""Qwen 2.5 and the DeepSeek-R1 Qwen distills (``qwen2``, Qwen2ForCausalLM) on Tunix's ``qwen2``:
the D-first rows of :mod:`ckptbridge.specs.dfirst` plus q/k/v biases (flat ``(n h)`` in both
worlds, never LoRA targets); tied head on 0.5B-3B. Tunix takes ``rope_theta`` from its config.
"""

from __future__ import annotations

from typing import Any

from ckptbridge.specs import dfirst, ggml, maxtext
from ckptbridge.specs.base import FamilySpec, ModelType

DENSE = dfirst.Dense("qwen2", "qwen2", {
    "vocab_size": 151_936, "hidden_size": 4096, "intermediate_size": 22_016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "use_sliding_window": False,
})
TUNIX_MODULE = "tunix.models.qwen2.model"
TUNIX = dfirst.tunix_model(TUNIX_MODULE, "Qwen2", fixed_theta=None, tie_field="use_tied_embedding",
                          dtypes=True, float32_logits=True)


# All distinct: V, D, N, K, H (= D / N, Qwen 2 has no head_dim field), F.
TINY_DIMS: dict[str, Any] = dict(vocab_size=300, hidden_size=48, intermediate_size=56, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=2)
VLLM_DIMS: dict[str, Any] = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                 num_attention_heads=2, num_key_value_heads=1)


# HF config of a tiny random model (theta 1e4 to show Tunix takes it; untied head)
tiny_config = dfirst.tiny_config("qwen2", "Qwen2ForCausalLM", TINY_DIMS, rope_theta=10_000.0)


QWEN2 = FamilySpec(
    name="qwen2", types=(ModelType("qwen2", "Qwen2ForCausalLM", "model.", tiny_config),),
    rules=dfirst.rules(qkv_bias=True), key_prefixes=("model.",),
    parse_config=DENSE.parse_config, axes=dfirst.AXES, model_flags=("untied_head",), tied_keys=("lm_head.weight",),
    tunix=TUNIX, experts=dfirst.experts,
    vllm_tiny=VLLM_DIMS,
    gguf={"qwen2": ggml.GGUFSpec(arch="qwen2", names=ggml.COMMON_NAMES, metadata=ggml.base_metadata)},
    maxtext=maxtext.DFIRST,
)
