"""LoRA adapters in both worlds, derived from the same spec table as the weights.

Layouts. An HF linear weight is ``(out, in)``; PEFT stores ``lora_A (r, in)`` and
``lora_B (out, r)``. qwix puts the weight's input-side axes (in Tunix order) plus ``r`` into A,
and ``r`` plus the output-side axes into B. A rule's HF layout names its output group first and
its input group second (``"(n h) d"``: out ``n h``, in ``d``), so all four factor layouts follow
from the rule: for ``q`` (Tunix ``n d h``) A is ``d r`` / ``r d`` and B is ``r n h`` / ``(n h) r``;
for the fused ``kv`` the Tunix B keeps the ``c`` axis (``r c k h``) and one A serves K and V.

Scale. qwix computes ``y + (alpha / rank) * x A B``; PEFT ``lora_alpha / r`` (rsLoRA:
``lora_alpha / sqrt(r)``). Conversions keep the scale of every module exactly.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
from typing import Iterable

import numpy as np

from typing import TYPE_CHECKING

from ckptbridge import layout, mapping
from ckptbridge.config import ModelConfig
from ckptbridge.errors import ConfigError, CorruptFileError, InputNotFoundError, MismatchError, UnsupportedError
from ckptbridge.io.hf import check_inside
from ckptbridge.io.safetensors import SafetensorsFile, numpy_dtype
from ckptbridge.qwix_lora import is_lora_leaf, lora_leaves
from ckptbridge.specs import FamilySpec

if TYPE_CHECKING:
    from ckptbridge.metadata import Metadata
    from ckptbridge.sources import Base

log = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


# --------------------------------------------------------------------------- layouts


@dataclasses.dataclass(frozen=True)
class LoraLayouts:
    a_tunix: str
    b_tunix: str
    a_peft: str
    b_peft: str  # of each HF tensor
    b_peft_stacked: str  # of the HF tensors stacked along c (fused rules), else b_peft


def lora_layouts(rule) -> LoraLayouts:
    """The four factor layouts of a rule, derived from its weight layouts."""
    groups = layout.parse(rule.hf_layout)
    if len(groups) != 2:
        raise ValueError(f"rule {rule.name}: LoRA needs a 2-D HF weight, layout is {rule.hf_layout!r}")
    out_axes, in_axes = groups
    t_axes = layout.axes(rule.tunix_layout)
    a_tunix = " ".join([a for a in t_axes if a in in_axes] + ["r"])
    b_tunix = " ".join(["r"] + [a for a in t_axes if a not in in_axes])
    a_peft = f"r ({' '.join(in_axes)})"
    b_peft = f"({' '.join(out_axes)}) r"
    return LoraLayouts(a_tunix, b_tunix, a_peft, b_peft, f"c {b_peft}" if rule.fused else b_peft)


@dataclasses.dataclass(frozen=True, eq=False)
class LoraModule:
    """One module that can carry LoRA: its Tunix parameter entry and its HF/PEFT module names."""

    entry: mapping.Entry

    def __eq__(self, other) -> bool:
        return isinstance(other, LoraModule) and other.entry.tunix_path == self.entry.tunix_path

    def __hash__(self) -> int:
        return hash(self.entry.tunix_path)

    @property
    def path(self) -> tuple[str, ...]:
        return self.entry.tunix_path[:-1]

    @property
    def qwix_path(self) -> str:
        """The module path qwix matches rules against (``layers/5/attn/k_einsum``)."""
        return "/".join(self.path)

    @property
    def leaves(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return lora_leaves(self.entry.tunix_path)

    @property
    def layer(self) -> str | None:
        """The layer index of a layer module (as in its path), None for a model-level one."""
        return self.entry.tunix_path[1] if self.entry.layer is not None else None

    @property
    def in_layer(self) -> tuple[str, ...]:
        """The module path inside its layer (the whole path for a model-level module)."""
        return self.path[2:] if self.entry.layer is not None else self.path

    @property
    def hf_modules(self) -> tuple[str, ...]:
        return tuple(k[: -len(".weight")] if k.endswith(".weight") else k for k in self.entry.hf_keys)

    @property
    def vllm_aliases(self) -> tuple[str, ...]:
        """HF modules that repeat this module's factors in an adapter exported for vLLM."""
        return tuple(self.entry.key_prefix + k.removesuffix(".weight") for k in self.entry.rule.vllm_lora_aliases)

    @property
    def layouts(self) -> LoraLayouts:
        return lora_layouts(self.entry.rule)

    def sizes(self, rank: int) -> dict:
        return {**self.entry.sizes, "r": rank}

    def shapes(self, rank: int) -> dict[str, tuple[int, ...]]:
        s, L = self.sizes(rank), self.layouts
        return {name: layout.shape(getattr(L, name), s) for name in ("a_tunix", "b_tunix", "a_peft", "b_peft")}


