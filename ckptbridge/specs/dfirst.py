"""What the D-first Tunix families share (``llama3``, ``qwen2``, ``qwen3``): rows, config parser
and Tunix config builder, parameterised by what differs (q/k norms, q/k/v biases, how Tunix
takes RoPE theta, field names of the Tunix config).

Axis sizes: ``v`` vocabulary, ``d`` hidden, ``n`` query heads, ``k`` kv heads, ``h`` head dim,
``f`` MLP width. Tunix's einsums put ``d`` first (``q_proj.w`` is ``d n h``, unlike Gemma's
``n d h``); q, k and v are separate modules, so each has its own LoRA (exact both ways); RMSNorm
weights (``.w``) multiply without Gemma's ``+1`` and copy unchanged. An untied output head is a
top-level ``lm_head.weight``, Tunix's ``lm_head.w`` (``d v``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from ckptbridge.config import FULL, SLIDING, Experts, LayerConfig, ModelConfig, check_heads, int_field, layer_types
from ckptbridge.errors import UnsupportedError
from ckptbridge.specs.base import PeftParam, TensorRule, TunixModel

R = TensorRule
AXES = ("v", "d", "n", "h", "k", "f")
# transformers' fused expert parameters, which PEFT targets with target_parameters
EXPERT_PARAMS = (PeftParam("mlp.experts.gate_up_proj", ("experts_gate", "experts_up")),
                 PeftParam("mlp.experts.down_proj", ("experts_down",)))


def rules(*, qk_norm: bool = False, qkv_bias: bool = False, moe: bool = False) -> tuple[TensorRule, ...]:
    """The rows of a D-first family; ``moe``: layers are MoE or dense (layer flags ``moe`` and
    ``dense_mlp``), a MoE layer's router and its experts stacked on Tunix's leading ``e`` axis
    (``m`` the expert width) from HF's one key per expert."""
    dense = "dense_mlp" if moe else None
    out = [
        R("embed", ("embed_tokens.weight",), "v d", "embedder.input_embedding", "v d", scope="model"),
        R("final_norm", ("norm.weight",), "d", "final_norm.w", "d", scope="model"),
        R("lm_head", ("lm_head.weight",), "v d", "lm_head.w", "d v", scope="model", when="untied_head",
          absolute=True),
        R("q", ("self_attn.q_proj.weight",), "(n h) d", "attn.q_proj.w", "d n h", lora="q_proj"),
        R("k", ("self_attn.k_proj.weight",), "(k h) d", "attn.k_proj.w", "d k h", lora="k_proj"),
        R("v", ("self_attn.v_proj.weight",), "(k h) d", "attn.v_proj.w", "d k h", lora="v_proj"),
        R("o", ("self_attn.o_proj.weight",), "d (n h)", "attn.o_proj.w", "n h d", lora="o_proj"),
    ]
    if qkv_bias:  # flat (n h) in both worlds; never LoRA targets
        out += [R("q_bias", ("self_attn.q_proj.bias",), "(n h)", "attn.q_bias", "(n h)"),
                R("k_bias", ("self_attn.k_proj.bias",), "(k h)", "attn.k_bias", "(k h)"),
                R("v_bias", ("self_attn.v_proj.bias",), "(k h)", "attn.v_bias", "(k h)")]
    if qk_norm:
        out += [R("q_norm", ("self_attn.q_norm.weight",), "h", "attn.q_norm.w", "h"),
                R("k_norm", ("self_attn.k_norm.weight",), "h", "attn.k_norm.w", "h")]
    out += [
        R("gate", ("mlp.gate_proj.weight",), "f d", "mlp.gate_proj.kernel", "d f", when=dense, lora="gate_proj"),
        R("up", ("mlp.up_proj.weight",), "f d", "mlp.up_proj.kernel", "d f", when=dense, lora="up_proj"),
        R("down", ("mlp.down_proj.weight",), "d f", "mlp.down_proj.kernel", "f d", when=dense, lora="down_proj"),
        R("pre_attn_norm", ("input_layernorm.weight",), "d", "input_layernorm.w", "d"),
        R("post_attn_norm", ("post_attention_layernorm.weight",), "d", "post_attention_layernorm.w", "d"),
    ]
    if moe:  # qwix puts no LoRA on raw expert Params (nor on the router: HF's is no nn.Linear for PEFT)
        out += [R("router", ("mlp.gate.weight",), "e d", "mlp.router.kernel", "d e", when="moe"),
                R("experts_gate", ("mlp.experts.{e}.gate_proj.weight",), "m d", "mlp.gate_proj", "e d m", when="moe",
                  stack="e"),
                R("experts_up", ("mlp.experts.{e}.up_proj.weight",), "m d", "mlp.up_proj", "e d m", when="moe",
                  stack="e"),
                R("experts_down", ("mlp.experts.{e}.down_proj.weight",), "d m", "mlp.down_proj", "e m d", when="moe",
                  stack="e")]
    return tuple(out)


