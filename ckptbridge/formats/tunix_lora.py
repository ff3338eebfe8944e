"""Tunix/qwix LoRA: an Orbax checkpoint of a Tunix model's LoRA factors (``<step>/model_params``,
qwix's ``*_lora_a`` / ``*_lora_b`` beside each adapted parameter, the rules that made them in the
step's metadata), read as PEFT pairs per HF module and written from any adapter.

Reading validates every factor against the base before any is read, and reads them in batches
(one Orbax call each) ahead of the writer. Writing makes, per Tunix module, the qwix factors of
its HF modules: one A for a fused module (k/v in ``kv_einsum``): PEFT modules sharing one A and
scale map as they are; otherwise ``kv="exact"`` stacks their A's (rank = the sum) and ``"svd"``
finds the best shared A at the largest rank; the qwix rules that rebuild the matching LoRA model
go into the step's custom metadata.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections import Counter

import numpy as np

from ckptbridge import deps, mapping, options, specs
from ckptbridge.errors import ConfigError, MismatchError, UnsupportedError
from ckptbridge.formats.qwix import is_lora_leaf
from ckptbridge.io import orbax as orbax_io
from ckptbridge.io import storage
from ckptbridge.io.atomic import atomic_directory
from ckptbridge.io.files import close_on_error
from ckptbridge.io.orbax import OrbaxCheckpoint, resolve_checkpoint
from ckptbridge.lora.base import Base
from ckptbridge.lora.factors import AdapterRows, ModuleLora, Pair, Target
from ckptbridge.lora.modules import LoraModule, Scaling, in_batches, peft_to_tunix, tunix_to_peft
from ckptbridge.lora.rules import rules_for, scaling_from_rules
from ckptbridge.metadata import KEY, LoraRules, Metadata, installed_tunix_version
from ckptbridge.options import KV_MODES
from ckptbridge.progress import progress_over
from ckptbridge.report import Report, human_bytes
from ckptbridge.rows import Request
from ckptbridge.stream import Shared

NAME = "tunix-lora"


class OrbaxLora(ModuleLora):
    """A Tunix/qwix LoRA checkpoint, validated against the base."""

    format = NAME

    def __init__(self, path: str, ckpt: OrbaxCheckpoint, base: Base, suffix: tuple[str, ...],
                 scaling: dict[LoraModule, Scaling], metadata: Metadata, batch_bytes: int = 32 << 20):
        self.path, self.ckpt, self.base, self.suffix = path, ckpt, base, suffix
        self.scaling, self.metadata = scaling, metadata
        self.batch_bytes_limit = batch_bytes  # factors per read batch (a piece of the engine)

    def _leaves(self, mod: LoraModule) -> tuple[tuple[str, ...], tuple[str, ...]]:
        a, b = (leaf + self.suffix for leaf in mod.leaves)
        return a, b

    def module_bytes(self, mod: LoraModule) -> int:
        return sum(int(np.prod(self.ckpt.leaves[p][0], dtype=np.int64)) * np.dtype(self.ckpt.leaves[p][1]).itemsize
                   for p in self._leaves(mod))

    def batches(self) -> list[list[LoraModule]]:
        """The modules in the order of ``scaling``, in batches of about ``batch_bytes``, each read in one call
        (with Orbax each call has a fixed cost, which made a 31B rank-64 export 4x slower read module by module)."""
        return in_batches(self.scaling, self.module_bytes, self.batch_bytes_limit)

    def batch_targets(self, batch: list[LoraModule]) -> list[Target]:
        return [(m, i) for m in batch for i in range(len(m.hf_modules))]

    def batch_bytes(self, batch: list[LoraModule]) -> int:
        return sum(self.module_bytes(m) for m in batch)

    def read_batch(self, batch: list[LoraModule]) -> dict[LoraModule, tuple[np.ndarray, np.ndarray]]:
        """(A, B) in Tunix layout of every module of ``batch``, in one read (safe to call from
        several threads)."""
        got = self.ckpt.read([p for mod in batch for p in self._leaves(mod)])
        return {mod: (got[self._leaves(mod)[0]], got[self._leaves(mod)[1]]) for mod in batch}

    def read_peft(self, batch: list[LoraModule]) -> dict[Target, Pair]:
        return {(mod, i): pair for mod, f in self.read_batch(batch).items()
                for i, pair in enumerate(tunix_to_peft(mod, *f))}

    def module_dtype(self, mod: LoraModule) -> np.dtype:
        return self.ckpt.leaves[mod.leaves[0] + self.suffix][1]

    def module_factors(self):
        """(module, (A, B) in Tunix layout) of every module, a batch read at a time."""
        for batch in self.batches():
            yield from self.read_batch(batch).items()

    @property
    def dropout(self) -> float:
        return self.metadata.lora.dropout if self.metadata.lora else 0.0

    @property
    def base_quant(self) -> dict | None:
        return self.metadata.base_quant

    @property
    def step(self) -> int | None:
        """The training step: recorded, or the name of the step directory."""
        if self.metadata.step is not None:
            return self.metadata.step
        name = storage.basename(storage.dirname(storage.absolute(self.path)))
        return int(name) if name.isdigit() else None

    def close(self) -> None:
        self.ckpt.close()


def open_orbax_lora(src: str, base: Base, *, step: int | None = None, alpha: float | None = None) -> OrbaxLora:
    """A Tunix/qwix LoRA checkpoint validated against ``base``."""
    path = resolve_checkpoint(src, step)
    return orbax_lora_of(path, OrbaxCheckpoint(path), base, alpha=alpha)


def orbax_lora_of(path: str, ckpt: OrbaxCheckpoint, base: Base, *, alpha: float | None = None) -> OrbaxLora:
    """The Tunix/qwix LoRA checkpoint ``ckpt`` opened at ``path`` (closed with the adapter, or on
    an error) validated against ``base``."""
    with close_on_error(ckpt):
        return _validate_orbax_lora(path, ckpt, base, alpha)


def _validate_orbax_lora(path: str, ckpt, base: Base, alpha: float | None) -> OrbaxLora:
    meta = ckpt.metadata
    leaves = dict(ckpt.leaves)
    if not any(is_lora_leaf(p) for p in leaves):
        raise UnsupportedError(f"{path}: has no LoRA parameters (*_lora_a/*_lora_b); for full weights use "
                               "orbax-to-safetensors")
    if meta.family not in (None, base.spec.name):
        raise MismatchError(f"{path}: LoRA of family {meta.family!r}, but the base {base.path} is {base.spec.name!r}")
    suffix = ckpt.value_suffix
    by_leaf = base.by_leaf()
    weights = {e.tunix_path for e in mapping.entries(base.cfg, base.spec, base.prefix)}
    present: dict[LoraModule, list] = {}
    for p in sorted(leaves):
        key = p[: len(p) - len(suffix)]
        if key not in by_leaf:
            param = key[:-1] + (key[-1].rsplit("_lora_", 1)[0],) if is_lora_leaf(key) else None
            if param in weights:
                raise UnsupportedError(
                    f"{path}: leaf {'/'.join(p)} is a LoRA on {'/'.join(param)}, which ckptbridge does not carry "
                    f"(the {base.spec.name} LoRA targets are {', '.join(base.spec.lora_targets)}; vLLM serves no "
                    "LoRA there): train without it, e.g. with module_path "
                    f"'.*({'|'.join(base.spec.lora_targets)})'"
                )
            raise MismatchError(
                f"{path}: leaf {'/'.join(p)} is not a LoRA factor of any {base.spec.name} module of the base "
                f"{base.path}; the adapter belongs to another model"
            )
        mod, i = by_leaf[key]
        present.setdefault(mod, [None, None])[i] = leaves[p]
    rules = meta.lora.rules if meta.lora else None
    scaling: dict[LoraModule, Scaling] = {}
    for mod, (a, b) in present.items():
        name = "/".join(mod.path)
        if a is None or b is None:
            raise MismatchError(f"{path}: {name} has only one of its LoRA factors (A and B are both needed)")
        rank = a[0][-1] if a[0] else 0
        shapes = mod.shapes(rank)
        if rank < 1 or a[0] != shapes["a_tunix"] or b[0] != shapes["b_tunix"]:
            raise MismatchError(
                f"{path}: {name} LoRA shapes A {a[0]} / B {b[0]} do not fit the base {base.path} "
                f"(expected A {shapes['a_tunix']}, B {shapes['b_tunix']} at rank {rank}); wrong base (--base)?"
            )
        if alpha is not None:
            scaling[mod] = Scaling(rank, float(alpha))
            continue
        sc = scaling_from_rules(mod, rules, path) if rules else None
        if sc is None:
            raise ConfigError(
                f"{path}: no LoRA alpha recorded for {name}; pass alpha (--alpha), the alpha used in training ("
                f"the scale is alpha / rank, rank here {rank})"
            )
        if sc.rank != rank:
            raise MismatchError(f"{path}: metadata gives {name} rank {sc.rank}, its tensors have rank {rank}")
        scaling[mod] = sc
    ordered = {m: scaling[m] for m in base.modules if m in scaling}
    return OrbaxLora(path, ckpt, base, suffix, ordered, meta)



def detect(probe) -> bool:
    """An Orbax checkpoint of a Tunix model's qwix LoRA factors."""
    from ckptbridge.formats.tunix import is_lora, is_maxtext_tree

    ckpt = probe.checkpoint
    return ckpt is not None and is_lora(ckpt) and not is_maxtext_tree(ckpt)


