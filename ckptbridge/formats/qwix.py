"""Everything ckptbridge knows about qwix: how it names LoRA factors and how it is applied.

qwix wraps every ``jnp.einsum`` / ``dot_general`` whose right-hand side is a parameter of the
current module, when the module's ``/``-joined path full-matches a rule's ``module_path``; a
parameter ``w`` then gets the factors ``w_lora_a`` (input-side axes + rank) and ``w_lora_b`` (rank
+ output-side axes), held in ``nnx.LoRAParam``. The functions that touch qwix's attributes
(dropout streams, the shardings it copies onto factors) live here, each with a test that fails
when qwix changes them. qwix itself is imported only by the functions that need it.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

LORA_A, LORA_B = "_lora_a", "_lora_b"


def lora_leaves(param_path: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The qwix factor paths (A, B) of the parameter at ``param_path`` (``.../attn/q_proj/w``)."""
    *parent, param = param_path
    return (*parent, param + LORA_A), (*parent, param + LORA_B)


def is_lora_leaf(path: tuple[str, ...]) -> bool:
    """Whether a checkpoint leaf path is a qwix LoRA factor (``.../w_lora_a`` or ``.../w_lora_a/value``)."""
    names = path[-2:] if path and path[-1] == "value" else path[-1:]
    return bool(names) and names[0].endswith((LORA_A, LORA_B))


def is_lora_a(path: tuple[str, ...]) -> bool:
    names = path[-2:] if path and path[-1] == "value" else path[-1:]
    return bool(names) and names[0].endswith(LORA_A)


def apply_lora(model, rules: list[dict], inputs: tuple, *, seed: int = 0):
    """Wrap ``model`` with qwix LoRA following ``rules`` ([{module_path, rank, alpha[, dropout,
    weight_qtype, tile_size]}, ...]), tracing one forward on ``inputs``. ``weight_qtype`` (QLoRA)
    makes the matched base weights qwix QArrays: the model's parameters are then their ``qvalue``
    and ``scale``. A rule with dropout > 0 drops LoRA inputs on every call
    (training only); its random stream is the model's ``qwix_rngs`` attribute (:func:`dropout_stream`)."""
    import qwix
    from flax import nnx

    provider = _provider([qwix.LoraRule(module_path=r["module_path"], rank=int(r["rank"]),
                                                alpha=float(r["alpha"]), dropout=float(r.get("dropout", 0.0)),
                                                weight_qtype=r.get("weight_qtype"), tile_size=r.get("tile_size"))
                                  for r in rules])
    originals = _set_remat_off(model)
    try:
        lora_model = qwix.apply_lora_to_model(model, provider, *inputs, rngs=nnx.Rngs(seed))
    finally:
        _restore_configs(model, originals)
    _restore_configs(lora_model, originals)
    return lora_model


def _provider(rules: list):
    """qwix's LoraProvider for ``rules``; for QLoRA rules (a ``weight_qtype``), one that also takes
    ``jnp.astype`` of a quantized weight (Tunix's Einsum casts its weight with it, which qwix 0.1.8
    does not intercept: it intercepts ``jnp.asarray`` only). ``tests/test_qlora.py`` fails when qwix
    intercepts ``jnp.astype`` itself (this is then no longer needed)."""
    import qwix

    if not any(r.weight_qtype for r in rules):
        return qwix.LoraProvider(rules)
    return _qlora_provider_class()(rules)


@functools.cache
def _qlora_provider_class():
    """The provider class (made on first use: qwix is imported lazily)."""
    import jax.numpy as jnp
    import qwix
    from qwix._src.providers.ptq import WithAux

    class QLoraProvider(qwix.LoraProvider):
        def astype(self, x, dtype, *args, **kwargs):
            if isinstance(x, WithAux):  # the QArray's dequantized dtype (its scale's) becomes dtype
                return x.replace(array=x.array.astype(dtype))
            return jnp.astype(x, dtype, *args, **kwargs)

        def get_intercept_map(self):
            return super().get_intercept_map() | {"jax.numpy.astype": self.astype}

    return QLoraProvider