def rope(hf_config: dict) -> dict:
    """rope_parameters (transformers 5) or the legacy rope_theta / rope_scaling fields."""
    params = hf_config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return dict(params)
    out = dict(hf_config.get("rope_scaling") or {})
    out.setdefault("rope_type", out.pop("type", "default"))
    out["rope_theta"] = float(hf_config.get("rope_theta", 10_000.0))
    return out


def tiny_config(model_type: str, hf_class: str, dims: dict, *, rope_theta: float, rms_norm_eps: float = 1e-6):
    """The ``tiny_config`` of a D-first family: HF config of a tiny random model with ``dims``, RoPE
    ``rope_theta`` and an untied head (``tie_word_embeddings=True`` ties it)."""
    def make(**overrides: Any) -> dict:
        return {"model_type": model_type, "architectures": [hf_class], **dims,
                "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta}, "tie_word_embeddings": False,
                "rms_norm_eps": rms_norm_eps, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, **overrides}
    return make


@dataclasses.dataclass(frozen=True)
class Extras:
    """A D-first family's own settings (``ModelConfig.extras``)."""

    rope: dict  # rope_parameters (rope_theta, rope_type)
    hidden_act: str
    experts: Experts | None  # the MoE MLP, None for a dense model


@dataclasses.dataclass(frozen=True)
class Dense:
    """One D-first family: its name, HF model type, transformers defaults and refusals."""

    family: str
    model_type: str
    defaults: dict
    refuse: tuple[tuple[str, str], ...] = ()  # (config field that must be false, why)

    def parse_config(self, hf_config: dict, where: str = "config.json") -> ModelConfig:
        if hf_config.get("model_type") != self.model_type:
            raise UnsupportedError(f"{where}: model_type {hf_config.get('model_type')!r} is not {self.model_type}")
        def get(k: str) -> Any:
            return hf_config.get(k, self.defaults.get(k))
        for field, why in self.refuse:
            if get(field):
                raise UnsupportedError(f"{where}: {field} true is not supported ({why})")
        num_layers = int_field(hf_config, "num_hidden_layers", where, self.defaults)
        num_heads = int_field(hf_config, "num_attention_heads", where, self.defaults)
        hidden = int_field(hf_config, "hidden_size", where, self.defaults)
        head_dim = hf_config.get("head_dim", self.defaults.get("head_dim")) or hidden // num_heads  # as transformers
        kv_heads = int_field(hf_config, "num_key_value_heads", where, {"num_key_value_heads": num_heads})
        sliding = bool(get("use_sliding_window"))
        window = hf_config.get("sliding_window") if sliding else None
        types = layer_types(hf_config, num_layers, [FULL] * num_layers, where) if sliding else [FULL] * num_layers
        vocab = int_field(hf_config, "vocab_size", where, self.defaults)
        mlp = int_field(hf_config, "intermediate_size", where, self.defaults)
        sizes = {"v": vocab, "d": hidden, "n": num_heads, "h": head_dim, "k": kv_heads, "f": mlp, "one": 1}
        experts = hf_config.get("num_experts", hf_config.get("num_local_experts", self.defaults.get("num_experts")))
        moe: set[int] = set()
        moe_mlp: Experts | None = None
        if experts:  # as transformers: every decoder_sparse_step-th layer not in mlp_only_layers
            step = int(get("decoder_sparse_step") or 1)
            only = {int(i) for i in (get("mlp_only_layers") or [])}
            moe = {i for i in range(num_layers) if i not in only and (i + 1) % step == 0}
            sizes.update(e=int(experts), m=int_field(hf_config, "moe_intermediate_size", where, self.defaults))
            top_k = int_field(hf_config, "num_experts_per_tok", where, self.defaults)
            moe_mlp = Experts(int(experts), top_k, bool(get("norm_topk_prob")),
                              tuple(i for i in range(num_layers) if i not in moe))
        layers = [LayerConfig(i, t, head_dim, kv_heads,
                              ("sliding" if t == SLIDING else "full") + (" moe" if i in moe else ""),
                              flags={"moe": i in moe, "dense_mlp": i not in moe})
                  for i, t in enumerate(types)]
        check_heads(layers, num_heads, where)
        tie = bool(get("tie_word_embeddings"))
        return ModelConfig(
            family=self.family, model_type=self.model_type, vocab_size=vocab, hidden_size=hidden,
            intermediate_size=mlp, num_heads=num_heads, layers=tuple(layers), rms_norm_eps=float(get("rms_norm_eps")),
            tie_word_embeddings=tie, sliding_window=int(window) if window else None, key_prefix="model.", towers=(),
            sizes=sizes, flags={"untied_head": not tie},
            extras=Extras(rope(hf_config), str(get("hidden_act")), moe_mlp), hf_config=hf_config,
        )