def open_source(src: str, base: Base, *, step: int | None = None, alpha: float | None = None, **_) -> OrbaxLora:
    return open_orbax_lora(src, base, step=step, alpha=alpha)


# --------------------------------------------------------------------------- writing


@dataclasses.dataclass(frozen=True)
class OrbaxLoraReport(Report):
    """An adapter written as a Tunix/qwix LoRA checkpoint."""

    direction: str
    source: str
    destination: str
    step: int
    family: str
    config_mismatch: str | None
    modules: int
    modes: dict[str, int]
    rules: list[dict]
    kv: str
    svd_relative_error: dict[str, float]
    vllm_repeats_dropped: int
    bytes: int
    seconds: float

    def summary(self) -> str:
        text = (f"{self.direction}: {self.source} -> {self.destination}/{self.step}/model_params\n"
                f"  {self.modules} modules ({', '.join(f'{v} {k}' for k, v in self.modes.items())}), "
                f"{human_bytes(self.bytes)} in {self.seconds:.2f} s")
        for rule in self.rules:
            text += f"\n  rule: rank {rule['rank']}, alpha {rule['alpha']}: {rule['module_path']}"
        for module, err in self.svd_relative_error.items():
            text += f"\n  svd {module}: relative error {err:.3e}"
        if self.vllm_repeats_dropped:
            text += f"\n  dropped {self.vllm_repeats_dropped} v_proj copies of k_proj factors (vLLM export)"
        return text


