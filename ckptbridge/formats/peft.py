"""PEFT's LoRA format: ``adapter_config.json`` (one typed config, read once and written once),
``adapter_model.safetensors`` (factor names), the modules a config selects, a PEFT adapter
validated against its base, and any adapter written as one (for transformers + PEFT, or for
vLLM: ``target="vllm"``).

What ckptbridge knows of vLLM's LoRA support (vLLM 0.32), for adapters written for it and for
``verify adapter --target vllm``:

* vLLM accepts ``--max-lora-rank`` only from a fixed list and defaults to 16
  (``vllm/config/lora.py``); an adapter above the limit fails to load.
* vLLM applies LoRA per HF module with its own slots; where transformers computes a module from
  another's output (V computed from K's projection), the export repeats the factors under
  the module's name: the family spec declares these as ``vllm_lora_aliases``.
* vLLM 0.32 honours ``rank_pattern`` / ``alpha_pattern`` (measured); exports still make rank and
  alpha uniform, which every release reads.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ckptbridge import mapping, model_card, options, specs
from ckptbridge.errors import CorruptFileError, InputNotFoundError, MismatchError, UnsupportedError
from ckptbridge.io import storage
from ckptbridge.io.atomic import atomic_directory
from ckptbridge.io.files import close_on_error, read_json_object
from ckptbridge.io.hf import check_inside
from ckptbridge.io.safetensors import PlannedTensor, SafetensorsFile, numpy_dtype, write_file
from ckptbridge.lora.base import Base
from ckptbridge.lora.factors import AdapterRows
from ckptbridge.lora.modules import Scaling, plain_number
from ckptbridge.lora.select import module_regex
from ckptbridge.metadata import KEY, Metadata
from ckptbridge.options import TARGETS
from ckptbridge.progress import Progress
from ckptbridge.report import Report, human_bytes
from ckptbridge.rows import Request
from ckptbridge.stream import Parts

NAME = "peft"
PEFT_PREFIX = "base_model.model."
DEFAULT_MAX_LORA_RANK = 16  # vLLM's --max-lora-rank default
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the --max-lora-rank values vLLM accepts


def next_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that fits ``rank``."""
    return next((r for r in LORA_RANKS if r >= rank), rank)

ADAPTER_CONFIG = "adapter_config.json"
# Beside an adapter trained on a quantized base (QLoRA): how the run held the base. PEFT warns on
# keys of adapter_config.json it does not know, so the record is a file of its own (and a copy in
# the weights' header, which PEFT and vLLM do not read).
BASE_QUANT_FILE = "base_quant.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# a LoRA factor's key after PEFT_PREFIX: <module>.lora_A[.<adapter name>].weight
FACTOR_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")


def factor_key(module: str, ab: str) -> str:
    """The key of a factor (``"A"`` or ``"B"``) of ``module`` in adapter_model.safetensors."""
    return f"{PEFT_PREFIX}{module}.lora_{ab}.weight"


def parse_factor_key(key: str) -> tuple[str, str] | None:
    """(module, "A" | "B") of a key of the default adapter, or None for any other tensor."""
    m = FACTOR_KEY.match(key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else "")
    if not m or m.group("adapter") not in (None, "default"):
        return None
    return m.group("module"), m.group("ab")