def _set_remat_off(model) -> dict:
    """Tunix runs rematerialised blocks under ``nnx.remat(..., graph_updates=False)``, which drops
    parameters created inside them, so qwix's first (parameter-creating) call must run without
    remat: each module's ``config`` becomes a copy with its ``remat_config`` enum at NONE. Returns
    the original configs by module path, for :func:`_restore_configs`."""
    originals = {}
    for path, module in model.iter_modules():
        config = getattr(module, "config", None)
        remat = getattr(config, "remat_config", None)
        if dataclasses.is_dataclass(config) and not isinstance(config, type) and remat is not None \
                and getattr(remat, "name", "NONE") != "NONE":
            originals[path] = config
            module.config = dataclasses.replace(config, remat_config=type(remat).NONE)
    return originals


def _restore_configs(model, originals: dict) -> None:
    for path, module in model.iter_modules():
        if path in originals:
            module.config = originals[path]


# LoRA dropout's random bits come from XLA's RngBitGenerator (the "rbg" PRNG: the chip's own
# generator), not threefry in software: the masks of one step are as many bits as the layers'
# activations, and threefry's unrolled arithmetic for them made the train step's compilation 3.6x
# slower (186 s instead of 52 s, compiled for a TPU v5e: hidden 5376, 3072 tokens, 2 layers).
DROPOUT_PRNG = "rbg"


def dropout_key(seed: int, index=None):
    """The key of LoRA dropout's stream for ``seed`` (folded with ``index`` when given)."""
    import jax

    key = jax.random.key(seed, impl=DROPOUT_PRNG)
    return key if index is None else jax.random.fold_in(key, index)


def dropout_stream(model, seed: int):
    """qwix draws LoRA dropout masks from the ``qwix_rngs`` attribute of the module it runs in:
    give every module one shared stream. Returns it, for :func:`reseed`."""
    from flax import nnx

    rngs = nnx.Rngs(dropout=dropout_key(seed))
    model.set_attributes(qwix_rngs=rngs)
    return rngs


def dropout_rngs(model):
    """The stream :func:`dropout_stream` gave ``model``'s modules (found again in a model merged
    from its state, e.g. inside a jitted step), or None."""
    for _, module in model.iter_modules():
        rngs = getattr(module, "qwix_rngs", None)
        if rngs is not None:
            return rngs
    return None


def reseed(rngs, seed: int, index) -> None:
    """Set a dropout stream to depend on (seed, index) only, so a resumed run draws the same masks
    (``index`` may be traced: a jitted step reseeds from its argument)."""
    rngs.dropout.key[...] = dropout_key(seed, index)
    rngs.dropout.count[...] = 0


def _parts(mesh, axis) -> int:
    """How many parts a dimension annotated with mesh axis (or axes) ``axis`` is split into."""
    return int(np.prod([mesh.shape[a] for a in (axis if isinstance(axis, tuple) else (axis,))]))


def fit_lora_annotations(model, mesh) -> tuple[int, int]:
    """Give every LoRA factor of ``model`` (concrete or abstract) a sharding annotation that fits
    it: qwix copies the base weight's annotation onto A and B, whose ranks and sizes differ; an
    annotation of the wrong length, or one that does not divide a dimension, becomes replicated.
    Returns (annotations replaced, factors)."""
    from flax import nnx

    flat = nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))
    replaced = 0
    for _, var in flat:
        spec = var.get_metadata().get("out_sharding")
        shape = var.get_value().shape
        ok = spec is not None and len(spec) == len(shape) and all(
            axis is None or size % _parts(mesh, axis) == 0 for axis, size in zip(spec, shape))
        if not ok:
            var.set_metadata(out_sharding=(None,) * len(shape))
            replaced += 1
    return replaced, len(flat)