def lora_modules(cfg: ModelConfig, spec: FamilySpec, prefix: str) -> list[LoraModule]:
    return [LoraModule(e) for e in mapping.entries(cfg, spec, prefix) if e.rule.lora and e.hf_keys]


def tunix_to_peft(mod: LoraModule, a: np.ndarray, b: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """qwix factors of one module -> PEFT ``(lora_A, lora_B)`` per HF module (A shared by k and v)."""
    rank = a.shape[-1]
    s, L = mod.sizes(rank), mod.layouts
    a_p = layout.rearrange(a, L.a_tunix, L.a_peft, s)
    b_p = layout.rearrange(b, L.b_tunix, L.b_peft_stacked, s)
    if mod.entry.rule.fused:
        return [(a_p, b_p[i]) for i in range(len(mod.hf_modules))]
    return [(a_p, b_p)]


def peft_to_tunix(mod: LoraModule, pairs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """PEFT factors (one pair per HF module, sharing A) -> qwix ``(A, B)`` of one module."""
    a_p = pairs[0][0]
    rank = a_p.shape[0]
    s, L = mod.sizes(rank), mod.layouts
    a = layout.rearrange(a_p, L.a_peft, L.a_tunix, s)
    b_p = np.stack([p[1] for p in pairs]) if mod.entry.rule.fused else pairs[0][1]
    return a, layout.rearrange(b_p, L.b_peft_stacked, L.b_tunix, s)


# --------------------------------------------------------------------------- scale bookkeeping


@dataclasses.dataclass(frozen=True)
class Scaling:
    rank: int
    alpha: float
    rslora: bool = False

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def plain_number(x: float) -> float | int:
    """12.0 -> 12, 0.5 -> 0.5: how a rank or alpha is written to JSON."""
    return int(x) if float(x).is_integer() else float(x)


def rules_for(assigned: dict[LoraModule, Scaling], all_modules: list[LoraModule]) -> list[dict]:
    """qwix rules (``module_path`` regex, rank, alpha) that give every module in ``assigned`` its
    rank and alpha and match no other module. Each regex names exactly its modules, so order
    does not matter; a layer module present in every layer it exists in gets ``\\d+``."""
    layers_of: dict[tuple[str, ...], set[str]] = {}
    for m in all_modules:
        if m.layer is not None:
            layers_of.setdefault(m.in_layer, set()).add(m.layer)
    groups: dict[tuple, list[LoraModule]] = {}
    for m, sc in assigned.items():
        qwix_alpha = sc.scale * sc.rank  # qwix scale is alpha / rank
        groups.setdefault((sc.rank, plain_number(round(qwix_alpha, 12))), []).append(m)
    rules = []
    for (rank, alpha), mods in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        by_name: dict[tuple[str, ...], set[str]] = {}
        top = []
        for m in mods:
            if m.layer is None:
                top.append(re.escape(m.qwix_path))
            else:
                by_name.setdefault(m.in_layer, set()).add(m.layer)
        full: dict[str, list[str]] = {}
        parts = []
        for inner, layers in sorted(by_name.items()):
            parent, name = "/".join(inner[:-1]), inner[-1]
            if layers == layers_of[inner]:
                full.setdefault(parent, []).append(name)
            else:
                idx = "|".join(sorted(layers, key=int))
                parts.append(f"layers/(?:{idx})/{parent + '/' if parent else ''}{name}")
        for parent, names in sorted(full.items()):
            parts.insert(0, f"layers/\\d+/{parent + '/' if parent else ''}(?:{'|'.join(names)})")
        parts += sorted(top)
        rules.append({"module_path": "|".join(parts) if len(parts) == 1 else "|".join(f"(?:{p})" for p in parts),
                      "rank": rank, "alpha": alpha})
    return rules


def scaling_from_rules(mod: LoraModule, rules: list[dict], where: str) -> Scaling | None:
    """The (rank, alpha) qwix gives ``mod`` under ``rules`` (first full match wins), or None."""
    for rule in rules:
        try:
            if re.fullmatch(rule["module_path"], mod.qwix_path):
                return Scaling(int(rule["rank"]), float(rule["alpha"]))
        except (KeyError, TypeError, ValueError, re.error):
            raise CorruptFileError(f"{where}: LoRA rule {rule!r} is malformed (needs module_path, rank, alpha)") from None
    return None


# --------------------------------------------------------------------------- sources


@dataclasses.dataclass
class OrbaxLora:
    """A Tunix/qwix LoRA checkpoint, validated against the base."""

    path: str
    ckpt: object  # OrbaxCheckpoint
    base: Base
    suffix: tuple[str, ...]
    scaling: dict[LoraModule, Scaling]
    metadata: "Metadata"
    batch_bytes: int = 128 << 20  # factors per read batch
    _ahead: dict = dataclasses.field(default_factory=dict)
    _pending: tuple | None = None  # (modules, result of OrbaxCheckpoint.start_read) of the next batch

    def factors(self, mod: LoraModule) -> tuple[np.ndarray, np.ndarray]:
        """(A, B) of ``mod`` in Tunix layout. Modules are read in batches of about ``batch_bytes``
        (one read call per batch: with Orbax each call has a fixed cost, which made a 31B rank-64
        export 4x slower), in the order of ``scaling``; once a batch is collected, the next one
        is started, so it is read and decoded while this one is converted and written. A factor
        is dropped once handed out."""
        if mod not in self._ahead:
            if self._pending is None or mod not in self._pending[0]:
                self._pending = self._start_batch(mod)
            batch, result = self._pending
            got = result()
            for m in batch:
                self._ahead[m] = tuple(got[p] for p in self._leaves(m))
            rest = self._order[self._order.index(batch[-1]) + 1:] if batch[-1] in self.scaling else []
            self._pending = self._start_batch(rest[0]) if rest else None
        return self._ahead.pop(mod)

    @property
    def _order(self) -> list[LoraModule]:
        return list(self.scaling)

    def _leaves(self, mod: LoraModule) -> tuple[tuple[str, ...], tuple[str, ...]]:
        a, b = (leaf + self.suffix for leaf in mod.leaves)
        return a, b

    def _start_batch(self, first: LoraModule) -> tuple:
        order = self._order
        batch, total = [], 0
        for mod in order[order.index(first):] if first in self.scaling else [first]:
            size = sum(int(np.prod(self.ckpt.leaves[p][0])) * np.dtype(self.ckpt.leaves[p][1]).itemsize
                       for p in self._leaves(mod))
            if batch and total + size > self.batch_bytes:
                break
            if mod not in self._ahead:
                batch.append(mod)
                total += size
        return batch, self.ckpt.start_read([p for mod in batch for p in self._leaves(mod)])

    def dtype(self, mod: LoraModule) -> np.dtype:
        return self.ckpt.leaves[mod.leaves[0] + self.suffix][1]

    def close(self) -> None:
        self._ahead.clear()
        self._pending = None
        self.ckpt.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_orbax_lora(src: str, base: Base, *, step: int | None = None, alpha: float | None = None) -> OrbaxLora:
    from ckptbridge.io.orbax import OrbaxCheckpoint, resolve_checkpoint

    path = resolve_checkpoint(src, step)
    ckpt = OrbaxCheckpoint(path)
    try:
        return _validate_orbax_lora(path, ckpt, base, alpha)
    except BaseException:
        ckpt.close()
        raise


def _validate_orbax_lora(path: str, ckpt, base: Base, alpha: float | None) -> OrbaxLora:
    meta = ckpt.metadata
    leaves = dict(ckpt.leaves)
    if not any(is_lora_leaf(p) for p in leaves):
        raise UnsupportedError(f"{path}: has no LoRA parameters (*_lora_a/*_lora_b); for full weights use orbax-to-safetensors")
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
                f"(expected A {shapes['a_tunix']}, B {shapes['b_tunix']} at rank {rank}); wrong --base?"
            )
        if alpha is not None:
            scaling[mod] = Scaling(rank, float(alpha))
            continue
        sc = scaling_from_rules(mod, rules, path) if rules else None
        if sc is None:
            raise ConfigError(
                f"{path}: no LoRA alpha recorded for {name}; pass --alpha (the alpha used in training; "
                f"the scale is alpha / rank, rank here {rank})"
            )
        if sc.rank != rank:
            raise MismatchError(f"{path}: metadata gives {name} rank {sc.rank}, its tensors have rank {rank}")
        scaling[mod] = sc
    ordered = {m: scaling[m] for m in base.modules if m in scaling}
    return OrbaxLora(path, ckpt, base, suffix, ordered, meta)


@dataclasses.dataclass
class ParamLora:
    """A PEFT ``target_parameters`` LoRA on one expert parameter of one layer: lora_A ``(e r, in)``
    with rows ordered (expert, rank), lora_B ``(out, r e)`` with columns ordered (rank, expert), as
    PEFT's ``ParamWrapper`` reads them; each expert's delta is ``B[:, :, j] @ A[j]``, its output
    rows split over ``entries`` (the HF rows, in order: one key per expert, or one tensor
    ``(e, out, in)`` holding them all)."""

    name: str
    keys: tuple[str, str]
    entries: tuple[mapping.Entry, ...]
    experts: int
    scaling: Scaling

    @staticmethod
    def expert_shape(entry: mapping.Entry) -> tuple[int, int]:
        """(out, in) of one expert's part of ``entry``."""
        return entry.hf_shape if entry.rule.stack else entry.hf_shape[1:]

    def expert_deltas(self, f: SafetensorsFile) -> Iterable[tuple[str, int, tuple[np.ndarray, np.ndarray]]]:
        """(HF key, first row of the key's tensor as a matrix, (lora_A, lora_B)) in PEFT layout, for
        every expert and row."""
        a, b = f.array(self.keys[0]), f.array(self.keys[1])
        e, r = self.experts, self.scaling.rank
        a = a.reshape(e, r, a.shape[-1])
        b = b.reshape(b.shape[0], r, e)
        for j in range(e):
            start = 0
            for entry in self.entries:
                rows = self.expert_shape(entry)[0]
                pair = (a[j], b[start:start + rows, :, j])
                if entry.rule.stack:
                    yield entry.hf_keys[j], 0, pair
                else:
                    yield entry.hf_keys[0], j * rows, pair
                start += rows


@dataclasses.dataclass
class PeftLora:
    """A PEFT LoRA adapter directory, validated against the base."""

    path: str
    file: SafetensorsFile
    base: Base
    config: dict
    keys: dict[str, tuple[str, str]]  # HF module -> (lora_A key, lora_B key)
    scaling: dict[str, Scaling]  # HF module -> scaling
    vllm_repeats: int = 0  # v_proj copies of k_proj factors (vLLM export) that were dropped
    params: dict[str, ParamLora] = dataclasses.field(default_factory=dict)  # target_parameters LoRA

    def pair(self, hf_module: str) -> tuple[np.ndarray, np.ndarray]:
        ka, kb = self.keys[hf_module]
        return self.file.array(ka), self.file.array(kb)

    def dtype(self, hf_module: str) -> np.dtype:
        return numpy_dtype(self.file.info(self.keys[hf_module][0]).dtype)

    def close(self) -> None:
        self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern/alpha_pattern lookup: first key matching the end of the module name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_adapter_config(path: str) -> dict:
    cfg_path = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(cfg_path):
        raise InputNotFoundError(f"{path}: no {ADAPTER_CONFIG}; not a PEFT adapter directory")
    check_inside(path, cfg_path)
    try:
        with open(cfg_path, "rb") as f:
            cfg = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CorruptFileError(f"{cfg_path}: not valid JSON; restore the adapter's config") from None
    if not isinstance(cfg, dict):
        raise CorruptFileError(f"{cfg_path}: expected a JSON object")
    return cfg


def open_peft_lora(src: str, base: Base) -> PeftLora:
    cfg = read_adapter_config(src)
    where = os.path.join(src, ADAPTER_CONFIG)
    if cfg.get("peft_type") != "LORA":
        raise UnsupportedError(f"{where}: peft_type {cfg.get('peft_type')!r}; only LORA adapters are supported")
    if cfg.get("use_dora"):
        raise UnsupportedError(f"{where}: DoRA (use_dora) has no qwix/Tunix equivalent; train a plain LoRA adapter")
    if cfg.get("modules_to_save"):
        raise UnsupportedError(
            f"{where}: modules_to_save {cfg['modules_to_save']} trains whole modules, which a LoRA checkpoint "
            "cannot carry; merge the adapter instead or retrain without modules_to_save"
        )
    if cfg.get("lora_bias") or cfg.get("bias") not in (None, "none"):
        raise UnsupportedError(f"{where}: LoRA biases (bias / lora_bias) are not supported")
    if cfg.get("layer_replication") or cfg.get("trainable_token_indices"):
        raise UnsupportedError(f"{where}: layer_replication / trainable_token_indices are not supported")
    for field in ("r", "lora_alpha"):
        v = cfg.get(field)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise CorruptFileError(f"{where}: {field} must be a positive number, found {v!r}")
    weights = os.path.join(src, ADAPTER_WEIGHTS)
    if not os.path.isfile(weights):
        if os.path.isfile(os.path.join(src, "adapter_model.bin")):
            raise UnsupportedError(
                f"{os.path.join(src, 'adapter_model.bin')}: pickle adapters are never loaded; re-save with "
                "save_pretrained(..., safe_serialization=True)"
            )
        raise InputNotFoundError(f"{src}: no {ADAPTER_WEIGHTS}")
    f = SafetensorsFile(check_inside(src, weights))
    try:
        return _validate_peft(src, f, base, cfg)
    except BaseException:
        f.close()
        raise


_PEFT_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")


def _validate_peft(src: str, f: SafetensorsFile, base: Base, cfg: dict) -> PeftLora:
    weights = f.path
    known = base.by_hf_module()
    # modules of the adapter may use either key prefix of the family; map them onto the base's
    aliases = base.module_names()
    alias_of = base.vllm_aliases()
    keys: dict[str, list] = {}
    param_keys: dict[str, list] = {}
    param_modules = _param_modules(base, cfg)
    targets = cfg.get("target_parameters") or []
    known_params = [p.name for p in base.spec.peft_params]
    unmatched = [t for t in (targets if isinstance(targets, list) else [targets])
                 if not any(str(t) == p or p.endswith("." + str(t)) or str(t).endswith("." + p) for p in known_params)]
    if unmatched:
        raise UnsupportedError(
            f"{os.path.join(src, ADAPTER_CONFIG)}: target_parameters {unmatched}: "
            + (f"ckptbridge takes parameter LoRA on a {base.spec.name} base only on {known_params}" if known_params
               else f"ckptbridge takes no parameter LoRA on a {base.spec.name} base, only LoRA on modules"))
    for key in f.keys():
        m = _PEFT_KEY.match(key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else "")
        if not m or m.group("adapter") not in (None, "default"):
            raise MismatchError(
                f"{weights}: tensor {key!r} is not a PEFT LoRA factor "
                f"({PEFT_PREFIX}<module>.lora_A.weight / .lora_B.weight)"
            )
        if m.group("module") in param_modules:
            param_keys.setdefault(param_modules[m.group("module")], [None, None])["AB".index(m.group("ab"))] = key
            continue
        module = aliases.get(m.group("module"))
        if module is None or (module not in known and module not in alias_of):
            raise MismatchError(
                f"{weights}: tensor {key!r} targets {m.group('module')!r}, which is not a LoRA-able module of the "
                f"{base.spec.name} base {base.path}; the adapter belongs to another model"
            )
        keys.setdefault(module, [None, None])["AB".index(m.group("ab"))] = key
    if not keys and not param_keys:
        raise MismatchError(f"{weights}: no LoRA tensors")
    # A vLLM export repeats some modules' factors under an alias (vllm_lora_aliases): drop those repeats.
    vllm_repeats = 0
    for alias, canonical in alias_of.items():
        if alias not in keys:
            continue
        pair = keys.pop(alias)
        same = canonical in keys and all(
            None not in (x, y) and f.info(x).shape == f.info(y).shape and f.raw(x) == f.raw(y)
            for x, y in zip(pair, keys[canonical])
        )
        if not same:
            raise MismatchError(
                f"{weights}: {alias} has LoRA factors but the base layer computes it with {canonical} (no module "
                f"of its own) and they are not a copy of {canonical}'s (as in a vLLM export); the adapter does not "
                f"fit the base {base.path}"
            )
        vllm_repeats += 1
    r, alpha = cfg["r"], cfg["lora_alpha"]
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    scaling: dict[str, Scaling] = {}
    for module, (ka, kb) in keys.items():
        if ka is None or kb is None:
            raise MismatchError(f"{weights}: {module} has only one of lora_A / lora_B")
        mod, _ = known[module]
        ia, ib = f.info(ka), f.info(kb)
        rank = ia.shape[0] if ia.shape else 0
        want = mod.shapes(rank)
        want_a, want_b = want["a_peft"], want["b_peft"]
        if rank < 1 or ia.shape != want_a or ib.shape != want_b:
            raise MismatchError(
                f"{weights}: {module} lora_A {ia.shape} / lora_B {ib.shape} do not fit the base {base.path} "
                f"(expected {want_a} / {want_b} at rank {rank}); wrong --base?"
            )
        if ia.dtype != ib.dtype:
            raise MismatchError(f"{weights}: {module} lora_A and lora_B differ in dtype")
        r_m = _pattern_value(rank_pattern, module, r)
        if int(r_m) != rank:
            raise MismatchError(
                f"{weights}: {module} has rank {rank} but {ADAPTER_CONFIG} gives it r={r_m}; the config and weights disagree"
            )
        scaling[module] = Scaling(rank, float(_pattern_value(alpha_pattern, module, alpha)), bool(cfg.get("use_rslora")))
    ordered = {name: tuple(keys[name]) for name in known if name in keys}
    params = {}
    param_entries = _param_entries(base) if param_keys else {}
    for name, (ka, kb) in param_keys.items():
        entries = param_entries[name]
        if ka is None or kb is None:
            raise MismatchError(f"{weights}: {name} has only one of lora_A / lora_B")
        ia, ib = f.info(ka), f.info(kb)
        experts = entries[0].sizes[next(p.axis for p in base.spec.peft_params if name.endswith("." + p.name))]
        out = sum(ParamLora.expert_shape(e)[0] for e in entries)
        inp = ParamLora.expert_shape(entries[0])[1]
        rank = ia.shape[0] // experts if len(ia.shape) == 2 else 0
        if rank < 1 or ia.shape != (experts * rank, inp) or ib.shape != (out, experts * rank):
            raise MismatchError(
                f"{weights}: {name} lora_A {ia.shape} / lora_B {ib.shape} do not fit the base {base.path} "
                f"({experts} experts of ({out}, {inp}): expected ({experts} r, {inp}) / ({out}, r {experts})); "
                "wrong --base?")
        r_m = _pattern_value(rank_pattern, name, r)
        if int(r_m) != rank:
            raise MismatchError(
                f"{weights}: {name} has rank {rank} but {ADAPTER_CONFIG} gives it r={r_m}; the config and weights disagree")
        params[name] = ParamLora(name, (ka, kb), entries, experts,
                                 Scaling(rank, float(_pattern_value(alpha_pattern, name, alpha)),
                                         bool(cfg.get("use_rslora"))))
    return PeftLora(src, f, base, cfg, ordered, {k: scaling[k] for k in ordered}, vllm_repeats, params)


def _param_entries(base: Base) -> dict[str, tuple[mapping.Entry, ...]]:
    """The base's PEFT-targetable parameters (``FamilySpec.peft_params``), by their transformers
    name (``model.layers.0.mlp.experts.gate_up_proj``) -> their rows in order."""
    by_layer_rule = {(e.layer.index, e.rule.name): e for e in mapping.entries(base.cfg, base.spec, base.prefix)
                     if e.layer is not None}
    out = {}
    for layer in base.cfg.layers:
        for param in base.spec.peft_params:
            rows = tuple(by_layer_rule.get((layer.index, n)) for n in param.rows)
            if None not in rows:
                out[f"{base.module_prefix}layers.{layer.index}.{param.name}"] = rows
    return out


def _param_modules(base: Base, cfg: dict) -> dict[str, str]:
    """PEFT module names of target_parameters factors -> the parameter they belong to. PEFT wraps
    a module once per targeted parameter, in the module's parameter order (the order of the
    spec's ``peft_params``), the first innermost: with two, the first's factors are under
    ``<module>.base_layer``, the second's under ``<module>``."""
    targets = cfg.get("target_parameters") or []
    if not isinstance(targets, list):
        return {}
    order = [p.name for p in base.spec.peft_params]
    by_module: dict[str, list[str]] = {}
    for name in _param_entries(base):
        if any(name == t or name.endswith("." + t) for t in targets):
            by_module.setdefault(name.rsplit(".", 1)[0], []).append(name)
    out = {}
    for module, names in by_module.items():
        names.sort(key=lambda n: next(i for i, p in enumerate(order) if n.endswith("." + p)))
        for depth, name in enumerate(reversed(names)):
            out[module + ".base_layer" * depth] = name
    return out


def open_adapter(src: str, base: Base, *, step: int | None = None, alpha: float | None = None):
    """A PEFT adapter directory or a Tunix/qwix Orbax LoRA checkpoint (local or on Cloud Storage)."""
    from ckptbridge.io import storage

    if storage.is_remote(src):
        return open_orbax_lora(src, base, step=step, alpha=alpha)
    if not os.path.exists(src):
        raise InputNotFoundError(f"{src}: no such adapter directory")
    if os.path.isfile(os.path.join(src, ADAPTER_CONFIG)):
        if alpha is not None or step is not None:
            raise ConfigError(f"{src}: --alpha/--step apply to Orbax LoRA checkpoints; a PEFT adapter records its own")
        return open_peft_lora(src, base)
    return open_orbax_lora(src, base, step=step, alpha=alpha)


def hf_deltas(adapter) -> Iterable[tuple[str, int, float, tuple[np.ndarray, np.ndarray]]]:
    """(HF key, first row, scale, (lora_A, lora_B)) for every LoRA delta of an adapter of either
    kind, in PEFT layout: ``scale * B @ A`` adds to rows ``first row :`` ``+ len(B)`` of the key's
    tensor seen as a matrix ``(prod(shape[:-1]), shape[-1])``. For an Orbax checkpoint each
    module is read and converted when reached."""
    if isinstance(adapter, PeftLora):
        for module in adapter.keys:
            yield adapter.base.weight_key(module), 0, adapter.scaling[module].scale, adapter.pair(module)
        for param in adapter.params.values():
            for key, row, pair in param.expert_deltas(adapter.file):
                yield key, row, param.scaling.scale, pair
    else:
        for mod, sc in adapter.scaling.items():
            for name, pair in zip(mod.hf_modules, tunix_to_peft(mod, *adapter.factors(mod))):
                yield adapter.base.weight_key(name), 0, sc.scale, pair