def pattern_value(patterns: dict, module: str, default: Any) -> Any:
    """PEFT's rank_pattern/alpha_pattern lookup: first key matching the end of the module name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    """``adapter_config.json`` of a PEFT LoRA adapter. Read: each field holds what the file says
    (None where it says nothing; values are checked by :meth:`check` or reported by the lint);
    written: :meth:`to_json` gives the fields in this order, then ``extra`` (other keys, as read)."""

    peft_type: str | None = "LORA"
    task_type: str | None = "CAUSAL_LM"
    base_model_name_or_path: str | None = None
    r: Any = None
    lora_alpha: Any = None
    target_modules: str | list[str] | None = None
    rank_pattern: dict = dataclasses.field(default_factory=dict)
    alpha_pattern: dict = dataclasses.field(default_factory=dict)
    lora_dropout: float = 0.0
    bias: str | None = "none"
    use_rslora: bool = False
    use_dora: bool = False
    fan_in_fan_out: bool = False
    init_lora_weights: Any = True
    inference_mode: bool = True
    modules_to_save: list[str] | None = None
    layers_to_transform: int | list[int] | None = None
    layers_pattern: str | list[str] | None = None
    lora_bias: bool = False
    revision: str | None = None
    # written only when set
    target_parameters: list[str] | None = None
    exclude_modules: str | list[str] | None = None
    extra: dict = dataclasses.field(default_factory=dict)

    _OPTIONAL = ("target_parameters", "exclude_modules")

    @classmethod
    def from_json(cls, obj: dict, where: str) -> AdapterConfig:
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        values = {k: v for k, v in obj.items() if k in names}
        for field in ("rank_pattern", "alpha_pattern"):
            if values.get(field) is None:
                values[field] = {}
            elif not isinstance(values[field], dict):
                raise CorruptFileError(f"{where}: {field} must be a JSON object, found {values[field]!r}")
        missing = {"peft_type": None, "task_type": None, "bias": None, "lora_dropout": 0.0, "use_rslora": False,
                   "use_dora": False, "lora_bias": False}
        for field, default in missing.items():
            values.setdefault(field, default)
        return cls(**values, extra={k: v for k, v in obj.items() if k not in names})

    @classmethod
    def read(cls, directory: str) -> AdapterConfig:
        """The adapter config of a PEFT adapter directory."""
        path = os.path.join(directory, ADAPTER_CONFIG)
        if not os.path.isfile(path):
            raise InputNotFoundError(f"{directory}: no {ADAPTER_CONFIG}; not a PEFT adapter directory")
        check_inside(directory, path)
        return cls.from_json(read_json_object(path, "restore the adapter's config"), path)

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        for field in self._OPTIONAL:
            if out[field] is None:
                del out[field]
        return {**out, **self.extra}

    def write(self, directory: str) -> None:
        with open(os.path.join(directory, ADAPTER_CONFIG), "w") as f:
            json.dump(self.to_json(), f, indent=2)
            f.write("\n")

    def get(self, name: str, default: Any = None) -> Any:
        """A field or, for keys ckptbridge has no field for, the value the file gives."""
        if name in {f.name for f in dataclasses.fields(self)}:
            return getattr(self, name)
        return self.extra.get(name, default)

    def rank_of(self, module: str) -> Any:
        return pattern_value(self.rank_pattern, module, self.r)

    def alpha_of(self, module: str) -> Any:
        return pattern_value(self.alpha_pattern, module, self.lora_alpha)

    def scaling(self, module: str, rank: int) -> Scaling:
        return Scaling(rank, float(self.alpha_of(module)), bool(self.use_rslora))

    def number_problems(self) -> list[str]:
        """What is wrong with r / lora_alpha (each must be a positive number)."""
        return [f"{field} must be a positive number, found {v!r}"
                for field, v in (("r", self.r), ("lora_alpha", self.lora_alpha))
                if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0]

    def check_convertible(self, where: str) -> None:
        """Raise for what a qwix LoRA (and so a conversion) cannot carry."""
        if self.peft_type != "LORA":
            raise UnsupportedError(f"{where}: peft_type {self.peft_type!r}; only LORA adapters are supported")
        if self.use_dora:
            raise UnsupportedError(f"{where}: DoRA (use_dora) has no qwix/Tunix equivalent; train a plain LoRA adapter")
        if self.modules_to_save:
            raise UnsupportedError(
                f"{where}: modules_to_save {self.modules_to_save} trains whole modules, which a LoRA checkpoint "
                "cannot carry; merge the adapter instead or retrain without modules_to_save"
            )
        if self.lora_bias or self.bias not in (None, "none"):
            raise UnsupportedError(f"{where}: LoRA biases (bias / lora_bias) are not supported")
        if self.get("layer_replication") or self.get("trainable_token_indices"):
            raise UnsupportedError(f"{where}: layer_replication / trainable_token_indices are not supported")
        problems = self.number_problems()
        if problems:
            raise CorruptFileError(f"{where}: {problems[0]}")

    def selects(self, module: str) -> bool:
        """Whether PEFT wraps ``module`` (a name of the base model's modules) under this config:
        ``target_modules`` (a regex full-matched, or names matched as the name or its last parts),
        ``exclude_modules``, ``modules_to_save`` and ``layers_to_transform`` as PEFT 0.21's
        ``check_target_module_exists`` applies them (tests compare the two)."""
        exclude = self.exclude_modules
        if exclude:
            if isinstance(exclude, str):
                if re.fullmatch(exclude, module):
                    return False
            elif module in exclude or any(module.endswith(f".{e}") for e in exclude):
                return False
        if any(re.match(rf"(^|.*\.){m}($|\..*)", module) for m in self.modules_to_save or ()):
            return False
        targets = self.target_modules
        if targets is None:
            return False
        if isinstance(targets, str):
            return re.fullmatch(targets, module) is not None
        if module in targets:
            return True
        if not any(module.endswith(f".{t}") for t in targets):
            return False
        layers = self.layers_to_transform
        if layers is None or (isinstance(layers, list) and not layers):
            return True
        patterns = self.layers_pattern
        if not patterns:
            m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
        else:
            m = None
            for pattern in [patterns] if isinstance(patterns, str) else patterns:
                m = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", module)
                if m:
                    break
        if not m:
            return False
        idx = int(m.group("idx"))
        return idx == layers if isinstance(layers, int) else idx in layers


def target_modules_regex(names: Iterable[str], base: Base) -> str:
    """A regex that PEFT full-matches against exactly the text-model modules in ``names``: layer
    modules grouped by their name inside the layer (``\\d+`` when present in every layer), model
    modules by name."""
    all_layers = {str(layer.index) for layer in base.cfg.layers}
    return module_regex(names, head=base.module_prefix + "layers", sep=".", layers_of=lambda rest: all_layers)


def export_config(base: Base, names: list[str], r: int, alpha: float, rank_pattern: dict, alpha_pattern: dict,
                  dropout: float = 0.0, base_id: str | None = None) -> AdapterConfig:
    """The config of an adapter ckptbridge writes for ``base`` with LoRA on the HF modules ``names``."""
    return AdapterConfig(base_model_name_or_path=base_id or os.path.abspath(base.path), r=r,
                         lora_alpha=plain_number(alpha), target_modules=target_modules_regex(names, base),
                         rank_pattern=rank_pattern, alpha_pattern=alpha_pattern, lora_dropout=dropout)


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
        out, inp = entry.hf_shape[-2:]
        return out, inp

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


class PeftLora(AdapterRows):
    """A PEFT LoRA adapter directory, validated against the base."""

    format = NAME

    def __init__(self, path: str, file: SafetensorsFile, base: Base, config: AdapterConfig,
                 keys: dict[str, tuple[str, str]], scaling: dict[str, Scaling], vllm_repeats: int = 0,
                 params: dict[str, ParamLora] | None = None):
        self.path, self.file, self.base, self.config = path, file, base, config
        self.keys = keys  # HF module -> (lora_A key, lora_B key)
        self.scaling = scaling  # HF module -> scaling
        self.vllm_repeats = vllm_repeats  # v_proj copies of k_proj factors (vLLM export) that were dropped
        self.params = params or {}  # target_parameters LoRA

    @property
    def dropout(self) -> float:
        return float(self.config.lora_dropout or 0.0)

    @property
    def base_quant(self) -> dict | None:
        return base_quant_of(self.path, self.file.metadata)

    def names(self) -> list[str]:
        return list(self.keys)

    def scaling_of(self, name: str) -> Scaling:
        return self.scaling[name]

    def dtype_of(self, name: str) -> np.dtype:
        return self.dtype(name)

    def pair(self, hf_module: str) -> tuple[np.ndarray, np.ndarray]:
        ka, kb = self.keys[hf_module]
        return self.file.array(ka), self.file.array(kb)

    def dtype(self, hf_module: str) -> np.dtype:
        return numpy_dtype(self.file.info(self.keys[hf_module][0]).dtype)

    def deltas(self):
        yield from super().deltas()
        for param in self.params.values():
            for key, row, pair in param.expert_deltas(self.file):
                yield key, row, param.scaling.scale, pair

    def close(self) -> None:
        self.file.close()


def base_quant_of(src: str, header: dict) -> dict | None:
    """How adapter directory ``src``'s QLoRA run held its base: ckptbridge's record in the weights'
    ``header`` (their metadata), else :data:`BASE_QUANT_FILE`; None: a plain base."""
    found = Metadata.from_json(header.get(KEY)).base_quant
    if found is None and os.path.isfile(os.path.join(src, BASE_QUANT_FILE)):
        found = read_base_quant(src)
    return found


def read_base_quant(src: str) -> dict:
    """:data:`BASE_QUANT_FILE` of adapter directory ``src``: how its QLoRA run held the base."""
    where = os.path.join(src, BASE_QUANT_FILE)
    record = read_json_object(where, "re-export the adapter with `ckptbridge convert`")
    if not isinstance(record.get("scheme"), str):
        raise CorruptFileError(f"{where}: no quantization scheme (\"scheme\"); re-export the adapter with "
                               "`ckptbridge convert`")
    return record


def open_peft_lora(src: str, base: Base) -> PeftLora:
    """A PEFT LoRA adapter directory, validated against ``base`` (no factor read)."""
    where = os.path.join(src, ADAPTER_CONFIG)
    cfg = AdapterConfig.read(src)
    cfg.check_convertible(where)
    weights = os.path.join(src, ADAPTER_WEIGHTS)
    if not os.path.isfile(weights):
        if os.path.isfile(os.path.join(src, "adapter_model.bin")):
            raise UnsupportedError(
                f"{os.path.join(src, 'adapter_model.bin')}: pickle adapters are never loaded; re-save with "
                "save_pretrained(..., safe_serialization=True)"
            )
        raise InputNotFoundError(f"{src}: no {ADAPTER_WEIGHTS}")
    with close_on_error(SafetensorsFile(check_inside(src, weights))) as f:
        return _validate_peft(src, f, base, cfg)



def _validate_peft(src: str, f: SafetensorsFile, base: Base, cfg: AdapterConfig) -> PeftLora:
    weights = f.path
    known = base.by_hf_module()
    # modules of the adapter may use either key prefix of the family; map them onto the base's
    aliases = base.module_names()
    alias_of = base.vllm_aliases()
    keys: dict[str, list] = {}
    param_keys: dict[str, list] = {}
    param_modules = _param_modules(base, cfg)
    targets = cfg.target_parameters or []
    known_params = [p.name for p in base.spec.peft_params]
    unmatched = [t for t in (targets if isinstance(targets, list) else [targets])
                 if not any(str(t) == p or p.endswith("." + str(t)) or str(t).endswith("." + p) for p in known_params)]
    if unmatched:
        raise UnsupportedError(
            f"{os.path.join(src, ADAPTER_CONFIG)}: target_parameters {unmatched}: "
            + (f"ckptbridge takes parameter LoRA on a {base.spec.name} base only on {known_params}" if known_params
               else f"ckptbridge takes no parameter LoRA on a {base.spec.name} base, only LoRA on modules"))
    for key in f.keys():
        parsed = parse_factor_key(key)
        if parsed is None:
            raise MismatchError(
                f"{weights}: tensor {key!r} is not a PEFT LoRA factor "
                f"({PEFT_PREFIX}<module>.lora_A.weight / .lora_B.weight)"
            )
        name, ab = parsed
        if name in param_modules:
            param_keys.setdefault(param_modules[name], [None, None])["AB".index(ab)] = key
            continue
        module = aliases.get(name)
        if module is None or (module not in known and module not in alias_of):
            raise MismatchError(
                f"{weights}: tensor {key!r} targets {name!r}, which is not a LoRA-able module of the "
                f"{base.spec.name} base {base.path}; the adapter belongs to another model"
            )
        keys.setdefault(module, [None, None])["AB".index(ab)] = key
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
                f"(expected {want_a} / {want_b} at rank {rank}); wrong base (--base)?"
            )
        if ia.dtype != ib.dtype:
            raise MismatchError(f"{weights}: {module} lora_A and lora_B differ in dtype")
        r_m = cfg.rank_of(module)
        if int(r_m) != rank:
            raise MismatchError(
                f"{weights}: {module} has rank {rank} but {ADAPTER_CONFIG} gives it r={r_m}; the config and "
                "weights disagree"
            )
        scaling[module] = cfg.scaling(module, rank)
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
                "wrong base (--base)?")
        r_m = cfg.rank_of(name)
        if int(r_m) != rank:
            raise MismatchError(
                f"{weights}: {name} has rank {rank} but {ADAPTER_CONFIG} gives it r={r_m}; the config and "
                "weights disagree")
        params[name] = ParamLora(name, (ka, kb), entries, experts, cfg.scaling(name, rank))
    return PeftLora(src, f, base, cfg, ordered, {k: scaling[k] for k in ordered}, vllm_repeats, params)


def _param_entries(base: Base) -> dict[str, tuple[mapping.Entry, ...]]:
    """The base's PEFT-targetable parameters (``FamilySpec.peft_params``), by their transformers
    name (``model.layers.0.mlp.experts.gate_up_proj``) -> their rows in order."""
    by_layer_rule = {(e.layer.index, e.rule.name): e for e in mapping.entries(base.cfg, base.spec, base.prefix)
                     if e.layer is not None}
    out = {}
    for layer in base.cfg.layers:
        for param in base.spec.peft_params:
            rows = [by_layer_rule.get((layer.index, n)) for n in param.rows]
            found = tuple(r for r in rows if r is not None)
            if len(found) == len(rows):
                out[f"{base.module_prefix}layers.{layer.index}.{param.name}"] = found
    return out


def _param_modules(base: Base, cfg: AdapterConfig) -> dict[str, str]:
    """PEFT module names of target_parameters factors -> the parameter they belong to. PEFT wraps
    a module once per targeted parameter, in the module's parameter order (the order of the
    spec's ``peft_params``), the first innermost: with two, the first's factors are under
    ``<module>.base_layer``, the second's under ``<module>``."""
    targets = cfg.target_parameters or []
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



def detect(probe) -> bool:
    return probe.has(ADAPTER_CONFIG)


def open_source(src: str, base: Base, **_) -> PeftLora:
    return open_peft_lora(src, base)


# --------------------------------------------------------------------------- writing


@dataclasses.dataclass(frozen=True)
class PeftExportReport(Report):
    """An adapter written as a PEFT adapter."""

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
        text = (f"{self.direction} ({self.target}): {self.source} -> {self.destination}\n"
                f"  {self.modules} modules, r={self.r}, lora_alpha={self.lora_alpha}, {human_bytes(self.bytes)} "
                f"in {self.seconds:.2f} s")
        return text + "".join(f"\n  warning: {w}" for w in self.warnings)


def padded(a: np.ndarray, b: np.ndarray, sc: Scaling, pad_to: int | None,
           fold_scale: float | None) -> tuple[np.ndarray, np.ndarray]:
    """A PEFT pair padded to rank ``pad_to`` with its scale folded into B as ``fold_scale`` (vLLM
    and MaxText take one rank and alpha), or as it is."""
    if pad_to is None or fold_scale is None or (sc.rank >= pad_to and sc.scale == fold_scale):
        return a, b
    dtype = a.dtype
    a = np.concatenate([a, np.zeros((pad_to - sc.rank, a.shape[1]), dtype)])
    scaled = b.astype(np.float32) * np.float32(sc.scale / fold_scale)
    return a, np.concatenate([scaled.astype(dtype), np.zeros((b.shape[0], pad_to - sc.rank), dtype)], axis=1)


def _peft_parts(read, by_source: dict, pad_to: int | None, fold_scale: float | None) -> list[tuple[str, np.ndarray]]:
    """The PEFT factors of a batch, under every name they are written as."""
    parts = []
    for source_name, (a0, b0) in read().items():
        for name, sc in by_source[source_name]:
            a, b_ = padded(a0, b0, sc, pad_to, fold_scale)
            parts += [(factor_key(name, "A"), a), (factor_key(name, "B"), b_)]
    return parts


def _modules_to_save(b: Base, full: dict, lora: set[str]) -> dict:
    """``full`` keyed as PEFT saves ``modules_to_save`` weights (``base_model.model.<module>.weight``,
    with the module names transformers gives); a module that also has LoRA factors is refused."""
    out = {}
    for key, value in full.items():
        if b.module_prefix != b.prefix and key.startswith(b.prefix):
            key = b.module_prefix + key[len(b.prefix):]
        module = key.rsplit(".", 1)[0]
        if module in lora:
            raise UnsupportedError(f"{key}: differs and its module {module} has LoRA factors; PEFT cannot save a "
                                   "module whole and as LoRA: leave it out of --modules, or drop --keep-full")
        out[PEFT_PREFIX + key] = value
    return out


def write(ad: AdapterRows, dst: str, req: Request, *, target: str = "hf",
          base_id: str | None = None, full: dict[str, tuple[np.dtype, tuple[int, ...], Callable[[], np.ndarray]]]
          | None = None) -> PeftExportReport:
    """Write ``ad`` as a PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors`` + a
    model card ``README.md``). ``target="vllm"`` also writes, on k_eq_v layers, the k_proj factors
    as v_proj (vLLM applies V's LoRA separately) and makes rank/alpha uniform (vLLM ignores
    rank/alpha patterns). ``base_id`` is the base's Hub id for the adapter config and model card
    (default: found from a Hub cache path or the base's config; else the base's local path is
    recorded). Factors are read and converted in batches on the engine's workers ahead of the
    writer. ``full``: whole tensors kept beside the factors (PEFT's ``modules_to_save``), by the
    key of the base's files: (dtype, shape, a read of the values)."""
    import logging

    from ckptbridge.formats.tunix_lora import no_expert_lora

    log = logging.getLogger(__name__)
    options.choice("target", target, TARGETS)
    model_card.check_repo_id("base_id", base_id)
    b = ad.base
    base_id = model_card.hub_id(b.path, base_id)
    mismatch = specs.note_mismatch(b.cfg)
    no_expert_lora(ad, "ckptbridge writes PEFT adapters of LoRA on modules")
    warnings: list[str] = []
    modules = b.by_hf_module()
    # every HF module that gets factors: (name written, name read, scaling)
    plan: list[tuple[str, str, Scaling]] = []
    for name in ad.names():
        sc = ad.scaling_of(name)
        plan.append((name, name, sc))
        mod, i = modules[name]
        if target == "vllm" and i == 0:
            plan += [(alias, name, sc) for alias in mod.vllm_aliases]
    counts = Counter((sc.rank, sc.alpha) for _, _, sc in plan)
    (r, alpha_default), _ = counts.most_common(1)[0]
    max_rank = max(sc.rank for _, _, sc in plan)
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
        for name, _, sc in plan:
            if sc.rank != r:
                rank_pattern[re.escape(name)] = sc.rank
            if sc.alpha != alpha_default:
                alpha_pattern[re.escape(name)] = plain_number(sc.alpha)
    if target == "vllm" and max_rank > DEFAULT_MAX_LORA_RANK:
        warnings.append(
            f"rank {max_rank} exceeds vLLM's default --max-lora-rank {DEFAULT_MAX_LORA_RANK}: "
            f"serve with --max-lora-rank {next_rank(max_rank)}"
        )
    for w in warnings:
        log.warning(w)
    by_source: dict[str, list[tuple[str, Scaling]]] = {}
    for name, source_name, sc in plan:
        by_source.setdefault(source_name, []).append((name, sc))
    parts = Parts(req.engine.stream((nbytes, functools.partial(_peft_parts, read, by_source, pad_to, fold_scale))
                                    for nbytes, read in ad.reads()))
    tensors = []
    for name, source_name, sc in plan:
        shapes = modules[source_name][0].shapes(pad_to or sc.rank)
        for which, shape in (("A", shapes["a_peft"]), ("B", shapes["b_peft"])):
            key = factor_key(name, which)
            tensors.append(PlannedTensor(key, ad.dtype_of(source_name), shape, functools.partial(parts.take, key)))
    names = [name for name, _, _ in plan]
    config = export_config(b, names, r, alpha_default, rank_pattern, alpha_pattern, ad.dropout, base_id)
    if full:
        saved = _modules_to_save(b, full, set(names))
        tensors += [PlannedTensor(key, dtype, shape, read) for key, (dtype, shape, read) in saved.items()]
        config = dataclasses.replace(config, modules_to_save=sorted({k[len(PEFT_PREFIX):].rsplit(".", 1)[0]
                                                                    for k in saved}))
    quant = ad.base_quant
    card = model_card.adapter_card(
        base_id=base_id, base_path=b.path, source=storage.absolute(ad.path), step=ad.step,
        rank=r, alpha=alpha_default, patterns=len(set(rank_pattern) | set(alpha_pattern)),
        target_modules=sorted({n.rsplit(".", 1)[-1] for n in names}), target=target, family=b.spec.name,
        peft_version=model_card.installed_version("peft"), base_quant=quant)
    meta = {KEY: json.dumps(Metadata(family=b.spec.name, target=target, source=storage.absolute(ad.path),
                                     base=os.path.abspath(b.path), base_quant=quant).to_json())}
    total = sum(t.nbytes for t in tensors)
    bar = Progress(total, req.desc, enabled=req.progress)
    with atomic_directory(dst, req.overwrite) as tmp:
        os.makedirs(tmp)
        write_file(os.path.join(tmp, ADAPTER_WEIGHTS), tensors, meta, on_tensor=lambda t: bar.update(t.nbytes))
        config.write(tmp)
        with open(os.path.join(tmp, model_card.FILENAME), "w") as f:
            f.write(card)
        if quant:
            with open(os.path.join(tmp, BASE_QUANT_FILE), "w") as f:
                json.dump(quant, f, indent=2)
                f.write("\n")
    bar.close()
    return PeftExportReport(
        direction=req.direction, source=ad.path, destination=dst, family=b.spec.name, key_prefix=b.prefix,
        target=target, config_mismatch=mismatch, modules=len(plan), tensors=len(tensors), bytes=total, r=r,
        lora_alpha=plain_number(alpha_default), rank_pattern=rank_pattern, alpha_pattern=alpha_pattern,
        warnings=warnings, seconds=round(time.perf_counter() - req.t0, 3))
