"""What each decoder layer keeps for the backward pass: the ``remat`` setting.

* ``none``: everything the backward pass needs is kept from the forward pass (fastest; memory
  grows with layers x sequence: the attention probabilities alone are heads x seq^2 per layer).
* ``block`` / ``decoder``: Tunix's own rematerialisation (``RematConfig``), per attention/MLP
  block or per decoder layer: a layer keeps only its input, and its forward runs again in the
  backward pass (the least memory: one layer's activations at a time, plus one hidden state per
  layer; every layer's forward twice).
* ``decoder_dots``: per decoder layer, keeping the outputs of the layer's projections by its
  frozen weights (q, k/v, o, the MLP's gate, up and down; not the LoRA factors' rank-sized
  products): the backward pass recomputes only attention, norms and activations, which cost a
  small part of the layer's FLOPs, for about (q + kv + o + 2F + D) x seq x 2 bytes a layer
  (0.43 GB at hidden 5376, MLP 21504 and 3072 tokens).
* ``decoder_ffn``: per decoder layer, keeping the MLP's gate and up outputs only (2F x seq x 2
  bytes: 0.26 GB at 31B, 3072 tokens); the rest of the layer runs again.

Tunix's layers take no policy, so the last two wrap each decoder layer (the family spec's
``layers`` list) in a subclass of its own class whose call runs the original under
``nnx.remat(policy=...)``, with Tunix's own remat off. Parameter paths do not change (LoRA
checkpoints are the same); ``tests/test_training.py`` checks the gradients equal those without
remat and that the memory kept per layer is what the policy says.
"""

from __future__ import annotations

import functools
import math

REMAT = ("none", "block", "decoder", "decoder_dots", "decoder_ffn")
POLICIES = ("decoder_dots", "decoder_ffn")  # ours; the others are Tunix's RematConfig (or none)


def tunix_remat(name: str) -> str | None:
    """The Tunix ``remat`` setting for the model config under ``remat=name``."""
    return name if name in ("block", "decoder") else None


def _policy(name: str, max_rank: int, ffn_width: int):
    """A ``jax.checkpoint`` policy: save the outputs of unbatched dot products over more than
    ``max_rank`` values (the frozen weights' projections, not the LoRA factors' second product);
    with ``decoder_ffn``, only those of ``ffn_width`` outputs (the MLP's gate and up)."""
    from jax import lax

    def policy(prim, *avals, **params) -> bool:
        if prim is not lax.dot_general_p:
            return False
        (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = params["dimension_numbers"]
        if lhs_batch:  # attention's per-head products
            return False
        lhs, rhs = avals[0], avals[1]
        if math.prod(lhs.shape[i] for i in lhs_contract) <= max_rank:
            return False
        if name == "decoder_ffn":
            free = [d for i, d in enumerate(rhs.shape) if i not in rhs_contract and i not in rhs_batch]
            return math.prod(free) == ffn_width
        return True

    return policy


@functools.cache
def _remat_class(cls: type, name: str, max_rank: int, ffn_width: int) -> type:
    from flax import nnx

    policy = _policy(name, max_rank, ffn_width)

    def __call__(self, *args, **kwargs):
        def call(module, args, kwargs):
            return cls.__call__(module, *args, **kwargs)

        return nnx.remat(call, policy=policy, graph_updates=False)(self, args, kwargs)

    return type(cls.__name__, (cls,), {"__call__": __call__, "__module__": __name__,
                                       "__qualname__": f"Remat[{name}]{cls.__qualname__}"})


def apply(model, layers_attr: str, name: str, *, max_rank: int, ffn_width: int) -> int:
    """Under ``remat=name`` (one of :data:`POLICIES`), make each decoder layer of ``model`` (the
    list ``layers_attr``) rematerialise with its policy. Returns the layers wrapped."""
    if name not in POLICIES:
        return 0
    layers = getattr(model, layers_attr)
    for layer in layers:
        base = type(layer)
        if base.__module__ == __name__:  # already wrapped
            continue
        layer.__class__ = _remat_class(base, name, max_rank, ffn_width)
    return len(layers)
