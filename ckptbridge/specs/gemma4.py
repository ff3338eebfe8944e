"""Gemma 4 (dense text model): the HF <-> Tunix table.

Notation for axis sizes: ``v`` vocabulary, ``d`` hidden, ``n`` query heads, ``k`` kv heads of
the layer, ``h`` head dim of the layer, ``f`` MLP width, ``c`` the fused k/v axis (k first).
Sliding layers and global layers without ``attention_k_eq_v`` fuse ``k_proj`` and ``v_proj``
into ``kv_einsum``; global layers with ``attention_k_eq_v`` have only ``k_proj`` (V is the raw
K projection) and map it to ``k_einsum``. Per-layer head dim and kv heads come from the config
(:mod:`ckptbridge.config`), so the same rows serve every layer kind.
"""

from __future__ import annotations

from ckptbridge.specs.base import FamilySpec, TensorRule

R = TensorRule

RULES: tuple[TensorRule, ...] = (
    R("embed", ("embed_tokens.weight",), "v d", "embedder.input_embedding", "v d", scope="model"),
    R("final_norm", ("norm.weight",), "d", "final_norm.scale", "d", scope="model"),
    R("q", ("self_attn.q_proj.weight",), "(n h) d", "attn.q_einsum.w", "n d h", lora="q_einsum"),
    R("kv", ("self_attn.k_proj.weight", "self_attn.v_proj.weight"), "(k h) d",
      "attn.kv_einsum.w", "c k d h", when="kv_fused", lora="kv_einsum"),
    # On k_eq_v layers V is the raw K projection; vLLM computes V with its own LoRA slot, so a
    # vLLM-bound adapter repeats the k_proj factors as v_proj.
    R("k", ("self_attn.k_proj.weight",), "(k h) d", "attn.k_einsum.w", "k d h",
      when="k_eq_v", lora="k_einsum", vllm_lora_aliases=("self_attn.v_proj.weight",)),
    R("o", ("self_attn.o_proj.weight",), "d (n h)", "attn.attn_vec_einsum.w", "n h d",
      lora="attn_vec_einsum"),
    R("q_norm", ("self_attn.q_norm.weight",), "h", "attn._query_norm.scale", "h"),
    R("k_norm", ("self_attn.k_norm.weight",), "h", "attn._key_norm.scale", "h"),
    R("gate", ("mlp.gate_proj.weight",), "f d", "mlp.gate_proj.kernel", "d f", lora="gate_proj"),
    R("up", ("mlp.up_proj.weight",), "f d", "mlp.up_proj.kernel", "d f", lora="up_proj"),
    R("down", ("mlp.down_proj.weight",), "d f", "mlp.down_proj.kernel", "f d", lora="down_proj"),
    R("pre_attn_norm", ("input_layernorm.weight",), "d", "pre_attention_norm.scale", "d"),
    R("post_attn_norm", ("post_attention_layernorm.weight",), "d", "post_attention_norm.scale", "d"),
    R("pre_ffw_norm", ("pre_feedforward_layernorm.weight",), "d", "pre_ffw_norm.scale", "d"),
    R("post_ffw_norm", ("post_feedforward_layernorm.weight",), "d", "post_ffw_norm.scale", "d"),
    R("layer_scalar", ("layer_scalar",), "one", "skip_scale", "one"),
)


def _parse(hf_config: dict, where: str = "config.json"):
    from ckptbridge.config import parse_gemma4_config

    return parse_gemma4_config(hf_config, where)


GEMMA4 = FamilySpec(
    name="gemma4",
    model_types=("gemma4", "gemma4_text"),
    rules=RULES,
    key_prefixes=("model.language_model.", "model."),
    foreign_prefixes=(
        "model.vision_tower.",
        "model.audio_tower.",
        "model.embed_vision.",
        "model.embed_audio.",
        "model.multi_modal_projector.",
    ),
    tied_keys=("lm_head.weight",),
    parse_config=_parse,
)
