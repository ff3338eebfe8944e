"""PEFT's ways of combining LoRA adapters (``LoraModel.add_weighted_adapter``), per module, in numpy.

The semantics are PEFT's (``peft/tuners/lora/model.py``, ``peft/utils/merge_utils.py``):

- ``cat``: ``A = [w_i s_i A_i]`` stacked along the rank, ``B = [B_i]``: the exact weighted sum of
  the deltas at the sum of the ranks;
- ``linear``, ``ties``, ``dare_linear``, ``dare_ties``, ``magnitude_prune``: the method applied to
  the A's with weights ``sign(w_i s_i) sqrt(|w_i s_i|)`` and to the B's with ``sqrt(|w_i s_i|)``
  (equal ranks);
- ``svd`` and the ``_svd`` forms: the method applied to the deltas ``s_i B_i A_i`` with weights
  ``w_i``, then the best factors at the new rank (``B = U S``, ``A = V^T``).

``ties`` keeps the ``density`` fraction of largest magnitudes of each tensor, elects a sign per
entry (``total``: of the sum; ``frequency``: of the count), and averages the weighted entries that
agree with it; ``dare_*`` keep each entry with probability ``density`` and rescale by
``1 / density`` (from a seeded generator, not torch's stream); ``magnitude_prune`` prunes like
``ties`` and sums. The result has ``lora_alpha = r`` (scale 1), as PEFT's.
"""

from __future__ import annotations

import numpy as np

from ckptbridge.adapter.lowrank import Factors, factor_matrix, truncate_product
from ckptbridge.options import COMBINE_FACTOR_METHODS as FACTOR_METHODS
from ckptbridge.options import COMBINE_METHODS as METHODS
from ckptbridge.options import COMBINE_PRUNING as NEEDS_DENSITY
from ckptbridge.options import COMBINE_SVD_METHODS as SVD_METHODS
from ckptbridge.options import SIGN_METHODS


def prune_magnitude(t: np.ndarray, density: float) -> np.ndarray:
    """``t`` with all but its ``int(density * size)`` largest magnitudes set to zero."""
    if density >= 1:
        return t
    k = int(density * t.size)
    flat = np.abs(t).reshape(-1)
    mask = np.zeros(t.size, bool)
    if k > 0:
        mask[np.argpartition(flat, t.size - k)[t.size - k:]] = True
    return t * mask.reshape(t.shape)


def prune_random(t: np.ndarray, density: float, rng: np.random.Generator) -> np.ndarray:
    """Each entry of ``t`` kept with probability ``density``, the kept ones divided by ``density``."""
    if density >= 1:
        return t
    return t * (rng.random(t.shape) < density) / t.dtype.type(density)


def _majority(stacked: np.ndarray, sign_method: str) -> np.ndarray:
    sign = np.sign(stacked)
    magnitude = stacked.sum(axis=0) if sign_method == "total" else sign.sum(axis=0)
    return sign == np.where(magnitude >= 0, 1, -1)


def apply(method: str, tensors: list[np.ndarray], weights: list[float], *, density: float | None,
          sign_method: str, rng: np.random.Generator) -> np.ndarray:
    """``method`` (without ``_svd``) over ``tensors`` with ``weights``: PEFT's merge_utils."""
    base = method.removesuffix("_svd")
    if base in ("ties", "magnitude_prune"):
        tensors = [prune_magnitude(t, density) for t in tensors]  # type: ignore[arg-type]
    elif base.startswith("dare"):
        tensors = [prune_random(t, density, rng) for t in tensors]  # type: ignore[arg-type]
    stacked = np.stack(tensors)
    w = np.asarray(weights, stacked.dtype).reshape((-1,) + (1,) * (stacked.ndim - 1))
    weighted = stacked * w
    if base in ("ties", "dare_ties"):
        mask = _majority(stacked, sign_method)
        return (weighted * mask).sum(axis=0) / np.maximum(mask.sum(axis=0), 1).astype(stacked.dtype)
    return weighted.sum(axis=0)


def combine_module(method: str, pairs: list[tuple[np.ndarray, np.ndarray]], scales: list[float],
                   weights: list[float], rank: int, *, density: float | None = None, sign_method: str = "total",
                   rng: np.random.Generator | None = None) -> tuple[np.ndarray, np.ndarray, float | None]:
    """The combined PEFT pair ``(A (rank, in), B (out, rank))`` in float32 of one module from the
    pairs of the adapters that have it (their scales and weights), and for the ``svd`` forms the
    relative error of the truncation."""
    rng = rng or np.random.default_rng(0)
    f32 = [(np.asarray(a, np.float32), np.asarray(b, np.float32)) for a, b in pairs]
    if method == "cat":
        a = np.concatenate([a * np.float32(w) * np.float32(s) for (a, _), w, s in zip(f32, weights, scales)])
        b = np.concatenate([b for _, b in f32], axis=1)
        out_a = np.zeros((rank, a.shape[1]), np.float32)
        out_b = np.zeros((b.shape[0], rank), np.float32)
        out_a[:a.shape[0]], out_b[:, :b.shape[1]] = a, b
        return out_a, out_b, None
    if method in FACTOR_METHODS:
        ws = [w * s for w, s in zip(weights, scales)]
        wa = [float(np.sign(x) or 1.0) * float(np.sqrt(abs(x))) for x in ws]
        wb = [float(np.sqrt(abs(x))) for x in ws]
        a = apply(method, [a for a, _ in f32], wa, density=density, sign_method=sign_method, rng=rng)
        b = apply(method, [b for _, b in f32], wb, density=density, sign_method=sign_method, rng=rng)
        return a.astype(np.float32), b.astype(np.float32), None
    factors: Factors
    if method == "svd":  # a weighted sum of products: the SVD of the stacked factors, never the delta
        a_all = np.concatenate([a for a, _ in f32])
        b_all = np.concatenate([b * np.float32(w * s) for (_, b), w, s in zip(f32, weights, scales)], axis=1)
        factors = truncate_product(b_all, a_all, 1.0, rank, None)
    else:
        deltas = [(b @ a) * np.float32(s) for (a, b), s in zip(f32, scales)]
        delta = apply(method, deltas, weights, density=density, sign_method=sign_method, rng=rng)
        factors = factor_matrix(delta, rank)
        if factors.rank < rank:  # a zero delta
            factors = Factors(np.zeros((delta.shape[0], rank)), np.zeros((rank, delta.shape[1])), factors.s, 0.0)
    return factors.a.astype(np.float32), factors.b.astype(np.float32), factors.error


__all__ = ["FACTOR_METHODS", "METHODS", "NEEDS_DENSITY", "SIGN_METHODS", "SVD_METHODS", "apply", "combine_module",
           "prune_magnitude", "prune_random"]
