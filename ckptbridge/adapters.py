"""LoRA conversions: Tunix/qwix Orbax checkpoints <-> PEFT adapter directories, and PEFT adapters ->
MaxText LoRA checkpoints (MaxText's to PEFT goes through ``convert_orbax_to_peft`` too).

Both read the adapter and the base's config and key names only (no model, no qwix, no
accelerator), stream module by module, and write atomically.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import time
from collections import Counter

import numpy as np

from ckptbridge import deps, hub, lora, mapping, maxtext, maxtext_layout, model_card, options, specs, vllm_lora
from ckptbridge.errors import ConfigError, UnsupportedError
from ckptbridge.io import orbax as orbax_io
from ckptbridge.io import storage
from ckptbridge.io.atomic import atomic_directory, check_destination
from ckptbridge.io.safetensors import PlannedTensor, write_file
from ckptbridge.lora import LoraModule, Scaling, open_base
from ckptbridge.metadata import KEY, LoraRules, Metadata, installed_tunix_version
from ckptbridge.options import KV_MODES, TARGETS
from ckptbridge.progress import Progress, progress_over
from ckptbridge.report import Report, human_bytes
from ckptbridge.sources import more
from ckptbridge.stream import Parallelism, Parts, Shared

log = logging.getLogger(__name__)



@dataclasses.dataclass(frozen=True)
class PeftExportReport(Report):
    """A Tunix/qwix LoRA checkpoint exported as a PEFT adapter."""

    direction: str
    source: str
    destination: str
    family: str
    key_prefix: str
    target: str
    config_mismatch: str | None
    modules: int
    tensors: int
    bytes: int
    r: int
    lora_alpha: float | int
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float | int]
    warnings: list[str]
    seconds: float

    def summary(self) -> str:
        text = (f"orbax-to-peft ({self.target}): {self.source} -> {self.destination}\n"
                f"  {self.modules} modules, r={self.r}, lora_alpha={self.lora_alpha}, {human_bytes(self.bytes)} "
                f"in {self.seconds:.2f} s")
        return text + "".join(f"\n  warning: {w}" for w in self.warnings)


@dataclasses.dataclass(frozen=True)
class OrbaxLoraReport(Report):
    """A PEFT adapter written as a Tunix/qwix LoRA checkpoint."""

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
        text = (f"peft-to-orbax: {self.source} -> {self.destination}/{self.step}/model_params\n"
                f"  {self.modules} modules ({', '.join(f'{v} {k}' for k, v in self.modes.items())}), "
                f"{human_bytes(self.bytes)} in {self.seconds:.2f} s")
        for rule in self.rules:
            text += f"\n  rule: rank {rule['rank']}, alpha {rule['alpha']}: {rule['module_path']}"
        for module, err in self.svd_relative_error.items():
            text += f"\n  svd {module}: relative error {err:.3e}"
        if self.vllm_repeats_dropped:
            text += f"\n  dropped {self.vllm_repeats_dropped} v_proj copies of k_proj factors (vLLM export)"
        return text


def _padded(a: np.ndarray, b: np.ndarray, sc: Scaling, pad_to: int | None,
            fold_scale: float | None) -> tuple[np.ndarray, np.ndarray]:
    """A PEFT pair padded to rank ``pad_to`` with its scale folded into B as ``fold_scale`` (vLLM
    takes one rank and alpha), or as it is."""
    if pad_to is None or fold_scale is None or (sc.rank >= pad_to and sc.scale == fold_scale):
        return a, b
    dtype = a.dtype
    a = np.concatenate([a, np.zeros((pad_to - sc.rank, a.shape[1]), dtype)])
    scaled = b.astype(np.float32) * np.float32(sc.scale / fold_scale)
    return a, np.concatenate([scaled.astype(dtype), np.zeros((b.shape[0], pad_to - sc.rank), dtype)], axis=1)


def convert_orbax_to_peft(src: str, dst: str, *, base: str, step: int | None = None, alpha: float | None = None,
                          target: str = "hf", base_id: str | None = None, overwrite: bool = False,
                          workers: int | None = None, memory_budget: str | int | None = None,
                          progress: bool | None = None, revision: str | None = None) -> PeftExportReport:
    """Tunix/qwix or MaxText LoRA checkpoint -> PEFT adapter (``adapter_config.json`` +
    ``adapter_model.safetensors`` + a model card ``README.md``). A MaxText checkpoint's factors are
    ``lora_A``/``lora_B`` transposed, its value transforms of B (a RoPE reordering, a query scale)
    undone.

    ``target="vllm"`` also writes, on k_eq_v layers, the k_proj factors as v_proj (vLLM applies
    V's LoRA separately) and makes rank/alpha uniform (vLLM ignores rank/alpha patterns).
    ``base_id`` is the base's Hub id for the adapter config and model card (default: found from
    a Hub cache path or the base's config; else the base's local path is recorded). Factors are
    read and converted in batches on ``workers`` threads (default: every usable core) ahead of the
    writer, within ``memory_budget`` bytes (default 256 MiB); the files do not depend on either.
    """
    t0 = time.perf_counter()
    options.choice("target", target, TARGETS)
    parallel = Parallelism.of(workers, memory_budget)
    model_card.check_repo_id("base_id", base_id)
    base = hub.local(base, hub.CONFIG, revision=revision, what="base model")
    check_destination(dst, [src, base], overwrite)
    b = open_base(base)
    base_id = model_card.hub_id(b.path, base_id)
    mismatch = specs.note_mismatch(b.cfg)
    warnings: list[str] = []
    with lora.open_checkpoint_lora(src, b, step=step, alpha=alpha) as ad, contextlib.ExitStack() as stack:
        # every HF module that gets factors: (name, module, index into the module's pairs, scaling)
        plan: list[tuple[str, LoraModule, int, Scaling]] = []
        for mod, i in ad.targets():
            sc = ad.scaling[mod]
            plan.append((mod.hf_modules[i], mod, i, sc))
            if target == "vllm" and i == 0:
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
        if target == "vllm" and max_rank > vllm_lora.DEFAULT_MAX_LORA_RANK:
            warnings.append(
                f"rank {max_rank} exceeds vLLM's default --max-lora-rank {vllm_lora.DEFAULT_MAX_LORA_RANK}: "
                f"serve with --max-lora-rank {vllm_lora.next_rank(max_rank)}"
            )
        for w in warnings:
            log.warning(w)

        by_target: dict[tuple[LoraModule, int], list[tuple[str, Scaling]]] = {}
        for name, mod, i, sc in plan:
            by_target.setdefault((mod, i), []).append((name, sc))

        def peft_parts(read) -> list[tuple[str, np.ndarray]]:
            """The PEFT factors of a batch, under every name they are written as."""
            parts = []
            for target_, (a0, b0) in read().items():
                for name, sc in by_target[target_]:
                    a, b_ = _padded(a0, b0, sc, pad_to, fold_scale)
                    parts += [(lora.factor_key(name, "A"), a), (lora.factor_key(name, "B"), b_)]
            return parts

        engine = stack.enter_context(parallel.engine("o2p"))
        parts = Parts(engine.stream((nbytes, functools.partial(peft_parts, read)) for nbytes, read in ad.peft_reads()))
        tensors = []
        for name, mod, _, sc in plan:
            shapes = mod.shapes(pad_to or sc.rank)
            for which, shape in (("A", shapes["a_peft"]), ("B", shapes["b_peft"])):
                key = lora.factor_key(name, which)
                tensors.append(PlannedTensor(key, ad.dtype(mod), shape, functools.partial(parts.take, key)))
        names = [name for name, _, _, _ in plan]
        config = lora.export_config(b, names, r, alpha_default, rank_pattern, alpha_pattern, ad.dropout, base_id)
        card = model_card.adapter_card(
            base_id=base_id, base_path=b.path, source=storage.absolute(ad.path), step=ad.step,
            rank=r, alpha=alpha_default, patterns=len(set(rank_pattern) | set(alpha_pattern)),
            target_modules=sorted({n.rsplit(".", 1)[-1] for n in names}), target=target, family=b.spec.name,
            peft_version=model_card.installed_version("peft"))
        meta = {KEY: json.dumps(Metadata(family=b.spec.name, target=target, source=storage.absolute(ad.path),
                                         base=os.path.abspath(b.path)).to_json())}
        total = sum(t.nbytes for t in tensors)
        bar = Progress(total, "orbax -> peft", enabled=progress)
        with atomic_directory(dst, overwrite) as tmp:
            os.makedirs(tmp)
            write_file(os.path.join(tmp, lora.ADAPTER_WEIGHTS), tensors, meta, on_tensor=lambda t: bar.update(t.nbytes))
            config.write(tmp)
            with open(os.path.join(tmp, model_card.FILENAME), "w") as f:
                f.write(card)
        bar.close()
        return PeftExportReport(
            direction="orbax-to-peft", source=ad.path, destination=dst, family=b.spec.name, key_prefix=b.prefix,
            target=target, config_mismatch=mismatch, modules=len(plan), tensors=len(tensors), bytes=total, r=r,
            lora_alpha=lora.plain_number(alpha_default), rank_pattern=rank_pattern, alpha_pattern=alpha_pattern,
            warnings=warnings, seconds=round(time.perf_counter() - t0, 3))


@dataclasses.dataclass
class _ModulePlan:
    """How one Tunix module is made from PEFT factors (decided from configs and A's alone)."""

    names: list[str]  # HF modules of the adapter that feed this module
    # "single" | "partial" (one of a fused module's HF modules) | "shared" (same A and scale) | "exact" | "svd"
    mode: str
    scaling: Scaling  # the qwix rank and alpha of the result
    dtype: np.dtype


def _plan_module(ad: lora.PeftLora, mod: LoraModule, kv: str) -> _ModulePlan:
    """A fused Tunix module (k/v, q/k/v) has one A for all its HF modules: separate PEFT modules
    sharing one A and scale map as they are; otherwise ``exact`` stacks their A's (rank = the sum)
    and ``svd`` finds the best shared A at the largest rank."""
    names = [n for n in mod.hf_modules if n in ad.keys]
    scal = [ad.scaling[n] for n in names]
    dtype = ad.dtype(names[0])
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


def _module_factors(ad: lora.PeftLora, mod: LoraModule,
                    plan: _ModulePlan) -> tuple[np.ndarray, np.ndarray, float | None]:
    """qwix (A, B) of one module following its plan, and (svd) the relative error of the delta."""
    pairs = {n: ad.pair(n) for n in plan.names}
    if plan.mode == "single":
        return (*lora.peft_to_tunix(mod, [pairs[plan.names[0]]]), None)
    rows = {n: mod.shapes(1)["b_peft"][0] for n in mod.hf_modules}  # output size of each HF module
    if plan.mode in ("partial", "shared"):  # one A; HF modules without LoRA get B = 0
        a = pairs[plan.names[0]][0]
        full = [(a, pairs[n][1]) if n in pairs else (a, np.zeros((rows[n], a.shape[0]), a.dtype))
                for n in mod.hf_modules]
        return (*lora.peft_to_tunix(mod, full), None)
    scales = {n: ad.scaling[n].scale for n in plan.names}
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
        return (*lora.peft_to_tunix(mod, full), None)
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
    return (*lora.peft_to_tunix(mod, full), err)


def _no_expert_lora(ad: lora.PeftLora, src: str, why: str) -> None:
    """Refuse an adapter with LoRA on experts (PEFT's ``target_parameters``), saying ``why``."""
    if ad.params:
        names = sorted({name.split("layers.", 1)[-1].split(".", 1)[-1] for name in ad.params})
        raise UnsupportedError(f"{src}: LoRA on {', '.join(names)} (target_parameters, {len(ad.params)} in all): "
                               f"{why}; merge the adapter into the base instead (ckptbridge merge)")


def convert_peft_to_orbax(src: str, dst: str, *, base: str, kv: str = "exact", step: int = 0,
                          overwrite: bool = False, workers: int | None = None, memory_budget: str | int | None = None,
                          progress: bool | None = None, revision: str | None = None) -> OrbaxLoraReport:
    """PEFT adapter -> Tunix checkpoint root ``DST/<step>/model_params`` with the qwix rules that
    rebuild the matching LoRA model in the step's custom metadata. Modules are converted on
    ``workers`` threads (default: every usable core) while earlier ones are written, within
    ``memory_budget`` bytes (default 256 MiB). ``src`` and ``base`` may be Hub ids (``revision``:
    the base's branch, tag or commit)."""
    t0 = time.perf_counter()
    deps.require("orbax")
    options.choice("kv", kv, KV_MODES)
    parallel = Parallelism.of(workers, memory_budget)
    if step < 0:
        raise ConfigError(f"step {step}: must be >= 0")
    base = hub.local(base, hub.CONFIG, revision=revision, what="base model")
    src = hub.local(src, hub.ADAPTER, what="adapter")
    check_destination(dst, [src, base], overwrite)
    b = open_base(base)
    mismatch = specs.note_mismatch(b.cfg)
    with lora.open_peft_lora(src, b) as ad:
        _no_expert_lora(ad, src, "Tunix's experts are raw parameters that qwix puts no LoRA on")
        plans = {m: _plan_module(ad, m, kv) for m in b.modules if any(n in ad.keys for n in m.hf_modules)}
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
        rules = lora.rules_for({m: p.scaling for m, p in plans.items()}, b.modules)
        meta = {KEY: Metadata(
            kind="lora", family=b.spec.name, lora=LoraRules(rules, float(ad.config.lora_dropout or 0.0)),
            base=os.path.abspath(b.path), key_prefix=b.prefix, source=os.path.abspath(src), kv=kv,
            tunix_version=installed_tunix_version(),
        ).to_json()}
        bar = progress_over(flat.values(), "peft -> orbax", progress)
        total = bar.total
        with atomic_directory(dst, overwrite) as tmp, parallel.engine("p2o") as engine:
            orbax_io.save_manager_step(tmp, step, orbax_io.nest(flat), meta, engine=engine)
        bar.close()
        return OrbaxLoraReport(
            direction="peft-to-orbax", source=src, destination=dst, step=step, family=b.spec.name,
            config_mismatch=mismatch, modules=len(plans), modes=dict(Counter(p.mode for p in plans.values())),
            rules=rules, kv=kv, svd_relative_error=errors, vllm_repeats_dropped=ad.vllm_repeats, bytes=total,
            seconds=round(time.perf_counter() - t0, 3))


@dataclasses.dataclass(frozen=True)
class MaxTextLoraReport(Report):
    """A PEFT adapter written as a MaxText LoRA checkpoint."""

    direction: str
    source: str
    destination: str
    family: str
    config_mismatch: str | None
    scan_layers: bool
    modules: int
    zero_layers: int  # stacked layers the adapter has no LoRA on, written as zero factors
    lora_rank: int
    lora_alpha: float | int
    bytes: int
    warnings: list[str]
    seconds: float

    def summary(self) -> str:
        lay = "scanned" if self.scan_layers else "unscanned"
        text = (f"peft-to-maxtext: {self.source} -> {self.destination}/0/{maxtext.ITEM}\n"
                f"  {self.modules} modules ({lay}), lora_rank={self.lora_rank}, lora_alpha={self.lora_alpha}, "
                f"{human_bytes(self.bytes)} in {self.seconds:.2f} s\n"
                f"  MaxText: lora.lora_restore_path={self.destination.rstrip('/')}/0/{maxtext.ITEM} with "
                f"scan_layers={str(self.scan_layers).lower()}")
        if self.zero_layers:
            text += f"\n  {self.zero_layers} stacked layer factors without LoRA in the adapter written as zeros"
        return text + "".join(f"\n  warning: {w}" for w in self.warnings)


def convert_peft_to_maxtext(src: str, dst: str, *, base: str, scan_layers: bool = False, overwrite: bool = False,
                            compression: bool = True, workers: int | None = None,
                            memory_budget: str | int | None = None, progress: bool | None = None,
                            revision: str | None = None) -> MaxTextLoraReport:
    """PEFT adapter -> MaxText LoRA checkpoint ``DST/0/items`` (``kernel_lora_a`` = ``lora_A``
    transposed, ``kernel_lora_b`` = ``lora_B`` transposed with the kernel's value transforms, as
    MaxText's ``to_maxtext`` converts an adapter; stacked on axis 1 with ``scan_layers``), with
    ``lora_rank`` and ``lora_alpha`` in the step's metadata as MaxText's trainer records them.
    MaxText has one rank and alpha: where the adapter's modules differ, every module is padded to
    the largest rank and its scale folded into B (exact). ``src`` and ``base`` may be Hub ids."""
    from ckptbridge.lora import maxtext as maxtext_lora

    t0 = time.perf_counter()
    deps.require("orbax")
    parallel = Parallelism.of(workers, memory_budget)
    base = hub.local(base, hub.CONFIG, revision=revision, what="base model")
    src = hub.local(src, hub.ADAPTER, what="adapter")
    check_destination(dst, [src, base], overwrite)
    b = open_base(base)
    mt = maxtext.maxtext_spec(b.spec, b.path)
    mismatch = specs.note_mismatch(b.cfg)
    with lora.open_peft_lora(src, b) as ad:
        _no_expert_lora(ad, src, "MaxText's experts take no LoRA in ckptbridge")
        leaves = maxtext_layout.plan(mapping.entries(b.cfg, b.spec, b.prefix), mt, scan_layers, b.cfg.flags)
        where: dict[str, tuple[maxtext_lora.FactorLeaves, int]] = {}
        for f in maxtext_lora.factor_leaves(b, leaves):
            for pos, (mod, i) in enumerate(f.targets):
                where[mod.hf_modules[i]] = (f, pos)
        missing = [n for n in ad.keys if n not in where]
        if missing:
            raise UnsupportedError(f"{src}: LoRA on {missing[0]}{more(missing)}, which has no LoRA form in MaxText's "
                                   f"layout of {b.spec.name}; merge the adapter into the base instead")
        counts = Counter(ad.scaling[n].scale for n in ad.keys)
        scale = counts.most_common(1)[0][0]
        rank = max(ad.scaling[n].rank for n in ad.keys)
        warnings: list[str] = []
        if len(counts) > 1 or len({ad.scaling[n].rank for n in ad.keys}) > 1:
            warnings.append(f"ranks/scales differ between modules: padded every module to rank {rank} and folded "
                            "the per-module scales into kernel_lora_b (MaxText has one rank and alpha)")
        elif any(ad.scaling[n].rslora for n in ad.keys):
            warnings.append("rsLoRA: lora_alpha written as the scale times the rank (MaxText scales by alpha / rank)")
        for w in warnings:
            log.warning(w)
        alpha = lora.plain_number(scale * rank)
        users: dict[maxtext_lora.FactorLeaves, dict[int, str]] = {}
        for n in ad.keys:
            f, pos = where[n]
            users.setdefault(f, {})[pos] = n

        def made(f: maxtext_lora.FactorLeaves) -> tuple[np.ndarray, np.ndarray]:
            dtype = ad.dtype(next(iter(users[f].values())))
            out = [np.zeros(s, dtype) for s in f.shapes(rank)]
            for pos, n in users[f].items():
                a0, b0 = ad.pair(n)
                for full, x in zip(out, f.to_maxtext(pos, *_padded(a0, b0, ad.scaling[n], rank, scale))):
                    full[f.region(pos, full.ndim)] = f.leaf.stacked(x.astype(dtype, copy=False))
            return out[0], out[1]

        shared = {f: Shared(functools.partial(made, f), uses=2) for f in users}

        def factor(f: maxtext_lora.FactorLeaves, which: int) -> np.ndarray:
            return shared[f].get()[which]

        flat: dict[tuple[str, ...], orbax_io.LazyArray] = {}
        for f, at in users.items():
            dtype = ad.dtype(next(iter(at.values())))
            for which, (path, shape) in enumerate(zip(f.paths, f.shapes(rank))):
                flat[maxtext.ROOT + path + ("value",)] = orbax_io.LazyArray(
                    shape, dtype, functools.partial(factor, f, which))
        tree = {**orbax_io.nest(flat), "step": np.asarray(0, np.int64)}  # MaxText's TrainState step
        meta = {maxtext.SCAN_KEY: scan_layers,
                maxtext_lora.LORA_KEY: {"enable_lora": True, "lora_rank": rank, "lora_alpha": alpha},
                KEY: Metadata(kind="lora", family=b.spec.name, base=os.path.abspath(b.path), key_prefix=b.prefix,
                              source=os.path.abspath(src)).to_json()}
        bar = progress_over(flat.values(), "peft -> maxtext", progress)
        total = bar.total
        with atomic_directory(dst, overwrite) as tmp, parallel.engine("p2m") as engine:
            orbax_io.save_manager_step(tmp, 0, tree, meta, item=maxtext.ITEM, compression=compression, engine=engine)
        bar.close()
        return MaxTextLoraReport(
            direction="peft-to-maxtext", source=src, destination=dst, family=b.spec.name, config_mismatch=mismatch,
            scan_layers=scan_layers, modules=len(ad.keys),
            zero_layers=sum(len(f.targets) - len(at) for f, at in users.items()), lora_rank=rank,
            lora_alpha=alpha, bytes=total, warnings=warnings, seconds=round(time.perf_counter() - t0, 3))
