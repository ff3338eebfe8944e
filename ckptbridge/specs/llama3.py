"""Llama 3 / 3.1 / 3.2 (``llama``, LlamaForCausalLM) on Tunix's ``llama3``: the D-first rows of
:mod:`ckptbridge.specs.dfirst` without q/k norms or biases; tied head on 3.2 1B/3B.

Tunix 0.1.7's ``llama3`` computes RoPE with theta 1e6 and without ``rope_type: llama3`` scaling,
whatever the config says (real Llama 3.x: theta 5e5, llama3 scaling), so a Tunix model is built
only for configs it computes like transformers; files convert exactly for any config.
"""

from __future__ import annotations

from typing import Any

from ckptbridge.specs import dfirst, ggml, maxtext
from ckptbridge.specs.base import FamilySpec, ModelType

DENSE = dfirst.Dense("llama3", "llama", {
    "vocab_size": 32_000, "hidden_size": 4096, "intermediate_size": 11_008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}, refuse=(("attention_bias", "Tunix llama3 has no attention biases"),
           ("mlp_bias", "Tunix llama3 has no MLP biases")))
TUNIX_MODULE = "tunix.models.llama3.model"
TUNIX = dfirst.tunix_model(TUNIX_MODULE, "Llama3", fixed_theta=1_000_000.0, tie_field="weight_tying",
                          dtypes=False, float32_logits=False)  # no dtype settings: Tunix llama3 computes in float32


TINY_DIMS: dict[str, Any] = dict(vocab_size=300, hidden_size=40, intermediate_size=56, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=12)
VLLM_DIMS: dict[str, Any] = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=64)


# HF config of a tiny random model (theta 1e6, the value Tunix computes with; untied head)
tiny_config = dfirst.tiny_config("llama", "LlamaForCausalLM", TINY_DIMS, rope_theta=1_000_000.0, rms_norm_eps=1e-5)


def gguf_metadata(h: dict, block_count: int) -> list:
    """The common keys, the vocabulary size and the rotary width."""
    from ckptbridge.specs.ggml import u32

    return ggml.base_metadata(h, block_count) + [
        ("{arch}.vocab_size", u32(h["vocab_size"])),
        ("{arch}.rope.dimension_count", u32(h.get("head_dim") or h["hidden_size"] // h["num_attention_heads"]))]


GGUF = ggml.GGUFSpec(arch="llama", names=ggml.COMMON_NAMES, metadata=gguf_metadata, extra=ggml.llama3_rope_freqs,
                     rope_rows={"self_attn.q_proj.weight": "num_attention_heads",
                                "self_attn.k_proj.weight": "num_key_value_heads"})

LLAMA3 = FamilySpec(
    name="llama3", types=(ModelType("llama", "LlamaForCausalLM", "model.", tiny_config),),
    rules=dfirst.rules(), key_prefixes=("model.",),
    parse_config=DENSE.parse_config, axes=dfirst.AXES, model_flags=("untied_head",), tied_keys=("lm_head.weight",),
    tunix=TUNIX, experts=dfirst.experts,
    vllm_tiny=VLLM_DIMS, gguf={"llama": GGUF}, maxtext=maxtext.LLAMA3,
)