@dataclasses.dataclass
class _ModulePlan:
    """How one Tunix module is made from PEFT factors (decided from configs and A's alone)."""

    names: list[str]  # HF modules of the adapter that feed this module
    # "single" | "partial" (one of a fused module's HF modules) | "shared" (same A and scale) | "exact" | "svd"
    mode: str
    scaling: Scaling  # the qwix rank and alpha of the result
    dtype: np.dtype


def _plan_module(ad: AdapterRows, have: set[str], mod: LoraModule, kv: str) -> _ModulePlan:
    """A fused Tunix module (k/v, q/k/v) has one A for all its HF modules: separate PEFT modules
    sharing one A and scale map as they are; otherwise ``exact`` stacks their A's (rank = the sum)
    and ``svd`` finds the best shared A at the largest rank."""
    names = [n for n in mod.hf_modules if n in have]
    scal = [ad.scaling_of(n) for n in names]
    dtype = ad.dtype_of(names[0])
    first = scal[0]
    if len(names) == 1:
        mode = "partial" if mod.entry.rule.fused else "single"
        return _ModulePlan(names, mode, Scaling(first.rank, first.scale * first.rank), dtype)
    a_list = [ad.pair(n)[0] for n in names]
    if all(sc.scale == first.scale for sc in scal) and all(
            a.shape == a_list[0].shape and a.tobytes() == a_list[0].tobytes() for a in a_list[1:]):
        return _ModulePlan(names, "shared", Scaling(first.rank, first.scale * first.rank), dtype)
    scale = first.scale if all(sc.scale == first.scale for sc in scal) else 1.0  # different scales go into B
    rank = sum(sc.rank for sc in scal) if kv == "exact" else max(sc.rank for sc in scal)
    return _ModulePlan(names, kv, Scaling(rank, scale * rank), dtype)


def _module_factors(ad: AdapterRows, mod: LoraModule,
                    plan: _ModulePlan) -> tuple[np.ndarray, np.ndarray, float | None]:
    """qwix (A, B) of one module following its plan, and (svd) the relative error of the delta."""
    pairs = {n: ad.pair(n) for n in plan.names}
    if plan.mode == "single":
        return (*peft_to_tunix(mod, [pairs[plan.names[0]]]), None)
    rows = {n: mod.shapes(1)["b_peft"][0] for n in mod.hf_modules}  # output size of each HF module
    if plan.mode in ("partial", "shared"):  # one A; HF modules without LoRA get B = 0
        a = pairs[plan.names[0]][0]
        full = [(a, pairs[n][1]) if n in pairs else (a, np.zeros((rows[n], a.shape[0]), a.dtype))
                for n in mod.hf_modules]
        return (*peft_to_tunix(mod, full), None)
    scales = {n: ad.scaling_of(n).scale for n in plan.names}
    fold = len(set(scales.values())) > 1
    if plan.mode == "exact":
        # stacked A, block-diagonal B: rank = the sum of ranks, every HF module's delta unchanged
        a = np.concatenate([pairs[n][0] for n in plan.names])
        full, col = [], 0
        for n in mod.hf_modules:
            b = np.zeros((rows[n], a.shape[0]), plan.dtype)
            if n in pairs:
                bn = pairs[n][1]
                if fold:
                    bn = (bn.astype(np.float32) * np.float32(scales[n])).astype(plan.dtype)
                b[:, col:col + bn.shape[1]] = bn
                col += bn.shape[1]
            full.append((a, b))
        return (*peft_to_tunix(mod, full), None)
    # svd: the best shared rank-r A for the stacked deltas
    r = plan.scaling.rank
    width = pairs[plan.names[0]][0].shape[1]
    deltas = [scales[n] * (pairs[n][1].astype(np.float64) @ pairs[n][0].astype(np.float64)) if n in pairs
              else np.zeros((rows[n], width)) for n in mod.hf_modules]
    m = np.concatenate(deltas)
    u, s, vt = np.linalg.svd(m, full_matrices=False)
    a, b = vt[:r], u[:, :r] * s[:r]
    err = float(np.linalg.norm(m - b @ a) / max(float(np.linalg.norm(m)), 1e-30))
    b = b / plan.scaling.scale
    a = a.astype(plan.dtype)
    bounds = np.cumsum([0] + [rows[n] for n in mod.hf_modules])
    full = [(a, b[bounds[i]:bounds[i + 1]].astype(plan.dtype)) for i in range(len(mod.hf_modules))]
    return (*peft_to_tunix(mod, full), err)


