"""The rows every Gemma generation shares (Tunix ``gemma``, ``gemma3``, ``gemma4``).

Axis sizes: ``v`` vocabulary, ``d`` hidden, ``n`` query heads, ``k`` kv heads, ``h`` head dim,
``f`` MLP width, ``c`` the fused axis. Tunix's Gemma einsums put heads first (``q_einsum`` is
``n d h``); ``kv_einsum`` fuses ``k_proj`` and ``v_proj`` (one LoRA A shared by both) and, when
query and kv heads are equal, ``qkv_einsum`` fuses all three (``fused_qkv``: Gemma 1 7B). RMSNorm
is ``x * (1 + scale)`` in both worlds, so norms copy unchanged. Each generation names its norms
its own way and adds its own rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ckptbridge.specs.base import TensorRule

R = TensorRule
AXES = ("v", "d", "n", "h", "k", "f")

EMBED = R("embed", ("embed_tokens.weight",), "v d", "embedder.input_embedding", "v d", scope="model")
FINAL_NORM = R("final_norm", ("norm.weight",), "d", "final_norm.scale", "d", scope="model")


def embedding_head(model, h, *, softcap: Callable[[Any], float | None] | None = None, float32: bool = False):
    """A Gemma Tunix model's output head on its final-normed hidden states: the tied embedding's
    ``decode``, cast to float32 where the model does, then ``cap * tanh(logits / cap)`` where
    ``softcap(model)`` gives a cap."""
    logits = model.embedder.decode(h)
    if float32:
        logits = logits.astype("float32")
    cap = softcap(model) if softcap is not None else None
    if cap is not None:
        import jax.numpy as jnp

        logits = jnp.tanh(logits / cap) * cap
    return logits


O = R("o", ("self_attn.o_proj.weight",), "d (n h)", "attn.attn_vec_einsum.w", "n h d", lora="attn_vec_einsum")  # noqa: E741
QK_NORMS = (R("q_norm", ("self_attn.q_norm.weight",), "h", "attn._query_norm.scale", "h"),
            R("k_norm", ("self_attn.k_norm.weight",), "h", "attn._key_norm.scale", "h"))
MLP = (R("gate", ("mlp.gate_proj.weight",), "f d", "mlp.gate_proj.kernel", "d f", lora="gate_proj"),
       R("up", ("mlp.up_proj.weight",), "f d", "mlp.up_proj.kernel", "d f", lora="up_proj"),
       R("down", ("mlp.down_proj.weight",), "d f", "mlp.down_proj.kernel", "f d", lora="down_proj"))
PRE_ATTN_NORM = R("pre_attn_norm", ("input_layernorm.weight",), "d", "pre_attention_norm.scale", "d")


def q(when: str | None = None) -> TensorRule:
    return R("q", ("self_attn.q_proj.weight",), "(n h) d", "attn.q_einsum.w", "n d h", when=when, lora="q_einsum")


def kv(when: str) -> TensorRule:
    return R("kv", ("self_attn.k_proj.weight", "self_attn.v_proj.weight"), "(k h) d", "attn.kv_einsum.w", "c k d h",
             when=when, lora="kv_einsum")


def qkv(when: str) -> TensorRule:
    return R("qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), "(n h) d",
             "attn.qkv_einsum.w", "c n d h", when=when, lora="qkv_einsum")


def sandwich_norms(post_attn: str) -> tuple[TensorRule, ...]:
    """Gemma 2-4's four norms per layer (``post_attn``: Tunix's name of the post-attention norm)."""
    return (PRE_ATTN_NORM,
            R("post_attn_norm", ("post_attention_layernorm.weight",), "d", f"{post_attn}.scale", "d"),
            R("pre_ffw_norm", ("pre_feedforward_layernorm.weight",), "d", "pre_ffw_norm.scale", "d"),
            R("post_ffw_norm", ("post_feedforward_layernorm.weight",), "d", "post_ffw_norm.scale", "d"))