def mismatches(cfg: ModelConfig, name: str, *, fixed_theta: float | None) -> list[str]:
    """What a D-first HF config asks for that Tunix's ``name`` model does not compute. ``fixed_theta``:
    the RoPE theta Tunix uses whatever the config says (None: it takes the config's)."""
    extras: Extras = cfg.extras
    theta = float(extras.rope.get("rope_theta", 10_000.0))
    problems = []
    if fixed_theta is not None and theta != fixed_theta:
        problems.append(f"rope_theta {theta:g} (Tunix {name} always uses {fixed_theta:g})")
    if extras.rope.get("rope_type", "default") != "default":
        problems.append(f"rope_type {extras.rope['rope_type']!r} (Tunix {name} has no RoPE scaling)")
    if cfg.sliding_window:
        problems.append(f"use_sliding_window (Tunix {name} attends to every position)")
    if extras.hidden_act != "silu":
        problems.append(f"hidden_act {extras.hidden_act!r} (Tunix {name} uses silu)")
    experts = extras.experts
    if experts and not experts.norm_topk_prob:
        problems.append(f"norm_topk_prob false (Tunix {name} renormalises the top-k routing weights)")
    return problems


def tunix_config(cfg: ModelConfig, module: str, *, fixed_theta: float | None, tie_field: str, dtypes: bool,
                 dtype: Any = None, param_dtype: Any = None, remat: str | None = None, sharding: Any = None):
    """The Tunix ``ModelConfig`` of a D-first family (the closest to the HF config: see
    :func:`mismatches`). ``dtypes``: whether the Tunix config has ``dtype`` / ``param_dtype``."""
    import importlib

    import jax.numpy as jnp

    tm = importlib.import_module(module)
    extras: Extras = cfg.extras
    theta = float(extras.rope.get("rope_theta", 10_000.0))
    experts = extras.experts
    moe = {}
    if experts:
        if experts.dense_layers:
            raise UnsupportedError(f"config.json: dense MLP layers {list(experts.dense_layers)} (mlp_only_layers, "
                                   "decoder_sparse_step) among MoE layers: Tunix's model makes every layer MoE")
        moe = dict(num_experts=experts.num_experts, num_experts_per_tok=experts.top_k)
    kwargs = dict(num_layers=cfg.num_layers, vocab_size=cfg.vocab_size, embed_dim=cfg.hidden_size,
                  hidden_dim=cfg.sizes["m"] if experts else cfg.intermediate_size, **moe, num_heads=cfg.num_heads,
                  head_dim=cfg.layers[0].head_dim,
                  num_kv_heads=cfg.layers[0].num_kv_heads, rope_theta=int(fixed_theta or theta),
                  norm_eps=cfg.rms_norm_eps, **{tie_field: cfg.tie_word_embeddings})
    if dtypes:
        kwargs.update(param_dtype=jnp.dtype(param_dtype) if param_dtype is not None else jnp.float32,
                      dtype=jnp.dtype(dtype) if dtype is not None else jnp.float32)
    if remat is not None:
        kwargs["remat_config"] = tm.RematConfig[remat.upper()]
    if sharding is not None:
        kwargs["shd_config"] = sharding
    return tm.ModelConfig(**kwargs)


def head(model, h, *, tie_field: str, float32: bool):
    """A D-first Tunix model's output head on its final-normed hidden states: the embedding where
    the config field ``tie_field`` ties it, else ``lm_head``; cast to float32 where the model does."""
    logits = model.embedder.decode(h) if getattr(model.config, tie_field) else model.lm_head(h)
    return logits.astype("float32") if float32 else logits


def experts(cfg: ModelConfig) -> Experts | None:
    return cfg.extras.experts


def tunix_model(module: str, model_class: str, *, fixed_theta: float | None, tie_field: str,
                dtypes: bool, float32_logits: bool) -> TunixModel:
    """The :class:`TunixModel` of a D-first family on Tunix's ``module`` (``float32_logits``: its
    forward casts the logits to float32)."""
    name = module.split(".")[-2]
    return TunixModel(
        module=module, model_class=model_class,
        config=functools.partial(tunix_config, module=module, fixed_theta=fixed_theta, tie_field=tie_field,
                                 dtypes=dtypes),
        mismatches=functools.partial(mismatches, name=name, fixed_theta=fixed_theta),
        head=functools.partial(head, tie_field=tie_field, float32=float32_logits))
