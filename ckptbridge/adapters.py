"""LoRA conversions: Tunix/qwix Orbax checkpoints <-> PEFT adapter directories.

Both read the adapter and the base's config and key names only (no model, no qwix, no
accelerator), stream module by module, and write atomically.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import time
from collections import Counter

import numpy as np

from ckptbridge import lora
from ckptbridge.errors import ConfigError
from ckptbridge.io import orbax as orbax_io
from ckptbridge.io.atomic import atomic_directory, check_destination
from ckptbridge.io.safetensors import PlannedTensor, write_file
from ckptbridge.lora import LoraModule, Scaling
from ckptbridge.progress import Progress

log = logging.getLogger(__name__)
TARGETS = ("hf", "vllm")
KV_MODES = ("exact", "svd")


def _target_modules_regex(names: list[str], base: lora.Base) -> str:
    """A regex that PEFT full-matches against exactly the language-model modules in ``names``."""
    all_layers = {str(layer.index) for layer in base.cfg.layers}
    layers_of: dict[str, set[str]] = {}
    for name in names:
        rest = name[len(base.prefix):]  # "layers.5.self_attn.k_proj"
        _, idx, suffix = rest.split(".", 2)
        layers_of.setdefault(suffix, set()).add(idx)
    by_layers: dict[str, list[str]] = {}
    for suffix, layers in sorted(layers_of.items()):
        key = r"\d+" if layers == all_layers else "(?:" + "|".join(sorted(layers, key=int)) + ")"
        by_layers.setdefault(key, []).append(re.escape(suffix))
    parts = [f"{re.escape(base.prefix)}layers\\.{key}\\.(?:{'|'.join(sfx)})" for key, sfx in by_layers.items()]
    return parts[0] if len(parts) == 1 else "|".join(f"(?:{p})" for p in parts)


def _adapter_config(base: lora.Base, names: list[str], r: int, alpha: float, rank_pattern: dict,
                    alpha_pattern: dict, dropout: float = 0.0) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": os.path.abspath(base.path),
        "r": r,
        "lora_alpha": lora.plain_number(alpha),
        "target_modules": _target_modules_regex(names, base),
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "lora_dropout": dropout,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "lora_bias": False,
        "revision": None,
    }


def convert_orbax_to_peft(src: str, dst: str, *, base: str, step: int | None = None, alpha: float | None = None,
                          target: str = "hf", overwrite: bool = False, progress: bool | None = None) -> dict:
    """Tunix/qwix LoRA checkpoint -> PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``).

    ``target="vllm"`` also writes, on k_eq_v layers, the k_proj factors as v_proj (vLLM applies
    V's LoRA separately) and makes rank/alpha uniform (vLLM ignores rank/alpha patterns).
    """
    t0 = time.perf_counter()
    if target not in TARGETS:
        raise ConfigError(f"--target {target!r}: choose one of {', '.join(TARGETS)}")
    check_destination(dst, [src, base], overwrite)
    b = lora.open_base(base)
    warnings: list[str] = []
    with lora.open_orbax_lora(src, b, step=step, alpha=alpha) as ad:
        # every HF module that gets factors: (name, module, index into the module's pairs, scaling)
        plan: list[tuple[str, LoraModule, int, Scaling]] = []
        for mod, sc in ad.scaling.items():
            plan += [(name, mod, i, sc) for i, name in enumerate(mod.hf_modules)]
            if target == "vllm":
                plan += [(name, mod, 0, sc) for name in mod.vllm_aliases]
        counts = Counter((sc.rank, sc.alpha) for _, _, _, sc in plan)
        (r, alpha_default), _ = counts.most_common(1)[0]
        max_rank = max(sc.rank for _, _, _, sc in plan)
        uniform = len(counts) == 1
        pad_to, fold_scale = None, None
        rank_pattern: dict[str, int] = {}
        alpha_pattern: dict[str, float] = {}
        if not uniform and target == "vllm":
            pad_to, fold_scale = max_rank, alpha_default / r
            r, alpha_default = max_rank, fold_scale * max_rank
            warnings.append(
                f"ranks/alphas differ between modules: padded every module to rank {max_rank} and folded the "
                "per-module scales into lora_B (vLLM ignores rank_pattern/alpha_pattern)"
            )
        elif not uniform:
            for name, _, _, sc in plan:
                if sc.rank != r:
                    rank_pattern[re.escape(name)] = sc.rank
                if sc.alpha != alpha_default:
                    alpha_pattern[re.escape(name)] = lora.plain_number(sc.alpha)
        if target == "vllm" and max_rank > lora.VLLM_DEFAULT_MAX_LORA_RANK:
            warnings.append(
                f"rank {max_rank} exceeds vLLM's default --max-lora-rank {lora.VLLM_DEFAULT_MAX_LORA_RANK}: "
                f"serve with --max-lora-rank {lora.next_vllm_rank(max_rank)}"
            )
        for w in warnings:
            log.warning(w)

        cache: dict = {}

        def pair(mod: LoraModule, i: int, sc: Scaling) -> tuple[np.ndarray, np.ndarray]:
            if cache.get("mod") is not mod:
                cache.clear()
                cache["mod"], cache["pairs"] = mod, lora.tunix_to_peft(mod, *ad.factors(mod))
            a, b_ = cache["pairs"][i]
            if pad_to is not None and (sc.rank < pad_to or sc.scale != fold_scale):
                dtype = a.dtype
                a = np.concatenate([a, np.zeros((pad_to - sc.rank, a.shape[1]), dtype)])
                scaled = b_.astype(np.float32) * np.float32(sc.scale / fold_scale)
                b_ = np.concatenate([scaled.astype(dtype), np.zeros((b_.shape[0], pad_to - sc.rank), dtype)], axis=1)
            return a, b_

        tensors = []
        for name, mod, i, sc in plan:
            rank = pad_to or sc.rank
            shapes = mod.shapes(rank)
            dtype = ad.dtype(mod)
            tensors.append(PlannedTensor(f"{lora.PEFT_PREFIX}{name}.lora_A.weight", dtype, shapes["a_peft"],
                                         lambda mod=mod, i=i, sc=sc: pair(mod, i, sc)[0]))
            tensors.append(PlannedTensor(f"{lora.PEFT_PREFIX}{name}.lora_B.weight", dtype, shapes["b_peft"],
                                         lambda mod=mod, i=i, sc=sc: pair(mod, i, sc)[1]))
        names = [name for name, _, _, _ in plan]
        lora_meta = ad.metadata.get("lora") if isinstance(ad.metadata.get("lora"), dict) else {}
        dropout = float(lora_meta.get("dropout", 0.0))
        config = _adapter_config(b, names, r, alpha_default, rank_pattern, alpha_pattern, dropout)
        meta = {"ckptbridge": json.dumps({
            "format_version": orbax_io.FORMAT_VERSION, "family": b.spec.name, "target": target,
            "source": os.path.abspath(ad.path), "base": os.path.abspath(b.path),
        })}
        total = sum(t.nbytes for t in tensors)
        bar = Progress(total, "orbax -> peft", enabled=progress)
        with atomic_directory(dst, overwrite) as tmp:
            os.makedirs(tmp)
            write_file(os.path.join(tmp, lora.ADAPTER_WEIGHTS), tensors, meta, on_tensor=lambda t: bar.update(t.nbytes))
            with open(os.path.join(tmp, lora.ADAPTER_CONFIG), "w") as f:
                json.dump(config, f, indent=2)
                f.write("\n")
        bar.close()
        return {
            "direction": "orbax-to-peft",
            "source": ad.path,
            "destination": dst,
            "family": b.spec.name,
            "key_prefix": b.prefix,
            "target": target,
            "modules": len(plan),
            "tensors": len(tensors),
            "bytes": total,
            "r": r,
            "lora_alpha": lora.plain_number(alpha_default),
            "rank_pattern": rank_pattern,
            "alpha_pattern": alpha_pattern,
            "warnings": warnings,
            "seconds": round(time.perf_counter() - t0, 3),
        }


@dataclasses.dataclass
class _ModulePlan:
    """How one Tunix module is made from PEFT factors (decided from configs and A's alone)."""

    names: list[str]  # HF modules of the adapter that feed this module
    mode: str  # "single" | "partial" (one of k/v) | "shared" (same A and scale) | "exact" | "svd"
    scaling: Scaling  # the qwix rank and alpha of the result
    dtype: np.dtype


def _plan_module(ad: lora.PeftLora, mod: LoraModule, kv: str) -> _ModulePlan:
    names = [n for n in mod.hf_modules if n in ad.keys]
    scal = [ad.scaling[n] for n in names]
    dtype = ad.dtype(names[0])
    if len(names) == 1:
        mode = "partial" if mod.entry.rule.fused else "single"
        return _ModulePlan(names, mode, Scaling(scal[0].rank, scal[0].scale * scal[0].rank), dtype)
    (ak, _), (av, _) = (ad.pair(n) for n in names)
    sk, sv = scal
    if sk.scale == sv.scale and ak.shape == av.shape and ak.tobytes() == av.tobytes():
        return _ModulePlan(names, "shared", Scaling(sk.rank, sk.scale * sk.rank), dtype)
    scale = sk.scale if sk.scale == sv.scale else 1.0  # different scales are folded into B
    rank = sk.rank + sv.rank if kv == "exact" else max(sk.rank, sv.rank)
    return _ModulePlan(names, kv, Scaling(rank, scale * rank), dtype)


def _module_factors(ad: lora.PeftLora, mod: LoraModule, plan: _ModulePlan) -> tuple[np.ndarray, np.ndarray, float | None]:
    """qwix (A, B) of one module following its plan, and (svd) the relative error of the delta."""
    pairs = [ad.pair(n) for n in plan.names]
    if plan.mode in ("single", "shared"):
        return (*lora.peft_to_tunix(mod, pairs), None)
    if plan.mode == "partial":  # LoRA on one of k/v only: the other gets B = 0 with the same A
        a, b = pairs[0]
        full = [(a, b) if n in plan.names else (a, np.zeros((b.shape[0], a.shape[0]), b.dtype)) for n in mod.hf_modules]
        return (*lora.peft_to_tunix(mod, full), None)
    (ak, bk), (av, bv) = pairs
    sk, sv = (ad.scaling[n] for n in plan.names)
    fold = sk.scale != sv.scale
    if plan.mode == "exact":
        # stacked A, block-diagonal B: rank r_k + r_v, each of the k and v deltas unchanged
        if fold:
            bk = (bk.astype(np.float32) * np.float32(sk.scale)).astype(plan.dtype)
            bv = (bv.astype(np.float32) * np.float32(sv.scale)).astype(plan.dtype)
        a = np.concatenate([ak, av])
        bk2 = np.concatenate([bk, np.zeros((bk.shape[0], av.shape[0]), plan.dtype)], axis=1)
        bv2 = np.concatenate([np.zeros((bv.shape[0], ak.shape[0]), plan.dtype), bv], axis=1)
        return (*lora.peft_to_tunix(mod, [(a, bk2), (a, bv2)]), None)
    # svd: the best shared rank-r A for the stacked deltas
    r = plan.scaling.rank
    dk = sk.scale * (bk.astype(np.float64) @ ak.astype(np.float64))
    dv = sv.scale * (bv.astype(np.float64) @ av.astype(np.float64))
    m = np.concatenate([dk, dv])
    u, s, vt = np.linalg.svd(m, full_matrices=False)
    a, b = vt[:r], u[:, :r] * s[:r]
    err = float(np.linalg.norm(m - b @ a) / max(float(np.linalg.norm(m)), 1e-30))
    b = b / plan.scaling.scale
    out = dk.shape[0]
    a = a.astype(plan.dtype)
    return (*lora.peft_to_tunix(mod, [(a, b[:out].astype(plan.dtype)), (a, b[out:].astype(plan.dtype))]), err)


def convert_peft_to_orbax(src: str, dst: str, *, base: str, kv: str = "exact", step: int = 0,
                          overwrite: bool = False, progress: bool | None = None) -> dict:
    """PEFT adapter -> Tunix checkpoint root ``DST/<step>/model_params`` with the qwix rules that
    rebuild the matching LoRA model in the step's custom metadata."""
    t0 = time.perf_counter()
    if kv not in KV_MODES:
        raise ConfigError(f"--kv {kv!r}: choose one of {', '.join(KV_MODES)}")
    if step < 0:
        raise ConfigError(f"--step {step}: must be >= 0")
    check_destination(dst, [src, base], overwrite)
    b = lora.open_base(base)
    with lora.open_peft_lora(src, b) as ad:
        plans = {m: _plan_module(ad, m, kv) for m in b.modules if any(n in ad.keys for n in m.hf_modules)}
        cache: dict = {}
        errors: dict[str, float] = {}

        def factors(mod: LoraModule) -> tuple:
            if cache.get("mod") is not mod:
                cache["mod"], cache["value"] = mod, _module_factors(ad, mod, plans[mod])
                if cache["value"][2] is not None:
                    errors["/".join(mod.path)] = cache["value"][2]
            return cache["value"]

        flat = {}
        for mod, plan in plans.items():
            shapes = mod.shapes(plan.scaling.rank)
            leaf_a, leaf_b = mod.leaves
            flat[leaf_a + ("value",)] = orbax_io.LazyArray(shapes["a_tunix"], plan.dtype, lambda m=mod: factors(m)[0])
            flat[leaf_b + ("value",)] = orbax_io.LazyArray(shapes["b_tunix"], plan.dtype, lambda m=mod: factors(m)[1])
        rules = lora.rules_for({m: p.scaling for m, p in plans.items()}, b.modules)
        meta = {"ckptbridge": orbax_io.metadata_json({
            "format_version": orbax_io.FORMAT_VERSION,
            "kind": "lora",
            "family": b.spec.name,
            "lora": {"rules": rules, "dropout": float(ad.config.get("lora_dropout") or 0.0)},
            "base": os.path.abspath(b.path),
            "key_prefix": b.prefix,
            "source": os.path.abspath(src),
            "kv": kv,
        })}
        total = sum(leaf.nbytes for leaf in flat.values())
        bar = Progress(total, "peft -> orbax", enabled=progress)
        for leaf in flat.values():
            leaf.on_written = lambda n=leaf.nbytes: bar.update(n)
        with atomic_directory(dst, overwrite) as tmp:
            orbax_io.save_manager_step(tmp, step, orbax_io.nest(flat), meta)
        bar.close()
        return {
            "direction": "peft-to-orbax",
            "source": src,
            "destination": dst,
            "step": step,
            "family": b.spec.name,
            "modules": len(plans),
            "modes": dict(Counter(p.mode for p in plans.values())),
            "rules": rules,
            "kv": kv,
            "svd_relative_error": errors,
            "vllm_repeats_dropped": ad.vllm_repeats,
            "bytes": total,
            "seconds": round(time.perf_counter() - t0, 3),
        }