def no_expert_lora(ad: AdapterRows, why: str) -> None:
    """Refuse an adapter with LoRA on experts (PEFT's ``target_parameters``), saying ``why``."""
    if ad.params:
        names = sorted({name.split("layers.", 1)[-1].split(".", 1)[-1] for name in ad.params})
        raise UnsupportedError(f"{ad.path}: LoRA on {', '.join(names)} (target_parameters, {len(ad.params)} in all): "
                               f"{why}; merge the adapter into the base instead (ckptbridge merge)")


def write(ad: AdapterRows, dst: str, req: Request, *, kv: str = "exact", save_step: int = 0) -> OrbaxLoraReport:
    """Write ``ad`` as the Tunix checkpoint root ``dst/<save_step>/model_params`` with the qwix rules
    that rebuild the matching LoRA model in the step's custom metadata; ``kv``: how HF modules of
    one fused module with different A's are joined (:func:`_plan_module`). Modules are converted on
    the engine's workers while earlier ones are written."""
    deps.require("orbax")
    options.choice("kv", kv, KV_MODES)
    step = save_step
    if step < 0:
        raise ConfigError(f"step {step}: must be >= 0")
    b = ad.base
    mismatch = specs.note_mismatch(b.cfg)
    no_expert_lora(ad, "Tunix's experts are raw parameters that qwix puts no LoRA on")
    have = set(ad.names())
    plans = {m: _plan_module(ad, have, m, kv) for m in b.modules if any(n in have for n in m.hf_modules)}
    errors: dict[str, float] = {}

    def made(mod: LoraModule) -> tuple:
        value = _module_factors(ad, mod, plans[mod])
        if value[2] is not None:
            errors["/".join(mod.path)] = value[2]
        return value

    shared = {mod: Shared(functools.partial(made, mod), uses=2) for mod in plans}  # for its A and B leaves

    def factor(mod: LoraModule, which: int) -> np.ndarray:
        return shared[mod].get()[which]

    flat = {}
    for mod, plan in plans.items():
        shapes = mod.shapes(plan.scaling.rank)
        leaf_a, leaf_b = mod.leaves
        for which, (path, shape) in enumerate(((leaf_a, shapes["a_tunix"]), (leaf_b, shapes["b_tunix"]))):
            flat[path + ("value",)] = orbax_io.LazyArray(shape, plan.dtype, functools.partial(factor, mod, which))
    rules = rules_for({m: p.scaling for m, p in plans.items()}, b.modules)
    meta = {KEY: Metadata(
        kind="lora", family=b.spec.name, lora=LoraRules(rules, float(ad.dropout or 0.0)),
        base=os.path.abspath(b.path), key_prefix=b.prefix, source=storage.absolute(ad.path), kv=kv,
        tunix_version=installed_tunix_version(), base_quant=ad.base_quant,
    ).to_json()}
    bar = progress_over(flat.values(), req.desc, req.progress)
    total = bar.total
    with atomic_directory(dst, req.overwrite) as tmp:
        orbax_io.save_manager_step(tmp, step, orbax_io.nest(flat), meta, engine=req.engine)
    bar.close()
    return OrbaxLoraReport(
        direction=req.direction, source=req.source, destination=dst, step=step, family=b.spec.name,
        config_mismatch=mismatch, modules=len(plans), modes=dict(Counter(p.mode for p in plans.values())),
        rules=rules, kv=kv, svd_relative_error=errors, vllm_repeats_dropped=ad.vllm_repeats, bytes=total,
        seconds=round(time.perf_counter() - req.t0, 3))
