"""Build a Tunix ``Gemma4`` model from an HF directory or a ckptbridge Orbax checkpoint.

This is the one module that knows Tunix's model classes. The weights go through the same
spec table as the file conversions (never through Tunix's own safetensors loader), and are
placed on a mesh, if one is given, with the sharding annotations of Tunix's parameters.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from ckptbridge.config import FULL, ModelConfig
from ckptbridge.errors import UnsupportedError

TUNIX_RMS_EPS = 1e-6
TUNIX_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")


def _rope(cfg: ModelConfig, layer_type: str, default_type: str) -> tuple[float, float, float]:
    """(base frequency, rotary proportion, scale factor) of one layer type, as Tunix takes them."""
    params = cfg.rope.get(layer_type) if isinstance(cfg.rope, dict) else None
    if not isinstance(params, dict):
        raise UnsupportedError(f"config.json: rope_parameters has no entry for {layer_type}")
    rope_type = params.get("rope_type", default_type)
    if rope_type not in ("default", "proportional"):
        raise UnsupportedError(
            f"config.json: rope_type {rope_type!r} for {layer_type} has no Tunix equivalent "
            "(supported: default, proportional)"
        )
    proportion = float(params.get("partial_rotary_factor", 1.0)) if rope_type == "proportional" else 1.0
    return float(params["rope_theta"]), proportion, float(params.get("factor", 1.0))


def tunix_model_config(cfg: ModelConfig, *, dtype: Any = None, param_dtype: Any = None,
                       remat: str | None = None, sharding: Any = None):
    """``tunix.models.gemma4.model.ModelConfig`` equivalent to an HF Gemma 4 text config."""
    import jax.numpy as jnp
    from tunix.models.gemma4 import model as gm

    if cfg.rms_norm_eps != TUNIX_RMS_EPS:
        raise UnsupportedError(f"config.json: rms_norm_eps {cfg.rms_norm_eps} (Tunix Gemma 4 uses {TUNIX_RMS_EPS})")
    if cfg.hidden_activation not in TUNIX_ACTIVATIONS:
        raise UnsupportedError(f"config.json: hidden_activation {cfg.hidden_activation!r} (Tunix uses tanh GELU)")
    sliding = [layer for layer in cfg.layers if not layer.is_global]
    global_ = [layer for layer in cfg.layers if layer.is_global]
    for group, what in ((sliding, "sliding"), (global_, "global")):
        if len({(layer.head_dim, layer.num_kv_heads) for layer in group}) > 1:
            raise UnsupportedError(
                f"config.json: {what} layers differ in head_dim/kv heads; Tunix has one setting per layer kind"
            )
    base = (sliding or global_)[0]
    glob = global_[0] if global_ else base
    local_freq, local_prop, local_scale = _rope(cfg, "sliding_attention", "default")
    global_freq, global_prop, global_scale = _rope(cfg, FULL, "proportional")
    kwargs = dict(
        num_layers=cfg.num_layers,
        num_embed=cfg.vocab_size,
        embed_dim=cfg.hidden_size,
        hidden_dim=cfg.intermediate_size,
        num_heads=cfg.num_heads,
        head_dim=base.head_dim,
        num_kv_heads=base.num_kv_heads,
        num_global_kv_heads=glob.num_kv_heads,
        global_key_size=glob.head_dim,
        k_eq_v_global=any(layer.k_eq_v for layer in global_),
        final_logit_softcap=cfg.final_logit_softcapping,
        sliding_window_size=cfg.sliding_window,
        attention_pattern=tuple(
            gm.AttentionType.GLOBAL if layer.is_global else gm.AttentionType.LOCAL_SLIDING for layer in cfg.layers
        ),
        local_base_frequency=local_freq,
        global_base_frequency=global_freq,
        local_rope_proportion=local_prop,
        global_rope_proportion=global_prop,
        local_scale_factor=local_scale,
        global_scale_factor=global_scale,
        param_dtype=jnp.dtype(param_dtype) if param_dtype is not None else jnp.float32,
        dtype=jnp.dtype(dtype) if dtype is not None else jnp.float32,
    )
    if remat is not None:
        kwargs["remat_config"] = gm.RematConfig[remat.upper()]
    if sharding is not None:
        kwargs["shd_config"] = sharding
    return gm.ModelConfig(**kwargs)


def _check_divisible(name: str, shape: tuple[int, ...], sharding) -> None:
    """A clear error where Tunix's annotation splits a dimension the mesh axis does not divide."""
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    if spec is None or mesh is None:
        return
    for dim, (size, axes) in enumerate(zip(shape, spec)):
        if axes is None:
            continue
        names = axes if isinstance(axes, tuple) else (axes,)
        parts = 1
        for a in names:
            parts *= mesh.shape[a]
        if size % parts:
            raise UnsupportedError(
                f"{name}: dimension {dim} of size {size} cannot be split over mesh axis "
                f"{'x'.join(names)} of size {parts}; choose a mesh whose {'x'.join(names)} divides it"
            )


def _open_source(src: str, step: int | None, skip_multimodal: bool):
    from ckptbridge.convert import open_hf_source, open_orbax_source

    if os.path.isfile(os.path.join(src, "config.json")) and not os.path.isfile(os.path.join(src, "_METADATA")):
        return open_hf_source(src, skip_multimodal=skip_multimodal)
    return open_orbax_source(src, step=step)


def _key(node: dict, k: str):
    """Pure-dict key of a path part: nnx keeps list indices (layers) as ints."""
    return int(k) if (k.isdigit() and int(k) in node) else k


def _lookup(tree: dict, path: tuple[str, ...]):
    node = tree
    for k in path:
        node = node[_key(node, k)]
    return node


def _assign(tree: dict, path: tuple[str, ...], value) -> None:
    parent = _lookup(tree, path[:-1])
    parent[_key(parent, path[-1])] = value


def load_tunix_model(src: str, *, mesh=None, dtype: Any = None, param_dtype: Any = None,
                     step: int | None = None, skip_multimodal: bool = False, remat: str | None = None):
    """A Tunix ``Gemma4`` with the weights of ``src`` (HF directory or ckptbridge Orbax checkpoint).

    Parameters keep the source dtype unless ``param_dtype`` is given; ``dtype`` is the compute
    dtype (default float32). With ``mesh``, each parameter is placed with Tunix's own sharding
    annotation as it is loaded. Returns ``(model, model_config)``.
    """
    import jax
    from flax import nnx
    from tunix.models.gemma4 import model as gm

    with _open_source(src, step, skip_multimodal) as source:
        first = source.entries[0]
        pdtype = np.dtype(param_dtype) if param_dtype is not None else source.dtype(first)
        tcfg = tunix_model_config(source.cfg, dtype=dtype, param_dtype=pdtype, remat=remat)
        abstract = nnx.eval_shape(lambda: gm.Gemma4(tcfg, rngs=nnx.Rngs(params=0)))
        graphdef, abs_state = nnx.split(abstract)
        pure = abs_state.to_pure_dict()
        shardings = nnx.get_named_sharding(abs_state, mesh).to_pure_dict() if mesh is not None else None

        filled = 0
        for e in source.entries:
            target = _lookup(pure, e.tunix_path)
            value = np.asarray(source.tunix_value(e))
            if tuple(value.shape) != tuple(target.shape):
                raise UnsupportedError(
                    f"{e.tunix_name}: Tunix expects {tuple(target.shape)}, the map gives {value.shape}"
                )
            value = value.astype(pdtype, copy=False)
            device = _lookup(shardings, e.tunix_path) if shardings is not None else jax.devices()[0]
            if shardings is not None:
                _check_divisible(e.tunix_name, value.shape, device)
            _assign(pure, e.tunix_path, jax.device_put(value, device))
            filled += 1
        leaves = len(jax.tree_util.tree_leaves(pure))
        if filled != leaves:
            raise UnsupportedError(f"{src}: filled {filled} of the {leaves} Tunix parameters; the spec is incomplete")
        return nnx.merge(graphdef, pure), tcfg


def apply_lora_rules(model, rules: list[dict], *, seed: int = 0):
    """Wrap a Tunix Gemma4 with qwix LoRA following ``rules`` ([{module_path, rank, alpha[, dropout]}, ...]).
    A rule with dropout > 0 drops LoRA inputs on every call (training only); its random stream is
    the model's ``qwix_rngs`` attribute (see ``training.trainer``)."""
    import jax.numpy as jnp
    import qwix
    from flax import nnx

    provider = qwix.LoraProvider([qwix.LoraRule(module_path=r["module_path"], rank=int(r["rank"]),
                                                alpha=float(r["alpha"]), dropout=float(r.get("dropout", 0.0)))
                                  for r in rules])
    t = 4  # Gemma 4 sliding layers need more than one token to trace
    originals = _set_remat_off(model)
    try:
        lora_model = qwix.apply_lora_to_model(
            model, provider, jnp.ones((1, t), jnp.int32), jnp.arange(t)[None], None,
            jnp.tril(jnp.ones((1, t, t), bool)), rngs=nnx.Rngs(seed),
        )
    finally:
        _restore_configs(model, originals)
    _restore_configs(lora_model, originals)
    return lora_model


def _set_remat_off(model) -> dict:
    """Tunix runs rematerialised blocks under ``nnx.remat(..., graph_updates=False)``, which drops
    parameters created inside them, so qwix's first (parameter-creating) call must run without
    remat: each module's ``config`` becomes a copy with ``remat_config`` NONE. Returns the
    original configs by module path, for :func:`_restore_configs`."""
    from tunix.models.gemma4 import model as gm

    originals = {}
    for path, module in model.iter_modules():
        config = getattr(module, "config", None)
        remat = getattr(config, "remat_config", gm.RematConfig.NONE)
        if dataclasses.is_dataclass(config) and remat != gm.RematConfig.NONE:
            originals[path] = config
            module.config = dataclasses.replace(config, remat_config=gm.RematConfig.NONE)
    return originals


def _restore_configs(model, originals: dict) -> None:
    for path, module in model.iter_modules():
        if path in originals:
            module.config = originals[path]


def load_tunix_lora_model(base: str, lora_root: str, *, step: int | None = None, mesh=None,
                          param_dtype: Any = None, rules: list[dict] | None = None):
    """The Tunix base model with qwix LoRA rebuilt from the rules recorded in a LoRA checkpoint root
    (as ``peft-to-orbax`` or the training package write them) and its factors restored with Tunix's
    own ``CheckpointManager.maybe_restore``. Returns ``(model, step, rules)``."""
    from tunix.sft.checkpoint_manager import CheckpointManager

    from ckptbridge.errors import ConfigError
    from ckptbridge.io.orbax import resolve_checkpoint, step_custom_metadata

    item = resolve_checkpoint(lora_root, step)
    meta = step_custom_metadata(os.path.dirname(item)).get("ckptbridge", {})
    rules = rules or ((meta.get("lora") or {}).get("rules") if isinstance(meta, dict) else None)
    if not rules:
        raise ConfigError(f"{lora_root}: no LoRA rules recorded; pass rules=[{{module_path, rank, alpha}}]")
    model, _ = load_tunix_model(base, mesh=mesh, param_dtype=param_dtype)
    model = apply_lora_rules(model, rules)
    root = os.path.dirname(os.path.dirname(item))
    manager = CheckpointManager(os.path.abspath(root))
    try:
        restored, _ = manager.maybe_restore(model, step=int(os.path.basename(os.path.dirname(item))),
                                            restore_only_lora_params=True)
    finally:
        manager.close()
    return model, restored, rules


def load_tunix_adapter(base: str, src: str, *, step: int | None = None, alpha: float | None = None,
                       dtype: Any = np.float32):
    """The Tunix base model with qwix LoRA for a LoRA checkpoint in any form ``orbax-to-peft``
    accepts (checkpoint-manager root, step, ``model_params``; rules recorded or ``alpha`` given):
    the qwix rules come from the checkpoint's validated ranks and alphas, the factors are read
    with ckptbridge's Orbax reader. For inference checks (float32 by default)."""
    import jax.numpy as jnp
    from flax import nnx

    from ckptbridge import lora

    b = lora.open_base(base)
    with lora.open_orbax_lora(src, b, step=step, alpha=alpha) as ad:
        rules = lora.rules_for(ad.scaling, b.modules)
        model, _ = load_tunix_model(base, param_dtype=dtype, dtype=dtype)
        model = apply_lora_rules(model, rules)
        state = nnx.state(model, nnx.LoRAParam)
        pure = state.to_pure_dict()
        filled = 0
        for mod in ad.scaling:
            for leaf, value in zip(mod.leaves, ad.factors(mod)):
                target = _lookup(pure, leaf)
                if tuple(target.shape) != tuple(value.shape):
                    raise UnsupportedError(f"{'/'.join(leaf)}: qwix made {tuple(target.shape)}, the checkpoint has "
                                           f"{value.shape}")
                _assign(pure, leaf, jnp.asarray(np.asarray(value, np.float32).astype(dtype)))
                filled += 1
    import jax

    leaves = len(jax.tree_util.tree_leaves(pure))
    if filled != leaves:
        raise UnsupportedError(f"{src}: filled {filled} of the {leaves} LoRA parameters qwix created")
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(model, state)
    return model
